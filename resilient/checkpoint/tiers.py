"""The node-local tier: checkpoints written on each node's fast storage, flushed to the shared root.

On every node, ``<local_dir>/<name of the shared root>-<hash of its path>/`` is a checkpoint
root of its own (a :class:`~resilient.io.targets.DirectoryTarget`) holding, per step, the data
files of that node's ranks plus the manifest and the ``COMMITTED`` marker (the same manifest the
shared copy gets). Every file group must lie on one node (``checkpoint_comm`` ``self`` or
``node``; ``world`` only on one node). Above ``manifest_shard_ranks`` ranks the manifest is
sharded (schema 3) with shards that never span two nodes: a node's copy holds the index (the
same on every node) and the shards of its own ranks, as it holds their data files.

A node is what the communicator says it is (:meth:`~resilient.parallel.comm.Comm.split_node`), not a
host name: several nodes may share a host. ``local_dir`` is expanded on each node by its own
ranks (``/scratch/$SLURMD_NODENAME``, ``$SLURM_TMPDIR``), so each node may have its own path;
every rank of a node must expand it to the same directory.

* A save goes to a pending directory on every node; each node's leader commits its copy with
  the usual protocol (:class:`~resilient.io.commit.PendingDir`).
* A flush copies a committed local checkpoint to the shared root: every rank copies its own
  datasets' bytes (the file's leader also HDF5's own bytes), hashing them as they are read, so a
  corrupt local copy is never flushed; then the coordinator commits the shared copy with the
  same manifest. A flush cut short is never visible.
* A flush also moves each node's manifest shards (a sharded manifest), then the coordinator
  commits the index.
* A step is restorable from the local tier only when every rank finds its file there (the
  coordinator checks every rank's file size, and every shard's, against the index of its own
  node's copy; same layout): a job on other nodes finds nothing and uses the shared root. Each
  rank receives its part of the index and reads its own shard, nothing that grows with the
  rank count.
* With ``redundancy="partner"`` (:mod:`resilient.checkpoint.partner`) every local commit is followed, in
  the background, by a copy of each node's files to the next node; a restore first rebuilds
  what lost or replaced nodes lack from those copies. With ``redundancy="xor"``
  (:mod:`resilient.checkpoint.xorsets`) it is followed by the XOR parity of each set of nodes,
  and a restore rebuilds a lost node per set from its set's survivors.
* A restore on another rank count, layout or decomposition stages on each node the files its
  ranks read of the newest step the nodes hold between them, own and partner copies of any
  layout, in ``<local root>/elastic/`` (:mod:`resilient.checkpoint.tierstaging`), before it
  looks at the shared root.

What a manager does with the tier (its commits, partner copies, flushes and restore chain) is
:mod:`resilient.checkpoint.tiermanager`. Collective: construction and :meth:`LocalTier.newest`;
every other method is local.

SCR's cache plus flush (``SCR_FLUSH``), without SCR's C library and job scripts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from resilient.checkpoint.redundancy import DEFAULT_SET_SIZE, CopyScheme, make_copy_scheme
from resilient.errors import ConfigError, InvalidCheckpointError
from resilient.io import fileio, storage
from resilient.io.commit import PendingDir
from resilient.io.manifests import SetFiles, load_entries
from resilient.io.moves import move_ranges
from resilient.io.targets import DirectoryTarget, Target
from resilient.model import filenames
from resilient.model.checksum import hash128
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Comm
from resilient.parallel.nodes import expand_node_path, node_label
from resilient.parallel.setcomms import SetComms

__all__ = [
    "LocalCheckpoint",
    "LocalSizes",
    "LocalTier",
    "known_local_roots",
    "local_root_of",
    "record_local_tiers",
]

log = logging.getLogger(__name__)


def local_root_of(local_dir: str | os.PathLike[str], shared_root: Path) -> Path:
    """The local tier's root under ``local_dir`` for the shared root ``shared_root`` (pure)."""
    absolute = os.path.abspath(shared_root)
    return Path(local_dir) / filenames.local_tier_dir_name(Path(absolute).name, hash128(absolute))


@dataclass(frozen=True, slots=True)
class NodeView:
    """What one rank knows of its node: the node's first rank (of the checkpoint set: the
    node's identity), its name, its host, and the local directory as this rank expands it
    and as the node's first rank does."""

    leader: int
    label: str
    host: str
    own_dir: str
    node_dir: str


class LocalCheckpoint:
    """A local checkpoint every rank has: its node's directory of the step, and the manifest:
    after a save, the whole manifest (of a sharded one, the index with this rank's entry
    loaded); found by :meth:`LocalTier.newest`, the whole on the coordinator (which commits
    the flush) and this rank's part elsewhere (a node's first rank: its node's)."""

    __slots__ = ("manifest", "path")

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest


