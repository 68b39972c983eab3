"""Staging buffers for asynchronous saves: a copy of the state that the program cannot touch.

An asynchronous save copies every array into a buffer of its own and writes from there, so the
program may change its arrays as soon as ``save()`` returns. The buffers are kept and reused by
every later save of the same names, shapes and dtypes: on this kind of VM a copy into fresh
memory runs at ~0.45 GB/s (first touch of pages the host took back) but at ~14 GB/s into a
buffer already touched (../MACHINE.md, gotcha 11). They are anonymous memory maps, so they
start on a page boundary and the writer can hand them to ``O_DIRECT`` without another copy.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["StagingArea", "allocate"]

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
        self, arrays: Mapping[str, npt.NDArray[np.generic]]
    ) -> dict[str, npt.NDArray[np.generic]]:
        """Copy ``arrays`` into this area's buffers; return the copies, by name.

        The copies stay valid until the next :meth:`stage` or :meth:`release`. Buffers of names
        no longer present are released; a name whose shape or dtype changed gets a new one.
        """
        import numpy as np

        for name in list(self._buffers):
            if name not in arrays:
                del self._buffers[name]
        out: dict[str, npt.NDArray[np.generic]] = {}
        for name, arr in arrays.items():
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


def allocate(shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> npt.NDArray[np.generic]:
    """A new array whose pages are already faulted in (an anonymous map, page-aligned).

    On this kind of VM touching new memory page by page costs ~2.3 s per GiB (the host took the
    pages back); ``MAP_POPULATE`` faults them in one go: reading 512 MiB from disk into a fresh
    ``np.empty`` took 2.5 s, into a populated map 0.64 s, the same as into a reused buffer. Small
    arrays come from ``np.empty``.
    """
    import numpy as np

    count = math.prod(shape)
    if count * dtype.itemsize < _POPULATE_MIN:
        return np.empty(shape, dtype=dtype)
    region = mmap.mmap(
        -1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE
    )
    return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)
