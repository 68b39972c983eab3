"""The manifest of a checkpoint as values: its files, its ranks' entries and the containers
that hold them (whole, a part, or the shards of a sharded manifest). Pure (no I/O).

The manifest's JSON, parsed strictly and written, is :mod:`resilient.model.codec` (a rank's
entry: :mod:`resilient.model.entries`; the shards of schema 3: :mod:`resilient.model.shards`);
the checks that its segments tile each file and its blocks each global array are
:mod:`resilient.model.tiling`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

from resilient.model.layout import Layout

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT",
    "SCHEMA_VERSION",
    "SHARDED_SCHEMA_VERSION",
    "DatasetEntry",
    "DatasetTable",
    "EncodedFiles",
    "FileColumns",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "PartialRanks",
    "RankEntry",
    "Segment",
    "ShardEntry",
    "ShardedRanks",
    "Stripes",
    "columns_of",
]

FORMAT = "resilient-checkpoint"
SCHEMA_VERSION = 2  # 2: datasets as columns; 1: one object per dataset (still read)
SHARDED_SCHEMA_VERSION = 3  # an index of shards, each holding some ranks' entries in schema 2
CHECKSUM_ALGORITHM = "xxh3_64"


class ManifestError(ValueError):
    """A manifest is malformed or hostile."""


class Segment(NamedTuple):
    """A byte range of a file and the checksum of its bytes.

    A named tuple, not a frozen dataclass (as :class:`DatasetEntry`): an index of 100,000
    files holds 200,000, built at every restore and pickled to the shards' leaders."""

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


class ShardedRanks(_ByRank):
    """The ranks' entries of a sharded manifest (schema 3): the index (which shard holds which
    files, which file which ranks) and the entries loaded so far. The entries are loaded
    through :func:`resilient.io.manifests.load_entries` (which reads the shards holding the
    ranks asked for: a restoring rank its own only); looking up an entry that was not loaded
    raises :class:`LookupError` naming the rank (it never reads a file). Indexed by rank like
    the whole tuple.

    A part (:meth:`Manifest.part`) holds some file groups only: a rank of another group raises
    :class:`LookupError`. Pickles as its shards, its files and its loaded entries.
    """

    __slots__ = (
        "_columns", "_entries", "_file_at", "_file_of", "_files", "_given", "_owner", "is_part",
        "shards",
    )  # fmt: skip

    def __init__(
        self,
        size: int,
        shards: Sequence[ShardEntry],
        files: Mapping[str, FileEntry] | EncodedFiles,
        *,
        entries: Mapping[int, RankEntry] | None = None,
        is_part: bool = False,
    ) -> None:
        self._size = size
        self.shards = tuple(shards)
        self._given = files if isinstance(files, EncodedFiles) else dict(files)
        # made at the first look-up (a coordinator that only commits an index never makes
        # them): by rank, its shard and its file's position (from the files' columns: no
        # file is decoded); the files by name and by rank (decoded)
        self._columns: FileColumns | None = None
        self._owner: dict[int, ShardEntry] | None = None
        self._file_at: dict[int, int] = {}
        self._files: dict[str, FileEntry] | None = None
        self._file_of: dict[int, FileEntry] = {}
        self._entries = dict(entries or {})
        self.is_part = is_part

    @property
    def files(self) -> Sequence[FileEntry]:
        """The files of these ranks (text, when they were given as text)."""
        given = self._given
        return given if isinstance(given, EncodedFiles) else tuple(given.values())

    def _files_columns(self) -> FileColumns:
        """The :class:`FileColumns` of :attr:`files`, made once (a restore makes a part per
        rank or shard of them)."""
        if self._columns is None:
            self._columns = columns_of(self.files)
        return self._columns

    def _owners(self) -> dict[int, ShardEntry]:
        """The shard holding each rank's entry (and each rank's file's position), made once."""
        if self._owner is None:
            cols = self._files_columns()
            self._file_at = {r: i for i, ranks in enumerate(cols.ranks) for r in ranks}
            at = {name: i for i, name in enumerate(cols.names)}
            self._owner = {
                r: s for s in self.shards for name in s.files if name in at
                for r in cols.ranks[at[name]]
            }  # fmt: skip
        return self._owner

    def _files_by_name(self) -> dict[str, FileEntry]:
        """The files by name, and by rank (decoded once)."""
        if self._files is None:
            given = self._given
            files = {f.name: f for f in given} if isinstance(given, EncodedFiles) else given
            self._file_of = {r: f for f in files.values() for r in f.ranks}
            self._files = files
        return self._files

    def shard_of(self, rank: int) -> ShardEntry:
        """The shard holding ``rank``'s entry."""
        try:
            return self._owners()[rank]
        except KeyError:
            raise LookupError(
                f"rank {rank}'s entry is not in this part of the manifest "
                f"(shards {[s.name for s in self.shards[:4]]})"
            ) from None

    def file_of(self, rank: int) -> FileEntry:
        """The file holding ``rank``'s data (from the index: no entry needed)."""
        self.shard_of(rank)  # (LookupError: not in this part)
        self._files_by_name()
        return self._file_of[rank]

    def file_positions(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """The positions of the files of ``ranks`` among :attr:`files`, in order.

        Raises:
            LookupError: a rank not in this part.
        """
        for r in ranks:
            self.shard_of(r)
        return tuple(sorted({self._file_at[r] for r in ranks}))

    def loaded(self, rank: int) -> bool:
        """Whether ``rank``'s entry is loaded."""
        return rank in self._entries

    def with_entries(self, entries: Mapping[int, RankEntry]) -> ShardedRanks:
        """These ranks with ``entries`` loaded too."""
        return ShardedRanks(
            self._size, self.shards, self._given, entries={**self._entries, **entries},
            is_part=self.is_part,
        )  # fmt: skip

    def part(self, ranks: Sequence[int]) -> ShardedRanks:
        """The file groups of ``ranks`` (with what was loaded of them), as a part; files given
        as text stay text (:meth:`EncodedFiles.select`)."""
        shards = {self.shard_of(r).name for r in ranks}  # (LookupError: not in this part)
        at = self.file_positions(ranks)
        given = self._given
        cols = self._files_columns()
        files: Mapping[str, FileEntry] | EncodedFiles
        if isinstance(given, EncodedFiles) and given.columns is not None:
            files = given.select(at)
        else:
            by_name = self._files_by_name()
            files = {cols.names[i]: by_name[cols.names[i]] for i in at}
        held = {r for i in at for r in cols.ranks[i]}
        entries = {r: e for r, e in self._entries.items() if r in held}
        keep = [s for s in self.shards if s.name in shards]
        return ShardedRanks(self._size, keep, files, entries=entries, is_part=True)

    def _entry(self, r: int) -> RankEntry:
        entry = self._entries.get(r)
        if entry is not None:
            return entry
        shard = self.shard_of(r)
        raise LookupError(
            f"rank {r}'s entry is in {shard.name}, which was not loaded "
            "(resilient.io.manifests.load_entries)"
        )

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
            (self._size, self.shards, self._given, self._entries, self.is_part),
        )

    def __repr__(self) -> str:
        return f"ShardedRanks({self._size}, {len(self.shards)} shards, {len(self._entries)} loaded)"


