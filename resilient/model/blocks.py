"""Blocks of global arrays and replicated values: what makes a checkpoint restorable on another
rank count. Pure (no I/O).

A state declares which of its leaves are pieces of one global array and which are the same on
every rank::

    state = {
        "u": Block(u_local, global_shape=(nx, ny), start=(x0, y0)),   # this rank's block
        "t": Replicated(t),                                            # equal on every rank
    }

Both are wrappers: a save records them in the state's tree (:mod:`resilient.model.tree`) and a restore
on the same rank count gives back the plain values. A restore on another rank count (see
:mod:`resilient.checkpoint.elasticread`) gives each rank its new block of every :class:`Block` leaf and saved
rank 0's copy of every :class:`Replicated` subtree.

The rest of this module is the arithmetic of blocks: balanced splits (:func:`block_1d`,
:func:`cartesian_block`), intersections (:func:`intersect`), the check that saved blocks tile their
global array (:func:`check_tiling`) and the row stripes a stored block is checksummed in
(:func:`stripe_rows`, :func:`stripe_range`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from resilient.errors import ConfigError

__all__ = [
    "STRIPE_BYTES",
    "STRIPE_MIN_BYTES",
    "STRIPE_PARTS",
    "Block",
    "BlockSpec",
    "Replicated",
    "block_1d",
    "cartesian_block",
    "check_tiling",
    "intersect",
    "stripe_count",
    "stripe_range",
    "stripe_rows",
    "unwrap",
]

STRIPE_BYTES = 1 << 20
"""Largest target size of one checksummed stripe of a stored block (whole rows along axis 0)."""

STRIPE_PARTS = 32
"""A stored block is cut into at least this many stripes where they stay :data:`STRIPE_MIN_BYTES`
or more: a rank that needs part of the block reads at most a stripe more at each end of its
part, so a small part of a block reads little more than it needs (a 4-MiB block in 1-MiB
stripes: a 4 -> 3 resharding read 1.13x its need; in 128-KiB stripes, 1.03x)."""

STRIPE_MIN_BYTES = 64 << 10
"""Smallest target size of a stripe (fewer digests in the manifest, fewer hash calls)."""

_MAX_DIMS = 32
_MAX_GRID_CELLS = 1 << 22  # above this, check_tiling compares blocks pairwise


def _ints(value: Any, what: str) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{what} must be a sequence of ints, got {value!r}") from None
    out = []
    for v in items:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ConfigError(f"{what} must be a sequence of ints, got {value!r}")
        out.append(int(v.__index__()))
    if any(v < 0 for v in out) or len(out) > _MAX_DIMS:
        raise ConfigError(f"{what} must hold at most {_MAX_DIMS} non-negative ints, got {value!r}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """Where a block lies in its global array.

    Attributes:
        global_shape: the global array's shape.
        start: the block's first index along each axis.
        shape: the block's shape.
    """

    global_shape: tuple[int, ...]
    start: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, global_shape: Any, start: Any, shape: Any, *, what: str = "block") -> BlockSpec:
        """A checked spec from any int sequences.

        Raises:
            ConfigError: not ints, different lengths, no axes, or the block is not inside the
                global shape.
        """
        g = _ints(global_shape, f"{what}: global_shape")
        s = _ints(start, f"{what}: start")
        n = _ints(shape, f"{what}: shape")
        if not g:
            raise ConfigError(f"{what}: a block needs at least one axis (global_shape is ())")
        if not len(g) == len(s) == len(n):
            raise ConfigError(f"{what}: global_shape {g}, start {s} and shape {n} differ in length")
        if any(a + b > c for a, b, c in zip(s, n, g, strict=True)):
            raise ConfigError(f"{what}: block at {s} of shape {n} is outside global shape {g}")
        return cls(g, s, n)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(a + b for a, b in zip(self.start, self.shape, strict=True))

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Block:
    """This rank's block of a global array, as a state leaf.

    Attributes:
        local: the block (a numpy array, a tensor, anything array-like), of the block's shape.
        global_shape: the shape of the global array.
        start: the global index of ``local[0, 0, ...]``.

    The block's shape is ``local``'s; it is checked against ``global_shape`` and ``start`` when
    the state is saved. A restore on the same rank count gives back ``local``'s array; an
    elastic restore reads each rank's new block (see :meth:`CheckpointManager.restore
    <resilient.checkpoint.manager.CheckpointManager.restore>`'s ``blocks``). As a leaf of ``into=``, a
    block is read into ``local`` in place.
    """

    local: Any
    global_shape: Sequence[int]  # normalised to a tuple of ints
    start: Sequence[int]

    def __post_init__(self) -> None:
        g = _ints(self.global_shape, "Block: global_shape")
        s = _ints(self.start, "Block: start")
        if not g or len(g) != len(s):
            raise ConfigError(
                f"Block: global_shape {g} and start {s} must have the same (>0) length"
            )
        object.__setattr__(self, "global_shape", g)  # normalised to tuples of ints
        object.__setattr__(self, "start", s)

    def spec(self, shape: Sequence[int], *, what: str = "Block") -> BlockSpec:
        """The checked spec of this block when ``local`` has ``shape``."""
        return BlockSpec.of(self.global_shape, self.start, shape, what=what)


@dataclass(frozen=True, slots=True)
class Replicated:
    """A subtree (arrays and JSON values) that is the same on every rank, e.g. the step time, a
    data-parallel model or its optimizer state. An elastic restore gives every rank saved rank
    0's copy; a restore on the same rank count gives each rank its own."""

    value: Any


def unwrap(value: Any) -> Any:
    """``value`` with every :class:`Block` and :class:`Replicated` replaced by what it wraps
    (through dicts, lists and tuples; other objects are returned as they are)."""
    if isinstance(value, Block):
        return value.local
    if isinstance(value, Replicated):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [unwrap(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


# --------------------------------------------------------------------------- decompositions


def block_1d(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``n`` items split into ``parts`` balanced parts
    (the first ``n % parts`` parts get one item more)."""
    if parts < 1 or not 0 <= index < parts or n < 0:
        raise ConfigError(
            f"block_1d: need n >= 0 and 0 <= index < parts, got {n}, {parts}, {index}"
        )
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def cartesian_block(
    global_shape: Sequence[int], dims: Sequence[int], coords: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(start, shape)`` of the block at ``coords`` of a process grid ``dims`` (e.g. from
    ``MPI.Compute_dims`` and ``cart.Get_coords(cart.rank)``): :func:`block_1d` along each axis."""
    if not len(global_shape) == len(dims) == len(coords):
        raise ConfigError(f"cartesian_block: {global_shape}, {dims}, {coords} differ in length")
    pieces = [
        block_1d(int(n), int(p), int(c)) for n, p, c in zip(global_shape, dims, coords, strict=True)
    ]
    return tuple(s for s, _ in pieces), tuple(n for _, n in pieces)


# --------------------------------------------------------------------------- arithmetic


def intersect(a: BlockSpec, b: BlockSpec) -> BlockSpec | None:
    """The common part of two blocks of one global array, or ``None`` if they do not overlap."""
    start = tuple(max(x, y) for x, y in zip(a.start, b.start, strict=True))
    stop = tuple(min(x, y) for x, y in zip(a.stop, b.stop, strict=True))
    if any(e <= s for s, e in zip(start, stop, strict=True)):
        return None
    return BlockSpec(a.global_shape, start, tuple(e - s for s, e in zip(start, stop, strict=True)))


def check_tiling(global_shape: Sequence[int], blocks: Sequence[BlockSpec]) -> str | None:
    """What is wrong with ``blocks`` as a tiling of ``global_shape``, or ``None`` if they cover
    every element exactly once (empty blocks are ignored)."""
    g = tuple(global_shape)
    for i, b in enumerate(blocks):
        if len(b.start) != len(g) or len(b.shape) != len(g):
            return f"block {i} has {len(b.shape)} axes, the global shape {g} has {len(g)}"
        if any(s + n > m for s, n, m in zip(b.start, b.shape, g, strict=True)):
            return f"block {i} at {b.start} of shape {b.shape} is outside global shape {g}"
    full = [b for b in blocks if b.size]
    total = sum(b.size for b in full)
    if total != math.prod(g):
        return f"blocks hold {total} elements, the global shape {g} has {math.prod(g)}"
    # Every cell of the grid made of all block boundaries is inside exactly one block or none;
    # with the totals equal, "no cell counted twice" means an exact tiling. A Cartesian
    # decomposition's grid has one cell per block.
    edges = [sorted({0, m, *(b.start[k] for b in full), *(b.stop[k] for b in full)}) for k, m in
             enumerate(g)]  # fmt: skip
    cells = math.prod(max(1, len(e) - 1) for e in edges)
    if cells <= _MAX_GRID_CELLS:
        import bisect

        import numpy as np

        counts = np.zeros([max(1, len(e) - 1) for e in edges], dtype=np.int32)
        for b in full:
            index = tuple(
                slice(bisect.bisect_left(e, s), bisect.bisect_left(e, t))
                for e, s, t in zip(edges, b.start, b.stop, strict=True)
            )
            counts[index] += 1
        if counts.size and int(counts.max()) > 1:
            return "blocks overlap"
        return None
    order = sorted(range(len(full)), key=lambda i: full[i].start[0])
    for pos, i in enumerate(order):
        for j in order[pos + 1 :]:
            if full[j].start[0] >= full[i].stop[0]:
                break
            if intersect(full[i], full[j]) is not None:
                return "blocks overlap"
    return None


def stripe_rows(shape: Sequence[int], itemsize: int) -> int:
    """Rows (along axis 0) per checksummed stripe of a stored block: about :data:`STRIPE_BYTES`
    at most, the block cut into :data:`STRIPE_PARTS` stripes where each stays at least
    :data:`STRIPE_MIN_BYTES`; at least one row, at most the block's."""
    rows = shape[0] if shape else 1
    row = math.prod(shape[1:]) * itemsize
    if not row:
        return max(1, rows)
    parts = max(-(-rows // STRIPE_PARTS), STRIPE_MIN_BYTES // row)
    return max(1, min(STRIPE_BYTES // row, parts, rows))


def stripe_count(rows: int, rows_per_stripe: int) -> int:
    """How many stripes ``rows`` rows make."""
    return -(-rows // rows_per_stripe)


def stripe_range(first_row: int, stop_row: int, rows_per_stripe: int) -> tuple[int, int]:
    """The stripes ``[first, stop)`` holding rows ``[first_row, stop_row)`` of a stored block."""
    return first_row // rows_per_stripe, -(-stop_row // rows_per_stripe)
