"""HDF5 files of a checkpoint: the sole h5py user.

A group of ranks shares one file. Its leader creates the file with h5py: one HDF5 group per
rank (``/rank_00003``) holding one contiguous, early-allocated, never-filled dataset per state
key, and attributes for the step, the rank and the datasets' byte offsets. Then every rank
writes its arrays' bytes straight to those offsets (``pwrite``) and fsyncs. The result is an
ordinary HDF5 file (``h5py``, ``h5ls``, ``h5dump`` read it) written at raw-disk speed, with serial
h5py only and no gather of data to a leader.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient.checksum import digest_file_range
from resilient.manifest import Segment

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "ArraySpec",
    "FileSkeleton",
    "create_skeleton",
    "rank_group_name",
    "read_into",
    "write_arrays",
]

_ALIGN = 4096  # each dataset >= 4 KiB starts on its own page: no two ranks share a page


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array a rank wants written: its name, shape and dtype string."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class FileSkeleton:
    """What the leader learned creating a file: offsets per rank, HDF5's own byte ranges, size."""

    offsets: Mapping[int, Mapping[str, int | None]]
    meta_segments: tuple[Segment, ...]
    size: int


def rank_group_name(rank: int) -> str:
    """Name of the HDF5 group holding ``rank``'s datasets."""
    return f"rank_{rank:05d}"


def create_skeleton(
    path: Path,
    *,
    step: int,
    layout_kind: str,
    ranks: Sequence[tuple[int, Sequence[ArraySpec], Mapping[str, Any]]],
) -> FileSkeleton:
    """Create the file for a group of ranks, allocate every dataset, and describe it.

    Args:
        path: the file to create (must not exist).
        step: the checkpoint step (stored as an attribute).
        layout_kind: ``self``, ``node``, ``world`` or ``custom`` (stored as an attribute).
        ranks: per rank of the group, its rank, its array specs and its JSON values.
    """
    import h5py
    import numpy as np

    offsets: dict[int, dict[str, int | None]] = {}
    extents: list[tuple[int, int]] = []
    with h5py.File(
        path, "w-", libver=("v110", "latest"), alignment_threshold=_ALIGN, alignment_interval=_ALIGN
    ) as f:
        f.attrs["resilient_step"] = step
        f.attrs["resilient_layout"] = layout_kind
        f.attrs["resilient_ranks"] = np.array([r for r, _, _ in ranks], dtype=np.int64)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        for rank, specs, values in ranks:
            group = f.create_group(rank_group_name(rank))
            group.attrs["rank"] = rank
            group.attrs["step"] = step
            group.attrs["values_json"] = json.dumps(dict(values), allow_nan=True)
            rank_offsets: dict[str, int | None] = {}
            for spec in specs:
                dtype = np.dtype(spec.dtype)
                space = (
                    h5py.h5s.create(h5py.h5s.SCALAR)
                    if spec.shape == ()
                    else h5py.h5s.create_simple(spec.shape)
                )
                dset = h5py.h5d.create(
                    group.id, spec.name.encode(), h5py.h5t.py_create(dtype), space, dcpl=dcpl
                )
                nbytes = int(np.prod(spec.shape, dtype=np.int64)) * dtype.itemsize
                offset = dset.get_offset() if nbytes else None
                dset.close()
                if offset is not None:
                    extents.append((int(offset), nbytes))
                rank_offsets[spec.name] = None if offset is None else int(offset)
            group.attrs["offsets_json"] = json.dumps(rank_offsets)
            offsets[rank] = rank_offsets
    size = max([os.stat(path).st_size] + [o + n for o, n in extents])
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)  # no fsync here: every rank of the group fsyncs after writing
        meta = tuple(
            Segment(start, end - start, digest_file_range(fd, start, end - start))
            for start, end in _gaps(extents, size)
        )
    finally:
        os.close(fd)
    return FileSkeleton(offsets=offsets, meta_segments=meta, size=size)


def _gaps(extents: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    gaps, pos = [], 0
    for offset, length in sorted(extents):
        if offset > pos:
            gaps.append((pos, offset))
        pos = max(pos, offset + length)
    if pos < size:
        gaps.append((pos, size))
    return gaps


_DIRECT_MIN = 1 << 20  # arrays from 1 MiB go through O_DIRECT
_BOUNCE_BYTES = 8 << 20  # page-aligned staging buffer, allocated once per process


class _Bounce:
    """A page-aligned buffer reused by every save of this process (O_DIRECT needs alignment)."""

    buffer: mmap.mmap | None = None

    @classmethod
    def get(cls) -> memoryview:
        if cls.buffer is None:
            cls.buffer = mmap.mmap(-1, _BOUNCE_BYTES)
        return memoryview(cls.buffer)


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


def write_arrays(
    path: Path, items: Sequence[tuple[int, npt.NDArray[np.generic]]], *, direct: bool = True
) -> None:
    """Write each C-contiguous array's bytes at its offset in ``path``, then fsync.

    Large arrays go through ``O_DIRECT`` (via a reused page-aligned buffer) when the filesystem
    allows it: buffered writers to one shared file are serialised by the kernel (ext4 holds
    the inode lock while it allocates page cache), which made shared-file saves bimodal here;
    direct writes also leave the page cache alone. Unaligned heads and tails, and small
    arrays, are written through the page cache.
    """
    fd = os.open(path, os.O_WRONLY)
    dfd = None
    try:
        if direct and any(arr.nbytes >= _DIRECT_MIN for _, arr in items):
            dfd = _open_direct(path)
        for offset, arr in items:
            view = _bytes_view(arr)
            if dfd is None or len(view) < _DIRECT_MIN:
                _pwrite_all(fd, view, offset)
                continue
            head = (-offset) % _ALIGN
            body = (len(view) - head) // _ALIGN * _ALIGN
            _pwrite_all(fd, view[:head], offset)
            bounce = _Bounce.get()
            pos = head
            while pos < head + body:
                n = min(len(bounce), head + body - pos)
                bounce[:n] = view[pos : pos + n]
                _pwrite_all(dfd, bounce[:n], offset + pos)
                pos += n
            _pwrite_all(fd, view[head + body :], offset + head + body)
        os.fsync(fd)
    finally:
        if dfd is not None:
            os.close(dfd)
        os.close(fd)


def read_into(fd: int, offset: int, arr: npt.NDArray[np.generic]) -> None:
    """Fill C-contiguous ``arr`` with bytes of ``fd`` from ``offset``.

    Raises:
        EOFError: the file ends early.
    """
    view = _bytes_view(arr)
    pos = offset
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            raise EOFError(f"file ends at byte {pos}")
        view, pos = view[n:], pos + n


def _bytes_view(arr: npt.NDArray[np.generic]) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(arr.reshape(-1).view("u1"))  # type: ignore[arg-type]
