"""CheckpointManager: steps, policies and rotation; the public API of the core.

The manager decides *when* and *which*: the save policy, the step bookkeeping and the keep
policy. How a set of ranks writes and commits one checkpoint is :mod:`resilient.checkpointer`;
static data is :mod:`resilient.statics`; restoring with fallback is :mod:`resilient.restorer`;
what is on disk is :mod:`resilient.validate` (read) and :mod:`resilient.catalog` (kept in
memory for rotation).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

from resilient import layout, storage
from resilient._version import __version__
from resilient.background import BackgroundWriter
from resilient.catalog import Catalog, save_record
from resilient.checkpointer import (
    RankWritten,
    SkeletonCache,
    WriteJob,
    finish_set,
    plan_write,
    planned,
)
from resilient.collective import Collective
from resilient.comm import Comm, as_comm
from resilient.commit import PendingDir
from resilient.errors import (
    ConfigError,
    ResilientError,
)
from resilient.manifest import LayoutInfo, Manifest
from resilient.payload import SaveRequest
from resilient.policies import KeepPolicyLike, SaveContext, SavePolicyLike
from resilient.restorer import Restorer, StateValidator
from resilient.staging import StagingArea
from resilient.statics import StaticStore
from resilient.topology import make_topology
from resilient.validate import latest_valid

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """Save and restore per-rank state as checkpoints under ``root``.

    Construction, :meth:`save`, :meth:`restore`, :meth:`latest_step`, :meth:`should_save` and
    :meth:`close` are collective over ``comm``: call them on all ranks, in the same order.

    Args:
        root: the checkpoint root directory (created if needed; shared by all ranks).
        comm: the ranks of this checkpoint set: an mpi4py communicator, a
            :class:`resilient.comm.Comm`, or ``None`` for one process. Rank 0 coordinates.
        checkpoint_comm: which ranks share a file: ``"self"`` (one file per rank), ``"node"``
            (one per node), ``"world"`` (one for all), or any sub-communicator of ``comm``
            (one file per group of it).
        keep: keep policy applied after every commit (``None`` keeps everything).
        save_when: save policy behind :meth:`should_save` (``None``: never by policy).
        gc_every: run ``gc.collect()`` after every ``gc_every`` saves (long runs grow otherwise).
        clock: monotonic clock, injectable for tests.
        lock_owner: extra facts recorded in the root's lock file for the error message a second
            job gets (e.g. ``{"slurm_job_id": "123"}``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        comm: Any = None,
        checkpoint_comm: Any = "self",
        keep: KeepPolicyLike | None = None,
        save_when: SavePolicyLike | None = None,
        gc_every: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        lock_owner: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.comm: Comm = as_comm(comm)
        self.keep = keep
        self.save_when = save_when
        self.gc_every = gc_every
        self._clock = clock
        self._coll = Collective(self.comm)
        self._lock = storage.RootLock(self.root, owner=lock_owner)
        self._deleter = storage.BackgroundDeleter()
        self._statics = StaticStore(self.root)
        self._catalog = Catalog(self.root, self._statics)
        self._closed = False
        self._staging = StagingArea()
        self._writer = BackgroundWriter("resilient-writer")
        self._skeletons = SkeletonCache()
        self._in_flight: _InFlight | None = None
        self._saves = 0
        self._last_saved_step: int | None = None
        self._last_saved_time: float | None = clock()
        self.save_cost_s: float | None = None
        if gc_every is not None and (not isinstance(gc_every, int) or gc_every < 1):
            raise ConfigError(f"gc_every must be a positive integer or None, got {gc_every!r}")
        self.topology = make_topology(self.comm, checkpoint_comm)
        self._restorer = Restorer(
            self.root, self._coll, self._catalog, layout=self.topology.layout_info
        )
        self._coll.broadcast(f"opening checkpoint root {self.root}", self._open_root)

    def _open_root(self) -> None:
        try:
            storage.ensure_root(self.root)
            self._lock.acquire()
            storage.cleanup_leftovers(self.root)
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Collective: release the root's lock. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown()
            self._staging.release()
        self._deleter.wait()
        self.comm.barrier()
        self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:  # other ranks may be elsewhere: no collective on the error path
            self._closed = True
            self._in_flight = None  # its temporary directory is removed by the next run
            self._deleter.wait()
            self._lock.release()

    @property
    def layout(self) -> LayoutInfo:
        """The layout this manager writes."""
        return self.topology.layout_info

    # ------------------------------------------------------------------ queries

    def latest_step(self) -> int | None:
        """Collective: the step of the newest checkpoint that passes quick validation."""

        def newest() -> int | None:
            record = latest_valid(self.root)
            return None if record is None else record.step

        return self._coll.broadcast("finding the latest checkpoint", newest)

    def should_save(
        self, step: int, *, time_left_s: float | None = None, stop_requested: bool = False
    ) -> bool:
        """Collective: whether ``save_when`` asks for a save at ``step`` (rank 0 decides).

        Cheap enough to call every step: one small allreduce (ranks arrive together here, so
        no sleeping barrier), not a broadcast behind a barrier. Only when rank 0 votes yes (a
        save, or a policy that raised) does a broadcast follow, so that a failing policy raises
        the same error on every rank.
        """
        decision = False
        error: Exception | None = None
        if self.comm.rank == 0 and self.save_when is not None:
            try:
                ctx = self.save_context(
                    step, time_left_s=time_left_s, stop_requested=stop_requested
                )
                decision = bool(self.save_when(ctx))
            except Exception as exc:
                error = exc
        if not self.comm.any_true(decision or error is not None):  # only rank 0 votes
            return False
        self._coll.broadcast(f"save decision at step {step}", functools.partial(_reraise, error))
        return True

    def save_context(
        self, step: int, *, time_left_s: float | None = None, stop_requested: bool = False
    ) -> SaveContext:
        """The :class:`SaveContext` a save policy sees at ``step`` (local, no communication)."""
        return SaveContext(
            step=step,
            now=self._clock(),
            last_saved_step=self._last_saved_step,
            last_saved_time=self._last_saved_time,
            time_left_s=time_left_s,
            stop_requested=stop_requested,
            save_cost_s=self.save_cost_s,
        )

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        static: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        *,
        blocking: bool = True,
        copy: bool = True,
    ) -> Path:
        """Collective over ``comm``: write and commit a checkpoint of ``step``.

        A save still in flight is finished first (at most one is in flight).

        Args:
            step: a non-negative integer, the same on every rank.
            state: this rank's piece: names -> numpy arrays or small JSON values.
            static: data that does not change between steps; stored once by content hash and
                shared by later checkpoints (rewritten only when it changes). Always written
                before this call returns.
            metrics: JSON values describing the checkpoint (rank 0's are kept), e.g. a loss
                for :class:`~resilient.policies.KeepBest`.
            blocking: ``False`` returns once the state is planned and copied into staging
                buffers (reused between saves); checksums, writes and fsyncs run on a background
                thread, and the commit (manifest, marker, rename, the save log, rotation)
                happens collectively at the next :meth:`save`, :meth:`wait`, :meth:`poll`,
                :meth:`restore` or :meth:`close`.
            copy: with ``blocking=False``, ``False`` takes no copy at all: the caller promises
                not to modify the arrays of ``state`` until :meth:`wait` (or another call
                above) has finished the save, e.g. immutable or double-buffered arrays.

        Returns:
            The checkpoint directory (committed, or to be committed by the next such call).

        Raises:
            CollectiveError: this save, or the one still in flight, failed on some rank; raised
                on every rank, earlier checkpoints intact.
        """
        self._check_open()
        self.wait()
        start = self._clock()
        built: list[SaveRequest] = []

        def check_arguments() -> int:
            built.append(SaveRequest.build(step, state, static, metrics))
            return built[0].step

        self._coll.all_reduce(f"save of step {step}", check_arguments, _same_step)
        request = built[0]
        static_hash = self._statics.store(self.topology, request.step, request.static)
        pending = self._coll.broadcast(
            f"creating a temporary directory in {self.root}",
            lambda: PendingDir.for_step(self.root, request.step).create(),
        )
        outcome = planned(
            lambda: plan_write(
                self.topology, pending.path, request.data, step=request.step,
                cache=self._skeletons,
            )
        )  # fmt: skip
        if not blocking and self.comm.any_true(_failed(outcome)):
            blocking = True  # a rank could not plan: finish now, so every rank raises its error
        if not blocking and copy:  # the last step of the caller's wait: a local memcpy
            job = outcome()
            staged = dataclasses.replace(job, arrays=self._staging.stage(job.arrays))
            outcome = lambda: staged  # noqa: E731
        task = self._writer.submit(lambda: outcome().run(), inline=blocking)
        self._in_flight = _InFlight(request, static_hash, pending, task, start)
        self._last_saved_step = request.step
        self._last_saved_time = self._clock()
        if blocking:
            self.wait()
        return pending.final

    def wait(self) -> None:
        """Collective: finish the save in flight, if any: wait for every rank's background
        write, then commit it. Returns at once when nothing is in flight.

        Raises:
            CollectiveError: the save failed on some rank (on every rank; its temporary
                directory is removed, earlier checkpoints are intact).
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        request = flight.request
        what = f"save of checkpoint step {request.step}"
        try:
            manifest = finish_set(
                self.topology, flight.task.result, step=request.step, static=flight.static,
                metrics=request.metrics, library_version=__version__,
                commit=lambda m: flight.pending.commit(m, what=what),
            )  # fmt: skip
        except Exception:
            if self._coll.is_coordinator:
                flight.pending.rollback()
            raise
        self._coll.broadcast(
            "recording the save", lambda: self._after_commit(manifest, flight.start)
        )
        self._saves += 1
        cost = self._clock() - flight.start
        self.save_cost_s = cost if self.save_cost_s is None else 0.5 * (self.save_cost_s + cost)
        if self.gc_every and self._saves % self.gc_every == 0:
            gc.collect()

    def poll(self) -> bool:
        """Collective: commit the save in flight if every rank's background write is done.

        Costs one small allreduce while a save is in flight, nothing otherwise.

        Returns:
            ``True`` when no save is in flight any more.

        Raises:
            CollectiveError: as :meth:`wait`.
        """
        if self._in_flight is None:
            return True
        if self.comm.any_true(not self._in_flight.task.done()):
            return False
        self.wait()
        return True

    @property
    def in_flight(self) -> bool:
        """Whether a save is in flight on this rank (local, no communication)."""
        return self._in_flight is not None

    def _after_commit(self, manifest: Manifest, start: float) -> None:
        """Coordinator: log the save, then rotate (a failed rotation only warns)."""
        storage.append_log(
            self.root / layout.SAVE_LOG,
            {"time": time.time(), "cost_s": round(self._clock() - start, 6),
             "bytes": manifest.nbytes, **save_record(manifest)},
        )  # fmt: skip
        if self.keep is None:
            return  # nothing is ever deleted: no need to know the history
        try:
            self._catalog.add(manifest)
            self._deleter.delete(self._catalog.apply(self._catalog.plan(self.keep)))
        except (OSError, ResilientError) as exc:
            log.warning("rotation in %s failed (checkpoints are intact): %s", self.root, exc)

    # ------------------------------------------------------------------ restore

    def restore(
        self, step: int | None = None, *, validate: StateValidator | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Collective over ``comm``: load the newest valid checkpoint (or ``step``'s).

        Each rank reads its own piece (and its static data, merged into the state) and checks
        every array's checksum. A checkpoint that fails on any rank, or whose state
        ``validate`` rejects on any rank, is quarantined and the next older one is tried.

        Returns:
            ``(step, state)`` for this rank.

        Raises:
            CheckpointNotFoundError: no valid checkpoint (or ``step`` is not valid).
            LayoutMismatchError: the newest checkpoint has another layout or rank count.
        """
        self._check_open()
        self.wait()
        restored, state = self._restorer.restore(step, validate=validate)
        self._last_saved_step = restored
        return restored, state

    def _check_open(self) -> None:
        if self._closed:
            raise ResilientError("this CheckpointManager is closed")


@dataclasses.dataclass(frozen=True, slots=True)
class _InFlight:
    """A save whose data is being written; committed by :meth:`CheckpointManager.wait`."""

    request: SaveRequest
    static: str | None
    pending: PendingDir
    task: Future[RankWritten]
    start: float


def _failed(outcome: Callable[[], WriteJob]) -> bool:
    try:
        outcome()
    except Exception:
        return True
    return False


def _reraise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _same_step(steps: list[int]) -> None:
    """Coordinator: every rank must save the same step."""
    if len(set(steps)) > 1:
        raise ConfigError(f"ranks disagree on the step: {sorted(set(steps))}")