class LocalTier:
    """The local tier of one manager. Construction is collective over ``comms.comm``.

    Args:
        local_dir: node-local storage (``$SLURM_TMPDIR``, NVMe, ``/dev/shm``), expanded on
            each node (``/scratch/$SLURMD_NODENAME``).
        shared_root: the shared checkpoint root this tier caches.
        comms: who writes which file.
        keep: local checkpoints kept per node (the newest ones).
        redundancy: ``"partner"``: keep a copy of each node's files on the next node;
            ``"xor"``: XOR parity over sets of nodes (:mod:`resilient.checkpoint.redundancy`).
        xor_set_size: the most nodes in an XOR set.

    Raises:
        ConfigError: a file group spans nodes, the ranks of one node expand ``local_dir`` to
            different directories, ``keep`` < 1, or an unknown ``redundancy``.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        shared_root: Path,
        comms: SetComms,
        *,
        keep: int,
        redundancy: str | None = None,
        xor_set_size: int = DEFAULT_SET_SIZE,
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"local_keep must be a positive integer, got {keep!r}")
        self.comms = comms
        self.keep = keep
        self._coll = Collective(comms.comm)
        self.node: Comm = self._coll.check("grouping ranks by node", comms.comm.split_node)
        own_dir = expand_node_path(local_dir)
        leader, label, node_dir = self.node.bcast((comms.comm.rank, node_label(), own_dir))
        self.views: list[NodeView] = comms.comm.allgather(
            NodeView(leader, label, socket.gethostname(), own_dir, node_dir)
        )
        self._coll.check("checking the local tier's layout", self._check_nodes)
        self.root = local_root_of(node_dir, shared_root)
        self.target = DirectoryTarget(self.root)
        self.staging = self.target.child(filenames.ELASTIC_DIR)  # see tierstaging
        self._coll.check(f"opening the local tier {self.root}", self._open)
        self.copies: CopyScheme | None = None
        if redundancy is not None:
            self.copies = make_copy_scheme(
                redundancy, self.target, [(v.leader, v.label) for v in self.views],
                self._coll, keep=keep, shared_root=shared_root, set_size=xor_set_size,
            )  # fmt: skip

    @property
    def is_node_leader(self) -> bool:
        """Whether this rank acts for its node (creates, commits and rotates its copies)."""
        return self.node.rank == 0

    def _check_nodes(self) -> None:
        for group in self.comms.groups:
            nodes = {self.views[r].leader: self.views[r].label for r in group}
            if len(nodes) > 1:
                raise ConfigError(
                    f"local_dir needs every checkpoint file on one node, but checkpoint_comm="
                    f"{self.comms.kind!r} puts ranks of nodes {sorted(nodes.values())[:3]} in "
                    "one file: use 'self' or 'node'"
                )
        for rank, view in enumerate(self.views):
            if view.own_dir != view.node_dir:
                raise ConfigError(
                    f"local_dir must name one directory per node, but rank {rank} expands it "
                    f"to {view.own_dir!r} and the first rank of its node ({view.label}) to "
                    f"{view.node_dir!r}"
                )

    def _open(self) -> None:
        if self.is_node_leader:
            storage.ensure_root(self.root)
            self.target.clean_up()
            if self.staging.root.exists():  # a crash left a staged elastic restore
                self.staging.drop()

    # ------------------------------------------------------------------ saving

    def commit(self, pending: PendingDir, manifest: Manifest) -> None:
        """Local: this node's leader commits its copy, then keeps the newest ``keep`` (the
        caller learns whether every node did)."""
        if self.is_node_leader:
            self.target.commit(pending, manifest, what=f"local copy of step {manifest.step}")
            self._rotate()

    def rollback(self, pending: PendingDir) -> None:
        """Local: this node's leader removes its temporary directory (no communication)."""
        if self.is_node_leader:
            self.target.rollback(pending)

    def _rotate(self) -> None:
        steps = sorted(self.target.steps(), reverse=True)
        for step in steps[self.keep :]:
            try:
                self.target.remove(step)
            except OSError as exc:
                log.warning("could not remove local checkpoint %d in %s: %s", step, self.root, exc)

    def partner_copy_job(self, checkpoint: LocalCheckpoint) -> Callable[[], str | None] | None:
        """This rank's part of copying a committed local checkpoint to its partner (see
        :meth:`~resilient.checkpoint.partner.CopyScheme.copy_job`; no collective), or ``None``
        without copies (or without another node)."""
        if self.copies is None or not self.copies.has_partner:
            return None
        return self.copies.copy_job(checkpoint.path, checkpoint.manifest)

    # ------------------------------------------------------------------ flushing

    def flush_job(
        self,
        checkpoint: LocalCheckpoint,
        into: Target,
        pending: PendingDir,
        *,
        bounce: fileio.Bounce | None = None,
    ) -> Callable[[], None]:
        """This rank's part of moving ``checkpoint`` from this tier into ``pending`` (``into``'s
        pending step, the shared root's; :func:`~resilient.io.moves.move_ranges`, through ``bounce``, the
        caller's buffer, if given): its datasets' bytes, on a file's first rank HDF5's own
        bytes too, and, of a sharded manifest, on the first rank of the first file of a shard
        the shard.

        The returned function does no communication (it may run on a background thread); it
        raises :class:`InvalidCheckpointError` if a byte range does not match its checksum
        (or this rank's shard cannot be read, to find its entry).
        """
        rank = self.comms.comm.rank

        def run() -> None:
            manifest = load_entries(
                SetFiles.in_directory(checkpoint.path), checkpoint.manifest, (rank,)
            )
            entry = manifest.ranks[rank]
            file = next(f for f in manifest.files if f.name == entry.file)
            ranges: list[tuple[int, int, str, str]] = [
                (d.offset, d.nbytes, d.checksum, f"rank {rank} dataset {d.name!r}")
                for d in entry.datasets
                if d.offset is not None and d.nbytes
            ]
            leader = file.ranks[0] == rank
            if leader:
                ranges += [
                    (s.offset, s.length, s.checksum, "HDF5 metadata") for s in file.meta_segments
                ]
            move = functools.partial(move_ranges, self.target, manifest.step, bounce=bounce)
            move(file.name, into, pending, ranges, size=file.size if leader else None)
            sharded = manifest.sharded
            shard = None if sharded is None else sharded.shard_of(rank)
            if leader and shard is not None and shard.files[0] == file.name:
                whole = [(0, shard.size, shard.checksum, f"manifest shard {shard.name}")]
                move(shard.name, into, pending, whole, size=shard.size)

        return run

    # ------------------------------------------------------------------ restoring

    def newest(
        self, current: Layout, *, step: int | None = None, at_least: int | None = None
    ) -> LocalCheckpoint | None:
        """Collective: the newest step (or ``step``; not older than ``at_least``) every rank
        finds intact in its node's copy, after rebuilding from partner copies what some nodes
        lack (one gather, one scatter).

        Every rank reports the size of its file (and of its manifest shard) in each committed
        local step; the coordinator reads the index of its own node's copy of the newest step
        every rank has, checks the layout and every rank's sizes against it, and hands each
        rank its part (:meth:`~resilient.model.manifest.Manifest.parts`: its own entry or,
        sharded, its shard's name, and its file; a node's first rank its node's): what a rank
        receives does not grow with the rank count. The coordinator keeps the whole index
        (the flush commits it in the shared root). Quick checks only: the restore verifies
        every checksum it reads (the shard's too).
        """
        if self.copies is not None and self.copies.has_partner:
            self.copies.rebuild_newest(self.target.steps, current, step=step, at_least=at_least)
        try:
            mine: dict[int, LocalSizes] | Exception = self._sizes(step, at_least)
        except Exception as exc:  # raised on every rank by deal
            mine = exc
        gathered = self._coll.gather(mine)
        answer: list[Manifest | None] | Exception | None = None
        if gathered is not None:
            try:
                answer = self._pick(gathered.values(), current)
            except Exception as exc:
                answer = exc
        part = self._coll.deal("finding local checkpoints", answer)
        if part is None:
            return None
        if part.is_part and not part.layout.groups:  # the groups every rank knows, put back
            part = dataclasses.replace(part, layout=current)
        return LocalCheckpoint(self.target.path(part.step), part)

    def _sizes(self, step: int | None, at_least: int | None) -> dict[int, LocalSizes]:
        """Local: per committed local step (or only ``step``; not older than ``at_least``) the
        size of this rank's file and of its manifest shard, as this job would name them."""
        shard = None
        if self.comms.shard is not None and self.comms.shard.rank == 0:
            shard = filenames.shard_name(self.comms.shard_index)
        out: dict[int, LocalSizes] = {}
        for s in self.target.steps():
            if (step is not None and s != step) or (at_least is not None and s < at_least):
                continue
            name = self.comms.file_name
            found = self.target.stat(s, name)
            held = None if shard is None else self.target.stat(s, shard)
            out[s] = LocalSizes(
                name, None if found is None else found.size,
                shard, None if held is None else held.size,
            )  # fmt: skip
        return out

    def _pick(
        self, found: Sequence[dict[int, LocalSizes]], current: Layout
    ) -> list[Manifest | None]:
        """Coordinator: the newest step every rank found intact, as each rank's part (the whole
        index for the coordinator), or ``None`` for every rank (and why, logged)."""
        common = set(found[0]).intersection(*found[1:])
        note = ""
        for s in sorted(common, reverse=True):
            try:
                manifest = self.target.manifest(s)
            except InvalidCheckpointError as exc:
                log.warning("local checkpoint %s is not usable: %s", exc.path, exc.reason)
                continue
            if manifest.layout != current:
                note = note or (
                    f"the node-local checkpoints (newest step {s}) were written by "
                    f"{_per_node(manifest.layout)}, this job has {_per_node(current)}: "
                    "they cannot be read as they are (keep the ranks per node the same, "
                    "e.g. sbatch --ntasks-per-node); trying an elastic restore from them"
                )
                continue
            if not _complete(manifest, [f[s] for f in found]):
                continue
            needed = self._needed()
            parts: list[Manifest | None] = list(
                manifest.parts(needed, layout=Layout(current.kind, current.nranks, ()))
            )
            parts[0] = manifest
            return parts
        if note:
            log.warning("%s", note)
        return [None] * len(found)

    def _needed(self) -> list[tuple[int, ...]]:
        """The ranks whose entries (or, sharded, shards and files) each rank needs: its own; a
        file's first rank its file's (the skeleton its next save reuses); a node's first rank
        its node's (the files its partner copy sends)."""
        needed: list[set[int]] = [{r} for r in range(len(self.views))]
        for group in self.comms.groups:
            needed[group[0]].update(group)
        for r, view in enumerate(self.views):
            needed[view.leader].add(r)
        return [tuple(sorted(n)) for n in needed]

    def discard(self, checkpoint: LocalCheckpoint, reason: str) -> None:
        """Local: this node's leader quarantines its copy of a checkpoint that failed a restore."""
        if not self.is_node_leader:
            return
        try:
            self.target.quarantine(checkpoint.manifest.step, reason)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", checkpoint.path, exc)

    def listing(self) -> list[tuple[str, str, Path]]:
        """``(node, host, local root)`` of every node (the shared root's record of its tiers)."""
        shared = self.root.name
        return sorted({(v.label, v.host, Path(v.node_dir) / shared) for v in self.views})


