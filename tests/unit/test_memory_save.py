"""A whole save of a set through the storage seam (:class:`~resilient.io.targets.Target`), into a
:class:`~resilient.io.targets.MemoryTarget` with no file opened on disk: several steps, the skeleton
reused, rotation; the data read back through the target's range reader, verified against the
manifest, and byte-identical to the same saves into a :class:`~resilient.io.targets.DirectoryTarget`;
then restored, still with no file opened, by the restore's own read of a rank
(:func:`~resilient.checkpoint.reading.read_rank`: new arrays, and into existing ones).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient.checkpoint.reading import read_rank
from resilient.checkpoint.saveset import (
    SkeletonCache,
    commit_set,
    gather_set,
    plan_rank,
    plan_write,
)
from resilient.errors import InvalidCheckpointError
from resilient.io.targets import DirectoryTarget, MemoryTarget, Target
from resilient.model import filenames
from resilient.model.arrays import numpy_dtype
from resilient.model.checksum import digest_array
from resilient.model.payload import split_state
from resilient.parallel.comm import SerialComm
from resilient.parallel.setcomms import make_set_comms

KEEP = 2


def state_of(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "u": np.arange(50_000, dtype=np.float64) * step,  # large enough for the O_DIRECT path
        "grid": np.full((3, 4), step, dtype=np.int32),
        "nested": {"v": np.linspace(0, 1, 7, dtype=np.float32) + step, "note": f"at {step}"},
        "empty": np.zeros(0),
        # 5.6 MB: the restore's read checksums on a helper thread, this one in pieces
        "big": np.arange(700_000, dtype=np.float64) + step,
    }


def save(target: Target, steps: list[int]) -> None:
    """The blocking save of one rank (what :class:`~resilient.checkpoint.saving.SavePipeline`
    runs), then rotation to the newest :data:`KEEP` steps."""
    comms = make_set_comms(SerialComm(), "self")
    cache = SkeletonCache()
    for step in steps:
        target.clean_up()
        data = split_state(state_of(step))
        pending = target.pending(step)
        target.create(pending)
        reuse = plan_rank(comms, data, cache) is not None
        job = plan_write(comms, target, pending, data, step=step, cache=cache, reuse=reuse)
        written = job.run()
        gathered = gather_set(comms, written, target, pending, kind="checkpoint", step=step)
        assert gathered is not None
        manifest = commit_set(comms, gathered.values(), step=step, at=1000.0 + step)
        target.commit(pending, manifest, what=f"save of step {step}")
        for old in sorted(target.steps())[:-KEEP]:
            target.remove(old)


def read_back(target: Target, step: int) -> dict[str, np.ndarray[Any, Any]]:
    """Rank 0's arrays of ``step``, read through the target's range reader and verified."""
    entry = target.manifest(step).ranks[0]
    table = entry.datasets
    out: dict[str, np.ndarray[Any, Any]] = {}
    reader = target.open_reader(step, entry.file)
    try:
        for i, name in enumerate(table.names):
            arr = np.empty(table.shapes[i], dtype=numpy_dtype(table.dtypes[i]))
            offset = table.offsets[i]
            if offset is not None:
                reader.read(arr.data.cast("B"), offset)
            assert digest_array(arr) == table.digests[16 * i : 16 * (i + 1)]
            out[name] = arr
    finally:
        reader.close()
    return out


def test_a_memory_target_saves_and_reads_back_without_touching_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = MemoryTarget()
    real_open = os.open

    def no_files(path: Any, *args: Any, **kwargs: Any) -> int:
        raise AssertionError(f"a file was opened: {path}")

    monkeypatch.setattr(os, "open", no_files)
    save(memory, [1, 2, 3, 4])
    assert sorted(memory.steps()) == [3, 4]
    monkeypatch.setattr(os, "open", real_open)

    for step in (3, 4):
        got = read_back(memory, step)
        want = split_state(state_of(step)).arrays
        assert got.keys() == want.keys()
        for name, arr in want.items():
            np.testing.assert_array_equal(got[name], arr)

    directory = DirectoryTarget(tmp_path / "root")
    save(directory, [1, 2, 3, 4])
    assert sorted(directory.steps()) == [3, 4]
    for step in (3, 4):
        name = directory.manifest(step).ranks[0].file
        assert memory.read(step, name) == directory.read(step, name)  # the same bytes
        assert memory.read(step, filenames.MANIFEST) == directory.read(step, filenames.MANIFEST)


def test_a_memory_target_is_restored_by_the_restores_own_read_without_touching_the_disk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = MemoryTarget()

    def no_files(path: Any, *args: Any, **kwargs: Any) -> int:
        raise AssertionError(f"a file was opened: {path}")

    monkeypatch.setattr(os, "open", no_files)
    save(memory, [1, 2, 3])
    for step in (2, 3):
        want = state_of(step)
        files = functools.partial(memory.open_reader, step)
        got = read_rank(files, memory.where(step), memory.manifest(step), 0)
        assert got.keys() == want.keys()
        assert got["step"] == step and got["nested"]["note"] == want["nested"]["note"]
        for have, arr in [(got[k], want[k]) for k in ("u", "grid", "empty", "big")] + [
            (got["nested"]["v"], want["nested"]["v"])
        ]:
            assert have.dtype == arr.dtype and have.shape == arr.shape
            assert have.tobytes() == arr.tobytes()  # bit-identical
        # into existing arrays (a restore_into): read in place, returned as themselves
        into = {k: np.empty_like(a) for k, a in split_state(want).arrays.items()}
        back = read_rank(files, memory.where(step), memory.manifest(step), 0, into=into)
        assert back["big"] is into["big"] and back["nested"]["v"] is into["nested/v"]
        assert into["big"].tobytes() == want["big"].tobytes()
        assert into["u"].tobytes() == want["u"].tobytes()
        # a flipped byte in a dataset: the restore's read says which, as for a file on disk
        entry = memory.manifest(step).ranks[0]
        at = entry.datasets.offsets[entry.datasets.names.index("grid")]
        assert at is not None
        files_of = memory.dirs[filenames.step_dir_name(step)]
        good = files_of[entry.file]
        files_of[entry.file] = good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :]
        with pytest.raises(
            InvalidCheckpointError, match="checksum mismatch: rank 0 dataset 'grid'"
        ):
            read_rank(files, memory.where(step), memory.manifest(step), 0)
        files_of[entry.file] = good
