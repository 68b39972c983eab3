"""The manifest's JSON, parsed strictly and written, for each schema version: 1 (a rank's datasets
as rows, read only), 2 (as columns) and 3 (an index of shards: :mod:`resilient.model.shards`).
Pure (no I/O).

A manifest read from disk is untrusted input: :func:`parse_manifest` checks every field's
type and range, accepts only plain file names (no paths, no ``..``), only numeric dtypes, and
offsets and sizes that fit inside their file, and raises
:class:`~resilient.model.manifest.ManifestError` otherwise.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

from resilient.model import filenames
from resilient.model.entries import (
    MAX_INT,
    MAX_RANKS,
    checked_checksum,
    is_index,
    json_object,
    manifest_section,
    parse_rank,
    rank_doc,
)
from resilient.model.layout import Layout
from resilient.model.manifest import (
    CHECKSUM_ALGORITHM,
    FORMAT,
    SCHEMA_VERSION,
    SHARDED_SCHEMA_VERSION,
    EncodedFiles,
    FileColumns,
    FileEntry,
    Manifest,
    ManifestError,
    RankEntry,
    Segment,
)
from resilient.model.schema import Section
from resilient.model.shards import index_shards
from resilient.model.tiling import check_blocks, check_tiling
from resilient.model.tree import Memo

__all__ = ["files_fragment", "manifest_json", "parse_manifest"]

_READS = (1, 2, 3)
_HEX32_RE = re.compile(r"^[0-9a-f]{32}\Z")
_KINDS = ("self", "node", "world", "custom")
_MAX_TIME = 253402300799  # 9999-12-31 23:59:59 UTC, the last second time.localtime() shows


def manifest_json(manifest: Manifest) -> str:
    """``manifest`` as JSON text in the current schema (stable key order): schema 2, or the
    index of schema 3 for a sharded one (its shards: :func:`~resilient.model.shards.shard_json`).

    Each rank's datasets are columns (:func:`~resilient.model.entries.columns`): a state dict's
    thousands of arrays are a few JSON arrays, written and parsed at C speed, not thousands of
    objects.

    Raises:
        ValueError: a part (:meth:`~resilient.model.manifest.Manifest.part`), not a whole
            manifest.
    """
    if manifest.is_part:
        raise ValueError("a part of a manifest cannot be written as a manifest")
    sharded = manifest.sharded
    doc: dict[str, Any] = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION if sharded is None else SHARDED_SCHEMA_VERSION,
        "library_version": manifest.library_version,
        "kind": manifest.kind,
        "step": manifest.step,
        "time": manifest.time,
        "checksum_algorithm": manifest.checksum_algorithm,
        "layout": {
            "kind": manifest.layout.kind,
            "nranks": manifest.layout.nranks,
            "groups": [list(g) for g in manifest.layout.groups],
        },
    }
    if sharded is None:
        doc["files"] = [_file_doc(f) for f in manifest.files]
    doc["static"] = manifest.static
    doc["metrics"] = dict(manifest.metrics)
    # compact: json.dumps with indent falls back to the pure-Python encoder (220 ms of a
    # 410 ms save of 4,000 arrays); `python -m json.tool` shows it indented
    if sharded is None:
        doc["ranks"] = [rank_doc(r) for r in manifest.ranks]
        return json.dumps(doc, allow_nan=True, separators=(",", ":"))
    # the index: the shards hold the ranks' entries (shard_json); its files, last, as the
    # shards' leaders encoded them (EncodedFiles) or encoded here
    doc["shards"] = [
        {"name": s.name, "size": s.size, "checksum": s.checksum, "files": list(s.files)}
        for s in sharded.shards
    ]
    files = manifest.files
    fragments = files.fragments if isinstance(files, EncodedFiles) else [files_fragment(files)]
    head = json.dumps(doc, allow_nan=True, separators=(",", ":"))
    return head[:-1] + ',"files":[' + ",".join(f for f in fragments if f) + "]}"


def files_fragment(files: Sequence[FileEntry]) -> str:
    """The file objects of ``files`` as an index lists them, comma-separated, without the
    brackets (empty for no file): a shard's leader encodes its files so, and the coordinator
    joins the fragments into its index (:class:`~resilient.model.manifest.EncodedFiles`)."""
    return json.dumps([_file_doc(f) for f in files], separators=(",", ":"))[1:-1]


def _file_doc(f: FileEntry) -> dict[str, Any]:
    """One file's object in a manifest."""
    return {
        "name": f.name,
        "size": f.size,
        "checksum": f.checksum,
        "ranks": list(f.ranks),
        "meta_segments": [[s.offset, s.length, s.checksum] for s in f.meta_segments],
    }


