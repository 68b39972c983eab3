"""The node-local tier as a manager of its own, composed over the shared root's saves.

:class:`LocalTierManager` is the :class:`~resilient.checkpoint.savepaths.SavePath` of a manager
with a node-local tier (:mod:`resilient.checkpoint.tiers`: the node's copies on disk). It owns
what the tier adds to a save and a restore:

* the save's commit on every node (:meth:`LocalTierManager.commit`): every rank builds the
  manifest (or, with manifest shards, the coordinator builds the index), every node's leader
  commits its copy, and everyone learns whether every node did;
* the partner copies (:mod:`resilient.checkpoint.partner`) that follow each commit, and again
  after a restore, in the background;
* the flush to the shared root every ``flush_every`` commits, in the background, committed by
  the coordinator through :class:`~resilient.checkpoint.savepaths.SharedRoot` (its log and
  rotation);
* the restore chain: the newest local step every rank holds intact, else one the nodes stage
  between them for an elastic restore (:mod:`resilient.checkpoint.tierstaging`), else the shared
  root.

Which calls are collective (over the checkpoint set's communicator): :meth:`commit`,
:meth:`after_save`, :meth:`flush`, :meth:`restore` and the :meth:`Flight.finish` of the flights
it starts; :meth:`make`, :meth:`pending`, :meth:`create`, :meth:`close` and
:meth:`Flight.done` are local.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from resilient._version import __version__
from resilient.checkpoint.restorer import Restorer, StateValidator
from resilient.checkpoint.savepaths import (
    Flight,
    Made,
    SharedRoot,
    Written,
    failed_after_commit,
)
from resilient.checkpoint.saveset import RankWritten, commit_set, gather_set
from resilient.checkpoint.tiers import LocalCheckpoint, LocalTier
from resilient.checkpoint.tierstaging import TierStaging
from resilient.errors import ResilientError
from resilient.io.background import BackgroundWriter
from resilient.io.checkpoints import latest_valid
from resilient.io.commit import PendingDir
from resilient.io.fileio import Bounce
from resilient.io.targets import DirectoryTarget, SetRef, Target
from resilient.model import filenames
from resilient.model.blocks import BlockSpec
from resilient.model.manifest import Manifest
from resilient.parallel.collective import Collective
from resilient.parallel.setcomms import SetComms

__all__ = ["LocalTierManager"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Protecting:
    """A local checkpoint being copied to partner nodes (then maybe flushed)."""

    tier: LocalTierManager
    checkpoint: LocalCheckpoint
    task: Future[str | None]
    start: float
    flush_due: bool

    def done(self) -> bool:
        """Local: whether this rank's part is done."""
        return self.task.done()

    def finish(self) -> Flight | None:
        """Collective: see :meth:`LocalTierManager._finish_protect`."""
        return self.tier._finish_protect(self)


@dataclasses.dataclass(frozen=True, slots=True)
class _Flushing:
    """A local checkpoint being copied to the shared root."""

    tier: LocalTierManager
    checkpoint: LocalCheckpoint
    pending: PendingDir
    task: Future[None]
    start: float

    def done(self) -> bool:
        """Local: whether this rank's part is done."""
        return self.task.done()

    def finish(self) -> Flight | None:
        """Collective: see :meth:`LocalTierManager._finish_flush`."""
        self.tier._finish_flush(self)
        return None


