"""The example campaign's Parsl apps: plain ``@python_app`` and ``@bash_app``, as a user writes them.

The heat case is a three-stage DAG::

    case = prepare(params, outputs=[File("results/heat/hot.json")])
    sim = simulate(ckpt, ranks=4, inputs=[case.outputs[0]], outputs=[File("results/heat/hot.h5")])
    summary = analyse(inputs=[sim.outputs[0]], outputs=[File("results/heat/hot-summary.json")])

``simulate`` and ``train`` return :func:`~resilient.integrations.parsl.resilient_command`: the
program runs under ``resilient run`` and resumes from its newest valid checkpoint in ``ckpt``
on every try. With ``parsl_resource_specification`` (an ``MPIExecutor``) the ranks are started
by ``$PARSL_MPI_PREFIX``, else by ``mpiexec -n ranks``. The programs run in the repository
root (``python -m apps.heat`` needs it).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from parsl import bash_app, python_app

from resilient.integrations.parsl import resilient_command
from resilient.job.launch import find_mpiexec

__all__ = ["analyse", "mpi_resources", "prepare", "simulate", "train"]

REPO = Path(__file__).resolve().parent.parent


def mpi_resources(ranks: int, nodes: int = 1) -> dict[str, int]:
    """An ``MPIExecutor``'s ``parsl_resource_specification`` for ``ranks`` ranks on ``nodes``."""
    return {"num_nodes": nodes, "ranks_per_node": -(-ranks // nodes), "num_ranks": ranks}


def _in_repo(
    program: Sequence[Any], ckpt: str, ranks: int, mpi: bool, options: Mapping[str, Any]
) -> str:
    """``cd REPO && resilient run ... -- LAUNCHER PROGRAM`` (on the worker)."""
    if mpi:
        command = resilient_command(
            program, checkpoint_dir=ckpt, launcher_prefix="$PARSL_MPI_PREFIX", **options
        )
    else:
        launcher = [find_mpiexec(), "-n", ranks]
        command = resilient_command([*launcher, *program], checkpoint_dir=ckpt, **options)
    return f"cd {shlex.quote(str(REPO))} && {command}"


def _optional(flag: str, value: Any) -> list[Any]:
    return [] if value is None else [flag, value]


@python_app
def prepare(case: Mapping[str, Any], outputs: Sequence[Any] = ()) -> dict[str, Any]:
    """Write the heat case's parameters (JSON) to ``outputs[0]``; return them."""
    path = Path(outputs[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(case), indent=2, sort_keys=True) + "\n")
    return dict(case)


@bash_app
def simulate(
    ckpt: str,
    *,
    ranks: int,
    checkpoint_every: int | None = None,
    step_delay: float = 0.0,
    policy: str | None = None,
    walltime_s: float | None = None,
    signal: str | None = None,
    max_no_progress: int | None = None,
    inputs: Sequence[Any] = (),
    outputs: Sequence[Any] = (),
    stdout: Any = None,
    stderr: Any = None,
    parsl_resource_specification: Mapping[str, Any] | None = None,
) -> str:
    """``apps.heat`` with the parameters in ``inputs[0]`` (JSON), the field to ``outputs[0]``."""
    case = json.loads(Path(inputs[0]).read_text())
    program = [
        sys.executable, "-m", "apps.heat", "--nx", case["nx"], "--ny", case["ny"],
        "--steps", case["steps"], "--alpha", repr(float(case["alpha"])),
        "--checkpoint-dir", ckpt, "--out", outputs[0], "--step-delay", repr(float(step_delay)),
        *_optional("--checkpoint-every", checkpoint_every), *_optional("--config", policy),
    ]  # fmt: skip
    options = {"walltime_s": walltime_s, "signal": signal, "max_no_progress": max_no_progress}
    return _in_repo(program, ckpt, ranks, parsl_resource_specification is not None, options)


@bash_app
def train(
    module: str,
    ckpt: str,
    *,
    ranks: int,
    steps: int,
    strategy: str | None = None,
    checkpoint_every: int | None = None,
    step_delay: float = 0.0,
    policy: str | None = None,
    walltime_s: float | None = None,
    signal: str | None = None,
    max_no_progress: int | None = None,
    outputs: Sequence[Any] = (),
    stdout: Any = None,
    stderr: Any = None,
    parsl_resource_specification: Mapping[str, Any] | None = None,
) -> str:
    """``python -m MODULE`` (``apps.train`` or ``apps.train_torch``), the model to ``outputs[0]``;
    ``strategy``: apps.train_torch's ``--strategy`` (ddp, fsdp2)."""
    program = [
        sys.executable, "-m", module, "--steps", steps, "--checkpoint-dir", ckpt,
        "--out", outputs[0], "--step-delay", repr(float(step_delay)),
        *_optional("--strategy", strategy), *_optional("--checkpoint-every", checkpoint_every),
        *_optional("--config", policy),
    ]  # fmt: skip
    options = {"walltime_s": walltime_s, "signal": signal, "max_no_progress": max_no_progress}
    return _in_repo(program, ckpt, ranks, parsl_resource_specification is not None, options)


@python_app
def analyse(inputs: Sequence[Any] = (), outputs: Sequence[Any] = ()) -> dict[str, Any]:
    """Summarise the heat field in ``inputs[0]`` (steps, ranks, min, max, mean) into ``outputs[0]``."""
    import h5py

    with h5py.File(Path(inputs[0])) as f:
        field = f["T"][()]
        summary = {
            "field": str(inputs[0]),
            "steps": int(f.attrs["steps"]),
            "ranks": int(f.attrs["ranks"]),
            "shape": list(field.shape),
            "min": float(field.min()),
            "max": float(field.max()),
            "mean": float(field.mean()),
        }
    path = Path(outputs[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
