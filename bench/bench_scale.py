"""The coordinator at scale, simulated (issue 23, point 4): one process, no MPI.

Run::

    python bench/bench_scale.py --ranks 1024 [--datasets 300] [--per-file 1] [--repeats 3]
                                [--json OUT] [--dir DIR] [--max-rss-gib 8] [--no-trace]
                                [--shard-ranks 128] [--leader-sample 16]

What a save's commit and a restore do with every rank's description, driven through the
library's own functions, fed with synthetic descriptions shaped like what the gather delivers:

* every rank's message is what :meth:`resilient.parallel.collective.Collective.gather` sends
  for :class:`resilient.checkpoint.saving.SavePipeline`, ``(True, RankWritten)``: its
  :class:`~resilient.model.manifest.RankEntry` (a
  :class:`~resilient.model.manifest.DatasetTable` of ``--datasets`` arrays, its tree) and, from each
  file's leader, a :class:`~resilient.checkpoint.saveset.FileWritten` with the segments of the real
  HDF5 skeleton (:func:`resilient.io.fileio.build_skeleton`), pickled as mpi4py's lowercase
  collectives pickle it (protocol 5, one message per rank);
* **commit**: rank 0 runs the real gather, ``commit_set`` and announce as
  :class:`resilient.checkpoint.saving.SavePipeline` runs them (every rank's data durable) over
  :class:`RootComm`, a stand-in for rank 0 of an MPI communicator (``gather`` receives every
  rank's bytes into one buffer and unpickles them; ``bcast`` pickles what rank 0 sends). One
  manifest (``--shard-ranks 0``): unpickle N descriptions, ``build_manifest``,
  ``PendingDir.prepare`` (JSON, checksum, manifest and marker written), ``PendingDir.publish``
  (fsync, rename), and pickling the reply every rank receives (``("ok", None)``). Sharded
  (above ``--shard-ranks`` ranks), the two levels of ``gather_set``: every shard's leader
  gathers its shard's descriptions, writes its shard and sends rank 0 its shard's summary, its
  files already encoded (:func:`leaders` runs each other leader's part, ``leader_s``: in
  parallel on their nodes); rank 0 does the same for shard 0, then gathers the leaders'
  summaries (one message per shard), joins the index and commits it (its *top level*);
* **restore** from the shared root (:class:`resilient.checkpoint.restorer.Restorer`): rank 0
  validates the candidate quickly as ``Restorer._candidates`` does
  (:func:`resilient.io.checkpoints.validate_checkpoint`: the index read, its checksum,
  ``parse_manifest``, each shard's size; without shards also every data file's size, with them
  each shard's leader checks its own files' sizes) and sends the chosen candidate's parts: one
  manifest, a scatter of every rank's part (``restorer.rank_parts``: its own entry, a file group's
  leader its group's, their files, the header; the layout's groups stay home when they are the
  restoring run's); sharded, the first level of ``deal_through_leaders``: each shard's leader
  its shard's part (``restorer.shard_parts``), and each leader (``--leader-sample`` of them
  measured, :func:`leader_restore`) reads its saved shard once (``Restorer._spread``) and deals
  each of its ranks its part with its entries as read. The last rank then unpickles its part,
  parses its own entry (:func:`resilient.io.manifests.load_entries`) and looks at it
  (:func:`resilient.checkpoint.elasticread.needs_elastic`): ``rank_restore_*`` is that rank's part
  before it reads its data.

The **critical paths** add up what runs one after the other, the slowest of what runs in
parallel (see :func:`measure_once`): ``commit_critical_s`` (the slowest shard leader, rank 0's
top level, a rank's receipt of the reply) and ``handout_critical_s`` (rank 0's
quick validation and sends, the slowest leader's read and deal, a rank's receipt and parse
of its part). Transfers themselves are not simulated (the bytes sent are reported).

``--local-tier [--ranks-per-node 64] [--no-before]``: a save with a node-local tier instead
(:func:`run_local`): shards that never span two nodes, written by their leaders into their
nodes' copies; rank 0's commit (its shard, the gather of the shards, the index built and
broadcast, its node's commit, the allgather of the nodes' outcomes: :func:`local_commit_sharded`),
a node leader's commit of the index it receives, and the restore's look-up
(:meth:`resilient.checkpoint.tiers.LocalTier.newest`: rank 0 gathers every rank's sizes, checks
them against its node's index and deals the parts; a rank then reads its shard). ``before``:
the same save unsharded (every rank builds the whole manifest and reads all of it at a
restore: :func:`local_commit_unsharded`).

Times are wall-clock medians of ``--repeats`` untraced runs; ``*_peak_bytes`` come from one
more run under :mod:`tracemalloc` (the peak of Python allocations inside the measured part;
the other ranks' messages, made before, are not counted, the receive buffer is).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from benchutil import library_revision, write_json

from resilient._version import __version__
from resilient.checkpoint.elasticread import needs_elastic
from resilient.checkpoint.manager import DEFAULT_SHARD_RANKS
from resilient.checkpoint.restorer import Candidate, Restorer, as_received, rank_parts, shard_parts
from resilient.checkpoint.saveset import (
    FileWritten,
    RankPlan,
    RankWritten,
    ShardWritten,
    commit_set,
    write_shard,
)
from resilient.checkpoint.tiers import LocalSizes, LocalTier, NodeView
from resilient.io import manifests
from resilient.io.checkpoints import validate_checkpoint
from resilient.io.commit import PendingDir
from resilient.io.fileio import build_skeleton
from resilient.io.manifests import SetFiles, load_entries, load_manifest
from resilient.io.targets import DirectoryTarget, SetRef
from resilient.model import filenames
from resilient.model.codec import manifest_json
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, Segment, columns_of
from resilient.model.payload import split_state
from resilient.model.tree import leaf_paths
from resilient.parallel.collective import Collective
from resilient.parallel.comm import SerialComm
from resilient.parallel.setcomms import SetComms, shard_groups, shard_members

LIBRARY_LIMIT = manifests.MAX_MANIFEST_BYTES  # the largest manifest the library commits

T = TypeVar("T")
PROTOCOL = pickle.HIGHEST_PROTOCOL  # mpi4py 4.1's MPI.pickle.PROTOCOL (5)
STEP = 1200
PARAMS = ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight",
          "linear1.bias", "linear2.weight", "norm1.weight")  # fmt: skip


# --------------------------------------------------------------------------- synthetic ranks


def rank_plans(ranks: int, datasets: int) -> list[RankPlan]:
    """Every rank's :class:`RankPlan` of a transformer-like state of ``datasets`` arrays (the
    same structure on every rank, as in a data-parallel or sharded job).

    A third of the arrays are ``model/layers.{i}.{param}``, the others
    ``optim/state/{k}/exp_avg[_sq]`` (int keys, as a PyTorch optimizer's), beside JSON
    ``param_groups`` and ``step``. The tree is the real one (:func:`split_state` of tiny arrays
    of these names); the shapes are set afterwards: (1024, 4096) float32 weights, (4096,) others.
    """
    n_model = max(1, datasets // 3)
    tiny = np.zeros(1, np.float32)
    model = {f"layers.{i // len(PARAMS)}.{PARAMS[i % len(PARAMS)]}": tiny for i in range(n_model)}
    moments: dict[int, dict[str, Any]] = {}
    for j in range(datasets - n_model):
        moments.setdefault(j // 2, {})["exp_avg" if j % 2 == 0 else "exp_avg_sq"] = tiny
    state = {
        "model": model,
        "optim": {"state": moments, "param_groups": [{"lr": 3e-4, "params": list(moments)}]},
        "step": STEP,
    }
    tree = split_state(state).tree
    names = tuple(leaf_paths(tree))
    shapes = tuple((1024, 4096) if "weight" in n else (4096,) for n in names)
    dtypes = ("<f4",) * len(names)
    nbytes = tuple(int(np.prod(s)) * 4 for s in shapes)
    specs = tuple(zip(names, shapes, dtypes, strict=True))
    return [
        RankPlan(r, specs, tree, frozenset(), names, shapes, dtypes, nbytes) for r in range(ranks)
    ]


def layout_kind(per_file: int) -> str:
    """The layout of files of ``per_file`` consecutive ranks."""
    return "self" if per_file == 1 else "custom"


def messages(ranks: int, datasets: int, per_file: int) -> list[bytes]:
    """What every rank sends in the save's gather, pickled: ``(True, RankWritten)``.

    Files hold ``per_file`` consecutive ranks; each file's leader also reports its file (the
    HDF5 skeleton of the first group, reused for the others with other checksums). Dataset
    checksums are random, different on every rank."""
    plans = rank_plans(ranks, datasets)
    kind = layout_kind(per_file)
    skeleton = build_skeleton(kind, [(p.rank, p.specs) for p in plans[:per_file]])
    rng = np.random.default_rng(23)
    out = []
    for plan in plans:
        group, slot = divmod(plan.rank, per_file)
        name = filenames.file_name(kind, group)
        hexes = rng.bytes(8 * datasets).hex()
        entry = plan.entry(
            name, skeleton.offsets[slot], [hexes[i : i + 16] for i in range(0, len(hexes), 16)]
        )
        file = None
        if slot == 0:
            members = tuple(range(plan.rank, min(plan.rank + per_file, ranks)))
            segs = tuple(Segment(s.offset, s.length, rng.bytes(8).hex())
                         for s in skeleton.meta_segments)  # fmt: skip
            file = FileWritten(name, skeleton.size, segs, members)
        out.append(pickle.dumps((True, RankWritten(entry, file)), PROTOCOL))
    return out


# --------------------------------------------------------------------------- rank 0's comm


@dataclass
class RootComm:
    """Rank 0 of ``size`` ranks, as mpi4py's lowercase ``gather`` and ``bcast`` treat it.

    The first ``gather`` returns ``inbox`` (every other rank's pickled message, and rank 0's
    own object), received into one buffer and unpickled; a later one, every rank sending what rank 0 sends.
    ``bcast`` pickles what rank 0 sends (what every other rank receives) into ``sent``;
    ``scatter`` pickles each rank's object (see :meth:`scatter`).
    ``seconds`` adds up the time of each (keys ``gather``, ``bcast``)."""

    size: int
    inbox: list[bytes] | None
    sent: list[bytes] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    rank: int = 0
    keep: tuple[int, ...] = ()  # the ranks whose scattered messages are kept
    kept: dict[int, bytes] = field(default_factory=dict)
    scattered: list[int] = field(default_factory=list)  # every scattered message's size

    def gather(self, obj: T, root: int = 0) -> list[T]:
        """Every rank's object, in rank order."""
        t0 = time.perf_counter()
        inbox, self.inbox = self.inbox, None
        if inbox is None:
            inbox = [pickle.dumps(obj, PROTOCOL)] * self.size
        else:  # rank 0's own, as it is now
            inbox = [pickle.dumps(obj, PROTOCOL), *inbox[1:]]
        buffer = b"".join(inbox)  # the receive buffer of a gatherv
        view, pos, out = memoryview(buffer), 0, []
        for msg in inbox:
            out.append(pickle.loads(view[pos : pos + len(msg)]))
            pos += len(msg)
        del view, buffer
        self._add("gather", t0)
        return out

    def bcast(self, obj: T, root: int = 0) -> T:
        """``obj``, pickled once as rank 0 sends it."""
        t0 = time.perf_counter()
        self.sent.append(pickle.dumps(obj, PROTOCOL))
        self._add("bcast", t0)
        return obj

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        """``objs[0]``; every other rank's object pickled as mpi4py's ``scatter`` pickles it
        (one by one, on rank 0), its size in ``scattered``, kept in ``kept`` for ``keep``."""
        assert objs is not None and len(objs) == self.size
        t0 = time.perf_counter()
        for r, obj in enumerate(objs):
            data = pickle.dumps(obj, PROTOCOL)
            self.scattered.append(len(data))
            if r in self.keep:
                self.kept[r] = data
        self._add("scatter", t0)
        return objs[0]

    def _add(self, what: str, t0: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t0


@dataclass
class Member:
    """The world communicator as another rank than 0 sees it, where only its rank and size are
    asked for (what a shard leader names its failures by)."""

    rank: int
    size: int


@dataclass
class TimedPending:
    """A :class:`PendingDir` whose two steps add their time to ``seconds`` (keys ``prepare``,
    ``publish``): what the coordinator commits after ``commit_set``."""

    pending: PendingDir
    seconds: dict[str, float]

    @property
    def path(self) -> Path:
        return self.pending.path

    def prepare(self, manifest: Manifest, *, what: str) -> None:
        t0 = time.perf_counter()
        self.pending.prepare(manifest, what=what)
        self._add("prepare", t0)

    def publish(self, *, what: str) -> None:
        t0 = time.perf_counter()
        self.pending.publish(what=what)
        self._add("publish", t0)

    def commit(self, manifest: Manifest, *, what: str) -> None:
        self.prepare(manifest, what=what)
        self.publish(what=what)

    def rollback(self) -> None:
        self.pending.rollback()

    def _add(self, step: str, t0: float) -> None:
        self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - t0


# --------------------------------------------------------------------------- the two sides


@dataclass
class Sharding:
    """A save's shards (``shard_ranks`` > 0): each shard's ranks, what each leader sends rank
    0 in the leaders' gather (:func:`leaders`; index 0, rank 0's own, made in the commit) and
    ``leader_s``: each other leader's own part, run in parallel on its node before rank 0's
    top level (gather its shard's messages, write the shard, encode its files, pickle what it
    sends)."""

    shard_ranks: int
    members: tuple[tuple[int, ...], ...]
    leader_inbox: list[bytes]
    leader_s: list[float]
    written: dict[str, bytes]  # the other leaders' shards, by name


def set_comms(comm: Any, ranks: int, per_file: int, shard: Any = None,
              shards: tuple[tuple[int, ...], ...] = (), index: int = 0,
              leaders: Any = None) -> SetComms:  # fmt: skip
    """Rank 0's SetComms (or shard ``index``'s leader's), files of ``per_file`` ranks."""
    groups = tuple(tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file))
    return SetComms(comm=comm, group=SerialComm(), kind=layout_kind(per_file), groups=groups,
                    group_index=0, shard=shard, shard_index=index, shards=shards,
                    leaders=leaders)  # fmt: skip


