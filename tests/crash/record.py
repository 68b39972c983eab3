"""The recorder: every file-system call a process makes under a directory, in order.

The library reaches the file system through ``os`` alone (its targets, :mod:`resilient.io.fileio`'s
writers and readers, the logs, the commit: ``os.open``, ``os.pwritev``, ``os.fsync``,
``os.replace``... and ``pathlib``/``shutil``, which call them), so the recorder wraps those
functions of the ``os`` module for the time of one operation, in the process that runs it
(every thread: the async save's writer, the node-local tier's copier), as LevelDB's and
RocksDB's fault-injection environments wrap their ``Env``. Recording at the ``Target`` alone
would see one call where a crash can fall between several (a commit is a write, two fsyncs
and a rename). Each call under ``base`` becomes one :class:`Call`, kept with its bytes, and
written at the end to ``<log>.jsonl`` (the calls) and ``<log>.bin`` (the bytes written).

Recorded: ``create`` (``os.open`` with ``O_CREAT`` of a path that did not exist), ``mkdir``,
``write`` (``os.write``, ``pwrite``, ``pwritev``, ``writev``: the inode, the offset and the
bytes), ``truncate`` (``ftruncate``, ``truncate``, ``O_TRUNC``), ``fsync`` (``fsync`` and
``fdatasync`` of a file or a directory), ``rename`` (``rename``, ``replace``), ``link``,
``unlink`` (``unlink``, ``remove``), ``rmdir``, and ``exchange`` (the library's
:func:`resilient.io.storage.exchange_dirs`: ``renameat2`` through ``ctypes``, which ``os``
does not offer, wrapped there). Calls with a ``dir_fd`` (``shutil.rmtree``'s)
are resolved through ``/proc/self/fd``. A file is known by its inode (``st_dev:st_ino``), so a
write lands in the right file whatever renames of its directory came between.

Left outside (listed in each log's ``unrecorded``, which the crash tests require to be empty
for the library's calls): writes through Python's buffered ``open()`` (the library makes none
in a save, a copy, a log append or a prune; ``resilient export`` writes its file through
HDF5's C library, and the ``h5py`` files of the programs themselves are not the library's),
``mmap`` writes, and calls of other processes than the recorded ones (a test records every
rank of an operation; ``resilient run``'s program is another process).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Call",
    "Recorder",
    "load_calls",
    "load_snapshot",
    "recording",
    "snapshot",
    "write_snapshot",
]


@dataclass(frozen=True)
class Call:
    """One file-system call, as the crash-state generator replays it.

    ``path``/``dest`` are relative to the recorded ``base`` (``dest``: of a rename or link);
    ``key`` is the inode (``dev:ino``) of a create, mkdir, write, truncate or fsync; ``data``
    the bytes of a write, at ``offset``; ``size`` the length a truncate leaves; ``is_dir`` an
    fsync of a directory. ``order`` sorts the calls of several processes (completion time in
    ``CLOCK_MONOTONIC`` nanoseconds, process id, sequence in the process).
    """

    order: tuple[int, int, int]
    op: str
    path: str = ""
    dest: str = ""
    key: str = ""
    offset: int = 0
    size: int = 0
    data: bytes = b""
    is_dir: bool = False
    thread: str = ""

    def describe(self) -> str:
        """One short line: ``write manifest.json @0 +812``."""
        if self.op == "write":
            return f"write {self.path or self.key} @{self.offset} +{len(self.data)}"
        if self.op in ("rename", "link", "exchange"):
            return f"{self.op} {self.path} -> {self.dest}"
        if self.op == "truncate":
            return f"truncate {self.path or self.key} to {self.size}"
        if self.op == "fsync":
            return f"fsync {'dir ' if self.is_dir else ''}{self.path or self.key}"
        return f"{self.op} {self.path}"


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


class Recorder:
    """Wraps the ``os`` functions while :meth:`active` (see the module); thread-safe: a call
    under ``base`` runs and is recorded under one lock, so the calls of one process are in
    the order they took effect."""

    WRAPPED = (
        "open", "close", "write", "pwrite", "pwritev", "writev", "ftruncate", "truncate",
        "fsync", "fdatasync", "rename", "replace", "link", "unlink", "remove", "mkdir", "rmdir",
    )  # fmt: skip

    def __init__(self, base: Path) -> None:
        self.base = os.path.realpath(base)
        self.calls: list[Call] = []
        self.unrecorded: list[str] = []
        self._fds: dict[int, tuple[str, str, bool]] = {}  # fd -> (key, path, is_dir)
        self._lock = threading.RLock()
        self._seq = 0
        self._real: dict[str, Any] = {}
        self._open: Any = None

    # ----------------------------------------------------------------- paths

    def _abs(self, path: Any, dir_fd: int | None = None) -> str:
        p = os.fsdecode(os.fspath(path))
        if not os.path.isabs(p):
            where = (
                self._real["readlink"](f"/proc/self/fd/{dir_fd}")
                if dir_fd is not None
                else os.getcwd()
            )
            p = os.path.join(where, p)
        return os.path.normpath(p)

    def _rel(self, absolute: str) -> str | None:
        if absolute == self.base:
            return "."
        if absolute.startswith(self.base + os.sep):
            return absolute[len(self.base) + 1 :]
        return None

    def _add(self, op: str, **fields: Any) -> None:
        self._seq += 1
        order = (time.monotonic_ns(), os.getpid(), self._seq)
        self.calls.append(Call(order, op, thread=threading.current_thread().name, **fields))

    # ----------------------------------------------------------------- the wrappers

    def _wrap_open(
        self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
    ) -> int:
        real = self._real["open"]
        if isinstance(path, int):
            return int(real(path, flags, mode, dir_fd=dir_fd))
        absolute = self._abs(path, dir_fd)
        rel = self._rel(absolute)
        if rel is None:
            return int(real(path, flags, mode, dir_fd=dir_fd))
        with self._lock:
            existed = os.path.lexists(absolute)
            fd = int(real(path, flags, mode, dir_fd=dir_fd))
            st = os.fstat(fd)
            key = _key(st)
            self._fds[fd] = (key, rel, stat.S_ISDIR(st.st_mode))
            if flags & os.O_CREAT and not existed:
                self._add("create", path=rel, key=key)
            elif flags & os.O_TRUNC and stat.S_ISREG(st.st_mode):
                self._add("truncate", path=rel, key=key, size=0)
            return fd

    def _wrap_close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            self._real["close"](fd)

    def _tracked(self, fd: int) -> bool:
        """Whether ``fd`` is a file under ``base`` (one opened before the recording too)."""
        if fd in self._fds:
            return True
        try:
            absolute = self._real["readlink"](f"/proc/self/fd/{fd}")
        except OSError:
            return False
        rel = self._rel(absolute)
        if rel is None:
            return False
        st = os.fstat(fd)
        self._fds[fd] = (_key(st), rel, stat.S_ISDIR(st.st_mode))
        return True

    def _written(self, fd: int, offset: int | None, buffers: list[Any], n: int) -> None:
        key, rel, _ = self._fds[fd]
        if offset is None:  # at the file position, which the write moved (O_APPEND too)
            offset = os.lseek(fd, 0, os.SEEK_CUR) - n
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:n]
        self._add("write", path=rel, key=key, offset=offset, data=data)

    def _wrap_write(self, fd: int, data: Any) -> int:
        if not self._tracked(fd):
            return int(self._real["write"](fd, data))
        with self._lock:
            n = int(self._real["write"](fd, data))
            self._written(fd, None, [data], n)
            return n

    def _wrap_pwrite(self, fd: int, data: Any, offset: int) -> int:
        if not self._tracked(fd):
            return int(self._real["pwrite"](fd, data, offset))
        with self._lock:
            n = int(self._real["pwrite"](fd, data, offset))
            self._written(fd, offset, [data], n)
            return n

    def _wrap_pwritev(self, fd: int, buffers: Any, offset: int, *flags: int) -> int:
        if not self._tracked(fd):
            return int(self._real["pwritev"](fd, buffers, offset, *flags))
        with self._lock:
            buffers = list(buffers)
            n = int(self._real["pwritev"](fd, buffers, offset, *flags))
            self._written(fd, offset, buffers, n)
            return n

    def _wrap_writev(self, fd: int, buffers: Any) -> int:
        if not self._tracked(fd):
            return int(self._real["writev"](fd, buffers))
        with self._lock:
            buffers = list(buffers)
            n = int(self._real["writev"](fd, buffers))
            self._written(fd, None, buffers, n)
            return n

    def _wrap_ftruncate(self, fd: int, length: int) -> None:
        if not self._tracked(fd):
            return self._real["ftruncate"](fd, length)  # type: ignore[no-any-return]
        with self._lock:
            self._real["ftruncate"](fd, length)
            key, rel, _ = self._fds[fd]
            self._add("truncate", path=rel, key=key, size=length)
            return None

    def _wrap_truncate(self, path: Any, length: int) -> None:
        if isinstance(path, int):
            return self._wrap_ftruncate(path, length)
        rel = self._rel(self._abs(path))
        if rel is None:
            return self._real["truncate"](path, length)  # type: ignore[no-any-return]
        with self._lock:
            self._real["truncate"](path, length)
            self._add("truncate", path=rel, key=_key(os.stat(path)), size=length)
            return None

    def _sync(self, name: str, fd: int) -> None:
        if not self._tracked(fd):
            return self._real[name](fd)  # type: ignore[no-any-return]
        with self._lock:
            self._real[name](fd)
            key, rel, is_dir = self._fds[fd]
            self._add("fsync", path=rel, key=key, is_dir=is_dir)
            return None

    def _two_paths(self, name: str, op: str, src: Any, dst: Any, **kw: Any) -> None:
        a = self._rel(self._abs(src, kw.get("src_dir_fd")))
        b = self._rel(self._abs(dst, kw.get("dst_dir_fd")))
        if a is None and b is None:
            return self._real[name](src, dst, **kw)  # type: ignore[no-any-return]
        with self._lock:
            self._real[name](src, dst, **kw)
            if a is None or b is None:
                self.unrecorded.append(f"{op} across the recorded directory: {src} -> {dst}")
            else:
                self._add(op, path=a, dest=b)
            return None

    def _one_path(self, name: str, op: str, path: Any, *args: Any, **kw: Any) -> None:
        absolute = self._abs(path, kw.get("dir_fd"))
        rel = self._rel(absolute)
        if rel is None:
            return self._real[name](path, *args, **kw)  # type: ignore[no-any-return]
        with self._lock:
            self._real[name](path, *args, **kw)
            key = _key(os.lstat(absolute)) if op == "mkdir" else ""
            self._add(op, path=rel, key=key)
            return None

    def _wrap_exchange(self, a: Any, b: Any) -> bool:
        ra, rb = self._rel(self._abs(a)), self._rel(self._abs(b))
        if ra is None or rb is None:
            return bool(self._real["exchange_dirs"](a, b))
        with self._lock:
            done = bool(self._real["exchange_dirs"](a, b))
            if done:
                self._add("exchange", path=ra, dest=rb)
            return done

    def _wrap_builtin_open(self, file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            rel = self._rel(self._abs(file))
            if rel is not None:
                self.unrecorded.append(f"open({rel!r}, {mode!r}): a buffered write")
        return self._open(file, mode, *args, **kw)

    # ----------------------------------------------------------------- on and off

    @contextlib.contextmanager
    def active(self) -> Iterator[Recorder]:
        """Record while inside (not re-entrant)."""
        self._real = {name: getattr(os, name) for name in self.WRAPPED}
        self._real["readlink"] = os.readlink
        wrappers: dict[str, Any] = {
            "open": self._wrap_open,
            "close": self._wrap_close,
            "write": self._wrap_write,
            "pwrite": self._wrap_pwrite,
            "pwritev": self._wrap_pwritev,
            "writev": self._wrap_writev,
            "ftruncate": self._wrap_ftruncate,
            "truncate": self._wrap_truncate,
            "fsync": lambda fd: self._sync("fsync", fd),
            "fdatasync": lambda fd: self._sync("fdatasync", fd),
            "rename": lambda a, b, **kw: self._two_paths("rename", "rename", a, b, **kw),
            "replace": lambda a, b, **kw: self._two_paths("replace", "rename", a, b, **kw),
            "link": lambda a, b, **kw: self._two_paths("link", "link", a, b, **kw),
            "unlink": lambda p, **kw: self._one_path("unlink", "unlink", p, **kw),
            "remove": lambda p, **kw: self._one_path("remove", "unlink", p, **kw),
            "mkdir": lambda p, *a, **kw: self._one_path("mkdir", "mkdir", p, *a, **kw),
            "rmdir": lambda p, **kw: self._one_path("rmdir", "rmdir", p, **kw),
        }
        self._open = builtins.open
        from resilient.io import storage

        self._real["exchange_dirs"] = storage.exchange_dirs
        try:
            for name, fn in wrappers.items():
                setattr(os, name, fn)
            builtins.open = self._wrap_builtin_open
            storage.exchange_dirs = self._wrap_exchange
            yield self
        finally:
            for name in self.WRAPPED:
                setattr(os, name, self._real[name])
            builtins.open = self._open
            storage.exchange_dirs = self._real["exchange_dirs"]

    def dump(self, log: Path) -> None:
        """Write ``<log>.jsonl`` (a header line, then a line per call) and ``<log>.bin``."""
        blob = bytearray()
        lines = [json.dumps({"base": self.base, "unrecorded": self.unrecorded})]
        for call in self.calls:
            doc = asdict(call)
            data = doc.pop("data")
            doc["blob"] = [len(blob), len(data)]
            blob += data
            lines.append(json.dumps(doc))
        Path(f"{log}.bin").write_bytes(bytes(blob))
        Path(f"{log}.jsonl").write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def recording(base: Path, log: Path) -> Iterator[Recorder]:
    """Record this process's calls under ``base`` while inside; write them to ``log``
    (``.jsonl`` and ``.bin``) on the way out, whatever happened."""
    recorder = Recorder(base)
    try:
        with recorder.active():
            yield recorder
    finally:
        recorder.dump(log)


def load_calls(logs: list[Path]) -> tuple[list[Call], list[str]]:
    """The calls of several processes' logs (paths without suffix), merged in order; and
    what each left unrecorded."""
    calls: list[Call] = []
    unrecorded: list[str] = []
    for log in logs:
        blob = Path(f"{log}.bin").read_bytes()
        head, *rest = Path(f"{log}.jsonl").read_text().splitlines()
        unrecorded += json.loads(head)["unrecorded"]
        for line in rest:
            doc = json.loads(line)
            start, n = doc.pop("blob")
            doc["order"] = tuple(doc["order"])
            calls.append(Call(data=blob[start : start + n], **doc))
    calls.sort(key=lambda c: c.order)
    return calls, unrecorded


def snapshot(base: Path) -> dict[str, Any]:
    """What ``base`` holds now, as the generator's starting point: ``{relative path: entry}``
    with ``{"dir": True, "key": ...}``, ``{"key": ..., "data": bytes}`` or
    ``{"symlink": target}`` (hard links share a key)."""
    out: dict[str, Any] = {}
    root = os.path.realpath(base)
    for here, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = os.path.join(here, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = {"symlink": os.readlink(path)}
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = {"dir": True, "key": _key(st)}
            elif stat.S_ISREG(st.st_mode):
                out[rel] = {"key": _key(st), "data": Path(path).read_bytes()}
    return out


def write_snapshot(snap: dict[str, Any], path: Path) -> None:
    """Keep :func:`snapshot`'s result as ``<path>.json`` and ``<path>.bin`` (no pickle)."""
    blob = bytearray()
    doc: dict[str, Any] = {}
    for rel, entry in snap.items():
        entry = dict(entry)
        if "data" in entry:
            data = entry.pop("data")
            entry["blob"] = [len(blob), len(data)]
            blob += data
        doc[rel] = entry
    Path(f"{path}.bin").write_bytes(bytes(blob))
    Path(f"{path}.json").write_text(json.dumps(doc))


def load_snapshot(path: Path) -> dict[str, Any]:
    """What :func:`write_snapshot` kept."""
    blob = Path(f"{path}.bin").read_bytes()
    doc: dict[str, Any] = json.loads(Path(f"{path}.json").read_text())
    for entry in doc.values():
        if "blob" in entry:
            start, n = entry.pop("blob")
            entry["data"] = blob[start : start + n]
    return doc
