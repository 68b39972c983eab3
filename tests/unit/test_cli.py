"""The `resilient` command: ls, status --json, latest, verify, prune; exit codes; no MPI;
ls and status over a workflow's tree of task roots; a closed pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from resilient import CheckpointManager
from tests.unit.ckutil import flip_dataset_byte

CLI = [sys.executable, "-m", "resilient.cli"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ck"
    with CheckpointManager(r) as m:
        for step in (10, 20, 30):
            m.save(step, {"u": np.arange(1000.0) * step}, metrics={"loss": 1.0 / step})
    return r


def test_ls_and_status_json(root: Path) -> None:
    ls = cli("ls", str(root))
    assert ls.returncode == 0
    lines = ls.stdout.splitlines()
    assert lines[0].split()[:3] == ["step", "tier", "time"] and len(lines) == 4
    assert all("valid" in line and "self" in line for line in lines[1:])
    st = cli("status", str(root), "--json")
    doc = json.loads(st.stdout)
    assert doc["latest_step"] == 30 and doc["latest_path"] == str(root / "step_00000030")
    assert [c["step"] for c in doc["checkpoints"]] == [10, 20, 30]
    first = doc["checkpoints"][0]
    assert first["status"] == "valid" and first["nranks"] == 1 and first["layout"] == "self"
    assert first["bytes"] > 8000


def test_latest_verify_and_quarantine_visible(root: Path) -> None:
    assert cli("latest", str(root)).stdout.strip() == str(root / "step_00000030")
    assert cli("latest", str(root), "--step").stdout.strip() == "30"
    assert cli("verify", str(root), "--full").returncode == 0
    flip_dataset_byte(root / "step_00000030")
    quick = cli("verify", str(root), "30")  # sizes still match: quick check passes
    assert quick.returncode == 0
    full = cli("verify", str(root), "30", "--full")
    assert full.returncode == 1 and "checksum mismatch" in full.stdout
    assert cli("verify", str(root), "--full").returncode == 1
    assert cli("latest", str(root), "--full").stdout.strip() == str(root / "step_00000020")
    # a restore quarantines it; ls and status show that
    with CheckpointManager(root) as m:
        assert m.restore()[0] == 20
    doc = json.loads(cli("status", str(root), "--json").stdout)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [
        (10, "valid"), (20, "valid"), (30, "quarantined"),
    ]  # fmt: skip
    assert "quarantined (rank 0: checksum mismatch" in cli("ls", str(root)).stdout


def test_prune(root: Path) -> None:
    dry = cli("prune", str(root), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.count("would delete") == 2
    assert len(list(root.glob("step_*"))) == 3
    done = cli("prune", str(root), "--keep-last", "1")
    assert done.returncode == 0
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000030"]
    with CheckpointManager(root):  # a running job holds the lock: prune refuses
        locked = cli("prune", str(root), "--keep-last", "1")
    assert locked.returncode == 3 and "in use by another job" in locked.stderr


def test_prune_collects_static_data_like_the_manager(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, {"u": np.zeros(3)}, static={"mesh": np.arange(4.0)})
        m.save(2, {"u": np.ones(3)}, static={"mesh": np.arange(5.0)})
        m.save(3, {"u": np.ones(3)}, static={"mesh": np.arange(5.0)})
    assert len(list((root / "static").iterdir())) == 4  # two contents, two copies each
    assert cli("prune", str(root), "--keep-last", "1").returncode == 0
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003"]
    (kept, copy) = sorted((root / "static").iterdir())  # step 1's mesh went with step 1
    assert copy.name == f"{kept.name}.copy"
    with CheckpointManager(root) as m:
        step, state = m.restore()
    assert step == 3 and state["mesh"].tolist() == list(np.arange(5.0))
    assert cli("verify", str(root), "--full").returncode == 0
    assert kept.is_dir()


def test_errors_are_one_line_with_documented_codes(tmp_path: Path) -> None:
    missing = cli("ls", str(tmp_path / "nope"))
    assert (
        missing.returncode == 2
        and missing.stderr.strip() == f"resilient: {tmp_path / 'nope'}: no such directory"
    )
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.txt").write_text("x")
    foreign = cli("status", str(tmp_path / "foreign"), "--json")
    assert foreign.returncode == 2 and "not a resilient checkpoint root" in foreign.stderr
    assert len(foreign.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    with CheckpointManager(empty):
        pass
    none = cli("latest", str(empty))
    assert none.returncode == 1 and "no valid checkpoint" in none.stderr
    assert cli("prune", str(empty), "--keep-last", "0").returncode == 2


def test_cli_never_imports_mpi4py_or_h5py(root: Path) -> None:
    code = (
        "import sys, runpy; sys.argv = ['resilient', 'status', sys.argv[1], '--json'];\n"
        "try:\n    runpy.run_module('resilient.cli', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'h5py')]\n"
        "print('IMPORTED', bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True
    )
    assert "IMPORTED []" in out.stdout


def test_cli_works_inside_an_mpi_rank(root: Path) -> None:
    """Called from a rank of mpiexec (PMI environment inherited): must not initialise MPI."""
    from tests.mpirun import run_mpi

    code = (
        "import subprocess, sys; from mpi4py import MPI;"
        f"r = subprocess.run([sys.executable, '-m', 'resilient.cli', 'latest', {str(root)!r}],"
        " capture_output=True, text=True);"
        'print(\'RESULT\', \'{"rank": %d, "rc": %d, "out": "%s"}\' % (MPI.COMM_WORLD.rank, r.returncode,'
        " r.stdout.strip()))"
    )
    proc = run_mpi(2, ["-c", code])
    assert proc.stdout.count(f'"rc": 0, "out": "{root / "step_00000030"}"') == 2, proc.stdout
    assert "PMI" not in proc.stderr and os.path.isdir(root)


# --------------------------------------------------------------------------- a workflow's tree

REPO = Path(__file__).resolve().parents[2]

# A one-process program as a user writes it: a Session (no comm) that checkpoints every 5 steps
# and stops at the simulated walltime's warning signal (saves, exits 75).
LOOP = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from resilient.job.session import Session
    from resilient.model.policies import EverySteps
    total = int(sys.argv[1])
    with Session(margin_s=0.2, save_when=EverySteps(5)) as s:
        step, state = s.restore_or({"x": np.zeros(4)})
        while step < total and not s.should_stop():
            step += 1
            time.sleep(0.02)
            state["x"] += 1
            s.maybe_save(step, state)
    """
)