def shards_of(
    ranks: int, per_file: int, shard_ranks: int, per_node: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Every shard's ranks, as :func:`resilient.parallel.setcomms.make_set_comms` makes them;
    ``per_node``: nodes of that many consecutive ranks, which no shard spans (``by_node``, a
    node-local tier)."""
    groups = [tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file)]
    nodes = None if per_node is None else [g[0] // per_node for g in groups]
    return shard_members(groups, shard_groups(groups, shard_ranks, nodes=nodes))


def leaders(
    inbox: list[bytes], per_file: int, shard_ranks: int, root: Path, per_node: int | None = None
) -> Sharding:
    """Every shard's leader but rank 0 runs its part of the save's two-level gather (the real
    one, :func:`write_shard`: gather its shard's messages, write its shard) into a scratch
    directory, and pickles what it sends rank 0 in the leaders' gather (``(True,
    ShardWritten)``, as :meth:`Collective.gather` sends it). The other ranks send rank 0
    nothing. ``per_node``: a save with a node-local tier, whose shards never span a node of
    that many consecutive ranks."""
    ranks = len(inbox)
    members = shards_of(ranks, per_file, shard_ranks, per_node)
    sent = [b""] * len(members)
    scratch = Path(tempfile.mkdtemp(prefix="shards-", dir=root))
    took = []
    for index, held in enumerate(members[1:], start=1):
        comm = RootComm(len(held), [inbox[r] for r in held])
        comms = set_comms(Member(held[0], ranks), ranks, per_file, comm, members, index)
        own = pickle.loads(inbox[held[0]])[1]
        t0 = time.perf_counter()
        got = write_shard(  # (into a scratch directory: never committed)
            comms, own, DirectoryTarget(root), PendingDir(scratch, scratch), kind="checkpoint",
            step=STEP,
        )
        assert isinstance(got, ShardWritten), got
        sent[index] = pickle.dumps((True, got), PROTOCOL)
        took.append(time.perf_counter() - t0)
    written = {p.name: p.read_bytes() for p in scratch.iterdir()}
    shutil.rmtree(scratch, ignore_errors=True)
    return Sharding(shard_ranks, members, sent, took, written)


@dataclass
class Committed:
    """Rank 0's commit: the manifest, the world comm (what it broadcast), the wall time of its
    whole part, and of the part after its own shard (``top_s``: the leaders' gather, the
    index built and committed, the announce) and before it (``shard_s``)."""

    manifest: Manifest
    comm: RootComm
    took: float
    top_s: float
    shard_s: float
    gathered_bytes: int


def commit(inbox: list[bytes], per_file: int, root: Path, sharding: Sharding | None) -> Committed:
    """Rank 0's part of a save from the gather to the published checkpoint in ``root``, as
    ``SharedRootSaves.commit`` runs it (:func:`gather_set`, ``commit_set`` and announce,
    ``prepare``/``publish`` of a real :class:`PendingDir`, timed: :class:`TimedPending`).
    Without ``sharding``: one gather of every rank's message. With it, two levels, as
    ``gather_set`` runs them: rank 0 leads shard 0 (gathers its shard's messages and writes
    its shard), then gathers the leaders' shards (the other leaders' work is done before, by
    :func:`leaders`; ``comm.seconds["gather"]`` is then the leaders' gather alone)."""
    ranks = len(inbox)
    if sharding is None:
        comm = RootComm(ranks, list(inbox))
        comms = set_comms(comm, ranks, per_file)
        gathered_bytes = sum(map(len, inbox))
    else:
        held, members = sharding.members[0], sharding.members
        comm = RootComm(len(members), list(sharding.leader_inbox))  # the leaders' gather
        world = RootComm(ranks, None)  # the announce
        shard = RootComm(len(held), inbox[: len(held)])
        comms = set_comms(world, ranks, per_file, shard, members, 0, comm)
        gathered_bytes = sum(map(len, sharding.leader_inbox[1:]))
    pending = PendingDir.for_step(root, STEP).create()
    for name, text in sharding.written.items() if sharding is not None else ():
        (pending.path / name).write_bytes(text)  # by the other leaders, meanwhile
    own = pickle.loads(inbox[0])[1]  # rank 0's outcome (the gather takes it from the inbox)
    # the library refuses to commit a manifest that no restore would read (over
    # manifests.MAX_MANIFEST_BYTES, 16,384 x 300 here): lifted, to measure what the design costs
    # there (the table says when the library refuses it)
    manifests.MAX_MANIFEST_BYTES = 1 << 40
    t0 = time.perf_counter()
    shard_s = 0.0
    if sharding is None:
        gathered = Collective(comm).gather(own)
    else:  # gather_set's two levels, timed apart
        mine = write_shard(comms, own, DirectoryTarget(root), pending, kind="checkpoint", step=STEP)
        assert isinstance(mine, ShardWritten), mine
        shard_s = time.perf_counter() - t0
        gathered = Collective(comm).gather(mine)
    assert gathered is not None
    manifest = commit_set(
        comms, gathered.values(), step=STEP, metrics={"loss": 1.0}, library_version=__version__
    )
    TimedPending(pending, comm.seconds).commit(manifest, what=f"save of checkpoint step {STEP}")
    announcer = comm if sharding is None else comms.comm
    Collective(announcer).announce("save", None)
    took = time.perf_counter() - t0
    if announcer is not comm:
        comm.sent.extend(announcer.sent)
        comm.seconds["bcast"] = announcer.seconds["bcast"]
    manifests.MAX_MANIFEST_BYTES = LIBRARY_LIMIT
    assert manifest is not None  # (rank 0: the coordinator keeps it)
    return Committed(manifest, comm, took, took - shard_s, shard_s, gathered_bytes)


