"""The manifest of a checkpoint: a JSON document, parsed strictly. Pure (no I/O).

A manifest read from disk is untrusted input: :func:`parse_manifest` checks every field's
type and range, accepts only plain file names (no paths, no ``..``), only numeric dtypes, and
offsets and sizes that fit inside their file, and raises :class:`ManifestError` otherwise.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

from resilient.errors import ConfigError
from resilient.model import filenames
from resilient.model.blocks import BlockSpec, stripe_count
from resilient.model.blocks import check_tiling as tiling_problem
from resilient.model.schema import Section
from resilient.model.tree import (
    Memo,
    TreeError,
    all_valid_paths,
    elastic_kinds,
    is_valid_path,
    leaf_metas,
    leaf_paths,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT",
    "SCHEMA_VERSION",
    "SHARDED_SCHEMA_VERSION",
    "DatasetEntry",
    "DatasetTable",
    "FileEntry",
    "Layout",
    "Manifest",
    "ManifestError",
    "PartialRanks",
    "RankEntry",
    "Segment",
    "ShardEntry",
    "ShardedRanks",
    "Stripes",
    "block_of",
    "dtype_itemsize",
    "parse_manifest",
    "ShardDoc",
    "open_shard",
    "parse_shard",
    "shard_entries",
    "segment_label",
    "shard_json",
]

FORMAT = "resilient-checkpoint"
SCHEMA_VERSION = 2  # 2: datasets as columns; 1: one object per dataset (still read)
SHARDED_SCHEMA_VERSION = 3  # an index of shards, each holding some ranks' entries in schema 2
_READS = (1, 2, 3)
CHECKSUM_ALGORITHM = "xxh3_64"

_DTYPE_RE = re.compile(r"^[<>|=]?([biufc])(\d{1,2})\Z")
_HEX16_RE = re.compile(r"^[0-9a-f]{16}\Z")
_HEX32_RE = re.compile(r"^[0-9a-f]{32}\Z")
_KINDS = ("self", "node", "world", "custom")
_MAX_RANKS = 1 << 24
_MAX_INT = 1 << 62
_MAX_TIME = 253402300799  # 9999-12-31 23:59:59 UTC, the last second time.localtime() shows


class ManifestError(ValueError):
    """A manifest is malformed or hostile."""


def dtype_itemsize(dtype: str) -> int:
    """Item size in bytes of an accepted dtype string such as ``'<f8'`` or ``'|b1'``."""
    m = _DTYPE_RE.match(dtype)
    if not m:
        raise ManifestError(f"unsupported dtype {dtype!r}")
    kind, size = m.group(1), int(m.group(2))
    allowed = {
        "b": (1,),
        "i": (1, 2, 4, 8),
        "u": (1, 2, 4, 8),
        "f": (2, 4, 8, 16),
        "c": (8, 16, 32),
    }
    if size not in allowed[kind]:
        raise ManifestError(f"unsupported dtype {dtype!r}")
    return size


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range of a file and the checksum of its bytes."""

    offset: int
    length: int
    checksum: str


@dataclass(frozen=True, slots=True)
class Stripes:
    """Checksums of a stored block by stripes of whole rows (axis 0), so that a reader needing
    part of the block verifies what it read without reading all of it.

    Attributes:
        rows: rows per stripe (the last stripe may hold fewer).
        digests: one xxh3-64 per stripe, in order.
    """

    rows: int
    digests: tuple[str, ...]


class DatasetEntry(NamedTuple):
    """One array of one rank: where it lives in its file and what it hashes to.

    A named tuple, not a frozen dataclass: a manifest of a state dict holds thousands, built at
    every save and parsed at every restore (~0.3 us each instead of ~1.5)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int | None
    nbytes: int
    checksum: str
    stripes: Stripes | None = None  # for Block leaves (resilient.model.blocks)


class DatasetTable(Sequence[DatasetEntry]):
    """A rank's datasets as columns, in order: what a save builds and a restore reads with no
    Python object per array (a state dict holds thousands). Indexing or iterating gives
    :class:`DatasetEntry` rows, built once on first use. Immutable; equal to any sequence of
    equal rows.

    Attributes:
        names, shapes, dtypes, offsets, nbytes: one item per dataset (``offsets``: ``None`` for
            an empty dataset).
        digests: the checksums, 16 hex digits each, as one string.
        stripes: stripe checksums of Block leaves, by name.
    """

    __slots__ = ("_rows", "digests", "dtypes", "names", "nbytes", "offsets", "shapes", "stripes")

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int | None, ...]
    nbytes: tuple[int, ...]
    digests: str
    stripes: Mapping[str, Stripes]
    _rows: tuple[DatasetEntry, ...] | None

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[str],
        offsets: Sequence[int | None],
        nbytes: Sequence[int],
        digests: str,
        stripes: Mapping[str, Stripes] | None = None,
    ) -> None:
        n = len(names)
        if not len(shapes) == len(dtypes) == len(offsets) == len(nbytes) == n == len(digests) // 16:
            raise ValueError("columns of different lengths")
        self.names, self.shapes, self.dtypes = tuple(names), tuple(shapes), tuple(dtypes)
        self.offsets, self.nbytes, self.digests = tuple(offsets), tuple(nbytes), digests
        self.stripes = dict(stripes or {})
        self._rows = None

    @classmethod
    def of(cls, rows: Sequence[DatasetEntry]) -> DatasetTable:
        """The table of ``rows``."""
        if isinstance(rows, DatasetTable):
            return rows
        if not rows:
            return cls((), (), (), (), (), "")
        names, shapes, dtypes, offsets, nbytes, checksums, _ = zip(*rows, strict=True)
        striped = {r.name: r.stripes for r in rows if r.stripes is not None}
        return cls(names, shapes, dtypes, offsets, nbytes, "".join(checksums), striped)

    @property
    def checksums(self) -> list[str]:
        """The checksums, one per dataset."""
        d = self.digests
        return [d[i : i + 16] for i in range(0, len(d), 16)]

    def rows(self) -> tuple[DatasetEntry, ...]:
        """Every dataset as a :class:`DatasetEntry`."""
        if self._rows is None:
            rows = list(
                map(DatasetEntry, self.names, self.shapes, self.dtypes, self.offsets, self.nbytes,
                    self.checksums)
            )  # fmt: skip
            for i, name in enumerate(self.names) if self.stripes else ():
                if name in self.stripes:
                    rows[i] = rows[i]._replace(stripes=self.stripes[name])
            self._rows = tuple(rows)
        return self._rows

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> DatasetEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[DatasetEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> DatasetEntry | tuple[DatasetEntry, ...]:
        return self.rows()[i]

    def __iter__(self) -> Iterator[DatasetEntry]:
        return iter(self.rows())

    def _key(self) -> tuple[Any, ...]:
        stripes = tuple(sorted(self.stripes.items()))
        return (self.names, self.shapes, self.dtypes, self.offsets, self.nbytes, self.digests,
                stripes)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DatasetTable):
            return self._key() == other._key()
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self.rows() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"DatasetTable({list(self.rows())!r})"


@dataclass(frozen=True, slots=True)
class RankEntry:
    """What one rank saved: its file, its arrays and its small JSON values."""

    file: str
    datasets: DatasetTable  # rows given as a sequence become a table
    values: Mapping[str, Any] = field(default_factory=dict)
    tree: Any = None  # the state's structure (resilient.model.tree); None in older manifests

    def __post_init__(self) -> None:
        if not isinstance(self.datasets, DatasetTable):
            object.__setattr__(self, "datasets", DatasetTable.of(self.datasets))


_Entries = Sequence[RankEntry] | Mapping[int, RankEntry]  # the ranks' entries, by rank


class _ByRank(Sequence[RankEntry]):
    """Entries indexed by rank ``0 .. size - 1`` like the whole tuple (negative indices and
    slices too): a subclass finds one rank's entry (:meth:`_entry`)."""

    __slots__ = ("_size",)

    _size: int

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, i: int) -> RankEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RankEntry]: ...
    def __getitem__(self, i: int | slice) -> RankEntry | Sequence[RankEntry]:
        if isinstance(i, slice):
            return tuple(self[r] for r in range(*i.indices(self._size)))
        r = i + self._size if i < 0 else i
        if not 0 <= r < self._size:
            raise IndexError(f"rank {i} of a manifest of {self._size} ranks")
        return self._entry(r)

    def _entry(self, rank: int) -> RankEntry:
        raise NotImplementedError