def run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RESILIENT_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def resilient_run(ckpt: Path, total: int, *options: str) -> int:
    cmd = [*CLI, "run", "--checkpoint-dir", str(ckpt), *options, "--",
           sys.executable, "-c", LOOP, str(total)]  # fmt: skip
    proc = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=120)
    return proc.returncode


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ckpt/``: sim/a finished, sim/b stopped by its walltime (exit 75), train without
    attempts (checkpoints written outside `resilient run`), and a plain directory."""
    base = tmp_path_factory.mktemp("tree") / "ckpt"
    assert resilient_run(base / "sim" / "a-0123456789ab", 20) == 0
    # the warning 5 s into a 10-s walltime (room for a start-up on a loaded machine: a warning
    # before the Session is made kills the program): the loop saves and exits 75 before 10**6
    stopped = resilient_run(base / "sim" / "b-0123456789ab", 10**6, "--walltime", "10",
                            "--signal", "USR1@5")  # fmt: skip
    assert stopped == 75
    with CheckpointManager(base / "train" / "train-0123456789ab") as m:
        m.save(7, {"u": np.zeros(3)})
    (base / "logs").mkdir()
    return base


def test_ls_on_a_tree_lists_its_task_roots(tree: Path) -> None:
    ls = cli("ls", str(tree))
    assert ls.returncode == 0, ls.stderr
    head, *rows = ls.stdout.splitlines()
    assert head.split() == ["task", "step", "attempts", "exit", "last", "attempt"]
    cells = [row.split(maxsplit=4) for row in rows]
    assert [c[0] for c in cells] == ["sim/a-0123456789ab", "sim/b-0123456789ab",
                                     "train/train-0123456789ab"]  # fmt: skip
    assert cells[0][1:] == ["20", "1", "0", "finished"]
    assert int(cells[1][1]) >= 1  # the stop saved a step (on a loaded machine, step 1)
    assert cells[1][2:4] == ["1", "75"]
    assert cells[1][4].startswith("stopped early (checkpointed and exited 75)")
    assert cells[2][1:] == ["7", "0", "-", "-"]


def test_ls_and_report_name_each_task_the_same_way(tree: Path) -> None:
    names = ["sim/a-0123456789ab", "sim/b-0123456789ab", "train/train-0123456789ab"]
    listed = [row.split()[0] for row in cli("ls", str(tree)).stdout.splitlines()[1:]]
    assert listed == names
    doc = json.loads(cli("report", str(tree), "--json").stdout)
    assert [t["name"] for t in doc] == names
    text = cli("report", str(tree)).stdout
    a, b, train = (line for line in text.splitlines() if not line.startswith(" "))
    assert a.startswith("sim/a-0123456789ab: 1 attempts (0 stops, 0 kills), ")
    assert a.endswith(", finished (its last attempt exited 0)")
    assert b.startswith("sim/b-0123456789ab: 1 attempts (1 stops, 0 kills), ")
    assert b.endswith(", NOT finished (its last attempt exited 75)")
    # train's checkpoints were written by a CheckpointManager outside `resilient run`
    assert train == (
        "train/train-0123456789ab: no attempt ledger: the program did not run under `resilient "
        f"run` (run it as `resilient run --checkpoint-dir {tree / 'train' / 'train-0123456789ab'}"
        " -- PROGRAM...` to record its attempts, stops, kills and goodput); 1 checkpoints "
        "written; finished: unknown (no timeline either: the program does not use Session)"
    )
    # one root named itself: its last two path components, as `resilient run` logs it
    (one,) = json.loads(cli("report", str(tree / "sim" / "b-0123456789ab"), "--json").stdout)
    assert one["name"] == "sim/b-0123456789ab" and one["stops"] == 1 and one["kills"] == 0
    assert one["finished"] is False


def test_status_on_a_tree_text_and_json(tree: Path) -> None:
    text = cli("status", str(tree))
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[-1] == (
        f"3 task root(s) under {tree}: 1 finished, 1 unfinished, 1 without attempts"
    )
    st = cli("status", str(tree), "--json")
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert [t["task"] for t in doc] == ["sim/a-0123456789ab", "sim/b-0123456789ab",
                                        "train/train-0123456789ab"]  # fmt: skip
    a, b, train = doc
    assert a["root"] == str(tree / "sim" / "a-0123456789ab") and a["latest_step"] == 20
    assert a["latest_path"] == str(tree / "sim" / "a-0123456789ab" / "step_00000020")
    assert a["attempts"] == 1 and a["last_attempt"]["exit_code"] == 0
    assert a["last_attempt"]["reason"] == "finished" and a["last_attempt"]["attempt"] == 1
    assert a["last_attempt"]["end"] >= a["last_attempt"]["start"]
    assert b["last_attempt"]["exit_code"] == 75 and b["latest_step"] is not None
    assert train["attempts"] == 0 and train["last_attempt"] is None
    assert train["latest_step"] == 7
    # a root inside the tree keeps the single-root output
    one = json.loads(cli("status", str(tree / "sim" / "a-0123456789ab"), "--json").stdout)
    assert one["latest_step"] == 20 and [c["step"] for c in one["checkpoints"]] == [5, 10, 15, 20]


def test_commands_of_one_root_still_refuse_a_tree(tree: Path, tmp_path: Path) -> None:
    latest = cli("latest", str(tree))
    assert latest.returncode == 2 and "not a resilient checkpoint root" in latest.stderr
    (tmp_path / "plain" / "deep").mkdir(parents=True)
    for command in ("ls", "status"):
        none = cli(command, str(tmp_path / "plain"))
        assert none.returncode == 2 and none.stdout == ""
        assert none.stderr == (
            f"resilient: {tmp_path / 'plain'}: not a resilient checkpoint root "
            "(no .resilient-root) and no checkpoint roots below it\n"
        )


@pytest.mark.parametrize("args", [("status", "--json"), ("ls",), ("status",)])
def test_a_closed_pipe_ends_quietly(tree: Path, args: tuple[str, ...]) -> None:
    """The reader is gone before the first write: no traceback, no error line; 141."""
    proc = subprocess.Popen(
        [*CLI, args[0], str(tree), *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # nobody reads: the first write into the pipe fails (EPIPE)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == b""


def test_piped_into_head(tree: Path) -> None:
    line = " ".join([*CLI, "status", str(tree), "--json"])
    proc = subprocess.run(["bash", "-c", f"{line} | head -c 10"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == '[\n {\n  "ta' and proc.stderr == ""