def data_files(directory: Path, manifest: Manifest) -> None:
    """The data files of ``manifest`` in ``directory``, sparse, each of its size (a restore
    checks their sizes; no rank reads them here)."""
    cols = columns_of(manifest.files)
    for name, size in zip(cols.names, cols.sizes, strict=True):
        with open(directory / name, "wb") as fh:
            fh.truncate(size)


def current_layout(ranks: int, per_file: int) -> Layout:
    """The layout of the restoring run: the saved one (files of ``per_file`` consecutive ranks)."""
    groups = tuple(tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file))
    return Layout(layout_kind(per_file), ranks, groups)


def coordinator_restore(
    path: Path, current: Layout, written: bytes, keep: Sequence[int], sharding: Sharding | None
) -> tuple[dict[int, bytes], RootComm, dict[str, Any]]:
    """Rank 0 of a restore: its quick validation of the candidate (:func:`validate_checkpoint`,
    the data files' sizes left to the shard leaders with ``sharding``), then its sends of the candidate's parts as
    :class:`~resilient.checkpoint.restorer.Restorer` makes them (``_first_parts``): without
    ``sharding`` a scatter of every rank's part (``rank_parts``), with it the leaders' scatter of
    every shard's part (``shard_parts``, the first level of ``deal_through_leaders``).
    Returns the messages to ``keep`` (ranks, or shards), the comm (every message's size) and
    times. When ``load_manifest`` (or the size limit) refuses the checkpoint, its error is returned
    (``restore_error``) and the candidate holds the manifest the commit wrote instead
    (``written``, pickled: what parsing it would give)."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        manifest = validate_checkpoint(path, data_files=sharding is None)
    except Exception as exc:  # e.g. a manifest over load_manifest's size limit
        out["restore_error"] = f"{type(exc).__name__}: {exc}"
        manifest = pickle.loads(written)
    else:
        out["validate_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    whole = Candidate(SetRef(DirectoryTarget(path.parent), path.name), manifest, None)
    if sharding is None:
        comm = RootComm(current.nranks, None, keep=tuple(keep))
        parts = [(p, False) for p in rank_parts(whole, current)]
    else:
        comm = RootComm(len(sharding.members), None, keep=tuple(keep))
        parts = [(p, False) for p in shard_parts(whole, current, sharding.members)]
    Collective(comm).deal("choosing a checkpoint", parts)  # type: ignore[arg-type]
    out["restore_scatter_s"] = time.perf_counter() - t1
    return comm.kept, comm, out


def leader_restore(
    received: bytes, index: int, current: Layout, sharding: Sharding, keep: int, per_file: int
) -> tuple[float, bytes, int]:
    """Shard ``index``'s leader's part of a restore's hand-out, as ``deal_through_leaders``
    runs it: unpickle its shard's part, :meth:`Restorer._spread` (its ranks' entries loaded:
    the saved shard read, checked and parsed once), and the scatter of each rank's part over
    its shard. Returns the time, the message of its rank ``keep`` (a shard rank) and the bytes
    of the shards it read."""
    members = sharding.members
    comms = set_comms(Member(members[index][0], current.nranks), current.nranks, per_file,
                      SerialComm(), members, index)  # fmt: skip
    t0 = time.perf_counter()
    status, given = pickle.loads(received)
    assert status == "ok", given
    restorer = Restorer(given[0].at.target, Collective(SerialComm()), None,  # type: ignore[arg-type]
                        layout=current, shards=comms)  # fmt: skip
    spread = restorer._spread(given)
    comm = RootComm(len(members[index]), None, keep=(keep,))
    Collective(comm).deal("choosing a checkpoint", spread)  # type: ignore[arg-type]
    took = time.perf_counter() - t0
    part = spread[keep][0]
    assert part.unloadable is None, part.unloadable
    sharded = part.manifest.sharded
    read = 0 if sharded is None else sum(s.size for s in sharded.shards)
    return took, comm.kept[keep], read


def rank_restore(received: bytes, rank: int, current: Layout) -> tuple[float, int]:
    """One rank's part of a restore before it reads its data: unpickle its part of the
    candidate, put its layout back, load its own entry (of a sharded manifest: parse what its
    shard's leader handed on, or read, check and parse its shard: :func:`load_entries`) and
    look at it. Returns the time and the bytes of the shard it read (0: none)."""
    t0 = time.perf_counter()
    status, (candidate, _) = pickle.loads(received)
    assert status == "ok"
    sharded = candidate.manifest.sharded
    docs = candidate.docs or {}
    read = 0 if sharded is None or sharded.shard_of(rank).name in docs else sharded.shard_of(rank).size
    manifest = load_entries(
        candidate.at.files, as_received(candidate.manifest, current), [rank], read=candidate.docs
    )
    needs_elastic(manifest.ranks[rank], {})
    return time.perf_counter() - t0, read


# --------------------------------------------------------------------------- the run


@contextmanager
def traced(on: bool) -> Iterator[dict[str, int]]:
    """With ``on``: the peak of Python allocations inside the block (tracemalloc), as
    ``out["peak"]``; else nothing."""
    out: dict[str, int] = {}
    if not on:
        yield out
        return
    gc.collect()
    tracemalloc.start()
    try:
        yield out
    finally:
        out["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def seconds_of(fn: Callable[[], object]) -> float:
    """Wall time of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sampled(count: int, sample: int) -> list[int]:
    """``sample`` indices of ``0 .. count - 1`` spread evenly, the first and the last among
    them (all when ``sample`` >= ``count``)."""
    if sample >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / max(1, sample - 1)) for i in range(sample)})