class PartialRanks(_ByRank):
    """Some ranks' entries of a manifest of ``size`` ranks (:meth:`Manifest.part`): what one
    rank of a restore receives instead of every rank's. Indexed by rank like the whole tuple;
    an entry that is not in the part raises :class:`LookupError` (so does iterating over all).
    Immutable; pickles as its entries only (nothing per absent rank)."""

    __slots__ = ("_entries",)

    def __init__(self, size: int, entries: Mapping[int, RankEntry]) -> None:
        if not all(0 <= r < size for r in entries):
            raise ValueError(f"ranks {sorted(entries)[:4]}... outside 0..{size - 1}")
        self._size = size
        self._entries = dict(entries)

    @property
    def held(self) -> tuple[int, ...]:
        """The ranks whose entries this part holds, in order."""
        return tuple(sorted(self._entries))

    def _entry(self, rank: int) -> RankEntry:
        try:
            return self._entries[rank]
        except KeyError:
            raise LookupError(
                f"rank {rank}'s entry is not in this part of the manifest (ranks {self.held[:8]})"
            ) from None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartialRanks):
            return (self._size, self._entries) == (other._size, other._entries)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._size, tuple(sorted(self._entries))))

    def __reduce__(self) -> tuple[Any, ...]:
        return (PartialRanks, (self._size, self._entries))

    def __repr__(self) -> str:
        return f"PartialRanks({self._size}, ranks {list(self.held)})"


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard of a sharded manifest (schema 3), as its index lists it.

    Attributes:
        name: its file name beside the index (:func:`resilient.model.filenames.shard_name`).
        size: its size in bytes.
        checksum: the xxh3-64 of its bytes.
        files: the data files whose ranks' entries it holds (whole file groups).
    """

    name: str
    size: int
    checksum: str
    files: tuple[str, ...]


class ShardDoc(NamedTuple):
    """A shard as read: its JSON, its header checked (see :func:`open_shard`); the ranks'
    entries are parsed only when asked for (:func:`shard_entries`)."""

    position: Mapping[int, int]  # rank -> index in entries
    entries: Sequence[Section]


ShardLoader = Callable[[ShardEntry], ShardDoc]
"""Reads one shard, checked against its index entry (size, checksum), and opens it
(:func:`open_shard`); raises if the shard is missing, changed or malformed."""


class ShardedRanks(_ByRank):
    """The ranks' entries of a sharded manifest (schema 3), read when first looked at: the
    shard holding a rank is read (once; the last one read is kept) and the entries of that
    rank's file group are parsed and checked (:func:`shard_entries`). A restoring rank reads
    its own shard only. Indexed by rank like the whole tuple.

    A part (:meth:`Manifest.part`) holds some file groups only: a rank of another group raises
    :class:`LookupError`. Pickles as its shards, its files, the entries read so far and its
    loader.
    """

    __slots__ = (
        "_entries", "_file_of", "_files", "_last", "_load", "_memo", "_owner", "is_part",
        "shards",
    )  # fmt: skip

    def __init__(
        self,
        size: int,
        shards: Sequence[ShardEntry],
        files: Mapping[str, FileEntry],
        load: ShardLoader | None,
        *,
        entries: Mapping[int, RankEntry] | None = None,
        is_part: bool = False,
    ) -> None:
        self._size = size
        self.shards = tuple(shards)
        self._files = dict(files)
        self._file_of = {r: f for f in self._files.values() for r in f.ranks}
        self._owner = {
            r: s for s in self.shards for name in s.files if name in self._files
            for r in self._files[name].ranks
        }  # fmt: skip
        self._load = load
        self._entries = dict(entries or {})
        self.is_part = is_part
        self._last: tuple[str, ShardDoc] | None = None
        self._memo = Memo()

    def shard_of(self, rank: int) -> ShardEntry:
        """The shard holding ``rank``'s entry."""
        try:
            return self._owner[rank]
        except KeyError:
            raise LookupError(
                f"rank {rank}'s entry is not in this part of the manifest "
                f"(shards {[s.name for s in self.shards[:4]]})"
            ) from None

    def part(self, ranks: Sequence[int]) -> ShardedRanks:
        """The file groups of ``ranks`` (with what was read of them), as a part."""
        names = {self.shard_of(r).name for r in ranks}  # (LookupError: not in this part)
        files = {self._file_of[r].name: self._file_of[r] for r in ranks}
        held = {r for f in files.values() for r in f.ranks}
        entries = {r: e for r, e in self._entries.items() if r in held}
        keep = [s for s in self.shards if s.name in names]
        return ShardedRanks(self._size, keep, files, self._load, entries=entries, is_part=True)

    def _entry(self, r: int) -> RankEntry:
        entry = self._entries.get(r)
        if entry is not None:
            return entry
        shard = self.shard_of(r)
        if self._load is None:
            raise LookupError(f"rank {r}'s entry is in {shard.name}, which is not read here")
        if self._last is None or self._last[0] != shard.name:
            self._last = None  # (one shard's JSON alive at a time)
            self._last = (shard.name, self._load(shard))
        file = self._file_of[r]
        try:
            self._entries.update(shard_entries(self._last[1], {file.name: file}, self._memo))
        except ManifestError as exc:
            raise ManifestError(f"{shard.name}: {exc}") from None
        return self._entries[r]

    def __iter__(self) -> Iterator[RankEntry]:
        return (self[r] for r in range(self._size))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardedRanks):
            return (self._size, self.shards, self.is_part) == (
                other._size, other.shards, other.is_part
            )  # fmt: skip
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._size, self.shards))

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _sharded_ranks,
            (self._size, self.shards, self._files, self._load, self._entries, self.is_part),
        )

    def __repr__(self) -> str:
        return f"ShardedRanks({self._size}, {len(self.shards)} shards, {len(self._entries)} read)"


