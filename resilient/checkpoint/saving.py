"""Saves from planning to commit, at most one in flight, and the flush of a node-local tier.

:class:`SavePipeline` is the manager's writer: it plans a save (collective), hands the bytes to
a background thread (or writes them here, for a blocking save: the same path), and commits the
save collectively when asked (:meth:`SavePipeline.wait`, :meth:`SavePipeline.poll`). With a
node-local tier (:mod:`resilient.checkpoint.tiers`) a save is committed on every node, and every
``flush_every`` commits a flush to the shared root starts in the background, committed the same
way. Logging and rotation run only after a commit in the shared root: a checkpoint is never
deleted before a newer one is durable (KempnerForge#102).

A blocking save reads as a script of three collective operations when the structure of every
file group and the static data are those of the previous save (more otherwise: a group that
plans its file again, new static data, a sharded manifest's shards, the first save)::

    save()    every rank    the state split and checked; its device tensors copied once into
                            the pinned arena of :attr:`SavePipeline.devices`
    ready()   coordinator   the temporary directory created (shared root), the dropped
                            checkpoint's files claimed to write over
              every rank    plan_rank: its part planned, locally
              every rank    1. allgather: the step, the static data, who can reuse its file's
                            skeleton, the directory (or, with a node-local tier, its name,
                            which every node's ranks then create)
    start()   every rank    plan_write (locally, the skeleton reused), write, checksum, fsync
    wait()    every rank    2. gather: every rank's outcome (or error) to the coordinator
                            (with a sharded manifest, through its shard's leader, which
                            writes the shard: one gather in the shard, one among the leaders)
              coordinator   commit_set: the manifest built and committed; the save log and
                            rotation
              every rank    3. broadcast: the outcome (what rotation dropped, to write over
                            next time), or the one error every rank raises

With a node-local tier, 2. and 3. are allgathers: every rank builds the manifest, every node's
leader commits its copy, and everyone learns whether every node did; every ``flush_every``
commits a flush (three more operations) starts, and with partner copies a protection. With a
node-local tier and a sharded manifest (a shard never spans two nodes) 2. is the shards' writes
(their leaders write them into their nodes' temporary directories), a gather of the shards to
the coordinator and the broadcast of the index it builds; then every node's leader commits its
copy with that index and everyone learns whether every node did (one allgather).

An asynchronous save runs the same steps, but its bytes are written on the writer thread (the
host arrays copied into staging buffers first; one small allreduce before: did every rank
plan?), and 2. and 3. happen when the save is waited for or polled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from resilient._version import __version__
from resilient.checkpoint.catalog import Catalog, save_record
from resilient.checkpoint.savepaths import LocalTierCommit, Made, SavePath, SharedRootCommit
from resilient.checkpoint.saveset import (
    Planned,
    RankWritten,
    SkeletonCache,
    WriteJob,
    commit_set,
    gather_set,
    plan_rank,
    plan_write,
)
from resilient.checkpoint.statics import StaticStore
from resilient.checkpoint.tiers import LocalCheckpoint, LocalTier
from resilient.errors import CollectiveError, ConfigError, ResilientError
from resilient.io import logs, storage
from resilient.io.background import BackgroundWriter
from resilient.io.commit import PendingDir
from resilient.io.devicecopy import DeviceStaging
from resilient.io.fileio import Bounce
from resilient.io.runkey import record_run_key
from resilient.io.staging import StagingArea
from resilient.io.targets import DirectoryTarget
from resilient.model import filenames
from resilient.model.manifest import Manifest
from resilient.model.payload import SaveRequest
from resilient.model.policies import KeepPolicyLike
from resilient.parallel.collective import Collective, Gathered, failure_of
from resilient.parallel.setcomms import SetComms

__all__ = ["SavePipeline"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Ask:
    """What each rank tells every other in a save's first round: its step, its static data's
    description, the skeleton generation it can write into unchanged (``None``: its group
    plans again), and on the coordinator what it made."""

    step: int
    static: object | None
    generation: int | None
    made: Made | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """A save every rank may write (after :meth:`SavePipeline.ready`).

    Attributes:
        request: this rank's checked arguments.
        static: the static data's content hash (``None``: none).
        pending: the checkpoint's temporary directory (this node's, with a node-local tier).
        reuse: this rank's group writes into its cached skeleton (no planning round).
        claimed: this rank's file was claimed from a dropped checkpoint (to write over).
        failed: the error that keeps this rank from writing (it could not create its node's
            directory); raised on every rank once every rank has written.
    """

    request: SaveRequest
    static: str | None
    pending: PendingDir
    reuse: bool
    claimed: bool
    failed: Exception | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Committed:
    """What the coordinator announces after a commit in the shared root: the newest
    checkpoint that rotation dropped (its files for the next save to write over), and whether
    the static data the checkpoint refers to is still known to be stored."""

    recycled: Path | None
    static_known: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _SaveFlight:
    """A save whose data is being written."""

    request: SaveRequest
    static: str | None
    pending: PendingDir
    task: Future[RankWritten]
    start: float
    written: Future[None] | None = None  # the data's fsync, when task only wrote and described

    def done(self) -> bool:
        """Whether this rank's part is done (its data durable too)."""
        return self.task.done() and (self.written is None or self.written.done())


