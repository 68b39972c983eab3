"""The coordinator at scale, simulated (issue 23, point 4): one process, no MPI.

Run::

    python bench/bench_scale.py --ranks 1024 [--datasets 300] [--per-file 1] [--repeats 3]
                                [--json OUT] [--dir DIR] [--max-rss-gib 8]

What a save's commit and a restore do with every rank's description, driven through the
library's own functions, fed with synthetic descriptions shaped like what the gather delivers:

* every rank's message is what :meth:`resilient.parallel.collective.Collective.gather` sends
  for :class:`resilient.checkpoint.saving.SavePipeline`, ``(True, RankWritten)``: its
  :class:`~resilient.model.manifest.RankEntry` (a
  :class:`~resilient.model.manifest.DatasetTable` of ``--datasets`` arrays, its tree) and, from each
  file's leader, a :class:`~resilient.checkpoint.checkpointer.FileWritten` with the segments of the real
  HDF5 skeleton (:func:`resilient.io.fileio.build_skeleton`), pickled as mpi4py's lowercase
  collectives pickle it (protocol 5, one message per rank);
* **commit**: rank 0 runs the real gather, ``commit_set`` and announce as
  :class:`resilient.checkpoint.saving.SavePipeline` runs them (every rank's data durable) over
  :class:`RootComm`, a stand-in for rank 0 of an MPI communicator (``gather`` receives every
  rank's bytes into one buffer and unpickles them; ``bcast`` pickles what rank 0 sends). So the
  commit is: unpickle N descriptions, ``build_manifest``, ``PendingDir.prepare`` (JSON,
  checksum, manifest and marker written), ``PendingDir.publish`` (fsync, rename), and pickling
  the reply every rank receives (``("ok", None)``: the manifest stays on rank 0);
* **restore** from the shared root (:class:`resilient.checkpoint.restorer.Restorer`): rank 0 loads the
  manifest (:func:`resilient.io.validate.load_manifest`: read, checksum, ``parse_manifest``; the
  ``lstat`` of every data file by ``validate_checkpoint`` is left out) and scatters each rank
  its part of the chosen candidate (``Collective.scatter`` of ``restorer._parts``: its own
  entry, a file group's leader its group's, their files, the header; the layout's groups stay
  home when they are the restoring run's); the last rank unpickles its part and looks at its
  own entry (:func:`resilient.checkpoint.elastic.needs_elastic`). ``rank_restore_*`` is that rank's part
  before it reads its data: the bytes it receives, the time to unpickle them, the memory they
  take (``leader_restore_bytes``: its group's leader's message).

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
from resilient.checkpoint.checkpointer import (
    FileWritten,
    RankPlan,
    RankWritten,
    commit_set,
    write_shard,
)
from resilient.checkpoint.elastic import needs_elastic
from resilient.checkpoint.manager import DEFAULT_SHARD_RANKS
from resilient.checkpoint.restorer import _Candidate, _parts, _received
from resilient.checkpoint.tiers import LocalTier, NodeView, _Sizes
from resilient.io import validate
from resilient.io.commit import PendingDir
from resilient.io.fileio import build_skeleton
from resilient.io.targets import DirectoryTarget
from resilient.io.validate import load_entries, load_manifest
from resilient.model import filenames
from resilient.model.codec import manifest_json
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, Segment
from resilient.model.payload import split_state
from resilient.model.tree import leaf_paths
from resilient.parallel.collective import Collective
from resilient.parallel.comm import SerialComm
from resilient.parallel.setcomms import SetComms, shard_groups

LIBRARY_LIMIT = validate.MAX_MANIFEST_BYTES  # the largest manifest the library commits

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
class TimedPending:
    """A :class:`PendingDir` whose two steps add their time to ``seconds`` (keys ``prepare``,
    ``publish``), which ``commit_set`` commits into."""

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
    """A save's shards (``shard_ranks`` > 0): each shard's ranks and what its leader sends rank
    0 (:func:`leaders`); ``leader_s``: each other leader's own work, done in parallel on its
    node (not in rank 0's commit)."""

    shard_ranks: int
    members: list[tuple[int, ...]]
    world_inbox: list[bytes]
    leader_s: list[float]
    written: dict[str, bytes]  # the other leaders' shards, by name


def set_comms(comm: Any, ranks: int, per_file: int, shard: Any = None,
             members: tuple[int, ...] = (), index: int = 0) -> SetComms:  # fmt: skip
    """Rank 0's SetComms (or shard ``index``'s leader's), files of ``per_file`` ranks."""
    groups = tuple(tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file))
    return SetComms(comm=comm, group=SerialComm(), kind=layout_kind(per_file), groups=groups,
                    group_index=0, shard=shard, shard_index=index, shard_members=members)  # fmt: skip


