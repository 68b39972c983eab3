"""An elastic restore from the node-local tier on one process (one node, no channel): a step
never flushed to the shared root is staged and read with new blocks. The multi-node cases (partner
copies over the wire, a corrupt copy) run with real ranks in tests/test_multinode.py and on the
local Slurm in tests/test_slurm_multinode.py."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from resilient import Block, CheckpointManager, Replicated
from resilient.checkpoint.partner import Ring
from resilient.checkpoint.tiermanager import LocalTierManager
from resilient.checkpoint.tierstaging import ShardFetch, files_needed, took_shards
from resilient.io.manifests import load_manifest
from resilient.model.blocks import BlockSpec
from resilient.model.manifest import ShardEntry

SHAPE = (10, 3)


def _global(step: int) -> np.ndarray:
    return np.arange(30.0).reshape(SHAPE) + step


def _replicated(step: int) -> Replicated:
    return Replicated({"s": step, "w": np.full(2, float(step))})


def _crashed_run(tmp_path: Path, steps: int) -> Path:
    """Save steps 1..N into the local tier only (never flushed), then stop as a crash would."""
    m = CheckpointManager(tmp_path / "ck", local_dir=tmp_path / "local", flush_every=1000)
    for step in range(1, steps + 1):
        m.save(step, {"g": Block(_global(step), SHAPE, (0, 0)), "t": _replicated(step)})
    local = m._path
    assert isinstance(local, LocalTierManager)
    m.__exit__(RuntimeError, RuntimeError("killed"), None)
    return local.tier.root


def test_new_blocks_are_read_from_the_newest_local_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = _crashed_run(tmp_path, 3)
    assert not list((tmp_path / "ck").glob("step_*"))
    caplog.set_level(logging.WARNING)
    with CheckpointManager(tmp_path / "ck", local_dir=tmp_path / "local") as m:
        step, state = m.restore(blocks={"g": (SHAPE, (2, 1), (5, 2))})
    assert step == 3 and state["t"]["s"] == 3 and state["t"]["w"].tolist() == [3.0, 3.0]
    assert state["g"].tobytes() == _global(3)[2:7, 1:3].tobytes()
    said = [
        r.getMessage() for r in caplog.records if "elastic restore on node(s)" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].startswith("staged local step 3"), said
    assert "(0 files, 0 bytes over the wire)" in said[0]
    assert not (local / "elastic").exists()  # removed after the restore


def test_a_step_older_than_the_shared_roots_newest_is_not_staged(tmp_path: Path) -> None:
    _crashed_run(tmp_path, 2)
    with CheckpointManager(tmp_path / "ck") as m:  # the shared root gets a newer step 5
        m.save(5, {"g": Block(_global(5), SHAPE, (0, 0)), "t": _replicated(5)})
    with CheckpointManager(tmp_path / "ck", local_dir=tmp_path / "local") as m:
        step, state = m.restore(blocks={"g": (SHAPE, (0, 0), (4, 3))})
    assert step == 5 and state["g"].tobytes() == _global(5)[:4].tobytes()


def test_each_node_needs_the_files_its_ranks_new_blocks_overlap(tmp_path: Path) -> None:
    local = _crashed_run(tmp_path, 1)
    manifest = load_manifest(local / "step_00000001")
    ring = Ring.of([(0, "a"), (0, "a"), (2, "b")])
    top, none = BlockSpec.of(SHAPE, (0, 0), (3, 3)), BlockSpec.of(SHAPE, (0, 0), (0, 3))
    needs = files_needed(manifest, ring, [{"g": top}, {"g": top}, {}], current="3 ranks")
    (name,) = {f.name for f in manifest.files}
    assert needs == {0: {name}, 2: {name}}  # rank 0's file: its block and the replicated leaf
    assert files_needed(manifest, ring, [{"g": none}] * 3, current="3 ranks") == {
        0: {name}, 2: {name}  # the replicated array is in saved rank 0's file
    }  # fmt: skip


def test_a_staged_step_that_fails_its_read_is_passed_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = _crashed_run(tmp_path, 3)
    step3 = local / "step_00000003"
    entry = load_manifest(step3).ranks[0]
    g = next(d for d in entry.datasets if d.name == "g")
    assert g.offset is not None
    data = step3 / entry.file
    raw = bytearray(data.read_bytes())
    raw[g.offset + g.nbytes - 1] ^= 0xFF  # in the last row, which the restore reads
    data.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING)
    with CheckpointManager(tmp_path / "ck", local_dir=tmp_path / "local") as m:
        step, state = m.restore(blocks={"g": (SHAPE, (5, 0), (5, 3))})
    assert step == 2 and state["g"].tobytes() == _global(2)[5:].tobytes()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "local step 3 staged for an elastic restore failed validation" in said, said
    assert "checksum mismatch" in said and "staged local step 2" in said, said


def test_every_shard_asked_for_is_received_or_no_longer_counted_as_held() -> None:
    one, two = (ShardEntry(f"manifest-0000{i}.json", 10, "0" * 16, (f"rank_0000{i}.h5",))
                for i in (1, 2))  # fmt: skip
    held = {"manifest-00001.json": "own", "manifest-00002.json": "partner", "rank_00001.h5": "own"}
    inventories = {0: {3: ("index", held)}, 2: {3: ("index", {"manifest-00002.json": "own"})}}
    fetch = ShardFetch(3, ((0, (one, two)),))
    answer: dict[str, bytes | str] = {one.name: b"x" * 10, two.name: "does not match its checksum"}
    replies = [answer, {}, {}]
    after, shards = took_shards(inventories, {}, fetch, replies)
    assert shards == {3: {one.name: b"x" * 10}}
    assert after[0][3] == ("index", {"manifest-00001.json": "own", "rank_00001.h5": "own"})
    assert after[2] == inventories[2]  # another holder of the shard is asked next
    assert "manifest-00002.json" in inventories[0][3][1]  # (the inventories are not changed)