def _sharded_ranks(
    size: int,
    shards: tuple[ShardEntry, ...],
    files: Mapping[str, FileEntry],
    load: ShardLoader | None,
    entries: Mapping[int, RankEntry],
    is_part: bool,
) -> ShardedRanks:
    return ShardedRanks(size, shards, files, load, entries=entries, is_part=is_part)


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One data file of a checkpoint.

    ``meta_segments`` covers the bytes HDF5 wrote itself (superblock, object headers,
    padding); together with the datasets of ``ranks`` they tile the file exactly.
    ``checksum`` is the checksum of the ordered list of all segment checksums.
    """

    name: str
    size: int
    checksum: str
    ranks: tuple[int, ...]
    meta_segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """The layout of a set: how its ranks are grouped into files (``kind``: ``self``, ``node``,
    ``world`` or ``custom``; the word *layout* means this everywhere, and the names of files on
    disk are :mod:`resilient.model.filenames`)."""

    kind: str
    nranks: int
    groups: tuple[tuple[int, ...], ...]

    def describe(self) -> str:
        """A short human description, e.g. ``'node (4 ranks, 2 files)'``."""
        return f"{self.kind} ({self.nranks} ranks, {len(self.groups)} files)"


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to validate and restore one checkpoint (or one static-data set)."""

    step: int
    time: float
    layout: Layout
    files: tuple[FileEntry, ...]
    ranks: Sequence[RankEntry]  # a tuple; a PartialRanks in a part; ShardedRanks (schema 3)
    kind: str = "checkpoint"
    static: str | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    library_version: str = ""
    schema_version: int = SCHEMA_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM

    @property
    def nbytes(self) -> int:
        """Total size of the data files (of a part's files only, in a part)."""
        return sum(f.size for f in self.files)

    @property
    def is_part(self) -> bool:
        """Whether this is a part (:meth:`part`), not the whole manifest."""
        ranks = self.ranks
        return isinstance(ranks, PartialRanks) or (
            isinstance(ranks, ShardedRanks) and ranks.is_part
        )

    @property
    def sharded(self) -> ShardedRanks | None:
        """The ranks' entries of a sharded manifest (schema 3), else ``None``."""
        return self.ranks if isinstance(self.ranks, ShardedRanks) else None

    def part(self, ranks: Sequence[int], *, layout: Layout | None = None) -> Manifest:
        """The manifest as one rank of a restore needs it: the entries of ``ranks`` only (a
        :class:`PartialRanks`), the files they name, and everything else as it is (step, static
        reference, metrics...). ``layout``: the layout to put in its place (e.g. one without
        its groups, which the receiving rank already knows: see the restorer).

        A part cannot be encoded (:meth:`to_json`) nor validated as a whole; the elastic restore,
        which reads other ranks' entries, needs the whole manifest.
        """
        return self.parts([ranks], layout=layout)[0]

    def parts(
        self, rank_sets: Sequence[Sequence[int]], *, layout: Layout | None = None
    ) -> list[Manifest]:
        """:meth:`part` of each of ``rank_sets`` (the files indexed once: work that grows with
        the ranks and files, not with their product)."""
        files = {f.name: f for f in self.files}
        position = {f.name: i for i, f in enumerate(self.files)}
        lay = self.layout if layout is None else layout
        sharded = self.sharded
        if sharded is not None:  # the files by rank from the index: no shard is read
            file_of = {r: f.name for f in self.files for r in f.ranks}
            made: dict[tuple[str, ...], ShardedRanks] = {}  # one part per set of file groups
        out = []
        for ranks in rank_sets:
            part: Sequence[RankEntry]
            if sharded is not None:
                names = sorted({file_of[r] for r in ranks}, key=position.__getitem__)
                key = tuple(names)
                if key not in made:
                    made[key] = sharded.part(ranks)
                part = made[key]
            else:
                entries = {r: self.ranks[r] for r in ranks}
                part = PartialRanks(len(self.ranks), entries)
                names = sorted({e.file for e in entries.values()}, key=position.__getitem__)
            out.append(
                Manifest(
                    step=self.step,
                    time=self.time,
                    layout=lay,
                    files=tuple(files[n] for n in names),
                    ranks=part,
                    kind=self.kind,
                    static=self.static,
                    metrics=self.metrics,
                    library_version=self.library_version,
                    schema_version=self.schema_version,
                    checksum_algorithm=self.checksum_algorithm,
                )
            )
        return out

    def to_json(self) -> str:
        """Serialise to JSON text in the current schema (stable key order).

        Each rank's datasets are columns (:func:`_columns`): a state dict's thousands of arrays
        are a few JSON arrays, written and parsed at C speed, not thousands of objects.

        Raises:
            ValueError: a part (:meth:`part`), not a whole manifest.
        """
        if self.is_part:
            raise ValueError("a part of a manifest cannot be written as a manifest")
        sharded = self.sharded
        doc: dict[str, Any] = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION if sharded is None else SHARDED_SCHEMA_VERSION,
            "library_version": self.library_version,
            "kind": self.kind,
            "step": self.step,
            "time": self.time,
            "checksum_algorithm": self.checksum_algorithm,
            "layout": {
                "kind": self.layout.kind,
                "nranks": self.layout.nranks,
                "groups": [list(g) for g in self.layout.groups],
            },
            "files": [
                {
                    "name": f.name,
                    "size": f.size,
                    "checksum": f.checksum,
                    "ranks": list(f.ranks),
                    "meta_segments": [[s.offset, s.length, s.checksum] for s in f.meta_segments],
                }
                for f in self.files
            ],
            "static": self.static,
            "metrics": dict(self.metrics),
        }
        if sharded is None:
            doc["ranks"] = [_rank_doc(r) for r in self.ranks]
        else:  # the index: the shards hold the ranks' entries (shard_json)
            doc["shards"] = [
                {"name": s.name, "size": s.size, "checksum": s.checksum, "files": list(s.files)}
                for s in sharded.shards
            ]
        # compact: json.dumps with indent falls back to the pure-Python encoder (220 ms of a
        # 410 ms save of 4,000 arrays); `python -m json.tool` shows it indented
        return json.dumps(doc, allow_nan=True, separators=(",", ":"))


