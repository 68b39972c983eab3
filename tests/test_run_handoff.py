"""``resilient run`` learns the directory its program's Session actually uses (issue 44): the
ledger always exists, progress is judged there, 93 always bounds, and start-up is recorded.

Real ``resilient run``, a real Session program (``tests/mpi/own_dir.py``: its own directory,
not ``$RESILIENT_CHECKPOINT_DIR``), real signals; no wall-clock assertions.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.job.handoff import task_dir
from resilient.job.ledger import read_ledger
from tests.mpirun import REPO, clean_env, mpiexec

pytestmark = [pytest.mark.timeout(300)]

PROGRAM = str(REPO / "tests" / "mpi" / "own_dir.py")
WALL = ["--walltime", "5", "--signal", "USR1@1", "--kill-wait", "0.5"]  # a start-up fits, loaded
RUN = ["--steps", "60", "--delay", "0.1"]  # 6 s of steps: stopped at least once
ARRAY_RETRY = {"SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1"}


def run(
    tmp: Path, args: list[str], program: list[str], **env: str
) -> subprocess.CompletedProcess[str]:
    """``resilient run ARGS -- PROGRAM`` in ``tmp``, its state directory there too."""
    full = [sys.executable, "-m", "resilient.cli", "run", *args, "--", *program]
    return subprocess.run(
        full, cwd=tmp, env=clean_env(RESILIENT_STATE_DIR=str(tmp / "state"), **env),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def own_ledger(tmp: Path, program: list[str]) -> list[dict[str, object]]:
    """The ledger kept in the task's own directory (before the program named its own)."""
    env = {"RESILIENT_STATE_DIR": str(tmp / "state")}
    return read_ledger(task_dir(env, cwd=str(tmp), command=program, task=None))


def test_without_checkpoint_dir_a_progressing_program_finishes(tmp_path: Path) -> None:
    """Numbered attempts, judged on the program's own directory, start-up in each line; a
    walltime shorter than six start-ups is said once."""
    ckpt = tmp_path / "mine"
    program = [sys.executable, PROGRAM, str(ckpt), *RUN, "--startup", "1"]
    proc = run(tmp_path, [*WALL, "--requeue"], program)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "out.txt").read_text() == "60 60.0\n"
    ledger = read_ledger(ckpt)  # in the program's directory, where `resilient report` looks
    assert [r["attempt"] for r in ledger] == list(range(1, len(ledger) + 1)) and len(ledger) >= 2
    assert [r["exit_code"] for r in ledger] == [75] * (len(ledger) - 1) + [0]
    assert all(r["progress"] and r["program_dir"] == str(ckpt) for r in ledger), ledger
    startups = [r["startup_s"] for r in ledger]
    assert all(isinstance(s, float) and s >= 1.0 for s in startups), startups
    assert ledger[1]["latest_before"] == ledger[0]["latest_after"] is not None
    assert proc.stderr.count("start-up (launch to the first step) took") == 1
    assert not own_ledger(tmp_path, program)  # moved to the program's directory


def test_without_checkpoint_dir_a_program_stuck_in_its_start_up_ends_in_93(
    tmp_path: Path,
) -> None:
    """A Session that never reaches its first step: each attempt says so with its start-up
    and the walltime, 93 after --max-no-progress, and an engine's retry of the same task
    (a separate invocation) finds the ledger and is refused."""
    ckpt = tmp_path / "mine"
    program = [sys.executable, PROGRAM, str(ckpt), "--stall", "60"]
    proc = run(tmp_path, [*WALL, "--requeue"], program)
    assert proc.returncode == 93, proc.stderr[-3000:]
    ledger = read_ledger(ckpt)
    assert [r["attempt"] for r in ledger] == [1, 2]
    assert all(r["startup_s"] is None and not r["progress"] for r in ledger)
    assert all(
        str(r["reason"]).startswith("ended before its first step: start-up took over ")
        and "of the 5 s walltime" in str(r["reason"])
        for r in ledger
    ), ledger
    assert "no progress in 2 consecutive attempts" in str(ledger[1]["reason"])
    assert proc.stderr.count("did not reach its first step within its 5 s walltime") == 1
    retry = run(tmp_path, [*WALL, "--requeue"], program, **ARRAY_RETRY)
    assert retry.returncode == 93 and "not starting again for this retry" in retry.stderr
    assert len(read_ledger(ckpt)) == 2