@dataclass(frozen=True, slots=True)
class LocalSizes:
    """What one rank finds of a committed local step: its file's name and size, and on a
    manifest shard's first rank the shard's (``None``: absent)."""

    file: str
    size: int | None
    shard: str | None
    shard_size: int | None


def _complete(manifest: Manifest, found: Sequence[LocalSizes]) -> bool:
    """Whether every rank's file (``found``, by rank) and every manifest shard are in the
    node-local copies with the sizes the manifest says."""
    files = {f.name: f for f in manifest.files}
    sharded = manifest.sharded
    for rank, sizes in enumerate(found):
        file = files.get(sizes.file)
        if file is None or rank not in file.ranks or sizes.size != file.size:
            return False
    if sharded is None:
        return True
    present = {f.shard: f.shard_size for f in found if f.shard is not None}
    return all(present.get(s.name) == s.size for s in sharded.shards)


def _per_node(layout: Layout) -> str:
    """``4 ranks on 2 nodes (2 + 2)`` for a layout of a file per node; else its files (a
    layout records files, not nodes): ``4 ranks in 4 files of checkpoint_comm='self'``."""
    if layout.kind != "node":
        return (
            f"{layout.nranks} ranks in {len(layout.groups)} files of "
            f"checkpoint_comm={layout.kind!r}"
        )
    sizes = " + ".join(str(len(g)) for g in layout.groups)
    return f"{layout.nranks} ranks on {len(layout.groups)} nodes ({sizes})"