def _parse_layout(sec: Section) -> Layout:
    kind = sec.require("kind", str)
    if kind not in _KINDS:
        raise ManifestError(f"layout: unknown kind {kind!r}")
    nranks = sec.require("nranks", int, minimum=0, maximum=MAX_RANKS)
    if nranks < 1:
        raise ManifestError("layout: nranks must be >= 1")
    given = sec.require("groups", list)
    flat = list(itertools.chain.from_iterable(g for g in given if type(g) is list))
    if not (
        _all_of_type(given, list) and all(given) and _ints_within(flat, nranks - 1)
        and len(set(flat)) == len(flat)
    ):  # fmt: skip  (checked at C speed: 100,000 groups at 100,000 ranks; else, one by one)
        _check_groups(given, nranks)
    if len(flat) != nranks:
        raise ManifestError("layout: groups do not cover every rank exactly once")
    return Layout(kind, nranks, tuple(map(tuple, given)))


def _check_groups(groups: list[Any], nranks: int) -> None:
    """Raise the :class:`ManifestError` that says what is wrong with a layout's ``groups``."""
    seen: set[int] = set()
    for g in groups:
        if not isinstance(g, list) or not g:
            raise ManifestError("layout: a group is not a non-empty list")
        for r in g:
            if not is_index(r, nranks) or r in seen:
                raise ManifestError(f"layout: bad or repeated rank {r!r} in groups")
            seen.add(r)


def _parse_file(sec: Section, nranks: int) -> FileEntry:
    where = sec.path
    name = sec.require("name", str)
    if not filenames.is_data_file_name(name):
        raise ManifestError(f"{where}: illegal or repeated file name {name!r}")
    size = sec.require("size", int, minimum=0, maximum=MAX_INT)
    ranks = sec.require("ranks", list)
    if not all(is_index(r, nranks) for r in ranks):
        raise ManifestError(f"{where}: bad rank list")
    segs: list[Segment] = []
    for j, s in enumerate(sec.require("meta_segments", list)):
        if (
            not isinstance(s, list)
            or len(s) != 3
            or not all(is_index(x, MAX_INT + 1) for x in s[:2])
        ):
            raise ManifestError(f"{where}.meta_segments[{j}]: malformed")
        segs.append(Segment(s[0], s[1], checked_checksum(s[2], f"{where}.meta_segments[{j}]")))
    return FileEntry(
        name, size, checked_checksum(sec.doc.get("checksum"), where), tuple(ranks), tuple(segs)
    )


_FILE_KEYS = frozenset(("name", "size", "checksum", "ranks", "meta_segments"))
_HEX16_RE = re.compile(r"^[0-9a-f]{16}\Z")


def _parse_files(top: Section, nranks: int) -> list[FileEntry]:
    """The manifest's files, each checked as :func:`_parse_file` checks it, names unique: all
    at once when every one is plain (:func:`_plain_files`: an index lists 100,000 files at
    100,000 ranks, which :class:`Section` would check at ~20 us each), else one by one."""
    items = top.require("files", list)
    plain = _plain_files(items, nranks)
    if plain is not None:
        return plain
    files: list[FileEntry] = []
    seen: set[str] = set()
    for f in top.sections("files"):
        entry = _parse_file(f, nranks)
        if entry.name in seen:
            raise ManifestError(f"{f.path}: illegal or repeated file name {entry.name!r}")
        seen.add(entry.name)
        files.append(entry)
    return files