def _rank_doc(r: RankEntry) -> dict[str, Any]:
    return {
        "file": r.file,
        "datasets": _columns(r.datasets),
        "values": dict(r.values),
        **({} if r.tree is None else {"tree": r.tree}),
    }


def shard_json(kind: str, step: int, entries: Mapping[int, RankEntry]) -> str:
    """A shard of a sharded manifest (schema 3): the entries of some ranks (a union of whole
    file groups), by rank, as the whole manifest of schema 2 writes them; its index
    (:meth:`Manifest.to_json` of a manifest with :class:`ShardedRanks`) names it with its size
    and checksum."""
    ranks = sorted(entries)
    doc = {
        "format": FORMAT,
        "schema_version": SHARDED_SCHEMA_VERSION,
        "kind": f"{kind} shard",
        "step": step,
        "ranks": ranks,
        "entries": [_rank_doc(entries[r]) for r in ranks],
    }
    return json.dumps(doc, allow_nan=True, separators=(",", ":"))


def _columns(table: DatasetTable) -> dict[str, Any]:
    """A rank's datasets as columns: ``names``, ``shapes``, ``dtypes``, ``offsets`` (``null`` for
    an empty dataset), ``checksums`` (one string, 16 hex digits each) and, for Block leaves only,
    ``stripes`` by name. The byte counts follow from the shapes and dtypes."""
    doc: dict[str, Any] = {
        "names": table.names,
        "shapes": table.shapes,
        "dtypes": table.dtypes,
        "offsets": table.offsets,
        "checksums": table.digests,
    }
    if table.stripes:
        doc["stripes"] = {
            name: {"rows": table.stripes[name].rows, "digests": list(table.stripes[name].digests)}
            for name in table.names
            if name in table.stripes
        }
    return doc


# --------------------------------------------------------------------------- parsing


def _section(doc: Any, path: str) -> Section:
    return Section(doc, where="manifest", path=path, error=ManifestError)


