"""The root lock: one writer per root, released on close and when the holder dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.errors import CheckpointLockedError, ResilientError


def test_second_manager_on_the_same_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    first = CheckpointManager(root)
    try:
        with pytest.raises(CheckpointLockedError) as info:
            CheckpointManager(root)
        msg = str(info.value)
        assert str(root) in msg
        assert f'"pid": {os.getpid()}' in msg
        assert socket.gethostname() in msg
        assert isinstance(info.value, ResilientError)
        holder = json.loads((root / ".lock").read_text())
        assert holder["pid"] == os.getpid()
        # the refused manager did not disturb the holder: it can still save
        first.save(1, {"x": np.arange(3)})
    finally:
        first.close()


def test_after_close_a_new_manager_works(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    first = CheckpointManager(root)
    first.save(1, {"x": np.arange(3)})
    first.close()
    first.close()  # idempotent
    with pytest.raises(ResilientError, match="closed"):
        first.save(2, {"x": np.arange(3)})
    with CheckpointManager(root) as second:
        step, state = second.restore()
        assert step == 1
        np.testing.assert_array_equal(state["x"], np.arange(3))
        with pytest.raises(CheckpointLockedError):
            CheckpointManager(root)
    with CheckpointManager(root) as third:
        assert third.latest_step() == 1


def test_context_manager_releases_the_lock_on_error(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="boom"), CheckpointManager(root):
        raise RuntimeError("boom")
    with CheckpointManager(root) as m:
        assert m.latest_step() is None


def test_refused_manager_leaves_the_root_unlocked_after_holder_closes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    holder = CheckpointManager(root)
    for _ in range(3):
        with pytest.raises(CheckpointLockedError):
            CheckpointManager(root)
    holder.close()
    CheckpointManager(root).close()


CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from resilient import CheckpointManager
    m = CheckpointManager(sys.argv[1])
    m.save(7, {"x": np.arange(5)})
    print("READY", flush=True)
    time.sleep(120)
    """
)


def test_sigkilled_holder_does_not_leave_the_root_locked(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "READY":
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"child did not start: {line!r} {err}")
        # while the child lives, the root is locked, by the child
        with pytest.raises(CheckpointLockedError) as info:
            CheckpointManager(root)
        assert f'"pid": {proc.pid}' in str(info.value)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with CheckpointManager(root) as m:
        step, state = m.restore()
        assert step == 7
        np.testing.assert_array_equal(state["x"], np.arange(5))
        m.save(8, {"x": np.arange(6)})
    holder = json.loads((root / ".lock").read_text())
    assert holder["pid"] == os.getpid()


def test_a_session_records_its_slurm_job_in_the_lock(tmp_path: Path) -> None:
    from resilient import Session

    root = tmp_path / "ck"
    env = {"SLURM_JOB_ID": "4242"}
    locked = pytest.raises(CheckpointLockedError, match='"slurm_job_id": "4242"')
    with Session(root, environ=env, exit_on_stop=False), locked:
        CheckpointManager(root)
    with CheckpointManager(root):  # the library alone reads no Slurm variable
        assert "slurm_job_id" not in json.loads((root / ".lock").read_text())
