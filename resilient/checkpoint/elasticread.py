"""An elastic restore's plan and reads: each rank reads its new blocks. No communication.

A checkpoint whose per-rank data is all declared (:class:`~resilient.model.blocks.Block` leaves and
:class:`~resilient.model.blocks.Replicated` subtrees) can be restored on any number of ranks, from
files of any layout. Whether a restore is elastic (:func:`another_layout`, :func:`is_elastic`,
:func:`needs_elastic`), what it reads (:class:`ElasticPlan`) and the reads themselves
(:func:`read_elastic`) are this module's; every function here is local. The collective rounds
around them (who decides, who receives the whole manifest) are
:mod:`resilient.checkpoint.restorer`'s; the staging of a step from a node-local tier's copies
before it is read is :mod:`resilient.checkpoint.tierstaging`'s. Call order::

    coordinator   ElasticPlan.of(manifest)   which leaves are blocks, which are replicated;
                                             anything else is a LayoutMismatchError naming it
    every rank    read_elastic(...)          per Block leaf: the stored blocks overlapping this
                                             rank's new block, one contiguous read of whole
                                             rows each, every stripe read verified; the
                                             replicated leaves from saved rank 0, verified whole

What is verified: a stored block's checksum covers all of it, so a rank that needs only part of
a block reads the stripes of rows (:func:`resilient.model.blocks.stripe_rows`, a thirty-second
of the block, 64 KiB to 1 MiB) that hold its part and verifies each of them; a block read
whole is verified by its stripes, which cover it (not hashed again whole); stripes it does
not read are not verified by this restore (``resilient verify --full`` verifies every block
and stripe of every file).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient.errors import ConfigError, InvalidCheckpointError, LayoutMismatchError
from resilient.io import fileio, storage
from resilient.model.arrays import fill_leaf, restore_leaf, template_spec, writable_view
from resilient.model.blocks import BlockSpec, intersect, stripe_range
from resilient.model.checksum import digest_array, digest_bytes
from resilient.model.layout import Layout
from resilient.model.manifest import DatasetEntry, Manifest, RankEntry
from resilient.model.tiling import block_of, check_blocks
from resilient.model.tree import elastic_kinds, leaf_paths, structure_of, unflatten

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "ElasticPlan",
    "ReadStats",
    "StoredBlock",
    "another_layout",
    "is_elastic",
    "needs_elastic",
    "read_elastic",
    "read_stored_block",
]


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One rank's stored block of a Block leaf: its file, its dataset and where it lies."""

    rank: int
    file: str
    dataset: DatasetEntry
    spec: BlockSpec


@dataclass(slots=True)
class ReadStats:
    """What a restore read from the data files (per rank)."""

    bytes_read: int = 0
    reads: int = 0
    stripes_verified: int = 0
    blocks_verified: int = 0
    files: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class ElasticPlan:
    """What a checkpoint (or static-data set) offers an elastic restore; the same on every rank.

    Attributes:
        tree: saved rank 0's tree (the structure every rank restores).
        blocks: per Block leaf, every rank's stored block, in rank order.
        metas: per Block leaf, its tree metadata (e.g. a torch dtype).
        replicated: saved rank 0's datasets of the array leaves inside Replicated subtrees.
        rank0_file: saved rank 0's file.
    """

    tree: Any
    blocks: Mapping[str, tuple[StoredBlock, ...]]
    metas: Mapping[str, Mapping[str, Any]]
    replicated: Mapping[str, DatasetEntry]
    rank0_file: str

    @classmethod
    def of(cls, manifest: Manifest, *, current: str) -> ElasticPlan:
        """The plan of ``manifest`` (a checked manifest: blocks tile their global arrays).

        Args:
            current: this run's layout, for the error message.

        Raises:
            LayoutMismatchError: per-rank data that is neither a Block nor Replicated, or saved
                ranks whose structures differ; naming the leaf paths.
        """
        if manifest.sharded is not None:  # a shard checks its own blocks only when read
            check_blocks(manifest)
        saved = manifest.layout.describe()
        first = manifest.ranks[0]
        if first.tree is None:  # written before nested states: nothing is declared
            names = sorted({d.name for d in first.datasets} | set(first.values))
            raise LayoutMismatchError(saved, current, names)
        kinds = elastic_kinds(first.tree)
        if kinds.blocking:
            raise LayoutMismatchError(saved, current, kinds.blocking)
        shape = json.dumps(structure_of(first.tree))
        for r, entry in enumerate(manifest.ranks[1:], start=1):
            if entry.tree is None or json.dumps(structure_of(entry.tree)) != shape:
                raise LayoutMismatchError(saved, current, _differences(first, entry, r))
        blocks: dict[str, list[StoredBlock]] = {p: [] for p in kinds.blocks}
        for r, entry in enumerate(manifest.ranks):
            by_name = {d.name: d for d in entry.datasets}
            metas = leaf_paths(entry.tree)
            for path in kinds.blocks:
                d = by_name[path]
                blocks[path].append(StoredBlock(r, entry.file, d, block_of(metas[path], d)))
        by_name = {d.name: d for d in first.datasets}
        return cls(
            tree=first.tree,
            blocks={p: tuple(b) for p, b in blocks.items()},
            metas=kinds.blocks,
            replicated={p: by_name[p] for p in kinds.replicated},
            rank0_file=first.file,
        )


