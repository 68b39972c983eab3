"""A save writes over the files of the checkpoint that rotation dropped (no new blocks, no
freed ones), and nothing of that shows: the checkpoints stay valid and restore bit-identically,
a file with another name for its bytes is never written over, and no trash is left."""

from __future__ import annotations

import os
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from resilient import CheckpointManager, KeepLast
from resilient.io.checkpoints import validate_checkpoint
from resilient.model import filenames

DATA = "rank_00000.h5"


def state(step: int, n: int = 300_000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"u": rng.random(n), "v": rng.random(1000).astype(np.float32), "k": np.arange(step)}


def data_file(root: Path, step: int) -> Path:
    return root / filenames.step_dir_name(step) / DATA


def test_the_next_save_writes_over_the_dropped_checkpoints_file(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root, keep=KeepLast(1)) as mgr:
        mgr.save(1, state(1))
        first = data_file(root, 1).stat().st_ino
        mgr.save(2, state(2))  # rotation drops step 1: its file is kept for the next save
        (kept,) = [p for p in root.iterdir() if filenames.is_trash(p.name)]
        assert (kept / DATA).stat().st_ino == first
        mgr.save(3, state(3))  # ... which writes over it: taken from the trash
        assert data_file(root, 3).stat().st_ino == first and not (kept / DATA).exists()
        mgr.save(4, state(4), blocking=False)
        mgr.wait()
        step, got = mgr.restore()
    assert step == 4 and sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        filenames.step_dir_name(4)
    ]
    for name, want in state(4).items():
        assert got[name].tobytes() == want.tobytes(), name
    validate_checkpoint(root / filenames.step_dir_name(4), full=True)
    with h5py.File(data_file(root, 4)) as f:  # still an ordinary HDF5 file
        assert f["rank_00000/u"][...].tobytes() == state(4)["u"].tobytes()
    assert not [p for p in root.iterdir() if filenames.is_trash(p.name)], "trash left after close"


@pytest.mark.parametrize("finish", ["wait", "poll", "next save"])
def test_an_async_save_writes_over_the_dropped_checkpoints_file(
    tmp_path: Path, finish: str
) -> None:
    """Asynchronous saves take the sync save's path: each writes over the file of the
    checkpoint rotation dropped (two inodes in turn), however it is finished; while it is in
    flight the newest committed step is whole (its file is not the one written), and every
    step restores bit-identically."""
    root = tmp_path / "ck"
    inodes: dict[int, int] = {}
    with CheckpointManager(root, keep=KeepLast(1)) as mgr:
        for step in range(1, 6):
            mgr.save(step, state(step), blocking=False)
            if step > 1:  # the previous step is committed and whole while this one is written
                validate_checkpoint(root / filenames.step_dir_name(step - 1), full=True)
                inodes[step - 1] = data_file(root, step - 1).stat().st_ino
            if finish == "wait":
                mgr.wait()
            elif finish == "poll":
                while not mgr.poll():
                    time.sleep(0.01)
            if finish != "next save":
                inodes[step] = data_file(root, step).stat().st_ino
                got_step, got = mgr.restore()
                assert got_step == step
                for name, want in state(step).items():
                    assert got[name].tobytes() == want.tobytes(), (step, name)
        mgr.wait()
        inodes[5] = data_file(root, 5).stat().st_ino
        step, got = mgr.restore()
    assert step == 5
    for name, want in state(5).items():
        assert got[name].tobytes() == want.tobytes(), name
    assert inodes[1] != inodes[2]
    for s in (3, 4, 5):  # each step's file is the one of the step two before: taken, written over
        assert inodes[s] == inodes[s - 2], (s, inodes)
    validate_checkpoint(root / filenames.step_dir_name(5), full=True)
    assert not [p for p in root.iterdir() if filenames.is_trash(p.name)], "trash left after close"


@pytest.mark.parametrize("sizes", [(300_000, 50_000), (50_000, 300_000)])
def test_another_structure_writes_over_a_longer_or_shorter_file(
    tmp_path: Path, sizes: tuple[int, int]
) -> None:
    """The dropped file is longer or shorter than the new one: it gets the new size, every
    checksum holds, and the state restores as saved."""
    root = tmp_path / "ck"
    small, large = sizes
    with CheckpointManager(root, keep=KeepLast(1)) as mgr:
        mgr.save(1, state(1, small))
        mgr.save(2, state(2, small))
        mgr.save(3, state(3, large))  # over step 1's file, of the other size
        step, got = mgr.restore()
    assert step == 3
    for name, want in state(3, large).items():
        assert got[name].tobytes() == want.tobytes(), name
    validate_checkpoint(root / filenames.step_dir_name(3), full=True)


def test_a_file_with_another_name_is_never_written_over(tmp_path: Path) -> None:
    """A hard link to a checkpoint's file (a user's backup) keeps its bytes: a file of more
    than one link is not taken."""
    root = tmp_path / "ck"
    backup = tmp_path / "backup.h5"
    with CheckpointManager(root, keep=KeepLast(1)) as mgr:
        mgr.save(1, state(1))
        os.link(data_file(root, 1), backup)
        before = backup.read_bytes()
        mgr.save(2, state(2))
        mgr.save(3, state(3))
        assert data_file(root, 3).stat().st_ino != backup.stat().st_ino
    assert backup.read_bytes() == before


def test_without_rotation_nothing_is_kept_or_taken(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as mgr:  # keep=None: every checkpoint stays
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        inodes = {data_file(root, s).stat().st_ino for s in (1, 2, 3)}
    assert len(inodes) == 3
    assert not [p for p in root.iterdir() if filenames.is_trash(p.name)]
