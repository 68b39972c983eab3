"""One save of a set of per-rank arrays: plan -> write -> finish. Collective. (One rank's read
of a checkpoint is :mod:`resilient.checkpoint.reading`.)

Used by :class:`resilient.checkpoint.saving.SavePipeline` for checkpoints (synchronous and
asynchronous) and by :class:`resilient.checkpoint.statics.StaticStore` for static data (through
:func:`save_set`). Call order (DCP's ``_save_state_dict``: plan, write, finish)::

    every rank    plan_rank()       local: names, shapes, dtypes; whether the cached skeleton
                                    of the previous save fits (the caller tells every rank of
                                    the group, in a round it holds anyway)
    every rank    plan_write()      local when the group's structure is unchanged (the cached
                                    skeleton is reused); else collective over the file's group:
                                    the leader plans the file's HDF5 metadata (h5format)
    every rank    WriteJob.run()    local, here or on a background thread: checksums, its
                                    bytes at its offsets, fsync (no communication)
    every rank    gather_set()      every rank's outcome to the coordinator; with a sharded
                                    manifest in two levels: up each shard to its leader, which
                                    writes the shard (write_shard), then up the leaders
    coordinator   commit_set()      builds the manifest (or a sharded one's index) and commits
                                    it; the caller announces the outcome

The caller moves the values (and each rank's error) with
:class:`~resilient.parallel.collective.Collective`, so a failure anywhere becomes the same
exception on every rank, never a hang.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resilient.io import fileio, storage
from resilient.io.commit import PendingDir
from resilient.io.digests import Digests
from resilient.io.idle import IdleWork
from resilient.io.skeleton import Skeleton
from resilient.io.targets import Target
from resilient.model import filenames, h5format
from resilient.model.blocks import stripe_rows
from resilient.model.checksum import (
    digest_arrays,
    digest_bytes,
    digest_stripes,
    digest_text,
)
from resilient.model.codec import files_fragment
from resilient.model.manifest import (
    SHARDED_SCHEMA_VERSION,
    DatasetTable,
    EncodedFiles,
    FileEntry,
    Manifest,
    RankEntry,
    Segment,
    ShardedRanks,
    ShardEntry,
    Stripes,
)
from resilient.model.payload import LocalData
from resilient.model.shards import shard_json
from resilient.model.tiling import file_checksum_text
from resilient.parallel.collective import Collective, Gathered
from resilient.parallel.setcomms import SetComms

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "FileWritten",
    "Planned",
    "RankPlan",
    "RankWritten",
    "ShardWritten",
    "SkeletonCache",
    "WriteJob",
    "build_index",
    "build_manifest",
    "commit_set",
    "gather_set",
    "plan_rank",
    "plan_write",
    "save_set",
    "seed_cache",
    "write_shard",
]


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank will write: its arrays' specs (and the same as columns) and its tree.

    The tree is :func:`~resilient.model.payload.split_state`'s private one (JSON values copied)."""

    rank: int
    specs: tuple[fileio.Spec, ...]
    tree: Any
    striped: frozenset[str] = frozenset()
    names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    nbytes: tuple[int, ...] = ()
    kinds: tuple[Any, ...] = field(default=(), compare=False)  # numpy dtypes, to compare

    @classmethod
    def of(cls, rank: int, data: LocalData, *, like: RankPlan | None = None) -> RankPlan:
        """Plan ``data`` of ``rank`` (no checksums, no I/O). The specs of ``like`` (the previous
        plan) are reused when the names, shapes and dtypes are the same: no per-array Python."""
        arrays = list(data.arrays.values())
        names = tuple(data.arrays)
        shapes = tuple(map(operator.attrgetter("shape"), arrays))
        kinds = tuple(map(operator.attrgetter("dtype"), arrays))
        if (
            like is not None
            and like.names == names
            and like.shapes == shapes
            and like.kinds == kinds
        ):
            return cls(rank, like.specs, data.tree, data.striped, names, shapes, like.dtypes,
                       like.nbytes, like.kinds)  # fmt: skip
        strs = {kind: kind.str for kind in set(kinds)}
        dtypes = tuple(map(strs.__getitem__, kinds))
        return cls(
            rank=rank,
            specs=tuple(zip(names, shapes, dtypes, strict=True)),  # ArraySpec-shaped tuples
            tree=data.tree,
            striped=data.striped,
            names=names,
            shapes=shapes,
            dtypes=dtypes,
            nbytes=tuple(map(operator.attrgetter("nbytes"), arrays)),
            kinds=kinds,
        )

    def entry(
        self,
        file: str,
        offsets: Sequence[int | None],
        digests: Sequence[str],
        stripes: Mapping[str, Stripes] | None = None,
    ) -> RankEntry:
        """This rank's manifest entry once its arrays (in plan order) sit at ``offsets`` in
        ``file`` with checksums ``digests``."""
        table = DatasetTable(
            self.names, self.shapes, self.dtypes, offsets, self.nbytes, "".join(digests), stripes
        )
        return RankEntry(file=file, datasets=table, tree=self.tree)


