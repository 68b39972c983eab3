"""DTensor leaves: the block arithmetic (against torch's own, where torch is installed) and,
on one process, what a save and a restore refuse. Several ranks: tests/test_dtensor.py."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager, ConfigError
from resilient.model.checksum import digest_stripes
from resilient.model.dtensors import Placement, local_block, writes

S0, S1, R = Placement("shard", 0), Placement("shard", 1), Placement("replicate")


def test_uneven_shards_follow_torch_chunk() -> None:
    # 7 rows over 4 ranks: chunks of 2, the last of 1; 5 columns: 2, 2, 1, none
    assert [local_block((7, 5), (4,), (c,), [S0]) for c in range(4)] == [
        ((0, 0), (2, 5)), ((2, 0), (2, 5)), ((4, 0), (2, 5)), ((6, 0), (1, 5)),
    ]  # fmt: skip
    assert local_block((7, 5), (4,), (3,), [S1]) == ((0, 0), (7, 0))  # empty: starts at 0
    assert local_block((5,), (4,), (3,), [S0]) == ((0,), (0,))  # torch.chunk gives 3 chunks


def test_two_mesh_dimensions_and_replicas() -> None:
    assert local_block((8, 6), (2, 2), (1, 1), [S0, S1]) == ((4, 3), (4, 3))
    assert local_block((8, 6), (2, 2), (1, 0), [S0, S0]) == ((4, 0), (2, 6))
    assert local_block((8, 6), (2, 2), (1, 1), [R, S0]) == ((4, 0), (4, 6))
    assert writes((0, 1), [R, S0]) and not writes((1, 0), [R, S0]) and writes((1, 1), [S0, S1])


def test_strided_shards_are_one_block_only_where_they_are() -> None:
    fsdp_over_tp = [Placement("strided", 0, 2), S0]  # FSDP2 (dp) over ColwiseParallel (tp)
    blocks = {
        c: local_block((8,), (2, 2), c, fsdp_over_tp) for c in itertools.product((0, 1), (0, 1))
    }
    assert blocks == {(0, 0): ((0,), (2,)), (1, 0): ((2,), (2,)), (0, 1): ((4,), (2,)),
                      (1, 1): ((6,), (2,))}  # fmt: skip
    assert local_block((8,), (2, 2), (0, 0), [S0, Placement("strided", 0, 2)]) is None


def _torch_placement(p: Placement) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if p.kind == "replicate":
        return Replicate()
    return Shard(p.dim) if p.kind == "shard" else _StridedShard(p.dim, split_factor=p.split)


@pytest.mark.torch
def test_blocks_agree_with_torch_wherever_they_are_blocks() -> None:
    """torch's own offsets (the function its checkpointing uses, on plain values) are the
    oracle: every block found has torch's shape and offset, for even, uneven and empty pieces."""
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    compute = utils._compute_local_shape_and_global_offset
    options = [R, S0, S1, Placement("strided", 0, 2), Placement("strided", 1, 3)]
    checked = 0
    for shape, mesh in itertools.product([(7, 5), (8, 6), (3, 13), (12, 12)], [(2, 2), (2, 3)]):
        for placements in itertools.product(options, repeat=2):
            for coord in itertools.product(*(range(n) for n in mesh)):
                found = local_block(shape, mesh, coord, list(placements))
                if found is None:
                    continue
                local, offset = compute(shape, mesh, list(coord),
                                        [_torch_placement(p) for p in placements])  # fmt: skip
                assert found[1] == tuple(local), (shape, mesh, coord, placements)
                if 0 not in found[1]:
                    assert found[0] == tuple(offset), (shape, mesh, coord, placements)
                checked += 1
    assert checked > 500


def test_rows_of_no_bytes_have_empty_stripes() -> None:
    assert len(digest_stripes(np.zeros((7, 0)), 7)) == 1  # a rank's empty shard of a column


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    dist = pytest.importorskip("torch.distributed")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.torch
def test_one_rank_round_trip_and_what_is_refused(one_rank: Any, tmp_path: Path) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,))
    g = torch.arange(12.0).reshape(3, 4).to(torch.bfloat16)
    w = DTensor.from_local(g.clone(), mesh, [Shard(0)])
    with CheckpointManager(tmp_path / "ck", comm=one_rank.group.WORLD) as mgr:
        with pytest.raises(ConfigError, match=r"state\['p'\]: DTensor placed Partial"):
            mgr.save(1, {"p": DTensor.from_local(g.clone(), mesh, [Partial()])})
        mgr.save(1, {"w": w, "r": DTensor.from_local(g.clone(), mesh, [Replicate()])})
        with pytest.raises(
            ConfigError, match="'r' was saved from a DTensor: restore it with into="
        ):
            mgr.restore()
        into = {"w": DTensor.from_local(torch.zeros_like(g), mesh, [Shard(0)]),
                "r": DTensor.from_local(torch.zeros_like(g), mesh, [Replicate()])}  # fmt: skip
        _, state = mgr.restore(into=into)
        assert state["w"] is into["w"] and state["r"] is into["r"]
        assert torch.equal(state["w"].to_local(), g) and torch.equal(state["r"].to_local(), g)
        _, plain = mgr.restore(
            blocks={"w": ((3, 4), (0, 1), (3, 2)), "r": ((3, 4), (0, 0), (3, 4))}
        )
        assert torch.equal(plain["w"], g[:, 1:3]) and plain["w"].dtype == torch.bfloat16
