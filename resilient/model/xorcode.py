"""The XOR code of the node-local tier's ``redundancy="xor"``: which nodes form a set, and where
each byte of a member's data goes. Pure: no I/O, no communication.

SCR's XOR scheme (redset's ``redset_xor``). The nodes of a job, in the order of their first rank,
are cut into *sets* of at most ``set_size`` (default 8) consecutive nodes, none smaller than 3.
In a set of ``n`` members, member ``j``'s data (its files of one step, one after the other in name
order: :func:`stream_sizes`) is read as ``n - 1`` *chunks* of ``chunk`` bytes each (zeros past its
end: members with less data are padded to the largest). Picture an ``n`` x ``n`` grid: row ``j``
holds member ``j``'s chunks in every column but column ``j``; column ``k``'s *parity*, the XOR of
its ``n - 1`` chunks, is stored by member ``k``::

             column 0   column 1   column 2   column 3
    member 0  parity     D0[0]      D0[1]      D0[2]
    member 1  D1[0]      parity     D1[1]      D1[2]
    member 2  D2[0]      D2[1]      parity     D2[2]
    member 3  D3[0]      D3[1]      D3[2]      parity

Every member stores its own data plus ``chunk = ceil(max data / (n - 1))`` bytes of parity: the
set stores ``n / (n - 1)`` times its data (+14 % at ``n = 8``; partner copies: +100 %). A lost
member ``m``'s chunk in column ``k`` is the XOR of column ``k``'s parity and the other members'
chunks in it; its own parity is the XOR of the survivors' chunks in column ``m``. Two members lost
in one set cannot be recovered.

The parity is computed by a ring reduce-scatter (:func:`ring_schedule`): in ``n - 1`` rounds every
member sends one partial column to the next member and adds its own chunk to the one it
receives, so every member sends and receives about its data's size once; :mod:`resilient.io.
xorwire` runs it over a channel, piece by piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ALIGN",
    "MIN_SET",
    "XorSet",
    "chunk_size",
    "column_range",
    "ring_schedule",
    "sets_of",
    "stream_sizes",
    "xor_into",
]

MIN_SET = 3  # fewer members: a parity chunk is as large as the data (partner copies do better)
ALIGN = 4096  # a chunk is a whole number of pages (O_DIRECT takes it as is; uint64 views fit)


@dataclass(frozen=True, slots=True)
class XorSet:
    """One set: its members (positions in the job's ring of nodes, in order) and this set's
    index among the job's sets."""

    index: int
    members: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.members)

    def position(self, node: int) -> int:
        """The place of ``node`` (a ring position) in this set: its column."""
        return self.members.index(node)


def sets_of(nodes: int, set_size: int) -> tuple[XorSet, ...]:
    """The sets of a job of ``nodes`` nodes: as few as hold at most ``set_size`` nodes each,
    their sizes differing by one at most (9 nodes, size 8: 5 + 4, not 8 + 1), none under
    :data:`MIN_SET`, which may make a set larger than ``set_size`` when that is below 6
    (4 nodes, size 3: one set of 4). Fewer than 3 nodes: no set (the caller says so).

    Raises:
        ValueError: ``set_size`` is below :data:`MIN_SET`.
    """
    if set_size < MIN_SET:
        raise ValueError(f"an XOR set needs at least {MIN_SET} nodes, got a set size of {set_size}")
    if nodes < MIN_SET:
        return ()
    count = min(-(-nodes // set_size), nodes // MIN_SET)
    base, extra = divmod(nodes, count)
    out: list[XorSet] = []
    start = 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        out.append(XorSet(i, tuple(range(start, start + size))))
        start += size
    return tuple(out)


def stream_sizes(files: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """A member's data as one stream: its files (name to size) in name order."""
    return tuple(sorted(files.items()))


def chunk_size(data_sizes: Sequence[int]) -> int:
    """The chunk of a set whose members hold ``data_sizes`` bytes: the largest split in
    ``n - 1`` parts, rounded up to whole pages (at least one page)."""
    n = len(data_sizes)
    if n < MIN_SET:
        raise ValueError(f"an XOR set needs at least {MIN_SET} members, got {n}")
    per = -(-max(data_sizes, default=0) // (n - 1))
    return max(ALIGN, -(-per // ALIGN) * ALIGN)


def column_range(member: int, column: int, chunk: int) -> tuple[int, int]:
    """Where member ``member``'s chunk of column ``column`` lies in its data stream:
    ``(offset, length)``. A member has no chunk in its own column.

    Raises:
        ValueError: ``column == member``.
    """
    if column == member:
        raise ValueError(f"member {member} holds the parity of its own column")
    index = column if column < member else column - 1
    return index * chunk, chunk


def ring_schedule(member: int, n: int) -> tuple[tuple[int, int], ...]:
    """The rounds of the ring reduce-scatter for ``member`` of a set of ``n``: per round, the
    column it sends to the next member and the column it receives from the previous one.

    In round 0 a member sends its own chunk of the column before its own; in each later round it
    sends what it received in the round before with its own chunk added. The column received in
    the last round is its own: the parity it stores.
    """
    return tuple(((member - t - 1) % n, (member - t - 2) % n) for t in range(n - 1))


def xor_into(acc: memoryview, other: memoryview) -> None:
    """``acc ^= other`` in place, as 64-bit words where the lengths allow (the
    XOR's upper bound is that of reading both once and writing one)."""
    if len(acc) != len(other):
        raise ValueError(f"xor of {len(acc)} and {len(other)} bytes")
    words = len(acc) // 8 * 8
    if words:
        a = np.frombuffer(acc[:words], dtype=np.uint64)
        np.bitwise_xor(a, np.frombuffer(other[:words], dtype=np.uint64), out=a)
    if words < len(acc):
        a8 = np.frombuffer(acc[words:], dtype=np.uint8)
        np.bitwise_xor(a8, np.frombuffer(other[words:], dtype=np.uint8), out=a8)
