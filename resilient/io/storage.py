"""Filesystem effects on a checkpoint root: the root itself, its lock, durable small files,
deleting and quarantining directories, leftovers, and retries of transient errors.

Elsewhere: :mod:`resilient.io.commit` names, fills, fsyncs and renames a save's temporary
directory; :mod:`resilient.io.fileio` writes and fsyncs the data files; :mod:`resilient.io.logs`
reads and appends the root's logs (the attempt ledger, fsynced, among them). Nothing here
follows a symlink out of the checkpoint root: directories are renamed (never their targets),
trees are deleted only after being renamed to a ``.trash-*`` name inside the root, and
``shutil.rmtree`` never follows symlinks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from resilient.errors import (
    CheckpointLockedError,
    CollectiveError,
    CommitError,
    ConfigError,
    StaticDataError,
)
from resilient.model import filenames
from resilient.model.checksum import hash128

__all__ = [
    "BackgroundDeleter",
    "Trash",
    "RootLock",
    "move_to_trash",
    "cleanup_leftovers",
    "ensure_root",
    "exchange_dirs",
    "fsync_dir",
    "free_bytes",
    "fsync_together",
    "is_permanent_storage_error",
    "is_root",
    "marker_problem",
    "is_transient",
    "retry_io",
    "new_token",
    "quarantine",
    "remove_tree",
    "fsync_files",
    "names_in",
    "remove_file",
    "replace_file",
    "write_all",
    "write_durable",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ROOT_FORMAT = {"format": "resilient-root", "version": 1}


def new_token() -> str:
    """A random hex token for temporary names."""
    return uuid.uuid4().hex[:16]


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Create ``path`` (which must not exist) with ``data`` and fsync it."""
    write_all([(path, data)])
    fsync_files([path])


def write_all(files: list[tuple[Path, bytes]]) -> None:
    """Create each file (none may exist) with its data (not durable yet: see
    :func:`fsync_files`)."""
    for path, data in files:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)


def remove_file(path: Path) -> None:
    """Remove the file ``path`` if it is there (a half-written one, before a retry)."""
    path.unlink(missing_ok=True)


def free_bytes(path: Path) -> int:
    """The bytes free to this user on the filesystem of ``path``."""
    return shutil.disk_usage(path).free


def names_in(directory: Path) -> list[str]:
    """The names of the entries of ``directory`` (none if it is missing)."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def replace_file(path: Path, data: bytes) -> None:
    """Replace (or create) the small file ``path`` with ``data`` at once: written durably under
    a hidden temporary name beside it, then renamed over it (a reader sees the old bytes or
    the new ones; the rename is durable once the caller fsyncs the directory)."""
    tmp = path.parent / filenames.replacement_name(path.name, new_token())
    write_durable(tmp, data)
    os.replace(tmp, path)


def fsync_files(paths: list[Path]) -> None:
    """fsync each file."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_together(paths: list[Path]) -> None:
    """fsync each file or directory of ``paths`` at the same time (one helper thread each but
    the first, which this thread fsyncs): on a journaling filesystem (ext4, XFS) fsyncs that
    run together share one journal commit, where one after the other each waits for its own
    (the three fsyncs of a commit: 5-7 ms here, 2-3 ms together). Returns once every fsync
    has returned.

    Raises:
        OSError: the first path's error whose fsync failed (every fsync has returned).
    """
    errors: list[OSError | None] = [None] * len(paths)

    def one(i: int) -> None:
        try:
            if paths[i].is_dir():
                fsync_dir(paths[i])
            else:
                fsync_files([paths[i]])
        except OSError as exc:
            errors[i] = exc

    helpers = [threading.Thread(target=one, args=(i,), name="resilient-fsync")
               for i in range(1, len(paths))]  # fmt: skip
    for helper in helpers:
        helper.start()
    if paths:
        one(0)
    for helper in helpers:
        helper.join()
    for exc in errors:
        if exc is not None:
            raise exc


_MARKERS = (filenames.ROOT_MARKER, filenames.ROOT_MARKER_COPY)


def _marker_bytes() -> bytes:
    """A root marker: :data:`ROOT_FORMAT` and a checksum of it (so that a flipped bit that
    still parses is seen)."""
    return json.dumps(
        {**ROOT_FORMAT, "checksum": hash128(json.dumps(ROOT_FORMAT, sort_keys=True))}
    ).encode()


def _marker_state(path: Path) -> str:
    """``good``, ``legacy`` (good, without a checksum: written before the copies), ``missing``
    or ``damaged``."""
    try:
        if os.lstat(path).st_size > 1 << 16:
            return "damaged"
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, RecursionError):
        return "damaged"
    if not isinstance(doc, dict) or doc.get("format") != ROOT_FORMAT["format"]:
        return "damaged"
    if "checksum" not in doc:  # as written before the copies, or a damaged key
        return "legacy" if doc == ROOT_FORMAT else "damaged"
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return "good" if doc["checksum"] == hash128(json.dumps(body, sort_keys=True)) else "damaged"


