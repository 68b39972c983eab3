"""Storage targets: where checkpoints live, as a few primitives every copy of a step goes through.

A target holds committed sets, each of named files (the data files, the manifest and the
``COMMITTED`` marker), addressed by a :data:`SetKey`: a step, or a set's name (static data's two
copies, :func:`resilient.io.checkpoints.statics_of`; a quarantined step).
:class:`DirectoryTarget` is a directory on a filesystem: the shared root, a node's local tier
(:mod:`resilient.checkpoint.tiers`), and the partner copies a node keeps of another node's
files (:meth:`DirectoryTarget.child`, filled over a channel by :mod:`resilient.io.wire`).
:class:`MemoryTarget` keeps them in a dictionary, for tests. Every implementation passes one
conformance suite (``tests/unit/test_targets.py``).

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
:meth:`~Target.stat`, :meth:`~Target.file_names`, :meth:`~Target.read`,
:meth:`~Target.read_small` and :meth:`~Target.open_reader` (byte ranges) look into one (the
scan that validates them: :mod:`resilient.io.checkpoints`). :meth:`~Target.copy` and
:meth:`~Target.link` bring a committed file of another target into a pending copy (the one copy
loop: :func:`resilient.io.fileio.pump`); :meth:`~Target.publish` lists a pending copy filled so
(a repair). :meth:`~Target.remove`, :meth:`~Target.trash` (deleted later, its files perhaps
taken over by the next save: :meth:`~Target.reuse`) and :meth:`~Target.quarantine` take a set
out of the listing atomically. A target holds targets of its own (:meth:`~Target.child`: the
static data, partner copies, the staged copies of an elastic restore).

A restore reads a rank's data file through :meth:`~Target.open_reader`
(:mod:`resilient.checkpoint.reading`; :class:`SetRef`: a set of a target): a reader's ``readv``
fills many arrays in one call (a directory's: one ``preadv``). Capability of
:class:`DirectoryTarget` alone: :meth:`DirectoryTarget.path`, the directory of a committed set,
for what the node-local tier moves by path (partner copies sent between nodes, the staged
copies of an elastic restore, :mod:`resilient.checkpoint.tierstaging`).

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

import functools
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from resilient.errors import CheckpointLockedError, InvalidCheckpointError
from resilient.io import fileio, logs, storage
from resilient.io.commit import PendingDir
from resilient.io.manifests import (
    SetFiles,
    check_manifest,
    load_manifest,
    marker_text,
    read_small,
)
from resilient.io.storage import Trash
from resilient.io.wire import CHUNK, new_hash
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json
from resilient.model.manifest import Manifest
from resilient.model.tree import Memo

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

log = logging.getLogger(__name__)

__all__ = [
    "DirectoryTarget",
    "DirectoryTrash",
    "FileStat",
    "MemoryTarget",
    "RootHold",
    "SetKey",
    "SetRef",
    "Target",
    "as_target",
    "copy_file",
    "set_files",
]


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

    def pending(self, step: SetKey, *, token: str | None = None) -> PendingDir:
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

    def discard(self, pending: PendingDir, name: str) -> None:
        """Remove the file ``name`` of the pending copy if it is there (a torn one, before a
        retry of its write)."""
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

    def copy(self, pending: PendingDir, name: str, source: Target, step: SetKey) -> str:
        """Copy the file ``name`` of ``source``'s committed ``step`` as ``name`` of the pending
        copy, durably; returns the xxh3-128 digest of the bytes copied
        (:func:`resilient.io.wire.new_hash`).

        Raises:
            OSError: the source is unreadable, ``name`` exists, or the write failed.
        """
        ...

    def link(self, pending: PendingDir, name: str, source: Target, step: SetKey) -> None:
        """The file ``name`` of ``source``'s committed ``step`` as ``name`` of the pending copy,
        durably: shared where the storage allows it (a hard link), else copied."""
        ...

    def commit(
        self, pending: PendingDir, manifest: Manifest, *, what: str, copies: int | None = None
    ) -> None:
        """Write the manifest and marker, make them durable, then list the step at once
        (``copies``: static data's, recorded in the marker: :func:`~resilient.io.manifests.marker_text`).

        Raises:
            CommitError: nothing was listed (the pending copy is left to :meth:`rollback`).
        """
        ...

    def publish(self, pending: PendingDir, *, what: str) -> None:
        """List the pending copy under its final name as it is (its marker and manifest copied
        in already, each durable: a repair of static data), replacing a set of that name;
        what :meth:`commit` does once it has written them.

        Raises:
            CommitError: nothing was listed (the pending copy is left to :meth:`rollback`).
        """
        ...

    def rollback(self, pending: PendingDir) -> None:
        """Remove the pending copy (best effort)."""
        ...

    def manifest(
        self, step: SetKey, *, kind: str = "checkpoint", memo: Memo | None = None
    ) -> Manifest:
        """The manifest of a committed set of ``kind``, checked against its marker (``memo``:
        see :func:`~resilient.model.codec.parse_manifest`).

        Raises:
            InvalidCheckpointError: with the reason.
        """
        ...

    def stat(self, step: SetKey, name: str) -> FileStat | None:
        """The size of the file ``name`` of a committed set and whether it is a regular file
        (``None``: it is not there; a symlink is not followed)."""
        ...

    def file_names(self, step: SetKey) -> list[str]:
        """The names of the files of a committed set (none if it is missing)."""
        ...

    def read(self, step: SetKey, name: str) -> bytes:
        """The bytes of the file ``name`` of a committed set.

        Raises:
            FileNotFoundError: no such step or file.
        """
        ...

    def read_small(self, step: SetKey, name: str, limit: int) -> bytes | None:
        """The bytes of the small file ``name`` of a committed set (``None``: it is not
        there), read only if it is a regular file of at most ``limit`` bytes.

        Raises:
            InvalidCheckpointError: it is not a regular file, or larger than ``limit``.
        """
        ...

    def open_reader(self, step: SetKey, name: str) -> fileio.RangeReader:
        """The file ``name`` of a committed step, to read by byte ranges.

        Raises:
            OSError: no such step or file (a symlink is not followed).
        """
        ...

    def where(self, step: SetKey) -> str:
        """Where the committed ``step`` lives, for messages (a directory's path)."""
        ...

    def remove(self, step: SetKey) -> None:
        """Take a committed set out of the listing at once, then delete it."""
        ...

    def trash(self, step: SetKey, *, durable: bool = True) -> Trash:
        """Take a committed set out of the listing at once (``durable=False``: a crash may
        bring it back, for a rotation); what is left to delete, by its :meth:`~resilient.io.storage.Trash.delete`
        (e.g. on a background thread).

        Raises:
            FileNotFoundError: there is no such set.
        """
        ...

    def reuse(self, pending: PendingDir, names: Iterable[str], trash: Trash) -> frozenset[str]:
        """Move the files ``names`` of a trashed set into the pending copy, for a save to write
        over (a directory's: :func:`~resilient.io.fileio.claim_file`); the names it moved (a
        failure only costs the speed-up: a target that gains nothing moves none)."""
        ...

    def quarantine(self, step: int, reason: str) -> None:
        """Take a committed step out of the listing, kept aside with ``reason`` (one warning)."""
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


SetKey = int | str
"""A committed set of a target: a step (its entry ``step_00000012``), or a set by its entry's
name (static data's ``<hash>`` and ``<hash>.copy`` in the root's ``static`` child, a quarantined
step)."""


@dataclass(frozen=True, slots=True)
class FileStat:
    """A file of a committed set (:meth:`Target.stat`).

    Attributes:
        size: its size in bytes.
        regular: whether it is a regular file (not a directory, a symlink, a device).
    """

    size: int
    regular: bool


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

    def path(self, step: SetKey) -> Path:
        """The directory of the committed ``step``: this target's capability for what opens
        data files by name (see the module)."""
        return self.root / filenames.set_dir_name(step)

    def where(self, step: SetKey) -> str:
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

    def pending(self, step: SetKey, *, token: str | None = None) -> PendingDir:
        """See :meth:`Target.pending`."""
        return PendingDir.for_set(self.root, step, token=token)

    def create(self, pending: PendingDir, *, shared: bool = False) -> None:
        """See :meth:`Target.create` (creates :attr:`root` too, if missing)."""
        self.root.mkdir(parents=True, exist_ok=True)
        pending.create(shared=shared)

    def write(self, pending: PendingDir, name: str, data: bytes) -> None:
        """See :meth:`Target.write`."""
        storage.write_durable(pending.path / name, data)

    def commit(
        self, pending: PendingDir, manifest: Manifest, *, what: str, copies: int | None = None
    ) -> None:
        """See :meth:`Target.commit`."""
        pending.commit(manifest, what=what, copies=copies)

    def publish(self, pending: PendingDir, *, what: str) -> None:
        """See :meth:`Target.publish` (:meth:`~resilient.io.commit.PendingDir.publish`)."""
        pending.publish(what=what)

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

    def discard(self, pending: PendingDir, name: str) -> None:
        """See :meth:`Target.discard`."""
        storage.remove_file(pending.path / name)

    def open_writer(
        self, pending: PendingDir, name: str, *, direct: bool = False, exclusive: bool = True
    ) -> fileio.RangeWriter:
        """See :meth:`Target.open_writer` (:class:`resilient.io.fileio.FileWriter`)."""
        return fileio.FileWriter(pending.path / name, direct=direct, exclusive=exclusive)

    def open_reader(self, step: SetKey, name: str) -> fileio.RangeReader:
        """See :meth:`Target.open_reader` (:class:`resilient.io.fileio.FileReader`)."""
        return fileio.FileReader(self.path(step) / name)

    def copy(self, pending: PendingDir, name: str, source: Target, step: SetKey) -> str:
        """See :meth:`Target.copy`."""
        return copy_file(source, step, name, self, pending)

    def link(self, pending: PendingDir, name: str, source: Target, step: SetKey) -> None:
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

    def manifest(
        self, step: SetKey, *, kind: str = "checkpoint", memo: Memo | None = None
    ) -> Manifest:
        """See :meth:`Target.manifest` (:func:`resilient.io.manifests.load_manifest`)."""
        return load_manifest(self.path(step), kind=kind, memo=memo)

    def stat(self, step: SetKey, name: str) -> FileStat | None:
        """See :meth:`Target.stat` (``lstat``)."""
        try:
            st = (self.path(step) / name).lstat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return FileStat(st.st_size, stat.S_ISREG(st.st_mode))

    def file_names(self, step: SetKey) -> list[str]:
        """See :meth:`Target.file_names`."""
        return storage.names_in(self.path(step))

    def read(self, step: SetKey, name: str) -> bytes:
        """See :meth:`Target.read`."""
        return (self.path(step) / name).read_bytes()

    def read_small(self, step: SetKey, name: str, limit: int) -> bytes | None:
        """See :meth:`Target.read_small` (:func:`resilient.io.manifests.read_small`)."""
        try:
            return read_small(self.path(step) / name, limit)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def remove(self, step: SetKey) -> None:
        """See :meth:`Target.remove`."""
        storage.remove_tree(self.path(step))

    def trash(self, step: SetKey, *, durable: bool = True) -> DirectoryTrash:
        """See :meth:`Target.trash` (renamed to ``.trash-*``: :func:`resilient.io.storage.move_to_trash`)."""
        return DirectoryTrash(storage.move_to_trash(self.path(step), durable=durable))

    def reuse(self, pending: PendingDir, names: Iterable[str], trash: Trash) -> frozenset[str]:
        """See :meth:`Target.reuse` (a trashed directory of this filesystem's files only)."""
        if not isinstance(trash, DirectoryTrash):
            return frozenset()
        return frozenset(n for n in names if _claimed(trash.path / n, pending.path / n))

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


@dataclass(frozen=True, slots=True)
class DirectoryTrash:
    """A directory renamed to trash (:meth:`DirectoryTarget.trash`).

    Attributes:
        path: its trash name.
    """

    path: Path

    def delete(self) -> None:
        """See :meth:`Trash.delete`."""
        shutil.rmtree(self.path, ignore_errors=True)


def _claimed(source: Path, path: Path) -> bool:
    """:func:`resilient.io.fileio.claim_file`; a failure only costs the speed-up."""
    try:
        return fileio.claim_file(source, path)
    except OSError as exc:
        log.debug("not reusing %s: %s", source, exc)
        return False


@dataclass(slots=True)
class MemoryTarget:
    """A target in a dictionary: directory name -> file name -> bytes (tests, no disk).

    A rename of a key stands for the directory target's rename, so the two list, commit and
    crash alike; what a crash leaves is lost with the process. A file written by ranges is
    published at each :meth:`~resilient.io.fileio.RangeWriter.close` of one of its writers.
    Its trash may be deleted on a background thread (a manager's rotation:
    :class:`~resilient.io.storage.BackgroundDeleter`): a listing takes the keys first.
    """

    dirs: dict[str, dict[str, bytes]] = field(default_factory=dict)
    subs: dict[str, MemoryTarget] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # the root's own small files
    _growing: dict[tuple[str, str], bytearray] = field(default_factory=dict, repr=False)
    _held: list[_MemoryHold] = field(default_factory=list, repr=False)

    def names(self) -> list[str]:
        """See :meth:`Target.names` (children that hold nothing are not listed)."""
        subs = [n for n, sub in list(self.subs.items()) if sub.names()]
        return [*list(self.dirs), *self.files, *subs]

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

    def where(self, step: SetKey) -> str:
        """See :meth:`Target.where`."""
        return f"memory:{filenames.set_dir_name(step)}"

    def __str__(self) -> str:
        return "memory"

    def clean_up(self) -> None:
        """See :meth:`Target.clean_up`."""
        for name in list(self.dirs):
            if filenames.parse_tmp_dir(name) is not None or filenames.is_trash(name):
                self.dirs.pop(name, None)
        static = self.subs.get(filenames.STATIC_DIR)
        if static is not None:  # (as a directory's: its pending and trashed copies)
            for name in list(static.dirs):
                if filenames.is_static_tmp(name) or filenames.is_trash(name):
                    static.dirs.pop(name, None)
            static._growing.clear()
        self._growing.clear()

    def steps(self) -> list[int]:
        """See :meth:`Target.steps`."""
        return [s for s in map(filenames.parse_step_dir, list(self.dirs)) if s is not None]

    def pending(self, step: SetKey, *, token: str | None = None) -> PendingDir:
        """See :meth:`Target.pending` (the paths only name keys)."""
        return PendingDir.for_set(Path("/memory"), step, token=token)

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

    def discard(self, pending: PendingDir, name: str) -> None:
        """See :meth:`Target.discard`."""
        self._pending(pending).pop(name, None)
        self._growing.pop((pending.path.name, name), None)

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

    def open_reader(self, step: SetKey, name: str) -> fileio.RangeReader:
        """See :meth:`Target.open_reader`."""
        return _MemoryReader(self.read(step, name))

    def copy(self, pending: PendingDir, name: str, source: Target, step: SetKey) -> str:
        """See :meth:`Target.copy`."""
        return copy_file(source, step, name, self, pending)

    def link(self, pending: PendingDir, name: str, source: Target, step: SetKey) -> None:
        """See :meth:`Target.link` (the bytes are shared: they never change)."""
        if source is self:
            files = self._pending(pending)
            if name in files:
                raise FileExistsError(str(pending.path / name))
            files[name] = self.read(step, name)
            return
        copy_file(source, step, name, self, pending)

    def commit(
        self, pending: PendingDir, manifest: Manifest, *, what: str, copies: int | None = None
    ) -> None:
        """See :meth:`Target.commit`."""
        files = self._pending(pending)
        text = manifest_json(manifest).encode()
        marker = marker_text(manifest.step, digest_bytes(text), copies=copies)
        files[filenames.MANIFEST] = text
        files[filenames.COMMITTED] = marker.encode()
        self.publish(pending, what=what)

    def publish(self, pending: PendingDir, *, what: str) -> None:
        """See :meth:`Target.publish`."""
        self._pending(pending)
        self._forget(pending)
        self.dirs[pending.final.name] = self.dirs.pop(pending.path.name)

    def rollback(self, pending: PendingDir) -> None:
        """See :meth:`Target.rollback`."""
        self._forget(pending)
        self.dirs.pop(pending.path.name, None)

    def _forget(self, pending: PendingDir) -> None:
        for key in [k for k in self._growing if k[0] == pending.path.name]:
            del self._growing[key]

    def manifest(
        self, step: SetKey, *, kind: str = "checkpoint", memo: Memo | None = None
    ) -> Manifest:
        """See :meth:`Target.manifest` (:func:`resilient.io.manifests.check_manifest`)."""
        where = self.where(step)
        files = self.dirs.get(filenames.set_dir_name(step))
        if files is None:
            raise InvalidCheckpointError(where, "does not exist")
        return check_manifest(
            where, files.get(filenames.COMMITTED), lambda: files.get(filenames.MANIFEST),
            kind=kind, memo=memo,
        )  # fmt: skip

    def stat(self, step: SetKey, name: str) -> FileStat | None:
        """See :meth:`Target.stat` (every file is a regular file)."""
        data = self.dirs.get(filenames.set_dir_name(step), {}).get(name)
        return None if data is None else FileStat(len(data), True)

    def file_names(self, step: SetKey) -> list[str]:
        """See :meth:`Target.file_names`."""
        return list(self.dirs.get(filenames.set_dir_name(step), {}))

    def read(self, step: SetKey, name: str) -> bytes:
        """See :meth:`Target.read`."""
        try:
            return self.dirs[filenames.set_dir_name(step)][name]
        except KeyError:
            raise FileNotFoundError(f"{self.where(step)}/{name}") from None

    def read_small(self, step: SetKey, name: str, limit: int) -> bytes | None:
        """See :meth:`Target.read_small`."""
        data = self.dirs.get(filenames.set_dir_name(step), {}).get(name)
        if data is not None and len(data) > limit:
            raise InvalidCheckpointError(self.where(step), f"{name} is implausibly large")
        return data

    def remove(self, step: SetKey) -> None:
        """See :meth:`Target.remove`."""
        self.dirs.pop(filenames.set_dir_name(step), None)

    def trash(self, step: SetKey, *, durable: bool = True) -> Trash:
        """See :meth:`Target.trash` (the set is renamed to a trash name until deleted)."""
        name = filenames.set_dir_name(step)
        if name not in self.dirs:
            raise FileNotFoundError(f"memory:{name}")
        trash = filenames.trash_dir_name(storage.new_token())
        self.dirs[trash] = self.dirs.pop(name)
        return _MemoryTrash(self.dirs, trash)

    def reuse(self, pending: PendingDir, names: Iterable[str], trash: Trash) -> frozenset[str]:
        """See :meth:`Target.reuse` (nothing to gain in memory: none)."""
        return frozenset()

    def quarantine(self, step: int, reason: str) -> None:
        """See :meth:`Target.quarantine`."""
        files = self.dirs.pop(filenames.step_dir_name(step))
        files[filenames.QUARANTINE_INFO] = json.dumps({"step": step, "reason": reason}).encode()
        name = filenames.quarantine_dir_name(step, storage.new_token())
        self.dirs[name] = files
        storage.log_quarantined(step, name, reason)

    def _pending(self, pending: PendingDir) -> dict[str, bytes]:
        try:
            return self.dirs[pending.path.name]
        except KeyError:
            raise FileNotFoundError(str(pending.path)) from None


@dataclass(frozen=True, slots=True)
class _MemoryTrash:
    dirs: dict[str, dict[str, bytes]]
    name: str

    def delete(self) -> None:
        self.dirs.pop(self.name, None)


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


@dataclass(frozen=True, slots=True)
class SetRef:
    """One committed set of a target, by its key: where a restore reads a step (the shared
    root's, a node-local copy's, a staged copy's).

    Attributes:
        target: the target holding it.
        key: its step (or its name).
    """

    target: Target
    key: SetKey

    @property
    def name(self) -> str:
        """Its entry's name (``step_00000012``), for messages."""
        return filenames.set_dir_name(self.key)

    def __str__(self) -> str:
        return self.target.where(self.key)

    def opener(self, name: str) -> fileio.RangeReader:
        """Its file ``name``, to read by byte ranges (:meth:`Target.open_reader`)."""
        return self.target.open_reader(self.key, name)

    @property
    def files(self) -> SetFiles:
        """Its small files, read by name (:func:`set_files`)."""
        return set_files(self.target, self.key)


def as_target(where: str | os.PathLike[str] | Target) -> Target:
    """``where`` as a target: a checkpoint directory's path as its :class:`DirectoryTarget`,
    a target as itself."""
    return DirectoryTarget(Path(where)) if isinstance(where, (str, os.PathLike)) else where


def set_files(target: Target, step: SetKey) -> SetFiles:
    """The small files of ``target``'s committed set ``step``, read by name
    (:meth:`Target.read_small`): what reads a sharded manifest's shards
    (:func:`resilient.io.manifests.load_entries`)."""
    return SetFiles(target.where(step), functools.partial(target.read_small, step))


def copy_file(source: Target, step: SetKey, name: str, dest: Target, pending: PendingDir) -> str:
    """Copy the file ``name`` of ``source``'s committed ``step`` as ``name`` of ``dest``'s
    pending copy, durably, through the one copy loop (:func:`resilient.io.fileio.pump`);
    returns the xxh3-128 digest of its bytes. What :meth:`Target.copy` does, for every target.

    Raises:
        OSError: the source is unreadable, ``name`` exists, or the write failed.
    """
    found = source.stat(step, name)
    if found is None:
        raise FileNotFoundError(f"{source.where(step)}/{name}")
    size = found.size
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
