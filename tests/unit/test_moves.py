"""Moves between targets (:mod:`resilient.io.moves`): a committed step's byte ranges into another
target's pending step, verified as they are read."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.errors import InvalidCheckpointError
from resilient.io.moves import move_ranges
from resilient.io.targets import DirectoryTarget, MemoryTarget
from resilient.model.checksum import digest_bytes
from tests.unit.test_targets import manifest_of

DATA = bytes(range(256)) * 64


def committed(tmp_path: Path) -> DirectoryTarget:
    """A source target whose step 3 holds one file ``f.h5`` (committed by name only: the move
    reads files, not the marker)."""
    source = DirectoryTarget(tmp_path / "local")
    source.path(3).mkdir(parents=True)
    (source.path(3) / "f.h5").write_bytes(DATA)
    return source


def test_ranges_land_at_their_offsets_and_the_size_is_set(tmp_path: Path) -> None:
    source, dest = committed(tmp_path), DirectoryTarget(tmp_path / "shared")
    pending = dest.pending(3)
    dest.create(pending)
    ranges = [
        (0, 100, digest_bytes(DATA[:100]), "head"),
        (4000, 96, digest_bytes(DATA[4000:4096]), "x"),
    ]
    move_ranges(source, 3, "f.h5", dest, pending, ranges, size=len(DATA))
    moved = (pending.path / "f.h5").read_bytes()
    assert len(moved) == len(DATA)
    assert moved[:100] == DATA[:100] and moved[4000:4096] == DATA[4000:4096]
    assert moved[100:4000] == bytes(3900)  # not moved: another rank's part


def test_a_corrupt_source_is_refused_naming_the_range(tmp_path: Path) -> None:
    source, dest = committed(tmp_path), DirectoryTarget(tmp_path / "shared")
    pending = dest.pending(3)
    dest.create(pending)
    with pytest.raises(InvalidCheckpointError, match="rank 1 dataset 'x'") as info:
        move_ranges(
            source,
            3,
            "f.h5",
            dest,
            pending,
            [(0, 10, digest_bytes(b"other"), "rank 1 dataset 'x'")],
        )
    assert info.value.path == str(source.path(3))


def test_a_short_source_is_refused(tmp_path: Path) -> None:
    source, dest = committed(tmp_path), DirectoryTarget(tmp_path / "shared")
    pending = dest.pending(3)
    dest.create(pending)
    with pytest.raises(InvalidCheckpointError, match="ends at byte"):
        move_ranges(source, 3, "f.h5", dest, pending, [(len(DATA) - 4, 8, "0" * 16, "tail")])


def test_a_move_between_memory_targets_goes_through_the_seam() -> None:
    source, dest = MemoryTarget(), MemoryTarget()
    made = source.pending(3)
    source.create(made)
    source.write(made, "f.h5", DATA)
    source.commit(made, manifest_of(3), what="step 3")
    pending = dest.pending(3)
    dest.create(pending)
    whole = [(0, len(DATA), digest_bytes(DATA), "all")]
    move_ranges(source, 3, "f.h5", dest, pending, whole, size=len(DATA))
    dest.commit(pending, manifest_of(3), what="step 3")
    assert dest.read(3, "f.h5") == DATA
    again = dest.pending(4)
    dest.create(again)
    with pytest.raises(InvalidCheckpointError, match="ends at byte") as info:
        move_ranges(source, 3, "f.h5", dest, again, [(len(DATA) - 4, 8, "0" * 16, "tail")])
    assert info.value.path == source.where(3)