def _differences(first: RankEntry, other: RankEntry, rank: int) -> list[str]:
    """The leaf paths in which saved rank ``rank``'s structure differs from rank 0's."""
    if other.tree is None:
        return [f"<rank {rank}: no tree>"]
    a, b = leaf_paths(first.tree), leaf_paths(other.tree)
    diff = sorted(set(a) ^ set(b))
    if not diff:
        diff = sorted(p for p in a if json.dumps(structure_of(["a", p, dict(a[p])]))
                      != json.dumps(structure_of(["a", p, dict(b[p])])))  # fmt: skip
    return diff or [f"<the structure of rank {rank} differs from rank 0's>"]


def another_layout(saved: Layout, current: Layout) -> bool:
    """Whether a checkpoint of layout ``saved`` can only be read elastically on ``current``:
    another rank count or kind of layout."""
    return (saved.nranks, saved.kind) != (current.nranks, current.kind)


def is_elastic(
    manifest: Manifest, current: Layout, wanted: Sequence[Mapping[str, BlockSpec]]
) -> bool:
    """Whether restoring ``manifest`` (every entry loaded) on ``current`` with the new blocks
    ``wanted`` (every rank's) is an elastic restore: :func:`another_layout`, or a rank whose
    new blocks differ from its saved ones (:func:`needs_elastic`)."""
    if another_layout(manifest.layout, current):
        return True
    return any(
        blocks and needs_elastic(manifest.ranks[r], blocks) for r, blocks in enumerate(wanted)
    )


def needs_elastic(entry: RankEntry, blocks: Mapping[str, BlockSpec]) -> bool:
    """Whether a rank whose saved piece is ``entry`` needs another block than the one it saved
    for one of the Block leaves in ``blocks`` (same rank count and layout)."""
    if not blocks or entry.tree is None:
        return False
    by_name = {d.name: d for d in entry.datasets}
    for path, meta in elastic_kinds(entry.tree).blocks.items():
        want = blocks.get(path)
        if want is not None:
            have = block_of(meta, by_name[path])
            if (have.global_shape, have.start, have.shape) != (
                want.global_shape, want.start, want.shape,
            ):  # fmt: skip
                return True
    return False