def is_root(root: Path) -> bool:
    """Whether ``root`` is a checkpoint root made by this library (one intact copy of its
    marker is enough)."""
    return any(_marker_state(root / n) in ("good", "legacy") for n in _MARKERS)


def marker_problem(root: Path) -> str | None:
    """Why ``root`` is not a checkpoint root although it has a marker: every copy of its
    marker is damaged (the sentence names them and the fix); ``None`` otherwise."""
    states = {n: _marker_state(root / n) for n in _MARKERS}
    if any(v in ("good", "legacy") for v in states.values()) or all(
        v == "missing" for v in states.values()
    ):
        return None
    damaged = " and ".join(n for n, v in states.items() if v == "damaged")
    return (
        f"the marker of the checkpoint directory {root} is damaged ({damaged}; "
        "its checkpoints are not looked at): if it is this run's checkpoint directory, "
        f"rewrite the marker with `printf '%s' '{json.dumps(ROOT_FORMAT)}' > "
        f"{root / filenames.ROOT_MARKER}` and start again (or delete the directory to start "
        "over)"
    )


def ensure_root(root: Path) -> None:
    """Create the checkpoint root (and both copies of its marker) if needed; refuse a foreign
    directory. A missing or damaged copy of the marker is written again from the other (one
    warning; a copy added to a root written before the copies: one info line).

    Raises:
        ConfigError: ``root`` exists, is not empty and is not a checkpoint root (or every copy
            of its marker is damaged: the message says so, with the fix).
    """
    if root.is_symlink() and not root.is_dir():
        raise ConfigError(f"{root}: dangling symlink, not a checkpoint root")
    root.mkdir(parents=True, exist_ok=True)
    states = {n: _marker_state(root / n) for n in _MARKERS}
    if any(v in ("good", "legacy") for v in states.values()):
        bad = [n for n, v in states.items() if v in ("missing", "damaged")]
        if bad:
            _rewrite_markers(root, bad)
            legacy = states[filenames.ROOT_MARKER] == "legacy" and states[bad[0]] == "missing"
            (log.info if legacy else log.warning)(
                "%s: %s its marker %s from the other copy",
                root, "added the second copy of" if legacy else "repaired", bad[0],
            )  # fmt: skip
        return
    problem = marker_problem(root)
    if problem is not None:
        raise ConfigError(problem)
    for entry in root.iterdir():  # a crash while the first start wrote the marker
        if filenames.replacement_target(entry.name) in _MARKERS and not entry.is_dir():
            entry.unlink()
    if any(root.iterdir()):
        raise ConfigError(
            f"{root} is not empty and is not a resilient checkpoint root "
            f"(no {filenames.ROOT_MARKER}); refusing to write into it"
        )
    _rewrite_markers(root, list(_MARKERS))


def _rewrite_markers(root: Path, names: list[str]) -> None:
    for name in names:
        replace_file(root / name, _marker_bytes())
    fsync_dir(root)


