"""resilient: checkpoint/restart for long MPI programs under walltime limits.

Importing this package does no work: no MPI initialisation, no signal handlers, no logging setup.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
)

if TYPE_CHECKING:
    from resilient.blocks import Block, BlockSpec, Replicated, block_1d, cartesian_block
    from resilient.comm import Comm, SerialComm
    from resilient.manager import CheckpointManager
    from resilient.policies import (
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
    from resilient.resumable import Resume, resumable
    from resilient.session import Session

# The rest is imported when first used: ``from resilient.slurm import StopSignals``, which a
# program runs first thing to catch an early warning signal, must not wait for numpy and the
# checkpoint machinery (~0.1 s, seconds for 4 ranks starting on a busy node).
_LAZY = {
    **dict.fromkeys(("Block", "BlockSpec", "Replicated", "block_1d", "cartesian_block"), "blocks"),
    **dict.fromkeys(("Comm", "SerialComm"), "comm"),
    "CheckpointManager": "manager",
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
        "policies",
    ),
    **dict.fromkeys(("Resume", "resumable"), "resumable"),
    "Session": "session",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    loaded = importlib.import_module(f"resilient.{module}")
    # bind every name of that module now: importing resilient.resumable made the package's
    # ``resumable`` the module, and the function must win, as with an eager import
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
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CollectiveError",
    "Comm",
    "CommitError",
    "ConfigError",
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
    "ResilientError",
    "SaveContext",
    "SavePolicy",
    "SerialComm",
    "__version__",
]
