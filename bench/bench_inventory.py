"""What rank 0 receives when the nodes list their local and partner copies (issue 38): the
inventory before a rebuild from partner copies or an elastic restore from the node-local tier
(:func:`resilient.checkpoint.partner.gather_inventories`), simulated in one process, no MPI.

Run::

    python bench/bench_inventory.py --ranks 16384 [--ranks-per-node 64] [--datasets 300]
                                    [--keep 2] [--json OUT] [--dir DIR]

The index is a real one: the local tier's sharded index of a save of ``--ranks`` ranks
(``checkpoint_comm="self"``, shards by node) as :mod:`bench_scale`'s ``--local-tier`` mode
commits it, one per step (``--keep`` steps). Every node holds each step's own files and shard
and its left neighbour's as a partner copy (:func:`~resilient.checkpoint.partner.node_files`).

* **before**: every node's first rank sends rank 0 the index text of every step it holds
  with its file list, as the library did before (``(rank, {step: (index, files)})``): the
  size of those messages, pickled as mpi4py's ``gather`` pickles them.
* **after**: the library's :func:`gather_inventories` run on rank 0 over :class:`Rank0`, a
  stand-in for rank 0 of the communicator: its first gather receives every rank's report
  (``(rank, {step: Held.summary()}, None)``: a content address per step), its broadcast says
  which node sends which index, its second gather receives those (each index once). What rank
  0 receives is the sum of the pickled messages of both gathers (its own included).
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_scale import PROTOCOL, local_commit_sharded, messages, node_sharding
from benchutil import library_revision, write_json

from resilient.checkpoint.manager import DEFAULT_SHARD_RANKS
from resilient.checkpoint.partner import Held, Ring, gather_inventories, node_files
from resilient.model.codec import manifest_json
from resilient.model.manifest import Manifest
from resilient.parallel.collective import Collective


class Rank0:
    """Rank 0 of ``size`` ranks for :func:`gather_inventories`: the first ``gather`` receives
    ``reports`` (every other rank's), the second what each rank sends of the indexes the
    last broadcast asked of it (``texts``: a rank's held indexes by content address);
    ``received`` adds up the pickled size of every message it receives (its own too)."""

    def __init__(self, reports: list[Any], texts: dict[int, dict[str, str]]) -> None:
        self.rank, self.size = 0, len(reports)
        self.reports, self.texts = reports, texts
        self.asked: dict[int, list[tuple[int, str]]] = {}
        self.received = 0
        self.broadcast = 0

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        if self.reports:
            others, self.reports = [(True, r) for r in self.reports[1:]], []
        else:
            others = [
                (True, {a: self.texts[r][a] for _, a in self.asked.get(r, ())})
                for r in range(1, self.size)
            ]
        out = [obj, *others]
        self.received += sum(len(pickle.dumps(m, PROTOCOL)) for m in out)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.broadcast += len(pickle.dumps(obj, PROTOCOL))
        status, value = obj
        if status == "ok" and isinstance(value, dict):
            self.asked = value
        return obj


def index_of(ranks: int, datasets: int, per_node: int, shard_ranks: int, base: Path) -> Manifest:
    """The local tier's sharded index of one save (:mod:`bench_scale`'s ``--local-tier``)."""
    inbox = messages(ranks, datasets, 1)
    sharding = node_sharding(inbox, 1, shard_ranks, per_node, base)
    root = Path(tempfile.mkdtemp(prefix="inventory-", dir=base))
    try:
        index, _, _ = local_commit_sharded(inbox, 1, root, sharding)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return index


def holdings(index: Manifest, ring: Ring, steps: list[int]) -> dict[int, dict[int, Held]]:
    """Per node, per step: its own files and shard and its left neighbour's (partner)."""
    texts = {s: manifest_json(dataclasses.replace(index, step=s)) for s in steps}
    out: dict[int, dict[int, Held]] = {}
    for node in ring.leaders:
        own = node_files(index, ring.ranks_of(node))
        left = node_files(index, ring.ranks_of(ring.left(node))) if len(ring) > 1 else {}
        files = {n: (Path(f"/local/partner/{n}"), size, "0" * 32) for n, size in left.items()}
        files.update({n: (Path(f"/local/{n}"), size, None) for n, size in own.items()})
        out[node] = {s: Held(texts[s], dict(files)) for s in steps}
    return out


def measure(ranks: int, datasets: int, per_node: int, keep: int, base: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    index = index_of(ranks, datasets, per_node, DEFAULT_SHARD_RANKS, base)
    built_s = time.perf_counter() - t0
    ring = Ring.of([(r - r % per_node, f"n{r // per_node}") for r in range(ranks)])
    steps = list(range(index.step, index.step + keep))
    held = holdings(index, ring, steps)
    empty: dict[int, Held] = {}

    def kinds(h: Held) -> dict[str, str]:
        return {n: ("own" if d is None else "partner") for n, (_, _, d) in h.files.items()}

    before = sum(
        len(pickle.dumps((True, (r, {s: (h.manifest, kinds(h)) for s, h in
                                     held.get(r, empty).items()})), PROTOCOL))
        for r in range(ranks)
    )  # fmt: skip
    reports = [(r, {s: h.summary() for s, h in held.get(r, empty).items()}, None)
               for r in range(ranks)]  # fmt: skip
    texts = {r: {h.summary()[0]: h.manifest for h in held.get(r, empty).values()}
             for r in range(ranks)}  # fmt: skip
    comm = Rank0(reports, texts)
    t0 = time.perf_counter()
    got = gather_inventories(Collective(comm), ring, held[0], None, what="bench")  # type: ignore[arg-type]
    after_s = time.perf_counter() - t0
    assert got is not None and not isinstance(got, Exception), got
    inventories, _ = got
    assert all(inventories[n][s][0] == held[n][s].manifest for n in ring.leaders for s in steps)
    return {
        "ranks": ranks, "datasets": datasets, "ranks_per_node": per_node, "nodes": len(ring),
        "steps_held": keep, "index_bytes": len(held[0][steps[0]].manifest),
        "before_received_bytes": before, "after_received_bytes": comm.received,
        "after_broadcast_bytes": comm.broadcast, "after_s": round(after_s, 3),
        "index_built_s": round(built_s, 1), "revision": library_revision(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="16384", help="comma-separated rank counts")
    p.add_argument("--ranks-per-node", type=int, default=64)
    p.add_argument("--datasets", type=int, default=300)
    p.add_argument("--keep", type=int, default=2, help="steps every node holds")
    p.add_argument("--json", default=None)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="bench-inventory-", dir=args.dir))
    results = []
    try:
        for n in (int(x) for x in args.ranks.split(",")):
            r = measure(n, args.datasets, args.ranks_per_node, args.keep, base)
            results.append(r)
            print(
                f"{r['ranks']} ranks, {r['nodes']} nodes, {r['steps_held']} steps, index "
                f"{r['index_bytes'] / 1e6:.2f} MB: rank 0 receives "
                f"{r['before_received_bytes'] / 1e6:.1f} MB before, "
                f"{r['after_received_bytes'] / 1e6:.1f} MB after "
                f"(broadcast {r['after_broadcast_bytes']} B; {r['after_s']} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    write_json(args.json, results)


if __name__ == "__main__":
    sys.exit(main())