def _checksum(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _HEX16_RE.match(value):
        raise ManifestError(f"{where}: not a checksum: {value!r}")
    return value


def _is_index(value: Any, upper: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < upper


@functools.lru_cache(maxsize=64)
def _itemsize_or_none(dtype: str) -> int | None:
    try:
        return dtype_itemsize(dtype)
    except ManifestError:
        return None


def _parse_rows(rank: Section, memo: Memo, *, fast: bool = True) -> DatasetTable:
    """Schema 1: a rank's datasets as a list of objects (``name``, ``shape``, ``dtype``,
    ``offset``, ``nbytes``, ``checksum``; ``stripes`` for Block leaves; other keys ignored).

    Each entry takes the fast path first: a few type and range checks inline (a few
    microseconds; a manifest lists thousands). An entry they do not accept (one with stripes,
    or any doubt) is read by the strict walk below it, which accepts it or raises the precise
    error. The fast path accepts nothing the strict walk rejects and gives the same entry
    (``fast=False``: every entry walked strictly; tests/unit/test_manifest_fast_path.py).
    """
    path = rank.name("datasets")
    rows: list[DatasetEntry] = []
    valid = memo.valid
    for i, doc in enumerate(rank.require("datasets", list)):
        if fast and type(doc) is dict and doc.get("stripes") is None:
            name, shape, dtype = doc.get("name"), doc.get("shape"), doc.get("dtype")
            nbytes, offset, checksum = doc.get("nbytes"), doc.get("offset"), doc.get("checksum")
            if (
                type(name) is str
                and type(shape) is list
                and type(dtype) is str
                and type(nbytes) is int
                and type(checksum) is str
                and len(shape) <= 32
            ):
                for n in shape:  # (a loop: all() of a generator costs ~140 ns more an entry)
                    if type(n) is not int or not 0 <= n < 1 << 48:
                        break
                else:
                    if (
                        (itemsize := _itemsize_or_none(dtype)) is not None
                        and 0 <= nbytes <= _MAX_INT
                        and nbytes == math.prod(shape) * itemsize
                        and (
                            (offset is None and not nbytes)
                            or (type(offset) is int and 0 <= offset <= _MAX_INT)
                        )
                        and _HEX16_RE.match(checksum)
                        and (name in valid or is_valid_path(name))
                    ):
                        if name not in valid:
                            memo.add_valid((name,))
                        rows.append(
                            DatasetEntry(name, tuple(shape), dtype, offset, nbytes, checksum)
                        )
                        continue
        # the strict walk: this entry's first fault, named
        sec = Section(doc, where="manifest", path=f"{path}[{i}]", error=ManifestError)
        where = sec.path
        name = sec.require("name", str)
        if not is_valid_path(name):
            raise ManifestError(f"{where}: illegal dataset name {name!r}")
        shape = sec.require("shape", list)
        if not _is_shape(shape):
            raise ManifestError(f"{where}: illegal shape {shape!r}")
        dims = tuple(shape)
        dtype = sec.require("dtype", str)
        itemsize = _itemsize_or_none(dtype)
        if itemsize is None:
            raise ManifestError(f"unsupported dtype {dtype!r} at {where}.dtype")
        nbytes = sec.require("nbytes", int, minimum=0, maximum=_MAX_INT)
        if nbytes != math.prod(dims) * itemsize:
            raise ManifestError(f"{where}: nbytes {nbytes} does not match shape {dims} x {dtype}")
        offset = sec.get("offset", int, None, minimum=0, maximum=_MAX_INT)
        if offset is None and nbytes:
            raise ManifestError(f"{where}: non-empty dataset without an offset")
        checksum = _checksum(sec.doc.get("checksum"), where)
        sub = sec.optional_section("stripes")
        stripes = None if sub is None else _parse_stripes(sub, dims)
        rows.append(DatasetEntry(name, dims, dtype, offset, nbytes, checksum, stripes))
    datasets = DatasetTable.of(rows)
    if len(set(datasets.names)) != len(datasets):
        raise ManifestError(f"{rank.path}: repeated dataset name")
    return datasets


def _is_shape(value: Any) -> bool:
    """Whether ``value`` is a shape a manifest may hold: a list of at most 32 sizes < 2**48."""
    return type(value) is list and len(value) <= 32 and all(_is_index(n, 1 << 48) for n in value)


_COLUMNS = frozenset({"names", "shapes", "dtypes", "offsets", "checksums", "stripes"})
_HEX_DIGITS = b"0123456789abcdef"
_NONE = type(None)


def _parse_columns(rank: Section, memo: Memo) -> DatasetTable:
    """Schema 2 (and the shards of schema 3): a rank's datasets as columns (see
    :func:`_columns`), checked column by column at C speed: no Python per dataset, unless a
    check fails and then names the culprit."""
    sec = rank.section("datasets")
    where = sec.path
    unknown = set(sec.doc) - _COLUMNS
    if unknown:
        raise ManifestError(f"{where}: unknown fields {sorted(unknown)}")
    names = sec.require("names", list)
    shapes = sec.require("shapes", list)
    dtypes = sec.require("dtypes", list)
    offsets = sec.require("offsets", list)
    checksums = sec.require("checksums", str)
    n = len(names)
    if not len(shapes) == len(dtypes) == len(offsets) == n or len(checksums) != 16 * n:
        raise ManifestError(f"{where}: columns of different lengths")
    if not n:
        return DatasetTable((), (), (), (), (), "")
    if set(map(type, names)) != {str} or not all_valid_paths(names, memo=memo):
        bad = next(x for x in names if type(x) is not str or not is_valid_path(x))
        raise ManifestError(f"{where}: illegal dataset name {bad!r}")
    if len(set(names)) != n:
        raise ManifestError(f"{where}: repeated dataset name")
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > 32:
        raise ManifestError(f"{where}: illegal shape {_first_bad_shape(shapes)!r}")
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) >= 1 << 48):
        raise ManifestError(f"{where}: illegal shape {_first_bad_shape(shapes)!r}")
    if set(map(type, dtypes)) != {str}:
        wrong = sorted({type(k).__name__ for k in dtypes} - {"str"})
        raise ManifestError(f"{where}: a dtype has the wrong type {', '.join(wrong)}")
    try:
        nbytes = _sizes(shapes, dims, dtypes)
    except ManifestError:  # an unsupported dtype: the first one named
        i = next(i for i, d in enumerate(dtypes) if _itemsize_or_none(d) is None)
        raise ManifestError(f"unsupported dtype {dtypes[i]!r} at {where}.dtypes[{i}]") from None
    if max(nbytes) > _MAX_INT:
        raise ManifestError(f"{where}: a dataset's size is out of range")
    types = set(map(type, offsets))
    if not types <= {int, _NONE}:
        raise ManifestError(f"{where}: an offset has the wrong type ({_offset_types(types)})")
    if _NONE in types:
        if any(o is None and b for o, b in zip(offsets, nbytes, strict=True)):
            raise ManifestError(f"{where}: non-empty dataset without an offset")
        present = [o for o in offsets if o is not None]
    else:
        present = offsets
    if present and (min(present) < 0 or max(present) > _MAX_INT):
        raise ManifestError(f"{where}: an offset is out of range")
    if not checksums.isascii() or checksums.encode().translate(None, _HEX_DIGITS):
        raise ManifestError(f"{where}: not a checksum: {checksums[:64]!r}")
    shape_tuples = list(map(tuple, shapes))
    stripes: dict[str, Stripes] = {}
    striped = sec.optional_section("stripes")
    if striped is not None:
        index = {name: i for i, name in enumerate(names)}
        for name in striped.doc:
            if name not in index:
                raise ManifestError(f"{where}.stripes: no dataset {name[:80]!r}")
            stripes[name] = _parse_stripes(striped.section(name), shape_tuples[index[name]])
    return DatasetTable(names, shape_tuples, dtypes, offsets, nbytes, checksums, stripes)


def _sizes(shapes: list[list[int]], dims: list[int], dtypes: list[str]) -> list[int]:
    """Each dataset's size in bytes, from its (checked) shape and dtype: with numpy when the
    products surely fit in 64 bits (no Python per dataset), else exactly in Python."""
    import numpy as np

    itemsize = {d: dtype_itemsize(d) for d in set(dtypes)}
    count = len(shapes)
    ndims = np.fromiter(map(len, shapes), np.intp, count)
    if dims and max(dims) ** int(ndims.max()) * max(itemsize.values()) <= _MAX_INT:
        flat = np.array(dims, np.int64)
        if ndims.min() == 1 and ndims.max() == 1:  # vectors only: their lengths
            counts = flat
        else:
            counts = np.ones(count, np.int64)
            shaped = np.flatnonzero(ndims)  # 0-d datasets hold one item
            starts = (np.cumsum(ndims) - ndims)[shaped]
            counts[shaped] = np.multiply.reduceat(flat, starts)
        if len(itemsize) == 1:
            counts *= next(iter(itemsize.values()))
        else:
            counts *= np.fromiter(map(itemsize.__getitem__, dtypes), np.int64, count)
        return list(counts.tolist())
    return list(map(operator.mul, map(math.prod, shapes), map(itemsize.__getitem__, dtypes)))


def _first_bad_shape(shapes: list[Any]) -> Any:
    return next((shape for shape in shapes if not _is_shape(shape)), None)


def _offset_types(types: set[type]) -> str:
    wrong = sorted(t.__name__ for t in types - {int, _NONE})
    return "boolean" if wrong == ["bool"] else f"wrong type {', '.join(wrong)}"


def _parse_stripes(sub: Section, shape: tuple[int, ...]) -> Stripes:
    where = sub.path
    if not shape:
        raise ManifestError(f"{where}: stripes of a 0-d dataset")
    rows = sub.require("rows", int, minimum=1, maximum=max(1, shape[0]))
    raw = sub.require("digests", list)
    if len(raw) != stripe_count(shape[0], rows):
        raise ManifestError(f"{where}: {len(raw)} stripe digests for {shape[0]} rows by {rows}")
    return Stripes(rows, tuple(_checksum(c, where) for c in raw))


