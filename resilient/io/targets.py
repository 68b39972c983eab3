"""Storage targets: where checkpoints live, as a few primitives every copy of a step goes through.

A target holds committed steps, each a set of named files (the data files, the manifest and the
``COMMITTED`` marker). :class:`DirectoryTarget` is a directory on a filesystem: the shared root,
a node's local tier (:mod:`resilient.checkpoint.tiers`), and the partner copies a node keeps of
another node's files (:meth:`DirectoryTarget.child`, filled over a channel by
:mod:`resilient.io.wire`). :class:`MemoryTarget` keeps them in a dictionary, for tests. Every
implementation passes one conformance suite (``tests/unit/test_targets.py``).

Call order of one step (DCP's ``StorageWriter``; one writer, usually a node's first rank)::

    target.clean_up()                            # once: drop what crashes left
    pending = target.pending(step, token=token)  # pure: names only (every rank may call it)
    target.create(pending)                       # the step's pending place; readers ignore it
                                                 # (shared=True: every rank of a node may)
    target.write(pending, name, data)            # small files, each durable
    target.create_file(pending, name)            # a data file, empty, by its group's leader
    target.write_data(pending, name, ...)        # its arrays at their offsets (and,
                                                 # on its group's leader, HDF5's own bytes)
    w = target.open_writer(pending, name, ...)   # or any file by byte ranges (copies, moves,
    w.write(view, pos); w.close(sync=True)       # transfers between nodes)
    target.commit(pending, manifest, what=...)   # manifest + marker durable, then visible
    # or, on any failure:
    target.rollback(pending)

Readers: :meth:`~Target.steps` lists the committed steps; :meth:`~Target.manifest`,
:meth:`~Target.size`, :meth:`~Target.read` and :meth:`~Target.open_reader` (byte ranges) look
into one. :meth:`~Target.copy` and :meth:`~Target.link` bring a committed file of another
target into a pending copy (the one copy loop: :func:`resilient.io.fileio.pump`).
:meth:`~Target.remove` and :meth:`~Target.quarantine` take a step out of the listing
atomically. A target holds targets of its own (:meth:`~Target.child`: partner copies, the
staged copies of an elastic restore).

A restore reads a rank's data file through :meth:`~Target.open_reader`
(:mod:`resilient.checkpoint.reading`): a reader's ``readv`` fills many arrays in one call (a
directory's: one ``preadv``). Capability of :class:`DirectoryTarget` alone:
:meth:`DirectoryTarget.path`, the directory of a committed step, for what opens data files by
name (the elastic restore, :mod:`~resilient.checkpoint.elastic`; the catalog's validation; the
recycling of a dropped step's files).

What a crash between two calls leaves:

* after ``create`` or during ``write``: a pending step (a torn file in it, perhaps), never
  listed; the next ``clean_up`` removes it (a directory: ``step_*.tmp-*``; memory: nothing).
* during ``commit``: the manifest and marker are written and made durable in the pending step,
  then the step appears under its name in one rename: either the previous state or the whole
  new step (a re-commit of a step keeps the old copy until the new one replaces it).
* during ``remove``: the step is gone from the listing (renamed to ``.trash-*`` first); the
  next ``clean_up`` deletes the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from resilient.errors import CheckpointLockedError, InvalidCheckpointError
from resilient.io import fileio, logs, storage
from resilient.io.checkpoints import check_manifest, load_manifest, marker_text
from resilient.io.commit import PendingDir
from resilient.io.wire import CHUNK, new_hash
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json
from resilient.model.manifest import Manifest

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["DirectoryTarget", "MemoryTarget", "RootHold", "Target", "copy_file"]


class Target(Protocol):
    """Where checkpoints live: committed steps of named files (see the module for the order
    of calls and what a crash between two leaves). Local: no call communicates."""

    def clean_up(self) -> None:
        """Remove what crashes left (pending steps, trash); a missing target stays missing
        (:meth:`create` makes it)."""
        ...

    def steps(self) -> list[int]:
        """The committed steps, in no particular order (a missing target holds none)."""
        ...

    def pending(self, step: int, *, token: str | None = None) -> PendingDir:
        """The names of a new pending copy of ``step`` (no I/O; ``token`` makes the
        temporary name, the same on every rank that passes the same one)."""
        ...

    def create(self, pending: PendingDir, *, shared: bool = False) -> None:
        """Create the pending copy, empty. ``shared``: several writers create it (the ranks of
        one node, each with the same token): the one that comes second finds it made."""
        ...

    def write(self, pending: PendingDir, name: str, data: bytes) -> None:
        """Write the new file ``name`` of the pending copy, durably.

        Raises:
            OSError: with the errno of the failure (ENOSPC: the target is full); the file may
                be torn, the pending copy is never listed.
        """
        ...

    def create_file(self, pending: PendingDir, name: str) -> None:
        """Create the data file ``name`` of the pending copy, empty (its group's writers fill
        it with :meth:`write_data`).

        Raises:
            FileExistsError: ``name`` exists (a second writer of one pending copy).
        """
        ...

    def write_data(
        self,
        pending: PendingDir,
        name: str,
        offsets: Sequence[int | None],
        arrays: Sequence[npt.NDArray[np.generic]],
        *,
        skeleton: Callable[[], fileio.FileSkeleton] | None = None,
        idle: Callable[[], None] | None = None,
        bounce: fileio.Bounce | None = None,
        sync: bool = True,
    ) -> None:
        """Write each array's bytes at its offset of the data file ``name`` of the pending
        copy, created if missing and never truncated (the ranks of a group fill one file); the
        group's leader passes ``skeleton`` (HDF5's own bytes and the file's size, written after
        the data); durable unless ``sync`` is false (then :meth:`sync_data` must follow). See
        :func:`resilient.io.fileio.write_file` for ``idle`` and ``bounce``.

        Raises:
            OSError: with the errno of the failure.
        """
        ...

    def sync_data(self, pending: PendingDir, name: str) -> None:
        """Make the data file ``name`` of the pending copy durable (after
        ``write_data(..., sync=False)``)."""
        ...

    def open_writer(
        self, pending: PendingDir, name: str, *, direct: bool = False, exclusive: bool = True
    ) -> fileio.RangeWriter:
        """The file ``name`` of the pending copy, to write by byte ranges: new (``exclusive``),
        or created if missing and never truncated. ``direct``: large aligned pieces may bypass
        a cache (``O_DIRECT``).

        Raises:
            OSError: ``name`` exists (``exclusive``), or it cannot be created.
        """
        ...

    def copy(self, pending: PendingDir, name: str, source: Target, step: int) -> str:
        """Copy the file ``name`` of ``source``'s committed ``step`` as ``name`` of the pending
        copy, durably; returns the xxh3-128 digest of the bytes copied
        (:func:`resilient.io.wire.new_hash`).

        Raises:
            OSError: the source is unreadable, ``name`` exists, or the write failed.
        """
        ...

    def link(self, pending: PendingDir, name: str, source: Target, step: int) -> None:
        """The file ``name`` of ``source``'s committed ``step`` as ``name`` of the pending copy,
        durably: shared where the storage allows it (a hard link), else copied."""
        ...

    def commit(self, pending: PendingDir, manifest: Manifest, *, what: str) -> None:
        """Write the manifest and marker, make them durable, then list the step at once.

        Raises:
            CommitError: nothing was listed (the pending copy is left to :meth:`rollback`).
        """
        ...

    def rollback(self, pending: PendingDir) -> None:
        """Remove the pending copy (best effort)."""
        ...

    def manifest(self, step: int) -> Manifest:
        """The manifest of a committed step, checked against its marker.

        Raises:
            InvalidCheckpointError: with the reason.
        """
        ...

    def size(self, step: int, name: str) -> int | None:
        """The size of the file ``name`` of a committed step (``None``: it is not there)."""
        ...

    def read(self, step: int, name: str) -> bytes:
        """The bytes of the file ``name`` of a committed step.

        Raises:
            FileNotFoundError: no such step or file.
        """
        ...

    def open_reader(self, step: int, name: str) -> fileio.RangeReader:
        """The file ``name`` of a committed step, to read by byte ranges.

        Raises:
            OSError: no such step or file (a symlink is not followed).
        """
        ...

    def where(self, step: int) -> str:
        """Where the committed ``step`` lives, for messages (a directory's path)."""
        ...

    def remove(self, step: int) -> None:
        """Take a committed step out of the listing at once, then delete it."""
        ...

    def quarantine(self, step: int, reason: str) -> None:
        """Take a committed step out of the listing, kept aside with ``reason``."""
        ...

    def names(self) -> list[str]:
        """The names of the entries of the target (steps, pending copies, trash, children;
        none if it is missing)."""
        ...

    def child(self, name: str) -> Target:
        """The target kept under ``name`` in this one (made by its first :meth:`create`)."""
        ...

    def children(self) -> list[Target]:
        """The targets kept in this one, by name (symlinks not followed)."""
        ...

    def drop(self) -> None:
        """Remove the whole target, children included."""
        ...

    # the root's own files: its marker, lock, run key and logs (a checkpoint root's target)

    def prepare_root(self) -> None:
        """Make the target a checkpoint root if it is none yet (under the lock's owner, before
        :meth:`lock`).

        Raises:
            ConfigError: it holds something else (a directory: not empty and no marker).
        """
        ...

    def lock(self, owner: Mapping[str, str] | None = None) -> RootHold:
        """Take the root's exclusive lock at once (never waits), held until
        :meth:`RootHold.release`; ``owner``: facts for the error a second holder gets.

        Raises:
            CheckpointLockedError: another holder has it.
        """
        ...

    def read_root(self, name: str) -> bytes | None:
        """The bytes of the root's small file ``name`` (``None``: there is none).

        Raises:
            OSError: it cannot be read.
        """
        ...

    def replace_root(self, name: str, data: bytes) -> None:
        """Replace (or create) the root's small file ``name`` with ``data`` at once, durably: a
        reader sees the old bytes or the new ones."""
        ...

    def append_record(self, name: str, record: Mapping[str, Any]) -> None:
        """Append ``record`` to the root's log ``name`` as one JSON line, best effort (a
        failure is one warning per log and process: a log never fails a save)."""
        ...

    def read_log(self, name: str, kind: logs.LogKind) -> list[dict[str, Any]]:
        """The valid records of the root's log ``name`` in order; never raises (see
        :func:`resilient.io.logs.parse_log`)."""
        ...


class RootHold(Protocol):
    """A root's lock, held (:meth:`Target.lock`)."""

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class DirectoryTarget:
    """A directory of step directories (:mod:`resilient.model.filenames`), committed with
    :class:`~resilient.io.commit.PendingDir`: the shared root, a node-local tier, a partner
    copy.

    Attributes:
        root: the directory.
    """

    root: Path

    def __str__(self) -> str:
        return str(self.root)

    def clean_up(self) -> None:
        """See :meth:`Target.clean_up`."""
        if self.root.is_dir() and not self.root.is_symlink():
            storage.cleanup_leftovers(self.root)

    def steps(self) -> list[int]:
        """See :meth:`Target.steps`."""
        return [s for s in map(filenames.parse_step_dir, self.names()) if s is not None]

    def names(self) -> list[str]:
        """See :meth:`Target.names` (the entries of :attr:`root`)."""
        return storage.names_in(self.root)

    def path(self, step: int) -> Path:
        """The directory of the committed ``step``: this target's capability for what opens
        data files by name (see the module)."""
        return self.root / filenames.step_dir_name(step)

    def where(self, step: int) -> str:
        """See :meth:`Target.where`."""
        return str(self.path(step))

    def child(self, name: str) -> DirectoryTarget:
        """See :meth:`Target.child` (the subdirectory ``name``)."""
        return DirectoryTarget(self.root / name)

    def children(self) -> list[Target]:
        """See :meth:`Target.children` (the subdirectories)."""
        if self.root.is_symlink():
            return []
        subs = [self.root / n for n in sorted(self.names())]
        return [DirectoryTarget(p) for p in subs if p.is_dir() and not p.is_symlink()]

    def drop(self) -> None:
        """See :meth:`Target.drop` (renamed to trash first)."""
        storage.remove_tree(self.root)

    def pending(self, step: int, *, token: str | None = None) -> PendingDir:
        """See :meth:`Target.pending`."""
        return PendingDir.for_step(self.root, step, token=token)

    def create(self, pending: PendingDir, *, shared: bool = False) -> None:
        """See :meth:`Target.create` (creates :attr:`root` too, if missing)."""
        self.root.mkdir(parents=True, exist_ok=True)
        pending.create(shared=shared)

    def write(self, pending: PendingDir, name: str, data: bytes) -> None:
        """See :meth:`Target.write`."""
        storage.write_durable(pending.path / name, data)

    def commit(self, pending: PendingDir, manifest: Manifest, *, what: str) -> None:
        """See :meth:`Target.commit`."""
        pending.commit(manifest, what=what)

    def write_data(
        self,
        pending: PendingDir,
        name: str,
        offsets: Sequence[int | None],
        arrays: Sequence[npt.NDArray[np.generic]],
        *,
        skeleton: Callable[[], fileio.FileSkeleton] | None = None,
        idle: Callable[[], None] | None = None,
        bounce: fileio.Bounce | None = None,
        sync: bool = True,
    ) -> None:
        """See :meth:`Target.write_data` (:func:`resilient.io.fileio.write_file`: ``pwrite``,
        ``O_DIRECT`` for large arrays, fsync)."""
        fileio.write_file(
            pending.path / name, offsets, arrays, skeleton=skeleton, idle=idle, bounce=bounce,
            sync=sync,
        )  # fmt: skip

    def sync_data(self, pending: PendingDir, name: str) -> None:
        """See :meth:`Target.sync_data`."""
        fileio.fsync_file(pending.path / name)

    def create_file(self, pending: PendingDir, name: str) -> None:
        """See :meth:`Target.create_file`."""
        fileio.create_file(pending.path / name)

    def open_writer(
        self, pending: PendingDir, name: str, *, direct: bool = False, exclusive: bool = True
    ) -> fileio.RangeWriter:
        """See :meth:`Target.open_writer` (:class:`resilient.io.fileio.FileWriter`)."""
        return fileio.FileWriter(pending.path / name, direct=direct, exclusive=exclusive)

    def open_reader(self, step: int, name: str) -> fileio.RangeReader:
        """See :meth:`Target.open_reader` (:class:`resilient.io.fileio.FileReader`)."""
        return fileio.FileReader(self.path(step) / name)

    def copy(self, pending: PendingDir, name: str, source: Target, step: int) -> str:
        """See :meth:`Target.copy`."""
        return copy_file(source, step, name, self, pending)

    def link(self, pending: PendingDir, name: str, source: Target, step: int) -> None:
        """See :meth:`Target.link`: a hard link when ``source`` is a directory on this
        filesystem (no bytes moved), else a copy."""
        if isinstance(source, DirectoryTarget):
            try:
                os.link(source.path(step) / name, pending.path / name)
                return
            except OSError:
                pass
        copy_file(source, step, name, self, pending)

    def rollback(self, pending: PendingDir) -> None:
        """See :meth:`Target.rollback`."""
        pending.rollback()

    def manifest(self, step: int) -> Manifest:
        """See :meth:`Target.manifest`."""
        return load_manifest(self.path(step))

    def size(self, step: int, name: str) -> int | None:
        """See :meth:`Target.size` (a symlink is not followed)."""
        try:
            return (self.path(step) / name).lstat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read(self, step: int, name: str) -> bytes:
        """See :meth:`Target.read`."""
        return (self.path(step) / name).read_bytes()

    def remove(self, step: int) -> None:
        """See :meth:`Target.remove`."""
        storage.remove_tree(self.path(step))

    def quarantine(self, step: int, reason: str) -> None:
        """See :meth:`Target.quarantine` (renamed, with the reason written beside)."""
        storage.quarantine(self.path(step), step, reason)

    def prepare_root(self) -> None:
        """See :meth:`Target.prepare_root` (:func:`resilient.io.storage.ensure_root`: the
        directory created, both copies of its marker written)."""
        storage.ensure_root(self.root)

    def lock(self, owner: Mapping[str, str] | None = None) -> RootHold:
        """See :meth:`Target.lock` (:class:`resilient.io.storage.RootLock`: ``flock``)."""
        held = storage.RootLock(self.root, owner=owner)
        held.acquire()
        return held

    def read_root(self, name: str) -> bytes | None:
        """See :meth:`Target.read_root`."""
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def replace_root(self, name: str, data: bytes) -> None:
        """See :meth:`Target.replace_root` (written under a hidden name, renamed over it,
        the directory fsynced)."""
        storage.replace_file(self.root / name, data)
        storage.fsync_dir(self.root)

    def append_record(self, name: str, record: Mapping[str, Any]) -> None:
        """See :meth:`Target.append_record` (:func:`resilient.io.logs.append_record`)."""
        logs.append_record(self.root / name, record)

    def read_log(self, name: str, kind: logs.LogKind) -> list[dict[str, Any]]:
        """See :meth:`Target.read_log` (:func:`resilient.io.logs.read_log`)."""
        return logs.read_log(self.root / name, kind)


@dataclass(slots=True)
class MemoryTarget:
    """A target in a dictionary: directory name -> file name -> bytes (tests, no disk).

    A rename of a key stands for the directory target's rename, so the two list, commit and
    crash alike; what a crash leaves is lost with the process. A file written by ranges is
    published at each :meth:`~resilient.io.fileio.RangeWriter.close` of one of its writers.
    """

    dirs: dict[str, dict[str, bytes]] = field(default_factory=dict)
    subs: dict[str, MemoryTarget] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # the root's own small files
    _growing: dict[tuple[str, str], bytearray] = field(default_factory=dict, repr=False)
    _held: list[_MemoryHold] = field(default_factory=list, repr=False)

    def names(self) -> list[str]:
        """See :meth:`Target.names` (children that hold nothing are not listed)."""
        return [*self.dirs, *self.files, *(n for n, sub in self.subs.items() if sub.names())]

    def child(self, name: str) -> MemoryTarget:
        """See :meth:`Target.child`."""
        return self.subs.setdefault(name, MemoryTarget())

    def children(self) -> list[Target]:
        """See :meth:`Target.children`."""
        return [self.subs[n] for n in sorted(self.subs) if self.subs[n].names()]

    def drop(self) -> None:
        """See :meth:`Target.drop`."""
        self.dirs.clear()
        self.subs.clear()
        self.files.clear()
        self._growing.clear()

    def prepare_root(self) -> None:
        """See :meth:`Target.prepare_root` (nothing: a dictionary holds nothing foreign)."""

    def lock(self, owner: Mapping[str, str] | None = None) -> RootHold:
        """See :meth:`Target.lock`: a lock of this process (the dictionary is this process's
        alone); a second holder is refused until the first releases it."""
        if any(not h.released for h in self._held):
            holder = json.dumps(self._held[-1].owner)
            raise CheckpointLockedError(
                f"{self} is in use by another job ({holder}); two jobs must not write one "
                "checkpoint root"
            )
        held = _MemoryHold({"pid": os.getpid(), **(owner or {})})
        self._held[:] = [held]
        return held

    def read_root(self, name: str) -> bytes | None:
        """See :meth:`Target.read_root`."""
        return self.files.get(name)

    def replace_root(self, name: str, data: bytes) -> None:
        """See :meth:`Target.replace_root`."""
        self.files[name] = bytes(data)

    def append_record(self, name: str, record: Mapping[str, Any]) -> None:
        """See :meth:`Target.append_record`."""
        old = self.files.get(name, b"")
        torn = b"\n" if old and not old.endswith(b"\n") else b""
        self.files[name] = old + torn + logs.record_line(record)

    def read_log(self, name: str, kind: logs.LogKind) -> list[dict[str, Any]]:
        """See :meth:`Target.read_log`."""
        return logs.parse_log(self.files.get(name, b""), kind, where=f"memory:{name}")

    def where(self, step: int) -> str:
        """See :meth:`Target.where`."""
        return f"memory:{filenames.step_dir_name(step)}"

    def __str__(self) -> str:
        return "memory"

    def clean_up(self) -> None:
        """See :meth:`Target.clean_up`."""
        for name in [n for n in self.dirs if filenames.parse_tmp_dir(n) is not None]:
            del self.dirs[name]
        self._growing.clear()

    def steps(self) -> list[int]:
        """See :meth:`Target.steps`."""
        return [s for s in map(filenames.parse_step_dir, self.dirs) if s is not None]

    def pending(self, step: int, *, token: str | None = None) -> PendingDir:
        """See :meth:`Target.pending` (the paths only name keys)."""
        return PendingDir.for_step(Path("/memory"), step, token=token)

    def create(self, pending: PendingDir, *, shared: bool = False) -> None:
        """See :meth:`Target.create`."""
        if pending.path.name in self.dirs:
            if shared:
                return
            raise FileExistsError(str(pending.path))
        self.dirs[pending.path.name] = {}

    def write(self, pending: PendingDir, name: str, data: bytes) -> None:
        """See :meth:`Target.write`."""
        files = self._pending(pending)
        if name in files:
            raise FileExistsError(str(pending.path / name))
        files[name] = bytes(data)

    def write_data(
        self,
        pending: PendingDir,
        name: str,
        offsets: Sequence[int | None],
        arrays: Sequence[npt.NDArray[np.generic]],
        *,
        skeleton: Callable[[], fileio.FileSkeleton] | None = None,
        idle: Callable[[], None] | None = None,
        bounce: fileio.Bounce | None = None,
        sync: bool = True,
    ) -> None:
        """See :meth:`Target.write_data`."""
        out = self.open_writer(pending, name, exclusive=False)
        try:
            for offset, arr in zip(offsets, arrays, strict=True):
                if offset is not None:
                    out.write(arr.data.cast("B"), offset)
                if idle is not None:
                    idle()
            if skeleton is not None:
                built = skeleton()
                out.resize(built.size)
                for offset, data in built.meta_bytes:
                    out.write(memoryview(data), offset)
        finally:
            out.close(sync=sync)

    def create_file(self, pending: PendingDir, name: str) -> None:
        """See :meth:`Target.create_file`."""
        self.open_writer(pending, name).close(sync=False)

    def sync_data(self, pending: PendingDir, name: str) -> None:
        """See :meth:`Target.sync_data` (nothing to do)."""
        if name not in self._pending(pending):
            raise FileNotFoundError(str(pending.path / name))

    def open_writer(
        self, pending: PendingDir, name: str, *, direct: bool = False, exclusive: bool = True
    ) -> fileio.RangeWriter:
        """See :meth:`Target.open_writer`."""
        files = self._pending(pending)
        key = (pending.path.name, name)
        if exclusive and (name in files or key in self._growing):
            raise FileExistsError(str(pending.path / name))
        buf = self._growing.setdefault(key, bytearray(files.get(name, b"")))
        files[name] = bytes(buf)
        return _MemoryWriter(files, name, buf)

    def open_reader(self, step: int, name: str) -> fileio.RangeReader:
        """See :meth:`Target.open_reader`."""
        return _MemoryReader(self.read(step, name))

    def copy(self, pending: PendingDir, name: str, source: Target, step: int) -> str:
        """See :meth:`Target.copy`."""
        return copy_file(source, step, name, self, pending)

    def link(self, pending: PendingDir, name: str, source: Target, step: int) -> None:
        """See :meth:`Target.link` (the bytes are shared: they never change)."""
        if source is self:
            files = self._pending(pending)
            if name in files:
                raise FileExistsError(str(pending.path / name))
            files[name] = self.read(step, name)
            return
        copy_file(source, step, name, self, pending)

    def commit(self, pending: PendingDir, manifest: Manifest, *, what: str) -> None:
        """See :meth:`Target.commit`."""
        files = self._pending(pending)
        text = manifest_json(manifest).encode()
        files[filenames.MANIFEST] = text
        files[filenames.COMMITTED] = marker_text(manifest.step, digest_bytes(text)).encode()
        self._forget(pending)
        self.dirs[pending.final.name] = self.dirs.pop(pending.path.name)

    def rollback(self, pending: PendingDir) -> None:
        """See :meth:`Target.rollback`."""
        self._forget(pending)
        self.dirs.pop(pending.path.name, None)

    def _forget(self, pending: PendingDir) -> None:
        for key in [k for k in self._growing if k[0] == pending.path.name]:
            del self._growing[key]

    def manifest(self, step: int) -> Manifest:
        """See :meth:`Target.manifest` (:func:`resilient.io.checkpoints.check_manifest`)."""
        where = self.where(step)
        files = self.dirs.get(filenames.step_dir_name(step))
        if files is None:
            raise InvalidCheckpointError(where, "does not exist")
        return check_manifest(
            where, files.get(filenames.COMMITTED), lambda: files.get(filenames.MANIFEST)
        )

    def size(self, step: int, name: str) -> int | None:
        """See :meth:`Target.size`."""
        data = self.dirs.get(filenames.step_dir_name(step), {}).get(name)
        return None if data is None else len(data)

    def read(self, step: int, name: str) -> bytes:
        """See :meth:`Target.read`."""
        try:
            return self.dirs[filenames.step_dir_name(step)][name]
        except KeyError:
            raise FileNotFoundError(f"memory:{filenames.step_dir_name(step)}/{name}") from None

    def remove(self, step: int) -> None:
        """See :meth:`Target.remove`."""
        self.dirs.pop(filenames.step_dir_name(step), None)

    def quarantine(self, step: int, reason: str) -> None:
        """See :meth:`Target.quarantine`."""
        files = self.dirs.pop(filenames.step_dir_name(step))
        files[filenames.QUARANTINE_INFO] = json.dumps({"step": step, "reason": reason}).encode()
        self.dirs[filenames.quarantine_dir_name(step, storage.new_token())] = files

    def _pending(self, pending: PendingDir) -> dict[str, bytes]:
        try:
            return self.dirs[pending.path.name]
        except KeyError:
            raise FileNotFoundError(str(pending.path)) from None


@dataclass(slots=True)
class _MemoryHold:
    owner: dict[str, object]
    released: bool = False

    def release(self) -> None:
        self.released = True


@dataclass(slots=True)
class _MemoryReader:
    data: bytes

    def read(self, view: memoryview, pos: int) -> None:
        if pos + len(view) > len(self.data):
            raise EOFError(f"the file ends at byte {max(pos, len(self.data))}")
        view[:] = self.data[pos : pos + len(view)]

    def readv(self, buffers: list[memoryview | npt.NDArray[Any]], pos: int) -> int:
        start = pos
        for buffer in buffers:
            view = memoryview(buffer).cast("B")  # type: ignore[arg-type]  # numpy: a buffer
            n = max(0, min(len(view), len(self.data) - pos))
            view[:n] = self.data[pos : pos + n]
            pos += n
            if n < len(view):
                break
        return pos - start

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _MemoryWriter:
    files: dict[str, bytes]
    name: str
    buf: bytearray

    def write(self, view: memoryview, pos: int) -> None:
        end = pos + len(view)
        if end > len(self.buf):
            self.buf.extend(bytes(end - len(self.buf)))
        self.buf[pos:end] = view

    def resize(self, size: int) -> None:
        if size < len(self.buf):
            del self.buf[size:]
        else:
            self.buf.extend(bytes(size - len(self.buf)))

    def close(self, *, sync: bool) -> None:
        self.files[self.name] = bytes(self.buf)


def copy_file(source: Target, step: int, name: str, dest: Target, pending: PendingDir) -> str:
    """Copy the file ``name`` of ``source``'s committed ``step`` as ``name`` of ``dest``'s
    pending copy, durably, through the one copy loop (:func:`resilient.io.fileio.pump`);
    returns the xxh3-128 digest of its bytes. What :meth:`Target.copy` does, for every target.

    Raises:
        OSError: the source is unreadable, ``name`` exists, or the write failed.
    """
    size = source.size(step, name)
    if size is None:
        raise FileNotFoundError(f"{source.where(step)}/{name}")
    h = new_hash()
    reader = source.open_reader(step, name)
    try:
        writer = dest.open_writer(pending, name)
        try:
            with fileio.Bounce(min(CHUNK, max(size, 1))) as bounce, bounce.lend() as chunk:
                fileio.pump(reader, writer, chunk, 0, size, h)
        except EOFError as exc:
            writer.close(sync=False)
            raise OSError(f"{source.where(step)}/{name}: {exc}") from None
        except BaseException:
            writer.close(sync=False)
            raise
        writer.close(sync=True)
    finally:
        reader.close()
    digest: str = h.hexdigest()
    return digest