def leaders(inbox: list[bytes], per_file: int, shard_ranks: int, root: Path) -> Sharding:
    """Every shard's leader but rank 0 runs its round (the real one: gather its shard's
    messages, write its shard) into a scratch directory; what each rank then sends rank 0 is
    ``(True, ShardWritten)`` from a leader, ``(True, None)`` from the others."""
    ranks = len(inbox)
    groups = [tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file)]
    of_group = shard_groups(groups, shard_ranks)
    members = [tuple(r for g, k in zip(groups, of_group, strict=True) if k == s for r in g)
               for s in range(of_group[-1] + 1)]  # fmt: skip
    world = [pickle.dumps((True, None), PROTOCOL)] * ranks
    scratch = Path(tempfile.mkdtemp(prefix="shards-", dir=root))
    took = []
    for index, held in enumerate(members[1:], start=1):
        comm = RootComm(len(held), [inbox[r] for r in held])
        comms = set_comms(None, ranks, per_file, comm, held, index)
        own = pickle.loads(inbox[held[0]])[1]
        t0 = time.perf_counter()
        got = write_shard(comms, own, scratch, kind="checkpoint", step=STEP)
        took.append(time.perf_counter() - t0)
        assert not isinstance(got, Exception), got
        world[held[0]] = pickle.dumps((True, got), PROTOCOL)
    written = {p.name: p.read_bytes() for p in scratch.iterdir()}
    shutil.rmtree(scratch, ignore_errors=True)
    return Sharding(shard_ranks, members, world, took, written)


def commit(
    inbox: list[bytes], per_file: int, root: Path, sharding: Sharding | None
) -> tuple[Manifest, RootComm, float]:
    """Rank 0's part of a save from the gather to the published checkpoint in ``root``, as
    ``SavePipeline._finish_save`` runs it (the real gather, ``commit_set`` and announce,
    ``prepare``/``publish`` of a real :class:`PendingDir`, timed: :class:`TimedPending`). With ``sharding``, rank 0
    leads shard 0 (gathers its shard's messages and writes its shard), then gathers the
    shards' summaries (the other leaders' work is done before, by :func:`leaders`). Returns
    the manifest, the world comm (bytes, times)
    and the wall time."""
    ranks = len(inbox)
    if sharding is None:
        comm = RootComm(ranks, list(inbox))
        comms = set_comms(comm, ranks, per_file)
    else:
        held = sharding.members[0]
        comm = RootComm(ranks, list(sharding.world_inbox))
        comms = set_comms(comm, ranks, per_file, RootComm(len(held), inbox[: len(held)]), held)
    pending = PendingDir.for_step(root, STEP).create()
    for name, text in sharding.written.items() if sharding is not None else ():
        (pending.path / name).write_bytes(text)  # by the other leaders, meanwhile
    own = pickle.loads(inbox[0])[1]  # rank 0's outcome (the gather takes it from the inbox)
    # the library refuses to commit a manifest that no restore would read (over
    # validate.MAX_MANIFEST_BYTES, 16,384 x 300 here): lifted, to measure what the design costs
    # there (the table says when the library refuses it)
    validate.MAX_MANIFEST_BYTES = 1 << 40
    t0 = time.perf_counter()
    shards = own if sharding is None else write_shard(comms, own, pending.path,
                                                      kind="checkpoint", step=STEP)  # fmt: skip
    coll = Collective(comm)
    gathered = coll.gather(shards)
    assert gathered is not None
    manifest = commit_set(
        comms, gathered.values(), step=STEP, metrics={"loss": 1.0}, library_version=__version__,
        pending=TimedPending(pending, comm.seconds),  # type: ignore[arg-type]
    )  # fmt: skip
    coll.announce("save", None)
    took = time.perf_counter() - t0
    validate.MAX_MANIFEST_BYTES = LIBRARY_LIMIT
    assert manifest is not None  # (rank 0: the coordinator keeps it)
    return manifest, comm, took


