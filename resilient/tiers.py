"""The node-local tier: checkpoints written on each node's fast storage, flushed to the shared root.

On every node, ``<local_dir>/<name of the shared root>-<hash of its path>/`` is a checkpoint
root of its own holding, per step, the data files of that node's ranks plus the manifest and
the ``COMMITTED`` marker (the same manifest the shared copy gets). Every file group must lie on
one node (``checkpoint_comm`` ``self`` or ``node``; ``world`` only on one node).

* A save goes to a pending directory on every node; each node's leader commits its copy with
  the usual protocol (:class:`~resilient.commit.PendingDir`).
* A flush copies a committed local checkpoint to the shared root: every rank copies its own
  datasets' bytes (the file's leader also HDF5's own bytes), hashing them as they are read, so a
  corrupt local copy is never flushed; then the coordinator commits the shared copy with the
  same manifest. A flush cut short is never visible.
* A step is restorable from the local tier only when every rank finds its file there (marker,
  manifest and file sizes check out, same layout): a job on other nodes finds nothing and uses
  the shared root.

SCR's cache plus flush (``SCR_FLUSH``), without SCR's C library and job scripts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from resilient import hdf5, layout, storage
from resilient.checksum import hash128
from resilient.collective import Collective
from resilient.comm import Comm
from resilient.commit import PendingDir
from resilient.errors import ConfigError, InvalidCheckpointError
from resilient.manifest import LayoutInfo, Manifest
from resilient.topology import Topology
from resilient.validate import load_manifest

__all__ = [
    "LocalCheckpoint",
    "LocalTier",
    "known_local_roots",
    "local_root_of",
    "record_local_tiers",
]

log = logging.getLogger(__name__)


def local_root_of(local_dir: str | os.PathLike[str], shared_root: Path) -> Path:
    """The local tier's root under ``local_dir`` for the shared root ``shared_root`` (pure)."""
    absolute = os.path.abspath(shared_root)
    return Path(local_dir) / f"{Path(absolute).name}-{hash128(absolute)[:12]}"


class LocalCheckpoint:
    """A local checkpoint every rank has: its directory (same path on every node) and manifest."""

    __slots__ = ("manifest", "path")

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest


