"""resilient: checkpoint/restart for long MPI programs under walltime limits.

Importing this package does no work: no MPI initialisation, no signal handlers, no logging setup.
"""

from __future__ import annotations

from resilient._version import __version__
from resilient.blocks import Block, BlockSpec, Replicated, block_1d, cartesian_block
from resilient.comm import Comm, SerialComm
from resilient.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CollectiveError,
    CommitError,
    ConfigError,
    InvalidCheckpointError,
    LayoutMismatchError,
    ResilientError,
)
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
