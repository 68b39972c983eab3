"""The example campaign's programs (``apps.heat``, ``apps.train``, ``apps.train_torch``) as Parsl apps.

Built on the library's generic apps (:func:`resilient.integrations.parsl.resumable_apps`): this
module only knows the programs' command lines. The tasks run in the repository root
(``python -m apps.heat`` needs it)::

    apps = CampaignApps(cwd=REPO)
    future = apps.submit("heat", nx=256, ny=256, steps=2000, ranks=4,
                         checkpoint_dir="ckpt/heat/hot", out="results/hot.h5")
    future = apps.submit("train", steps=400, ranks=2, mpi=True, ...)   # on an MPIExecutor
    future = apps.submit("train_torch", steps=400, ranks=2, ...)       # PyTorch DDP (gloo)

``apps.train_torch`` takes the same arguments as ``apps.train``; it reads its rank from the
launcher's environment (``mpiexec``, ``srun``) and never initialises MPI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from resilient.integrations.parsl import Launch, RunOptions, resumable_apps

__all__ = ["PROGRAMS", "CampaignApps", "heat_args", "train_args"]

PathLike = str | os.PathLike[str]


def _opt(flag: str, value: Any) -> list[str]:
    return [] if value is None else [flag, str(value)]


def heat_args(
    *, nx: int, ny: int, steps: int, out: str, checkpoint_dir: str, alpha: float = 0.2,
    checkpoint_every: int | None = None, step_delay: float = 0.0, config: str | None = None,
) -> list[str]:  # fmt: skip
    """Arguments of ``python -m apps.heat``."""
    return [
        "--nx", str(nx), "--ny", str(ny), "--steps", str(steps), "--alpha", repr(float(alpha)),
        "--checkpoint-dir", checkpoint_dir, "--out", out,
        *_opt("--checkpoint-every", checkpoint_every), "--step-delay", repr(float(step_delay)),
        *_opt("--config", config),
    ]  # fmt: skip


def train_args(
    *, steps: int, out: str, checkpoint_dir: str, checkpoint_every: int | None = None,
    step_delay: float = 0.0, config: str | None = None,
) -> list[str]:  # fmt: skip
    """Arguments of ``python -m apps.train``."""
    return [
        "--steps", str(steps), "--checkpoint-dir", checkpoint_dir, "--out", out,
        *_opt("--checkpoint-every", checkpoint_every), "--step-delay", repr(float(step_delay)),
        *_opt("--config", config),
    ]  # fmt: skip


PROGRAMS: dict[str, tuple[str, Callable[..., list[str]]]] = {
    "heat": ("apps.heat", heat_args),
    "train": ("apps.train", train_args),
    "train_torch": ("apps.train_torch", train_args),
}
_PATHS = ("checkpoint_dir", "out", "config")


class CampaignApps:
    """Submits the campaign's programs through ``resilient run`` (see the module docstring).

    Args:
        cwd: where the programs run; relative paths are resolved against it.
        executors: the Parsl executors the apps may use.
    """

    def __init__(self, *, cwd: PathLike, executors: str | list[str] = "all") -> None:
        self.cwd = Path(cwd).resolve()
        self.apps = resumable_apps(executors, cwd=self.cwd)

    def submit(
        self,
        program: str,
        *,
        ranks: int,
        mpi: bool = False,
        walltime_s: float | None = None,
        max_no_progress: int = 2,
        run_extra: Sequence[str] = (),
        stdout: str | None = None,
        stderr: str | None = None,
        **params: Any,
    ) -> Any:
        """Submit ``program`` (``heat``, ``train``, ``train_torch``) with its parameters; returns
        the future.

        ``mpi`` runs it on an ``MPIExecutor`` (ranks started by ``$PARSL_MPI_PREFIX``), else
        it is started by ``mpiexec -n ranks``.
        """
        module, build = PROGRAMS[program]
        for name in _PATHS:
            if params.get(name) is not None:
                params[name] = str(self.cwd / os.fspath(params[name]))
        run = RunOptions(
            walltime_s=walltime_s, max_no_progress=max_no_progress, extra=tuple(run_extra)
        )
        common = {
            "module": module, "args": build(**params), "checkpoint_dir": params["checkpoint_dir"],
            "run": run, "stdout": stdout, "stderr": stderr,
        }  # fmt: skip
        if mpi:
            return self.apps.mpi_bash(ranks=ranks, **common)
        return self.apps.bash(launch=Launch(launcher="mpiexec", ranks=ranks), **common)