def _parse_layout(sec: Section) -> Layout:
    kind = sec.require("kind", str)
    if kind not in _KINDS:
        raise ManifestError(f"layout: unknown kind {kind!r}")
    nranks = sec.require("nranks", int, minimum=0, maximum=_MAX_RANKS)
    if nranks < 1:
        raise ManifestError("layout: nranks must be >= 1")
    groups: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for g in sec.require("groups", list):
        if not isinstance(g, list) or not g:
            raise ManifestError("layout: a group is not a non-empty list")
        for r in g:
            if not _is_index(r, nranks) or r in seen:
                raise ManifestError(f"layout: bad or repeated rank {r!r} in groups")
            seen.add(r)
        groups.append(tuple(g))
    if len(seen) != nranks:
        raise ManifestError("layout: groups do not cover every rank exactly once")
    return Layout(kind, nranks, tuple(groups))


def _parse_file(sec: Section, nranks: int) -> FileEntry:
    where = sec.path
    name = sec.require("name", str)
    if not filenames.is_data_file_name(name):
        raise ManifestError(f"{where}: illegal or repeated file name {name!r}")
    size = sec.require("size", int, minimum=0, maximum=_MAX_INT)
    ranks = sec.require("ranks", list)
    if not all(_is_index(r, nranks) for r in ranks):
        raise ManifestError(f"{where}: bad rank list")
    segs: list[Segment] = []
    for j, s in enumerate(sec.require("meta_segments", list)):
        if (
            not isinstance(s, list)
            or len(s) != 3
            or not all(_is_index(x, _MAX_INT + 1) for x in s[:2])
        ):
            raise ManifestError(f"{where}.meta_segments[{j}]: malformed")
        segs.append(Segment(s[0], s[1], _checksum(s[2], f"{where}.meta_segments[{j}]")))
    return FileEntry(
        name, size, _checksum(sec.doc.get("checksum"), where), tuple(ranks), tuple(segs)
    )


def _parse_rank(sec: Section, file_names: set[str], version: int, memo: Memo) -> RankEntry:
    fname = sec.require("file", str)
    if fname not in file_names:
        raise ManifestError(f"{sec.path}: file {fname!r} is not listed in files")
    # one parser of the datasets per schema version (schema 3's shards hold schema 2's columns)
    datasets = (_parse_rows if version == 1 else _parse_columns)(sec, memo)
    tree = sec.doc.get("tree")
    if tree is not None:
        try:
            leaves = leaf_paths(tree, memo=memo)
        except TreeError as exc:
            raise ManifestError(f"{sec.path}.tree: {exc}") from None
        # (the names are distinct, and so are the leaves: equal lengths and inclusion suffice)
        if (
            tree[0] not in ("d", "p")
            or len(leaves) != len(datasets)
            or not all(map(leaves.__contains__, datasets.names))
        ):
            raise ManifestError(f"{sec.path}.tree: does not match the datasets")
        blocks = [(p, m) for p, m in leaf_metas(tree).items() if "block" in m]
        by_name = {d.name: d for d in datasets} if blocks else {}
        for path, meta in blocks:
            block_of(meta, by_name[path], where=f"{sec.path}.tree")
    return RankEntry(fname, datasets, sec.require("values", dict), tree)


def block_of(meta: Mapping[str, Any], dataset: DatasetEntry, *, where: str = "") -> BlockSpec:
    """The block a Block leaf's dataset holds (its tree metadata, checked against the dataset).

    Raises:
        ManifestError: malformed block metadata, a block outside its global shape, or a block
            without stripe checksums.
    """
    block = meta.get("block")
    label = f"{where}: {dataset.name!r}" if where else repr(dataset.name)
    if not isinstance(block, dict) or set(block) != {"global_shape", "start"}:
        raise ManifestError(f"{label}: malformed block metadata")
    try:
        spec = BlockSpec.of(block["global_shape"], block["start"], dataset.shape, what=label)
    except ConfigError as exc:
        raise ManifestError(str(exc)) from None
    if any(n >= 1 << 48 for n in spec.global_shape):
        raise ManifestError(f"{label}: implausible global shape {spec.global_shape}")
    if dataset.stripes is None:
        raise ManifestError(f"{label}: a block without stripe checksums")
    return spec


def _json_object(text: str | bytes) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"not JSON: {exc}") from None
    except RecursionError:  # json's decoder recurses per level: "[[[[..." deeper than the stack
        raise ManifestError("not JSON this reader accepts: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ManifestError("not a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"not a resilient manifest (format {doc.get('format')!r})")
    return doc


def parse_manifest(
    text: str | bytes,
    *,
    memo: Memo | None = None,
    read_shard: Callable[[ShardEntry], bytes] | None = None,
) -> Manifest:
    """Parse and check a manifest read from disk. Its ranks' trees and names are checked with
    ``memo`` (the caller's :class:`~resilient.model.tree.Memo`; ``None``: one for this parse, so that
    the names every rank repeats are checked once).

    A sharded manifest (schema 3) is its index: its ranks are a :class:`ShardedRanks` whose
    shards are read with ``read_shard`` when first needed (their bytes, given their index
    entry, checked against it: size and checksum) and parsed (:func:`parse_shard`).

    Raises:
        ManifestError: the text is not a well-formed manifest of a supported version.
    """
    doc = _json_object(text)
    top = _section(doc, "")
    version = top.require("schema_version", int)
    if version not in _READS:
        raise ManifestError(
            f"unsupported schema version {version} (this library reads {_READS[0]} to {_READS[-1]})"
        )
    if doc.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise ManifestError(f"unsupported checksum algorithm {doc.get('checksum_algorithm')!r}")
    kind = top.require("kind", str)
    if kind not in ("checkpoint", "static"):
        raise ManifestError(f"unknown manifest kind {kind!r}")
    step = top.require("step", int, minimum=0, maximum=_MAX_INT)
    time_ = top.require("time", (int, float))
    if not 0 <= time_ <= _MAX_TIME:  # NaN too; float() of a huge int would raise OverflowError
        raise ManifestError(f"time: not a Unix time this reader accepts: {time_!r}")
    lay = _parse_layout(top.section("layout"))

    files: list[FileEntry] = []
    seen: set[str] = set()
    for f in top.sections("files"):
        entry = _parse_file(f, lay.nranks)
        if entry.name in seen:
            raise ManifestError(f"{f.path}: illegal or repeated file name {entry.name!r}")
        seen.add(entry.name)
        files.append(entry)
    ranks: Sequence[RankEntry]
    if version == SHARDED_SCHEMA_VERSION:
        if "ranks" in doc:
            raise ManifestError("a sharded manifest (schema 3) lists its ranks in its shards")
        load = (
            None if read_shard is None else functools.partial(_load_shard, read_shard, kind, step)
        )
        ranks = _parse_shards(top, files, lay.nranks, load)
    else:
        rank_sections = top.sections("ranks")
        if len(rank_sections) != lay.nranks:
            raise ManifestError(
                f"manifest lists {len(rank_sections)} ranks, layout says {lay.nranks}"
            )
        names = {f.name for f in files}
        memo = Memo() if memo is None else memo
        ranks = tuple(_parse_rank(r, names, version, memo) for r in rank_sections)

    static = doc.get("static")
    if static is not None and (not isinstance(static, str) or not _HEX32_RE.match(static)):
        raise ManifestError(f"illegal static reference {static!r}")
    metrics = top.optional_section("metrics")
    manifest = Manifest(
        step=step,
        time=float(time_),
        layout=lay,
        files=tuple(files),
        ranks=ranks,
        kind=kind,
        static=static,
        metrics=dict(metrics.doc) if metrics is not None else {},
        library_version=str(doc.get("library_version", "")),
        schema_version=version,
    )
    if version != SHARDED_SCHEMA_VERSION:  # a shard's are checked when it is read
        check_tiling(manifest)
        check_blocks(manifest)
    return manifest