def measure_once(
    inbox: list[bytes], per_file: int, base: Path, sharding: Sharding | None, *, trace: bool,
    leader_sample: int = 16,
) -> dict[str, Any]:
    """One commit, then one restore, of the checkpoint of ``inbox`` in a new directory under
    ``base``: times (``trace=False``) or tracemalloc peaks (``trace=True``), and sizes. At most
    one copy of the manifest's objects is alive at a time (besides the commit's inputs).

    The critical paths (the slowest rank's share, not rank 0's alone; the shard leaders work
    in parallel): ``commit_critical_s`` = the slowest leader's part (its shard gathered and
    written; rank 0's own shard included) + rank 0's top level (the leaders' gather to the
    announce) + a rank's receipt of the reply; ``handout_critical_s`` = rank 0's
    quick validation + its sends (the shards' parts made and pickled) + the slowest leader's
    part (:func:`leader_restore`, ``leader_sample`` leaders of every shard measured, the first
    and last among them) + a rank's receipt of its part. Without shards, rank 0's whole
    commit or scatter plus a rank's receipt."""
    ranks, out = len(inbox), dict[str, Any]()
    root = Path(tempfile.mkdtemp(prefix="scale-", dir=base))
    try:
        rss0 = reset_peak_rss()
        with traced(trace) as mem:
            done = commit(inbox, per_file, root, sharding)
        out["commit_rss_delta_bytes"] = max_rss() - rss0 if rss0 else None
        manifest, comm = done.manifest, done.comm
        final = root / filenames.step_dir_name(STEP)
        reply = comm.sent[0]  # ("ok", None): what every rank receives at every save
        shards = sorted(
            p.stat().st_size for p in final.iterdir() if filenames.is_shard_name(p.name)
        )
        out.update(
            manifest_bytes=(final / filenames.MANIFEST).stat().st_size, reply_bytes=len(reply),
            shards=len(shards), shard_bytes_max=max(shards, default=0),
            shard_bytes_total=sum(shards), gathered_bytes=done.gathered_bytes,
        )  # fmt: skip
        if trace:
            out["commit_peak_bytes"] = mem["peak"]
        else:
            s = comm.seconds
            slowest = max([done.shard_s, *sharding.leader_s]) if sharding is not None else 0.0
            receive = seconds_of(functools.partial(pickle.loads, reply))
            out.update(
                commit_s=done.took, commit_top_s=done.top_s, commit_shard_s=done.shard_s,
                commit_slowest_leader_s=slowest, gather_unpickle_s=s["gather"],
                prepare_s=s["prepare"], publish_s=s["publish"], bcast_pickle_s=s["bcast"],
                build_manifest_s=done.top_s - sum(s.values()), rank_save_receive_s=receive,
                commit_critical_s=slowest + done.top_s + receive,
                encode_s=seconds_of(functools.partial(manifest_json, manifest)),
            )  # fmt: skip
        written = pickle.dumps(manifest, protocol=5)  # (for a manifest load_manifest refuses)
        data_files(final, manifest)  # (what the ranks wrote: their sizes are checked)
        del manifest, comm, done
        gc.collect()
        current = current_layout(ranks, per_file)
        last = ranks - 1
        if sharding is None:
            keep: list[int] = [last, current.groups[-1][0]]  # a file group's last rank, its leader
        else:
            keep = sampled(len(sharding.members), leader_sample)
        with traced(trace) as mem:
            kept, scomm, restore = coordinator_restore(final, current, written, keep, sharding)
        del reply, written
        gc.collect()
        leader_s: list[float] = []
        leader_read = 0
        if sharding is None:
            received = kept[last]
            out["leader_restore_bytes"] = len(kept[keep[1]])
        else:
            for index in keep:  # (the last shard's leader keeps its last rank's message)
                size = len(sharding.members[index])
                took, received, read = leader_restore(
                    kept[index], index, current, sharding, size - 1, per_file
                )
                leader_s.append(took)
                leader_read = max(leader_read, read)
                gc.collect()
            out["leader_restore_bytes"] = max(len(kept[i]) for i in keep)
        with traced(trace) as mem2:
            rank_s, shard_read = rank_restore(received, last, current)
        out.update(
            rank_restore_bytes=len(received) + shard_read, rank_received_bytes=len(received),
            rank_shard_read_bytes=shard_read, leader_shard_read_bytes=leader_read,
            restore_scatter_bytes_total=sum(scomm.scattered),
            restore_scatter_bytes_max=max(scomm.scattered),
            restore_scatter_messages=len(scomm.scattered),
            restore_error=restore.pop("restore_error", None),
        )  # fmt: skip
        del scomm
        if trace:
            out.update(coordinator_restore_peak_bytes=mem["peak"],
                       rank_restore_peak_bytes=mem2["peak"])  # fmt: skip
        else:
            slowest_leader = max(leader_s, default=0.0)
            out.update(
                rank_restore_s=rank_s, handout_leader_max_s=slowest_leader if leader_s else None,
                handout_leader_median_s=statistics.median(leader_s) if leader_s else None,
                handout_critical_s=restore.get("validate_s", 0.0)
                + restore["restore_scatter_s"] + slowest_leader + rank_s,
                **restore,
            )  # fmt: skip
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
        gc.collect()


