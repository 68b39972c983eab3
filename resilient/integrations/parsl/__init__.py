"""Parsl integration: resume-aware retries, resumable apps for any program, YAML configs.

Three modules, each usable alone:

* :mod:`~resilient.integrations.parsl.retry` -- :func:`resume_retry_handler`, a
  ``Config(retry_handler=...)`` that charges a failed try by checkpoint progress (0 when it
  committed a newer checkpoint) and sets ``resume_from`` for the next try;
* :mod:`~resilient.integrations.parsl.apps` -- :func:`resumable_apps`: bash apps (any launcher:
  ``mpiexec``, ``srun``, ``$PARSL_MPI_PREFIX``, none) and a python app that run any command or
  module through ``resilient run``;
* :mod:`~resilient.integrations.parsl.config` -- :func:`load_config`, one strict loader for
  ``configs/parsl/*.yaml`` (schema in its docstring).

The core of ``resilient`` never imports this package.
"""

from __future__ import annotations

from resilient.integrations.parsl.apps import (
    Launch,
    ResumableApps,
    RunOptions,
    resilient_argv,
    resilient_command,
    resumable_apps,
    resumable_bash,
    resumable_mpi_bash,
    run_resumable,
)
from resilient.integrations.parsl.config import build_config, load_config
from resilient.integrations.parsl.retry import (
    FAILURE,
    NO_PROGRESS,
    PERMANENT,
    WALLTIME,
    ResumableCommandError,
    classify_failure,
    exit_code_of,
    resume_retry_handler,
)

__all__ = [
    "FAILURE",
    "NO_PROGRESS",
    "PERMANENT",
    "WALLTIME",
    "Launch",
    "ResumableApps",
    "ResumableCommandError",
    "RunOptions",
    "build_config",
    "classify_failure",
    "exit_code_of",
    "load_config",
    "resilient_argv",
    "resilient_command",
    "resume_retry_handler",
    "resumable_apps",
    "resumable_bash",
    "resumable_mpi_bash",
    "run_resumable",
]