class LocalTier:
    """The local tier of one manager. Construction is collective over ``topo.comm``.

    Args:
        local_dir: node-local storage (``$SLURM_TMPDIR``, NVMe, ``/dev/shm``).
        shared_root: the shared checkpoint root this tier caches.
        topo: who writes which file.
        keep: local checkpoints kept per node (the newest ones).

    Raises:
        ConfigError: a file group spans nodes, or ``keep`` < 1.
    """

    def __init__(
        self, local_dir: str | os.PathLike[str], shared_root: Path, topo: Topology, *, keep: int
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"local_keep must be a positive integer, got {keep!r}")
        self.root = local_root_of(local_dir, shared_root)
        self.topo = topo
        self.keep = keep
        self._coll = Collective(topo.comm)
        self.node: Comm = self._coll.check("grouping ranks by node", topo.comm.split_node)
        self.hosts: list[str] = topo.comm.allgather(socket.gethostname())
        self._coll.check("checking the local tier's layout", self._check_groups)
        self._coll.check(f"opening the local tier {self.root}", self._open)

    @property
    def is_node_leader(self) -> bool:
        """Whether this rank acts for its node (creates, commits and rotates its copies)."""
        return self.node.rank == 0

    def _check_groups(self) -> None:
        for group in self.topo.groups:
            hosts = {self.hosts[r] for r in group}
            if len(hosts) > 1:
                raise ConfigError(
                    f"local_dir needs every checkpoint file on one node, but checkpoint_comm="
                    f"{self.topo.kind!r} puts ranks of {sorted(hosts)[:3]} in one file: use "
                    "'self' or 'node'"
                )

    def _open(self) -> None:
        if self.is_node_leader:
            storage.ensure_root(self.root)
            storage.cleanup_leftovers(self.root)

    # ------------------------------------------------------------------ saving

    def create_pending(self, step: int) -> PendingDir:
        """Collective: name a temporary directory for ``step``; every node's leader creates it."""
        pending = self._coll.broadcast(
            "naming a local temporary directory", lambda: PendingDir.for_step(self.root, step)
        )

        def create() -> None:
            if self.is_node_leader:
                pending.create()

        self._coll.check(f"creating {pending.path} on every node", create)
        return pending

    def commit(self, pending: PendingDir, manifest: Manifest) -> None:
        """Collective: every node's leader commits its copy, then keeps the newest ``keep``."""

        def commit_here() -> None:
            if self.is_node_leader:
                pending.commit(manifest, what=f"local copy of step {manifest.step}")
                self._rotate()

        try:
            self._coll.check(f"committing the local copies of step {manifest.step}", commit_here)
        except Exception:
            self.rollback(pending)
            raise

    def rollback(self, pending: PendingDir) -> None:
        """Local: this node's leader removes its temporary directory (no communication)."""
        if self.is_node_leader:
            pending.rollback()

    def _rotate(self) -> None:
        steps = sorted(self._committed_steps(), reverse=True)
        for step in steps[self.keep :]:
            try:
                storage.remove_tree(self.root / layout.step_dir_name(step))
            except OSError as exc:
                log.warning("could not remove local checkpoint %d in %s: %s", step, self.root, exc)

    def _committed_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [s for s in map(layout.parse_step_dir, names) if s is not None]

    # ------------------------------------------------------------------ flushing

    def flush_job(self, checkpoint: LocalCheckpoint, shared: Path) -> Callable[[], None]:
        """This rank's part of copying ``checkpoint`` into the shared directory ``shared``.

        The returned function does no communication (it may run on a background thread); it
        raises :class:`InvalidCheckpointError` if a byte range does not match its checksum.
        """
        manifest, rank = checkpoint.manifest, self.topo.comm.rank
        entry = manifest.ranks[rank]
        file = next(f for f in manifest.files if f.name == entry.file)
        ranges: list[tuple[int, int, str, str]] = [
            (d.offset, d.nbytes, d.checksum, f"rank {rank} dataset {d.name!r}")
            for d in entry.datasets
            if d.offset is not None and d.nbytes
        ]
        leader = self.topo.group.rank == 0
        if leader:
            ranges += [
                (s.offset, s.length, s.checksum, "HDF5 metadata") for s in file.meta_segments
            ]
        src, dst = checkpoint.path / file.name, shared / file.name

        def copy() -> None:
            try:
                storage.retry_io(
                    lambda: hdf5.copy_ranges(src, dst, ranges, size=file.size if leader else None),
                    what=f"copying {src} to {dst}",
                )
            except (ValueError, EOFError) as exc:
                raise InvalidCheckpointError(str(checkpoint.path), str(exc)) from None

        return copy

    # ------------------------------------------------------------------ restoring

    def newest(self, current: LayoutInfo, *, step: int | None = None) -> LocalCheckpoint | None:
        """Collective: the newest step (or ``step``) every rank finds intact in its node's copy.

        Quick checks only (marker, manifest, this rank's file size, same layout); the restore
        verifies every checksum it reads.
        """
        mine = self._intact_steps(current, step)

        def pick(found: Sequence[Sequence[int]]) -> LocalCheckpoint | None:
            common = set(found[0]).intersection(*map(set, found[1:]))
            if not common:
                return None
            path = self.root / layout.step_dir_name(max(common))
            return LocalCheckpoint(path, load_manifest(path))

        return self._coll.all_reduce("finding local checkpoints", lambda: mine, pick)

    def _intact_steps(self, current: LayoutInfo, step: int | None) -> list[int]:
        """Steps whose local copy holds this rank's file intact (local: a few stats)."""
        rank, found = self.topo.comm.rank, []
        for s in sorted(self._committed_steps(), reverse=True):
            if step is not None and s != step:
                continue
            path = self.root / layout.step_dir_name(s)
            try:
                manifest = load_manifest(path)
            except InvalidCheckpointError as exc:
                log.warning("local checkpoint %s is not usable: %s", path, exc.reason)
                continue
            if manifest.layout != current or rank >= len(manifest.ranks):
                continue
            name = manifest.ranks[rank].file
            size = next((f.size for f in manifest.files if f.name == name), -1)
            try:
                if os.lstat(path / name).st_size == size:
                    found.append(s)
            except FileNotFoundError:
                continue
        return found

    def discard(self, checkpoint: LocalCheckpoint, reason: str) -> None:
        """Local: this node's leader quarantines its copy of a checkpoint that failed a restore."""
        if not self.is_node_leader:
            return
        try:
            storage.quarantine(checkpoint.path, checkpoint.manifest.step, reason)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", checkpoint.path, exc)

    def listing(self) -> list[tuple[str, Path]]:
        """``(host, local root)`` of every node (for the shared root's record of its tiers)."""
        return sorted({(self.hosts[r], self.root) for r in range(len(self.hosts))})


def record_local_tiers(shared_root: Path, tiers: Sequence[tuple[str, Path]]) -> None:
    """Add ``(host, local root)`` pairs to the shared root's record (for ``resilient ls``)."""
    known = set(_read_tiers(shared_root))
    new = known | {(h, str(p)) for h, p in tiers}
    if new != known:
        doc = [{"host": h, "path": p} for h, p in sorted(new)]
        tmp = shared_root / f".{layout.LOCAL_TIERS}.{storage.new_token()}"
        storage.write_durable(tmp, json.dumps(doc, indent=1).encode())
        os.replace(tmp, shared_root / layout.LOCAL_TIERS)


def known_local_roots(shared_root: Path, *, host: str | None = None) -> list[Path]:
    """The local roots recorded for ``shared_root`` on ``host`` (default: this host)."""
    here = socket.gethostname() if host is None else host
    return [Path(p) for h, p in _read_tiers(shared_root) if h == here]


def _read_tiers(shared_root: Path) -> list[tuple[str, str]]:
    try:
        doc = json.loads((shared_root / layout.LOCAL_TIERS).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(doc, list):
        return []
    return [
        (d["host"], d["path"])
        for d in doc
        if isinstance(d, dict) and isinstance(d.get("host"), str) and isinstance(d.get("path"), str)
    ]
