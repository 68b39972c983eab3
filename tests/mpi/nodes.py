"""The node-local tier across several nodes; driven by tests/test_multinode.py.

Usage: python tests/mpi/nodes.py SCENARIO ROOT LOCAL_DIR [ARG]

Started as ``mpiexec -hosts nodeA:2,nodeB:2 -launcher fork`` (one MPI node per host name on
this machine) or by ``srun -N 2`` on the multi-node local Slurm. ``LOCAL_DIR`` is given
unexpanded (``/tmp/x/$PMI_HOSTNAME``): each node's ranks expand it. Each rank prints
``RESULT <json>`` on success; any failure raises (the launcher then exits non-zero).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from resilient import Block, CheckpointManager, KeepLast, Replicated, block_1d
from resilient.checkpoint.tiermanager import LocalTierManager
from resilient.checkpoint.tiers import LocalTier
from resilient.errors import ResilientError
from resilient.model.xorcode import sets_of
from resilient.parallel.nodes import node_label

world = MPI.COMM_WORLD
rank = world.rank


def local_tier(m: CheckpointManager) -> LocalTier | None:
    """The manager's node-local tier, if it has one."""
    path = m._path
    return path.tier if isinstance(path, LocalTierManager) else None


def make_state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 * rank + step)
    return {"u": rng.standard_normal((64 + rank, 3)), "step": step}


def result(**kw: Any) -> None:
    print("RESULT " + json.dumps({"rank": rank, "node": node_label(), **kw}), flush=True)


def manager(
    root: str,
    local_dir: str,
    redundancy: str = "none",
    comm: str = "node",
    shard_ranks: str = "default",
    **kw: Any,
) -> CheckpointManager:
    """``shard_ranks``: the manager's ``manifest_shard_ranks`` (``default``: its default);
    ``redundancy`` ``xor:4``: XOR sets of at most 4 nodes."""
    if shard_ranks != "default":
        kw["manifest_shard_ranks"] = int(shard_ranks)
    if redundancy.startswith("xor:"):
        redundancy, size = redundancy.split(":")
        kw["xor_set_size"] = int(size)
    return CheckpointManager(
        root, comm=kw.pop("mpi_comm", world), checkpoint_comm=comm, local_dir=local_dir, keep=KeepLast(5),
        redundancy=None if redundancy == "none" else redundancy, **kw,
    )  # fmt: skip


def scenario_save(root: str, local_dir: str, steps: str, *how: str) -> None:
    """Save steps 1..N (every 2nd flushed to the shared root); leave like a killed job (no
    close, no last flush). ``how``: redundancy, checkpoint_comm and manifest_shard_ranks."""
    m = manager(root, local_dir, *how, flush_every=2)
    for step in range(1, int(steps) + 1):
        m.save(step, make_state(step))
        m.wait()  # the flush of an even step has reached the shared root
    result(local_root=str(tier.root) if (tier := local_tier(m)) else None)
    m.__exit__(RuntimeError, RuntimeError("killed"), None)


def scenario_restore(root: str, local_dir: str, *how: str) -> None:
    """Restore the newest checkpoint (local tier first) and check every rank's state."""
    with manager(root, local_dir, *how) as m:
        step, got = m.restore()
        want = make_state(step)
        assert got["step"] == step and np.array_equal(got["u"], want["u"]), (step, got)
    result(step=step)


def scenario_partner_full(root: str, local_dir: str, steps: str, *how: str) -> None:
    """Save steps 1..N with partner copies while the partner's disk is full: every save still
    commits locally, nothing is protected, and the run goes on."""
    scenario_full_disk(root, local_dir, steps, "partner", *how)


def scenario_full_disk(root: str, local_dir: str, steps: str, redundancy: str, *how: str) -> None:
    """Save steps 1..N with ``redundancy`` while nodeB's disk takes no data written through
    the library's file writer (partner copies and XOR parities): every save still commits
    locally, nothing is protected, and the run goes on."""
    import errno
    import os

    from resilient.io import fileio

    if node_label() == "nodeB":

        def full(*_: Any) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        fileio.FileWriter.write = full  # type: ignore[method-assign,assignment]
    m = manager(root, local_dir, redundancy, *how, flush_every=100)
    for step in range(1, int(steps) + 1):
        m.save(step, make_state(step))
        m.wait()
    result(local_root=str(tier.root) if (tier := local_tier(m)) else None)
    m.__exit__(RuntimeError, RuntimeError("killed"), None)