def _parse_shards(
    top: Section, files: Sequence[FileEntry], nranks: int, load: ShardLoader | None
) -> ShardedRanks:
    """The shard list of an index: every file in exactly one shard, every rank in one file."""
    by_name = {f.name: f for f in files}
    shards: list[ShardEntry] = []
    placed: set[str] = set()
    for sec in top.sections("shards"):
        name = sec.require("name", str)
        if not filenames.is_shard_name(name) or any(s.name == name for s in shards):
            raise ManifestError(f"{sec.path}: illegal or repeated shard name {name!r}")
        names = sec.require("files", list)
        if not names or not all(isinstance(n, str) and n in by_name for n in names):
            raise ManifestError(f"{sec.path}: names a file the manifest does not list")
        if placed.intersection(names) or len(set(names)) != len(names):
            raise ManifestError(f"{sec.path}: a file is in two shards")
        placed.update(names)
        shards.append(
            ShardEntry(
                name,
                sec.require("size", int, minimum=1, maximum=_MAX_INT),
                _checksum(sec.doc.get("checksum"), sec.path),
                tuple(names),
            )
        )
    if placed != set(by_name):
        raise ManifestError(f"files in no shard: {sorted(set(by_name) - placed)[:4]}")
    covered = sorted(r for f in files for r in f.ranks)
    if covered != list(range(nranks)):
        raise ManifestError("the files do not list every rank exactly once")
    return ShardedRanks(nranks, shards, by_name, load)


def _load_shard(
    read: Callable[[ShardEntry], bytes], kind: str, step: int, shard: ShardEntry
) -> ShardDoc:
    """A :data:`ShardLoader`: ``read`` gives the shard's bytes, checked against its index entry
    (size and checksum: it raises what the caller's I/O layer raises)."""
    try:
        return open_shard(read(shard), kind=kind, step=step)
    except ManifestError as exc:
        raise ManifestError(f"{shard.name}: {exc}") from None


def open_shard(text: str | bytes, *, kind: str, step: int) -> ShardDoc:
    """Parse one shard of a sharded manifest (see :func:`shard_json`) and check its header:
    format, version, kind and step, and one entry per listed rank.

    Raises:
        ManifestError: a malformed shard, or one of another checkpoint.
    """
    doc = _json_object(text)
    top = _section(doc, "")
    if top.require("schema_version", int) != SHARDED_SCHEMA_VERSION:
        raise ManifestError("a shard of another schema version than its index")
    if top.require("kind", str) != f"{kind} shard" or top.require("step", int) != step:
        raise ManifestError(f"not a shard of this {kind} of step {step}")
    ranks = top.require("ranks", list)
    if not all(_is_index(r, _MAX_RANKS) for r in ranks) or len(set(ranks)) != len(ranks):
        raise ManifestError("bad or repeated rank in its rank list")
    sections = top.sections("entries")
    if len(sections) != len(ranks):
        raise ManifestError(f"{len(sections)} entries for {len(ranks)} ranks")
    return ShardDoc({r: i for i, r in enumerate(ranks)}, sections)


def shard_entries(
    doc: ShardDoc, files: Mapping[str, FileEntry], memo: Memo | None = None
) -> dict[int, RankEntry]:
    """The entries of the ranks of ``files`` in an opened shard, parsed and checked: each names
    its file, and together they tile their files (their blocks agree with each other).

    Raises:
        ManifestError: a rank missing from the shard, or a malformed or misplaced entry.
    """
    wanted = sorted(r for f in files.values() for r in f.ranks)
    missing = [r for r in wanted if r not in doc.position]
    if missing:
        raise ManifestError(f"holds no entry for ranks {missing[:4]}")
    memo = Memo() if memo is None else memo
    names = set(files)
    entries = {
        r: _parse_rank(doc.entries[doc.position[r]], names, SCHEMA_VERSION, memo) for r in wanted
    }
    _check_tiling(list(files.values()), entries)
    _check_blocks(entries.values(), whole=False)
    return entries


def parse_shard(
    text: str | bytes,
    files: Mapping[str, FileEntry],
    *,
    kind: str,
    step: int,
    memo: Memo | None = None,
) -> dict[int, RankEntry]:
    """:func:`open_shard`, then :func:`shard_entries` of ``files``.

    Raises:
        ManifestError: see both.
    """
    return shard_entries(open_shard(text, kind=kind, step=step), files, memo)


def check_blocks(manifest: Manifest) -> None:
    """Check that every Block leaf's blocks, over all ranks, tile one global array exactly once
    and agree on its global shape and dtype (a leaf that is a block on one rank and not on
    another is left to the elastic restore, which names it).

    Raises:
        ManifestError: naming the leaf.
    """
    _check_blocks(manifest.ranks, whole=True)