def read_elastic(
    files: Callable[[str], fileio.RangeReader],
    where: str,
    plan: ElasticPlan,
    *,
    blocks: Mapping[str, BlockSpec],
    into: Mapping[str, Any],
    stats: ReadStats,
    absent: set[str] | None = None,
) -> dict[str, Any]:
    """Read this rank's new blocks and the replicated leaves of a checkpoint, verifying them,
    and rebuild saved rank 0's structure.

    Args:
        files: opens the data files of the checkpoint (or static data) copy by name (a target's
            ``functools.partial(target.open_reader, step)``).
        where: that copy, for messages (a directory's path).
        blocks: this rank's new block of every Block leaf of ``plan``, by leaf path.
        into: existing arrays to read into, by leaf path (their shapes must fit).
        stats: counts what was read (added to).
        absent: devices that tensors were saved on and that do not exist here are added to it
            (those tensors come back on the CPU); ``None``: this read logs them, one line.

    Raises:
        ConfigError: a Block leaf without a new block, a block of another global shape, or an
            ``into`` array that does not fit.
        InvalidCheckpointError: a stripe or block checksum mismatch, or a truncated file.
    """
    import numpy as np

    arrays: dict[str, Any] = {}
    targets: dict[str, tuple[Any, Any]] = {}  # path -> (array read into, template to fill)
    for path, stored in plan.blocks.items():
        want = blocks.get(path)
        if want is None:
            raise ConfigError(
                f"elastic restore: no block given for Block leaf {path!r} (pass "
                f"blocks={{{path!r}: (global_shape, start, shape)}} or a Block in into=)"
            )
        if want.global_shape != stored[0].spec.global_shape:
            raise ConfigError(
                f"elastic restore: {path!r} has global shape {stored[0].spec.global_shape} "
                f"in the checkpoint, {want.global_shape} here"
            )
        dtype = np.dtype(stored[0].dataset.dtype)
        targets[path] = _target(path, into.get(path), want.shape, dtype)
    for path, d in plan.replicated.items():
        targets[path] = _target(path, into.get(path), d.shape, np.dtype(d.dtype))

    opened: dict[str, fileio.RangeReader] = {}

    def reader_of(name: str) -> fileio.RangeReader:
        if name not in opened:
            opened[name] = files(name)
            stats.files.add(name)
        return opened[name]

    def read_all() -> None:
        for path, stored in plan.blocks.items():
            want = blocks[path]
            out = targets[path][0]
            for sb in stored:  # only the files this rank reads are opened (a staged copy of
                if intersect(sb.spec, want) is not None:  # a node-local one holds only those)
                    _copy_overlap(reader_of(sb.file), sb, want, out, stats, where, path)
        for path, d in plan.replicated.items():
            out = targets[path][0]
            if d.offset is not None and d.nbytes:
                fileio.read_many(reader_of(plan.rank0_file), [(d.offset, out)])
                stats.bytes_read += d.nbytes
                stats.reads += 1
            if digest_array(out) != d.checksum:
                raise InvalidCheckpointError(
                    where,
                    f"checksum mismatch: rank 0 dataset {path!r} in {plan.rank0_file}",
                )
            stats.blocks_verified += 1

    try:
        storage.retry_io(read_all, what=f"reading {where} (elastic restore)")
    except EOFError as exc:
        raise InvalidCheckpointError(where, f"a data file is truncated: {exc}") from None
    finally:
        for reader in opened.values():
            reader.close()
    for path, (arr, template) in targets.items():
        if template is not None and arr is not template:
            fill_leaf(template, arr)
        arrays[path] = template if template is not None else arr
    metas = {**plan.metas, **leaf_paths(plan.tree)}
    missing: set[str] = set() if absent is None else absent
    built = unflatten(
        plan.tree,
        lambda path, meta: (
            arrays[path]
            if path in into
            else restore_leaf(arrays[path], metas[path], absent=missing)
        ),
    )
    assert isinstance(built, dict)
    if absent is None and missing:
        log.warning("%s: tensors saved on %s are restored on the CPU (no such device here)",
                    where, ", ".join(sorted(missing)))  # fmt: skip
    return built


