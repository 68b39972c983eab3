"""Saves from planning to commit, at most one in flight (with what a commit leaves to do).

:class:`SavePipeline` is the manager's writer: it plans a save (collective), hands the bytes to
a background thread (or writes them here, for a blocking save: the same path), and commits the
save collectively when asked (:meth:`SavePipeline.wait`, :meth:`SavePipeline.poll`) through
its :class:`~resilient.checkpoint.savepaths.SavePath`, chosen once: the shared root
(:class:`~resilient.checkpoint.savepaths.SharedRootSaves`) or a node-local tier
(:class:`~resilient.checkpoint.tiermanager.LocalTierManager`: a save is committed on every node,
and every ``flush_every`` commits a flush to the shared root starts in the background, committed
the same way). Logging and rotation run only after a commit in the shared root: a checkpoint is
never deleted before a newer one is durable (KempnerForge#102).

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
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from resilient.checkpoint.catalog import Catalog
from resilient.checkpoint.reading import Opener
from resilient.checkpoint.savepaths import (
    Flight,
    Made,
    SavePath,
    SharedRoot,
    SharedRootSaves,
    Written,
)
from resilient.checkpoint.saveset import (
    Planned,
    RankWritten,
    SkeletonCache,
    WriteJob,
    plan_rank,
    plan_write,
)
from resilient.checkpoint.statics import StaticStore
from resilient.checkpoint.tiermanager import LocalTierManager
from resilient.checkpoint.tiers import LocalTier
from resilient.errors import ConfigError
from resilient.io import storage
from resilient.io.background import BackgroundWriter
from resilient.io.commit import PendingDir
from resilient.io.devicecopy import DeviceStaging
from resilient.io.fileio import Bounce
from resilient.io.runkey import record_run_key
from resilient.io.staging import StagingArea
from resilient.io.targets import Target
from resilient.model.manifest import Manifest
from resilient.model.payload import SaveRequest
from resilient.model.policies import KeepPolicyLike
from resilient.parallel.collective import Collective
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


class SavePipeline:
    """The saves of one manager. Every method but :attr:`in_flight` and :meth:`shutdown` is
    collective over ``comms.comm``.

    Args:
        target: the shared checkpoint root's target.
        comms: who writes which file.
        catalog: the shared root's history, for rotation.
        statics: the shared root's static data.
        run_key: recorded in the shared root at the first save (``None``: none).
        deleter: deletes what rotation drops, in the background.
        keep: keep policy of the shared root (``None`` keeps everything).
        local: the node-local tier, if any: chooses the :class:`SavePath`
            (:class:`~resilient.checkpoint.tiermanager.LocalTierManager` over it, else
            :class:`~resilient.checkpoint.savepaths.SharedRootSaves`).
        flush_every: with ``local``: flush every this many commits.
        clock: monotonic clock.
        committed: called on every rank after each save's commit with its cost in seconds.
    """

    def __init__(
        self,
        target: Target,
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
        self.comms = comms
        self.shared = SharedRoot(
            target, catalog=catalog, statics=statics, keep=keep, deleter=deleter, clock=clock
        )
        self._coll = Collective(comms.comm)
        self._statics = statics
        self._run_key = run_key
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
        self._in_flight: _SaveFlight | Flight | None = None
        # where a save is committed and a restore looks first, chosen once: the shared root,
        # or every node's local tier (its partner copies, flushes and restore chain its own)
        self.path: SavePath = (
            SharedRootSaves(self.shared, comms)
            if local is None
            else LocalTierManager(
                local, self.shared, comms, writer=self._writer, bounce=self._bounce,
                flush_every=flush_every, clock=clock, follow=self._follow,
            )
        )  # fmt: skip

    @property
    def in_flight(self) -> bool:
        """Whether a save or a flush is in flight (local, no communication)."""
        return self._in_flight is not None

    def after_restore(self, files: Opener, manifest: Manifest) -> None:
        """Local: after a restore of ``manifest`` (``files``: opens its files by name), let the next save of the
        same structure reuse its file's skeleton (see :func:`~resilient.checkpoint.saveset.seed_cache`;
        the planning of that save checks that every rank of the group agrees). Nothing is read
        until that save: a restore that is not followed by one pays nothing for it. A manager
        that has saved already keeps its own skeleton (the restore of its own checkpoint).
        The static data it refers to was just read: the next save of the same needs no
        look-up."""
        if self._skeletons.specs is None:
            self._skeletons.seed = (files, manifest)
        self.shared.static_known = manifest.static

    def _follow(self, start: Callable[[], Flight]) -> None:
        """Local: start background work after a restore (``start``), unless something is in
        flight already."""
        if self._in_flight is None:
            self._in_flight = start()

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
                    mine, made=self.path.make(mine.step, storage.new_token())
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
                self.shared.target.rollback(made.pending)
            raise
        assert isinstance(request, SaveRequest)
        made = asked[0].made
        assert made is not None
        pending = self.path.pending(request.step, made)
        static = StaticStore.content(self.comms.kind, [a.static for a in asked])
        try:
            record_key = first and self._run_key is not None
            if record_key or (static is not None and static != self.shared.static_known):
                self._store_static(what, request, static, record_key=record_key)
        except Exception:
            if made.pending is not None and self._coll.is_coordinator:
                self.shared.target.rollback(made.pending)
            raise
        failed = self.path.create(pending)
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
                    record_run_key(self.shared.target, self._run_key)
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
                    self.path.target,
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
            self._in_flight = self._finish(flight)

    def poll(self) -> bool:
        """Collective: finish what is in flight if every rank's part is done; ``True`` when
        nothing is in flight any more."""
        if self._in_flight is None:
            return True
        if self.comms.comm.any_true(not self._in_flight.done()):
            return False
        flight, self._in_flight = self._in_flight, None
        self._in_flight = self._finish(flight)
        return self._in_flight is None

    def flush(self) -> None:
        """Collective: finish what is in flight, then copy the newest local checkpoint to the
        shared root if it is not there yet, and wait for that."""
        self.wait()
        self._in_flight = self.path.flush()
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
        self.path.close()

    def _finish(self, flight: _SaveFlight | Flight) -> Flight | None:
        """Collective: finish ``flight``; the background work it starts, if any."""
        if not isinstance(flight, _SaveFlight):
            return flight.finish()
        save = Written(
            flight.request, flight.static, flight.pending, _written(flight), flight.start
        )
        self.path.commit(save)
        self._committed(self._clock() - flight.start)
        return self.path.after_save()


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


def _same_step(steps: list[int]) -> None:
    """Every rank must save the same step."""
    if len(set(steps)) > 1:
        raise ConfigError(f"ranks disagree on the step: {sorted(set(steps))}")