def run(
    ranks: int,
    datasets: int,
    per_file: int,
    repeats: int,
    base: Path,
    *,
    shard_ranks: int = 0,
    trace: bool = True,
    leader_sample: int = 16,
    pause_gc: bool = False,
) -> dict[str, Any]:
    """Measure one size: ``repeats`` timed commits and restores (medians, and the spread of the
    critical paths), then one traced (with ``trace``; else the peaks are ``None``).
    ``shard_ranks``: the manifest in shards of that many ranks when there are more (the
    library's ``manifest_shard_ranks``; 0: one). ``pause_gc``: the timed runs with Python's
    cyclic garbage collector paused, as ``RESILIENT_PAUSE_GC=1`` pauses it in a manager's saves
    and restores."""
    t0 = time.perf_counter()
    inbox = messages(ranks, datasets, per_file)
    sharding = None
    if shard_ranks and ranks > shard_ranks:
        sharding = leaders(inbox, per_file, shard_ranks, base)
        if len(sharding.members) < 2:
            sharding = None
    setup_s = time.perf_counter() - t0
    once = functools.partial(measure_once, inbox, per_file, base, sharding,
                             leader_sample=leader_sample)  # fmt: skip
    samples = [paused(pause_gc, functools.partial(once, trace=False)) for _ in range(repeats)]
    peaks = once(trace=True) if trace else {}
    first = samples[0]
    shard_gathered = 0 if sharding is None else sum(len(inbox[r]) for r in sharding.members[0])
    times = {
        k: round(statistics.median(s[k] for s in samples), 4)
        for k in first if k.endswith("_s") and first[k] is not None
    }  # fmt: skip
    spread = {
        f"{k}_range": [round(min(s[k] for s in samples), 4), round(max(s[k] for s in samples), 4)]
        for k in ("commit_critical_s", "handout_critical_s")
    }
    return {
        "ranks": ranks,
        "datasets": datasets,
        "per_file": per_file,
        "files": -(-ranks // per_file),
        "repeats": repeats,
        "shard_ranks": shard_ranks if sharding is not None else 0,
        "shards": first["shards"],
        "manifest_bytes": first["manifest_bytes"],
        "shard_bytes_max": first["shard_bytes_max"],
        "shard_bytes_total": first["shard_bytes_total"],
        "shard_leader_s_median": None
        if sharding is None
        else round(statistics.median(sharding.leader_s), 4),
        "shard_leader_s_max": None if sharding is None else round(max(sharding.leader_s), 4),
        "shard_gathered_bytes": shard_gathered,
        **times,
        **spread,
        "leader_sample": leader_sample if sharding is not None else 0,
        "pause_gc": pause_gc,
        "commit_s_max": round(max(s["commit_s"] for s in samples), 4),
        "commit_peak_bytes": peaks.get("commit_peak_bytes"),
        "commit_rss_delta_bytes": max(s["commit_rss_delta_bytes"] or 0 for s in samples) or None,
        "rank_restore_bytes": first["rank_restore_bytes"],
        "rank_received_bytes": first["rank_received_bytes"],
        "rank_shard_read_bytes": first["rank_shard_read_bytes"],
        "leader_shard_read_bytes": first["leader_shard_read_bytes"],
        "leader_restore_bytes": first["leader_restore_bytes"],
        "restore_scatter_bytes_total": first["restore_scatter_bytes_total"],
        "restore_scatter_bytes_max": first["restore_scatter_bytes_max"],
        "restore_scatter_messages": first["restore_scatter_messages"],
        "rank_restore_peak_bytes": peaks.get("rank_restore_peak_bytes"),
        "coordinator_restore_peak_bytes": peaks.get("coordinator_restore_peak_bytes"),
        "restore_error": first["restore_error"],
        "library_commits": first["manifest_bytes"] <= LIBRARY_LIMIT,
        "gathered_bytes": first["gathered_bytes"],
        "save_bcast_bytes_per_rank": first["reply_bytes"],
        "save_bcast_bytes_total": first["reply_bytes"] * (ranks - 1),
        "max_rss_bytes": max_rss(),
        "setup_s": round(setup_s, 2),
        "peak_memory": "*_peak_bytes: tracemalloc, peak of Python allocations, one extra untimed "
        "run; commit_rss_delta_bytes: VmHWM after the commit minus VmRSS before it (VmHWM reset "
        "by clear_refs; a lower bound: memory freed earlier is reused)",
        "revision": library_revision(),
        "python": sys.version.split()[0],
    }


def paused(pause: bool, fn: Callable[[], T]) -> T:
    """``fn()``, with the cyclic garbage collector paused if ``pause``."""
    if not pause:
        return fn()
    gc.disable()
    try:
        return fn()
    finally:
        gc.enable()


# --------------------------------------------------------------------------- a node-local tier


class LocalRootComm(RootComm):
    """:class:`RootComm` with ``allgather`` (a save with a node-local tier shares its outcomes):
    every rank's object as rank 0 receives it (the inbox, or every rank sending what rank 0
    sends), and what rank 0 sends pickled once into ``sent``."""

    def allgather(self, obj: T) -> list[T]:
        self.bcast(obj)
        return self.gather(obj)


def local_commit_unsharded(
    inbox: list[bytes], per_file: int, root: Path
) -> tuple[Manifest, LocalRootComm, float]:
    """Rank 0's part of a save with a node-local tier before sharding (every rank's): the
    allgather of every rank's outcome (unpickled), ``commit_set`` (every rank builds the whole
    manifest), its node's commit of it, and the allgather of the commits' outcomes."""
    ranks = len(inbox)
    comm = LocalRootComm(ranks, list(inbox))
    comms = set_comms(comm, ranks, per_file)
    pending = PendingDir.for_step(root, STEP).create()
    manifests.MAX_MANIFEST_BYTES = 1 << 40  # (see commit)
    t0 = time.perf_counter()
    done = comm.allgather(pickle.loads(inbox[0]))
    manifest = commit_set(
        comms, [w for _, w in done], step=STEP, metrics={"loss": 1.0},
        library_version=__version__, at=time.time(),
    )  # fmt: skip
    TimedPending(pending, comm.seconds).commit(manifest, what="local copy")
    Collective(comm).share("committing the local copies", None)
    took = time.perf_counter() - t0
    manifests.MAX_MANIFEST_BYTES = LIBRARY_LIMIT
    return manifest, comm, took


def local_commit_sharded(
    inbox: list[bytes], per_file: int, root: Path, sharding: Sharding
) -> tuple[Manifest, LocalRootComm, float]:
    """Rank 0's part of a sharded save with a node-local tier, as
    ``LocalTierManager._index`` and ``commit`` run it: it leads shard 0 (gather, write
    its shard into its node's temporary directory), gathers the shards' summaries, builds the
    index (``commit_set``), broadcasts it, commits its node's copy and learns every node's
    outcome (the allgather). The other shards are in the directory before (their leaders)."""
    ranks = len(inbox)
    held, members = sharding.members[0], sharding.members
    comm = LocalRootComm(ranks, None)  # the index announced, the nodes' outcomes shared
    leaders = RootComm(len(members), list(sharding.leader_inbox))  # the leaders' gather
    shard = RootComm(len(held), inbox[: len(held)])
    comms = set_comms(comm, ranks, per_file, shard, members, 0, leaders)
    pending = PendingDir.for_step(root, STEP).create()
    for name, text in sharding.written.items():
        (pending.path / name).write_bytes(text)  # (on their own nodes; here for the restore)
    own = pickle.loads(inbox[0])[1]
    t0 = time.perf_counter()
    mine = write_shard(comms, own, DirectoryTarget(root), pending, kind="checkpoint", step=STEP)
    assert isinstance(mine, ShardWritten), mine
    gathered = Collective(leaders).gather(mine)
    comm.seconds["gather"] = leaders.seconds["gather"]
    coll = Collective(comm)
    assert gathered is not None
    index = commit_set(
        comms, gathered.values(), step=STEP, metrics={"loss": 1.0}, library_version=__version__
    )
    coll.announce("save", index)
    TimedPending(pending, comm.seconds).commit(index, what="local copy")
    comm.inbox = None  # every rank shares what rank 0 shares
    coll.share("committing the local copies", None)
    return index, comm, time.perf_counter() - t0


def node_leader_commit(index_message: bytes, root: Path) -> float:
    """A node leader's part of a sharded local save after its shard's round: receive the index
    (unpickle the broadcast) and commit its node's copy with it."""
    pending = PendingDir.for_step(root, STEP + 1).create()
    t0 = time.perf_counter()
    _, index = pickle.loads(index_message)
    pending.commit(dataclasses.replace(index, step=STEP + 1), what="local copy")
    return time.perf_counter() - t0


def local_restore(
    final: Path, index: Manifest, current: Layout, per_node: int, keep: Sequence[int]
) -> tuple[dict[int, bytes], RootComm, dict[str, float]]:
    """Rank 0 of :meth:`LocalTier.newest` (no partner copies): gather every rank's sizes of its
    file and shard, ``_pick`` (the index of its node's copy read, the sizes checked, each
    rank's part made) and the scatter of the parts. Returns the messages of ``keep``."""
    sharded = index.sharded
    assert sharded is not None
    files = {f.name: f for f in index.files}
    first_of = {s.name: min(r for n in s.files for r in files[n].ranks) for s in sharded.shards}
    inbox = []
    for r in range(current.nranks):
        shard = sharded.shard_of(r)
        mine = first_of[shard.name] == r
        sizes = LocalSizes(sharded.file_of(r).name, sharded.file_of(r).size,
                       shard.name if mine else None, shard.size if mine else None)  # fmt: skip
        inbox.append(pickle.dumps((True, {STEP: sizes}), PROTOCOL))
    tier = object.__new__(LocalTier)  # what _pick and _needed use: the copy, groups, nodes
    tier.target = DirectoryTarget(final.parent)
    tier.comms = SetComms(comm=SerialComm(), group=SerialComm(), kind=current.kind,
                          groups=current.groups, group_index=0)  # fmt: skip
    tier.views = [NodeView(r - r % per_node, "", "", "", "") for r in range(current.nranks)]
    comm = RootComm(current.nranks, inbox, keep=tuple(keep))
    coll = Collective(comm)
    t0 = time.perf_counter()
    gathered = coll.gather(pickle.loads(inbox[0])[1])
    assert gathered is not None
    t1 = time.perf_counter()
    parts = tier._pick(gathered.values(), current)
    t2 = time.perf_counter()
    coll.deal("finding local checkpoints", parts)
    t3 = time.perf_counter()
    return comm.kept, comm, {"restore_gather_s": t1 - t0, "restore_pick_s": t2 - t1,
                             "restore_scatter_s": t3 - t2}  # fmt: skip


def local_rank_restore(received: bytes, final: Path, rank: int, current: Layout) -> float:
    """One rank's part of :meth:`LocalTier.newest` and of the read's start: unpickle its part,
    put its layout back, load its own entry from its shard in its node's copy."""
    t0 = time.perf_counter()
    ok, part = pickle.loads(received)
    assert ok
    part = dataclasses.replace(part, layout=current)
    needs_elastic(load_entries(SetFiles.in_directory(final), part, [rank]).ranks[rank], {})
    return time.perf_counter() - t0


def measure_local_once(
    inbox: list[bytes], per_file: int, per_node: int, base: Path, sharding: Sharding | None,
    *, trace: bool,
) -> dict[str, Any]:  # fmt: skip
    """One save with a node-local tier (rank 0's part, a node leader's), then the restore's
    look-up, with shards (``sharding``) or without (before: every rank reads the manifest)."""
    ranks, out = len(inbox), dict[str, Any]()
    root = Path(tempfile.mkdtemp(prefix="local-", dir=base))
    try:
        rss0 = reset_peak_rss()
        with traced(trace) as mem:
            if sharding is None:
                manifest, comm, commit_s = local_commit_unsharded(inbox, per_file, root)
            else:
                manifest, comm, commit_s = local_commit_sharded(inbox, per_file, root, sharding)
        out["commit_rss_delta_bytes"] = max_rss() - rss0 if rss0 else None
        final = root / filenames.step_dir_name(STEP)
        out["manifest_bytes"] = (final / filenames.MANIFEST).stat().st_size
        out["save_receive_bytes"] = len(comm.sent[0])  # what every rank receives (of rank 0)
        if trace:
            out["commit_peak_bytes"] = mem["peak"]
        else:
            out["commit_s"] = commit_s
            out.update({f"{k}_s": v for k, v in comm.seconds.items()})
        current = current_layout(ranks, per_file)
        if sharding is None:  # every rank reads the whole manifest (if the library would)
            out["rank_restore_bytes"] = out["manifest_bytes"]
            if not trace and out["manifest_bytes"] <= LIBRARY_LIMIT:
                out["rank_restore_s"] = seconds_of(functools.partial(load_manifest, final))
            return out
        if not trace:
            out["node_leader_commit_s"] = node_leader_commit(comm.sent[0], root)
        del comm
        gc.collect()
        last = ranks - 1
        leader = last - last % per_node
        with traced(trace) as mem:
            kept, scomm, times = local_restore(final, manifest, current, per_node, (last, leader))
        del manifest
        gc.collect()
        with traced(trace) as mem2:
            rank_s = local_rank_restore(kept[last], final, last, current)
        shard = max(p.stat().st_size for p in final.iterdir() if filenames.is_shard_name(p.name))
        out.update(
            rank_restore_bytes=len(kept[last]) + shard, rank_received_bytes=len(kept[last]),
            rank_shard_read_bytes=shard, leader_restore_bytes=len(kept[leader]),
            restore_scatter_bytes_total=sum(scomm.scattered),
        )  # fmt: skip
        if trace:
            out.update(coordinator_restore_peak_bytes=mem["peak"],
                       rank_restore_peak_bytes=mem2["peak"])  # fmt: skip
        else:
            out.update(rank_restore_s=rank_s, **times)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
        gc.collect()


def run_local(
    ranks: int, datasets: int, per_file: int, per_node: int, repeats: int, base: Path, *,
    shard_ranks: int, trace: bool, before: bool,
) -> dict[str, Any]:  # fmt: skip
    """Measure one size with a node-local tier: sharded by node (``shard_ranks``), and, with
    ``before``, unsharded (every rank builds and reads the whole manifest)."""
    inbox = messages(ranks, datasets, per_file)
    sharding = leaders(inbox, per_file, shard_ranks, base, per_node)
    out: dict[str, Any] = {"ranks": ranks, "datasets": datasets, "per_file": per_file,
                           "per_node": per_node, "shard_ranks": shard_ranks,
                           "shards": len(sharding.members), "repeats": repeats}  # fmt: skip
    for name, how in (("after", sharding), ("before", None)):
        if name == "before" and not before:
            continue
        samples = [measure_local_once(inbox, per_file, per_node, base, how, trace=False)
                   for _ in range(repeats)]  # fmt: skip
        peaks = measure_local_once(inbox, per_file, per_node, base, how, trace=True) if trace else {}
        first = samples[0]
        result = {k: v for k, v in first.items() if not k.endswith("_s")}
        result.update({k: round(statistics.median(s[k] for s in samples), 4)
                       for k in first if k.endswith("_s")})  # fmt: skip
        result["commit_rss_delta_bytes"] = max(s["commit_rss_delta_bytes"] or 0 for s in samples)
        result.update({k: v for k, v in peaks.items() if k.endswith("_peak_bytes")})
        if how is not None:
            result["shard_leader_s_median"] = round(statistics.median(how.leader_s), 4)
            result["shard_leader_s_max"] = round(max(how.leader_s), 4)
        out[name] = result
    out.update(max_rss_bytes=max_rss(), revision=library_revision(),
               python=sys.version.split()[0])  # fmt: skip
    return out


def mb(n: int | None) -> str:
    """Bytes as MB (10^6), ``-`` for none."""
    return "-" if n is None else f"{n / 1e6:,.1f}"


def kb(n: int | None) -> str:
    """Bytes as KB (10^3), ``-`` for none."""
    return "-" if n is None else f"{n / 1e3:,.1f}"


def secs(x: float | None) -> str:
    """Seconds, 3 decimals, ``-`` for none."""
    return "-" if x is None else f"{x:.3f}"


def local_table(results: Sequence[dict[str, Any]]) -> str:
    """The node-local tier's results as a Markdown table (MB = 10^6 bytes)."""

    rows = [
        "| ranks x datasets (per node) | shards | before: rank 0's commit s, RSS delta MB; a rank "
        "reads MB | commit s: rank 0 (gather / bcast / prepare / publish) | rank 0 commit peak MB "
        "(RSS delta) | every rank receives KB | a node leader s: its shard (median, max), its "
        "commit | restore, rank 0 s: gather / pick / scatter | restore, a rank: receives KB, "
        "reads KB, s (a node leader receives KB) |",
        "|" + "---|" * 9,
    ]
    for r in results:
        a, b = r["after"], r.get("before", {})
        rows.append(
            f"| {r['ranks']:,} x {r['datasets']} ({r['per_node']}) | {r['shards']} "
            f"| {secs(b.get('commit_s'))}, {mb(b.get('commit_rss_delta_bytes'))}; "
            f"{mb(b.get('rank_restore_bytes'))} "
            f"| {secs(a.get('commit_s'))} ({secs(a.get('gather_s'))} / {secs(a.get('bcast_s'))} / "
            f"{secs(a.get('prepare_s'))} / {secs(a.get('publish_s'))}) "
            f"| {mb(a.get('commit_peak_bytes'))} ({mb(a.get('commit_rss_delta_bytes'))}) "
            f"| {kb(a['save_receive_bytes'])} "
            f"| ({secs(a['shard_leader_s_median'])}, {secs(a['shard_leader_s_max'])}), "
            f"{secs(a.get('node_leader_commit_s'))} "
            f"| {secs(a.get('restore_gather_s'))} / {secs(a.get('restore_pick_s'))} / "
            f"{secs(a.get('restore_scatter_s'))} "
            f"| {kb(a['rank_received_bytes'])}, {kb(a['rank_shard_read_bytes'])}, "
            f"{secs(a.get('rank_restore_s'))} ({kb(a['leader_restore_bytes'])}) |"
        )
    return "\n".join(rows)


def main_local(args: argparse.Namespace, base: Path) -> None:
    """``--local-tier``: measure each size with a node-local tier, print the table, write the
    JSON."""
    results = []
    for n in (int(x) for x in args.ranks.split(",")):
        result = run_local(
            n, args.datasets, args.per_file, args.ranks_per_node, args.repeats, base,
            shard_ranks=args.shard_ranks or DEFAULT_SHARD_RANKS, trace=not args.no_trace,
            before=not args.no_before,
        )  # fmt: skip
        results.append(result)
        print(local_table(results[-1:]).splitlines()[2], flush=True)
    print(local_table(results))
    write_json(args.json, results)


def reset_peak_rss() -> int:
    """Reset this process's ``VmHWM`` to its current resident memory (Linux ``clear_refs``);
    return that, or 0 where it cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return 0
    return max_rss()


def max_rss() -> int:
    """This process's peak resident memory so far (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def watch_rss(limit_bytes: int) -> None:
    """Abort this process (exit 3) as soon as its resident memory passes ``limit_bytes``."""
    page = os.sysconf("SC_PAGE_SIZE")

    def watch() -> None:
        while True:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * page
            if rss > limit_bytes:
                print(f"aborted: resident memory {rss / 2**30:.1f} GiB over the limit",
                      file=sys.stderr, flush=True)  # fmt: skip
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def table(results: Sequence[dict[str, Any]]) -> str:
    """The results as a Markdown table (MB = 10^6 bytes): sizes, then the commit's and the
    restore hand-out's critical paths (medians; the range over repeats) with their parts."""

    def spread(r: dict[str, Any], key: str) -> str:
        lo, hi = r[f"{key}_range"]
        return f"**{secs(r[key])}** ({secs(lo)}-{secs(hi)})"

    rows = [
        "| ranks x datasets | shards | index MB (largest shard) | gathered MB: by rank 0 (by a "
        "leader) | commit critical path s (range) | = slowest leader + rank 0's top (unpickle / "
        "build / prepare / publish) + a rank | restore hand-out critical path s (range) | = "
        "rank 0's quick validation + sends (messages, MB) + slowest leader (median; reads KB) + a rank "
        "(receives KB, reads KB) | commit peak MB (RSS delta) |",
        "|" + "---|" * 9,
    ]
    for r in results:
        rows.append(
            f"| {r['ranks']:,} x {r['datasets']} | {r['shards'] or 1} | "
            f"{mb(r['manifest_bytes'])} ({mb(r['shard_bytes_max'] or None)}) "
            f"| {mb(r['gathered_bytes'])} ({mb(r['shard_gathered_bytes'] or None)}) "
            f"| {spread(r, 'commit_critical_s')} "
            f"| {secs(r.get('commit_slowest_leader_s'))} + {secs(r['commit_top_s'])} "
            f"({secs(r['gather_unpickle_s'])} / {secs(r['build_manifest_s'])} / {secs(r['prepare_s'])} / "
            f"{secs(r['publish_s'])}) + {secs(r['rank_save_receive_s'])} "
            f"| {spread(r, 'handout_critical_s')} "
            f"| {secs(r.get('validate_s'))} + {secs(r['restore_scatter_s'])} "
            f"({r['restore_scatter_messages']:,}, {mb(r['restore_scatter_bytes_total'])}) + "
            f"{secs(r.get('handout_leader_max_s'))} ({secs(r.get('handout_leader_median_s'))}; "
            f"{kb(r['leader_shard_read_bytes'] or None)}) + {secs(r['rank_restore_s'])} "
            f"({kb(r['rank_received_bytes'])}, {kb(r['rank_shard_read_bytes'] or None)}) "
            f"| {mb(r['commit_peak_bytes'])} ({mb(r['commit_rss_delta_bytes'])}) |"
        )
    rows += [f"{r['ranks']:,} ranks: restore failed: {r['restore_error']}"
             for r in results if r["restore_error"]]  # fmt: skip
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments, measure each size, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description="The coordinator at scale, simulated (no MPI).")
    ap.add_argument("--ranks", default="1024", help="rank counts, comma-separated")
    ap.add_argument("--datasets", type=int, default=300, help="arrays per rank")
    ap.add_argument("--per-file", type=int, default=1, help="ranks per file (1: self)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per size")
    ap.add_argument("--shard-ranks", type=int, default=DEFAULT_SHARD_RANKS,
                    help="ranks per manifest shard (0: one manifest)")  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dir", help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--no-trace", action="store_true", help="skip the tracemalloc run")
    ap.add_argument("--max-rss-gib", type=float, default=8.0, help="abort above this RSS")
    ap.add_argument("--leader-sample", type=int, default=16,
                    help="shard leaders whose restore part is measured (evenly spread)")
    ap.add_argument("--pause-gc", action="store_true",
                    help="time with the garbage collector paused (RESILIENT_PAUSE_GC=1)")  # fmt: skip
    ap.add_argument("--local-tier", action="store_true",
                    help="a save with a node-local tier (shards never span nodes)")  # fmt: skip
    ap.add_argument("--ranks-per-node", type=int, default=64, help="with --local-tier")
    ap.add_argument("--no-before", action="store_true",
                    help="with --local-tier: skip the unsharded save (every rank's manifest)")  # fmt: skip
    args = ap.parse_args(argv)
    watch_rss(int(args.max_rss_gib * 2**30))
    base = Path(args.dir or tempfile.gettempdir())
    if args.local_tier:
        main_local(args, base)
        return
    results = []
    for n in (int(x) for x in args.ranks.split(",")):
        results.append(
            run(
                n,
                args.datasets,
                args.per_file,
                args.repeats,
                base,
                shard_ranks=args.shard_ranks,
                trace=not args.no_trace,
                leader_sample=args.leader_sample,
                pause_gc=args.pause_gc,
            )
        )
        print(table(results[-1:]).splitlines()[2], flush=True)
    print(table(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
