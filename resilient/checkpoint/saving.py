"""Saves from planning to commit, at most one in flight, and the flush of a node-local tier.

:class:`SavePipeline` is the manager's writer: it plans a save (collective), hands the bytes to
a background thread (or writes them here, for a blocking save: the same path), and commits the
save collectively when asked (:meth:`SavePipeline.wait`, :meth:`SavePipeline.poll`). With a
node-local tier (:mod:`resilient.checkpoint.tiers`) a save is committed on every node, and every
``flush_every`` commits a flush to the shared root starts in the background, committed the same
way. Logging and rotation run only after a commit in the shared root: a checkpoint is never
deleted before a newer one is durable (KempnerForge#102).

Call order of one asynchronous save (NVRx's ``save_state_dict_async_plan`` / ``finalize``)::

    save()    every rank    the state split; its device tensors copied once into the pinned
                            arena of :attr:`SavePipeline.devices` (the manager asks for it)
    start()   every rank    temporary directory (shared root, or every node's local root)
              file group    plan_write: the leader creates the file's skeleton or reuses it
              every rank    one small allreduce: did every rank plan?
              every rank    copy the host arrays into staging buffers (not the device
                            tensors' copies: private already); submit the write; return
    ... the program computes; the writer thread writes (checksumming between the runs of the
        write), describes, then fsyncs (a second job queued behind the first) ...
    wait()    every rank    finish_set: every rank's description to the coordinator, manifest
                            and marker prepared while the fsyncs run; a second small round once
                            every rank's data is durable publishes it; then the save log and
                            rotation (or the local commit and, every flush_every saves, the
                            start of a flush)

A blocking save does the same but writes its bytes on the caller's thread and hands their fsync
to the writer thread, checksumming what the write left meanwhile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from resilient._version import __version__
from resilient.checkpoint.catalog import Catalog, save_record
from resilient.checkpoint.checkpointer import (
    Planned,
    RankWritten,
    SkeletonCache,
    WriteJob,
    finish_set,
    plan_write,
)
from resilient.checkpoint.tiers import LocalCheckpoint, LocalTier
from resilient.errors import ResilientError
from resilient.io import storage
from resilient.io.background import BackgroundWriter
from resilient.io.commit import PendingDir
from resilient.io.devicecopy import DeviceStaging
from resilient.io.fileio import Bounce
from resilient.io.staging import StagingArea
from resilient.model import filenames
from resilient.model.manifest import Manifest
from resilient.model.payload import SaveRequest
from resilient.model.policies import KeepPolicyLike
from resilient.parallel.collective import Collective
from resilient.parallel.topology import Topology

__all__ = ["SavePipeline"]

log = logging.getLogger(__name__)


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
    collective over ``topo.comm``.

    Args:
        root: the shared checkpoint root.
        topo: who writes which file.
        catalog: the shared root's history, for rotation.
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
        topo: Topology,
        *,
        catalog: Catalog,
        deleter: storage.BackgroundDeleter,
        keep: KeepPolicyLike | None,
        local: LocalTier | None,
        flush_every: int,
        clock: Callable[[], float],
        committed: Callable[[float], None],
    ) -> None:
        self.root = root
        self.topo = topo
        self.keep = keep
        self.local = local
        self.flush_every = flush_every
        self._coll = Collective(topo.comm)
        self._catalog = catalog
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

    @property
    def in_flight(self) -> bool:
        """Whether a save or a flush is in flight (local, no communication)."""
        return self._in_flight is not None

    def reuse_skeleton(self, directory: Path, manifest: Manifest) -> None:
        """Local: after a restore of ``manifest`` from ``directory``, let the next save of the
        same structure reuse its file's skeleton (see :func:`~resilient.checkpoint.checkpointer.seed_cache`;
        the planning of that save checks that every rank of the group agrees). Nothing is read
        until that save: a restore that is not followed by one pays nothing for it. A manager
        that has saved already keeps its own skeleton (the restore of its own checkpoint)."""
        if self._skeletons.specs is None:
            self._skeletons.seed = (directory, manifest)

    def adopt_unflushed(self, checkpoint: LocalCheckpoint) -> None:
        """A restored local checkpoint that is not in the shared root yet: flush it at the
        latest in :meth:`flush`."""
        self._unflushed = checkpoint

    # ------------------------------------------------------------------ saving

    def start(
        self,
        request: SaveRequest,
        static: str | None,
        *,
        blocking: bool,
        copy: bool,
        start: float,
        pending: PendingDir | None = None,
    ) -> Path:
        """Collective: plan a save of ``request`` and start writing it (or write and commit it,
        with ``blocking``). Nothing may be in flight. Returns the checkpoint's directory.

        ``pending``: the temporary directory :meth:`create_dir` made already (the same on
        every rank; ``None``: made here, in one more round)."""
        assert self._in_flight is None, "finish the save in flight first"
        step = request.step
        if self.local is not None:
            pending = self.local.create_pending(step)
        elif pending is None:
            pending = self._coll.broadcast(
                f"creating a temporary directory in {self.root}",
                lambda: PendingDir.for_step(self.root, step).create(),
            )
        plan = Planned.of(
            lambda: plan_write(
                self.topo,
                pending.path,
                request.data,
                step=step,
                cache=self._skeletons,
                bounce=self._bounce,
                digester=self.digester,
                recycled=self._recycled if self.local is None else None,
            )
        )
        if not blocking and self.topo.comm.any_true(plan.failed):
            blocking = True  # a rank could not plan: finish now, so every rank raises its error
        if blocking:  # the bytes are written here, checksummed between the runs of the
            # write (while the disk works), then fsynced on the writer thread while the
            # manifest is made here
            task, written = self._write_here(plan)
            self._in_flight = _SaveFlight(request, static, pending, task, start, written)
            self.wait()
        else:  # the same on the writer thread, the fsync queued behind it there: whoever
            # waits for the save makes the manifest while the fsync runs
            job = plan.result()  # (every rank planned)
            if copy:  # the last step of the caller's wait: a local memcpy
                staged = self._staging.stage(job.arrays, private=request.data.staged)
                job = dataclasses.replace(job, arrays=staged)
            task = self._writer.submit(functools.partial(_write_described, job, _nothing))
            written = self._writer.submit(job.sync)
            self._in_flight = _SaveFlight(request, static, pending, task, start, written)
        return pending.final

    def _write_here(self, plan: Planned) -> tuple[Future[RankWritten], Future[None] | None]:
        """Local: write this rank's part of a blocking save on this thread and hand its fsync
        to the writer thread once the bytes are written; the outcome (or the plan's or the
        write's error) and the fsync, if it was started."""
        task: Future[RankWritten] = Future()
        syncing: _Syncing | None = None
        try:
            job = plan.result()
            syncing = _Syncing(self._writer, job.sync)
            task.set_result(_write_described(job, syncing.start))
        except Exception as exc:
            task.set_exception(exc)
        return task, None if syncing is None else syncing.future

    def create_dir(self, step: int) -> PendingDir | None:
        """Coordinator: the temporary directory of a save of ``step`` in the shared root, for
        :meth:`start` (``None`` with a node-local tier, where every node makes its own)."""
        return None if self.local is not None else PendingDir.for_step(self.root, step).create()

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
        if self.topo.comm.any_true(not self._in_flight.done()):
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
        request, pending, local = flight.request, flight.pending, self.local
        try:
            manifest = finish_set(
                self.topo, flight.task.result, step=request.step, static=flight.static,
                metrics=request.metrics, library_version=__version__,
                pending=None if local else pending,
                durable=None if flight.written is None else flight.written.result,
                everywhere=local is not None,
            )  # fmt: skip
        except Exception:
            if local is not None:
                local.rollback(pending)
            elif self._coll.is_coordinator:
                pending.rollback()
            raise
        if local is None:  # the manifest is the coordinator's alone (see finish_set)
            self._recycled = self._coll.broadcast(
                "recording the save",
                lambda: self._after_commit(_made(manifest), flight.start),
            )
        else:
            local.commit(pending, _made(manifest))
            self._unflushed = LocalCheckpoint(pending.final, _made(manifest))
            self._local_commits += 1
        self._committed(self._clock() - flight.start)
        if local is None:
            return
        flush_due = self._local_commits % self.flush_every == 0
        checkpoint = LocalCheckpoint(pending.final, _made(manifest))
        protect = local.partner_copy_job(checkpoint)
        if protect is not None:
            task = self._writer.submit(protect)
            self._in_flight = _ProtectFlight(checkpoint, task, self._clock(), flush_due)
        elif flush_due:
            self._start_flush()

    # ------------------------------------------------------------------ partner copies

    def protect(self, checkpoint: LocalCheckpoint) -> None:
        """Collective: copy a restored local checkpoint to the partner nodes again, in the
        background (nothing else in flight). A lost node's partner copies were lost with it,
        and a job on another node set has another ring: until this is done, a second loss
        would find nothing."""
        job = self.local.partner_copy_job(checkpoint) if self.local is not None else None
        if job is None or self._in_flight is not None:
            return
        self._in_flight = _ProtectFlight(checkpoint, self._writer.submit(job), self._clock(), False)

    def _finish_protect(self, flight: _ProtectFlight) -> None:
        """Collective: learn whether every node's partner copy is committed; record it in the
        shared root if so, else warn (once per run: the next save tries again)."""
        step = flight.checkpoint.manifest.step
        try:
            problems: list[str] = self._coll.all_reduce(
                f"protecting step {step}", flight.task.result, lambda f: [p for p in f if p]
            )
        except ResilientError as exc:
            problems = [str(exc)]
        if not problems:
            took = round(self._clock() - flight.start, 6)
            self._coll.broadcast(
                "recording the partner copies",
                lambda: storage.append_log(
                    self.root / filenames.PROTECT_LOG,
                    {"time": time.time(), "step": step, "protect_s": took,
                     "bytes": flight.checkpoint.manifest.nbytes},
                ),
            )  # fmt: skip
        elif self._coll.is_coordinator:
            level = logging.DEBUG if self._unprotected_said else logging.WARNING
            log.log(level, "local checkpoint step %d is valid but not protected (the next save "
                    "tries again): %s", step, problems[0])  # fmt: skip
        self._unprotected_said = self._unprotected_said or bool(problems)
        if flight.flush_due:
            self._start_flush()

    # ------------------------------------------------------------------ flushing

    def _start_flush(self) -> None:
        """Collective: start copying the newest local checkpoint to the shared root."""
        assert self.local is not None and self._unflushed is not None
        checkpoint, self._unflushed = self._unflushed, None
        step = checkpoint.manifest.step
        pending = self._coll.broadcast(
            f"creating a temporary directory in {self.root}",
            lambda: PendingDir.for_step(self.root, step).create(),
        )
        task = self._writer.submit(
            self.local.flush_job(checkpoint, pending.path, bounce=self._bounce)
        )
        self._in_flight = _FlushFlight(checkpoint, pending, task, self._clock())

    def _finish_flush(self, flight: _FlushFlight) -> None:
        manifest, pending = flight.checkpoint.manifest, flight.pending
        what = f"flush of checkpoint step {manifest.step} to {self.root}"
        try:
            self._coll.all_reduce(
                what, flight.task.result, lambda _: pending.commit(manifest, what=what)
            )
        except Exception:
            if self._coll.is_coordinator:
                pending.rollback()
            raise
        self._coll.broadcast(
            "recording the flush",
            lambda: self._after_commit(manifest, flight.start, flushed=True),
        )

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
        storage.append_log(
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
        reuse = trashed.checkpoints[-1] if trashed.checkpoints and self.local is None else None
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


def _made(manifest: Manifest | None) -> Manifest:
    """The manifest a commit returned where it returns one."""
    assert manifest is not None, "finish_set returns the manifest here"
    return manifest
