"""Where saves are committed and restores look first: the shared root alone, or a node-local tier.

:class:`~resilient.checkpoint.saving.SavePipeline` picks a :class:`SavePath` once, when it is
made, and asks it the few things in which the two paths differ, instead of asking "is there a
local tier" at every turn: :class:`SharedRootSaves` (this module: saves committed by the
coordinator in the shared root) or
:class:`~resilient.checkpoint.tiermanager.LocalTierManager` (every node commits its own copy;
partner copies, flushes and the local restore chain are its own). Both write the shared root's
records through one :class:`SharedRoot`.

Which calls are collective (over the checkpoint set's communicator):

* :meth:`SavePath.make` (coordinator, before a save's first round): the temporary directory in
  the shared root with the data files claimed from a dropped checkpoint, or only the token that
  names every node's own directory; local.
* :meth:`SavePath.pending` and :meth:`SavePath.create` (every rank, after that round): this
  rank's temporary directory, and on a node-local tier its creation by the node's ranks; local.
* :meth:`SavePath.commit` (collective): commit a save every rank has written;
  :meth:`SavePath.after_save` (collective) then starts what a commit leaves to the background
  (partner copies, a flush), as a :class:`Flight` the pipeline finishes (:meth:`Flight.finish`:
  collective; :meth:`Flight.done`: local).
* :meth:`SavePath.flush` (collective): start copying what is not in the shared root yet.
* :meth:`SavePath.restore` (collective): the restore chain.
* :meth:`SavePath.close` (local).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from resilient._version import __version__
from resilient.checkpoint.catalog import Catalog, save_record
from resilient.checkpoint.restorer import Restorer, StateValidator
from resilient.checkpoint.saveset import RankWritten, commit_set, gather_set
from resilient.checkpoint.statics import StaticStore
from resilient.errors import CollectiveError, ResilientError
from resilient.io import storage
from resilient.io.commit import PendingDir
from resilient.io.storage import Trash
from resilient.io.targets import Target
from resilient.model import filenames
from resilient.model.blocks import BlockSpec
from resilient.model.manifest import Manifest
from resilient.model.payload import SaveRequest
from resilient.model.policies import KeepPolicyLike
from resilient.parallel.collective import Collective, Gathered, failure_of
from resilient.parallel.setcomms import SetComms

__all__ = [
    "Flight",
    "Made",
    "SavePath",
    "SharedRoot",
    "SharedRootSaves",
    "Written",
    "failed_after_commit",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Made:
    """What the coordinator made before a save's first round: the shared root's temporary
    directory and the data files it claimed there (:meth:`~resilient.io.targets.Target.reuse`), or, with a node-local
    tier, the token that names every node's own."""

    pending: PendingDir | None
    claimed: frozenset[str]
    token: str


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """A save every rank has written (or failed to): what its commit needs.

    Attributes:
        request: this rank's checked arguments.
        static: the static data's content hash (``None``: none).
        pending: the checkpoint's temporary directory (this node's, with a node-local tier).
        written: this rank's outcome, its data durable, or the error of its write.
        start: when the save started (the pipeline's clock).
    """

    request: SaveRequest
    static: str | None
    pending: PendingDir
    written: RankWritten | Exception
    start: float


class Flight(Protocol):
    """Background work a commit left (partner copies, a flush), finished by the pipeline."""

    def done(self) -> bool:
        """Local: whether this rank's part is done."""
        ...

    def finish(self) -> Flight | None:
        """Collective: finish it; the work it starts in turn, if any."""
        ...


class SavePath(Protocol):
    """Where a save is committed and where a restore looks first (see the module's docstring
    for which calls are collective)."""

    @property
    def target(self) -> Target:
        """Where a save's files are written (the shared root, or this node's local tier)."""
        ...

    def make(self, step: int, token: str) -> Made: ...

    def pending(self, step: int, made: Made) -> PendingDir: ...

    def create(self, pending: PendingDir) -> Exception | None: ...

    def commit(self, save: Written) -> None: ...

    def after_save(self) -> Flight | None: ...

    def flush(self) -> Flight | None: ...

    def restore(
        self,
        restorer: Restorer,
        step: int | None,
        *,
        validate: StateValidator | None,
        into: Mapping[str, Any] | None,
        blocks: Mapping[str, BlockSpec],
        refused: Exception | None,
    ) -> tuple[int, dict[str, Any]]: ...

    def close(self) -> None: ...


