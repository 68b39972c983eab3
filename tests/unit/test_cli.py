"""The `resilient` command: ls, status --json, latest, verify, prune; exit codes; no MPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    assert len(list((root / "static").iterdir())) == 2
    assert cli("prune", str(root), "--keep-last", "1").returncode == 0
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003"]
    (kept,) = list((root / "static").iterdir())  # step 1's mesh went with step 1
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