class LocalTierManager:
    """Saves committed on every node, in its local tier, copied to partner nodes and flushed
    to the shared root later; restores that look at the local copies first.

    Args:
        tier: the node-local tier (its copies on disk).
        shared: the shared root (its records, log and rotation).
        comms: who writes which file.
        writer: the thread that runs the partner copies and flushes (the save's writer).
        bounce: the aligned buffer the flushes copy through.
        flush_every: flush every this many commits.
        clock: monotonic clock.
        follow: starts background work after a restore (partner copies again) through the
            pipeline, which holds what is in flight (and starts nothing while something is).
    """

    def __init__(
        self,
        tier: LocalTier,
        shared: SharedRoot,
        comms: SetComms,
        *,
        writer: BackgroundWriter,
        bounce: Bounce,
        flush_every: int,
        clock: Callable[[], float],
        follow: Callable[[Callable[[], Flight]], None],
    ) -> None:
        self.tier = tier
        self.shared = shared
        self.comms = comms
        self.flush_every = flush_every
        self._writer = writer
        self._bounce = bounce
        self._clock = clock
        self._follow = follow
        self._coll = Collective(comms.comm)
        self.staging = TierStaging(tier)  # elastic restores staged from the nodes' copies
        self._unprotected_said = False
        self._unflushed: LocalCheckpoint | None = None
        self._commits = 0

    @property
    def target(self) -> Target:
        """Where a save's files go: this node's local tier."""
        return self.tier.target

    # ------------------------------------------------------------------ saving

    def make(self, step: int, token: str) -> Made:
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

    def commit(self, save: Written) -> None:
        """Collective: every node commits its own copy: every rank builds the manifest (at the
        time the last rank finished), or with shards the coordinator builds the index and
        announces it; every node's leader commits, and everyone learns who failed (the same
        error on every rank)."""
        request, pending = save.request, save.pending
        what = f"save of checkpoint step {request.step}"
        try:
            copied: Manifest | Exception
            if self.comms.shard is None:
                done = self._coll.share(what, _stamped(save.written))
                try:
                    copied = commit_set(
                        self.comms, [w for w, _ in done], step=request.step,
                        static=save.static, metrics=request.metrics,
                        library_version=__version__, at=max(t for _, t in done),
                    )  # fmt: skip
                except Exception as exc:
                    copied = exc
            else:
                copied = self._index(save)
            try:
                if not isinstance(copied, Exception):
                    self.tier.commit(pending, copied)
            except Exception as exc:
                copied = exc
            failed = copied if isinstance(copied, Exception) else None
            self._coll.share(f"committing the local copies of step {request.step}", failed)
        except Exception:
            self.tier.rollback(pending)
            raise
        assert not isinstance(copied, Exception)
        self.shared.static_known = save.static  # (in the shared root: rotated by flushes only)
        self._unflushed = LocalCheckpoint(pending.final, copied)
        self._commits += 1

    def _index(self, save: Written) -> Manifest:
        """Collective: the index of a save with a sharded manifest. Each shard's leader writes
        its shard into its node's temporary directory (a shard never spans two nodes) on the
        way up (:func:`gather_set`), the coordinator builds the index from the shards and
        announces it; returned with this rank's own entry loaded (for its flush). The same
        error on every rank if any of that failed."""
        request, written = save.request, save.written
        what = f"save of checkpoint step {request.step}"
        gathered = gather_set(
            self.comms, written, self.tier.target, save.pending, kind="checkpoint",
            step=request.step,
        )  # fmt: skip
        answer: Manifest | Exception | None = None
        if gathered is not None:
            try:
                answer = commit_set(
                    self.comms, gathered.values(), step=request.step, static=save.static,
                    metrics=request.metrics, library_version=__version__,
                )  # fmt: skip
            except Exception as exc:
                answer = exc
        index: Manifest = self._coll.announce(what, answer)
        assert isinstance(written, RankWritten) and index.sharded is not None
        own = index.sharded.with_entries({self.comms.comm.rank: written.entry})
        return dataclasses.replace(index, ranks=own)

    def after_save(self) -> Flight | None:
        """Collective: after a commit, start its partner copies (then, every ``flush_every``
        commits, a flush), or the flush alone."""
        checkpoint = self._unflushed
        assert checkpoint is not None
        flush_due = self._commits % self.flush_every == 0
        protect = self.tier.partner_copy_job(checkpoint)
        if protect is not None:
            task = self._writer.submit(protect)
            return _Protecting(self, checkpoint, task, self._clock(), flush_due)
        if flush_due:
            return self._start_flush()
        return None

    def close(self) -> None:
        """Local: nothing is kept to write over (the saves write on the nodes)."""
        self.shared.close(coordinator=self._coll.is_coordinator)

    # ------------------------------------------------------------------ partner copies

    def _protect(self, checkpoint: LocalCheckpoint) -> None:
        """Local: copy a restored local checkpoint to the partner nodes again, in the
        background (handed to the pipeline, nothing else in flight). A lost node's partner
        copies were lost with it, and a job on another node set has another ring: until this
        is done, a second loss would find nothing."""
        job = self.tier.partner_copy_job(checkpoint)
        if job is not None:
            self._follow(
                lambda: _Protecting(
                    self, checkpoint, self._writer.submit(job), self._clock(), False
                )
            )

    def _finish_protect(self, flight: _Protecting) -> Flight | None:
        """Collective: learn whether every node's partner copy is committed; record it in the
        shared root if so, else warn (once per run: the next save tries again). Then the flush
        that was due, if any."""
        step = flight.checkpoint.manifest.step
        try:
            mine: str | Exception | None = flight.task.result()
        except Exception as exc:
            mine = exc
        gathered = self._coll.gather(mine)
        answer: tuple[list[str], Exception | None] | Exception | None = None
        if gathered is not None:
            try:
                problems = [p for p in gathered.values() if p]
            except Exception as exc:
                answer = exc
            else:
                answer = (problems, None if problems else self._log_protect(flight))
        try:
            problems, failed = self._coll.announce(f"protecting step {step}", answer)
        except ResilientError as exc:
            problems, failed = [str(exc)], None
        if failed is not None:  # the copies are committed, but their log could not be written
            raise failed
        if problems and self._coll.is_coordinator:
            level = logging.DEBUG if self._unprotected_said else logging.WARNING
            log.log(level, "local checkpoint step %d is valid but not protected (the next save "
                    "tries again): %s", step, problems[0])  # fmt: skip
        self._unprotected_said = self._unprotected_said or bool(problems)
        return self._start_flush() if flight.flush_due else None

    def _log_protect(self, flight: _Protecting) -> Exception | None:
        """Coordinator: record that every node's partner copy is committed; the error every
        rank then raises if that failed."""
        manifest = flight.checkpoint.manifest
        took = round(self._clock() - flight.start, 6)
        record = {"time": time.time(), "step": manifest.step, "protect_s": took,
                  "bytes": manifest.nbytes}  # fmt: skip
        try:
            self.shared.target.append_record(filenames.PROTECT_LOG, record)
        except Exception as exc:
            return failed_after_commit("recording the partner copies", exc)
        return None

    # ------------------------------------------------------------------ flushing

    def flush(self) -> Flight | None:
        """Collective: start copying the newest local checkpoint to the shared root if it is
        not there yet."""
        return None if self._unflushed is None else self._start_flush()

    def _start_flush(self) -> Flight:
        """Collective: start copying the newest local checkpoint to the shared root."""
        assert self._unflushed is not None
        checkpoint, self._unflushed = self._unflushed, None
        step = checkpoint.manifest.step
        target = self.shared.target
        made: PendingDir | Exception | None = None
        if self._coll.is_coordinator:
            try:
                made = target.pending(step)
                target.create(made)
            except Exception as exc:
                made = exc
        pending: PendingDir = self._coll.announce(
            f"creating a temporary directory in {self.shared.target}", made
        )
        task = self._writer.submit(self.tier.flush_job(checkpoint, self.shared.target, pending, bounce=self._bounce))
        return _Flushing(self, checkpoint, pending, task, self._clock())

    def _finish_flush(self, flight: _Flushing) -> None:
        """Collective: every rank's copy (durable) to the coordinator, which commits it in the
        shared root, logs and rotates; then everyone learns the outcome."""
        manifest, pending, target = flight.checkpoint.manifest, flight.pending, self.shared.target
        what = f"flush of checkpoint step {manifest.step} to {self.shared.target}"
        try:
            copied: Exception | None = flight.task.result()
        except Exception as exc:
            copied = exc
        gathered = self._coll.gather(copied)
        answer: bool | Exception | None = None
        if gathered is not None:
            try:
                gathered.values()
                target.commit(pending, manifest, what=what)
            except Exception as exc:
                target.rollback(pending)
                answer = exc
            else:
                try:
                    self.shared.after_commit(manifest, flight.start, flushed=True)
                    answer = self.shared.still_stored(self.shared.static_known)
                except Exception as exc:
                    answer = failed_after_commit("recording the flush", exc)
        if not self._coll.announce(what, answer):  # rotation may have dropped the static data
            self.shared.static_known = None

    # ------------------------------------------------------------------ restoring

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
        """Collective: the local copies first (:meth:`_restore_local`), then the shared root.
        ``refused`` (what was wrong with this rank's arguments) is raised on every rank first."""
        self._coll.share("checking the restore's arguments", refused)
        local = self._restore_local(restorer, step, validate, into, blocks)
        return local or restorer.restore(
            step, validate=validate, into=into, blocks=blocks, refused=refused
        )

    def _restore_local(
        self,
        restorer: Restorer,
        step: int | None,
        validate: StateValidator | None,
        into: Mapping[str, Any] | None,
        blocks: Mapping[str, BlockSpec],
    ) -> tuple[int, dict[str, Any]] | None:
        """Collective: the newest local checkpoint if every rank has it intact and it is at
        least as new as the newest one in the shared root; else the newest one of another
        layout (or another decomposition) that the nodes can stage between them for an elastic
        restore (:meth:`_restore_staged`); ``None`` to restore from the shared root."""
        shared = self._latest_shared() if step is None else None
        found = self.tier.newest(self.comms.layout, step=step, at_least=shared)
        if found is None:
            return self._restore_staged(restorer, step, shared, validate, into, blocks)
        at = SetRef(DirectoryTarget(found.path.parent), found.path.name)
        state, reasons = restorer.read(
            at, found.manifest, validate=validate, into=into, blocks=blocks
        )
        if state is None and not reasons:  # new blocks: an elastic restore reads other files
            return self._restore_staged(restorer, step, shared, validate, into, blocks)
        if state is None:
            why = "; ".join(reasons[:4])
            log.warning(
                "local copy %s failed validation, using %s: %s", found.path, self.shared.target, why
            )
            self.tier.discard(found, why)
            return None
        if step is None and (shared is None or shared < found.manifest.step):
            self._unflushed = found  # not in the shared root: close() flushes it
        self._protect(found)  # partner copies again, for the nodes of this job
        return found.manifest.step, state

    def _latest_shared(self) -> int | None:
        """Collective: the step of the newest checkpoint in the shared root that passes quick
        validation."""

        def newest() -> int | None:
            record = latest_valid(self.shared.target)
            return None if record is None else record.step

        return self._coll.broadcast("finding the latest checkpoint", newest)

    def _restore_staged(
        self,
        restorer: Restorer,
        step: int | None,
        shared: int | None,
        validate: StateValidator | None,
        into: Mapping[str, Any] | None,
        blocks: Mapping[str, BlockSpec],
    ) -> tuple[int, dict[str, Any]] | None:
        """Collective: an elastic restore of the newest local step (or ``step``; not older
        than ``shared``, the shared root's newest) of any layout, staged on every node from
        its own and partner copies (:mod:`resilient.checkpoint.tierstaging`); a staged step
        that fails its read is passed over for the next older one. ``None``: none, use the
        shared root.

        The step is not adopted as this run's unflushed checkpoint (it has another layout):
        the next save is newer, and the old nodes' copies keep it until then."""
        failed: set[int] = set()
        for _ in range(3):
            staged = self.staging.stage(
                blocks, step=step, at_least=shared, excluded=frozenset(failed)
            )
            if staged is None:
                return None
            try:
                at = SetRef(DirectoryTarget(staged.path.parent), staged.path.name)
                state, reasons = restorer.read_elastic(
                    at, staged.manifest, validate=validate, into=into, blocks=blocks
                )
            finally:  # every rank has read (the read's last round gathers them all)
                self.staging.drop()
            if state is not None:
                return staged.manifest.step, state
            if self._coll.is_coordinator:
                log.warning(
                    "local step %d staged for an elastic restore failed validation: %s",
                    staged.manifest.step, "; ".join(reasons[:4]),
                )  # fmt: skip
            failed.add(staged.manifest.step)
        return None


def _stamped(written: RankWritten | Exception) -> tuple[RankWritten, float] | Exception:
    """This rank's outcome with the time it is durable (or the write's error)."""
    return written if isinstance(written, Exception) else (written, time.time())
