"""Checksums taken as bytes move: of a range of an open file (each byte read once), and of
arrays on a helper thread while the caller reads or writes others (:class:`Digests`).

The digests are :mod:`resilient.model.checksum`'s (xxh3-64); this module adds the reads and
the thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from resilient.model.checksum import digest_arrays

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["Digests", "Readv", "digest_file_range", "digest_file_stripes"]

_CHUNK = 8 << 20

T = TypeVar("T")


class Digests:
    """Checksums of arrays handed over as they are read, taken on a helper thread meanwhile
    (the read runs in the kernel, xxh3 in C: both release the GIL), kept by position.

    The helper thread (``resilient-digest``) is this object's own: started by the first
    :meth:`add`, :meth:`add_piece` or :meth:`alongside`, ended by :meth:`result` (or
    :meth:`close`), so no thread outlives the save or restore that used it. That costs a
    thread start and join per save or restore that uses it: ~0.05 ms on an idle machine,
    0.1-0.4 ms (up to 0.8) measured here on a loaded one, where ``Thread.start`` blocks until
    the new thread runs and the caller then waits for its turn on a core. An owner that runs
    many saves or restores avoids it by passing its own single-thread ``helper`` (an executor
    it shuts down itself), which is used and left running.

    Not thread-safe: one reader calls :meth:`add` (and :meth:`put`), then :meth:`result`.
    """

    def __init__(self, count: int, *, helper: Executor | None = None) -> None:
        self._out = [""] * count
        self._jobs: list[Future[None]] = []
        self._streams: dict[int, xxhash.xxh3_64] = {}  # used on the helper thread only
        self._given = helper  # (one thread: the pieces of an array are hashed in order)
        self._own: ThreadPoolExecutor | None = None

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._given is not None:
            return self._given.submit(fn, *args)
        if self._own is None:
            self._own = ThreadPoolExecutor(1, thread_name_prefix="resilient-digest")
        return self._own.submit(fn, *args)

    def add(self, positions: Sequence[int], arrays: Sequence[npt.NDArray[np.generic]]) -> None:
        """Checksum ``arrays`` (complete now, unchanged until :meth:`result`) as the digests
        at ``positions``."""
        self._jobs.append(self._submit(self.take, positions, arrays))

    def add_piece(self, position: int, data: memoryview, last: bool) -> None:
        """Checksum the next bytes of the array at ``position`` (unchanged until
        :meth:`result`); with ``last``, its digest is complete (the same as :meth:`add`'s)."""
        self._jobs.append(self._submit(self._update, position, data, last))

    def _update(self, position: int, data: memoryview, last: bool) -> None:
        stream = self._streams.get(position)
        if stream is None:
            stream = self._streams[position] = xxhash.xxh3_64()
        stream.update(data)
        if last:
            self._out[position] = self._streams.pop(position).hexdigest()

    def alongside(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the helper thread, after the checksums added so far (and before
        :meth:`result`, which ends the thread)."""
        return self._submit(fn)

    def take(self, positions: Sequence[int], arrays: Sequence[npt.NDArray[np.generic]]) -> None:
        """Checksum ``arrays`` now, on the calling thread, as the digests at ``positions``."""
        self.put(positions, digest_arrays(list(arrays)))

    def put(self, positions: Sequence[int], digests: Sequence[str]) -> None:
        """Digests taken by the caller, at ``positions``."""
        if isinstance(positions, range) and positions.step == 1 and len(digests) == len(positions):
            self._out[positions.start : positions.stop] = digests
            return
        for p, digest in zip(positions, digests, strict=True):
            self._out[p] = digest

    def taken(self, positions: Sequence[int]) -> list[str]:
        """The digests at ``positions`` taken so far (``""`` where not yet): complete for those
        added before, when called on the helper thread (by a function :meth:`alongside` runs)."""
        return [self._out[p] for p in positions]

    def result(self) -> list[str]:
        """Every digest, once all are taken (``""`` where nothing was added). The helper thread
        has ended when this returns, or raises the error of a checksum."""
        try:
            for job in self._jobs:
                job.result()
        finally:
            self.close()
        return self._out

    def close(self) -> None:
        """End the helper thread (not a ``helper`` passed in): what it runs finishes, what
        waits for it is dropped. Idempotent; a later :meth:`add` starts a new one. (A
        ``Digests`` dropped without it ends its thread when collected, as any
        ``ThreadPoolExecutor`` does.)"""
        if self._own is not None:
            self._own.shutdown(wait=True, cancel_futures=True)
            self._own = None


Readv = Callable[[list[Any], int], int]
"""``readv(buffers, pos)``: a file's bytes from ``pos`` into ``buffers``, the count read (0 at
its end): ``functools.partial(os.preadv, fd)``, or a reader's
:meth:`~resilient.io.fileio.RangeReader.readv`."""


def digest_file_stripes(
    readv: Readv, offset: int, length: int, stripe: int
) -> tuple[str, list[str]]:
    """xxh3-64 of ``length`` bytes of a file (read by ``readv``) from ``offset`` and of each
    ``stripe`` bytes of it, reading every byte once.

    Raises:
        EOFError: the file ends before ``offset + length``.
    """
    whole = xxhash.xxh3_64()
    parts = []
    buf = bytearray(max(1, min(stripe, length, _CHUNK)))
    view = memoryview(buf)
    pos, end = offset, offset + length
    while pos < end:
        want = min(stripe, end - pos)
        part = xxhash.xxh3_64()
        got = 0
        while got < want:
            n = readv([view[: min(len(buf), want - got)]], pos + got)
            if n == 0:
                raise EOFError(f"file ends at {pos + got}, expected {end}")
            whole.update(view[:n])
            part.update(view[:n])
            got += n
        parts.append(part.hexdigest())
        pos += want
    return whole.hexdigest(), parts


def digest_file_range(readv: Readv, offset: int, length: int) -> str:
    """xxh3-64 of ``length`` bytes of a file (read by ``readv``) from ``offset``; bytes past
    the end read as missing.

    Raises:
        EOFError: the file ends before ``offset + length``.
    """
    h = xxhash.xxh3_64()
    buf = bytearray(min(_CHUNK, max(length, 1)))
    view = memoryview(buf)
    pos, end = offset, offset + length
    while pos < end:
        n = readv([view[: min(len(buf), end - pos)]], pos)
        if n == 0:
            raise EOFError(f"file ends at {pos}, expected {end}")
        h.update(view[:n])
        pos += n
    return h.hexdigest()