class SharedRoot:
    """The shared root as the saves see it: its target, its history (for rotation), the
    checkpoint rotation dropped last and the static data the last save referred to. Used on
    the caller's thread only; every method is local (the coordinator's, where it says so).

    Args:
        target: the shared checkpoint root's target.
        catalog: the shared root's history, for rotation.
        statics: the shared root's static data.
        keep: keep policy of the shared root (``None`` keeps everything).
        deleter: deletes what rotation drops, in the background.
        clock: monotonic clock.
    """

    def __init__(
        self,
        target: Target,
        *,
        catalog: Catalog,
        statics: StaticStore,
        keep: KeepPolicyLike | None,
        deleter: storage.BackgroundDeleter,
        clock: Callable[[], float],
    ) -> None:
        self.target = target
        self.catalog = catalog
        self.statics = statics
        self.keep = keep
        self.deleter = deleter
        self.clock = clock
        # a checkpoint that rotation dropped, whose data files the next save writes over
        # (:meth:`~resilient.io.targets.Target.reuse`); the same on every rank
        self.recycled: Trash | None = None
        # the static content the last save referred to, known stored by every rank
        self.static_known: str | None = None

    def after_commit(
        self, manifest: Manifest, start: float, *, flushed: bool = False
    ) -> Trash | None:
        """Coordinator: log the save (or flush), then rotate (a failed rotation only warns).

        Returns the newest checkpoint that rotation dropped, kept for the next save to write
        over its files (not after a flush: a node-local tier's saves write on the nodes); the
        one kept before, and the rest of the trash, are deleted in the background."""
        took = round(self.clock() - start, 6)
        extra = {"flush_s": took, "tier": "local"} if flushed else {"cost_s": took}
        self.target.append_record(
            filenames.SAVE_LOG,
            {"time": time.time(), **extra, "bytes": manifest.nbytes, **save_record(manifest)},
        )
        if self.keep is None:
            return None  # nothing is ever deleted: no need to know the history
        try:
            self.catalog.add(manifest)
            trashed = self.catalog.apply(self.catalog.plan(self.keep))
        except (OSError, ResilientError) as exc:
            log.warning("rotation in %s failed (checkpoints are intact): %s", self.target, exc)
            return self.recycled
        reuse = trashed.checkpoints[-1] if trashed.checkpoints and not flushed else None
        drop = [t for t in (self.recycled, *trashed.all) if t is not None and t is not reuse]
        self.deleter.delete(drop)
        return reuse

    def still_stored(self, static: str | None) -> bool:
        """Coordinator, after rotation: whether the static content ``static`` is stored."""
        return static is not None and self.statics.is_stored(static)

    def close(self, *, coordinator: bool) -> None:
        """Local: the coordinator deletes the checkpoint kept to write over."""
        if self.recycled is not None and coordinator:
            self.deleter.delete([self.recycled])
        self.recycled = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Committed:
    """What the coordinator announces after a commit in the shared root: the newest
    checkpoint that rotation dropped (its files for the next save to write over), and whether
    the static data the checkpoint refers to is still known to be stored."""

    recycled: Trash | None
    static_known: bool


class SharedRootSaves:
    """Saves committed by the coordinator in the shared root (no node-local tier).

    Args:
        shared: the shared root.
        comms: who writes which file.
    """

    __slots__ = ("_coll", "comms", "shared")

    def __init__(self, shared: SharedRoot, comms: SetComms) -> None:
        self.shared = shared
        self.comms = comms
        self._coll = Collective(comms.comm)

    @property
    def target(self) -> Target:
        """Where the save's files go: the shared root."""
        return self.shared.target

    def make(self, step: int, token: str) -> Made:
        """Coordinator: create the save's temporary directory in the shared root and claim the
        data files of the checkpoint rotation dropped last (if any) in it."""
        target, recycled = self.shared.target, self.shared.recycled
        pending = target.pending(step, token=token)
        target.create(pending)
        names = (filenames.file_name(self.comms.kind, i) for i in range(len(self.comms.groups)))
        claimed = frozenset() if recycled is None else target.reuse(pending, names, recycled)
        return Made(pending, claimed, token)

    def pending(self, step: int, made: Made) -> PendingDir:
        """Local: the coordinator's temporary directory, the one of every rank."""
        assert made.pending is not None
        return made.pending

    def create(self, pending: PendingDir) -> Exception | None:
        """Local: nothing (the coordinator created it)."""
        return None

    def commit(self, save: Written) -> None:
        """Collective: every rank's outcome to the coordinator (with shards: each shard's leader
        writes its shard on the way up), which commits, logs and rotates; then everyone learns
        the outcome (the same error on every rank)."""
        request = save.request
        gathered = gather_set(
            self.comms, save.written, self.target, save.pending, kind="checkpoint",
            step=request.step,
        )  # fmt: skip
        answer = None if gathered is None else self._commit(gathered, save)
        committed: _Committed = self._coll.announce(
            f"save of checkpoint step {request.step}", answer
        )
        self.shared.recycled = committed.recycled
        self.shared.static_known = save.static if committed.static_known else None

    def _commit(self, gathered: Gathered[Any], save: Written) -> _Committed | Exception:
        """Coordinator: commit a save in the shared root (or roll it back), log it and rotate;
        what to announce."""
        request = save.request
        try:
            manifest = commit_set(
                self.comms, gathered.values(), step=request.step, static=save.static,
                metrics=request.metrics, library_version=__version__,
                into=(self.target, save.pending),
            )  # fmt: skip
        except Exception as exc:
            self.target.rollback(save.pending)
            return exc
        try:
            recycled = self.shared.after_commit(manifest, save.start)
            return _Committed(recycled, self.shared.still_stored(save.static))
        except Exception as exc:
            return failed_after_commit("recording the save", exc)

    def after_save(self) -> Flight | None:
        """Collective: nothing (the save is in the shared root)."""
        return None

    def flush(self) -> Flight | None:
        """Collective: nothing to flush."""
        return None

    def restore(
        self,
        restorer: Restorer,
        step: int | None,
        *,
        validate: StateValidator | None,
        into: Mapping[str, Any] | None,
        blocks: Mapping[str, BlockSpec],
        refused: Exception | None,
    ) -> tuple[int, dict[str, Any]]:
        """Collective: restore from the shared root (:meth:`Restorer.restore`)."""
        return restorer.restore(step, validate=validate, into=into, blocks=blocks, refused=refused)

    def close(self) -> None:
        """Local: the coordinator deletes the checkpoint kept to write over."""
        self.shared.close(coordinator=self._coll.is_coordinator)


def failed_after_commit(what: str, exc: Exception) -> Exception:
    """Coordinator: the error every rank raises when logging or rotating after a commit
    failed (the checkpoint is committed: nothing is rolled back)."""
    if isinstance(exc, ResilientError):
        return exc
    return CollectiveError(what, {0: failure_of(exc, 0)})
