"""Asynchronous saves (``save(blocking=False)``): what is saved, when it is committed, errors."""

from __future__ import annotations

import errno
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient.checkpoint.manager import CheckpointManager
from resilient.errors import CollectiveError
from resilient.io import fileio
from resilient.io.checkpoints import latest_valid, list_checkpoints
from resilient.job.exitcodes import EXIT_RESUME
from resilient.job.session import Session
from resilient.model.codec import parse_manifest
from resilient.model.policies import EverySteps, KeepLast
from tests.unit.ckutil import assert_state_equal, state_of


def big_state(step: int) -> dict[str, Any]:
    """Arrays over 1 MiB (the O_DIRECT path) and small ones, plus JSON values."""
    return {
        "field": np.arange(300_000, dtype=np.float64) * step,
        "small": np.full((3, 4), step, dtype=np.int16),
        "scalar": np.array(step * 0.5),
        "empty": np.zeros((0, 7)),
        "meta": {"t": step * 0.1, "hist": [step, step + 1]},
    }


def data_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.h5"))}


class HeldWrites:
    """Makes ``fileio.write_file`` wait for :meth:`release` (a background write held in flight)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        real = fileio.write_file

        def write(path: Path, *args: Any, **kwargs: Any) -> None:
            self.started.set()
            assert self.go.wait(30), "test never released the write"
            real(path, *args, **kwargs)

        monkeypatch.setattr(fileio, "write_file", write)

    def release(self) -> None:
        self.go.set()


def test_async_files_are_bit_identical_to_a_sync_save(tmp_path: Path) -> None:
    state = big_state(3)
    with CheckpointManager(tmp_path / "sync") as m:
        m.save(3, state)
    with CheckpointManager(tmp_path / "async") as m:
        path = m.save(3, state, blocking=False)
        m.wait()
    assert path == tmp_path / "async" / "step_00000003"
    sync_files = data_files(tmp_path / "sync" / "step_00000003")
    assert sync_files and sync_files == data_files(path)
    with CheckpointManager(tmp_path / "async") as m:
        step, got = m.restore()
    assert step == 3
    assert_state_equal(got, state)


def test_state_may_change_as_soon_as_save_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWrites(monkeypatch)
    state = big_state(5)
    expected = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    expected["meta"] = {"t": 0.5, "hist": [5, 6]}
    with CheckpointManager(tmp_path) as m:
        m.save(5, state, blocking=False)
        assert m.in_flight
        state["field"][:] = -1.0  # the program goes on computing
        state["small"] += 7
        state["meta"]["hist"].append(99)
        held.release()
        m.wait()
        assert not m.in_flight
        step, got = m.restore()
    assert step == 5
    assert_state_equal(got, expected)


def test_copy_false_saves_the_callers_arrays(tmp_path: Path) -> None:
    state = big_state(2)
    with CheckpointManager(tmp_path) as m:
        m.save(2, state, blocking=False, copy=False)
        m.wait()
        _, got = m.restore()
    assert_state_equal(got, state)


def test_commit_happens_at_wait_poll_save_restore_and_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWrites(monkeypatch)
    m = CheckpointManager(tmp_path)
    m.save(1, state_of(1), blocking=False)
    assert held.started.wait(10)
    assert latest_valid(tmp_path) is None  # written in the background, not committed
    assert m.poll() is False  # the write is still held: nothing committed
    assert latest_valid(tmp_path) is None
    held.release()
    m.save(2, state_of(2), blocking=False)  # finishes (commits) step 1 first
    record = latest_valid(tmp_path)
    assert record is not None and record.step in (1, 2)
    step, got = m.restore()  # commits step 2 first
    assert step == 2
    assert_state_equal(got, state_of(2))
    m.save(3, state_of(3), blocking=False)
    m.close()  # commits step 3
    record = latest_valid(tmp_path)
    assert record is not None and record.step == 3


def test_poll_commits_once_every_write_is_done(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(4, state_of(4), blocking=False)
        for _ in range(2000):
            if m.poll():
                break
            threading.Event().wait(0.005)
        assert not m.in_flight
        record = latest_valid(tmp_path)
        assert record is not None and record.step == 4


def test_rotation_waits_for_the_newer_checkpoint_to_be_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path, keep=KeepLast(1)) as m:
        m.save(1, state_of(1))
        held = HeldWrites(monkeypatch)
        m.save(2, state_of(2), blocking=False)
        assert held.started.wait(10)
        # step 2 is being written: step 1 is still the newest durable one and stays
        record = latest_valid(tmp_path)
        assert record is not None and record.step == 1
        held.release()
        m.wait()
    m._deleter.wait()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002"]


def test_background_error_surfaces_at_the_next_call_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path, keep=KeepLast(1)) as m:
        m.save(1, state_of(1))

        def full(path: Path, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        real = fileio.write_file
        monkeypatch.setattr(fileio, "write_file", full)
        m.save(2, state_of(2), blocking=False)  # returns: the error is in the background
        with pytest.raises(CollectiveError, match="No space left") as info:
            m.wait()
        assert info.value.details[0].errno == errno.ENOSPC
        assert not list(tmp_path.glob(".tmp*")) and not list(tmp_path.glob("*tmp*step*"))
        record = latest_valid(tmp_path)
        assert record is not None and record.step == 1
        monkeypatch.setattr(fileio, "write_file", real)
        m.save(3, state_of(3), blocking=False)  # the manager still works
        m.wait()
        step, got = m.restore()
    assert step == 3
    assert_state_equal(got, state_of(3))
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []


def count_skeleton_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that gets one item per HDF5 skeleton built from now on."""
    created: list[str] = []
    real = fileio.build_skeleton

    def counting(kind: str, ranks: Any) -> fileio.FileSkeleton:
        created.append(kind)
        return real(kind, ranks)

    monkeypatch.setattr(fileio, "build_skeleton", counting)
    return created