def scenario_unreadable_index(root: str, local_dir: str, steps: str, redundancy: str) -> None:
    """Save steps 1..N with ``redundancy`` while nodeB cannot read its committed manifests off
    the main thread (where the copies and parities run): no node waits forever for nodeB's
    bytes, every save commits locally, nothing is protected, and the run goes on."""
    import errno
    import threading

    from resilient.io.targets import DirectoryTarget

    if node_label() == "nodeB":
        read, manifest = DirectoryTarget.read, DirectoryTarget.manifest

        def off_main(fn: Any) -> Any:
            def wrapped(self: Any, step: Any, *args: Any, **kw: Any) -> Any:
                name = args[0] if args else "manifest.json"
                if (
                    threading.current_thread() is not threading.main_thread()
                    and name == "manifest.json"
                ):
                    raise OSError(errno.EIO, "an unreadable manifest (test)")
                return fn(self, step, *args, **kw)

            return wrapped

        DirectoryTarget.read = off_main(read)  # type: ignore[method-assign]
        DirectoryTarget.manifest = off_main(manifest)  # type: ignore[method-assign]
    m = manager(root, local_dir, redundancy, "self", flush_every=100)
    for step in range(1, int(steps) + 1):
        m.save(step, make_state(step))
        m.wait()
    result(local_root=str(tier.root) if (tier := local_tier(m)) else None)
    m.__exit__(RuntimeError, RuntimeError("killed"), None)


G_SHAPE = (203, 7)  # the global array of the elastic scenarios: rows split unevenly


def global_g(step: int) -> np.ndarray:
    i, j = np.indices(G_SHAPE)
    return (i * 10.0 + j + 0.5 * step).astype(np.float64)


def elastic_state(step: int) -> dict[str, Any]:
    """This rank's rows of the global array at ``step`` (a Block) and the step (Replicated)."""
    start, rows = block_1d(G_SHAPE[0], world.size, rank)
    block = Block(global_g(step)[start : start + rows], G_SHAPE, (start, 0))
    return {"g": block, "meta": Replicated({"step": step})}


def scenario_elastic_save(
    root: str, local_dir: str, steps: str, redundancy: str, shard_ranks: str = "default"
) -> None:
    """Save steps 1..N of a state restorable on any rank count, never flushed to the shared
    root (flush_every 1000); leave like a killed job. ``shard_ranks``: see :func:`manager`."""
    m = manager(root, local_dir, redundancy, "self", shard_ranks, flush_every=1000)
    for step in range(1, int(steps) + 1):
        m.save(step, elastic_state(step))
        m.wait()
    result(local_root=str(tier.root) if (tier := local_tier(m)) else None)
    m.__exit__(RuntimeError, RuntimeError("killed"), None)


def scenario_elastic_restore(
    root: str, local_dir: str, redundancy: str, shard_ranks: str = "default"
) -> None:
    """Restore on this job's rank count (each rank its rows) and check every rank's block is
    the global array's at the restored step; then save the next step and close (the flush of
    a new layout)."""
    start, rows = block_1d(G_SHAPE[0], world.size, rank)
    with manager(root, local_dir, redundancy, "self", shard_ranks) as m:
        try:
            step, got = m.restore(blocks={"g": (G_SHAPE, (start, 0), (rows, G_SHAPE[1]))})
        except ResilientError as exc:
            result(error=type(exc).__name__, message=str(exc))
            return
        want = global_g(step)[start : start + rows]
        assert got["meta"] == {"step": step}, got["meta"]
        assert got["g"].tobytes() == want.tobytes(), step
        m.save(step + 1, elastic_state(step + 1))
        staging = tier.staging.root if (tier := local_tier(m)) else None
    # the node's leader drops the staging on its own (local): look after close's collectives
    result(step=step, staged_left=staging is not None and staging.exists())


