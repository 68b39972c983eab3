"""A user's own MPI program (docs/howto/parsl.md): a time loop under a Session.

    mpiexec -n 2 python sim.py ALPHA STEPS OUT INIT STEP_DELAY

The checkpoint directory comes from $RESILIENT_CHECKPOINT_DIR, which `resilient run` sets.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from resilient import Session

alpha, steps, out, init = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
comm = MPI.COMM_WORLD
with Session(comm=comm, margin_s=0.5, run_key={"alpha": alpha}) as s:  # $RESILIENT_CHECKPOINT_DIR
    step, state = s.restore_or({"x": np.loadtxt(init)})
    x = state["x"]
    while step < steps and not s.should_stop():
        x = x + alpha * np.sin(x) + comm.allreduce(float(x.sum())) * 1e-6
        step += 1
        time.sleep(float(sys.argv[5]))
        s.maybe_save(step, {"x": x})
if comm.rank == 0:
    np.savetxt(out, x)
