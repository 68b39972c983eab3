"""A user's program written from the README (tests/test_warn_signal.py): slow imports, a Session,
the output written after the block. Nothing in it handles signals.

    python readme_program.py OUT STEPS

Environment: ``PROG_IMPORT_S`` (the slow imports, default 1.5 s), ``PROG_STEP_S`` (0.05),
``PROG_WRITE_S`` (writing the output, 1.0). Test probes: ``PROG_IMPORT_FIRST=1`` imports
resilient before the slow imports (what a program started by ``srun`` needs), and
``PROG_UNTIL_WARNED=1`` ends the slow imports 1 s after a warning signal was recorded. Rank 0
prints ``probe imports-done=T block-end=T written=T`` (Unix times) to stderr.
"""

import os
import sys
import time

if os.environ.get("PROG_IMPORT_FIRST") == "1":
    import resilient  # noqa: F401

# Slow imports (a big library, a model): the warning signal may land here.
_until = time.time() + float(os.environ.get("PROG_IMPORT_S", "1.5"))
while time.time() < _until:
    time.sleep(0.1)
    if os.environ.get("PROG_UNTIL_WARNED") == "1":
        from resilient.job import warning

        if warning._early:
            _until = min(_until, time.time() + 1.0)

import json  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from resilient import EverySteps, KeepLast, OnSignal, Session  # noqa: E402

imports_done = time.time()
out, steps = sys.argv[1], int(sys.argv[2])
step_s = float(os.environ.get("PROG_STEP_S", "0.05"))
write_s = float(os.environ.get("PROG_WRITE_S", "1.0"))
comm = MPI.COMM_WORLD

with Session(comm=comm, save_when=EverySteps(5) | OnSignal(), keep=KeepLast(2), margin_s=0.5) as s:
    step, state = s.restore_or({"x": np.zeros(3)})
    while step < steps and not s.should_stop():
        state = {"x": state["x"] + 1.0}
        step += 1
        time.sleep(step_s)
        s.maybe_save(step, state)
block_end = time.time()

# Finished: write the output (slowly: the warning signal may land here).
time.sleep(write_s)
if comm.rank == 0:
    with open(out + ".tmp", "w") as fh:
        json.dump({"step": step, "x": state["x"].tolist(), "ranks": comm.size}, fh)
    os.replace(out + ".tmp", out)
    print(
        f"probe imports-done={imports_done:.3f} block-end={block_end:.3f} written={time.time():.3f}",
        file=sys.stderr,
        flush=True,
    )