def test_without_checkpoint_dir_a_program_that_never_reaches_its_session_ends_in_93(
    tmp_path: Path,
) -> None:
    """Before any Session: the ledger is the task's own, and still bounds the requeues."""
    program = [sys.executable, PROGRAM, str(tmp_path / "mine"), "--startup", "60"]
    proc = run(tmp_path, [*WALL, "--requeue"], program)
    assert proc.returncode == 93, proc.stderr[-3000:]
    ledger = own_ledger(tmp_path, program)
    assert [r["attempt"] for r in ledger] == [1, 2]
    assert all(str(r["reason"]).startswith("ended before a first step was recorded") for r in ledger)
    retry = run(tmp_path, WALL, program, **ARRAY_RETRY)
    assert retry.returncode == 93 and len(own_ledger(tmp_path, program)) == 2


def test_another_checkpoint_dir_is_named_once_and_progress_is_the_programs(
    tmp_path: Path,
) -> None:
    given, mine = tmp_path / "given", tmp_path / "mine"
    program = [sys.executable, PROGRAM, str(mine), *RUN]
    proc = run(tmp_path, ["--checkpoint-dir", str(given), *WALL, "--requeue"], program)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "not in the --checkpoint-dir" in line]
    assert len(warned) == 1 and str(mine) in warned[0] and str(given) in warned[0], warned
    assert f"--checkpoint-dir {mine}" in warned[0]  # the fix
    ledger = read_ledger(given)  # the ledger stays where it was asked for
    assert len(ledger) >= 2 and all(r["progress"] for r in ledger), ledger
    assert ledger[-1]["latest_after"] == 60 and ledger[-1]["program_dir"] == str(mine)


@pytest.mark.mpi
def test_a_program_without_any_directory_ends_the_task_with_78(tmp_path: Path) -> None:
    """No checkpoint_dir, no $RESILIENT_CHECKPOINT_DIR, no --checkpoint-dir: rank 0 says so once, no
    traceback, every rank exits; `resilient run` ends with 78 and the fix, in the ledger."""
    program = [mpiexec(), "-n", "2", sys.executable, PROGRAM, "-", "--mpi"]
    proc = run(tmp_path, ["--walltime", "30"], program)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("no checkpoint directory given") == 1  # rank 0's line
    (line,) = own_ledger(tmp_path, program)
    assert line["exit_code"] == 78 and "--checkpoint-dir DIR" in str(line["reason"])
    retry = run(tmp_path, ["--walltime", "30"], program, **ARRAY_RETRY)
    assert retry.returncode == 78 and "Not starting the program again" in retry.stderr


def test_a_relative_checkpoint_dir_that_the_session_takes_is_the_same_directory(
    tmp_path: Path,
) -> None:
    """The Session names its directory absolute; `--checkpoint-dir ck` is the same one: no
    warning, and each attempt's newest step before is the last one's after."""
    program = [sys.executable, PROGRAM, "-", *RUN]  # Session() takes $RESILIENT_CHECKPOINT_DIR
    proc = run(tmp_path, ["--checkpoint-dir", "ck", *WALL, "--requeue"], program)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not in the --checkpoint-dir" not in proc.stderr
    ledger = read_ledger(tmp_path / "ck")
    assert len(ledger) >= 2 and all(r["progress"] for r in ledger)
    for before, after in itertools.pairwise(ledger):
        assert after["latest_before"] == before["latest_after"] is not None, ledger
    assert ledger[0]["program_dir"] == str(tmp_path / "ck")
