"""A save's temporary directory, from creation to commit or rollback: :class:`PendingDir`.

The only code that names, creates, fills with the manifest and the marker, fsyncs, renames and
removes a save's directory (orbax's ``TemporaryPath``; DCP's ``finish``). The data files inside
are written and fsynced by :mod:`resilient.io.fileio`; the names come from :mod:`resilient.model.filenames`.

Call order (rank 0 of the save's communicator, the coordinator)::

    pending = PendingDir.for_step(root, step)   # pure: names only
    pending.create()                            # mkdir the temporary directory
    ...every rank writes and fsyncs its data files in pending.path...
    pending.commit(manifest)                    # manifest, COMMITTED, fsync, rename, fsync parent
    # or, on any failure:
    pending.rollback()                          # remove the temporary directory (best effort)

A reader trusts only a directory under its final name whose ``COMMITTED`` marker holds the
checksum of its manifest, so a crash at any point leaves either the previous state or the new
checkpoint, never a torn one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from resilient.errors import CommitError, ConfigError
from resilient.io import manifests, storage
from resilient.io.manifests import marker_text
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json
from resilient.model.manifest import Manifest

__all__ = ["PendingDir"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingDir:
    """A directory being written under a temporary name, to be published as ``final``.

    Attributes:
        path: the temporary directory (a name readers ignore).
        final: the name it gets when committed.
    """

    path: Path
    final: Path

    @classmethod
    def for_step(cls, root: Path, step: int, *, token: str | None = None) -> PendingDir:
        """The pending directory of a checkpoint of ``step`` (no I/O); ``token`` makes the
        temporary name (default: a new one)."""
        tmp = filenames.tmp_dir_name(step, token if token is not None else storage.new_token())
        return cls(root / tmp, root / filenames.step_dir_name(step))

    @classmethod
    def for_set(cls, root: Path, key: int | str, *, token: str | None = None) -> PendingDir:
        """The pending directory of a committed set of ``root`` (no I/O): of a step
        (:meth:`for_step`), or of the set named ``key`` (static data's, in its ``static``
        directory: the temporary name :func:`~resilient.model.filenames.static_tmp_dir_name`)."""
        if not isinstance(key, str):
            return cls.for_step(root, key, token=token)
        tmp = filenames.static_tmp_dir_name(token if token is not None else storage.new_token())
        return cls(root / tmp, root / key)

    def create(self, *, shared: bool = False) -> PendingDir:
        """Create the temporary directory (and its parent, for static data); returns ``self``.

        ``shared``: several writers create it (the ranks of one node, each with the same
        name): the one that comes second finds it made."""
        self.path.parent.mkdir(exist_ok=True)
        self.path.mkdir(exist_ok=shared)
        return self

    def commit(self, manifest: Manifest, *, what: str, copies: int | None = None) -> None:
        """Write the manifest and the marker durably, then atomically rename to :attr:`final`
        (:meth:`prepare`, then :meth:`publish`).

        A re-save of an existing step replaces the old directory only once the new one is
        complete, in one atomic exchange of the two where the filesystem can
        (:func:`~resilient.io.storage.exchange_dirs`); elsewhere the old one is renamed aside
        first, and a crash between the two renames leaves the step's number empty (a restore
        takes the step before). If the rename fails, the old one is put back.

        Raises:
            CommitError: with the OS error's errno, after transient errors were retried.
        """
        self.prepare(manifest, what=what, copies=copies)
        self.publish(what=what)

    def prepare(self, manifest: Manifest, *, what: str, copies: int | None = None) -> None:
        """Write the manifest and the marker (not yet durable: :meth:`publish` makes them so);
        ``copies``: static data's, recorded in the marker (see
        :func:`~resilient.io.manifests.marker_text`).

        Raises:
            CommitError: as :meth:`commit`.
        """
        text = manifest_json(manifest).encode()
        if len(text) > manifests.MAX_MANIFEST_BYTES:  # committed, it could never be restored
            raise ConfigError(
                f"{what}: its manifest would be {len(text) / 1e6:.0f} MB, over the "
                f"{manifests.MAX_MANIFEST_BYTES >> 20} MiB a restore reads ({len(manifest.ranks)} "
                "ranks x their arrays); not committed (earlier checkpoints are intact). Save "
                "fewer, larger arrays per rank (e.g. one flat buffer for an optimizer's state)"
            )
        marker = marker_text(manifest.step, digest_bytes(text), copies=copies).encode()
        files = [(self.path / filenames.MANIFEST, text), (self.path / filenames.COMMITTED, marker)]
        with _commit_errors(what):
            storage.retry_io(
                lambda: storage.write_all(files),
                what=f"writing {files[0][0]} and {files[1][0].name}",
                cleanup=lambda: _unlink_all([p for p, _ in files]),
            )

    def publish(self, *, what: str) -> None:
        """Make what :meth:`prepare` wrote durable, then rename to :attr:`final` (every data
        file must be durable already).

        Raises:
            CommitError: as :meth:`commit`.
        """
        with _commit_errors(what):
            storage.retry_io(self._publish, what=f"committing {self.final}")

    def _publish(self) -> None:
        storage.fsync_together(
            [self.path / filenames.MANIFEST, self.path / filenames.COMMITTED, self.path]
        )
        old: Path | None = None
        # a step saved again: the new directory in and the old one out in one atomic step
        # where the filesystem can (then the old one is under the temporary name)
        again = self.final.is_dir() and not self.final.is_symlink()
        if again and storage.exchange_dirs(self.path, self.final):
            storage.fsync_dir(self.final.parent)
            shutil.rmtree(self.path, ignore_errors=True)
            return
        if self.final.exists() or self.final.is_symlink():
            # elsewhere a crash between the two renames leaves no step under this name
            old = storage.move_to_trash(self.final)
        try:
            os.replace(self.path, self.final)
        except OSError:
            if old is not None:
                os.rename(old, self.final)  # put the old checkpoint back
            raise
        storage.fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def rollback(self) -> None:
        """Remove the temporary directory (best effort: leftovers are cleaned at the next start)."""
        try:
            if self.path.exists():
                storage.remove_tree(self.path)
        except OSError as exc:
            log.warning("could not remove %s: %s", self.path, exc)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _commit_errors(what: str) -> Iterator[None]:
    """An OS error (after retries) as a :class:`CommitError` with its errno."""
    try:
        yield
    except OSError as exc:
        raise CommitError(f"{what}: commit failed: {type(exc).__name__}: {exc}", exc.errno) from exc
