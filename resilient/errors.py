"""Exceptions raised by :mod:`resilient`.

Every exception passes all of its constructor arguments to ``super().__init__`` so that it
survives pickling (exceptions cross mpi4py messages and Parsl workers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CollectiveError",
    "CommitError",
    "ConfigError",
    "ForeignRunError",
    "InvalidCheckpointError",
    "LayoutMismatchError",
    "RankFailure",
    "ResilientError",
    "StaticDataError",
]


class ResilientError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(ResilientError, ValueError):
    """A setting, policy or argument is invalid."""


class ForeignRunError(ConfigError):
    """The checkpoint directory belongs to another run: another ``run_key``, or restored arrays
    of another shape or dtype than the run's initial state. Retrying cannot help; a
    :class:`~resilient.job.session.Session` exits with ``EXIT_FOREIGN_RUN`` (78)."""


class CheckpointNotFoundError(ResilientError, FileNotFoundError):
    """No (valid) checkpoint exists where one was asked for."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidCheckpointError(ResilientError):
    """A checkpoint failed validation.

    Attributes:
        path: the checkpoint directory or file that failed.
        reason: one line saying what is wrong.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"invalid checkpoint {self.path}: {self.reason}"


class StaticDataError(InvalidCheckpointError):
    """Both copies of a piece of static data are damaged (or its only copy of the data files,
    saved with ``static_copies=1``): the checkpoints that use it cannot be restored, although
    their own files may be intact. Not a reason to quarantine them; retrying cannot help: a
    permanent storage error (a :class:`~resilient.job.session.Session` exits 74, which
    ``resilient run`` does not retry). The message names the files and what the user can do."""

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class LayoutMismatchError(ResilientError):
    """A checkpoint was written with a layout that the current run cannot read.

    Attributes:
        saved: description of the layout on disk.
        current: description of the layout of this run.
        keys: the leaf paths that block a restore on another rank count: per-rank data
            declared neither ``Block`` nor ``Replicated`` (empty when not known).
    """

    def __init__(self, saved: str, current: str, keys: Sequence[str] = ()) -> None:
        super().__init__(saved, current, tuple(keys))
        self.saved = saved
        self.current = current
        self.keys = tuple(keys)

    def __str__(self) -> str:
        text = f"checkpoint layout {self.saved} does not match this run's layout {self.current}; "
        if not self.keys:
            return text + "restart with the same number of ranks and the same checkpoint_comm"
        shown = ", ".join(repr(k) for k in self.keys[:12])
        more = f" and {len(self.keys) - 12} more" if len(self.keys) > 12 else ""
        return text + (
            f"per-rank data not declared Block or Replicated blocks an elastic restore: "
            f"{shown}{more} (restart with the same number of ranks and checkpoint_comm, or "
            "declare them)"
        )


class CommitError(ResilientError):
    """The commit of a checkpoint (manifest, marker, rename) failed.

    Attributes:
        errno: the OS error number behind it, if it was an OS error (e.g. ``ENOSPC``).
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message, errno)
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointLockedError(ResilientError):
    """Another job holds the checkpoint root's lock."""


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, as data (it travels between ranks and processes).

    Attributes:
        rank: the rank (of the communicator of the operation) that failed.
        message: one line: the exception's type and message.
        errno: the OS error number, when the failure was an OS error.
    """

    rank: int
    message: str
    errno: int | None = None


class CollectiveError(ResilientError):
    """A collective operation failed on at least one rank; raised identically on every rank.

    Attributes:
        what: the operation that failed, e.g. ``"save of step 12"``.
        details: rank -> :class:`RankFailure` (message and errno of that rank's error).
        failures: rank -> one-line description of that rank's error.
    """

    def __init__(self, what: str, failures: Mapping[int, str | RankFailure]) -> None:
        details = {
            r: f if isinstance(f, RankFailure) else RankFailure(r, str(f))
            for r, f in failures.items()
        }
        super().__init__(what, details)
        self.what = what
        self.details = details

    @property
    def failures(self) -> dict[int, str]:
        """rank -> one-line description of that rank's error."""
        return {r: f.message for r, f in self.details.items()}

    def __str__(self) -> str:
        ranks = sorted(self.failures)
        first = self.failures[ranks[0]] if ranks else "unknown error"
        return f"{self.what} failed on rank(s) {ranks}: {first}"