def _check_blocks(ranks: Iterable[RankEntry], *, whole: bool) -> None:
    found: dict[str, list[tuple[BlockSpec, str]]] = {}
    count = 0
    for entry in ranks:
        count += 1
        if entry.tree is None:
            continue
        block_leaves = elastic_kinds(entry.tree).blocks
        by_name = {d.name: d for d in entry.datasets} if block_leaves else {}
        for path, meta in block_leaves.items():
            dataset = by_name[path]
            found.setdefault(path, []).append((block_of(meta, dataset), dataset.dtype))
    for path, blocks in found.items():
        shapes = {b.global_shape for b, _ in blocks}
        dtypes = {d for _, d in blocks}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ManifestError(
                f"block {path!r}: ranks disagree on its global shape or dtype "
                f"({sorted(shapes)[:4]}, {sorted(dtypes)[:4]})"
            )
        if not whole or len(blocks) != count:
            continue
        why = tiling_problem(next(iter(shapes)), [b for b, _ in blocks])
        if why is not None:
            raise ManifestError(f"block {path!r}: {why}")


def file_segments(
    manifest: Manifest, entry: FileEntry
) -> list[tuple[int, int, str, tuple[int, str] | None]]:
    """All segments of one file, sorted by offset: ``(offset, length, checksum, owner)``, the
    owner ``(rank, dataset name)`` or ``None`` for HDF5's own bytes (see :func:`segment_label`).
    """
    return _segments(manifest.ranks, entry)


def _segments(
    ranks: _Entries, entry: FileEntry
) -> list[tuple[int, int, str, tuple[int, str] | None]]:
    segs: list[tuple[int, int, str, tuple[int, str] | None]] = [
        (s.offset, s.length, s.checksum, None) for s in entry.meta_segments
    ]
    for r in entry.ranks:
        rank_entry = ranks[r]
        if rank_entry.file != entry.name or not rank_entry.datasets:
            continue
        table = rank_entry.datasets
        offsets: Sequence[Any] = table.offsets  # None only for empty ones, left out below
        nbytes, checksums = table.nbytes, table.checksums
        owners = zip(itertools.repeat(r), table.names)
        # empty datasets (no bytes, perhaps no offset) own no segment
        segs.extend(
            itertools.compress(zip(offsets, nbytes, checksums, owners, strict=True), nbytes)
        )
    segs.sort(key=_by_offset)
    return segs


_by_offset = operator.itemgetter(0)


def segment_label(owner: tuple[int, str] | None) -> str:
    """What a segment of :func:`file_segments` holds, for messages."""
    return "HDF5 metadata" if owner is None else f"rank {owner[0]} dataset {owner[1]!r}"


def check_tiling(manifest: Manifest) -> None:
    """Check that each file's segments cover it exactly once (no gaps, no overlaps).

    Raises:
        ManifestError: a segment lies outside its file, overlaps another or leaves a hole.
    """
    _check_tiling(manifest.files, dict(enumerate(manifest.ranks)))


def _check_tiling(files: Sequence[FileEntry], entries: Mapping[int, RankEntry]) -> None:
    owner: dict[int, str] = {}
    for f in files:
        for r in f.ranks:
            if r in owner:
                raise ManifestError(f"rank {r} is listed in two files")
            owner[r] = f.name
    for r, entry in entries.items():
        if owner.get(r) != entry.file:
            raise ManifestError(
                f"rank {r} names file {entry.file!r} but that file does not list it"
            )
    for f in files:
        if _tiles(entries, f):
            continue
        segments = _segments(entries, f)
        pos = 0  # find the first fault, to name it
        for offset, length, _, held in segments:
            if offset != pos:
                raise ManifestError(
                    f"{f.name}: {segment_label(held)} at {offset} leaves a gap or overlap at {pos}"
                )
            pos = offset + length
        if pos != f.size:
            raise ManifestError(f"{f.name}: segments end at {pos}, file size is {f.size}")


def _tiles(ranks: _Entries, entry: FileEntry) -> bool:
    """Whether the segments of a file cover ``[0, size)`` exactly, from the columns (vectorised:
    no Python per dataset)."""
    import numpy as np

    starts = [np.array([s.offset for s in entry.meta_segments], np.int64)]
    lengths = [np.array([s.length for s in entry.meta_segments], np.int64)]
    for r in entry.ranks:
        table = ranks[r].datasets
        if ranks[r].file != entry.name or not table:
            continue
        nbytes = np.array(table.nbytes, np.int64)
        try:
            offsets = np.array(table.offsets, np.int64)
        except TypeError:  # empty datasets have no offset
            offsets = np.array([-1 if o is None else o for o in table.offsets], np.int64)
        full = nbytes > 0
        starts.append(offsets[full])
        lengths.append(nbytes[full])
    offset, length = np.concatenate(starts), np.concatenate(lengths)
    if not offset.size:
        return entry.size == 0
    order = np.argsort(offset, kind="stable")
    offset, end = offset[order], offset[order] + length[order]
    return bool(offset[0] == 0 and end[-1] == entry.size and np.array_equal(offset[1:], end[:-1]))


def file_checksum_text(ranks: _Entries, entry: FileEntry) -> str:
    """:func:`combine_checksums` of all segments of one file (what its checksum is taken of),
    from the columns (``ranks``: the entries of at least the file's ranks, by rank): the same
    text as from :func:`file_segments`, ~3x faster."""
    import numpy as np

    offsets = [s.offset for s in entry.meta_segments]
    lengths = [s.length for s in entry.meta_segments]
    checksums = [s.checksum for s in entry.meta_segments]
    for r in entry.ranks:
        table = ranks[r].datasets
        if ranks[r].file != entry.name or not table:
            continue
        if 0 in table.nbytes:  # empty datasets own no segment
            keep = [i for i, n in enumerate(table.nbytes) if n]
            offsets += [table.offsets[i] for i in keep]  # type: ignore[misc]
            lengths += [table.nbytes[i] for i in keep]
            digests = table.checksums
            checksums += [digests[i] for i in keep]
        else:
            offsets += table.offsets  # type: ignore[arg-type]
            lengths += table.nbytes
            checksums += table.checksums
    if not offsets:
        return ""
    order = np.argsort(np.array(offsets, np.int64), kind="stable")
    if not (np.diff(order) == 1).all():
        pick = operator.itemgetter(*order.tolist())
        offsets, lengths, checksums = (
            list(pick(offsets)),
            list(pick(lengths)),
            list(pick(checksums)),
        )
    return combine_checksums(list(zip(offsets, lengths, checksums, strict=True)))


def combine_checksums(segments: Sequence[tuple[int, int, str]]) -> str:
    """Canonical text whose checksum is a file's checksum (see :class:`FileEntry`)."""
    if not segments:
        return ""
    # one format of a template repeated: ~0.2 us a segment, half of a format call each
    template = ";".join(itertools.repeat("%d:%d:%s", len(segments)))
    return template % tuple(itertools.chain.from_iterable(segments))
