"""The XOR code's transfers over a channel: a set's parity computed by a ring, a lost member's
files and parity rebuilt by a chain of the survivors (:mod:`resilient.model.xorcode` says what goes
where).

*Encode* (:func:`encode`): redset's reduce-scatter. Each member's files are read as one stream
(:class:`DataStream`), piece by piece; in each of the ``n - 1`` rounds of a piece every member
sends a partial column to the next member while it receives one from the previous member, then
adds its own chunk of that column to what it received (``numpy.bitwise_xor`` on 64-bit words).
What it receives in the last round is its own column's parity, written to ``parity`` as it
comes. Each member sends and receives about its data's size once, like a partner copy.

*Rebuild* (:func:`contribute`, :func:`receive_lost`): the survivors form a chain ending at the
lost member's replacement. For every column ``k`` the chain carries the XOR of, per survivor,
its chunk of column ``k`` or (its own column) its stored parity: the lost member's chunk of
column ``k``, and for the lost member's own column its parity. Parity bytes are hashed as they
are read and checked against the digest recorded at the encode.

Both always complete their streams, so no member waits for bytes that do not come: a file that
cannot be read goes as zeros and the problem travels in a trailer (a JSON document) along the
same path; the caller discards what such a run produced. Local: each call pairs with the calls
of the set's other members (no collective).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from resilient.io import fileio
from resilient.io.wire import Channel, new_hash, recv_doc, send_doc
from resilient.model.xorcode import ALIGN, column_range, ring_schedule, xor_into

__all__ = [
    "PARITY_MISMATCH",
    "PARITY_UNREADABLE",
    "PIECE",
    "DataStream",
    "Share",
    "LostMember",
    "Rebuilt",
    "contribute",
    "encode",
    "receive_lost",
]

PIECE = 4 << 20  # bytes per message of a column (a multiple of ALIGN)
PARITY_MISMATCH = "its parity does not match the digest recorded when it was computed"
PARITY_UNREADABLE = "reading the parity"


class DataStream:
    """A member's files as one stream: each file's bytes after the previous one's, in the order
    given, then zeros (the padding to the set's largest member). Reads through the readers it is
    given (a target's :meth:`~resilient.io.targets.Target.open_reader`); a file that cannot be
    read is zeros, and :attr:`problem` says why.

    Args:
        files: ``(name, size, open)`` per file, in stream order; ``open()`` makes its reader.
    """

    def __init__(self, files: Sequence[tuple[str, int, Callable[[], fileio.RangeReader]]]) -> None:
        self.files = list(files)
        self.size = sum(size for _, size, _ in files)
        self.problem: str | None = None
        self._readers: dict[int, fileio.RangeReader] = {}

    def read(self, view: memoryview, pos: int) -> None:
        """Fill ``view`` with the stream's bytes from ``pos`` on (zeros past the end)."""
        start = 0
        for i, (name, size, _) in enumerate(self.files):
            end = start + size
            lo, hi = max(pos, start), min(pos + len(view), end)
            if lo < hi:
                part = view[lo - pos : hi - pos]
                if not self._read_file(i, name, part, lo - start):
                    _zero(part)
            start = end
        if pos + len(view) > self.size:
            _zero(view[max(0, self.size - pos) :])

    def _read_file(self, i: int, name: str, view: memoryview, pos: int) -> bool:
        if self.problem is not None:
            return False
        try:
            reader = self._readers.get(i)
            if reader is None:
                reader = self._readers[i] = self.files[i][2]()
            reader.read(view, pos)
        except (OSError, EOFError) as exc:
            self.problem = f"reading {name}: {getattr(exc, 'strerror', None) or exc}"
            return False
        return True

    def close(self) -> None:
        """Release every reader opened."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def _zero(view: memoryview) -> None:
    np.frombuffer(view, dtype=np.uint8)[:] = 0


def _pieces(chunk: int) -> list[tuple[int, int]]:
    return [(pos, min(PIECE, chunk - pos)) for pos in range(0, chunk, PIECE)]


def _buffers(count: int, size: int) -> list[memoryview]:
    """``count`` page-aligned buffers of ``size`` bytes (O_DIRECT writes take them as is)."""
    half = -(-max(size, 1) // ALIGN) * ALIGN
    area = memoryview(mmap.mmap(-1, count * half))
    return [area[i * half : i * half + size] for i in range(count)]


def encode(
    channel: Channel,
    prev: int,
    next_: int,
    member: int,
    n: int,
    chunk: int,
    data: DataStream,
    parity: fileio.RangeWriter,
) -> tuple[str, str | None]:
    """This member's part of computing its set's parity: ``n - 1`` rounds per piece, sending to
    ``next_`` (the rank of the next member) while receiving from ``prev``; its own column's
    parity written to ``parity`` (left open: the caller closes it with its fsync).

    Returns:
        The digest (xxh3-128) of the parity written, and the first problem met here (a file
        that could not be read, the parity that could not be written: the set's parity is then
        wrong everywhere and the caller must not commit it; the stream went on regardless).
    """
    rounds = ring_schedule(member, n)
    size = min(PIECE, chunk)
    out, inc, own = _buffers(3, size)
    digest = new_hash()
    problem: str | None = None
    with ThreadPoolExecutor(1, thread_name_prefix="resilient-xor-send") as sender:
        for pos, length in _pieces(chunk):
            o, i, w = out[:length], inc[:length], own[:length]
            first = rounds[0][0]
            start, _ = column_range(member, first, chunk)
            data.read(o, start + pos)
            for t, (_, got) in enumerate(rounds):
                sent: Future[None] = sender.submit(channel.send, next_, o)
                channel.recv(prev, i)
                sent.result()
                if t + 1 < len(rounds):  # add this member's chunk, send it on
                    start, _ = column_range(member, got, chunk)
                    data.read(w, start + pos)
                    xor_into(i, w)
                    o, i = i, o
                else:  # this member's column: its parity
                    digest.update(i)
                    if problem is None:
                        try:
                            parity.write(i, pos)
                        except OSError as exc:
                            problem = f"writing the parity: {exc.strerror or exc}"
    return digest.hexdigest(), data.problem or problem


@dataclass(frozen=True, slots=True)
class LostMember:
    """The member a rebuild recovers: its place in the set, and its files in stream order
    (name and size, from the step's manifest)."""

    member: int
    files: tuple[tuple[str, int], ...]


class Share:
    """A survivor's part of every column of a rebuild: its chunk of the column, or in its own
    column its stored parity, hashed as it is read (all of it, in order) and checked against
    ``parity_digest`` at the end (:meth:`problem`)."""

    def __init__(
        self,
        member: int,
        chunk: int,
        data: DataStream,
        parity: fileio.RangeReader,
        parity_digest: str,
    ) -> None:
        self.member, self.chunk, self.data = member, chunk, data
        self.parity, self.parity_digest = parity, parity_digest
        self._hash = new_hash()
        self._problem: str | None = None

    def fill(self, column: int, pos: int, view: memoryview) -> None:
        """``view`` := this survivor's bytes of ``column`` from ``pos`` on."""
        if column == self.member:
            try:
                self.parity.read(view, pos)
            except (OSError, EOFError) as exc:
                self._problem = self._problem or f"{PARITY_UNREADABLE}: {exc}"
                _zero(view)
            self._hash.update(view)
        else:
            start, _ = column_range(self.member, column, self.chunk)
            self.data.read(view, start + pos)

    def problem(self) -> str | None:
        """After every column: the first problem met (a file or the parity unreadable, the
        parity not matching its digest)."""
        if self._problem is None and self._hash.hexdigest() != self.parity_digest:
            self._problem = PARITY_MISMATCH
        return self.data.problem or self._problem


def contribute(
    channel: Channel, prev: int | None, next_: int, n: int, chunk: int, share: Share
) -> str | None:
    """A survivor's part of a rebuild: for every column, its ``share`` added to what ``prev``
    sends (``None``: this is the chain's first survivor), sent to ``next_``; then the trailer.
    Returns the first problem met here (also sent on in the trailer)."""
    size = min(PIECE, chunk)
    bufs = _buffers(3, size)
    pending: Future[None] | None = None
    k = 0
    with ThreadPoolExecutor(1, thread_name_prefix="resilient-xor-send") as sender:
        for column in range(n):
            for pos, length in _pieces(chunk):
                acc = bufs[k % 2][:length]
                mine = bufs[2][:length]
                k += 1
                share.fill(column, pos, mine)
                if prev is None:
                    acc[:] = mine
                else:
                    channel.recv(prev, acc)
                    xor_into(acc, mine)
                if pending is not None:
                    pending.result()  # the buffer's previous send is done
                pending = sender.submit(channel.send, next_, acc)
        if pending is not None:
            pending.result()
    problem = share.problem()
    trailer = {"problems": []} if prev is None else recv_doc(channel, prev)
    problems = list(trailer.get("problems", [])) if isinstance(trailer, dict) else ["garbled"]
    if problem is not None:
        problems.append(problem)
    send_doc(channel, next_, {"problems": problems})
    return problem


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What :func:`receive_lost` made: the parity's digest, and the first problem (``None``:
    every byte arrived and was written; the caller still checks the files' checksums)."""

    parity_digest: str
    error: str | None


def receive_lost(
    channel: Channel,
    prev: int,
    lost: LostMember,
    n: int,
    chunk: int,
    open_file: Callable[[str], fileio.RangeWriter],
    parity: fileio.RangeWriter,
    *,
    share: Share | None = None,
) -> Rebuilt:
    """The lost member's part of a rebuild: receive every column from the chain's last survivor
    ``prev``; write its chunks into its files (``open_file(name)`` makes each one's writer,
    closed here with an fsync) and its own column into ``parity`` (left open). Bytes past the
    end of its files must be zeros (its padding at the encode): any other value means a
    survivor's data or parity was not what the encode saw.

    ``share``: this rank is itself a survivor of the set (it rebuilds a lost member's files
    for another purpose, an elastic restore's staging): its own share is added last."""
    size = min(PIECE, chunk)
    buf, mine = _buffers(2, size)
    member = lost.member
    total = sum(s for _, s in lost.files)
    digest = new_hash()
    errors: list[str] = []
    writers: dict[str, fileio.RangeWriter] = {}

    def write_stream(view: memoryview, pos: int) -> None:
        start = 0
        for name, fsize in lost.files:
            lo, hi = max(pos, start), min(pos + len(view), start + fsize)
            if lo < hi:
                if name not in writers:
                    writers[name] = open_file(name)
                writers[name].write(view[lo - pos : hi - pos], lo - start)
            start += fsize
        past = max(0, min(len(view), pos + len(view) - max(total, pos)))
        if past and np.frombuffer(view[len(view) - past :], dtype=np.uint8).any():
            raise ValueError("the padding past its files rebuilt to nonzero bytes")

    for column in range(n):
        for pos, length in _pieces(chunk):
            view = buf[:length]
            channel.recv(prev, view)
            if share is not None:
                share.fill(column, pos, mine[:length])
                xor_into(view, mine[:length])
            if errors:
                continue
            try:
                if column == member:
                    digest.update(view)
                    parity.write(view, pos)
                else:
                    start, _ = column_range(member, column, chunk)
                    write_stream(view, start + pos)
            except (OSError, ValueError) as exc:
                errors.append(str(getattr(exc, "strerror", None) or exc))
    for name, _ in lost.files:
        try:
            if name not in writers and not errors:  # an empty file
                writers[name] = open_file(name)
            if name in writers:
                writers[name].close(sync=not errors)
        except OSError as exc:
            errors.append(f"syncing {name}: {exc.strerror or exc}")
    trailer = recv_doc(channel, prev)
    problems = trailer.get("problems") if isinstance(trailer, dict) else ["a garbled trailer"]
    if not problems and share is not None and share.problem() is not None:
        problems = [share.problem()]
    if problems:
        errors.insert(0, f"a survivor could not contribute: {problems[0]}")
    return Rebuilt(digest.hexdigest(), errors[0] if errors else None)
