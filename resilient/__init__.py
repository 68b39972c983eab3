"""resilient: checkpoint/restart for long MPI programs under walltime limits.

Importing this package does no work: no MPI initialisation, no signal handlers, no logging setup;
only a cheap look for another vendor's ``resilient`` in the environment (:mod:`resilient._foreign`);
and under ``resilient run`` (or with ``$RESILIENT_WARN_SIGNALS`` set by hand, e.g. in an sbatch
script) a handler that only records the walltime's warning signal, so that one arriving before
the program's ``Session`` exists does not kill it (:mod:`resilient.job.warning`).

The library in layers; each package imports only the ones below it (``lint-imports`` checks it):

    the edges      cli, demo, report, export, config, workflow, integrations (Snakemake, Parsl)
    job            the time loop (Session, @resumable), walltime and signals, ``resilient run``
    checkpoint     saving, committing, restoring and rotating the checkpoints of a set of ranks
    io | parallel  one process's file I/O | the communicator and the one way ranks agree
    model          the on-disk format and the in-memory state, pure
    errors         the exceptions every layer raises
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from resilient._foreign import ForeignPackageWarning, warn_if_foreign
from resilient._version import __version__
from resilient.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CollectiveError,
    CommitError,
    ConfigError,
    ForeignRunError,
    InvalidCheckpointError,
    LayoutMismatchError,
    ResilientError,
    StaticDataError,
)
from resilient.job import warning as _warning

_warning.arm()  # only with $RESILIENT_WARN_SIGNALS set (resilient run exports it)

# `resilient` on PyPI is another vendor's package with the same import package: say so, once.
warn_if_foreign()

if TYPE_CHECKING:
    from resilient.checkpoint.manager import CheckpointManager
    from resilient.job.resumable import Resume, resumable
    from resilient.job.session import Session
    from resilient.model.blocks import Block, BlockSpec, Replicated, block_1d, cartesian_block
    from resilient.model.policies import (
        BeforeWalltime,
        CheckpointInfo,
        EverySeconds,
        EverySteps,
        KeepAll,
        KeepBest,
        KeepEvery,
        KeepLast,
        KeepPolicy,
        OnSignal,
        SaveContext,
        SavePolicy,
        YoungDaly,
    )
    from resilient.model.rngstate import rng_state, set_rng_state
    from resilient.parallel.comm import Comm, SerialComm

# The rest is imported when first used: ``from resilient.job.slurm import StopSignals``, which a
# program runs first thing to catch an early warning signal, must not wait for numpy and the
# checkpoint machinery (~0.1 s, seconds for 4 ranks starting on a busy node).
_LAZY = {
    **dict.fromkeys(
        ("Block", "BlockSpec", "Replicated", "block_1d", "cartesian_block"), "model.blocks"
    ),
    **dict.fromkeys(("Comm", "SerialComm"), "parallel.comm"),
    "CheckpointManager": "checkpoint.manager",
    **dict.fromkeys(
        (
            "BeforeWalltime",
            "CheckpointInfo",
            "EverySeconds",
            "EverySteps",
            "KeepAll",
            "KeepBest",
            "KeepEvery",
            "KeepLast",
            "KeepPolicy",
            "OnSignal",
            "SaveContext",
            "SavePolicy",
            "YoungDaly",
        ),
        "model.policies",
    ),
    **dict.fromkeys(("Resume", "resumable"), "job.resumable"),
    "Session": "job.session",
    **dict.fromkeys(("rng_state", "set_rng_state"), "model.rngstate"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    loaded = importlib.import_module(f"resilient.{module}")
    # bind every name of that module now, as an eager import would
    for other, where in _LAZY.items():
        if where == module:
            globals()[other] = getattr(loaded, other)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "Block",
    "BlockSpec",
    "Replicated",
    "block_1d",
    "cartesian_block",
    "BeforeWalltime",
    "OnSignal",
    "Resume",
    "Session",
    "YoungDaly",
    "resumable",
    "rng_state",
    "set_rng_state",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CollectiveError",
    "Comm",
    "CommitError",
    "ConfigError",
    "ForeignPackageWarning",
    "ForeignRunError",
    "EverySeconds",
    "EverySteps",
    "InvalidCheckpointError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPolicy",
    "LayoutMismatchError",
    "StaticDataError",
    "ResilientError",
    "SaveContext",
    "SavePolicy",
    "SerialComm",
    "__version__",
]