def _sharded_ranks(
    size: int,
    shards: tuple[ShardEntry, ...],
    files: Mapping[str, FileEntry] | EncodedFiles,
    entries: Mapping[int, RankEntry],
    is_part: bool,
) -> ShardedRanks:
    return ShardedRanks(size, shards, files, entries=entries, is_part=is_part)


class FileEntry(NamedTuple):
    """One data file of a checkpoint.

    ``meta_segments`` covers the bytes HDF5 wrote itself (superblock, object headers,
    padding); together with the datasets of ``ranks`` they tile the file exactly.
    ``checksum`` is the checksum of the ordered list of all segment checksums.

    A named tuple, not a frozen dataclass (as :class:`DatasetEntry`): an index lists one per
    file, 100,000 at 100,000 ranks, built at every restore (~0.4 us each instead of ~4).
    """

    name: str
    size: int
    checksum: str
    ranks: tuple[int, ...]
    meta_segments: tuple[Segment, ...]


class FileColumns(NamedTuple):
    """The names, sizes and ranks of some files, in order, without an object per file: what
    a restore's coordinator needs of an index of 100,000 files (which shard and file hold
    each rank, which files to check and hand out), read straight from the index's text
    (:func:`~resilient.model.codec.parse_manifest`)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]

    def select(self, indices: Sequence[int]) -> FileColumns:
        """The columns of the files at ``indices``, in that order."""
        return FileColumns(
            tuple(self.names[i] for i in indices),
            tuple(self.sizes[i] for i in indices),
            tuple(self.ranks[i] for i in indices),
        )


def columns_of(files: Sequence[FileEntry]) -> FileColumns:
    """The :class:`FileColumns` of ``files``: those an index's text gave
    (:attr:`EncodedFiles.columns`: no file is decoded), else read off the entries."""
    if isinstance(files, EncodedFiles) and files.columns is not None:
        return files.columns
    return FileColumns(
        tuple(f.name for f in files), tuple(f.size for f in files), tuple(f.ranks for f in files)
    )


class EncodedFiles(Sequence[FileEntry]):
    """Files as the JSON text of an index (schema 3), decoded into entries on first use.

    Two sources: the files of a sharded manifest a save's coordinator commits without an
    object per file (each shard's leader encodes its shard's files,
    :func:`~resilient.model.codec.files_fragment`, and the coordinator joins the fragments);
    and the files of an index read from disk whose text
    :func:`~resilient.model.codec.parse_manifest` checked as this library writes it, one
    fragment per file, with their :class:`FileColumns` (a restore's coordinator then hands
    each shard's files on as text: :meth:`select`). Either way the text is known good: it is
    decoded without further checks. Their count and total size are known. Immutable;
    pickles as its text (and columns).

    Attributes:
        fragments: each a comma-separated run of file objects as the index writes them, in
            order.
        nbytes: the files' total size.
        columns: with one fragment per file, the files' names, sizes and ranks (``None``:
            not known without decoding).
    """

    __slots__ = ("_count", "_entries", "columns", "fragments", "nbytes")

    def __init__(
        self,
        fragments: Sequence[str],
        count: int,
        nbytes: int,
        columns: FileColumns | None = None,
    ) -> None:
        self.fragments = tuple(fragments)
        self._count = count
        self.nbytes = nbytes
        self.columns = columns
        if columns is not None and not len(self.fragments) == len(columns.names) == count:
            raise ValueError("columns need one fragment per file")
        self._entries: tuple[FileEntry, ...] | None = None

    @classmethod
    def of_columns(cls, fragments: Sequence[str], columns: FileColumns) -> EncodedFiles:
        """Files of one fragment each, with their columns."""
        return cls(fragments, len(columns.names), sum(columns.sizes), columns)

    def select(self, indices: Sequence[int]) -> EncodedFiles:
        """The files at ``indices`` (in that order), still as text.

        Raises:
            ValueError: these files have no columns (not one fragment per file).
        """
        if self.columns is None:
            raise ValueError("only files with columns can be selected without decoding them")
        return EncodedFiles.of_columns(
            [self.fragments[i] for i in indices], self.columns.select(indices)
        )

    def entries(self) -> tuple[FileEntry, ...]:
        """Every file's entry (decoded once)."""
        if self._entries is None:
            docs = json.loads("[" + ",".join(f for f in self.fragments if f) + "]")
            self._entries = tuple(
                FileEntry(d["name"], d["size"], d["checksum"], tuple(d["ranks"]),
                          tuple(Segment(*s) for s in d["meta_segments"]))
                for d in docs
            )  # fmt: skip
            if len(self._entries) != self._count:
                raise ValueError(f"{len(self._entries)} files encoded, {self._count} said")
        return self._entries

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> FileEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[FileEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> FileEntry | tuple[FileEntry, ...]:
        return self.entries()[i]

    def __iter__(self) -> Iterator[FileEntry]:
        return iter(self.entries())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.fragments)

    def __reduce__(self) -> tuple[Any, ...]:
        return (EncodedFiles, (self.fragments, self._count, self.nbytes, self.columns))

    def __repr__(self) -> str:
        return f"EncodedFiles({self._count} files, {self.nbytes} bytes)"


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to validate and restore one checkpoint (or one static-data set)."""

    step: int
    time: float
    layout: Layout
    files: Sequence[FileEntry]  # a tuple; EncodedFiles in an index a save just committed
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
        files = self.files
        return files.nbytes if isinstance(files, EncodedFiles) else sum(f.size for f in files)

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

        A part cannot be encoded (:func:`~resilient.model.codec.manifest_json`) nor validated as
        a whole; the elastic restore, which reads other ranks' entries, needs the whole manifest.
        """
        return self.parts([ranks], layout=layout)[0]

    def parts(
        self, rank_sets: Sequence[Sequence[int]], *, layout: Layout | None = None
    ) -> list[Manifest]:
        """:meth:`part` of each of ``rank_sets`` (the files indexed once: work that grows with
        the ranks and files, not with their product)."""
        lay = self.layout if layout is None else layout
        sharded = self.sharded
        out = []
        if sharded is not None:  # the files by rank from the index: no shard is read
            made: dict[tuple[int, ...], Manifest] = {}  # one part per set of file groups
            for ranks in rank_sets:
                key = sharded.file_positions(ranks)
                if key not in made:
                    part = sharded.part(ranks)
                    made[key] = self._with(files=part.files, ranks=part, layout=lay)
                out.append(made[key])
            return out
        files = {f.name: f for f in self.files}
        position = {f.name: i for i, f in enumerate(self.files)}
        for ranks in rank_sets:
            entries = {r: self.ranks[r] for r in ranks}
            names = sorted({e.file for e in entries.values()}, key=position.__getitem__)
            out.append(
                self._with(files=tuple(files[n] for n in names),
                           ranks=PartialRanks(len(self.ranks), entries), layout=lay)
            )  # fmt: skip
        return out

    def _with(
        self, *, files: Sequence[FileEntry], ranks: Sequence[RankEntry], layout: Layout
    ) -> Manifest:
        """This manifest's header with ``files``, ``ranks`` and ``layout``."""
        return Manifest(
            step=self.step, time=self.time, layout=layout, files=files, ranks=ranks,
            kind=self.kind, static=self.static, metrics=self.metrics,
            library_version=self.library_version, schema_version=self.schema_version,
            checksum_algorithm=self.checksum_algorithm,
        )  # fmt: skip
