"""A program whose Session keeps its checkpoints in a directory of its own choosing (not
``$RESILIENT_CHECKPOINT_DIR``), for the ``resilient run`` hand-off tests.

    python tests/mpi/own_dir.py DIR [--steps N] [--delay S] [--startup S] [--stall S] [--mpi]

``DIR``: its checkpoint directory; ``-``: none (``Session()`` reads ``$RESILIENT_CHECKPOINT_DIR``).
``--startup``: seconds slept before the Session is made (slow imports); ``--stall``: seconds
slept after it is made, before the restore (a start-up that never ends). ``--mpi``: the
Session runs over MPI.COMM_WORLD. Writes ``DIR/out.txt`` (the final counter) when it finishes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from resilient import EverySteps
from resilient.job.session import Session


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--startup", type=float, default=0.0)
    p.add_argument("--stall", type=float, default=0.0)
    p.add_argument("--mpi", action="store_true")
    args = p.parse_args()
    comm = None
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    time.sleep(args.startup)
    root = None if args.dir == "-" else args.dir
    with Session(root, comm=comm, save_when=EverySteps(5), margin_s=0.3) as s:
        time.sleep(args.stall)
        step, state = s.restore_or({"x": np.zeros(4)})
        x = state["x"]
        while step < args.steps and not s.should_stop():
            time.sleep(args.delay)
            x = x + 1.0
            step += 1
            s.maybe_save(step, {"x": x})
    if getattr(comm, "rank", 0) == 0:
        with open(f"{s.root}/out.txt", "w") as fh:
            fh.write(f"{step} {float(x[0])}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