def _plain_files(items: list[Any], nranks: int) -> list[FileEntry] | None:
    """The files of ``items`` when every one is a plain, well-formed file object (the keys
    :func:`_parse_file` reads, no other; values of the types and ranges it accepts; names
    unique), checked column by column at C speed; ``None`` otherwise (then :func:`_parse_file`
    says what is wrong)."""
    if not all(type(d) is dict and d.keys() == _FILE_KEYS for d in items):
        return None
    names = [d["name"] for d in items]
    sizes = [d["size"] for d in items]
    checksums = [d["checksum"] for d in items]
    ranks = [d["ranks"] for d in items]
    segs = [d["meta_segments"] for d in items]
    if not (
        _all_of_type(names, str) and all(map(filenames.is_data_file_name, names))
        and len(set(names)) == len(names) and _ints_within(sizes, MAX_INT)
        and _all_of_type(checksums, str) and all(map(_HEX16_RE.match, checksums))
        and _all_of_type(ranks, list) and _all_of_type(segs, list)
    ):  # fmt: skip
        return None
    flat_ranks = list(itertools.chain.from_iterable(ranks))
    flat = list(itertools.chain.from_iterable(segs))
    if not (
        _ints_within(flat_ranks, nranks - 1) and _all_of_type(flat, list)
        and set(map(len, flat)) <= {3}
    ):  # fmt: skip
        return None
    offsets, lengths, digests = ([x[i] for x in flat] for i in range(3))
    if not (
        _ints_within(offsets, MAX_INT) and _ints_within(lengths, MAX_INT)
        and _all_of_type(digests, str) and all(map(_HEX16_RE.match, digests))
    ):  # fmt: skip
        return None
    segments = iter(list(map(Segment, offsets, lengths, digests)))
    return [
        FileEntry(n, size, c, tuple(r), tuple(itertools.islice(segments, len(s))))
        for n, size, c, r, s in zip(names, sizes, checksums, ranks, segs, strict=True)
    ]


# An index's files as this library writes them (files_fragment), checked whole by a regular
# expression instead of as 100,000 JSON objects (parse_manifest's fast path, _index_as_text):
# every value of the form and range _plain_files accepts (an integer of at most 18 digits is
# below MAX_INT), nothing else; names checked further with filenames.is_data_file_name.
_INT = r"(?:0|[1-9][0-9]{0,17})"
_HEX16 = r'"[0-9a-f]{16}"'
_SEGMENT = rf"\[{_INT},{_INT},{_HEX16}\]"
_FILE = (
    rf'\{{"name":"[A-Za-z0-9_.]+","size":{_INT},"checksum":{_HEX16},'
    rf'"ranks":\[{_INT}(?:,{_INT})*\],"meta_segments":\[(?:{_SEGMENT}(?:,{_SEGMENT})*)?\]\}}'
)
_FILES_RE = re.compile(rf"(?:{_FILE}(?:,{_FILE})*)?")
_NAME_SIZE_RE = re.compile(rf'\{{"name":"([^"]*)","size":({_INT}),')
_RANKS_RE = re.compile(r'"ranks":\[([0-9,]*)\]')
_FILES_KEY = ',"files":['
assert MAX_INT > 10**18


