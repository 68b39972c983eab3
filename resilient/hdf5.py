"""HDF5 files of a checkpoint: the sole h5py user.

A group of ranks shares one file. Its leader plans the file (:mod:`resilient.h5format`
computes HDF5's metadata: one HDF5 group per rank, ``/rank_00003``, holding one contiguous,
early-allocated dataset per state key, and attributes for the layout and the rank) and writes
that metadata; every rank writes its arrays' bytes straight to their offsets (``pwrite``) and
fsyncs. The result is an ordinary HDF5 file (``h5py``, ``h5ls``, ``h5dump`` read it) written at
raw-disk speed, with no HDF5 library call and no gather of data to a leader. h5py is used only
to export a global file (:func:`write_global_file`).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient import h5format
from resilient.checksum import digest_bytes
from resilient.h5format import ArraySpec
from resilient.layout import rank_group_name
from resilient.manifest import Segment

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "ArraySpec",
    "FileSkeleton",
    "GlobalDataset",
    "VirtualSource",
    "copy_ranges",
    "create_skeleton",
    "rank_group_name",
    "read_into",
    "read_many",
    "write_file",
    "write_global_file",
]

_ALIGN = h5format.PAGE  # O_DIRECT's alignment: every dataset written through it starts on a page


@dataclass(frozen=True, slots=True)
class FileSkeleton:
    """A file as its leader planned it: offsets per rank, HDF5's own bytes, size.

    The skeleton depends only on the structure (every rank's names, shapes and dtypes): equal
    structures give byte-identical skeletons, and a later save of the same structure writes
    :attr:`image` again without planning (seed 002's metadata cache).

    Attributes:
        offsets: per rank, each dataset's byte offset (``None`` for empty ones).
        meta_segments: HDF5's own byte ranges (everything but the datasets) with checksums.
        size: the file's size.
        image: the bytes of ``meta_segments``, as ``(offset, bytes)``.
    """

    offsets: Mapping[int, Mapping[str, int | None]]
    meta_segments: tuple[Segment, ...]
    size: int
    image: tuple[tuple[int, bytes], ...] = ()


def create_skeleton(
    path: Path, *, layout_kind: str, ranks: Sequence[tuple[int, Sequence[ArraySpec]]]
) -> FileSkeleton:
    """Create the file for a group of ranks, of its final size, and describe it.

    The file holds the structure only (the layout, the ranks, their datasets); the step and the
    JSON values of a checkpoint are in its manifest. :mod:`resilient.h5format` computes HDF5's
    metadata (h5py took ~26 us per dataset; that takes ~0.7 us). The metadata is not
    written here: the leader's :func:`write_file` writes :attr:`FileSkeleton.image` (as it does
    when the skeleton comes from the cache), so writing it here too would write it twice.

    Args:
        path: the file to create (must not exist).
        layout_kind: ``self``, ``node``, ``world`` or ``custom`` (stored as an attribute).
        ranks: per rank of the group, its rank and its array specs.

    Raises:
        ValueError: a name HDF5 cannot hold, or another structure it cannot (see
            :func:`resilient.h5format.plan_file`).
        FileExistsError: ``path`` exists.
    """
    planned = h5format.plan_file(layout_kind, ranks)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, planned.size)
    finally:
        os.close(fd)
    meta = tuple(Segment(o, len(b), digest_bytes(b)) for o, b in planned.pieces)
    return FileSkeleton(
        offsets=planned.offsets, meta_segments=meta, size=planned.size, image=planned.pieces
    )


_DIRECT_MIN = h5format.DIRECT_MIN  # arrays from 1 MiB go through O_DIRECT
_BOUNCE_BYTES = 32 << 20  # page-aligned staging buffer, allocated once per process


class _Bounce:
    """A page-aligned buffer per thread, reused by every save (O_DIRECT needs alignment; the
    writer thread and the caller's thread may both be writing)."""

    local = threading.local()

    @classmethod
    def get(cls) -> memoryview:
        buffer = getattr(cls.local, "buffer", None)
        if buffer is None:
            buffer = cls.local.buffer = mmap.mmap(-1, _BOUNCE_BYTES)
        return memoryview(buffer)


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def _open_direct(path: Path) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:  # e.g. tmpfs: no O_DIRECT; buffered writes are fine there
        return None


def write_file(
    path: Path,
    items: Sequence[tuple[int, npt.NDArray[np.generic]]],
    *,
    skeleton: FileSkeleton | None = None,
    direct: bool = True,
) -> None:
    """Write each C-contiguous array's bytes at its offset in ``path``, then fsync.

    Several ranks may write parts of one file concurrently, in any order: the file is created
    if missing and never truncated by a writer. The group's leader passes ``skeleton``: it
    writes HDF5's own bytes (the cached :attr:`FileSkeleton.image`) and sets the file's size.

    Large arrays go through ``O_DIRECT`` when the filesystem allows it: buffered writers to one
    shared file are serialised by the kernel (ext4 holds the inode lock while it allocates page
    cache), which made shared-file saves bimodal here; direct writes also leave the page cache
    alone. A page-aligned source (a staging buffer) is written as it is; any other goes through
    a reused page-aligned buffer. Unaligned heads and tails, and small arrays, are written
    through the page cache.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    dfd = None
    try:
        small: list[tuple[int, memoryview]] = []
        if skeleton is not None:
            small += [(offset, memoryview(data)) for offset, data in skeleton.image]
            os.ftruncate(fd, skeleton.size)
        if direct and any(arr.nbytes >= _DIRECT_MIN for _, arr in items):
            dfd = _open_direct(path)
        for offset, arr in items:
            view = _bytes_view(arr)
            if dfd is None or len(view) < _DIRECT_MIN:
                small.append((offset, view))
                continue
            head = (-offset) % _ALIGN
            body = (len(view) - head) // _ALIGN * _ALIGN
            small.append((offset, view[:head]))
            if (arr.ctypes.data + head) % _ALIGN == 0:
                _pwrite_all(dfd, view[head : head + body], offset + head)
            else:
                _write_bounced(dfd, view[head : head + body], offset + head)
            small.append((offset + head + body, view[head + body :]))
        _pwrite_runs(fd, small)
        os.fsync(fd)
    finally:
        if dfd is not None:
            os.close(dfd)
        os.close(fd)


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


_GATHER_PIECES = 64  # a run of more pieces is copied into one buffer: one write, not iovecs
_GATHER_MEAN = 16 << 10  # ... when they are small on average (larger ones: iovecs, no copy)


def _gathers(pieces: Sequence[tuple[int, memoryview]] | list[memoryview]) -> bool:
    """Whether copying ``pieces`` through the bounce buffer beats one iovec each (many, small)."""
    if len(pieces) < _GATHER_PIECES:
        return False
    total = sum(len(p) if isinstance(p, memoryview) else len(p[1]) for p in pieces)
    return total < _GATHER_MEAN * len(pieces)


def _pwrite_runs(fd: int, pieces: list[tuple[int, memoryview]]) -> None:
    """Write ``(offset, bytes)`` pieces, one system call per run of adjacent ones.

    A state of 4,000 small arrays is a few runs (HDF5's metadata between them included), not
    4,000 system calls. A run of many small pieces is first copied into the bounce buffer: the
    kernel spends ~1 us per iovec, more than the copy (4,000 x 4 KiB: 14 ms instead of 18-22,
    against 10 ms for the same bytes in one piece).
    """
    for start, run in _runs(pieces):
        if not _gathers(run):
            _pwritev_all(fd, run, start)
        else:
            _write_gathered(fd, run, start)


def _write_gathered(fd: int, views: list[memoryview], pos: int) -> None:
    """Write adjacent ``views`` from ``pos``, copied into the bounce buffer chunk by chunk."""
    bounce = _Bounce.get()
    filled = 0
    for view in views:
        while view:
            n = min(len(view), len(bounce) - filled)
            bounce[filled : filled + n] = view[:n]
            filled, view = filled + n, view[n:]
            if filled == len(bounce):
                _pwrite_all(fd, bounce, pos)
                pos, filled = pos + filled, 0
    if filled:
        _pwrite_all(fd, bounce[:filled], pos)


def _runs(pieces: Sequence[tuple[int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """Non-empty pieces sorted by offset, grouped into runs of adjacent ones (<= IOV_MAX each)."""
    ordered = sorted((p for p in pieces if len(p[1])), key=lambda p: p[0])
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, view in ordered:
        if offset == end and len(runs[-1][1]) < _IOV_MAX:
            runs[-1][1].append(view)
        else:
            runs.append((offset, [view]))
        end = offset + len(view)
    return runs


def _pwritev_all(fd: int, views: list[memoryview], pos: int) -> None:
    first = 0
    while first < len(views):
        n = os.pwritev(fd, views[first:], pos)
        pos += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:  # a short write ended inside a piece
            views[first] = views[first][n:]


def _write_bounced(dfd: int, view: memoryview, offset: int) -> None:
    """Write an aligned-length ``view`` to aligned ``offset`` through the page-aligned buffer."""
    bounce = _Bounce.get()
    pos = 0
    while pos < len(view):
        n = min(len(bounce), len(view) - pos)
        bounce[:n] = view[pos : pos + n]
        _pwrite_all(dfd, bounce[:n], offset + pos)
        pos += n


def copy_ranges(
    src: Path,
    dst: Path,
    ranges: Sequence[tuple[int, int, str, str]],
    *,
    size: int | None = None,
) -> None:
    """Copy byte ranges of ``src`` to the same offsets of ``dst``, verifying each one, then fsync.

    Each range is ``(offset, length, xxh3-64 hex digest, label)``; its bytes are hashed as they
    are read, so a corrupt source is never copied as if it were good. Like :func:`write_file`,
    several ranks may copy parts of one file concurrently: ``dst`` is created if missing and
    never truncated; the one passing ``size`` sets the file's size.

    Raises:
        ValueError: a range's bytes do not match its digest (naming its label).
        EOFError: ``src`` ends early.
    """
    import xxhash

    chunk = _Bounce.get()
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
    dfd = _open_direct(dst) if any(n >= _DIRECT_MIN for _, n, _, _ in ranges) else None
    try:
        if size is not None:
            os.ftruncate(fd, size)
        for offset, length, expected, label in ranges:
            h = xxhash.xxh3_64()
            pos, end = offset, offset + length
            while pos < end:
                n = min(len(chunk), end - pos)
                got = os.preadv(sfd, [chunk[:n]], pos)
                if got == 0:
                    raise EOFError(f"{src.name} ends at byte {pos}, expected {end}")
                h.update(chunk[:got])
                aligned = dfd is not None and pos % _ALIGN == 0 and got % _ALIGN == 0
                _pwrite_all(dfd if aligned else fd, chunk[:got], pos)  # type: ignore[arg-type]
                pos += got
            if h.hexdigest() != expected:
                raise ValueError(f"checksum mismatch in {src}: {label}")
        os.fsync(fd)
    finally:
        for f in (sfd, fd, dfd):
            if f is not None:
                os.close(f)


def read_into(fd: int, offset: int, arr: npt.NDArray[np.generic]) -> None:
    """Fill C-contiguous ``arr`` with bytes of ``fd`` from ``offset``.

    Raises:
        EOFError: the file ends early.
    """
    read_many(fd, [(offset, arr)])


def read_many(fd: int, items: Sequence[tuple[int, npt.NDArray[np.generic]]]) -> None:
    """Fill each C-contiguous array with the bytes of ``fd`` at its offset.

    Small arrays lying close together (HDF5's metadata between them) are read as one span:
    through the bounce buffer when there are many, then copied out (4,000 arrays are a few
    reads, not 4,000 and not 4,000 iovecs); else, like large arrays, by one ``preadv`` per run
    of adjacent ones.

    Raises:
        EOFError: the file ends early.
    """
    pieces = sorted(((o, _bytes_view(a)) for o, a in items if a.nbytes), key=lambda p: p[0])
    for start, run in _runs([p for p in pieces if len(p[1]) >= _DIRECT_MIN]):
        _preadv_all(fd, run, start)
    for span in _spans([p for p in pieces if len(p[1]) < _DIRECT_MIN]):
        if _gathers(span):
            _read_gathered(fd, span)
        else:
            for start, run in _runs(span):
                _preadv_all(fd, run, start)


_SPAN_GAP = 64 << 10  # arrays at most this far apart are read as one span


def _spans(pieces: list[tuple[int, memoryview]]) -> list[list[tuple[int, memoryview]]]:
    """Sorted pieces grouped into spans whose gaps are at most :data:`_SPAN_GAP` bytes."""
    spans: list[list[tuple[int, memoryview]]] = []
    end = -1
    for offset, view in pieces:
        if spans and 0 <= offset - end <= _SPAN_GAP:
            spans[-1].append((offset, view))
        else:
            spans.append([(offset, view)])
        end = max(end, offset + len(view))
    return spans


def _read_gathered(fd: int, span: list[tuple[int, memoryview]]) -> None:
    """Read the bytes from the first piece's start to the last one's end through the bounce
    buffer, chunk by chunk, and copy each piece's bytes out."""
    bounce = _Bounce.get()
    pos, end = span[0][0], max(o + len(v) for o, v in span)
    first = 0  # the first piece not yet filled completely
    while pos < end:
        n = _pread_full(fd, bounce[: min(len(bounce), end - pos)], pos)
        stop = pos + n
        i = first
        while i < len(span) and span[i][0] < stop:
            offset, view = span[i]
            lo, hi = max(offset, pos), min(offset + len(view), stop)
            if hi > lo:
                view[lo - offset : hi - offset] = bounce[lo - pos : hi - pos]
            if offset + len(view) <= stop and i == first:
                first += 1
            i += 1
        pos = stop


def _pread_full(fd: int, view: memoryview, pos: int) -> int:
    """Fill ``view`` from ``pos``; its length, or EOFError when the file ends first."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], pos + got)
        if n == 0:
            raise EOFError(f"file ends at byte {pos + got}")
        got += n
    return got


def _preadv_all(fd: int, views: list[memoryview], pos: int) -> None:
    first = 0
    while first < len(views):
        n = os.preadv(fd, views[first:], pos)
        if n == 0:
            raise EOFError(f"file ends at byte {pos}")
        pos += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:  # a short read ended inside a piece
            views[first] = views[first][n:]


def _bytes_view(arr: npt.NDArray[np.generic]) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(arr.reshape(-1).view("u1"))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class VirtualSource:
    """One stored block as a source of a virtual dataset: its file, the dataset in it, its shape
    and where it starts in the global array."""

    file: Path
    dataset: str
    shape: tuple[int, ...]
    start: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GlobalDataset:
    """One dataset of an exported file (:mod:`resilient.export`).

    Attributes:
        name: its path in the file (groups are created as needed).
        shape: its shape.
        dtype: its dtype string.
        sources: for a virtual dataset, the stored blocks it maps (no data is copied).
        pieces: otherwise, yields ``(start, array)`` pieces that together fill it.
        attrs: its attributes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[VirtualSource, ...] | None = None
    pieces: Callable[[], Iterator[tuple[tuple[int, ...], npt.NDArray[Any]]]] | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)


def write_global_file(
    path: Path, datasets: Sequence[GlobalDataset], *, attrs: Mapping[str, Any]
) -> None:
    """Write ``path`` (through a temporary file and a rename) holding ``datasets``: virtual
    datasets over the checkpoint's files, or real data written piece by piece."""
    import h5py
    import numpy as np

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w", libver=("v110", "latest")) as f:
            for key, value in attrs.items():
                f.attrs[key] = value
            for d in datasets:
                dtype = np.dtype(d.dtype)
                size: int = math.prod(d.shape)
                if d.sources is not None and size:
                    layout = h5py.VirtualLayout(shape=d.shape, dtype=dtype)
                    for s in d.sources:
                        if math.prod(s.shape):
                            index = tuple(
                                slice(a, a + n) for a, n in zip(s.start, s.shape, strict=True)
                            )
                            layout[index] = h5py.VirtualSource(
                                os.fspath(s.file), s.dataset, shape=s.shape, dtype=dtype
                            )
                    dset = f.create_virtual_dataset(d.name, layout)
                else:
                    dset = f.create_dataset(d.name, shape=d.shape, dtype=dtype)
                    for start, arr in d.pieces() if d.pieces is not None else ():
                        if arr.size:
                            dset[
                                tuple(
                                    slice(a, a + n) for a, n in zip(start, arr.shape, strict=True)
                                )
                            ] = arr
                for key, value in d.attrs.items():
                    dset.attrs[key] = value
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
