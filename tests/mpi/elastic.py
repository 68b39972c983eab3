"""Elastic restore scenarios run under ``mpiexec -n 6``; driven by tests/test_elastic.py.

Usage: python tests/mpi/elastic.py SCENARIO ROOT KIND [ARG]

One launch covers many rank counts: the first N ranks of COMM_WORLD save on their own
communicator (``Split``), then the first M ranks restore on theirs, for each N and M asked for.
KIND is the saved layout (self, node, world, split: pairs of ranks); restores use ``self``.
Each rank prints ``RESULT <json>``; any failure raises (mpiexec then exits non-zero).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

import resilient
from resilient import Block, Replicated, block_1d, cartesian_block

world = MPI.COMM_WORLD
rank = world.rank
# SCENARIO_SHARD_RANKS=K: sharded manifests of shards of K ranks (whole file groups)
SHARD_RANKS = int(os.environ.get("SCENARIO_SHARD_RANKS", "0"))
CheckpointManager = (
    functools.partial(resilient.CheckpointManager, manifest_shard_ranks=SHARD_RANKS)
    if SHARD_RANKS
    else resilient.CheckpointManager
)

U_SHAPE = (1200, 700)  # 2-D Cartesian blocks of ~1.7 MB on 4 ranks: 27 stripes of 23 rows each
V_SHAPE = (1001,)  # 1-D, uneven
K_SHAPE = (37, 23)  # static, 2-D, split along axis 1 only (columns: whole rows are read)


def global_u(step: int) -> np.ndarray:
    i, j = np.indices(U_SHAPE)
    return (i * 1000.0 + j + 0.25 * step).astype(np.float64)


def global_v(step: int) -> np.ndarray:
    return (np.arange(V_SHAPE[0], dtype=np.int64) * 7 + step).astype(np.int32)


def global_k() -> np.ndarray:
    i, j = np.indices(K_SHAPE)
    return (i * 100 + j).astype(np.float32)


def decomposition(n: int, r: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(start, shape) of rank ``r`` of ``n`` for every Block leaf."""
    dims = MPI.Compute_dims(n, 2)
    coords = (r // dims[1], r % dims[1])
    v0, vn = block_1d(V_SHAPE[0], n, r)
    k0, kn = block_1d(K_SHAPE[1], n, r)
    return {
        "u": cartesian_block(U_SHAPE, dims, coords),
        "v": ((v0,), (vn,)),
        "k": ((0, k0), (K_SHAPE[0], kn)),
    }


def sl(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))


