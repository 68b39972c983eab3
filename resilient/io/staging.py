"""Staging buffers for asynchronous saves: a copy of the state that the program cannot touch.

An asynchronous save copies every array into a buffer of its own and writes from there, so the
program may change its arrays as soon as ``save()`` returns. The buffers are kept and reused by
every later save of the same names, shapes and dtypes: on a virtual machine whose host takes
freed pages back, a copy into fresh memory ran at ~0.45 GB/s (the first touch of every page)
and at ~14 GB/s into a buffer touched before (the project's machine, bench/README.md). They are
anonymous memory maps, so they start on a page boundary and the writer can hand them to
``O_DIRECT`` without another copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["StagingArea", "allocate", "fault_in"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the pages in at allocation


class StagingArea:
    """Reusable page-aligned copies of a state's arrays, one buffer per name (local, no I/O)."""

    def __init__(self) -> None:
        self._buffers: dict[str, npt.NDArray[np.generic]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held in buffers."""
        return sum(b.nbytes for b in self._buffers.values())

    def stage(
        self,
        arrays: Mapping[str, npt.NDArray[np.generic]],
        *,
        private: frozenset[str] = frozenset(),
    ) -> dict[str, npt.NDArray[np.generic]]:
        """Copy ``arrays`` into this area's buffers; return the copies, by name.

        The copies stay valid until the next :meth:`stage` or :meth:`release`. Buffers of names
        no longer present are released; a name whose shape or dtype changed gets a new one.
        Names in ``private`` are copies already (device tensors staged by
        :class:`~resilient.io.devicecopy.DeviceStaging`): returned as they are, no buffer kept.
        """
        import numpy as np

        for name in list(self._buffers):
            if name not in arrays or name in private:
                del self._buffers[name]
        out: dict[str, npt.NDArray[np.generic]] = {}
        for name, arr in arrays.items():
            if name in private:
                out[name] = arr
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
                buf = allocate(arr.shape, arr.dtype)
                self._buffers[name] = buf
            np.copyto(buf, arr, casting="no")
            out[name] = buf
        return out

    def release(self) -> None:
        """Drop every buffer."""
        self._buffers.clear()


_POPULATE_MIN = 1 << 20


def allocate(
    shape: tuple[int, ...], dtype: np.dtype[np.generic], *, populate: bool = True
) -> npt.NDArray[np.generic]:
    """A new array whose pages are already faulted in (an anonymous map, page-aligned).

    Where the host of a virtual machine takes freed pages back, touching new memory page by
    page cost ~2.3 s per GiB (the project's machine); ``MAP_POPULATE`` faults them in one go:
    reading 512 MiB from disk into a fresh ``np.empty`` took 2.5 s, into a populated map 0.64 s,
    the same as into a reused buffer. Small arrays come from ``np.empty``.

    With ``populate=False`` the pages are left for :func:`fault_in` to fault in piece by piece
    (a reader faults the next piece in while it reads this one), where the kernel can do that
    (``MADV_POPULATE_WRITE``, Linux 5.14); elsewhere they are faulted in here all the same.
    """
    import numpy as np

    count = math.prod(shape)
    if count * dtype.itemsize < _POPULATE_MIN:
        return np.empty(shape, dtype=dtype)
    lazy = not populate and _can_fault_in()
    region = mmap.mmap(
        -1,
        count * dtype.itemsize,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if lazy else _POPULATE),
    )
    return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)


_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14): fault a range in, writable, in one call


def fault_in(piece: memoryview) -> None:
    """Fault in the pages under ``piece`` (a part of an array from ``allocate(populate=False)``)
    in one system call, writable; a no-op for pages already there or where the kernel cannot."""
    import numpy as np

    if not len(piece):
        return
    address = int(np.frombuffer(piece, np.uint8).ctypes.data)
    head = address % mmap.PAGESIZE
    _madvise(address - head, len(piece) + head, _MADV_POPULATE_WRITE)


@functools.cache  # a fact of the running kernel, the same for every caller
def _can_fault_in() -> bool:
    """Whether ``MADV_POPULATE_WRITE`` works here (tried once on a page of its own)."""
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        ok = _madvise(address, mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0
        del address
        return ok
    except (AttributeError, OSError):
        return False
    finally:
        with contextlib.suppress(BufferError):  # (a ctypes export still alive)
            probe.close()


def _madvise(address: int, length: int, advice: int) -> int:
    return int(_libc_madvise()(address, length, advice))


@functools.cache  # the C library's function, looked up once
def _libc_madvise() -> Any:
    func = ctypes.CDLL(None, use_errno=True).madvise
    func.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    func.restype = ctypes.c_int
    return func
