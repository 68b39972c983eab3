"""DTensor leaves: a ``torch.distributed.tensor.DTensor`` as this rank's block of its global
tensor. Pure (no I/O, no communication).

FSDP2 (``fully_shard``) and tensor parallelism keep parameters and optimizer state as DTensors:
a global tensor laid out over a device mesh by one placement per mesh dimension. A save stores
each DTensor leaf as a :class:`~resilient.model.blocks.Block` of its global tensor (so that the
elastic restore and ``resilient export`` read it like any block), with these rules:

* ``Shard(d)``, even or uneven (``torch.chunk``'s split: the last ranks may hold fewer rows, or
  none), over any number of mesh dimensions, and ``_StridedShard`` (FSDP2 over tensor
  parallelism) where the rank's piece is one block of the global tensor;
* ``Replicate()``: the piece is written once, by the ranks at coordinate 0 of every mesh
  dimension that replicates it (the lowest rank holding it); the others store an empty block
  (no bytes), as DCP deduplicates;
* anything else (``Partial``, a ``_StridedShard`` whose pieces are not one block) is a
  :class:`~resilient.errors.ConfigError` naming the leaf.

Every rank records the same metadata for a leaf (its mesh shape and placements, by name).

A restore needs the caller's DTensors (``into=``): only the caller has this run's mesh and
placements (a mesh is process groups of this run); each is read in place, through its local
tensor, as a Block of its full local piece (every rank reads what it holds, a replica too).

torch is never imported here: a DTensor comes from a program that imported
``torch.distributed.tensor`` (see :func:`resilient.model.torchlazy.dtensor_type`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resilient.errors import ConfigError
from resilient.model import torchlazy

__all__ = [
    "DTensorPiece",
    "Placement",
    "is_dtensor",
    "local_block",
    "needs_target",
    "piece",
    "writes",
]


@dataclass(frozen=True, slots=True)
class Placement:
    """One mesh dimension's placement of a tensor, described without torch.

    Attributes:
        kind: ``"shard"``, ``"strided"`` (``_StridedShard``) or ``"replicate"``.
        dim: the tensor dimension sharded (``-1`` for a replica).
        split: a ``_StridedShard``'s split factor (1 otherwise).
    """

    kind: str
    dim: int = -1
    split: int = 1


_Segments = tuple[tuple[int, int], ...]  # global index ranges [start, stop), in local order


def _chunk(n: int, parts: int, k: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of chunk ``k`` of ``n`` items split as ``torch.chunk`` does
    (chunks of ``ceil(n / parts)``; the last ones shorter or empty)."""
    size = -(-n // parts) if n else 0
    return min(k * size, n), min((k + 1) * size, n)


def _take(segments: _Segments, lo: int, hi: int) -> _Segments:
    """Positions ``[lo, hi)`` of the concatenation of ``segments``."""
    out = []
    pos = 0
    for a, b in segments:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
    return tuple(out)


def _length(segments: _Segments) -> int:
    return sum(b - a for a, b in segments)


def local_block(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(start, shape)`` of the piece of a global tensor held at ``coordinate`` of a mesh, or
    ``None`` if that piece is not one block of the global tensor (a ``_StridedShard``'s).

    The mesh dimensions shard in order; a ``_StridedShard`` of split factor ``f`` over ``n``
    ranks splits what it is given into ``f`` chunks, each into ``n``, and the rank at ``c``
    holds chunk ``c`` of each of the ``f`` in turn. An empty piece starts at 0.
    """
    held: list[_Segments] = [((0, n),) for n in global_shape]
    for size, coord, p in zip(mesh_shape, coordinate, placements, strict=True):
        if p.kind == "replicate":
            continue
        segs = held[p.dim]
        n = _length(segs)
        if p.kind == "shard":
            held[p.dim] = _take(segs, *_chunk(n, size, coord))
        else:
            parts: list[tuple[int, int]] = []
            for j in range(p.split):
                a, b = _chunk(n, p.split, j)
                s, e = _chunk(b - a, size, coord)
                parts.extend(_take(segs, a + s, a + e))
            held[p.dim] = tuple(parts)
    start, shape = [], []
    for segs in held:
        merged: list[tuple[int, int]] = []
        for a, b in segs:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            elif b > a:
                merged.append((a, b))
        if len(merged) > 1:
            return None
        start.append(merged[0][0] if merged else 0)
        shape.append(merged[0][1] - merged[0][0] if merged else 0)
    if 0 in shape:
        start = [0] * len(start)
    return tuple(start), tuple(shape)


def writes(coordinate: Sequence[int], placements: Sequence[Placement]) -> bool:
    """Whether the rank at ``coordinate`` writes its piece: it is at coordinate 0 of every
    mesh dimension that replicates the tensor (the lowest rank holding that piece)."""
    return all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p.kind == "replicate")


# --------------------------------------------------------------------------- DTensor objects


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing torch)."""
    cls = torchlazy.dtensor_type()
    return cls is not None and isinstance(value, cls)


def _describe(placement: Any, what: str) -> Placement:
    if placement.is_replicate():
        return Placement("replicate")
    if placement.is_shard():
        return Placement("shard", int(placement.dim))
    split = getattr(placement, "split_factor", None)
    if type(placement).__name__ == "_StridedShard" and isinstance(split, int):
        return Placement("strided", int(placement.dim), split)
    raise ConfigError(
        f"{what} placed {placement!r} cannot be saved (Shard, Replicate and FSDP2's "
        "_StridedShard can): redistribute it to Replicate() or Shard() first"
    )


@dataclass(frozen=True, slots=True)
class DTensorPiece:
    """A DTensor as this rank's block of its global tensor.

    Attributes:
        local: the rank's local tensor (the DTensor's own memory).
        global_shape: the global tensor's shape.
        start: where ``local`` starts in it.
        writer: whether this rank stores ``local`` (see :func:`writes`); the others store an
            empty block.
        meta: what every rank records of the leaf: ``{"mesh": [...], "placements": [...]}``.
    """

    local: Any
    global_shape: tuple[int, ...]
    start: tuple[int, ...]
    writer: bool
    meta: Mapping[str, Any]

    @property
    def stored(self) -> Any:
        """What this rank writes: ``local``, or an empty slice of it (another rank writes it)."""
        return self.local if self.writer else self.local[:0]

    @property
    def stored_start(self) -> tuple[int, ...]:
        """Where :attr:`stored` starts in the global tensor."""
        return self.start if self.writer else (0,) * len(self.start)


def piece(value: Any, *, what: str) -> DTensorPiece:
    """DTensor ``value`` as this rank's block (:class:`DTensorPiece`).

    Raises:
        ConfigError: a placement that cannot be saved, a 0-d DTensor, a rank outside the
            DTensor's mesh, or a piece that is not one block; naming ``what``.
    """
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    global_shape = tuple(int(n) for n in value.shape)
    if coordinate is None:
        raise ConfigError(f"{what}: this rank is not in its device mesh")
    if not global_shape:
        raise ConfigError(
            f"{what} of 0 dimensions cannot be saved as a block (save .full_tensor())"
        )
    placements = [_describe(p, what) for p in value.placements]
    mesh_shape = tuple(int(n) for n in mesh.shape)
    found = local_block(global_shape, mesh_shape, tuple(coordinate), placements)
    with torchlazy.load().no_grad():  # without autograd: the DTensor's own local tensor
        local = value.to_local()
    if found is None or found[1] != tuple(local.shape):
        why = "not one block of the global tensor" if found is None else (
            f"of shape {tuple(local.shape)}, not {found[1]} as its placements say"
        )  # fmt: skip
        raise ConfigError(
            f"{what} placed {[repr(p) for p in value.placements]} over a mesh of shape "
            f"{mesh_shape}: this rank's piece is {why}, so it cannot be saved as a block"
        )
    meta = {"mesh": list(mesh_shape), "placements": [repr(p) for p in value.placements]}
    return DTensorPiece(local, global_shape, found[0], writes(coordinate, placements), meta)


def needs_target(
    metas: Mapping[str, Mapping[str, Any]],
    into: Mapping[str, Any],
    blocks: Mapping[str, Any],
    *,
    where: str,
) -> None:
    """Check that every DTensor leaf a checkpoint holds (``metas``: leaf path -> metadata) has
    a target in the restore's ``into`` (or a block in ``blocks``).

    Raises:
        ConfigError: naming the first DTensor leaf without one.
    """
    for path, meta in metas.items():
        if "dtensor" in meta and path not in into and path not in blocks:
            raise ConfigError(
                f"{where}: {path!r} was saved from a DTensor: restore it with into= (a state "
                "of this run's DTensors, e.g. get_model_state_dict(model) after fully_shard, "
                "which are filled in place): only they know this run's mesh and placements"
            )