@dataclasses.dataclass(frozen=True, slots=True)
class _ProtectFlight:
    """A local checkpoint being copied to partner nodes (then maybe flushed)."""

    checkpoint: LocalCheckpoint
    task: Future[str | None]
    start: float
    flush_due: bool

    def done(self) -> bool:
        """Whether this rank's part is done."""
        return self.task.done()


@dataclasses.dataclass(frozen=True, slots=True)
class _FlushFlight:
    """A local checkpoint being copied to the shared root."""

    checkpoint: LocalCheckpoint
    pending: PendingDir
    task: Future[None]
    start: float

    def done(self) -> bool:
        """Whether this rank's part is done."""
        return self.task.done()


class SavePipeline:
    """The saves of one manager. Every method but :attr:`in_flight` and :meth:`shutdown` is
    collective over ``comms.comm``.

    Args:
        root: the shared checkpoint root.
        comms: who writes which file.
        catalog: the shared root's history, for rotation.
        statics: the shared root's static data.
        run_key: recorded in the shared root at the first save (``None``: none).
        deleter: deletes what rotation drops, in the background.
        keep: keep policy of the shared root (``None`` keeps everything).
        local: the node-local tier, if any.
        flush_every: with ``local``: flush every this many commits.
        clock: monotonic clock.
        committed: called on every rank after each save's commit with its cost in seconds.
    """

    def __init__(
        self,
        root: Path,
        comms: SetComms,
        *,
        catalog: Catalog,
        statics: StaticStore,
        run_key: Mapping[str, Any] | None,
        deleter: storage.BackgroundDeleter,
        keep: KeepPolicyLike | None,
        local: LocalTier | None,
        flush_every: int,
        clock: Callable[[], float],
        committed: Callable[[float], None],
    ) -> None:
        self.root = root
        self.shared = DirectoryTarget(root)
        self.comms = comms
        self.keep = keep
        self.local = local
        # where a save is committed, chosen once: the shared root or every node's local tier
        self._path: SavePath = (
            SharedRootCommit(self.shared, comms) if local is None else LocalTierCommit(local)
        )
        self.flush_every = flush_every
        self._coll = Collective(comms.comm)
        self._catalog = catalog
        self._statics = statics
        self._run_key = run_key
        self._deleter = deleter
        self._clock = clock
        self._committed = committed
        self._staging = StagingArea()
        # device tensors' one copy, into a pinned arena reused by every save (close frees it)
        self.devices = DeviceStaging()
        self._writer = BackgroundWriter("resilient-writer")
        self._skeletons = SkeletonCache()
        self._bounce = Bounce()  # O_DIRECT's aligned buffer: reused by every save, then closed
        # the checksum thread of every save (and, lent, restore): started at the first use
        self.digester = ThreadPoolExecutor(1, thread_name_prefix="resilient-digest")
        self._in_flight: _SaveFlight | _ProtectFlight | _FlushFlight | None = None
        self._unprotected_said = False
        self._unflushed: LocalCheckpoint | None = None
        self._local_commits = 0
        # a checkpoint that rotation dropped, whose data files the next save writes over
        # (:func:`resilient.io.fileio.claim_file`); the same on every rank
        self._recycled: Path | None = None
        # the static content the last save referred to, known stored by every rank
        self._static_known: str | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a save or a flush is in flight (local, no communication)."""
        return self._in_flight is not None

    def after_restore(self, directory: Path, manifest: Manifest) -> None:
        """Local: after a restore of ``manifest`` from ``directory``, let the next save of the
        same structure reuse its file's skeleton (see :func:`~resilient.checkpoint.saveset.seed_cache`;
        the planning of that save checks that every rank of the group agrees). Nothing is read
        until that save: a restore that is not followed by one pays nothing for it. A manager
        that has saved already keeps its own skeleton (the restore of its own checkpoint).
        The static data it refers to was just read: the next save of the same needs no
        look-up."""
        if self._skeletons.specs is None:
            self._skeletons.seed = (directory, manifest)
        self._static_known = manifest.static

    def adopt_unflushed(self, checkpoint: LocalCheckpoint) -> None:
        """A restored local checkpoint that is not in the shared root yet: flush it at the
        latest in :meth:`flush`."""
        self._unflushed = checkpoint

    # ------------------------------------------------------------------ saving

    def ready(self, step: int, request: SaveRequest | Exception, *, first: bool) -> Ready:
        """Collective: a save's first round (one allgather). Every rank plans its part
        (:func:`plan_rank`); the coordinator first creates the temporary directory in the shared
        root and claims the files of a checkpoint that rotation dropped (or, with a node-local
        tier, names the directory every node's ranks create). Every rank learns the step (the
        same on every rank), the static data and which file groups must plan again.

        The first save also records the run key (if any), and static data the last save (or
        restore) did not refer to is looked up (and written if new): one more round (and a
        save of it).

        Args:
            step: the step as the caller gave it (for the error's text).
            request: this rank's checked arguments, or the error of its check.
            first: whether this is the manager's first save (the same on every rank).

        Raises:
            ResilientError: the same error on every rank (the temporary directory removed).
        """
        mine: _Ask | Exception
        try:
            if isinstance(request, Exception):
                raise request
            generation = plan_rank(self.comms, request.data, self._skeletons)
            mine = _Ask(request.step, StaticStore.describe(request.static), generation)
        except Exception as exc:
            mine = exc
        if self._coll.is_coordinator and isinstance(mine, _Ask):
            try:
                mine = dataclasses.replace(
                    mine, made=self._path.make(mine.step, storage.new_token(), self._recycled)
                )
            except Exception as exc:
                mine = exc
        made = mine.made if isinstance(mine, _Ask) else None
        what = f"save of step {step}"
        try:
            asked = self._coll.share(what, mine)
            _same_step([a.step for a in asked])
        except Exception:
            if made is not None and made.pending is not None:
                made.pending.rollback()
            raise
        assert isinstance(request, SaveRequest)
        made = asked[0].made
        assert made is not None
        pending = self._path.pending(request.step, made)
        static = StaticStore.content(self.comms.kind, [a.static for a in asked])
        try:
            record_key = first and self._run_key is not None
            if record_key or (static is not None and static != self._static_known):
                self._store_static(what, request, static, record_key=record_key)
        except Exception:
            if made.pending is not None and self._coll.is_coordinator:
                made.pending.rollback()
            raise
        failed = self._path.create(pending)
        generations = {asked[r].generation for r in self.comms.members}
        return Ready(
            request, static, pending, reuse=None not in generations and len(generations) == 1,
            claimed=self.comms.file_name in made.claimed, failed=failed,
        )  # fmt: skip

    def _store_static(
        self, what: str, request: SaveRequest, static: str | None, *, record_key: bool
    ) -> None:
        """Collective: the coordinator records the run key (``record_key``) and looks ``static``
        up; every rank writes it if it is not stored."""
        answer: bool | Exception | None = None
        if self._coll.is_coordinator:
            try:
                if record_key:
                    assert self._run_key is not None
                    record_run_key(self.root, self._run_key)
                answer = static is None or self._statics.is_stored(static)
            except Exception as exc:
                answer = exc
        if not self._coll.announce(what, answer):
            assert static is not None
            self._statics.write(self.comms, request.step, request.static, static)

    def start(self, ready: Ready, *, blocking: bool, copy: bool, start: float) -> Path:
        """Collective: start writing a save every rank is :meth:`ready` for (or write and
        commit it, with ``blocking``). Nothing may be in flight. Returns the checkpoint's
        directory.

        A blocking save whose file groups reuse their skeletons communicates no more here
        than in its commit (:meth:`wait`: one gather, one broadcast)."""
        assert self._in_flight is None, "finish the save in flight first"
        request, pending = ready.request, ready.pending
        if ready.failed is not None and ready.reuse:
            plan = Planned(None, ready.failed)
        else:
            plan = Planned.of(
                functools.partial(
                    plan_write,
                    self.comms,
                    self._path.target,
                    pending,
                    request.data,
                    step=request.step,
                    cache=self._skeletons,
                    reuse=ready.reuse,
                    claimed=ready.claimed,
                    failed=ready.failed,
                    bounce=self._bounce,
                    digester=self.digester,
                )
            )
        if not blocking and self.comms.comm.any_true(plan.failed):
            blocking = True  # a rank could not plan: finish now, so every rank raises its error
        if blocking:  # the bytes are written here, checksummed between the runs of the
            # write (while the disk works), then fsynced on the writer thread while the
            # rest is checksummed
            task, written = self._write_here(plan)
            self._in_flight = _SaveFlight(request, ready.static, pending, task, start, written)
            self.wait()
        else:  # the same on the writer thread, the fsync queued behind it there
            job = plan.result()  # (every rank planned)
            if copy:  # the last step of the caller's wait: a local memcpy
                staged = self._staging.stage(job.arrays, private=request.data.staged)
                job = dataclasses.replace(job, arrays=staged)
            task = self._writer.submit(functools.partial(_write_described, job, _nothing))
            written = self._writer.submit(job.fsync)
            self._in_flight = _SaveFlight(request, ready.static, pending, task, start, written)
        return pending.final

    def _write_here(self, plan: Planned) -> tuple[Future[RankWritten], Future[None] | None]:
        """Local: write this rank's part of a blocking save on this thread and hand its fsync
        to the writer thread once the bytes are written; the outcome (or the plan's or the
        write's error) and the fsync, if it was started."""
        task: Future[RankWritten] = Future()
        syncing: _Syncing | None = None
        try:
            job = plan.result()
            syncing = _Syncing(self._writer, job.fsync)
            task.set_result(_write_described(job, syncing.start))
        except Exception as exc:
            task.set_exception(exc)
        return task, None if syncing is None else syncing.future

    def wait(self) -> None:
        """Collective: finish what is in flight, including a flush that a commit starts."""
        while self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            self._finish(flight)

    def poll(self) -> bool:
        """Collective: finish what is in flight if every rank's part is done; ``True`` when
        nothing is in flight any more."""
        if self._in_flight is None:
            return True
        if self.comms.comm.any_true(not self._in_flight.done()):
            return False
        flight, self._in_flight = self._in_flight, None
        self._finish(flight)
        return self._in_flight is None

    def flush(self) -> None:
        """Collective: finish what is in flight, then copy the newest local checkpoint to the
        shared root if it is not there yet, and wait for that."""
        self.wait()
        if self._unflushed is not None:
            self._start_flush()
            self.wait()

    def shutdown(self) -> None:
        """Local: stop the writer and checksum threads and free the staging, device staging and
        bounce buffers (nothing in flight)."""
        self._in_flight = None
        self._writer.shutdown()
        self.digester.shutdown(wait=True, cancel_futures=True)
        self._staging.release()
        self.devices.close()
        self._bounce.close()
        if self._recycled is not None and self._coll.is_coordinator:
            self._deleter.delete([self._recycled])
        self._recycled = None

    def _finish(self, flight: _SaveFlight | _ProtectFlight | _FlushFlight) -> None:
        if isinstance(flight, _FlushFlight):
            self._finish_flush(flight)
        elif isinstance(flight, _ProtectFlight):
            self._finish_protect(flight)
        else:
            self._finish_save(flight)

    def _finish_save(self, flight: _SaveFlight) -> None:
        """Collective: every rank's outcome (its data durable) to the coordinator, which
        commits; then everyone learns the outcome (the same error on every rank)."""
        request, pending, local = flight.request, flight.pending, self.local
        what = f"save of checkpoint step {request.step}"
        written = _written(flight)
        if local is None:  # (with shards: each shard's leader writes its shard on the way up)
            gathered = gather_set(
                self.comms, written, pending.path, kind="checkpoint", step=request.step
            )
            answer = None if gathered is None else self._commit(gathered, flight)
            committed: _Committed = self._coll.announce(what, answer)
            self._recycled = committed.recycled
            self._static_known = flight.static if committed.static_known else None
            self._committed(self._clock() - flight.start)
            return
        # every node commits its own copy: every rank builds the manifest (at the time the
        # last rank finished), or with shards the coordinator builds the index and announces
        # it; every node's leader commits, and everyone learns who failed
        try:
            copied: Manifest | Exception
            if self.comms.shard is None:
                done = self._coll.share(what, _stamped(written))
                try:
                    copied = commit_set(
                        self.comms, [w for w, _ in done], step=request.step,
                        static=flight.static, metrics=request.metrics,
                        library_version=__version__, at=max(t for _, t in done),
                    )  # fmt: skip
                except Exception as exc:
                    copied = exc
            else:
                copied = self._local_index(written, flight)
            try:
                if not isinstance(copied, Exception):
                    local.commit(pending, copied)
            except Exception as exc:
                copied = exc
            failed = copied if isinstance(copied, Exception) else None
            self._coll.share(f"committing the local copies of step {request.step}", failed)
        except Exception:
            local.rollback(pending)
            raise
        assert not isinstance(copied, Exception)
        self._static_known = flight.static  # (in the shared root: rotated by flushes only)
        checkpoint = LocalCheckpoint(pending.final, copied)
        self._unflushed = checkpoint
        self._local_commits += 1
        self._committed(self._clock() - flight.start)
        flush_due = self._local_commits % self.flush_every == 0
        protect = local.partner_copy_job(checkpoint)
        if protect is not None:
            task = self._writer.submit(protect)
            self._in_flight = _ProtectFlight(checkpoint, task, self._clock(), flush_due)
        elif flush_due:
            self._start_flush()

    def _local_index(self, written: RankWritten | Exception, flight: _SaveFlight) -> Manifest:
        """Collective: the index of a save with a node-local tier and a sharded manifest. Each
        shard's leader writes its shard into its node's temporary directory (a shard never
        spans two nodes) on the way up (:func:`gather_set`), the coordinator builds the index
        from the shards and announces it;
        returned with this rank's own entry loaded (for its flush). The same error on every
        rank if any of that failed."""
        request = flight.request
        what = f"save of checkpoint step {request.step}"
        gathered = gather_set(
            self.comms, written, flight.pending.path, kind="checkpoint", step=request.step
        )
        answer: Manifest | Exception | None = None
        if gathered is not None:
            try:
                answer = commit_set(
                    self.comms, gathered.values(), step=request.step, static=flight.static,
                    metrics=request.metrics, library_version=__version__,
                )  # fmt: skip
            except Exception as exc:
                answer = exc
        index: Manifest = self._coll.announce(what, answer)
        assert isinstance(written, RankWritten) and index.sharded is not None
        own = index.sharded.with_entries({self.comms.comm.rank: written.entry})
        return dataclasses.replace(index, ranks=own)

    def _commit(self, gathered: Gathered[Any], flight: _SaveFlight) -> _Committed | Exception:
        """Coordinator: commit a save in the shared root (or roll it back), log it and rotate;
        what to announce."""
        request = flight.request
        try:
            manifest = commit_set(
                self.comms, gathered.values(), step=request.step, static=flight.static,
                metrics=request.metrics, library_version=__version__, pending=flight.pending,
            )  # fmt: skip
        except Exception as exc:
            flight.pending.rollback()
            return exc
        try:
            recycled = self._after_commit(manifest, flight.start)
            return _Committed(recycled, self._still_stored(flight.static))
        except Exception as exc:
            return _failed_after_commit("recording the save", exc)

    def _still_stored(self, static: str | None) -> bool:
        """Coordinator, after rotation: whether the static content ``static`` is stored."""
        return static is not None and self._statics.is_stored(static)

    # ------------------------------------------------------------------ partner copies

    def protect(self, checkpoint: LocalCheckpoint) -> None:
        """Collective: copy a restored local checkpoint to the partner nodes again, in the
        background (nothing else in flight). A lost node's partner copies were lost with it,
        and a job on another node set has another ring: until this is done, a second loss
        would find nothing."""
        job = self._path.partner_copy_job(checkpoint)
        if job is None or self._in_flight is not None:
            return
        self._in_flight = _ProtectFlight(checkpoint, self._writer.submit(job), self._clock(), False)

    def _finish_protect(self, flight: _ProtectFlight) -> None:
        """Collective: learn whether every node's partner copy is committed; record it in the
        shared root if so, else warn (once per run: the next save tries again)."""
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
        if flight.flush_due:
            self._start_flush()

    def _log_protect(self, flight: _ProtectFlight) -> Exception | None:
        """Coordinator: record that every node's partner copy is committed; the error every
        rank then raises if that failed."""
        manifest = flight.checkpoint.manifest
        took = round(self._clock() - flight.start, 6)
        record = {"time": time.time(), "step": manifest.step, "protect_s": took,
                  "bytes": manifest.nbytes}  # fmt: skip
        try:
            logs.append_record(self.root / filenames.PROTECT_LOG, record)
        except Exception as exc:
            return _failed_after_commit("recording the partner copies", exc)
        return None

    # ------------------------------------------------------------------ flushing

    def _start_flush(self) -> None:
        """Collective: start copying the newest local checkpoint to the shared root."""
        assert self.local is not None and self._unflushed is not None
        checkpoint, self._unflushed = self._unflushed, None
        step = checkpoint.manifest.step
        made: PendingDir | Exception | None = None
        if self._coll.is_coordinator:
            try:
                made = self.shared.pending(step)
                self.shared.create(made)
            except Exception as exc:
                made = exc
        pending: PendingDir = self._coll.announce(
            f"creating a temporary directory in {self.root}", made
        )
        task = self._writer.submit(
            self.local.flush_job(checkpoint, self.shared, pending, bounce=self._bounce)
        )
        self._in_flight = _FlushFlight(checkpoint, pending, task, self._clock())

    def _finish_flush(self, flight: _FlushFlight) -> None:
        """Collective: every rank's copy (durable) to the coordinator, which commits it in the
        shared root, logs and rotates; then everyone learns the outcome."""
        manifest, pending = flight.checkpoint.manifest, flight.pending
        what = f"flush of checkpoint step {manifest.step} to {self.root}"
        try:
            copied: Exception | None = flight.task.result()
        except Exception as exc:
            copied = exc
        gathered = self._coll.gather(copied)
        answer: bool | Exception | None = None
        if gathered is not None:
            try:
                gathered.values()
                self.shared.commit(pending, manifest, what=what)
            except Exception as exc:
                self.shared.rollback(pending)
                answer = exc
            else:
                try:
                    self._after_commit(manifest, flight.start, flushed=True)
                    answer = self._still_stored(self._static_known)
                except Exception as exc:
                    answer = _failed_after_commit("recording the flush", exc)
        if not self._coll.announce(what, answer):  # rotation may have dropped the static data
            self._static_known = None

    # ------------------------------------------------------------------ after a commit

    def _after_commit(
        self, manifest: Manifest, start: float, *, flushed: bool = False
    ) -> Path | None:
        """Coordinator: log the save (or flush), then rotate (a failed rotation only warns).

        Returns the newest checkpoint that rotation dropped, kept for the next save to write
        over its files (without a node-local tier); the one kept before, and the rest of the
        trash, are deleted in the background."""
        took = round(self._clock() - start, 6)
        extra = {"flush_s": took, "tier": "local"} if flushed else {"cost_s": took}
        logs.append_record(
            self.root / filenames.SAVE_LOG,
            {"time": time.time(), **extra, "bytes": manifest.nbytes, **save_record(manifest)},
        )
        if self.keep is None:
            return None  # nothing is ever deleted: no need to know the history
        try:
            self._catalog.add(manifest)
            trashed = self._catalog.apply(self._catalog.plan(self.keep))
        except (OSError, ResilientError) as exc:
            log.warning("rotation in %s failed (checkpoints are intact): %s", self.root, exc)
            return self._recycled
        reuse = trashed.checkpoints[-1] if trashed.checkpoints and self._path.recycles else None
        drop = [p for p in (self._recycled, *trashed.paths) if p is not None and p != reuse]
        self._deleter.delete(drop)
        return reuse


def _write_described(job: WriteJob, written: Callable[[], None]) -> RankWritten:
    """Write ``job`` without its fsync, checksumming its arrays between the runs of the write
    (while the disk works); call ``written`` (which starts the fsync, where it is not queued
    already), then take the checksums the write left and describe the job."""
    hashing, digests = job.digests_alongside()
    try:
        job.write(sync=False, alongside=hashing)
    finally:
        digests.result()  # no thread reads the arrays once this returns (or raises)
    written()
    hashing.finish()  # what the write left: done while the fsync runs (if it does)
    return job.describe(digests.result())


def _nothing() -> None:
    """Nothing to start: the fsync is queued already."""


class _Syncing:
    """The fsync of a blocking save's data, started on the writer thread once its bytes are
    written (:attr:`future`: ``None`` until then)."""

    def __init__(self, writer: BackgroundWriter, sync: Callable[[], None]) -> None:
        self._writer = writer
        self._sync = sync
        self.future: Future[None] | None = None

    def start(self) -> None:
        self.future = self._writer.submit(self._sync, started=True)


def _written(flight: _SaveFlight) -> RankWritten | Exception:
    """This rank's outcome of a save once its data is durable (or the write's error); no
    writer thread's work outlives it."""
    try:
        done: RankWritten | Exception = flight.task.result()
    except Exception as exc:
        done = exc
    if flight.written is not None:
        try:
            flight.written.result()
        except Exception as exc:
            done = done if isinstance(done, Exception) else exc
    return done


def _stamped(written: RankWritten | Exception) -> tuple[RankWritten, float] | Exception:
    """This rank's outcome with the time it is durable (or the write's error)."""
    return written if isinstance(written, Exception) else (written, time.time())


def _failed_after_commit(what: str, exc: Exception) -> Exception:
    """Coordinator: the error every rank raises when logging or rotating after a commit
    failed (the checkpoint is committed: nothing is rolled back)."""
    if isinstance(exc, ResilientError):
        return exc
    return CollectiveError(what, {0: failure_of(exc, 0)})


def _same_step(steps: list[int]) -> None:
    """Every rank must save the same step."""
    if len(set(steps)) > 1:
        raise ConfigError(f"ranks disagree on the step: {sorted(set(steps))}")
