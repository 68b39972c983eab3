"""Heat spreading along a ring of cells split over the MPI ranks: the tutorial's program.

Run it: mpiexec -n 2 python heat1d.py --checkpoint-dir ckpt/first --out first.npy
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from resilient import EverySteps, KeepLast, OnSignal, Session

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--cells", type=int, default=50, help="cells per rank")
parser.add_argument("--work", type=float, default=0.02, help="seconds of pretend work per step")
parser.add_argument("--checkpoint-dir", help="default: $RESILIENT_CHECKPOINT_DIR")
parser.add_argument("--out", default="heat.npy")
args = parser.parse_args()

comm = MPI.COMM_WORLD
left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
u0 = np.zeros(args.cells)
u0[0] = 100.0 if comm.rank == 0 else 0.0  # one hot cell

with Session(
    args.checkpoint_dir, comm=comm, checkpoint_comm="node",
    save_when=EverySteps(100) | OnSignal(), keep=KeepLast(2), margin_s=2.0,
    run_key={"cells": args.cells, "ranks": comm.size},
) as s:  # fmt: skip
    step, state = s.restore_or({"u": u0})
    u = state["u"]
    while step < args.steps and not s.should_stop():
        from_left = comm.sendrecv(u[-1], dest=right, source=left)
        from_right = comm.sendrecv(u[0], dest=left, source=right)
        padded = np.concatenate(([from_left], u, [from_right]))
        u = u + 0.25 * (padded[:-2] - 2 * u + padded[2:])
        time.sleep(args.work)
        step += 1
        s.maybe_save(step, {"u": u})

# Only a finished run gets here: a stopped one saved a checkpoint and exited 75 above.
whole = comm.gather(u, root=0)
if comm.rank == 0:
    np.save(args.out, np.concatenate(whole))
    print(f"finished at step {step}: wrote {args.out}")