def scenario_xor_sizes(root: str, local_dir: str, *runs: str) -> None:
    """XOR parity on the first nodes of this job, one run after the other in this launch: each
    ``run`` is ``NODES/SPEC[/EXTRA...]`` (``4/xor``: the first 4 nodes, sets of at most 8;
    ``8/xor:4/nodeA+nodeB``). A run saves steps 1..3 into the local tier, never flushed, then
    round by round wipes nodes' local tiers and restores: one node of each set per round until
    every node was wiped once, then the rounds of ``EXTRA`` (node names joined by ``+``). Per
    run and round each rank reports the step restored, whether its node's files of step 3 are
    back bit for bit, and the lines said about XOR parity (the ranks of other nodes wait,
    without spinning)."""
    import logging
    import time

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("resilient").addHandler(Keep(logging.WARNING))
    labels = sorted(set(world.allgather(node_label())))
    out: list[dict[str, Any] | None] = []
    for i, run in enumerate(runs):
        nodes, spec, *extra = run.split("/")
        inside = labels.index(node_label()) < int(nodes)
        sub = world.Split(1 if inside else MPI.UNDEFINED, rank)
        if inside:
            where = (f"{root}/run{i}", f"{local_dir}/run{i}")
            out.append(_xor_rounds(sub, *where, spec, extra, said))
            sub.Free()
        else:
            out.append(None)
        done = world.Ibarrier()
        while not done.Test():
            time.sleep(0.01)
    result(runs=out)


def _xor_rounds(
    comm: Any, root: str, local_dir: str, spec: str, extra: list[str], said: list[str]
) -> dict[str, Any]:
    import hashlib
    import shutil
    from pathlib import Path

    m = manager(root, local_dir, spec, "self", flush_every=1000, mpi_comm=comm)
    for step in range(1, 4):
        m.save(step, make_state(step))
        m.wait()
    tier = local_tier(m)
    assert tier is not None
    mine, acts = tier.root, tier.is_node_leader

    def digests() -> dict[str, str]:
        step = mine / "step_00000003"
        if not step.is_dir():
            return {}
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step.glob("*.h5")}

    before = digests() if acts else {}
    m.__exit__(RuntimeError, RuntimeError("killed"), None)
    labels = sorted(set(comm.allgather(node_label())))
    size = int(spec.split(":")[1]) if ":" in spec else 8
    sets = [s.members for s in sets_of(len(labels), size)]
    rounds = [[labels[s[i]] for s in sets if i < len(s)] for i in range(max(map(len, sets)))]
    rounds += [r.split("+") for r in extra]
    out = []
    for wipe in rounds:
        if acts and node_label() in wipe:
            shutil.rmtree(mine)
        comm.Barrier()
        said.clear()
        with manager(root, local_dir, spec, "self", flush_every=1000, mpi_comm=comm) as again:
            step, got = again.restore()
            want = make_state(step)
            assert got["step"] == step and np.array_equal(got["u"], want["u"]), (step, wipe)
        out.append((wipe, step, acts and digests() == before, [s for s in said if "XOR" in s]))
    if comm.rank == 0:  # what was said: too long for a RESULT line that no other rank splits
        Path(root, "said.json").write_text(json.dumps([(w, s) for w, _, _, s in out]))
    return {"steps": [s for _, s, _, _ in out], "same": [m for _, _, m, _ in out], "acts": acts}


def scenario_refused(root: str, local_dir: str, comm: str) -> None:
    """Construction fails with the same error on every rank (no rank hangs)."""
    try:
        CheckpointManager(root, comm=world, checkpoint_comm=comm, local_dir=local_dir)
    except ResilientError as exc:
        result(error=type(exc).__name__, message=str(exc))
        return
    raise AssertionError("the manager was built")


def main() -> None:
    scenario, root, local_dir, *args = sys.argv[1:]
    globals()[f"scenario_{scenario}"](root, local_dir, *args)


if __name__ == "__main__":
    main()
