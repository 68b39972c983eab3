"""How much the heat app's step loop slows while an asynchronous save drains (4 ranks).

Usage::

    mpiexec -n 4 python bench/bench_heat_overlap.py --nx 4096 --ny 4096 --saves 6

Runs the heat app's own decomposition and kernel (``apps.heat``: ``Domain``, ``advance``) with
a :class:`~resilient.checkpoint.manager.CheckpointManager` and times every step on every rank (max over
ranks, each step ends with the halo exchange, so the ranks run in lockstep). Every
``--every`` steps it saves ``{"u": u}`` with ``blocking=False`` and calls ``poll()`` after each
step (what ``Session(async_save=True)`` does), so each step is either *quiet* (nothing in flight)
or *draining* (a save in flight). Printed: the median step time of each kind, their ratio (the
slowdown while a save drains; target <= 1.10), the median time ``save()`` blocked, and the
same for synchronous saves for comparison (``--sync``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the apps/ package

from apps.heat import Domain, advance, initial_state
from resilient import CheckpointManager, KeepLast


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nx", type=int, default=4096)
    p.add_argument("--ny", type=int, default=4096)
    p.add_argument("--every", type=int, default=40, help="steps between saves")
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--comm", default="self", choices=["self", "node", "world"])
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    base = comm.bcast(
        tempfile.mkdtemp(prefix="bench-heat-", dir=args.dir) if comm.rank == 0 else None
    )
    dom = Domain(comm, args.nx, args.ny)
    state, static = initial_state(dom)
    u, kappa = state["u"], static["kappa"]
    mgr = CheckpointManager(
        Path(base) / "ck", comm=comm, checkpoint_comm=args.comm, keep=KeepLast(2)
    )
    quiet: list[float] = []
    draining: list[float] = []
    blocked: list[float] = []
    steps = args.every * (args.saves + 1)
    for step in range(1, steps + 1):
        in_flight = mgr.in_flight
        comm.Barrier()
        t0 = time.perf_counter()
        u = advance(dom, u, kappa, 0.2)
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if step > args.every:  # the first interval warms up (buffers, page cache, writer thread)
            (draining if in_flight else quiet).append(dt)
        if step % args.every == 0:
            comm.Barrier()
            t0 = time.perf_counter()
            mgr.save(step, {"u": u}, blocking=False)
            b = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if step > args.every:
                blocked.append(b)
        mgr.poll()
    mgr.close()
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        q, d = statistics.median(quiet), statistics.median(draining)
        mib = 8 * (args.nx + 2 * int(np.sqrt(comm.size))) * args.ny / 2**20
        doc = {
            "ranks": comm.size, "grid": [args.nx, args.ny], "state_mib_total": round(mib),
            "quiet_steps": len(quiet), "draining_steps": len(draining),
            "quiet_step_s": q, "draining_step_s": d, "slowdown": d / q,
            "save_blocked_s": statistics.median(blocked),
        }  # fmt: skip
        print(
            f"{comm.size} ranks, {args.nx}x{args.ny} grid (~{mib:.0f} MiB), {args.comm} files: "
            f"step {q * 1e3:.1f} ms quiet vs {d * 1e3:.1f} ms while a save drains "
            f"({len(draining)} steps): slowdown {d / q:.2f}x (target <= 1.10); "
            f"save() blocked {statistics.median(blocked) * 1e3:.1f} ms"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