def record_local_tiers(shared_root: Path, tiers: Sequence[tuple[str, str, Path]]) -> None:
    """Add ``(node, host, local root)`` entries to the shared root's record (``resilient ls``)."""
    known = set(_read_tiers(shared_root))
    new = known | {(n, h, str(p)) for n, h, p in tiers}
    if new != known:
        doc = [{"node": n, "host": h, "path": p} for n, h, p in sorted(new)]
        storage.replace_file(
            shared_root / filenames.LOCAL_TIERS, json.dumps(doc, indent=1).encode()
        )


def known_local_roots(shared_root: Path, *, node: str | None = None) -> list[Path]:
    """The local roots recorded for ``shared_root`` on ``node``: by default this process's
    node (:func:`~resilient.parallel.nodes.node_label`) or host."""
    here = {node} if node is not None else {node_label(), socket.gethostname()}
    return [Path(p) for n, h, p in _read_tiers(shared_root) if n in here or h in here]


def _read_tiers(shared_root: Path) -> list[tuple[str, str, str]]:
    """``(node, host, path)`` entries (records written before nodes had names: node = host)."""
    try:
        doc = json.loads((shared_root / filenames.LOCAL_TIERS).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(doc, list):
        return []
    return [
        (d["node"] if isinstance(d.get("node"), str) else d["host"], d["host"], d["path"])
        for d in doc
        if isinstance(d, dict) and isinstance(d.get("host"), str) and isinstance(d.get("path"), str)
    ]