def _index_as_text(text: str | bytes) -> tuple[dict[str, Any], EncodedFiles] | None:
    """The document of an index (schema 3) as this library writes it, its files last, and its
    files kept as text (one fragment per file, with their columns: a restore's coordinator
    makes no object per file); ``None`` for any other text, which :func:`parse_manifest`
    then parses whole (so this path accepts nothing the other would not, and gives the same
    values).

    The text before the files is parsed as JSON; the files' text must match the form
    :func:`files_fragment` writes, every value of the type and range :func:`_plain_files`
    accepts (the rest of its checks, on the columns, are :func:`_checked_columns`'s)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            return None
    at = text.rfind(_FILES_KEY)
    if at < 0 or not text.endswith("]}"):
        return None
    body = text[at + len(_FILES_KEY) : -2]
    if not _FILES_RE.fullmatch(body):
        return None
    try:  # (a "files" key anywhere but at the top level leaves braces open: not JSON)
        doc = json.loads(text[:at] + "}")
    except (ValueError, RecursionError):
        return None
    if type(doc) is not dict or "files" in doc:
        return None
    if doc.get("schema_version") != SHARDED_SCHEMA_VERSION:
        return None
    fragments = body.split("},{") if body else []  # (no name, number or checksum holds a brace)
    if len(fragments) > 1:
        inner = ("{" + f + "}" for f in fragments[1:-1])
        fragments = [fragments[0] + "}", *inner, "{" + fragments[-1]]
    named = _NAME_SIZE_RE.findall(body)
    ranks = _RANKS_RE.findall(body)
    by_file: tuple[tuple[int, ...], ...]
    if all("," not in r for r in ranks):  # a file per rank: each list one rank
        by_file = tuple(zip(map(int, ranks), strict=True))
    else:
        by_file = tuple(tuple(map(int, r.split(","))) for r in ranks)
    columns = FileColumns(tuple(n for n, _ in named), tuple(int(z) for _, z in named), by_file)
    if not len(fragments) == len(columns.names) == len(by_file):
        return None
    return doc, EncodedFiles.of_columns(fragments, columns)


def _checked_columns(files: EncodedFiles, nranks: int) -> bool:
    """Whether the names of ``files`` (of :func:`_index_as_text`) are legal data file names,
    each once, and their ranks below ``nranks``."""
    cols = files.columns
    assert cols is not None
    flat = list(itertools.chain.from_iterable(cols.ranks))
    return (
        all(map(filenames.is_data_file_name, cols.names))
        and len(set(cols.names)) == len(cols.names)
        and (not flat or max(flat) < nranks)
    )


def _all_of_type(values: list[Any], kind: type) -> bool:
    """Whether every value is of exactly ``kind`` (not a subclass: ``bool`` is no ``int``)."""
    return set(map(type, values)) <= {kind}


def _ints_within(values: list[Any], top: int) -> bool:
    """Whether every value is an ``int`` (no ``bool``) in ``0 .. top``."""
    return _all_of_type(values, int) and (not values or (min(values) >= 0 and max(values) <= top))


def parse_manifest(
    text: str | bytes,
    *,
    memo: Memo | None = None,
) -> Manifest:
    """Parse and check a manifest read from disk. Its ranks' trees and names are checked with
    ``memo`` (the caller's :class:`~resilient.model.tree.Memo`; ``None``: one for this parse, so that
    the names every rank repeats are checked once).

    A sharded manifest (schema 3) is its index: its ranks are a :class:`ShardedRanks` with no
    entry loaded (its shards are read through :func:`resilient.io.manifests.load_entries`).

    Raises:
        ManifestError: the text is not a well-formed manifest of a supported version.
    """
    fast = _index_as_text(text)
    if fast is not None:
        try:
            return _parse_doc(*fast, memo)
        except ManifestError:  # the whole text parsed again, to say what is wrong
            pass
    return _parse_doc(json_object(text), None, memo)


def _parse_doc(
    doc: dict[str, Any], files_text: EncodedFiles | None, memo: Memo | None
) -> Manifest:
    """:func:`parse_manifest` of a manifest's document; ``files_text``: its files, kept as
    text (:func:`_index_as_text`; then ``doc`` has no files)."""
    if doc.get("format") != FORMAT:
        raise ManifestError(f"not a resilient manifest (format {doc.get('format')!r})")
    top = manifest_section(doc, "")
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
    step = top.require("step", int, minimum=0, maximum=MAX_INT)
    time_ = top.require("time", (int, float))
    if not 0 <= time_ <= _MAX_TIME:  # NaN too; float() of a huge int would raise OverflowError
        raise ManifestError(f"time: not a Unix time this reader accepts: {time_!r}")
    lay = _parse_layout(top.section("layout"))

    files: Sequence[FileEntry]
    if files_text is None:
        files = _parse_files(top, lay.nranks)
    elif _checked_columns(files_text, lay.nranks):
        files = files_text
    else:
        raise ManifestError("the index's files are not all legal")  # (the slow path says why)
    ranks: Sequence[RankEntry]
    if version == SHARDED_SCHEMA_VERSION:
        if "ranks" in doc:
            raise ManifestError("a sharded manifest (schema 3) lists its ranks in its shards")
        ranks = index_shards(top, files, lay.nranks)
    else:
        rank_sections = top.sections("ranks")
        if len(rank_sections) != lay.nranks:
            raise ManifestError(
                f"manifest lists {len(rank_sections)} ranks, layout says {lay.nranks}"
            )
        names = {f.name for f in files}
        memo = Memo() if memo is None else memo
        ranks = tuple(parse_rank(r, names, version, memo) for r in rank_sections)

    static = doc.get("static")
    if static is not None and (not isinstance(static, str) or not _HEX32_RE.match(static)):
        raise ManifestError(f"illegal static reference {static!r}")
    metrics = top.optional_section("metrics")
    manifest = Manifest(
        step=step,
        time=float(time_),
        layout=lay,
        files=files if isinstance(files, EncodedFiles) else tuple(files),
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