def state_of(
    step: int, n: int, r: int, *, extra: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    d = decomposition(n, r)
    state: dict[str, Any] = {
        "u": Block(np.ascontiguousarray(global_u(step)[sl(*d["u"])]), U_SHAPE, d["u"][0]),
        "v": Block(np.ascontiguousarray(global_v(step)[sl(*d["v"])]), V_SHAPE, d["v"][0]),
        "clock": Replicated({"time": 0.5 * step, "hist": np.arange(5.0) * step, "n": n}),
    }
    if extra:  # undeclared per-rank data: blocks an elastic restore
        state["note"] = f"rank {r}"
        state["mine"] = np.full(3, r)
    static = {"k": Block(np.ascontiguousarray(global_k()[sl(*d["k"])]), K_SHAPE, d["k"][0])}
    return state, static


def layout_comm(comm: MPI.Intracomm, kind: str) -> Any:
    return comm.Split(comm.rank // 2, comm.rank) if kind == "split" else kind


def sub(n: int) -> Any:
    """The first ``n`` ranks' communicator (``None`` on the others)."""
    comm = world.Split(0 if rank < n else MPI.UNDEFINED, rank)
    return None if comm == MPI.COMM_NULL else comm


def save(root: str, kind: str, n: int, steps: list[int], *, extra: bool = False) -> None:
    comm = sub(n)
    if comm is not None:
        with CheckpointManager(root, comm=comm, checkpoint_comm=layout_comm(comm, kind)) as m:
            for step in steps:
                state, static = state_of(step, n, comm.rank, extra=extra)
                m.save(step, state, static=static)
    world.Barrier()


def bound(saved_n: int, want: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """The most an elastic read of ``want`` may read: per overlapping stored block, the rows
    needed plus one stripe on each side, of the stored block's full width."""
    from resilient.model.blocks import BlockSpec, intersect, stripe_rows

    shapes = {"u": (U_SHAPE, 8), "v": (V_SHAPE, 4), "k": (K_SHAPE, 4)}
    total = 5 * 8  # the replicated array
    for name, (gshape, itemsize) in shapes.items():
        w = BlockSpec(gshape, *want[name])
        for r in range(saved_n):
            s = BlockSpec(gshape, *decomposition(saved_n, r)[name])
            common = intersect(s, w)
            if common is None:
                continue
            rows = stripe_rows(s.shape, itemsize)
            row_bytes = int(np.prod(s.shape[1:], dtype=np.int64)) * itemsize
            total += min(s.shape[0], common.shape[0] + 2 * rows) * row_bytes
    return total


def restore(root: str, m_ranks: int, saved_n: int, step: int) -> dict[str, Any] | None:
    comm = sub(m_ranks)
    out: dict[str, Any] | None = None
    if comm is not None:
        want = decomposition(m_ranks, comm.rank)
        blocks = {
            k: (shape, *want[k]) for k, shape in (("u", U_SHAPE), ("v", V_SHAPE), ("k", K_SHAPE))
        }
        with CheckpointManager(root, comm=comm) as m:
            got_step, st = m.restore(blocks=blocks)
            stats = m._restorer.last_read
        assert got_step == step, (got_step, step)
        assert st["u"].tobytes() == global_u(step)[sl(*want["u"])].tobytes()
        assert st["v"].tobytes() == global_v(step)[sl(*want["v"])].tobytes()
        assert st["k"].tobytes() == global_k()[sl(*want["k"])].tobytes()
        assert st["clock"]["time"] == 0.5 * step and st["clock"]["n"] == saved_n
        assert st["clock"]["hist"].tobytes() == (np.arange(5.0) * step).tobytes()
        if stats is not None:  # an elastic read (another rank count or layout)
            limit = bound(saved_n, want)
            assert stats.bytes_read <= limit, (stats.bytes_read, limit)
            out = {"bytes": stats.bytes_read, "bound": limit, "files": len(stats.files)}
        else:
            out = {"bytes": None}
    world.Barrier()
    return out


def scenario_matrix(root: str, kind: str, arg: str) -> None:
    """For each saved N in ARG (comma-separated): save step 3 on N ranks, restore on 1..6."""
    report = []
    for n in map(int, arg.split(",")):
        where = f"{root}/n{n}"
        save(where, kind, n, [3])
        for m in range(1, world.size + 1):
            got = restore(where, m, n, 3)
            if got is not None:
                report.append({"n": n, "m": m, **got})
    print("RESULT " + json.dumps({"rank": rank, "ok": True, "report": report}), flush=True)


def scenario_undeclared(root: str, kind: str, arg: str) -> None:
    """Saved with undeclared per-rank keys on 2 ranks: a restore on 3 fails the same way on all."""
    save(root, kind, 2, [1], extra=True)
    comm = sub(3)
    res: dict[str, Any] = {"rank": rank}
    if comm is not None:
        d = decomposition(3, comm.rank)
        blocks = {
            k: (shape, *d[k]) for k, shape in (("u", U_SHAPE), ("v", V_SHAPE), ("k", K_SHAPE))
        }
        with CheckpointManager(root, comm=comm) as m:
            try:
                m.restore(blocks=blocks)
            except resilient.LayoutMismatchError as exc:
                res.update(error=type(exc).__name__, message=str(exc), keys=list(exc.keys))
        # a missing block for a Block leaf: a ConfigError naming it, on every rank
        clean = f"{root}-clean"
        world_ok = True
    else:
        world_ok = False
    world.Barrier()
    save(f"{root}-clean", kind, 2, [1])
    if world_ok and comm is not None:
        with CheckpointManager(clean, comm=comm) as m:
            try:
                m.restore(blocks={"u": (U_SHAPE, *decomposition(3, comm.rank)["u"])})
            except resilient.ConfigError as exc:
                res.update(missing=str(exc))
    world.Barrier()
    print("RESULT " + json.dumps(res), flush=True)


def scenario_corrupt(root: str, kind: str, arg: str) -> None:
    """Steps 1 and 2 saved on 2 ranks; ARG: rank 0 of the 3 restoring ranks corrupts one byte
    of step 2's stored block of u at global row ARG first; every rank falls back to step 1."""
    save(root, kind, 2, [1, 2])
    row = int(arg)
    if rank == 0:
        corrupt_u(root, 2, row)
    world.Barrier()
    got = restore(root, 3, 2, 1)
    print("RESULT " + json.dumps({"rank": rank, "ok": got is not None or rank >= 3}), flush=True)


def corrupt_u(root: str, step: int, row: int) -> None:
    """Flip one byte of u's stored data at global ``(row, 0)`` in the checkpoint of ``step``."""
    import os

    ckpt = f"{root}/step_{step:08d}"
    with open(f"{ckpt}/manifest.json") as fh:
        manifest = json.load(fh)
    entries = manifest.get("ranks", [])
    for shard in manifest.get("shards", []):  # a sharded manifest: the entries are in shards
        with open(f"{ckpt}/{shard['name']}") as fh:
            entries.extend(json.load(fh)["entries"])
    for entry in entries:
        meta = {n[1]: n[2] for _, _, n in entry["tree"][1] if n[0] == "a" and len(n) == 3}
        start = meta["u"]["block"]["start"]
        cols = entry["datasets"]
        i = cols["names"].index("u")
        d = {"offset": cols["offsets"][i], "shape": cols["shapes"][i]}
        if start[0] <= row < start[0] + d["shape"][0] and start[1] == 0:
            offset = d["offset"] + (row - start[0]) * d["shape"][1] * 8
            fd = os.open(f"{ckpt}/{entry['file']}", os.O_RDWR)
            try:
                b = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
            finally:
                os.close(fd)
            return
    raise SystemExit(f"no stored block of u holds row {row}")


def main() -> None:
    scenario, root, kind = sys.argv[1:4]
    arg = sys.argv[4] if len(sys.argv) > 4 else ""
    globals()[f"scenario_{scenario}"](root, kind, arg)


if __name__ == "__main__":
    main()
