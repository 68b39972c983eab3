"""CheckpointManager: steps, policies and rotation; the public API of the core.

The manager decides *when* and *which*: the save policy, the step bookkeeping and the keep
policy. Saves in flight and their commits are :mod:`resilient.checkpoint.saving`; where they
are committed and where a restore looks first, the shared root alone or a node-local tier over
it (its partner copies, flushes and restore chain), :mod:`resilient.checkpoint.savepaths` and
:mod:`resilient.checkpoint.tiermanager`; how a set of ranks writes
and commits one checkpoint is :mod:`resilient.checkpoint.saveset`; static data is
:mod:`resilient.checkpoint.statics`; restoring with fallback is :mod:`resilient.checkpoint.restorer`;
what is on disk is :mod:`resilient.io.checkpoints` (read) and :mod:`resilient.checkpoint.catalog` (kept in
memory for rotation).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from resilient._renamed import renamed_keyword
from resilient.checkpoint.catalog import Catalog
from resilient.checkpoint.reading import log_absent
from resilient.checkpoint.redundancy import DEFAULT_SET_SIZE, check_redundancy, check_set_size
from resilient.checkpoint.restorer import Restorer, StateValidator
from resilient.checkpoint.saving import SavePipeline
from resilient.checkpoint.statics import StaticStore
from resilient.checkpoint.tiers import LocalTier, record_local_tiers
from resilient.errors import (
    ConfigError,
    ResilientError,
)
from resilient.io import storage
from resilient.io.checkpoints import latest_valid
from resilient.io.runkey import check_run_key, normalize_run_key
from resilient.io.targets import DirectoryTarget, RootHold, Target, as_target
from resilient.model.blocks import BlockSpec
from resilient.model.layout import Layout
from resilient.model.payload import SaveRequest, local_targets, put_back, split_template
from resilient.model.policies import KeepPolicyLike, SaveContext, SavePolicyLike
from resilient.model.tree import Memo
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Comm, as_comm
from resilient.parallel.setcomms import make_set_comms

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


_P = ParamSpec("_P")
_R = TypeVar("_R")


DEFAULT_SHARD_RANKS = 128
"""Ranks per manifest shard by default: a node or two of ranks; a shard of 128 ranks x 300
arrays is ~4 MB of JSON, written by its leader in ~0.1 s (bench/bench_scale.py)."""

PAUSE_GC_ENV = "RESILIENT_PAUSE_GC"
"""Set to ``1`` to pause Python's cyclic garbage collector during saves and restores."""


