"""The data files of a checkpoint, byte by byte: raw ``pwrite``/``preadv`` (``O_DIRECT`` for large
arrays), their fsync, reuse and copies. No HDF5 library call.

A group of ranks shares one file. Its leader plans the file (:func:`build_skeleton`:
:mod:`resilient.model.h5format` computes HDF5's metadata: one HDF5 group per rank, ``/rank_00003``,
holding one contiguous, early-allocated dataset per state key, and attributes for the layout and
the rank) and writes that metadata; every rank writes its arrays' bytes straight to their offsets
(:func:`write_file`) and fsyncs. The result is an ordinary HDF5 file (``h5py``, ``h5ls``,
``h5dump`` read it) written at raw-disk speed, with no gather of data to a leader. A restore
reads the bytes back the same way (:func:`read_new`, :func:`read_many`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import math
import mmap
import operator
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from resilient.model import h5format
from resilient.model.checksum import digest_bytes
from resilient.model.filenames import rank_group_name
from resilient.model.h5format import ArraySpec, Spec
from resilient.model.manifest import Segment

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import numpy.typing as npt

    _Buffer: TypeAlias = memoryview | npt.NDArray[Any]  # .nbytes and the buffer protocol

__all__ = [
    "ArraySpec",
    "Bounce",
    "DIRECT_MIN",
    "Spec",
    "FileSkeleton",
    "fsync_file",
    "build_skeleton",
    "claim_file",
    "copy_ranges",
    "create_file",
    "open_direct",
    "rank_group_name",
    "ReadWatcher",
    "read_many",
    "read_new",
    "write_file",
    "FileReader",
    "FileWriter",
    "RangeReader",
    "RangeWriter",
    "pump",
    "open_read",
]

_ALIGN = h5format.PAGE  # O_DIRECT's alignment: every dataset written through it starts on a page


@dataclass(frozen=True, slots=True)
class FileSkeleton:
    """A file as its leader planned it: offsets per rank, HDF5's own bytes, size.

    The skeleton depends only on the structure (every rank's names, shapes and dtypes): equal
    structures give byte-identical skeletons, and a later save of the same structure writes
    :attr:`meta_bytes` again without planning (seed 002's metadata cache).

    Attributes:
        offsets: per rank, each dataset's byte offset (``None`` for empty ones).
        meta_segments: HDF5's own byte ranges (everything but the datasets) with checksums.
        size: the file's size.
        meta_bytes: the bytes of ``meta_segments``, as ``(offset, bytes)``.
    """

    offsets: Mapping[int, tuple[int | None, ...]]
    meta_segments: tuple[Segment, ...]
    size: int
    meta_bytes: tuple[tuple[int, bytes], ...] = ()


def build_skeleton(layout_kind: str, ranks: Sequence[tuple[int, Sequence[Spec]]]) -> FileSkeleton:
    """The skeleton of the file of a group of ranks (no I/O): the structure only (the layout,
    the ranks, their datasets); the step and the JSON values of a checkpoint are in its
    manifest. :mod:`resilient.model.h5format` computes HDF5's metadata (h5py took ~26 us per
    dataset; that takes ~0.7 us); its dataset offsets are :func:`h5format.place_data`'s.

    Args:
        layout_kind: ``self``, ``node``, ``world`` or ``custom`` (stored as an attribute).
        ranks: per rank of the group, its rank and its array specs.

    Raises:
        ValueError: a name HDF5 cannot hold, or another structure it cannot (see
            :func:`resilient.model.h5format.plan_file`).
    """
    planned = h5format.plan_file(layout_kind, ranks)
    meta = tuple(Segment(o, len(b), digest_bytes(b)) for o, b in planned.meta_bytes)
    return FileSkeleton(
        offsets=planned.offsets, meta_segments=meta, size=planned.size, meta_bytes=planned.meta_bytes
    )


def create_file(path: Path) -> None:
    """Create an empty file (its group's writers fill it).

    Raises:
        FileExistsError: ``path`` exists (a second writer of one directory).
    """
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))


def claim_file(source: Path, path: Path) -> bool:
    """Move ``source``, a data file of a checkpoint that rotation dropped, to ``path`` for a
    save to write over in place; whether it was there to take.

    Writing over a file's blocks costs less than writing a new file and deleting the old one
    (no blocks freed, discarded and allocated again; 1.1-2x the speed of a new file here,
    bench/README.md). Only a regular file of one link is taken (another name of its bytes,
    e.g. a hard link a user made, must not change). Its bytes count for nothing until
    rewritten: whatever the new save leaves unwritten lies between its datasets, where no
    reader looks and no checksum covers.
    """
    try:
        info = source.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return False
        os.rename(source, path)
    except FileNotFoundError:  # taken already, or never there
        return False
    return True


DIRECT_MIN = h5format.PAGE_ALIGNED_MIN  # arrays from 1 MiB go through O_DIRECT (on a page each)
_BOUNCE_BYTES = 32 << 20  # page-aligned staging buffer of a Bounce


class Bounce:
    """A page-aligned buffer through which :func:`write_file` writes arrays that are not
    page-aligned with ``O_DIRECT`` (which needs alignment), and :func:`copy_ranges` copies.

    Owned by its user (a manager's writer, :class:`resilient.checkpoint.saving.SavePipeline`): mapped at
    its first use, kept and reused by every later one (first touching new pages cost ~2.3 s per
    GiB on the project's virtual machine; a buffer touched before costs nothing), unmapped by
    :meth:`close`. Nothing of it lives in the module or in a thread: a write given no bounce
    maps one for the call and unmaps it when it returns. Local, thread-safe: the buffer is lent
    to one write at a time; a write that finds it lent (another thread's) maps one of its own
    for the call, and one returned after :meth:`close` is unmapped then.
    """

    def __init__(self, nbytes: int = _BOUNCE_BYTES) -> None:
        self.nbytes = -(-nbytes // _ALIGN) * _ALIGN
        self._lock = threading.Lock()
        self._kept: mmap.mmap | None = None
        self._closed = False

    @contextlib.contextmanager
    def lend(self) -> Iterator[memoryview]:
        """The buffer, for the ``with`` block (views of it must not outlive the block)."""
        with self._lock:
            buffer, self._kept = self._kept, None
        if buffer is None:
            buffer = _map(self.nbytes)
        view = memoryview(buffer)
        try:
            yield view
        finally:
            view.release()
            with self._lock:
                keep = not self._closed and self._kept is None
                if keep:
                    self._kept = buffer
            if not keep:
                _unmap(buffer)

    def close(self) -> None:
        """Unmap the buffer (one lent now: when it is returned). Idempotent; a later
        :meth:`lend` maps a buffer for that call only."""
        with self._lock:
            self._closed = True
            buffer, self._kept = self._kept, None
        if buffer is not None:
            _unmap(buffer)

    def __enter__(self) -> Bounce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _map(nbytes: int) -> mmap.mmap:
    """A new anonymous map (page-aligned, its pages faulted in as they are first written)."""
    return mmap.mmap(-1, nbytes)


def _unmap(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive (an error's traceback)
        buffer.close()  # then it is unmapped when that view goes


@contextlib.contextmanager
def _bounce(owner: Bounce | None, need: int) -> Iterator[memoryview]:
    """``owner``'s buffer, or (none) one of at most ``need`` bytes mapped for the block only."""
    if owner is not None:
        with owner.lend() as view:
            yield view
        return
    with Bounce(min(_BOUNCE_BYTES, max(need, 1))) as own, own.lend() as view:
        yield view


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def open_direct(path: Path) -> int | None:
    """``path`` opened for ``O_DIRECT`` writes, or ``None`` where that is refused (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:  # e.g. tmpfs: no O_DIRECT; buffered writes are fine there
        return None


def write_file(
    path: Path,
    offsets: Sequence[int | None],
    arrays: Sequence[npt.NDArray[np.generic]],
    *,
    skeleton: Callable[[], FileSkeleton] | None = None,
    idle: Callable[[], None] | None = None,
    bounce: Bounce | None = None,
    sync: bool = True,
) -> None:
    """Write each C-contiguous array's bytes at its offset in ``path`` (``None``: an empty array,
    nothing to write), then fsync (unless ``sync`` is false: then :func:`fsync_file` must follow
    before the file counts).

    Several ranks may write parts of one file concurrently, in any order: the file is created
    if missing and never truncated by a writer. The group's leader passes ``skeleton``, which
    gives the file's :class:`FileSkeleton` (perhaps building it): its HDF5 bytes are written
    after the data, and the file gets its size.

    The steps: the bytes are split by the way they reach the disk (:func:`_split`); the
    page-aligned bodies of large arrays are written with ``O_DIRECT`` (:func:`_write_direct`,
    through ``bounce``), the rest through the page cache in runs whose writeback starts at once
    (:func:`_pwrite_runs`); while the disk works, the CPU work of the save is done between two
    runs: ``skeleton`` after the first, then ``idle`` after each (:class:`_Between`); then the
    leader's HDF5 bytes, then the fsync.
    """
    split = _split(offsets, arrays)
    between = _Between(skeleton, idle)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        refused = _write_direct(path, split.direct, bounce)
        _pwrite_runs(
            fd,
            [*split.starts, *(s.offset for s in refused)],
            [*split.bufs, *(s.data for s in refused)],
            between=between,
        )
        if skeleton is not None:
            _write_metadata(fd, between.skeleton())
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _Span:
    """Bytes to write at an offset of a file."""

    offset: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class _Split:
    """One rank's bytes for a file, by the way they reach the disk.

    Attributes:
        direct: the page-aligned bodies of the arrays of 1 MiB or more, for ``O_DIRECT``.
        starts: offsets of the rest, for the page cache: the small arrays whole, the large
            ones' unaligned heads and tails.
        bufs: the buffers at ``starts`` (arrays, or byte views of them).
    """

    direct: tuple[_Span, ...]
    starts: list[int]
    bufs: list[_Buffer]


def _split(offsets: Sequence[int | None], arrays: Sequence[npt.NDArray[np.generic]]) -> _Split:
    """Split the bytes of ``arrays`` at ``offsets`` (``None``: empty, dropped) for
    :func:`write_file` (no I/O; no Python per small array).

    Large arrays go through ``O_DIRECT`` when the filesystem allows it: buffered writers to one
    shared file are serialised by the kernel (ext4 holds the inode lock while it allocates page
    cache), which made shared-file saves bimodal here; direct writes also leave the page cache
    alone. ``O_DIRECT`` needs page-aligned offsets, so a large array's head before its first
    page boundary and its tail after its last go through the page cache with the small arrays.
    """
    import numpy as np

    starts = list(offsets)
    arrs = list(arrays)
    if None in starts:  # empty arrays: nothing to write
        kept = [i for i, o in enumerate(starts) if o is not None]
        starts, arrs = [starts[i] for i in kept], [arrs[i] for i in kept]
    sizes = np.fromiter(map(_NBYTES, arrs), np.int64, len(arrs))
    large = np.flatnonzero(sizes >= DIRECT_MIN)
    if not large.size:
        return _Split((), cast("list[int]", starts), list(arrs))
    small = np.ones(len(arrs), bool)
    small[large] = False
    keep = np.flatnonzero(small).tolist()
    rest_starts = [cast(int, starts[i]) for i in keep]
    rest_bufs: list[_Buffer] = [arrs[i] for i in keep]
    direct: list[_Span] = []
    for i in large.tolist():
        offset, view = cast(int, starts[i]), _bytes_view(arrs[i])
        head = (-offset) % _ALIGN
        end = head + (len(view) - head) // _ALIGN * _ALIGN
        direct.append(_Span(offset + head, view[head:end]))
        rest_starts += [offset, offset + end]
        rest_bufs += [view[:head], view[end:]]
    return _Split(tuple(direct), rest_starts, rest_bufs)


def _write_direct(path: Path, spans: Sequence[_Span], bounce: Bounce | None) -> Sequence[_Span]:
    """Write ``spans`` (page-aligned offsets and lengths) with ``O_DIRECT``; those it cannot
    (the filesystem refuses ``O_DIRECT``: all of them) are returned, for the page cache.

    A page-aligned source (a staging buffer) is written as it is; any other is copied through
    ``bounce``'s page-aligned buffer (none given: one mapped for this call, of at most the
    largest span, whose pages are faulted in as it is filled).
    """
    if not spans:
        return ()
    dfd = open_direct(path)
    if dfd is None:
        return spans
    try:
        with contextlib.ExitStack() as lent:
            buffer: memoryview | None = None
            for span in spans:
                if _address(span.data) % _ALIGN == 0:
                    _pwrite_all(dfd, span.data, span.offset)
                    continue
                if buffer is None:  # the first span that needs it
                    need = max(len(s.data) for s in spans)
                    buffer = lent.enter_context(_bounce(bounce, need))
                _write_bounced(dfd, buffer, span)
    finally:
        os.close(dfd)
    return ()


def _address(view: memoryview) -> int:
    """The address of ``view``'s first byte."""
    import numpy as np

    return int(np.frombuffer(view, np.uint8).ctypes.data)


class _Between:
    """What :func:`write_file` does while the disk writes a run of data: the leader's
    ``skeleton`` after the first run, then the caller's ``idle`` work after each."""

    def __init__(
        self, skeleton: Callable[[], FileSkeleton] | None, idle: Callable[[], None] | None
    ) -> None:
        self._build = skeleton
        self._built: FileSkeleton | None = None
        self._idle = idle

    def __call__(self) -> None:
        if self._build is not None and self._built is None:
            self._built = self._build()
        elif self._idle is not None:
            self._idle()

    def skeleton(self) -> FileSkeleton:
        """The skeleton (built now if no run of data came first)."""
        if self._built is None:
            assert self._build is not None
            self._built = self._build()
        return self._built


def _write_metadata(fd: int, skeleton: FileSkeleton) -> None:
    """The leader's part after the data: the file's size, then HDF5's own bytes."""
    os.ftruncate(fd, skeleton.size)
    _pwrite_runs(
        fd, [offset for offset, _ in skeleton.meta_bytes], [memoryview(b) for _, b in skeleton.meta_bytes]
    )


_NBYTES = operator.attrgetter("nbytes")


def fsync_file(path: Path) -> None:
    """fsync a file written with ``write_file(..., sync=False)``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def _pwrite_runs(
    fd: int,
    offsets: list[int],
    bufs: list[_Buffer],
    *,
    between: Callable[[], Any] | None = None,
) -> None:
    """Write each buffer (a C-contiguous array or a byte view) at its offset, one ``pwritev``
    per run of adjacent ones: a state of 4,000 small arrays is a few system calls, the arrays
    themselves the iovecs (no copy here: ~0.3 us each in the kernel), and the runs are found
    with numpy (no Python per array).

    A run holds at most IOV_MAX buffers and, unless one buffer is larger,
    :data:`_WRITEBACK_BYTES`; ``between`` is called after each. After each run the kernel is
    asked to start writing its whole pages to the device (:func:`_start_writeback`): the disk
    works while the next run is copied, and the final fsync only waits for the tail. Measured
    here, write + fsync of 62 MiB of 64 KiB arrays took 23 ms this way against 33-40 ms for
    one write, then fsync."""
    import numpy as np

    start = np.array(offsets, np.int64)
    sizes = np.fromiter(map(_NBYTES, bufs), np.int64, len(bufs))
    if not (sizes > 0).all():
        keep = np.flatnonzero(sizes > 0)
        start, sizes, bufs = start[keep], sizes[keep], [bufs[i] for i in keep.tolist()]
    if start.size > 1 and (start[1:] < start[:-1]).any():
        order = np.argsort(start, kind="stable")
        start, sizes, bufs = start[order], sizes[order], [bufs[i] for i in order.tolist()]
    end = start + sizes
    stretches = [*(np.flatnonzero(start[1:] != end[:-1]) + 1).tolist(), len(bufs)]
    a = 0
    for stop in stretches:
        while a < stop:  # cut the stretch into runs
            b = int(np.searchsorted(end[a:stop], start[a] + _WRITEBACK_BYTES, "right")) + a
            b = min(max(b, a + 1), a + _IOV_MAX, stop)
            first, last = int(start[a]), int(end[b - 1])
            _pwritev_all(fd, bufs[a:b], first, last - first)
            low, high = first - first % _PAGE, last - last % _PAGE
            if high > low:  # a partial last page is written again by the next run: leave it
                _start_writeback(fd, low, high - low)
            if between is not None:  # the disk is busy with this run: time for other work
                between()
            a = b


_PAGE = mmap.PAGESIZE
_WRITEBACK_BYTES = 2 << 20  # 1-4 MiB measured alike here; 2 MiB keeps 64 KiB pieces in step
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, no wait


@functools.cache  # the C library's function, looked up once
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; ``os`` does not wrap it), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` (> 0) bytes of ``fd`` from ``offset`` to the
    device, without waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; the GIL is released).
    A hint: where it is missing or fails, nothing changes, and the fsync that must follow
    reports any I/O error (this call does not consume it)."""
    func = _sync_file_range()
    if func is not None:
        func(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _pwritev_all(fd: int, bufs: list[_Buffer], pos: int, total: int | None = None) -> None:
    """Write ``bufs`` from ``pos`` on (``total``: their byte count, if the caller knows it)."""
    first = 0
    while first < len(bufs):
        n = os.pwritev(fd, bufs[first:], pos)  # type: ignore[arg-type]  # numpy: a buffer
        if n == total:  # all of it (the usual case): no walk over the pieces
            return
        total = None
        pos += n
        while first < len(bufs) and n >= bufs[first].nbytes:
            n -= bufs[first].nbytes
            first += 1
        if n:  # a short write ended inside a piece
            bufs[first] = memoryview(bufs[first]).cast("B")[n:]  # type: ignore[arg-type]


def _write_bounced(dfd: int, bounce: memoryview, span: _Span) -> None:
    """Write ``span`` (page-aligned offset and length) with ``O_DIRECT`` through the
    page-aligned ``bounce``, a piece at a time: copy, then write."""
    pos, data = 0, span.data
    while pos < len(data):
        n = min(len(bounce), len(data) - pos)
        bounce[:n] = data[pos : pos + n]
        _pwrite_all(dfd, bounce[:n], span.offset + pos)
        pos += n


class RangeReader(Protocol):
    """A file of a committed step, read at the offsets asked for (a target's
    :meth:`~resilient.io.targets.Target.open_reader`). Local; the caller closes it."""

    def read(self, view: memoryview, pos: int) -> None:
        """Fill ``view`` with the file's bytes from ``pos`` on.

        Raises:
            EOFError: the file ends first.
        """
        ...

    def readv(self, buffers: list[_Buffer], pos: int) -> int:
        """Read the file's bytes from ``pos`` on into ``buffers``, one after the other, in one
        call (a file's: one ``preadv``, the buffers its iovecs); the count read: less than
        asked where the file ends or the read stopped short, 0 at the end of the file
        (:func:`read_many` and :func:`read_new` go on from there)."""
        ...

    def close(self) -> None:
        """Release the file (idempotent)."""
        ...


class RangeWriter(Protocol):
    """A file of a pending step, written at the offsets given (a target's
    :meth:`~resilient.io.targets.Target.open_writer`). Local; the caller closes it."""

    def write(self, view: memoryview, pos: int) -> None:
        """Write ``view`` at ``pos``."""
        ...

    def resize(self, size: int) -> None:
        """Set the file's size."""
        ...

    def close(self, *, sync: bool) -> None:
        """Make the file durable (with ``sync``), then release it, even if that fails.

        Raises:
            OSError: the file could not be made durable.
        """
        ...


class _Hash(Protocol):
    def update(self, data: memoryview, /) -> None: ...


def pump(
    reader: RangeReader,
    writer: RangeWriter,
    chunk: memoryview,
    offset: int,
    length: int,
    hash: _Hash,
) -> None:
    """The library's one copy loop: ``length`` bytes from ``offset`` of ``reader`` to the same
    offset of ``writer``, through ``chunk`` (a bounce buffer), each piece hashed into ``hash``
    as it is read.

    Raises:
        EOFError: ``reader`` ends first.
    """
    pos, end = offset, offset + length
    while pos < end:
        view = chunk[: min(len(chunk), end - pos)]
        reader.read(view, pos)
        hash.update(view)
        writer.write(view, pos)
        pos += len(view)


def copy_ranges(
    reader: RangeReader,
    writer: RangeWriter,
    ranges: Sequence[tuple[int, int, str, str]],
    *,
    where: str,
    size: int | None = None,
    bounce: Bounce | None = None,
) -> None:
    """Copy byte ranges of ``reader`` to the same offsets of ``writer``, verifying each one
    (:func:`pump`). The bytes pass through ``bounce``'s buffer (none given: one mapped for this
    call). ``writer`` is left open (its owner closes it, with the fsync).

    Each range is ``(offset, length, xxh3-64 hex digest, label)``; its bytes are hashed as they
    are read, so a corrupt source is never copied as if it were good. Like :func:`write_file`,
    several ranks may copy parts of one file concurrently: the destination is created if
    missing and never truncated; the one passing ``size`` sets the file's size.

    Args:
        where: the source file, for messages.

    Raises:
        ValueError: a range's bytes do not match its digest (naming its label).
        EOFError: the source ends early.
    """
    import xxhash

    need = max((n for _, n, _, _ in ranges), default=0)
    with _bounce(bounce, need) as chunk:
        if size is not None:
            writer.resize(size)
        for offset, length, expected, label in ranges:
            h = xxhash.xxh3_64()
            try:
                pump(reader, writer, chunk, offset, length, h)
            except EOFError as exc:
                name = where.rsplit("/", 1)[-1]
                raise EOFError(f"{name}: {exc}, expected {offset + length}") from None
            if h.hexdigest() != expected:
                raise ValueError(f"checksum mismatch in {where}: {label}")


class ReadWatcher(Protocol):
    """Told, as reading goes on, what is in memory (to checksum it while the next bytes are
    read). Positions are those of the arrays in the request."""

    def arrays(self, positions: Sequence[int], arrays: Sequence[npt.NDArray[Any]]) -> None:
        """These arrays are complete."""

    def piece(self, position: int, data: memoryview, last: bool) -> None:
        """The next bytes of a large array, read a piece at a time (``last``: its end)."""

    def fault(self, data: memoryview) -> Callable[[], object]:
        """Start faulting in the pages under ``data`` (new memory, read into next); return
        what waits until they are in."""


_READ_CHUNK = 2 << 20  # a span is read this many bytes at a time when someone is told


def read_many(
    reader: RangeReader,
    items: Sequence[tuple[int, npt.NDArray[np.generic]]],
    *,
    arrived: ReadWatcher | None = None,
    fresh: bool = False,
) -> None:
    """Fill each C-contiguous array with the bytes of ``reader`` at its offset.

    Arrays lying close together (HDF5's metadata between them) are read by one ``preadv`` per
    run of up to 512 of them: the arrays themselves are its iovecs (the bytes between them go
    to a scratch buffer), so 4,000 small arrays are eight system calls, no copy, and the runs
    are found with numpy (no Python per array). With ``arrived``, a run holds about 2 MiB at
    most, ``arrived`` is told after each read which arrays it completed, and an array larger
    than that is read a piece at a time, each piece told as it arrives; with ``fresh`` too
    (arrays of new memory whose pages are not in yet), each piece's pages are faulted in
    (``arrived.fault``) while the piece before it is read.

    Raises:
        EOFError: the file ends early.
    """
    import numpy as np

    count = len(items)
    if not count:
        return
    arrays = list(map(_SECOND, items))
    offsets = np.fromiter(map(_FIRST, items), np.int64, count)
    sizes = np.fromiter(map(_NBYTES, arrays), np.int64, count)
    present = np.flatnonzero(sizes)
    order = present[np.argsort(offsets[present], kind="stable")]
    start, end = offsets[order], offsets[order] + sizes[order]
    ordered = list(map(arrays.__getitem__, order.tolist()))
    gaps = start[1:] - end[:-1]
    cuts = [0, *(np.flatnonzero((gaps < 0) | (gaps > _SPAN_GAP)) + 1).tolist(), len(order)]
    limit = _READ_CHUNK if arrived is not None else _MAX_READ
    # where the bytes between two arrays of a span are read to (never looked at)
    inner = gaps[(gaps > 0) & (gaps <= _SPAN_GAP)]
    scratch = memoryview(bytearray(int(inner.max()) if inner.size else 0))
    for a, b in itertools.pairwise(cuts):
        k = a
        while k < b:  # a run: whole arrays, at most IOV_MAX iovecs with the gaps between them
            stop = int(np.searchsorted(end[k:b], start[k] + limit, "right")) + k
            stop = min(max(stop, k + 1), b, k + _IOV_MAX // 2)
            if arrived is not None and stop == k + 1 and end[k] - start[k] > limit:
                _read_pieces(reader, ordered[k], int(start[k]), int(order[k]), arrived, fresh=fresh)
                k = stop
                continue
            if fresh and arrived is not None:  # their pages in one call each, not by faults
                for wait in [arrived.fault(_bytes_view(a)) for a in ordered[k:stop]]:
                    wait()
            bufs: list[_Buffer] = ordered[k:stop]
            holes = np.flatnonzero(gaps[k : stop - 1] > 0)
            for h in holes[::-1].tolist():  # from the back: the positions stay right
                bufs.insert(h + 1, scratch[: int(gaps[k + h])])
            _preadv_all(reader, bufs, int(start[k]), int(end[stop - 1] - start[k]))
            if arrived is not None:
                arrived.arrays(order[k:stop].tolist(), ordered[k:stop])
            k = stop


def _read_pieces(
    reader: RangeReader,
    array: npt.NDArray[np.generic],
    offset: int,
    position: int,
    watcher: ReadWatcher,
    *,
    fresh: bool,
) -> None:
    """Read one large array ``_READ_CHUNK`` bytes at a time, telling ``watcher`` each piece
    (and, ``fresh``, having the next piece's pages faulted in while this one is read)."""
    data = _bytes_view(array)
    size = len(data)
    ready = watcher.fault(data[:_READ_CHUNK]) if fresh else None
    for pos in range(0, size, _READ_CHUNK):
        end = pos + _READ_CHUNK
        after = watcher.fault(data[end : end + _READ_CHUNK]) if fresh and end < size else None
        if ready is not None:
            ready()
        piece = data[pos:end]
        _preadv_all(reader, [piece], offset + pos, len(piece))
        watcher.piece(position, piece, end >= size)
        ready = after


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_MAX_READ = 1 << 62


def read_new(
    reader: RangeReader,
    offsets: Sequence[int | None],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype[Any]],
    *,
    allocate: Allocate,
    arrived: ReadWatcher | None = None,
    nbytes: Sequence[int] | None = None,
) -> list[npt.NDArray[Any]]:
    """New arrays holding the datasets at ``offsets`` (``None``: empty) of ``reader``, in order
    (``nbytes``: their sizes, if known).

    Small datasets (< 1 MiB) lying close together are read by one ``preadv`` into one new
    buffer that mirrors the file from the first to the last (64-byte aligned, like the file),
    and come back as views of it: no copy, no Python per array (4,000 arrays: one read and one
    ``map``). A view that would be misaligned for its dtype is copied instead. Large ones get
    their own array from ``allocate`` and are read straight into it. With ``arrived``, spans
    are read about 2 MiB at a time and ``arrived`` is told after each read which arrays are
    complete (empty ones are never told) or, of a large array, which piece arrived; the large
    arrays' pages are then faulted in a piece ahead of the read (``populate=False``) instead of
    all before it.

    Raises:
        EOFError: the file ends early.
    """
    import numpy as np

    count = len(offsets)
    out: list[Any] = [None] * count
    if nbytes is None:
        sizes = np.fromiter(map(operator.attrgetter("itemsize"), dtypes), np.int64, count)
        sizes *= np.fromiter(map(math.prod, shapes), np.int64, count)
    else:
        sizes = np.array(nbytes, np.int64)
    present = np.flatnonzero(sizes)
    for i in np.flatnonzero(sizes == 0).tolist():
        out[i] = np.empty(shapes[i], dtypes[i])
    if len(present) == count:
        starts = np.array(offsets, dtype=np.int64)
    else:
        starts = np.zeros(count, dtype=np.int64)
        starts[present] = [offsets[i] for i in present.tolist()]
    large = present[sizes[present] >= DIRECT_MIN].tolist()
    for i in large:
        out[i] = allocate(shapes[i], dtypes[i], populate=arrived is None)
    told = None if arrived is None else _Renumbered(arrived, large)
    read_many(reader, [(int(starts[i]), out[i]) for i in large], arrived=told, fresh=True)
    small = present[sizes[present] < DIRECT_MIN]
    order = small[np.argsort(starts[small], kind="stable")]
    begin, end = starts[order], starts[order] + sizes[order]
    gaps = begin[1:] - end[:-1]
    cuts = [0, *(np.flatnonzero((gaps < 0) | (gaps > _SPAN_GAP)) + 1).tolist(), len(order)]
    for a, b in itertools.pairwise(cuts):
        if a == b:
            continue
        base = int(begin[a]) - int(begin[a]) % 64
        arena = _aligned_empty(int(end[a:b].max()) - base)
        index = order[a:b].tolist()
        views = _views(arena, begin[a:b] - base, sizes[order[a:b]], index, shapes, dtypes)
        if arrived is None:
            _preadv_all(reader, [arena[int(begin[a]) - base :]], int(begin[a]))
        else:  # in pieces of whole arrays, each told once read
            relative_end = end[a:b] - base
            ends = relative_end.tolist()
            pos = int(begin[a]) - base
            k = 0
            while k < len(index):
                stop = int(np.searchsorted(relative_end, pos + _READ_CHUNK, "right"))
                stop = max(stop, k + 1)
                upto = max(ends[k:stop])
                _preadv_all(reader, [arena[pos:upto]], base + pos)
                arrived.arrays(index[k:stop], views[k:stop])
                pos, k = upto, stop
        if (begin[a:b] % _VIEW_ALIGN).any():  # a view misaligned for its dtype is copied
            views = [view if view.flags.aligned else view.copy() for view in views]
        for i, view in zip(index, views, strict=True):
            out[i] = view
    return out


class Allocate(Protocol):
    """Makes a new array (``populate=False``: its pages may be left for ``fault``)."""

    def __call__(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], *, populate: bool = ...
    ) -> npt.NDArray[Any]: ...


@dataclass(frozen=True, slots=True)
class _Renumbered:
    """A watcher of a sub-request: position ``k`` of it is ``positions[k]`` of the whole."""

    watcher: ReadWatcher
    positions: Sequence[int]

    def arrays(self, positions: Sequence[int], arrays: Sequence[npt.NDArray[Any]]) -> None:
        self.watcher.arrays([self.positions[k] for k in positions], arrays)

    def piece(self, position: int, data: memoryview, last: bool) -> None:
        self.watcher.piece(self.positions[position], data, last)

    def fault(self, data: memoryview) -> Callable[[], object]:
        return self.watcher.fault(data)


_VIEW_ALIGN = 64  # the arena's alignment: a view starting on it is aligned for any dtype


def _views(
    arena: npt.NDArray[Any],
    starts: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
    index: list[int],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype[Any]],
) -> list[npt.NDArray[Any]]:
    """Views of ``arena``: one per array ``index[k]``, starting at ``starts[k]`` (ascending).

    A run of arrays of one shape and dtype, equally spaced (a model's thousands of equal small
    tensors), becomes one array of one more dimension whose rows are the views: numpy makes
    them in C, ~6x faster than one ``ndarray`` call each. The others get a call each.
    """
    import numpy as np

    count = len(index)
    views: list[Any] = [None] * count
    alone = np.ones(count, bool)  # not in a block: one call each
    # a link joins neighbours k, k + 1 of equal size; a run of links at one spacing is a block
    spacing = np.diff(starts)
    link = np.where(sizes[1:] == sizes[:-1], spacing, -1 - np.arange(count - 1))
    breaks = np.flatnonzero(link[1:] != link[:-1]) + 1
    k = 0
    for first, last in itertools.pairwise([0, *breaks.tolist(), count - 1]):
        # links first..last-1 join arrays first..last; the array `first` may be in the block
        # before, which ended at it
        first = max(first, k)
        if last - first < _BLOCK_MIN or link[first] < 0:
            continue
        shape, dtype = shapes[index[first]], dtypes[index[first]]
        members = index[first : last + 1]
        if (
            not shape
            or list(map(shapes.__getitem__, members)).count(shape) != len(members)
            or list(map(dtypes.__getitem__, members)).count(dtype) != len(members)
        ):
            continue
        block = np.ndarray(
            (len(members), *shape),
            dtype,
            arena,
            int(starts[first]),
            (int(link[first]), *_c_strides(shape, dtype.itemsize)),
        )
        views[first : last + 1] = block
        alone[first : last + 1] = False
        k = last + 1
    for k in np.flatnonzero(alone).tolist():
        views[k] = np.ndarray(shapes[index[k]], dtypes[index[k]], arena, int(starts[k]))
    return views


_BLOCK_MIN = 8  # arrays: below this, one call each costs less than finding the block


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides of a C-contiguous array of ``shape``."""
    return tuple(itertools.accumulate(shape[:0:-1], operator.mul, initial=itemsize))[::-1]


def _aligned_empty(nbytes: int) -> npt.NDArray[Any]:
    """A new uint8 buffer of ``nbytes`` starting on a 64-byte boundary."""
    import numpy as np

    raw = np.empty(nbytes + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + nbytes]


_SPAN_GAP = 64 << 10  # arrays at most this far apart are read as one span


def _preadv_all(
    reader: RangeReader, bufs: list[_Buffer], pos: int, total: int | None = None
) -> None:
    """Fill ``bufs`` from ``pos`` on (``total``: their byte count, if the caller knows it)."""
    first = 0
    while first < len(bufs):
        n = reader.readv(bufs[first:], pos)
        if n == 0:
            raise EOFError(f"file ends at byte {pos}")
        if n == total:  # all of it (the usual case): no walk over the pieces
            return
        total = None
        pos += n
        while first < len(bufs) and n >= bufs[first].nbytes:
            n -= bufs[first].nbytes
            first += 1
        if n:  # a short read ended inside a piece
            bufs[first] = memoryview(bufs[first]).cast("B")[n:]  # type: ignore[arg-type]


def _bytes_view(arr: npt.NDArray[np.generic]) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(arr.reshape(-1).view("u1"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- whole files, piece by piece
# (what a partner copy moves: see resilient.io.wire)


def open_read(path: Path) -> int:
    """``path`` opened for reading (never through a symlink); the caller closes it."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)


class FileReader:
    """A file read piece by piece at the offsets asked for (a :class:`RangeReader`). Local; the
    caller closes it.

    Raises:
        OSError: ``path`` cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.fd = open_read(path)

    def read(self, view: memoryview, pos: int) -> None:
        """Fill ``view`` with the file's bytes from ``pos`` on.

        Raises:
            EOFError: the file ends first.
        """
        while view:
            got = os.preadv(self.fd, [view], pos)
            if got == 0:
                raise EOFError(f"the file ends at byte {pos}")
            view, pos = view[got:], pos + got

    def readv(self, buffers: list[_Buffer], pos: int) -> int:
        """See :meth:`RangeReader.readv` (one ``os.preadv``)."""
        return os.preadv(self.fd, buffers, pos)  # type: ignore[arg-type]  # numpy: a buffer

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileWriter:
    """A file written piece by piece at the offsets given, then fsynced (a
    :class:`RangeWriter`). Local.

    With ``direct``, page-aligned pieces from page-aligned memory go through ``O_DIRECT`` where
    the filesystem allows it: no page cache to fill (and evict) on the receiving node. With
    ``exclusive`` the file is new; without, it is created if missing and never truncated
    (several writers may fill parts of it).

    Raises:
        OSError: ``path`` exists (``exclusive``) or cannot be created.
    """

    def __init__(self, path: Path, *, direct: bool, exclusive: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else 0)
        self.fd = os.open(path, flags, 0o644)
        try:
            self._direct = open_direct(path) if direct else None
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, view: memoryview, pos: int) -> None:
        """Write ``view`` at ``pos``."""
        aligned = self._direct is not None and pos % _ALIGN == 0 and len(view) % _ALIGN == 0
        _pwrite_all(self._direct if aligned and self._direct is not None else self.fd, view, pos)

    def resize(self, size: int) -> None:
        """Set the file's size."""
        os.ftruncate(self.fd, size)

    def close(self, *, sync: bool) -> None:
        """fsync the file (with ``sync``), then close it, even if the fsync fails.

        Raises:
            OSError: the fsync failed.
        """
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        try:
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
