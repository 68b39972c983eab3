"""A run's identity (``run_key``): a changed parameter never resumes another run's checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resilient import CheckpointManager, Session
from resilient.errors import ConfigError, ForeignRunError
from resilient.job.exitcodes import EXIT_FOREIGN_RUN
from tests.mpirun import REPO, clean_env, mpiexec, results

KEY = {"nx": 64, "alpha": 0.2, "case": "hot"}


def test_the_key_is_recorded_at_the_first_save_and_the_same_key_resumes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root, run_key=KEY):
        pass  # no save: the directory is not claimed
    assert not (root / "run_key.json").exists()
    with CheckpointManager(root, run_key=KEY) as m:
        m.save(1, {"u": np.arange(3.0)})
    assert json.loads((root / "run_key.json").read_text()) == KEY
    with CheckpointManager(root, run_key=dict(reversed(KEY.items()))) as m:  # order is no matter
        step, state = m.restore()
    assert step == 1 and state["u"].tolist() == [0.0, 1.0, 2.0]


def test_another_key_is_refused_before_anything_is_touched(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root, run_key=KEY) as m:
        m.save(1, {"u": np.arange(3.0)})
    leftover = root / ".step_00000002.tmp-0123456789abcdef"
    leftover.mkdir()  # a killed save's temporary directory: cleaned up only by the right run
    other = {**KEY, "alpha": 0.3, "extra": [1, 2]}
    with pytest.raises(ConfigError) as info:
        CheckpointManager(root, run_key=other)
    message = str(info.value)
    assert "belongs to another run" in message
    assert "alpha: 0.2 there, 0.3 now" in message and "extra: absent there, [1, 2] now" in message
    assert "nx" not in message  # only what differs
    assert "delete" in message and "checkpoint directory of their own" in message
    assert leftover.is_dir() and (root / "step_00000001").is_dir()
    with CheckpointManager(root, run_key=KEY) as m:  # the refused manager left no lock behind
        assert m.restore()[0] == 1


def test_a_root_without_a_record_accepts_a_key_and_no_key_accepts_any(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:  # a program that declares no key
        m.save(1, {"u": np.zeros(2)})
    with CheckpointManager(root, run_key=KEY) as m:
        assert m.restore()[0] == 1
        m.save(2, {"u": np.zeros(2)})
    assert json.loads((root / "run_key.json").read_text()) == KEY
    with CheckpointManager(root) as m:  # no key declared: not checked
        assert m.restore()[0] == 2


def test_a_key_must_hold_json_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="JSON values"):
        CheckpointManager(tmp_path / "ck", run_key={"f": float("nan")})
    with pytest.raises(ConfigError, match="string keys"):
        CheckpointManager(tmp_path / "ck", run_key={1: "x"})  # type: ignore[dict-item]


def test_session_passes_the_key(tmp_path: Path) -> None:
    with Session(tmp_path / "ck", run_key=KEY, environ={}) as s:
        _, state = s.restore_or({"u": np.zeros(2)})
        s.manager.save(5, state)
    with pytest.raises(ForeignRunError, match="nx: 64 there, 65 now"):
        Session(tmp_path / "ck", run_key={**KEY, "nx": 65}, environ={}, exit_on_stop=False)
    # a program's Session exits 78 (the exit-code contract), after logging the reason
    with pytest.raises(SystemExit) as info:
        Session(tmp_path / "ck", run_key={**KEY, "nx": 65}, environ={})
    assert info.value.code == EXIT_FOREIGN_RUN == 78
    assert isinstance(info.value.__cause__, ForeignRunError)


def test_session_exits_78_on_a_shape_change(tmp_path: Path) -> None:
    with Session(tmp_path / "ck", environ={}) as s:
        _, state = s.restore_or({"u": np.zeros(2)})
        s.manager.save(5, state)
    with pytest.raises(SystemExit) as info, Session(tmp_path / "ck", environ={}) as s:
        s.restore_or({"u": np.zeros(3)})
    assert info.value.code == EXIT_FOREIGN_RUN
    assert "'u' with shape (2,)" in str(info.value.__cause__)


SCRIPT = """
import json, sys
import numpy as np
from mpi4py import MPI
from resilient import CheckpointManager
from resilient.errors import ConfigError
root, nx = sys.argv[1], int(sys.argv[2])
try:
    with CheckpointManager(root, comm=MPI.COMM_WORLD, run_key={"nx": nx}) as m:
        m.save(1, {"u": np.zeros(nx)})
    out = {"ok": True}
except ConfigError as exc:
    out = {"error": str(exc)}
print("RESULT " + json.dumps({"rank": MPI.COMM_WORLD.rank, **out}), flush=True)
"""


@pytest.mark.mpi
def test_every_rank_raises_the_same_error(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")

    def run(nx: int) -> list[dict[str, object]]:
        proc = subprocess.run(
            [mpiexec(), "-n", "3", sys.executable, "-c", SCRIPT, root, str(nx)],
            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return results(proc)

    assert all(r.get("ok") for r in run(8))
    refused = run(9)
    assert len(refused) == 3 and len({str(r["error"]) for r in refused}) == 1
    assert "nx: 8 there, 9 now" in str(refused[0]["error"])


def test_a_restored_array_of_another_shape_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Session(root, environ={}) as s:
        _, state = s.restore_or({"u": np.zeros((4, 3)), "step": 0})
        s.manager.save(1, state)
    with Session(root, environ={}) as s, pytest.raises(ConfigError) as info:
        s.restore_or({"u": np.zeros((5, 3)), "step": 0})  # --nx 4 -> 5 with the same directory
    message = str(info.value)
    assert "'u'" in message and "(4, 3)" in message and "(5, 3)" in message
    assert "belongs to a run with other parameters" in message
    with Session(root, environ={}) as s, pytest.raises(ConfigError, match="dtype <f4"):
        s.restore_or({"u": np.zeros((4, 3), dtype=np.float32), "step": 0})
    with Session(root, environ={}) as s:  # the same shapes; a callable initial is not compared
        assert s.restore_or({"u": np.ones((4, 3)), "step": 0})[0] == 1
        assert s.restore_or(lambda: {"u": np.zeros((9, 9))})[0] == 1