def _gc_paused(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` with Python's cyclic garbage collector paused, only where the user asked
    for it (``RESILIENT_PAUSE_GC=1``, read at each call): the collector is process-wide state,
    so pausing it pauses it for the program's other threads too. What it buys: a save or
    restore of thousands of small arrays allocates tens of thousands of small objects, which
    trigger collections; pausing saved 4-8% of a save or restore of 4,000 arrays of 4 KiB
    (``bench/bench_state_dict.py --cases many4k``, 3 alternating runs) and nothing measurable
    on a model's state dict. A process with many live objects gains more (a full collection
    scans them all)."""

    @functools.wraps(method)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if os.environ.get(PAUSE_GC_ENV) != "1" or not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused


class CheckpointManager:
    """Save and restore per-rank state as checkpoints under ``checkpoint_dir``.

    Construction, :meth:`save`, :meth:`restore`, :meth:`latest_step`, :meth:`should_save` and
    :meth:`close` are collective over ``comm``: call them on all ranks, in the same order.

    Args:
        checkpoint_dir: the checkpoint directory (created if needed; shared by all ranks), or
            a :class:`~resilient.io.targets.Target` to keep the checkpoints in instead (e.g. a
            :class:`~resilient.io.targets.MemoryTarget`, one process's, for tests: every save,
            rotation, validation and restore goes through it). ``root`` is its deprecated
            alias. A target that is not a directory takes no ``local_dir``.
        comm: the ranks of this checkpoint set: an mpi4py communicator, a torch.distributed
            process group (or ``torch.distributed`` itself: its default group), a
            :class:`resilient.parallel.comm.Comm`, or ``None`` for one process. Rank 0 coordinates.
        checkpoint_comm: which ranks share a file: ``"self"`` (one file per rank), ``"node"``
            (one per node), ``"world"`` (one for all), or any sub-communicator of ``comm``
            (one file per group of it).
        keep: keep policy applied after every commit (``None`` keeps everything).
        save_when: save policy behind :meth:`should_save` (``None``: never by policy).
        gc_every: run ``gc.collect()`` after every ``gc_every`` saves (long runs grow otherwise).
        clock: monotonic clock, injectable for tests.
        lock_owner: extra facts recorded in the root's lock file for the error message a second
            job gets (e.g. ``{"slurm_job_id": "123"}``).
        local_dir: node-local storage (``$SLURM_TMPDIR``, NVMe, ``/dev/shm``): checkpoints are
            written there (:mod:`resilient.checkpoint.tiers`) and copied to ``root`` in the background every
            ``flush_every`` checkpoints, and always the newest one at :meth:`close`.
            :meth:`restore` prefers a local copy that is intact on every node and at least as
            new as the newest checkpoint in ``root``.
        flush_every: with ``local_dir``: copy every this many checkpoints to ``root``.
        local_keep: with ``local_dir``: local checkpoints kept per node (``keep`` applies to
            ``root``).
        redundancy: with ``local_dir``: ``"partner"`` copies each node's local checkpoint to
            the next node's local tier in the background (:mod:`resilient.checkpoint.partner`), so a
            restore on a job that lost a node rebuilds its files from that copy before it
            looks at ``root``; ``"xor"`` keeps XOR parity over sets of up to ``xor_set_size``
            nodes instead (:mod:`resilient.checkpoint.xorsets`: one lost node per set, for
            ``1 / (n - 1)`` of the bytes; partner copies below 3 nodes). ``None``: no copies.
        xor_set_size: with ``redundancy="xor"``: the most nodes in a set (at least 3; SCR's
            default 8).
        run_key: the parameters that define this run's result (JSON values, e.g.
            ``{"nx": 512, "alpha": 0.2}``; not what may change between its jobs, such as the
            number of steps or, for an elastic state, the rank count). Recorded in ``root`` at
            the first save; a manager whose key differs from the recorded one raises
            :class:`~resilient.errors.ForeignRunError` (a :class:`ConfigError`) on every rank
            at construction, naming the differing keys,
            before anything in ``root`` is touched (:mod:`resilient.io.runkey`).
        manifest_shard_ranks: a checkpoint set of more ranks than this writes its manifest in
            shards of about this many ranks (whole file groups) beside a small index (schema
            3): no rank gathers, encodes or parses every rank's entries, each shard's leader
            is the only rank of it that talks to rank 0, and at a restore reads its shard once
            for its ranks. ``None``: one manifest whatever the rank count. With ``local_dir``
            no shard spans two nodes: each node's copy holds the shards of its own ranks and
            the index.
        static_copies: copies of the static data's files (``static=`` of :meth:`save`): 2
            (default) or 1, for static data too large to store twice. Its manifest, shards and
            ``COMMITTED`` always have two copies; one damaged copy is repaired from the other
            at the next restore or save of it. With 1, a damaged data file of it is an error
            (:class:`~resilient.errors.StaticDataError`) that names the file and this option.
    """

    @renamed_keyword("root", "checkpoint_dir")
    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | Target,
        *,
        comm: Any = None,
        checkpoint_comm: Any = "self",
        keep: KeepPolicyLike | None = None,
        save_when: SavePolicyLike | None = None,
        gc_every: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        lock_owner: Mapping[str, str] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        flush_every: int = 1,
        local_keep: int = 2,
        redundancy: str | None = None,
        xor_set_size: int = DEFAULT_SET_SIZE,
        run_key: Mapping[str, Any] | None = None,
        manifest_shard_ranks: int | None = DEFAULT_SHARD_RANKS,
        static_copies: int = 2,
    ) -> None:
        self.target: Target = as_target(checkpoint_dir)
        # the checkpoint directory (``None``: a target that is not one)
        self.root: Path | None = (
            self.target.root if isinstance(self.target, DirectoryTarget) else None
        )
        self.run_key = normalize_run_key(run_key)
        self.comm: Comm = as_comm(comm)
        self.keep = keep
        self.save_when = save_when
        self.gc_every = gc_every
        self._clock = clock
        self._coll = Collective(self.comm)
        self._lock_owner = lock_owner
        self._held: RootHold | None = None
        self._deleter = storage.BackgroundDeleter()
        self._statics = StaticStore(self.target, copies=static_copies)
        self._catalog = Catalog(self.target, self._statics)
        self._closed = False
        self._saves = 0
        self._saves_started = 0
        self._last_saved_step: int | None = None
        self._last_saved_time: float | None = clock()
        self.save_cost_s: float | None = None
        if gc_every is not None and (not isinstance(gc_every, int) or gc_every < 1):
            raise ConfigError(f"gc_every must be a positive integer or None, got {gc_every!r}")
        if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
            raise ConfigError(f"flush_every must be a positive integer, got {flush_every!r}")
        if local_dir is not None and self.root is None:
            raise ConfigError(
                f"local_dir={str(local_dir)!r} keeps node-local copies of a checkpoint "
                f"directory: it needs checkpoint_dir to be a directory, not a target ({self.target})"
            )
        check_set_size(xor_set_size)
        if check_redundancy(redundancy) is not None and local_dir is None:
            raise ConfigError(
                f"redundancy={redundancy!r} copies node-local checkpoints to other nodes: it "
                "needs local_dir (node-local storage such as $SLURM_TMPDIR or /dev/shm)"
            )
        if manifest_shard_ranks is not None and (
            not isinstance(manifest_shard_ranks, int)
            or isinstance(manifest_shard_ranks, bool)
            or manifest_shard_ranks < 1
        ):
            raise ConfigError(
                f"manifest_shard_ranks must be a positive integer or None, got "
                f"{manifest_shard_ranks!r}"
            )
        self.set_comms = make_set_comms(
            self.comm, checkpoint_comm,
            shard_ranks=manifest_shard_ranks, by_node=local_dir is not None,
        )  # fmt: skip
        self._memo = Memo()  # what the saves and restores of this manager's states share
        self._coll.broadcast(f"opening checkpoint root {self.target}", self._open_root)
        local: LocalTier | None = None
        if local_dir is not None:
            root = self.root
            assert root is not None
            try:
                local = LocalTier(
                    local_dir, root, self.set_comms, keep=local_keep, redundancy=redundancy,
                    xor_set_size=xor_set_size,
                )
                tiers = local.listing()
                self._coll.broadcast(
                    "recording the local tier", lambda: record_local_tiers(root, tiers)
                )
            except BaseException:
                self._release()
                raise
        self._pipeline = SavePipeline(
            self.target, self.set_comms, catalog=self._catalog, statics=self._statics,
            run_key=self.run_key, deleter=self._deleter, keep=keep,
            local=local, flush_every=flush_every, clock=clock, committed=self._committed,
        )  # fmt: skip
        self._path = self._pipeline.path  # the shared root, or a node-local tier over it
        self._restorer = Restorer(
            self.target, self._coll, self._catalog, layout=self.set_comms.layout,
            memo=self._memo, digester=self._pipeline.digester, devices=self._pipeline.devices,
            shards=self.set_comms if self.set_comms.shard is not None else None,
        )  # fmt: skip

    def _open_root(self) -> None:
        try:
            self.target.prepare_root()
            self._held = self.target.lock(self._lock_owner)
            check_run_key(self.target, self.run_key)
            self.target.clean_up()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Local: drop the root's lock, if this process holds it."""
        if self._held is not None:
            self._held.release()
            self._held = None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Collective: release the root's lock. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()  # the newest checkpoint always reaches the shared root
        finally:
            self._closed = True
            self._pipeline.shutdown()
        self._deleter.wait()
        self.comm.barrier()
        self._release()

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
            self._pipeline.shutdown()  # what was in flight is removed by the next run
            self._deleter.wait()
            self._release()

    @property
    def layout(self) -> Layout:
        """The layout this manager writes."""
        return self.set_comms.layout

    # ------------------------------------------------------------------ queries

    def latest_step(self) -> int | None:
        """Collective: the step of the newest checkpoint that passes quick validation."""

        def newest() -> int | None:
            record = latest_valid(self.target)
            return None if record is None else record.step

        return self._coll.broadcast("finding the latest checkpoint", newest)

    def should_save(
        self,
        step: int,
        *,
        time_left_s: float | None = None,
        stop_requested: bool = False,
        veto: bool = False,
    ) -> bool:
        """Collective: whether ``save_when`` asks for a save at ``step`` (rank 0 decides;
        its ``veto``: no save now, whatever the policy says).

        Cheap enough to call every step: one small allreduce (ranks arrive together here, so
        no sleeping barrier), not a broadcast behind a barrier. Only when rank 0 votes yes (a
        save, or a policy that raised) does a broadcast follow, so that a failing policy raises
        the same error on every rank.
        """
        decision = False
        error: Exception | None = None
        if self.comm.rank == 0 and self.save_when is not None and not veto:
            try:
                ctx = self.save_context(
                    step, time_left_s=time_left_s, stop_requested=stop_requested
                )
                decision = bool(self.save_when(ctx))
            except Exception as exc:
                error = exc
        if not self.comm.any_true(decision or error is not None):  # only rank 0 votes
            return False
        self._coll.announce(f"save decision at step {step}", error)  # rank 0's error, if any
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

    @_gc_paused
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
                for :class:`~resilient.model.policies.KeepBest`.
            blocking: ``False`` returns once the state is planned and copied into staging
                buffers (reused between saves); the write, its checksums and its fsync run on a
                background thread, and the commit (manifest, marker, rename, the save log, rotation)
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
        try:
            request: SaveRequest | Exception = SaveRequest.build(
                step, state, static, metrics, memo=self._memo, device=self._pipeline.devices
            )
        except Exception as exc:  # raised on every rank by the save's first round
            request = exc
        ready = self._pipeline.ready(step, request, first=self._saves_started == 0)
        self._saves_started += 1
        self._last_saved_step = ready.request.step
        self._last_saved_time = self._clock()
        return self._pipeline.start(ready, blocking=blocking, copy=copy, start=start)

    def wait(self) -> None:
        """Collective: finish what is in flight, if anything: wait for every rank's background
        write, then commit it (and, with ``local_dir``, the flush to ``root`` it may start).
        Returns at once when nothing is in flight.

        Raises:
            CollectiveError: the save or flush failed on some rank (on every rank; its temporary
                directory is removed, earlier checkpoints are intact).
        """
        self._pipeline.wait()

    def poll(self) -> bool:
        """Collective: commit what is in flight if every rank's background work is done.

        Costs one small allreduce while something is in flight, nothing otherwise.

        Returns:
            ``True`` when nothing is in flight any more.

        Raises:
            CollectiveError: as :meth:`wait`.
        """
        return self._pipeline.poll()

    def flush(self) -> None:
        """Collective: with ``local_dir``, copy the newest local checkpoint to ``root`` now (if
        it is not there yet) and wait until it is committed. Without ``local_dir``: :meth:`wait`.
        """
        self._pipeline.flush()

    @property
    def in_flight(self) -> bool:
        """Whether a save or flush is in flight on this rank (local, no communication)."""
        return self._pipeline.in_flight

    def _committed(self, cost: float) -> None:
        """Called on every rank after each commit of a save (not of a flush)."""
        self._saves += 1
        self.save_cost_s = cost if self.save_cost_s is None else 0.5 * (self.save_cost_s + cost)
        if self.gc_every and self._saves % self.gc_every == 0:
            gc.collect()

    # ------------------------------------------------------------------ restore

    @_gc_paused
    def restore(
        self,
        step: int | None = None,
        *,
        validate: StateValidator | None = None,
        into: Mapping[str, Any] | None = None,
        blocks: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Collective over ``comm``: call on all ranks. Load the newest valid checkpoint (or
        ``step``'s).

        Each rank reads its own piece (and its static data, merged into the state) and checks
        every array's checksum. A checkpoint that fails on any rank, or whose state
        ``validate`` rejects on any rank, is quarantined and the next older one is tried.

        A checkpoint saved on another number of ranks (or with another ``checkpoint_comm``) is
        restored *elastically* when all its per-rank data is declared:
        :class:`~resilient.model.blocks.Block` leaves (each rank gets its new block, given by
        ``blocks`` or by a ``Block`` in ``into``; it reads only the stripes of rows of the
        stored blocks that overlap it, from whatever files hold them, and verifies each stripe
        it reads) and :class:`~resilient.model.blocks.Replicated` subtrees (saved rank 0's copy).
        The same happens on the same rank count when some rank's new block differs from the one
        it saved.

        Args:
            step: restore this step instead of the newest.
            validate: ``callable(state) -> bool``; a rejected checkpoint is quarantined.
            into: a state of the same structure (e.g. ``{"model": model.state_dict()}``) whose
                arrays and tensors are filled in place instead of allocating new ones (CUDA
                tensors through the pinned arena of the saves, without device memory, each
                copied to its device as soon as it is read and verified, while the next are
                read; the target's device wins over the saved one)
                (shapes and dtypes are checked first: a mismatch raises :class:`ConfigError`
                naming the leaf and quarantines nothing). The result holds those very objects,
                so ``model.load_state_dict(state["model"])`` copies nothing twice. If a
                checkpoint fails its checksums half-way, the targets may hold part of it
                (arrays read in place: any of its bytes; device tensors: only tensors verified
                before the failure) and its older fallback, read into the same targets,
                overwrites every leaf it holds (a leaf it lacks keeps what was there; with no
                fallback, :class:`CheckpointNotFoundError` leaves the targets so).
                A ``Block(np.empty(shape), global_shape, start)`` leaf is this rank's new block
                of that leaf, read in place. A DTensor leaf (FSDP2, tensor parallelism) is one
                too: its whole local piece, read into its local tensor from the stored pieces
                that overlap it, whatever mesh or rank count saved them; the result holds the
                DTensor itself. A checkpoint's DTensor leaves need targets here (or blocks in
                ``blocks``): only this run's DTensors know its mesh and placements
                (:mod:`resilient.model.dtensors`).
            blocks: this rank's new block of each Block leaf, by leaf path (``"u"``,
                ``"model/layer1.weight"``): ``(global_shape, start, shape)`` or a
                :class:`~resilient.model.blocks.BlockSpec` (see :func:`~resilient.model.blocks.cartesian_block`).

        Returns:
            ``(step, state)`` for this rank, ``state`` being the saved structure (dicts,
            lists, tuples), numpy arrays, and torch tensors where tensors were saved, on their
            saved device where it exists here (CUDA tensors read through the pinned arena into
            new device tensors), else on the CPU (logged once per restore).

        Raises:
            CheckpointNotFoundError: no valid checkpoint (or ``step`` is not valid).
            LayoutMismatchError: the newest checkpoint has another layout or rank count and
                per-rank data that is neither a Block nor Replicated (its ``keys`` name them).
            ConfigError: ``into`` does not fit the checkpoint, an elastic restore lacks the
                new block of a Block leaf, or a DTensor leaf has no target (naming it).
        """
        self._check_open()
        self.wait()

        def arguments() -> tuple[dict[str, Any] | None, dict[str, BlockSpec]]:
            leaves, specs = (
                split_template(into, memo=self._memo) if into is not None else (None, {})
            )
            for path, value in (blocks or {}).items():
                specs[path] = _block_spec(path, value)
            return leaves, specs

        swaps: dict[int, Any] = {}  # DTensors of into=, by their local tensors read into
        try:  # checked by every rank in the restore's first round (the same error everywhere)
            leaves, specs = arguments()
            if leaves is not None:
                leaves, swaps = local_targets(leaves)
            refused = None
        except Exception as exc:
            leaves, specs, refused = None, {}, exc
        self._restorer.absent_devices.clear()
        restored, state = self._path.restore(  # a node-local tier looks at its own copies first
            self._restorer, step, validate=validate, into=leaves, blocks=specs, refused=refused
        )
        last = self._restorer.last_restored
        if last is not None:  # a restart's first save skips planning
            self._pipeline.after_restore(last[0].opener, last[1])
        if self._restorer.absent_devices:  # one line per restore (state and static data)
            where = str(self.target if last is None else last[0])
            log_absent(where, self._restorer.absent_devices)
        self._last_saved_step = restored
        return restored, put_back(state, swaps)

    @property
    def passed_over(self) -> tuple[int, ...]:
        """The steps newer than the one the last :meth:`restore` returned that failed
        validation and were quarantined on its way, on the coordinator (rank 0); empty on the
        other ranks."""
        return tuple(self._restorer.passed_over)

    def _check_open(self) -> None:
        if self._closed:
            raise ResilientError("this CheckpointManager is closed")


def _block_spec(path: str, value: Any) -> BlockSpec:
    """``blocks[path]`` as a checked spec."""
    if isinstance(value, BlockSpec):
        return BlockSpec.of(value.global_shape, value.start, value.shape, what=f"blocks[{path!r}]")
    try:
        global_shape, start, shape = value
    except (TypeError, ValueError):
        raise ConfigError(
            f"blocks[{path!r}] must be (global_shape, start, shape), got {value!r}"
        ) from None
    return BlockSpec.of(global_shape, start, shape, what=f"blocks[{path!r}]")