@dataclass(frozen=True, slots=True)
class FileWritten:
    """A data file as its group leader planned it: name, size, HDF5's own bytes, its ranks."""

    name: str
    size: int
    meta_segments: tuple[Segment, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankWritten:
    """What one rank reports after writing: its manifest entry; the file, from its leader."""

    entry: RankEntry
    file: FileWritten | None


@dataclass(slots=True)
class SkeletonCache:
    """The skeleton of this rank's last file, reused while its group's structure is unchanged.

    Every rank keeps its own offsets (in the order of its specs), specs and last plan; the
    group's leader also keeps every rank's specs and the file's bytes. ``generation`` names the
    skeleton the group agreed on last.
    """

    generation: int = 0
    # a restored checkpoint (the opener of its files, its manifest), for seed_cache
    seed: tuple[Callable[[str], fileio.RangeReader], Manifest] | None = None
    specs: tuple[fileio.Spec, ...] | None = None
    offsets: tuple[int | None, ...] = ()
    plan: RankPlan | None = None
    group_specs: Mapping[int, tuple[fileio.Spec, ...]] = field(default_factory=dict)
    skeleton: Skeleton | None = None


@dataclass(frozen=True, slots=True)
class _Offer:
    """What a rank sends its leader when planning: its specs, or ``None`` for "as last time"."""

    rank: int
    generation: int
    specs: tuple[fileio.Spec, ...] | None


@dataclass(frozen=True, slots=True)
class _Skeleton:
    """The leader's answer: the skeleton's generation, and every rank's offsets if it is new."""

    generation: int
    offsets: Mapping[int, tuple[int | None, ...]] | None  # in each rank's order


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One rank's part of a save, planned: runs here or on a background thread.

    :meth:`run` (:meth:`write`, then :meth:`describe`) does no communication, so it may run on
    any thread; its outcome (or its exception) goes to the coordinator (:func:`commit_set`).
    A blocking save writes here, hands the fsync to a thread and describes meanwhile.
    """

    target: Target  # where the data file goes: ``name`` in its pending copy ``pending``
    pending: PendingDir
    name: str
    plan: RankPlan
    offsets: Sequence[int | None]  # in the plan's order
    arrays: Mapping[str, npt.NDArray[np.generic]]
    skeleton: Skeleton | None  # the group's leader writes HDF5's own bytes
    members: tuple[int, ...] = ()  # the group's ranks, on its leader
    bounce: fileio.Bounce | None = None  # the writer's O_DIRECT buffer (None: one per write)
    digester: Executor | None = None  # the owner's checksum thread (None: one per save)

    def run(self) -> RankWritten:
        """:meth:`write`, then :meth:`describe`."""
        self.write()
        return self.describe()

    def describe(self, digests: Sequence[str] | None = None) -> RankWritten:
        """This rank's manifest entry: checksums of its arrays (``digests``, if already taken;
        Block leaves also by stripes of rows), and on the leader its file (after
        :meth:`write`: the skeleton may be built there). No I/O."""
        if digests is None:
            digests = digest_arrays(list(map(self.arrays.__getitem__, self.plan.names)))
        stripes = {}
        for k in self.plan.striped:
            arr = self.arrays[k]
            rows = stripe_rows(arr.shape, arr.dtype.itemsize)
            stripes[k] = Stripes(rows, tuple(digest_stripes(arr, rows)))
        entry = self.plan.entry(self.name, self.offsets, digests, stripes)
        file = None
        if self.skeleton is not None:
            built = self.skeleton.get()
            file = FileWritten(self.name, built.size, built.meta_segments, self.members)
        return RankWritten(entry, file)

    def digests_alongside(self, parts: int = 8) -> tuple[IdleWork, Digests]:
        """Checksums of this rank's arrays taken while :meth:`write` writes them: those of 1 MiB
        or more on a helper thread from now on (they are written with ``O_DIRECT``, and both
        release the GIL), the others in ``parts`` tasks for :meth:`write` to run between its
        runs of data. Run the tasks :meth:`write` left, then take the digests (plan order)."""
        arrays = list(map(self.arrays.__getitem__, self.plan.names))
        digests = Digests(len(arrays), helper=self.digester)
        index: Sequence[int] = range(len(arrays))
        if arrays and max(self.plan.nbytes) >= fileio.DIRECT_MIN:
            big = [i for i, n in enumerate(self.plan.nbytes) if n >= fileio.DIRECT_MIN]
            digests.add(big, [arrays[i] for i in big])
            index = [i for i, n in enumerate(self.plan.nbytes) if n < fileio.DIRECT_MIN]
        step = max(1, -(-len(index) // parts))

        def task(part: Sequence[int]) -> Callable[[], None]:
            if isinstance(part, range):  # all small: slices, no Python per array
                return functools.partial(digests.take, part, arrays[part.start : part.stop])
            return functools.partial(digests.take, part, [arrays[i] for i in part])

        tasks = [task(index[lo : lo + step]) for lo in range(0, len(index), step)]
        return IdleWork(tasks), digests

    def write(self, *, sync: bool = True, alongside: IdleWork | None = None) -> None:
        """Write this rank's arrays at their offsets (and, on the leader, HDF5's own bytes),
        fsync (or not: then :attr:`fsync` must follow); ``alongside``: CPU work to do while the
        disk writes (see :meth:`Target.write_data <resilient.io.targets.Target.write_data>`)."""
        arrays = list(map(self.arrays.__getitem__, self.plan.names))
        skeleton = self.skeleton.get if self.skeleton is not None else None
        write = functools.partial(
            self.target.write_data, self.pending, self.name, self.offsets, arrays,
            skeleton=skeleton, sync=sync, bounce=self.bounce,
            idle=alongside.run_one if alongside is not None else None,
        )  # fmt: skip
        storage.retry_io(write, what=f"writing {self.pending.path / self.name}")

    @property
    def fsync(self) -> Callable[[], None]:
        """What fsyncs what :meth:`write` wrote with ``sync=False`` (for any thread)."""
        sync = functools.partial(self.target.sync_data, self.pending, self.name)
        what = f"writing {self.pending.path / self.name}"
        return functools.partial(storage.retry_io, sync, what=what)


def plan_rank(comms: SetComms, data: LocalData, cache: SkeletonCache) -> int | None:
    """Local: plan this rank's part of a save (kept in ``cache.plan``; no I/O but a restored
    skeleton's, see :func:`seed_cache`).

    Returns:
        The generation of the cached skeleton this rank can write into unchanged (its names,
        shapes and dtypes are the last save's; on the leader, its skeleton is usable), or
        ``None`` when its group must plan its file again (:func:`plan_write`).
    """
    if cache.seed is not None:  # the first save after a restore: its file's skeleton
        seed = cache.seed
        cache.seed = None
        seed_cache(cache, comms, *seed)
    plan = RankPlan.of(comms.comm.rank, data, like=cache.plan)
    cache.plan = plan
    usable = comms.group.rank != 0 or (cache.skeleton is not None and cache.skeleton.usable)
    return cache.generation if usable and cache.specs == plan.specs else None


def plan_write(
    comms: SetComms,
    target: Target,
    pending: PendingDir,
    data: LocalData,
    *,
    step: int,
    cache: SkeletonCache,
    reuse: bool,
    claimed: bool = False,
    failed: Exception | None = None,
    bounce: fileio.Bounce | None = None,
    digester: Executor | None = None,
) -> WriteJob:
    """This rank's write of a save into ``pending`` (of ``target``), planned by :func:`plan_rank` (its write
    goes through ``bounce`` and its checksums through ``digester``, the caller's, if given: see
    :class:`resilient.io.fileio.Bounce` and :class:`resilient.io.digests.Digests`).

    With ``reuse`` (every rank of the group offered the same generation, see
    :func:`plan_rank`) it is local: the cached skeleton is reused and nothing touches the disk.
    Otherwise it is collective over ``comms.group`` (the ranks sharing this rank's file; one
    gather, one broadcast): the leader lays out the data (:func:`resilient.model.h5format.place_data`)
    and creates the file, unless ``claimed`` (the coordinator moved a dropped checkpoint's file
    there to write over: :func:`resilient.io.fileio.claim_file`); its write builds HDF5's
    metadata (:func:`resilient.io.fileio.build_skeleton`). ``failed``: the error that kept this
    rank from planning, raised on every rank of the group. ``data`` must stay unchanged until
    the job has run.
    """
    leader = comms.group.rank == 0
    plan = cache.plan
    if not reuse:
        group = Collective(comms.group)
        offer: _Offer | Exception
        if failed is not None:
            offer = failed
        else:
            assert plan is not None
            offer = _Offer(
                plan.rank, cache.generation, None if cache.specs == plan.specs else plan.specs
            )
        gathered = group.gather(offer)
        answer: _Skeleton | Exception | None = None
        if gathered is not None:
            try:
                answer = _plan_file(
                    target, pending, comms, gathered.values(), cache, claimed=claimed
                )
            except Exception as exc:
                answer = exc
        planned = group.announce(f"planning {comms.file_name} of step {step}", answer)
        assert plan is not None
        if planned.offsets is not None:
            cache.specs = plan.specs
            cache.offsets = planned.offsets[plan.rank]
        cache.generation = planned.generation
    assert plan is not None
    skeleton = cache.skeleton if leader else None
    assert skeleton is not None or not leader
    members = comms.members if leader else ()
    return WriteJob(
        target, pending, comms.file_name, plan, cache.offsets, dict(data.arrays), skeleton,
        members, bounce, digester,
    )  # fmt: skip


def _plan_file(
    target: Target,
    pending: PendingDir,
    comms: SetComms,
    offers: Sequence[_Offer],
    cache: SkeletonCache,
    *,
    claimed: bool,
) -> _Skeleton:
    """Leader: reuse the cached skeleton if every rank offers the same structure, else create
    the file (unless ``claimed``: a dropped checkpoint's file is there to write over)."""
    current = (
        cache.skeleton is not None
        and cache.skeleton.usable
        and all(o.specs is None and o.generation == cache.generation for o in offers)
    )
    if current:
        return _Skeleton(cache.generation, None)
    specs = {
        o.rank: o.specs if o.specs is not None else cache.group_specs.get(o.rank) for o in offers
    }
    missing = [r for r, s in specs.items() if s is None]
    if missing:  # a rank's "as last time" refers to a skeleton this leader no longer has
        raise RuntimeError(f"planning {comms.file_name}: no cached structure for ranks {missing}")
    members = [(r, s) for r, s in specs.items() if s is not None]
    offsets = h5format.place_data(members)  # the data's offsets: the metadata comes after it
    if not claimed:
        name = comms.file_name
        storage.retry_io(
            functools.partial(target.create_file, pending, name),
            what=f"creating {pending.path / name}",
            cleanup=functools.partial(target.discard, pending, name),
        )
    cache.generation += 1
    cache.group_specs = dict(members)
    cache.skeleton = Skeleton(functools.partial(fileio.build_skeleton, comms.kind, members))
    return _Skeleton(cache.generation, offsets)


@dataclass(frozen=True, slots=True)
class Planned:
    """This rank's planned write, or the error that kept it from planning.

    A rank whose planning failed must still take part in the save's gather (other groups
    planned fine and are waiting there): its error travels as that rank's outcome.
    """

    job: WriteJob | None
    error: Exception | None = None

    @classmethod
    def of(cls, plan: Callable[[], WriteJob]) -> Planned:
        """Run ``plan`` now, keeping its job or its error."""
        try:
            return cls(plan())
        except Exception as exc:
            return cls(None, exc)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def result(self) -> WriteJob:
        """The job, or raise the planning's error."""
        if self.error is not None:
            raise self.error
        assert self.job is not None
        return self.job


def commit_set(
    comms: SetComms,
    written: Sequence[RankWritten | ShardWritten | None],
    *,
    step: int,
    kind: str = "checkpoint",
    static: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    library_version: str = "",
    into: tuple[Target, PendingDir] | None = None,
    at: float | None = None,
) -> Manifest:
    """Coordinator: the manifest of a set whose every rank's data is durable (``written``, by
    rank: each rank's outcome, or with ``comms.shard`` what :func:`write_shard` returned), and
    its commit into ``into``, a target's pending copy (``None``: the caller commits, e.g. each
    node of a node-local tier its own copy). ``at``: the manifest's time (default: now); every
    rank that builds the manifest from the same values and time builds the same.

    Raises:
        CommitError: the commit failed (the pending copy is the caller's to roll back).
    """
    what = f"save of {kind} step {step}"
    if comms.shard is None:
        manifest = build_manifest(
            comms, [w for w in written if isinstance(w, RankWritten)], step=step, kind=kind,
            static=static, metrics=metrics or {}, library_version=library_version, at=at,
        )  # fmt: skip
    else:
        manifest = build_index(
            comms, [w for w in written if isinstance(w, ShardWritten)], step=step, kind=kind,
            static=static, metrics=metrics or {}, library_version=library_version,
        )  # fmt: skip
    if into is not None:
        target, pending = into
        target.commit(pending, manifest, what=what)
    return manifest


@dataclass(frozen=True, slots=True)
class ShardWritten:
    """A manifest shard as its leader wrote it: its index entry and its files, encoded as the
    index lists them (:func:`~resilient.model.codec.files_fragment`: the coordinator joins the
    text, with no object per file to unpickle or encode), with their count and total size."""

    shard: ShardEntry
    files: str
    count: int
    nbytes: int


def gather_set(
    comms: SetComms,
    written: RankWritten | Exception,
    target: Target,
    pending: PendingDir,
    *,
    kind: str,
    step: int,
) -> Gathered[RankWritten | ShardWritten] | None:
    """Collective over ``comms.comm``: every rank's outcome (``written``, its data durable) to
    the coordinator, which then commits (:func:`commit_set`) and announces the outcome over
    ``comms.comm``.

    Without shards, one gather of every rank's outcome. With shards, two levels: each shard's
    outcomes up to its leader, which writes the shard (:func:`write_shard`; one gather over
    ``comms.shard``), then the leaders' shards up to the coordinator (one gather over
    ``comms.leaders``): the other ranks send nothing to the coordinator, and a rank's failure
    reaches it through its leader, naming the rank. The shards go into ``pending`` of
    ``target``.

    Returns:
        On the coordinator, what it gathered (each rank's outcome, or each shard's); ``None``
        elsewhere.
    """
    if comms.shard is None:
        return Collective(comms.comm).gather(written)
    shard = write_shard(comms, written, target, pending, kind=kind, step=step)
    if comms.leaders is None:
        return None
    assert shard is not None  # (a leader's)
    return Collective(comms.leaders, name=comms.comm.rank).gather(shard)


def write_shard(
    comms: SetComms,
    written: RankWritten | Exception,
    target: Target,
    pending: PendingDir,
    *,
    kind: str,
    step: int,
) -> ShardWritten | Exception | None:
    """Collective over ``comms.shard`` (one gather): its leader gathers the shard's outcomes
    (``written``: this rank's, its data durable) and writes the shard durably into
    ``pending`` of ``target``.

    Returns:
        On the leader, the shard, or the error that kept it from writing it (the ranks'
        failures as :meth:`~resilient.parallel.collective.Gathered.values` raises them, for
        the leaders' gather to forward); ``None`` on the other ranks.
    """
    assert comms.shard is not None
    shard = Collective(comms.shard, name=comms.comm.rank)
    gathered = shard.gather(written)
    if gathered is None:
        return None
    try:
        return _write_shard_file(target, pending, comms, gathered.values(), kind=kind, step=step)
    except Exception as exc:
        return exc


def _write_shard_file(
    target: Target,
    pending: PendingDir,
    comms: SetComms,
    written: Sequence[RankWritten],
    *,
    kind: str,
    step: int,
) -> ShardWritten:
    """Shard leader: write the shard of ``written`` (its ranks' outcomes) durably into
    ``pending`` of ``target``."""
    name = filenames.shard_name(comms.shard_index)
    entries = dict(zip(comms.shard_members, (w.entry for w in written), strict=True))
    files = _file_entries(entries, written)
    text = shard_json(kind, step, entries).encode()
    storage.retry_io(
        functools.partial(target.write, pending, name, text),
        what=f"writing {pending.path / name}",
        cleanup=functools.partial(target.discard, pending, name),
    )
    entry = ShardEntry(name, len(text), digest_bytes(text), tuple(f.name for f in files))
    return ShardWritten(entry, files_fragment(files), len(files), sum(f.size for f in files))


def save_set(
    comms: SetComms,
    target: Target,
    pending: PendingDir,
    *,
    step: int,
    data: LocalData,
    cache: SkeletonCache | None = None,
    kind: str = "checkpoint",
    static: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    library_version: str = "",
    copy: PendingDir | None = None,
    copies: int | None = None,
) -> None:
    """Collective over ``comms.comm``: call on all ranks. Write ``data`` of every rank into
    ``pending`` (of ``target``: where the data files go) and commit it (:func:`plan_rank`,
    :func:`plan_write`, :meth:`WriteJob.run`, :func:`commit_set`).

    ``copy``: a second directory (static data's second copy), committed after ``pending``
    with the same manifest and shards (copied by the coordinator); with ``copies=2`` every
    rank writes its data into it too, in the same pass (no more communication). ``copies``
    is recorded in both markers.

    The coordinator has already created ``pending`` (and ``copy``). On any failure every rank
    raises the same error and both are rolled back; everything else is untouched.
    """
    coll = Collective(comms.comm)
    cache = cache or SkeletonCache()
    try:
        plan_rank(comms, data, cache)
        failed: Exception | None = None
    except Exception as exc:
        failed = exc
    planned = Planned.of(
        lambda: plan_write(
            comms, target, pending, data, step=step, cache=cache, reuse=False, failed=failed
        )
    )
    try:
        job = planned.result()
        written: RankWritten | Exception = job.run()
        if copy is not None and copies == 2:  # the same bytes into the second copy
            dataclasses.replace(job, pending=copy).write()
    except Exception as exc:
        written = exc
    gathered = gather_set(comms, written, target, pending, kind=kind, step=step)
    answer: Manifest | Exception | None = None
    if gathered is not None:
        what = f"save of {kind} step {step}"
        try:
            answer = commit_set(
                comms, gathered.values(), step=step, kind=kind, static=static, metrics=metrics,
                library_version=library_version,
            )  # fmt: skip
            target.commit(pending, answer, what=what, copies=copies)
            if copy is not None:
                _commit_copy(target, pending.final.name, copy, answer, what=what, copies=copies)
        except Exception as exc:
            target.rollback(pending)
            if copy is not None:
                target.rollback(copy)
            answer = exc
    coll.announce(f"save of {kind} step {step}", answer, everywhere=False)


def _commit_copy(
    target: Target,
    first: str,
    copy: PendingDir,
    manifest: Manifest,
    *,
    what: str,
    copies: int | None,
) -> None:
    """Coordinator: commit ``copy`` with ``manifest`` and the shards committed in the set
    ``first`` of ``target`` (its data files, if it holds them, are written already)."""
    sharded = manifest.sharded
    for name in [] if sharded is None else [s.name for s in sharded.shards]:
        target.copy(copy, name, target, first)
    target.commit(copy, manifest, what=f"{what} (its second copy)", copies=copies)


def build_manifest(
    comms: SetComms,
    written: Sequence[RankWritten],
    *,
    step: int,
    kind: str,
    static: str | None,
    metrics: Mapping[str, Any],
    library_version: str,
    at: float | None = None,
) -> Manifest:
    """The manifest of a written set at time ``at`` (default: now); each file's checksum over
    its segments' checksums."""
    ranks = tuple(w.entry for w in written)
    return Manifest(
        step=step, time=time.time() if at is None else at, layout=comms.layout,
        files=_file_entries(dict(enumerate(ranks)), written), ranks=ranks, kind=kind,
        static=static, metrics=dict(metrics), library_version=library_version,
    )  # fmt: skip


def build_index(
    comms: SetComms,
    shards: Sequence[ShardWritten],
    *,
    step: int,
    kind: str,
    static: str | None,
    metrics: Mapping[str, Any],
    library_version: str,
) -> Manifest:
    """The index of a sharded manifest (schema 3) from its shards, in order: every file's entry
    and every shard's, no rank's (they are in the shards). Its files stay the text the
    leaders encoded (:class:`~resilient.model.manifest.EncodedFiles`)."""
    files = EncodedFiles(
        [s.files for s in shards], sum(s.count for s in shards), sum(s.nbytes for s in shards)
    )
    ranks = ShardedRanks(comms.comm.size, [s.shard for s in shards], files)
    return Manifest(
        step=step, time=time.time(), layout=comms.layout, files=files, ranks=ranks,
        kind=kind, static=static, metrics=dict(metrics), library_version=library_version,
        schema_version=SHARDED_SCHEMA_VERSION,
    )  # fmt: skip


def _file_entries(
    entries: Mapping[int, RankEntry], written: Sequence[RankWritten]
) -> tuple[FileEntry, ...]:
    """The entries of the files whose leaders are in ``written``; each file's checksum over its
    segments' checksums (``entries``: the entries of their ranks, by rank)."""
    out = []
    for w in written:
        if w.file is None:
            continue
        f = FileEntry(w.file.name, w.file.size, "", w.file.ranks, tuple(w.file.meta_segments))
        out.append(f._replace(checksum=digest_text(file_checksum_text(entries, f))))
    return tuple(out)


def seed_cache(
    cache: SkeletonCache,
    comms: SetComms,
    files: Callable[[str], fileio.RangeReader],
    manifest: Manifest,
) -> None:
    """Local: after a restore, remember the restored file's skeleton, so that the first save of
    the same structure (the usual first save after a restart) skips planning altogether
    (``files``: opens the restored checkpoint's files by name).

    Every rank decides from the manifest alone (the same on every rank of a group): the file
    must have been written by exactly this group. The leader also reads HDF5's own bytes back
    and checks them against the manifest; if it cannot, it keeps only the structure, and its
    first save creates a new skeleton as usual.
    """
    entry = next((f for f in manifest.files if f.name == comms.file_name), None)
    if (
        manifest.layout.groups != comms.groups
        or manifest.layout.kind != comms.kind
        or entry is None
        or entry.ranks != comms.members
    ):
        return
    rank = comms.comm.rank
    own = manifest.ranks[rank].datasets  # (a member holds only its own entry: the leader all)
    cache.generation += 1
    cache.specs = tuple(zip(own.names, own.shapes, own.dtypes, strict=True))
    cache.offsets = own.offsets
    if comms.group.rank != 0:
        return
    tables = {r: manifest.ranks[r].datasets for r in comms.members}
    specs = {r: tuple(zip(t.names, t.shapes, t.dtypes, strict=True)) for r, t in tables.items()}
    offsets = {r: t.offsets for r, t in tables.items()}
    cache.group_specs = specs
    cache.skeleton = None
    meta_bytes: list[tuple[int, bytes]] = []
    try:
        reader = files(entry.name)
        try:
            for s in entry.meta_segments:
                piece = bytearray(s.length)
                reader.read(memoryview(piece), s.offset)
                meta_bytes.append((s.offset, bytes(piece)))
        finally:
            reader.close()
    except (OSError, EOFError):
        return
    if all(
        digest_bytes(b) == s.checksum
        for (_, b), s in zip(meta_bytes, entry.meta_segments, strict=True)
    ):
        built = fileio.FileSkeleton(offsets, entry.meta_segments, entry.size, tuple(meta_bytes))
        cache.skeleton = Skeleton.of(built)
