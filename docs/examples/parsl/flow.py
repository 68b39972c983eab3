"""A user's own Parsl script (docs/howto/parsl.md): prepare -> simulate (resumable) -> analyse.

    python flow.py ALPHA MPIEXEC [CHECKPOINT_DIR]

Parsl sends the apps to the worker by value, without this script's module-level names: the
imports an app needs are inside it.
"""

import sys

import parsl
from parsl import File, bash_app, python_app
from parsl.config import Config
from parsl.executors import HighThroughputExecutor
from parsl.providers import LocalProvider

from resilient.integrations.parsl import resume_retry_handler
from resilient.workflow import checkpoint_dir


@python_app
def prepare(outputs=()):
    import numpy as np

    np.savetxt(outputs[0], np.linspace(0, 1, 8))


@bash_app
def simulate(alpha, ck, mpiexec, inputs=(), outputs=(), stdout=None, stderr=None):
    import sys

    from resilient.integrations.parsl import resilient_command

    return resilient_command(
        [mpiexec, "-n", 2, sys.executable, "sim.py", alpha, 400, outputs[0], inputs[0], 0.05],
        checkpoint_dir=ck,
        walltime_s=10,
        signal="USR1@1",
    )


@python_app
def analyse(inputs=()):
    import numpy as np

    return float(np.loadtxt(inputs[0]).sum())


alpha, mpiexec = float(sys.argv[1]), sys.argv[2]
ck = sys.argv[3] if len(sys.argv) > 3 else checkpoint_dir("ckpt", "sim", {"alpha": alpha})
parsl.load(
    Config(
        executors=[HighThroughputExecutor(provider=LocalProvider())],
        retries=1,
        retry_handler=resume_retry_handler(),
        run_dir="runinfo",
    )
)
try:
    p = prepare(outputs=[File("init.txt")])
    s = simulate(
        alpha,
        ck,
        mpiexec,
        inputs=[p.outputs[0]],
        outputs=[File(f"out-{alpha}.txt")],
        stdout="sim.out",
        stderr="sim.err",
    )
    a = analyse(inputs=[s.outputs[0]])
    try:
        print("RESULT", a.result())
    except Exception as exc:
        print("FAILED", type(exc).__name__)
    print("TRIES", s.task_record["try_id"] + 1, "COST", s.task_record["fail_cost"])
    print("SIM", type(s.exception()).__name__)
finally:
    parsl.dfk().cleanup()
