"""What partner copies cost: the blocked time of an asynchronous save and the time until a
checkpoint is protected, against the same save without partner copies and a raw write.

Usage (from the repository root, with the project's environment; two MPI nodes of this machine)::

    mpiexec -n 4 -hosts nodeA:2,nodeB:2 -launcher fork python bench/bench_partner.py --runs 7

Every rank holds one prefaulted float64 buffer of ``--mib`` MiB (default 128). Each round runs,
in a shuffled order, with a pause of ``--gap`` seconds before each save (the program's compute,
during which the previous save's background work finishes):

| mode | what |
|---|---|
| `raw` | each rank: a new file in its node's directory, `pwrite`, `fsync` (the physical limit) |
| `local` | `save(blocking=False)` to the node-local tier without partner copies, then `wait()` |
| `partner` | the same with `redundancy="partner"`: `wait()` also waits for the copy to the next node |

Printed (rank 0, medians over ``--runs`` rounds after one warm-up round; min and max too):
``blocked`` = the time ``save()`` took (the program's pause: a memory copy, plus finishing the
previous save's background work), ``done`` = from the start of ``save()`` to the end of
``wait()`` (``local``: the local copy committed; ``partner``: protected too). Ratios:
``partner blocked / local blocked`` (target <= 1.1), ``partner done / local done`` (the time
until protected against the local write, target <= 2) and ``local done / raw``.

On this machine both "nodes" share one disk, so the partner copy's writes compete with the
local writes of the other node (on a cluster each node has its own). Shared-root flushes are
off (``flush_every`` 10**6) so that only the local tier and its copies are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from resilient import CheckpointManager  # noqa: E402
from resilient.parallel.nodes import node_label  # noqa: E402

COMM = MPI.COMM_WORLD
MODES = ("raw", "local", "partner")


def sleep_barrier() -> None:
    req = COMM.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def raw_write(path: Path, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(buf).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=128.0, help="MiB per rank")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--gap", type=float, default=3.0, help="seconds of 'compute' before a save")
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the nodes' dirs go")
    p.add_argument("--seed", type=int, default=20261125)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rank, node = COMM.rank, node_label()
    base = Path(COMM.bcast(str(args.dir / f"bench-partner-{os.getpid()}") if rank == 0 else None))
    local = f"{base}/local/$PMI_HOSTNAME"
    n = int(args.mib * (1 << 20) // 8)
    rng_data = np.random.default_rng(rank)
    buf = rng_data.standard_normal(n)
    managers = {
        mode: CheckpointManager(
            base / f"shared-{mode}",
            comm=COMM,
            checkpoint_comm="self",
            local_dir=local,
            flush_every=10**6,
            redundancy="partner" if mode == "partner" else None,
        )
        for mode in ("local", "partner")
    }
    raw_dir = base / "raw" / node
    raw_dir.mkdir(parents=True, exist_ok=True)
    nodes = len({x for x in COMM.allgather(node)})
    order_rng = random.Random(args.seed)
    times: dict[str, dict[str, list[float]]] = {m: {"blocked": [], "done": []} for m in MODES}
    step = 0
    for round_ in range(args.runs + 1):  # round 0 warms up
        modes = list(MODES)
        order_rng.shuffle(modes)
        modes = COMM.bcast(modes)
        for mode in modes:
            step += 1
            buf[0] = step  # a new checkpoint each time
            time.sleep(args.gap)
            sleep_barrier()
            t0 = time.perf_counter()
            if mode == "raw":
                raw_write(raw_dir / f"rank{rank}.bin", buf)
                blocked = time.perf_counter() - t0
            else:
                managers[mode].save(step, {"x": buf}, blocking=False)
                blocked = time.perf_counter() - t0
                managers[mode].wait()
            sleep_barrier()
            done = time.perf_counter() - t0
            blocked = COMM.allreduce(blocked, op=MPI.MAX)
            if round_ > 0:
                times[mode]["blocked"].append(blocked)
                times[mode]["done"].append(done)
    for m in managers.values():
        m.close()
    if rank == 0:
        med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
        total = args.mib * COMM.size
        print(f"partner cost: {COMM.size} ranks on {nodes} nodes x {args.mib:g} MiB "
              f"({total:g} MiB per save), {args.runs} rounds, gap {args.gap} s")  # fmt: skip
        print(f"{'mode':8} {'blocked med':>12} {'min':>8} {'max':>8} {'done med':>10} "
              f"{'min':>8} {'max':>8}")  # fmt: skip
        for mode in MODES:
            b, d = times[mode]["blocked"], times[mode]["done"]
            print(f"{mode:8} {statistics.median(b):12.4f} {min(b):8.4f} {max(b):8.4f} "
                  f"{statistics.median(d):10.3f} {min(d):8.3f} {max(d):8.3f}")  # fmt: skip
        ratios = {
            "blocked_partner_over_local": med["partner"]["blocked"] / med["local"]["blocked"],
            "protected_over_local_write": med["partner"]["done"] / med["local"]["done"],
            "local_write_over_raw": med["local"]["done"] / med["raw"]["done"],
        }
        for name, value in ratios.items():
            print(f"{name}: {value:.2f}")
        if args.json:
            doc: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                                   "ranks": COMM.size, "nodes": nodes, "times": times,
                                   "medians": med, "ratios": ratios}  # fmt: skip
            args.json.write_text(json.dumps(doc, indent=1))
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