def _target(
    path: str, template: Any, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> tuple[Any, Any]:
    """The array to read ``path`` into (a template's own memory where possible) and the template."""
    from resilient.io.staging import allocate

    if template is None:
        return allocate(shape, dtype), None
    have_shape, have_dtype = template_spec(template)
    if have_shape != shape or have_dtype != dtype.str:
        raise ConfigError(
            f"elastic restore into the given arrays: {path!r} is {have_dtype} {have_shape} here "
            f"but {dtype.str} {shape} is restored"
        )
    view = writable_view(template)
    return (view if view is not None else allocate(shape, dtype)), template


def _copy_overlap(
    reader: fileio.RangeReader,
    sb: StoredBlock,
    want: BlockSpec,
    out: npt.NDArray[Any],
    stats: ReadStats,
    where: str,
    path: str,
) -> None:
    """Copy the part of stored block ``sb`` inside ``want`` into ``out``: one read of the whole
    rows (the stripes holding them), each stripe verified (a whole block by its stripes
    alone), then the columns sliced out; read
    straight into ``out`` when those rows are exactly the overlap and lie contiguous there.

    A checksum mismatch raises with ``out`` partly overwritten: the restore then fails as a
    whole (or falls back to an older step, which rewrites it)."""
    import numpy as np

    common = intersect(sb.spec, want)
    if common is None:
        return
    d = sb.dataset
    assert d.stripes is not None and d.offset is not None  # checked when the manifest was parsed
    row_bytes = d.nbytes // d.shape[0]
    rows_per = d.stripes.rows
    first = common.start[0] - sb.spec.start[0]
    first_stripe, stop_stripe = stripe_range(first, first + common.shape[0], rows_per)
    row0, row1 = first_stripe * rows_per, min(stop_stripe * rows_per, d.shape[0])
    dst = tuple(
        slice(c - w, c - w + n)
        for c, w, n in zip(common.start, want.start, common.shape, strict=True)
    )
    # the rows read are exactly the overlap, whole, and land in one contiguous run of ``out``
    # (a resharding along the first axis, 4 ranks to 2): read them there, no buffer, no copy
    direct = out[dst]
    in_place = (
        first == row0
        and first + common.shape[0] == row1
        and tuple(common.shape[1:]) == tuple(d.shape[1:])
        and direct.flags.c_contiguous
        and direct.dtype == np.dtype(d.dtype)
    )
    buf = direct if in_place else np.empty((row1 - row0, *d.shape[1:]), dtype=np.dtype(d.dtype))
    fileio.read_many(reader, [(d.offset + row0 * row_bytes, buf)])
    stats.bytes_read += buf.nbytes
    stats.reads += 1
    raw = memoryview(buf.reshape(-1).view("u1"))  # type: ignore[arg-type]
    span = rows_per * row_bytes
    for i, s in enumerate(range(first_stripe, stop_stripe)):
        if digest_bytes(raw[i * span : (i + 1) * span]) != d.stripes.digests[s]:
            raise InvalidCheckpointError(
                where,
                f"checksum mismatch: stripe {s} of rank {sb.rank}'s block {path!r} in {sb.file}",
            )
        stats.stripes_verified += 1
    if first_stripe == 0 and row1 == d.shape[0]:  # the whole stored block, verified by its
        stats.blocks_verified += 1  # stripes (which cover it), not hashed a second time whole
    if in_place:
        return
    src = tuple(
        slice(c - s - (row0 if k == 0 else 0), c - s - (row0 if k == 0 else 0) + n)
        for k, (c, s, n) in enumerate(zip(common.start, sb.spec.start, common.shape, strict=True))
    )
    out[dst] = buf[src]


def read_stored_block(directory: Path, sb: StoredBlock, *, stats: ReadStats) -> npt.NDArray[Any]:
    """One whole stored block, every stripe and the block's own checksum verified.

    Raises:
        InvalidCheckpointError: a checksum mismatch or a truncated file.
    """
    import numpy as np

    out = np.empty(sb.spec.shape, dtype=np.dtype(sb.dataset.dtype))
    reader = fileio.FileReader(directory / sb.file)
    try:
        _copy_overlap(reader, sb, sb.spec, out, stats, str(directory), sb.dataset.name)
    except EOFError as exc:
        raise InvalidCheckpointError(str(directory), f"{sb.file} truncated: {exc}") from None
    finally:
        reader.close()
    return out
