"""A rank's entry of a manifest as JSON, parsed strictly and written, and the checks every part
of a manifest's JSON shares (a checksum, an index, the document's format). Pure (no I/O).

A rank's datasets are rows in schema 1 (one object per dataset, still read) and columns in
schema 2 and in the shards of schema 3 (:func:`columns`); :func:`parse_rank` reads either.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
import re
from typing import Any

from resilient.model.blocks import stripe_count
from resilient.model.manifest import (
    FORMAT,
    DatasetEntry,
    DatasetTable,
    ManifestError,
    RankEntry,
    Stripes,
)
from resilient.model.schema import Section
from resilient.model.tiling import block_of
from resilient.model.tree import (
    Memo,
    TreeError,
    all_valid_paths,
    is_valid_path,
    leaf_metas,
    leaf_paths,
)

__all__ = [
    "MAX_INT",
    "MAX_RANKS",
    "checked_checksum",
    "columns",
    "dtype_itemsize",
    "is_index",
    "json_object",
    "manifest_section",
    "parse_rank",
    "rank_doc",
]

_DTYPE_RE = re.compile(r"^[<>|=]?([biufc])(\d{1,2})\Z")
_HEX16_RE = re.compile(r"^[0-9a-f]{16}\Z")
MAX_RANKS = 1 << 24
MAX_INT = 1 << 62


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


def rank_doc(r: RankEntry) -> dict[str, Any]:
    return {
        "file": r.file,
        "datasets": columns(r.datasets),
        "values": dict(r.values),
        **({} if r.tree is None else {"tree": r.tree}),
    }


def columns(table: DatasetTable) -> dict[str, Any]:
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


def manifest_section(doc: Any, path: str) -> Section:
    return Section(doc, where="manifest", path=path, error=ManifestError)


def checked_checksum(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _HEX16_RE.match(value):
        raise ManifestError(f"{where}: not a checksum: {value!r}")
    return value


def is_index(value: Any, upper: int) -> bool:
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
                        and 0 <= nbytes <= MAX_INT
                        and nbytes == math.prod(shape) * itemsize
                        and (
                            (offset is None and not nbytes)
                            or (type(offset) is int and 0 <= offset <= MAX_INT)
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
        nbytes = sec.require("nbytes", int, minimum=0, maximum=MAX_INT)
        if nbytes != math.prod(dims) * itemsize:
            raise ManifestError(f"{where}: nbytes {nbytes} does not match shape {dims} x {dtype}")
        offset = sec.get("offset", int, None, minimum=0, maximum=MAX_INT)
        if offset is None and nbytes:
            raise ManifestError(f"{where}: non-empty dataset without an offset")
        checksum = checked_checksum(sec.doc.get("checksum"), where)
        sub = sec.optional_section("stripes")
        stripes = None if sub is None else _parse_stripes(sub, dims)
        rows.append(DatasetEntry(name, dims, dtype, offset, nbytes, checksum, stripes))
    datasets = DatasetTable.of(rows)
    if len(set(datasets.names)) != len(datasets):
        raise ManifestError(f"{rank.path}: repeated dataset name")
    return datasets


def _is_shape(value: Any) -> bool:
    """Whether ``value`` is a shape a manifest may hold: a list of at most 32 sizes < 2**48."""
    return type(value) is list and len(value) <= 32 and all(is_index(n, 1 << 48) for n in value)


_COLUMNS = frozenset({"names", "shapes", "dtypes", "offsets", "checksums", "stripes"})
_HEX_DIGITS = b"0123456789abcdef"
_NONE = type(None)


def _parse_columns(rank: Section, memo: Memo) -> DatasetTable:
    """Schema 2 (and the shards of schema 3): a rank's datasets as columns (see
    :func:`columns`), checked column by column at C speed: no Python per dataset, unless a
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
    if max(nbytes) > MAX_INT:
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
    if present and (min(present) < 0 or max(present) > MAX_INT):
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
    if dims and max(dims) ** int(ndims.max()) * max(itemsize.values()) <= MAX_INT:
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
    return Stripes(rows, tuple(checked_checksum(c, where) for c in raw))


def parse_rank(sec: Section, file_names: set[str], version: int, memo: Memo) -> RankEntry:
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


def json_object(text: str | bytes) -> dict[str, Any]:
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
