"""One save of a set of per-rank arrays: plan -> write -> finish. Collective. (One rank's read
of a checkpoint is :mod:`resilient.checkpoint.reading`.)

Used by :class:`resilient.checkpoint.manager.CheckpointManager` for checkpoints (synchronous and
asynchronous) and by :class:`resilient.checkpoint.statics.StaticStore` for static data. Call order (DCP's
``_save_state_dict``: plan, write, finish; NVRx's async ``plan``/``finalize``)::

    every rank   plan_write()       collective over the file's group: names, shapes, dtypes;
                                    the leader plans the file's HDF5 metadata (h5format), or
                                    reuses the skeleton of the previous save when the structure
                                    is unchanged
    every rank   WriteJob.run()     local, here or on a background thread: checksums, its
                                    bytes at its offsets, fsync (no communication); a blocking
                                    save writes, hands the fsync to a thread, then checksums
    every rank   finish_set()       collective: every rank's outcome to the coordinator, which
                                    builds the manifest and commits (a blocking save: prepares
                                    the commit, then publishes it in a second round once every
                                    rank's fsync is done)

Every phase goes through :class:`~resilient.parallel.collective.Collective`, so a failure anywhere
becomes the same exception on every rank, never a hang.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from resilient.io import fileio, storage
from resilient.io.commit import PendingDir
from resilient.io.digests import Digests
from resilient.model import filenames, h5format
from resilient.model.blocks import stripe_rows
from resilient.model.checksum import (
    digest_arrays,
    digest_bytes,
    digest_stripes,
    digest_text,
)
from resilient.model.manifest import (
    SHARDED_SCHEMA_VERSION,
    DatasetTable,
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
from resilient.parallel.collective import Collective
from resilient.parallel.topology import Topology

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "FileWritten",
    "IdleWork",
    "Planned",
    "Publisher",
    "RankPlan",
    "RankWritten",
    "ShardWritten",
    "SkeletonCache",
    "WriteJob",
    "build_index",
    "build_manifest",
    "finish_set",
    "plan_write",
    "save_set",
    "seed_cache",
]


class IdleWork:
    """CPU work to do while the disk writes: :meth:`WriteJob.write` hands :meth:`run_one` to
    :func:`fileio.write_file` as its ``idle``, called after each run of data the kernel writes
    back without the CPU; the tasks not reached then are the owner's to :meth:`finish` (while
    the fsync runs). In order, each once, on the calling thread."""

    def __init__(self, tasks: Iterable[Callable[[], None]]) -> None:
        self._tasks = collections.deque(tasks)

    def run_one(self) -> None:
        """Run the next task, if one is left."""
        if self._tasks:
            self._tasks.popleft()()

    def finish(self) -> None:
        """Run every task left."""
        while self._tasks:
            self.run_one()


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
    seed: tuple[Path, Manifest] | None = None  # a restored checkpoint, for seed_cache
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


class Skeleton:
    """A file's skeleton on its group's leader: built when first asked for (a new structure's,
    by the leader's write, between two runs of data, while the disk is busy), then kept for
    the later saves of the same structure. A build that failed fails again when asked."""

    def __init__(self, build: Callable[[], fileio.FileSkeleton]) -> None:
        self._build: Callable[[], fileio.FileSkeleton] | None = build
        self._built: fileio.FileSkeleton | None = None

    @classmethod
    def of(cls, skeleton: fileio.FileSkeleton) -> Skeleton:
        """An already built skeleton."""
        done = cls(lambda: skeleton)
        done.get()
        return done

    def get(self) -> fileio.FileSkeleton:
        """The skeleton (built now, if it is not yet).

        Raises:
            RuntimeError: its build failed before (that failure raised its own error).
        """
        if self._built is None:
            if self._build is None:
                raise RuntimeError("this file's skeleton could not be built")
            build, self._build = self._build, None
            self._built = build()  # if this raises, the skeleton is never used again
        return self._built

    @property
    def usable(self) -> bool:
        """Whether it is built, or not tried yet (a failed build is not reused)."""
        return self._built is not None or self._build is not None


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One rank's part of a save, planned: runs here or on a background thread.

    :meth:`run` (:meth:`write`, then :meth:`describe`) does no communication, so it may run on
    any thread; its outcome (or its exception) goes to :func:`finish_set`. A blocking save
    writes here, hands the fsync to a thread and describes meanwhile.
    """

    path: Path
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
        entry = self.plan.entry(self.path.name, self.offsets, digests, stripes)
        file = None
        if self.skeleton is not None:
            built = self.skeleton.get()
            file = FileWritten(self.path.name, built.size, built.meta_segments, self.members)
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
                return lambda: digests.put(part, digest_arrays(arrays[part.start : part.stop]))
            return lambda: digests.put(part, digest_arrays([arrays[i] for i in part]))

        tasks = [task(index[lo : lo + step]) for lo in range(0, len(index), step)]
        return IdleWork(tasks), digests

    def write(self, *, sync: bool = True, alongside: IdleWork | None = None) -> None:
        """Write this rank's arrays at their offsets (and, on the leader, HDF5's own bytes),
        fsync (or not: then :meth:`sync` must follow); ``alongside``: CPU work to do while the
        disk writes (see :func:`fileio.write_file`)."""
        arrays = list(map(self.arrays.__getitem__, self.plan.names))
        skeleton = self.skeleton.get if self.skeleton is not None else None
        storage.retry_io(
            lambda: fileio.write_file(
                self.path,
                self.offsets,
                arrays,
                skeleton=skeleton,
                sync=sync,
                idle=alongside.run_one if alongside is not None else None,
                bounce=self.bounce,
            ),
            what=f"writing {self.path}",
        )

    def sync(self) -> None:
        """fsync what :meth:`write` wrote with ``sync=False``."""
        storage.retry_io(lambda: fileio.fsync_file(self.path), what=f"writing {self.path}")


def plan_write(
    topo: Topology,
    directory: Path,
    data: LocalData,
    *,
    step: int,
    cache: SkeletonCache,
    bounce: fileio.Bounce | None = None,
    digester: Executor | None = None,
    recycled: Path | None = None,
) -> WriteJob:
    """Collective over ``topo.group`` (the ranks sharing this rank's file): plan this rank's
    part of a save into ``directory`` (its write goes through ``bounce`` and its checksums
    through ``digester``, the caller's, if given: see :class:`resilient.io.fileio.Bounce` and
    :class:`resilient.io.digests.Digests`). With ``recycled``, a checkpoint directory that
    rotation dropped, the leader takes the file of the same name from it to write over
    (:func:`resilient.io.fileio.claim_file`) instead of creating one.

    The leader creates the file and lays out the data (:func:`resilient.model.h5format.place_data`);
    its write builds HDF5's metadata (:func:`resilient.io.fileio.build_skeleton`), unless
    every rank's structure (names, shapes, dtypes) is the one of the previous save: then the
    cached skeleton is reused and nothing touches the disk here. ``data`` must stay unchanged until the job has run.
    """
    path = directory / topo.file_name
    leader = topo.group.rank == 0
    # this rank's own work comes first; what fails in it fails the group's round below on
    # every member alike (a member that left before the round would leave the others in it)
    try:
        if cache.seed is not None:  # the first save after a restore: its file's skeleton
            seed = cache.seed
            cache.seed = None
            seed_cache(cache, topo, *seed)
        plan = RankPlan.of(topo.comm.rank, data, like=cache.plan)
        cache.plan = plan
        unchanged = cache.specs == plan.specs
        offer = _Offer(plan.rank, cache.generation, None if unchanged else plan.specs)
        failed: Exception | None = None
    except Exception as exc:
        failed = exc
    claimed = (
        failed is None and leader and recycled is not None
        and _claimed(recycled / topo.file_name, path)
    )  # fmt: skip
    answer = Collective(topo.group).all_reduce(
        f"planning {topo.file_name} of step {step}",
        lambda: _offered(offer, failed),
        lambda offers: _plan_file(path, topo.kind, offers, cache, claimed=claimed),
    )
    if answer.offsets is not None:
        cache.specs = plan.specs
        cache.offsets = answer.offsets[plan.rank]
    cache.generation = answer.generation
    skeleton = cache.skeleton if leader else None
    assert skeleton is not None or not leader
    members = topo.members if leader else ()
    return WriteJob(
        path, plan, cache.offsets, dict(data.arrays), skeleton, members, bounce, digester
    )


def _offered(offer: _Offer, failed: Exception | None) -> _Offer:
    """This rank's offer, or the error that kept it from making one."""
    if failed is not None:
        raise failed
    return offer


def _claimed(source: Path, path: Path) -> bool:
    """Leader: :func:`resilient.io.fileio.claim_file`; a failure only costs the speed-up."""
    try:
        return fileio.claim_file(source, path)
    except OSError as exc:
        log.debug("not reusing %s: %s", source, exc)
        return False


def _plan_file(
    path: Path, kind: str, offers: Sequence[_Offer], cache: SkeletonCache, *, claimed: bool
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
        raise RuntimeError(f"planning {path.name}: no cached structure for ranks {missing}")
    members = [(r, s) for r, s in specs.items() if s is not None]
    offsets = h5format.place_data(members)  # the data's offsets: the metadata comes after it
    if not claimed:
        storage.retry_io(
            lambda: fileio.create_file(path),
            what=f"creating {path}",
            cleanup=lambda: storage.remove_file(path),
        )
    cache.generation += 1
    cache.group_specs = dict(members)
    cache.skeleton = Skeleton(lambda: fileio.build_skeleton(kind, members))
    return _Skeleton(cache.generation, offsets)


@dataclass(frozen=True, slots=True)
class Planned:
    """This rank's planned write, or the error that kept it from planning.

    A rank whose planning failed must still take part in :func:`finish_set` (other groups
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


def finish_set(
    topo: Topology,
    outcome: Callable[[], RankWritten],
    *,
    step: int,
    kind: str = "checkpoint",
    static: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    library_version: str = "",
    pending: Publisher | None = None,
    durable: Callable[[], None] | None = None,
    everywhere: bool = False,
) -> Manifest | None:
    """Collective over ``topo.comm``: gather every rank's :meth:`WriteJob.run` outcome (``outcome``
    returns it or raises the job's error), build the manifest and commit it into ``pending`` on
    the coordinator: :meth:`Publisher.prepare`, then :meth:`Publisher.publish` once every
    rank's data is durable (``pending=None``: the caller commits, e.g. each node of a
    node-local tier its own copy).

    With ``durable`` (returns once this rank's :meth:`WriteJob.write` is done, or raises its
    error), the data may still be on its way to disk when ``outcome`` returns (only described):
    the coordinator prepares the commit meanwhile, and a second round, once every rank's data
    is durable, publishes it. Without it the data is durable already: prepared and published
    in one round.

    With ``topo.shard`` (a sharded manifest, schema 3), a first round over each shard has its
    leader gather only its shard's outcomes and write its shard into ``pending`` (durable
    before the commit is published); the coordinator then gathers the shards' summaries, not
    the ranks' entries, and commits the index (:func:`build_index`).

    Returns:
        The manifest on the coordinator; on every rank with ``everywhere`` (a node-local
        tier, whose every node commits its own copy). Otherwise the other ranks get ``None``:
        the manifest grows with ranks x datasets, and sending it to every rank at every save
        would move ranks x that over the network.
    """
    coll = Collective(topo.comm)
    what = f"save of {kind} step {step}"
    gathered: Callable[[], Any] = outcome
    if topo.shard is not None:
        if pending is None or everywhere:
            raise ValueError("a sharded manifest is written into the save's directory")
        shard = _shard_round(
            topo, outcome, pending.path, kind=kind, step=step, what=what, sync=durable is None
        )  # fmt: skip
        gathered = shard.result
        if durable is not None and shard.path is not None:
            durable = functools.partial(_durable_with, durable, shard.path)

    def combine(written: list[Any]) -> Manifest:
        build = build_manifest if topo.shard is None else build_index
        manifest = build(
            topo, [w for w in written if w is not None], step=step, kind=kind, static=static,
            metrics=metrics or {}, library_version=library_version,
        )  # fmt: skip
        if pending is not None:
            pending.prepare(manifest, what=what)
            if durable is None:
                pending.publish(what=what)
        return manifest

    try:
        manifest = coll.all_reduce(what, gathered, combine, everywhere=everywhere)
    except Exception:
        if durable is not None:  # no writer thread may outlive the save
            with contextlib.suppress(Exception):
                durable()
        raise
    if durable is not None:
        coll.all_reduce(what, durable, lambda _: pending.publish(what=what) if pending else None)
    return manifest


class Publisher(Protocol):
    """Where the coordinator commits a save, in two named steps (a
    :class:`~resilient.io.commit.PendingDir`)."""

    @property
    def path(self) -> Path:
        """The directory being written (a sharded manifest's shards go there too)."""
        ...

    def prepare(self, manifest: Manifest, *, what: str) -> None:
        """Write the manifest and the marker (not yet durable)."""
        ...

    def publish(self, *, what: str) -> None:
        """Make them durable and publish the directory (every rank's data is durable)."""
        ...


@dataclass(frozen=True, slots=True)
class ShardWritten:
    """A manifest shard as its leader wrote it: its index entry and its files' entries."""

    shard: ShardEntry
    files: tuple[FileEntry, ...]


@dataclass(frozen=True, slots=True)
class _ShardOutcome:
    """This rank's outcome of the shard round: the shard (its leader), nothing (a member) or
    the round's error (every rank of the shard)."""

    written: ShardWritten | None
    error: Exception | None
    path: Path | None  # the shard file, on its leader

    def result(self) -> ShardWritten | None:
        if self.error is not None:
            raise self.error
        return self.written


def _shard_round(
    topo: Topology,
    outcome: Callable[[], RankWritten],
    directory: Path,
    *,
    kind: str,
    step: int,
    what: str,
    sync: bool,
) -> _ShardOutcome:
    """Collective over ``topo.shard``: its leader gathers the shard's outcomes and writes the
    shard (durable with ``sync``, else later: :func:`_durable_with`); a failure becomes every
    shard rank's outcome of the next round."""
    assert topo.shard is not None
    path = directory / filenames.shard_name(topo.shard_index)

    def write(written: list[RankWritten]) -> ShardWritten:
        entries = dict(zip(topo.shard_members, (w.entry for w in written), strict=True))
        files = _file_entries(entries, written)
        text = shard_json(kind, step, entries).encode()
        storage.retry_io(
            lambda: storage.write_all([(path, text)]),
            what=f"writing {path}",
            cleanup=lambda: storage.remove_file(path),
        )
        if sync:
            storage.retry_io(lambda: storage.fsync_files([path]), what=f"writing {path}")
        entry = ShardEntry(path.name, len(text), digest_bytes(text), tuple(f.name for f in files))
        return ShardWritten(entry, files)

    try:
        written = Collective(topo.shard).all_reduce(what, outcome, write, everywhere=False)
    except Exception as exc:
        return _ShardOutcome(None, exc, None)
    return _ShardOutcome(written, None, path if written is not None else None)


def _durable_with(durable: Callable[[], None], shard: Path) -> None:
    """``durable``, then the shard its leader wrote made durable too."""
    durable()
    storage.fsync_files([shard])


def save_set(
    topo: Topology,
    pending: PendingDir,
    *,
    step: int,
    data: LocalData,
    cache: SkeletonCache | None = None,
    kind: str = "checkpoint",
    static: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    library_version: str = "",
) -> None:
    """Collective over ``topo.comm``: call on all ranks. Write ``data`` of every rank into
    ``pending`` and commit it (:func:`plan_write`, :meth:`WriteJob.run`, :func:`finish_set`).

    The coordinator has already created ``pending``. On any failure every rank raises the same
    error and ``pending`` is rolled back; everything else is untouched.
    """
    coll = Collective(topo.comm)
    try:
        plan = Planned.of(
            lambda: plan_write(topo, pending.path, data, step=step, cache=cache or SkeletonCache())
        )
        finish_set(
            topo, lambda: plan.result().run(), step=step, kind=kind, static=static, metrics=metrics,
            library_version=library_version, pending=pending,
        )  # fmt: skip
    except Exception:
        if coll.is_coordinator:
            pending.rollback()
        raise


def build_manifest(
    topo: Topology,
    written: Sequence[RankWritten],
    *,
    step: int,
    kind: str,
    static: str | None,
    metrics: Mapping[str, Any],
    library_version: str,
) -> Manifest:
    """The manifest of a written set; each file's checksum over its segments' checksums."""
    ranks = tuple(w.entry for w in written)
    return Manifest(
        step=step, time=time.time(), layout=topo.layout,
        files=_file_entries(dict(enumerate(ranks)), written), ranks=ranks, kind=kind,
        static=static, metrics=dict(metrics), library_version=library_version,
    )  # fmt: skip


def build_index(
    topo: Topology,
    shards: Sequence[ShardWritten],
    *,
    step: int,
    kind: str,
    static: str | None,
    metrics: Mapping[str, Any],
    library_version: str,
) -> Manifest:
    """The index of a sharded manifest (schema 3) from its shards, in order: every file's entry
    and every shard's, no rank's (they are in the shards)."""
    files = tuple(f for s in shards for f in s.files)
    by_name = {f.name: f for f in files}
    ranks = ShardedRanks(topo.comm.size, [s.shard for s in shards], by_name, None)
    return Manifest(
        step=step, time=time.time(), layout=topo.layout, files=files, ranks=ranks,
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
        out.append(dataclasses.replace(f, checksum=digest_text(file_checksum_text(entries, f))))
    return tuple(out)


def seed_cache(cache: SkeletonCache, topo: Topology, directory: Path, manifest: Manifest) -> None:
    """Local: after a restore, remember the restored file's skeleton, so that the first save of
    the same structure (the usual first save after a restart) skips planning altogether.

    Every rank decides from the manifest alone (the same on every rank of a group): the file
    must have been written by exactly this group. The leader also reads HDF5's own bytes back
    and checks them against the manifest; if it cannot, it keeps only the structure, and its
    first save creates a new skeleton as usual.
    """
    entry = next((f for f in manifest.files if f.name == topo.file_name), None)
    if (
        manifest.layout.groups != topo.groups
        or manifest.layout.kind != topo.kind
        or entry is None
        or entry.ranks != topo.members
    ):
        return
    rank = topo.comm.rank
    own = manifest.ranks[rank].datasets  # (a member holds only its own entry: the leader all)
    cache.generation += 1
    cache.specs = tuple(zip(own.names, own.shapes, own.dtypes, strict=True))
    cache.offsets = own.offsets
    if topo.group.rank != 0:
        return
    tables = {r: manifest.ranks[r].datasets for r in topo.members}
    specs = {r: tuple(zip(t.names, t.shapes, t.dtypes, strict=True)) for r, t in tables.items()}
    offsets = {r: t.offsets for r, t in tables.items()}
    cache.group_specs = specs
    cache.skeleton = None
    image: list[tuple[int, bytes]] = []
    try:
        reader = fileio.FileReader(directory / entry.name)
        try:
            for s in entry.meta_segments:
                piece = bytearray(s.length)
                reader.read(memoryview(piece), s.offset)
                image.append((s.offset, bytes(piece)))
        finally:
            reader.close()
    except (OSError, EOFError):
        return
    if all(
        digest_bytes(b) == s.checksum for (_, b), s in zip(image, entry.meta_segments, strict=True)
    ):
        built = fileio.FileSkeleton(offsets, entry.meta_segments, entry.size, tuple(image))
        cache.skeleton = Skeleton.of(built)