class RootLock:
    """An exclusive lock on a checkpoint root, held while a job writes there.

    Uses ``flock``: the kernel drops it when the holding process dies, so a crashed job never
    leaves the root locked. The lock file records who holds it (host, pid, and whatever
    ``owner`` adds, e.g. a Slurm job id), for the error message.
    """

    def __init__(self, root: Path, *, owner: Mapping[str, str] | None = None) -> None:
        self.path = root / filenames.LOCK_FILE
        self.owner = dict(owner or {})
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`CheckpointLockedError` at once (never waits)."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointLockedError(
                    f"{self.path.parent} is in use by another job ({holder}); two jobs must not "
                    "write one checkpoint root"
                ) from None
            raise
        info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), **self.owner}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)  # who holds it, for the error above
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_RENAME_EXCHANGE = 2  # renameat2(2)'s flag (Linux 3.15; ext4, XFS, btrfs, tmpfs: not NFS)
_AT_FDCWD = -100
_renameat2: list[Any] = []  # the libc function, looked up once ([None]: not there)


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step (``renameat2`` with
    ``RENAME_EXCHANGE``); ``False`` where the system or the filesystem cannot (nothing done).

    Raises:
        OSError: any other failure of the call.
    """
    import ctypes

    if not _renameat2:
        try:
            fn: Any = ctypes.CDLL(None, use_errno=True).renameat2
            path, at = ctypes.c_char_p, ctypes.c_int
            fn.argtypes = [at, path, at, path, ctypes.c_uint]
        except (AttributeError, OSError):  # not glibc >= 2.28
            fn = None
        _renameat2.append(fn)
    fn = _renameat2[0]
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def move_to_trash(path: Path, *, durable: bool = True) -> Path:
    """Rename a directory inside a root to ``.trash-*`` (atomic; it no longer counts).

    ``durable=False`` skips the fsync of the parent: for a rotation, which a crash may undo
    (the checkpoint comes back, valid, and the next rotation deletes it again)."""
    trash = path.parent / filenames.trash_dir_name(new_token())
    os.rename(path, trash)
    if durable:
        fsync_dir(path.parent)
    return trash


class Trash(Protocol):
    """A set taken out of a target's listing, to delete
    (:meth:`resilient.io.targets.Target.trash`)."""

    def delete(self) -> None:
        """Delete it (best effort; idempotent)."""
        ...


class BackgroundDeleter:
    """Deletes trash (:class:`Trash`: trashed directories) on one background thread.

    Unlinking a checkpoint costs ~0.2 s per GiB on filesystems mounted with ``discard``: that
    must not stall the ranks. :meth:`wait` joins the thread (call it before the next deletion
    and at close); a crash leaves ``.trash-*`` directories that the next start removes.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def delete(self, trash: Sequence[Trash]) -> None:
        """Start deleting ``trash`` (already out of its target's listing) in the background."""
        self.wait()
        if trash:

            def run() -> None:
                for t in trash:
                    t.delete()

            self._thread = threading.Thread(target=run, name="resilient-delete", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Block until the previous deletion finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def remove_tree(path: Path) -> None:
    """Delete a directory inside a root: :func:`move_to_trash`, then remove it.

    A crash in the middle leaves a ``.trash-*`` directory (cleaned up later), never a
    half-deleted checkpoint under its real name.
    """
    shutil.rmtree(move_to_trash(path), ignore_errors=True)


def quarantine(path: Path, step: int, reason: str) -> Path:
    """Rename a failed checkpoint out of the way (never delete it) and record why."""
    target = path.parent / filenames.quarantine_dir_name(step, new_token())
    os.rename(path, target)
    fsync_dir(path.parent)
    try:
        if target.is_dir() and not target.is_symlink():
            info = json.dumps({"step": step, "reason": reason}).encode()
            write_durable(target / filenames.QUARANTINE_INFO, info)
    except OSError:  # the reason is also logged; a read-only dir must not hide the rename
        pass
    log_quarantined(step, target.name, reason)
    return target


def log_quarantined(step: int, name: str, reason: str) -> None:
    """The one warning a quarantine gives (every target's :meth:`~resilient.io.targets.Target.quarantine`)."""
    log.warning("quarantined checkpoint of step %d as %s: %s", step, name, reason)


def cleanup_leftovers(root: Path) -> list[str]:
    """Remove temporary and trash directories left by killed saves. Call only under the lock."""
    removed = []
    candidates = list(root.iterdir())
    static = root / filenames.STATIC_DIR
    if static.is_dir() and not static.is_symlink():
        candidates += list(static.iterdir())
    for entry in candidates:
        name = entry.name
        if (
            filenames.parse_tmp_dir(name) is not None
            or filenames.is_trash(name)
            or (entry.parent == static and filenames.is_static_tmp(name))
        ):
            if entry.is_symlink():
                entry.unlink()
            else:
                shutil.rmtree(entry, ignore_errors=True)
            removed.append(name)
    if removed:
        log.info("removed %d leftover temporary directories in %s", len(removed), root)
    return removed


# --------------------------------------------------------------------------- transient errors

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT})
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


def is_permanent_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or a rank's error inside a collective one) is a permanent storage error.

    Reads errnos as data: an ``OSError``'s, a :class:`CommitError`'s, and each rank's
    :class:`~resilient.errors.RankFailure` of a :class:`CollectiveError`; then the cause chain.
    Static data that no copy of can be read (:class:`~resilient.errors.StaticDataError`) is one.
    """
    if isinstance(exc, (OSError, CommitError)) and exc.errno in PERMANENT_ERRNOS:
        return True
    if isinstance(exc, StaticDataError):  # no copy of it can be read: retrying cannot help
        return True
    if isinstance(exc, CollectiveError):
        return any(f.errno in PERMANENT_ERRNOS for f in exc.details.values())
    cause = exc.__cause__
    return cause is not None and cause is not exc and is_permanent_storage_error(cause)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a filesystem error worth retrying (shared storage hiccups)."""
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def retry_io(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int = 5,
    cleanup: Callable[[], None] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> T:
    """Run ``fn``; retry transient errors (EIO, ESTALE, EAGAIN, EINTR) with exponential backoff.

    Permanent errors (ENOSPC, EDQUOT, EACCES, EPERM, EROFS) fail at once with a message that
    says what was being done and that it was not retried. ``cleanup`` runs before each retry
    (e.g. to remove a half-created file).
    """
    import time as _time

    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    def before_sleep(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "transient error while %s (attempt %d): %s; retrying", what, state.attempt_number, exc
        )
        if cleanup is not None:
            cleanup()

    try:
        for attempt in Retrying(
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception(is_transient),
            before_sleep=before_sleep,
            sleep=sleep or _time.sleep,
            reraise=True,
        ):
            with attempt:
                return fn()
    except OSError as exc:
        if exc.errno in PERMANENT_ERRNOS:
            raise OSError(
                exc.errno, f"{exc.strerror} while {what} (permanent: not retried)"
            ) from exc
        raise
    raise AssertionError("unreachable")  # pragma: no cover