def test_unchanged_structure_reuses_the_file_skeleton(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = count_skeleton_builds(monkeypatch)
    with CheckpointManager(tmp_path) as m:
        for step in range(1, 4):
            m.save(step, state_of(step), blocking=step % 2 == 0)
        assert len(created) == 1  # same names, shapes, dtypes: planned once
        changed = {**state_of(4), "x": np.zeros(10)}
        m.save(4, changed, blocking=False)
        m.wait()
        assert len(created) == 2
        _, got = m.restore()
    assert_state_equal(got, changed)
    # every reused skeleton gives a file identical to a freshly planned one
    with CheckpointManager(tmp_path / "fresh") as m:
        m.save(3, state_of(3))
    assert data_files(tmp_path / "fresh" / "step_00000003") == data_files(
        tmp_path / "step_00000003"
    )


@pytest.mark.parametrize("corrupt_metadata", [False, True])
def test_a_restart_reuses_the_restored_checkpoints_skeleton(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corrupt_metadata: bool
) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root) as m:
        m.save(1, state_of(1))
    if corrupt_metadata:  # HDF5's own bytes (not a dataset): restore still succeeds
        step_dir = root / "step_00000001"
        manifest = parse_manifest((step_dir / "manifest.json").read_text())
        meta = max(manifest.files[0].meta_segments, key=lambda s: s.length)  # the metadata
        path = step_dir / "rank_00000.h5"
        data = bytearray(path.read_bytes())
        data[meta.offset + meta.length // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    created = count_skeleton_builds(monkeypatch)
    with CheckpointManager(root) as m:  # a new process, as after a requeue
        step, got = m.restore()
        assert step == 1
        m.save(2, state_of(2))
        # a verified skeleton is reused; a corrupt one is never copied into a new checkpoint
        assert len(created) == (1 if corrupt_metadata else 0)
        m.save(3, {**state_of(3), "x": np.zeros(10)})  # another structure: planned anew
        assert len(created) == (2 if corrupt_metadata else 1)
        assert m.restore(step=2)[0] == 2
    assert_state_equal(got, state_of(1))
    record = latest_valid(root, full=True)
    assert record is not None and record.step == 3
    with CheckpointManager(tmp_path / "fresh") as m:
        m.save(2, state_of(2))
    assert data_files(tmp_path / "fresh" / "step_00000002") == data_files(root / "step_00000002")


def test_second_save_finishes_the_first(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, big_state(1), blocking=False)
        m.save(2, big_state(2), blocking=False)
        assert (tmp_path / "step_00000001" / "COMMITTED").exists()
        m.wait()
        assert (tmp_path / "step_00000002" / "COMMITTED").exists()


def test_session_stop_waits_for_the_async_save_then_saves_synchronously(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWrites(monkeypatch)
    root = tmp_path / "ck"
    with (
        pytest.raises(SystemExit) as exc_info,
        Session(root, environ={}, save_when=EverySteps(2), async_save=True) as s,
    ):
        step, state = s.restore_or(lambda: state_of(0))
        for step in (1, 2, 3):
            state = state_of(step)
            s.maybe_save(step, state)
        assert s.manager.in_flight  # step 2 is being written in the background
        signal.raise_signal(signal.SIGTERM)
        assert s.should_stop()
        held.release()
    assert exc_info.value.code == EXIT_RESUME
    assert [r.step for r in list_checkpoints(root)] == [2, 3]  # step 2 committed, then 3 saved
    with CheckpointManager(root) as m:
        step, got = m.restore()
    assert step == 3
    assert_state_equal(got, state_of(3))
