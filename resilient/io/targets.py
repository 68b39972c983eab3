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
    target.write(pending, name, data)            # small files, each durable (data files are
                                                 # written by resilient.io.fileio or io.wire
                                                 # into pending.path of a DirectoryTarget)
    target.commit(pending, manifest, what=...)   # manifest + marker durable, then visible
    # or, on any failure:
    target.rollback(pending)

Readers: :meth:`~Target.steps` lists the committed steps; :meth:`~Target.manifest`,
:meth:`~Target.size` and :meth:`~Target.read` look into one. :meth:`~Target.remove` and
:meth:`~Target.quarantine` take a step out of the listing atomically.

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
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from resilient.errors import InvalidCheckpointError
from resilient.io import storage
from resilient.io.checkpoints import MAX_MANIFEST_BYTES, load_manifest, marker_text
from resilient.io.commit import PendingDir
from resilient.io.wire import CHUNK, new_hash
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json, parse_manifest
from resilient.model.manifest import Manifest, ManifestError

__all__ = ["DirectoryTarget", "MemoryTarget", "Target"]


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

    def remove(self, step: int) -> None:
        """Take a committed step out of the listing at once, then delete it."""
        ...

    def quarantine(self, step: int, reason: str) -> None:
        """Take a committed step out of the listing, kept aside with ``reason``."""
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

    def clean_up(self) -> None:
        """See :meth:`Target.clean_up`."""
        if self.root.is_dir() and not self.root.is_symlink():
            storage.cleanup_leftovers(self.root)

    def steps(self) -> list[int]:
        """See :meth:`Target.steps`."""
        return [s for s in map(filenames.parse_step_dir, self.names()) if s is not None]

    def names(self) -> list[str]:
        """The names of the entries in :attr:`root` (none if it is missing)."""
        return storage.names_in(self.root)

    def path(self, step: int) -> Path:
        """The directory of the committed ``step`` (for the data files' readers and copiers)."""
        return self.root / filenames.step_dir_name(step)

    def child(self, name: str) -> DirectoryTarget:
        """The target in the subdirectory ``name`` (a partner copy's place)."""
        return DirectoryTarget(self.root / name)

    def children(self) -> list[DirectoryTarget]:
        """The targets in subdirectories (symlinks not followed)."""
        if self.root.is_symlink():
            return []
        subs = [self.root / n for n in sorted(self.names())]
        return [DirectoryTarget(p) for p in subs if p.is_dir() and not p.is_symlink()]

    def drop(self) -> None:
        """Remove the whole target (renamed to trash first)."""
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

    def link(self, pending: PendingDir, name: str, source: Path) -> None:
        """The file ``source`` (of another step on this filesystem) as ``name`` of the pending
        copy: hard-linked (no bytes moved), or copied and fsynced where links are refused."""
        dst = pending.path / name
        try:
            os.link(source, dst)
        except OSError:
            shutil.copyfile(source, dst)
            storage.fsync_files([dst])

    def copy(self, pending: PendingDir, name: str, source: Path) -> str:
        """Copy the file ``source`` as ``name`` of the pending copy, durably; returns the
        xxh3-128 digest of the bytes copied (:func:`resilient.io.wire.new_hash`).

        Raises:
            OSError: ``source`` unreadable, ``name`` exists, or the write failed.
        """
        h = new_hash()
        with open(source, "rb") as src, open(pending.path / name, "xb") as dst:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        digest: str = h.hexdigest()
        return digest

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


@dataclass(slots=True)
class MemoryTarget:
    """A target in a dictionary: directory name -> file name -> bytes (tests, no disk).

    A rename of a key stands for the directory target's rename, so the two list, commit and
    crash alike; what a crash leaves is lost with the process.
    """

    dirs: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def clean_up(self) -> None:
        """See :meth:`Target.clean_up`."""
        for name in [n for n in self.dirs if filenames.parse_tmp_dir(n) is not None]:
            del self.dirs[name]

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

    def commit(self, pending: PendingDir, manifest: Manifest, *, what: str) -> None:
        """See :meth:`Target.commit`."""
        files = self._pending(pending)
        text = manifest_json(manifest).encode()
        files[filenames.MANIFEST] = text
        files[filenames.COMMITTED] = marker_text(manifest.step, digest_bytes(text)).encode()
        self.dirs[pending.final.name] = self.dirs.pop(pending.path.name)

    def rollback(self, pending: PendingDir) -> None:
        """See :meth:`Target.rollback`."""
        self.dirs.pop(pending.path.name, None)

    def manifest(self, step: int) -> Manifest:
        """See :meth:`Target.manifest`."""
        where = f"memory:{filenames.step_dir_name(step)}"
        files = self.dirs.get(filenames.step_dir_name(step))
        if files is None:
            raise InvalidCheckpointError(where, "does not exist")
        marker, text = files.get(filenames.COMMITTED), files.get(filenames.MANIFEST)
        if marker is None:
            raise InvalidCheckpointError(where, "no COMMITTED marker (incomplete save)")
        if text is None or len(text) > MAX_MANIFEST_BYTES:
            raise InvalidCheckpointError(where, "manifest.json is missing")
        try:
            expected = json.loads(marker)["manifest_checksum"]
        except (ValueError, KeyError, TypeError):
            raise InvalidCheckpointError(where, "COMMITTED marker is garbled") from None
        if digest_bytes(text) != expected:
            raise InvalidCheckpointError(where, "manifest.json does not match its checksum")
        try:
            return parse_manifest(text)
        except ManifestError as exc:
            raise InvalidCheckpointError(where, f"bad manifest: {exc}") from None

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
