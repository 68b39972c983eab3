"""Where a save is committed: the shared root (by the coordinator) or every node's local tier.

:class:`~resilient.checkpoint.saving.SavePipeline` picks one of these once, when it is made, and
asks it the few things in which the two paths differ, instead of asking "is there a local tier"
at every turn:

* :meth:`make` (coordinator, before a save's first round): the temporary directory in the
  shared root with the data files claimed from a dropped checkpoint, or only the token that
  names every node's own directory;
* :meth:`pending` and :meth:`create` (every rank, after that round): this rank's temporary
  directory, and on a node-local tier its creation by the node's ranks;
* :meth:`partner_copy_job` (every rank, after a local commit): its part of the partner copies;
* :attr:`recycles`: whether the next save writes over the files of a checkpoint that rotation
  dropped.

No method communicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from resilient.checkpoint.saveset import claim_files
from resilient.checkpoint.tiers import LocalCheckpoint, LocalTier
from resilient.io.commit import PendingDir
from resilient.io.targets import Target
from resilient.parallel.setcomms import SetComms

__all__ = ["LocalTierCommit", "Made", "SavePath", "SharedRootCommit"]


@dataclasses.dataclass(frozen=True, slots=True)
class Made:
    """What the coordinator made before a save's first round: the shared root's temporary
    directory and the data files it claimed there (:func:`claim_files`), or, with a node-local
    tier, the token that names every node's own."""

    pending: PendingDir | None
    claimed: frozenset[str]
    token: str


class SharedRootCommit:
    """Saves committed by the coordinator in the shared root (no node-local tier).

    Args:
        shared: the shared root.
        comms: who writes which file.
    """

    __slots__ = ("comms", "shared")

    recycles = True

    def __init__(self, shared: Target, comms: SetComms) -> None:
        self.shared = shared
        self.comms = comms

    @property
    def target(self) -> Target:
        """Where the save's files go: the shared root."""
        return self.shared

    def make(self, step: int, token: str, recycled: Path | None) -> Made:
        """Coordinator: create the save's temporary directory in the shared root and claim the
        data files of ``recycled`` (a checkpoint rotation dropped) in it."""
        pending = self.shared.pending(step, token=token)
        self.shared.create(pending)
        claimed = (
            frozenset() if recycled is None else claim_files(self.comms, recycled, pending.path)
        )
        return Made(pending, claimed, token)

    def pending(self, step: int, made: Made) -> PendingDir:
        """Local: the coordinator's temporary directory, the one of every rank."""
        assert made.pending is not None
        return made.pending

    def create(self, pending: PendingDir) -> Exception | None:
        """Local: nothing (the coordinator created it)."""
        return None

    def partner_copy_job(self, checkpoint: LocalCheckpoint) -> Callable[[], str | None] | None:
        """Local: none (no local checkpoints)."""
        return None


class LocalTierCommit:
    """Saves committed on every node, in its local tier (flushed to the shared root later).

    Args:
        tier: the node-local tier.
    """

    __slots__ = ("tier",)

    recycles = False

    def __init__(self, tier: LocalTier) -> None:
        self.tier = tier

    @property
    def target(self) -> Target:
        """Where the save's files go: this node's local tier."""
        return self.tier.target

    def make(self, step: int, token: str, recycled: Path | None) -> Made:
        """Coordinator: only the token of every node's temporary directory."""
        return Made(None, frozenset(), token)

    def pending(self, step: int, made: Made) -> PendingDir:
        """Local: this node's temporary directory of ``step``."""
        return self.tier.target.pending(step, token=made.token)

    def create(self, pending: PendingDir) -> Exception | None:
        """Local: create this node's temporary directory (every rank of the node may); the error
        that keeps this rank from writing, if any."""
        try:
            self.tier.target.create(pending, shared=True)
        except Exception as exc:  # raised on every rank once every rank has written
            return exc
        return None

    def partner_copy_job(self, checkpoint: LocalCheckpoint) -> Callable[[], str | None] | None:
        """See :meth:`~resilient.checkpoint.tiers.LocalTier.partner_copy_job`."""
        return self.tier.partner_copy_job(checkpoint)


SavePath = SharedRootCommit | LocalTierCommit