def current_layout(ranks: int, per_file: int) -> Layout:
    """The layout of the restoring run: the saved one (files of ``per_file`` consecutive ranks)."""
    groups = tuple(tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file))
    return Layout(layout_kind(per_file), ranks, groups)


def coordinator_restore(
    path: Path, current: Layout, written: bytes, keep: Sequence[int]
) -> tuple[dict[int, bytes], RootComm, dict[str, Any]]:
    """Rank 0 of a restore: :func:`load_manifest`, then the real ``Collective.scatter`` of each
    rank's part of the candidate (:func:`resilient.checkpoint.restorer._parts`). Returns the messages of
    the ranks ``keep``, the comm (every message's size) and times. When ``load_manifest``
    refuses the checkpoint, its error is returned (``restore_error``) and the candidate holds
    the manifest the commit wrote instead (``written``, pickled: what parsing it would give)."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        manifest = load_manifest(path)
    except Exception as exc:  # e.g. a manifest over load_manifest's size limit
        out["restore_error"] = f"{type(exc).__name__}: {exc}"
        manifest = pickle.loads(written)
    else:
        out["load_manifest_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    comm = RootComm(current.nranks, None, keep=tuple(keep))
    whole = _Candidate(path, manifest, None)
    Collective(comm).scatter("choosing a checkpoint", lambda: _parts(whole, current))  # type: ignore[arg-type]
    out["restore_scatter_s"] = time.perf_counter() - t1
    return comm.kept, comm, out


def rank_restore(received: bytes, rank: int, current: Layout) -> tuple[float, int]:
    """One rank's part of a restore before it reads its data: unpickle its part of the
    candidate, put its layout back, load its own entry (of a sharded manifest: read, check
    and parse its shard: :func:`load_entries`) and look at it. Returns the time and the bytes
    of the shard it read (0: none)."""
    t0 = time.perf_counter()
    ok, candidate = pickle.loads(received)
    assert ok
    manifest = load_entries(candidate.path, _received(candidate.manifest, current), [rank])
    needs_elastic(manifest.ranks[rank], {})
    sharded = manifest.sharded
    read = 0 if sharded is None else sharded.shard_of(rank).size
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


def measure_once(
    inbox: list[bytes], per_file: int, base: Path, sharding: Sharding | None, *, trace: bool
) -> dict[str, Any]:
    """One commit, then one restore, of the checkpoint of ``inbox`` in a new directory under
    ``base``: times (``trace=False``) or tracemalloc peaks (``trace=True``), and sizes. At most
    one copy of the manifest's objects is alive at a time (besides the commit's inputs)."""
    ranks, out = len(inbox), dict[str, Any]()
    root = Path(tempfile.mkdtemp(prefix="scale-", dir=base))
    try:
        rss0 = reset_peak_rss()
        with traced(trace) as mem:
            manifest, comm, commit_s = commit(inbox, per_file, root, sharding)
        out["commit_rss_delta_bytes"] = max_rss() - rss0 if rss0 else None
        final = root / filenames.step_dir_name(STEP)
        reply = comm.sent[0]  # ("ok", None): what every rank receives at every save
        shards = sorted(
            p.stat().st_size for p in final.iterdir() if filenames.is_shard_name(p.name)
        )
        out.update(
            manifest_bytes=(final / filenames.MANIFEST).stat().st_size, reply_bytes=len(reply),
            shards=len(shards), shard_bytes_max=max(shards, default=0),
            shard_bytes_total=sum(shards),
        )  # fmt: skip
        if trace:
            out["commit_peak_bytes"] = mem["peak"]
        else:
            s = comm.seconds
            out.update(
                commit_s=commit_s, gather_unpickle_s=s["gather"], prepare_s=s["prepare"],
                publish_s=s["publish"], bcast_pickle_s=s["bcast"],
                build_manifest_s=commit_s - sum(s.values()),
                encode_s=seconds_of(functools.partial(manifest_json, manifest)),
            )  # fmt: skip
        written = pickle.dumps(manifest, protocol=5)  # (for a manifest load_manifest refuses)
        del manifest, comm
        gc.collect()
        if not trace:
            out["rank_save_receive_s"] = seconds_of(functools.partial(pickle.loads, reply))
            gc.collect()
        current = current_layout(ranks, per_file)
        last, leader = ranks - 1, current.groups[-1][0]  # a file group's last rank, its leader
        with traced(trace) as mem:
            kept, scomm, restore = coordinator_restore(final, current, written, (last, leader))
        del reply, written
        gc.collect()
        with traced(trace) as mem2:
            rank_s, shard_read = rank_restore(kept[last], last, current)
        out.update(
            rank_restore_bytes=len(kept[last]) + shard_read, rank_received_bytes=len(kept[last]),
            rank_shard_read_bytes=shard_read, leader_restore_bytes=len(kept[leader]),
            restore_scatter_bytes_total=sum(scomm.scattered),
            restore_scatter_bytes_max=max(scomm.scattered),
            restore_error=restore.pop("restore_error", None),
        )  # fmt: skip
        del scomm
        if trace:
            out.update(coordinator_restore_peak_bytes=mem["peak"],
                       rank_restore_peak_bytes=mem2["peak"])  # fmt: skip
        else:
            out.update(rank_restore_s=rank_s, **restore)
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
) -> dict[str, Any]:
    """Measure one size: ``repeats`` timed commits and restores (medians), then one traced
    (with ``trace``; else the peaks are ``None``). ``shard_ranks``: the manifest in shards of
    that many ranks when there are more (the library's ``manifest_shard_ranks``; 0: one)."""
    t0 = time.perf_counter()
    inbox = messages(ranks, datasets, per_file)
    sharding = None
    if shard_ranks and ranks > shard_ranks:
        sharding = leaders(inbox, per_file, shard_ranks, base)
        if len(sharding.members) < 2:
            sharding = None
    setup_s = time.perf_counter() - t0
    samples = [measure_once(inbox, per_file, base, sharding, trace=False) for _ in range(repeats)]
    peaks = measure_once(inbox, per_file, base, sharding, trace=True) if trace else {}
    first = samples[0]
    gathered = sum(map(len, inbox if sharding is None else sharding.world_inbox))
    shard_gathered = 0 if sharding is None else sum(len(inbox[r]) for r in sharding.members[0])
    times = {
        k: round(statistics.median(s[k] for s in samples), 4) for k in first if k.endswith("_s")
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
        "commit_s_max": round(max(s["commit_s"] for s in samples), 4),
        "commit_peak_bytes": peaks.get("commit_peak_bytes"),
        "commit_rss_delta_bytes": max(s["commit_rss_delta_bytes"] or 0 for s in samples) or None,
        "rank_restore_bytes": first["rank_restore_bytes"],
        "rank_received_bytes": first["rank_received_bytes"],
        "rank_shard_read_bytes": first["rank_shard_read_bytes"],
        "leader_restore_bytes": first["leader_restore_bytes"],
        "restore_scatter_bytes_total": first["restore_scatter_bytes_total"],
        "restore_scatter_bytes_max": first["restore_scatter_bytes_max"],
        "rank_restore_peak_bytes": peaks.get("rank_restore_peak_bytes"),
        "coordinator_restore_peak_bytes": peaks.get("coordinator_restore_peak_bytes"),
        "restore_error": first["restore_error"],
        "library_commits": first["manifest_bytes"] <= LIBRARY_LIMIT,
        "gathered_bytes": gathered,
        "gathered_bytes_per_rank": gathered // ranks,
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


# --------------------------------------------------------------------------- a node-local tier


class LocalRootComm(RootComm):
    """:class:`RootComm` with ``allgather`` (a save with a node-local tier shares its outcomes):
    every rank's object as rank 0 receives it (the inbox, or every rank sending what rank 0
    sends), and what rank 0 sends pickled once into ``sent``."""

    def allgather(self, obj: T) -> list[T]:
        self.bcast(obj)
        return self.gather(obj)


def node_sharding(
    inbox: list[bytes], per_file: int, shard_ranks: int, per_node: int, root: Path
) -> Sharding:
    """:func:`leaders` for a save with a node-local tier: the shards of
    :func:`~resilient.parallel.setcomms.shard_groups` with nodes of ``per_node`` consecutive
    ranks (a shard never spans two nodes); every shard's leader but rank 0 runs its round."""
    ranks = len(inbox)
    groups = [tuple(range(g, min(g + per_file, ranks))) for g in range(0, ranks, per_file)]
    of_group = shard_groups(groups, shard_ranks, nodes=[g[0] // per_node for g in groups])
    members = [tuple(r for g, k in zip(groups, of_group, strict=True) if k == s for r in g)
               for s in range(max(of_group) + 1)]  # fmt: skip
    world = [pickle.dumps((True, None), PROTOCOL)] * ranks
    scratch = Path(tempfile.mkdtemp(prefix="shards-", dir=root))
    took = []
    for index, held in enumerate(members[1:], start=1):
        comm = RootComm(len(held), [inbox[r] for r in held])
        comms = set_comms(None, ranks, per_file, comm, held, index)
        own = pickle.loads(inbox[held[0]])[1]
        t0 = time.perf_counter()
        got = write_shard(comms, own, scratch, kind="checkpoint", step=STEP)
        took.append(time.perf_counter() - t0)
        assert not isinstance(got, Exception), got
        world[held[0]] = pickle.dumps((True, got), PROTOCOL)
    written = {p.name: p.read_bytes() for p in scratch.iterdir()}
    shutil.rmtree(scratch, ignore_errors=True)
    return Sharding(shard_ranks, members, world, took, written)


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
    validate.MAX_MANIFEST_BYTES = 1 << 40  # (see commit)
    t0 = time.perf_counter()
    done = comm.allgather(pickle.loads(inbox[0]))
    manifest = commit_set(
        comms, [w for _, w in done], step=STEP, metrics={"loss": 1.0},
        library_version=__version__, at=time.time(),
    )  # fmt: skip
    TimedPending(pending, comm.seconds).commit(manifest, what="local copy")
    Collective(comm).share("committing the local copies", None)
    took = time.perf_counter() - t0
    validate.MAX_MANIFEST_BYTES = LIBRARY_LIMIT
    return manifest, comm, took


def local_commit_sharded(
    inbox: list[bytes], per_file: int, root: Path, sharding: Sharding
) -> tuple[Manifest, LocalRootComm, float]:
    """Rank 0's part of a sharded save with a node-local tier, as
    ``SavePipeline._local_index`` and ``_finish_save`` run it: it leads shard 0 (gather, write
    its shard into its node's temporary directory), gathers the shards' summaries, builds the
    index (``commit_set``), broadcasts it, commits its node's copy and learns every node's
    outcome (the allgather). The other shards are in the directory before (their leaders)."""
    ranks = len(inbox)
    held = sharding.members[0]
    comm = LocalRootComm(ranks, list(sharding.world_inbox))
    comms = set_comms(comm, ranks, per_file, RootComm(len(held), inbox[: len(held)]), held)
    pending = PendingDir.for_step(root, STEP).create()
    for name, text in sharding.written.items():
        (pending.path / name).write_bytes(text)  # (on their own nodes; here for the restore)
    own = pickle.loads(inbox[0])[1]
    t0 = time.perf_counter()
    shards = write_shard(comms, own, pending.path, kind="checkpoint", step=STEP)
    coll = Collective(comm)
    gathered = coll.gather(shards)
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
        sizes = _Sizes(sharded.file_of(r).name, sharded.file_of(r).size,
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
    needs_elastic(load_entries(final, part, [rank]).ranks[rank], {})
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
    sharding = node_sharding(inbox, per_file, shard_ranks, per_node, base)
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


def local_table(results: Sequence[dict[str, Any]]) -> str:
    """The node-local tier's results as a Markdown table (MB = 10^6 bytes)."""

    def mb(n: int | None) -> str:
        return "-" if n is None else f"{n / 1e6:,.1f}"

    def kb(n: int | None) -> str:
        return "-" if n is None else f"{n / 1e3:,.1f}"

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

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
            f"| {s(b.get('commit_s'))}, {mb(b.get('commit_rss_delta_bytes'))}; "
            f"{mb(b.get('rank_restore_bytes'))} "
            f"| {s(a.get('commit_s'))} ({s(a.get('gather_s'))} / {s(a.get('bcast_s'))} / "
            f"{s(a.get('prepare_s'))} / {s(a.get('publish_s'))}) "
            f"| {mb(a.get('commit_peak_bytes'))} ({mb(a.get('commit_rss_delta_bytes'))}) "
            f"| {kb(a['save_receive_bytes'])} "
            f"| ({s(a['shard_leader_s_median'])}, {s(a['shard_leader_s_max'])}), "
            f"{s(a.get('node_leader_commit_s'))} "
            f"| {s(a.get('restore_gather_s'))} / {s(a.get('restore_pick_s'))} / "
            f"{s(a.get('restore_scatter_s'))} "
            f"| {kb(a['rank_received_bytes'])}, {kb(a['rank_shard_read_bytes'])}, "
            f"{s(a.get('rank_restore_s'))} ({kb(a['leader_restore_bytes'])}) |"
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
    """The results as a Markdown table (MB = 10^6 bytes)."""

    def mb(n: int | None) -> str:
        return "-" if n is None else f"{n / 1e6:,.1f}"

    def kb(n: int | None) -> str:
        return "-" if n is None else f"{n / 1e3:,.1f}"

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    rows = [
        "| ranks x datasets | shards | manifest MB (largest shard) | gathered MB: by rank 0 (by a "
        "shard leader) | commit s: rank 0 (unpickle / build / prepare / publish) | a shard "
        "leader s: median, max | commit peak MB (RSS delta) | restore, a rank: receives KB, reads "
        "KB, s, peak KB | rank 0: load_manifest s, scatter s |",
        "|" + "---|" * 9,
    ]
    for r in results:
        rows.append(
            f"| {r['ranks']:,} x {r['datasets']} | {r['shards'] or 1} | "
            f"{mb(r['manifest_bytes'])} ({mb(r['shard_bytes_max'] or None)}) "
            f"| {mb(r['gathered_bytes'])} ({mb(r['shard_gathered_bytes'] or None)}) "
            f"| {s(r['commit_s'])} ({s(r['gather_unpickle_s'])} / "
            f"{s(r['build_manifest_s'])} / {s(r['prepare_s'])} / {s(r['publish_s'])}) "
            f"| {s(r['shard_leader_s_median'])}, {s(r['shard_leader_s_max'])} "
            f"| {mb(r['commit_peak_bytes'])} ({mb(r['commit_rss_delta_bytes'])}) "
            f"| {kb(r['rank_received_bytes'])}, {kb(r['rank_shard_read_bytes'] or None)}, "
            f"{s(r['rank_restore_s'])}, {kb(r['rank_restore_peak_bytes'])} "
            f"| {s(r.get('load_manifest_s'))}, {s(r.get('restore_scatter_s'))} |"
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
            )
        )
        print(table(results[-1:]).splitlines()[2], flush=True)
    print(table(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
