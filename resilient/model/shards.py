"""The shards of a sharded manifest (schema 3): each holds the entries of some ranks (whole file
groups) as schema 2 writes them, and the index (:mod:`resilient.model.codec`) lists them with
their sizes and checksums. Pure (no I/O): the bytes of a shard come from the caller.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

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
from resilient.model.manifest import (
    FORMAT,
    SCHEMA_VERSION,
    SHARDED_SCHEMA_VERSION,
    EncodedFiles,
    FileEntry,
    ManifestError,
    RankEntry,
    ShardedRanks,
    ShardEntry,
    columns_of,
)
from resilient.model.schema import Section
from resilient.model.tiling import check_group_blocks, check_group_tiling
from resilient.model.tree import Memo

__all__ = [
    "ShardDoc",
    "index_shards",
    "open_shard",
    "parse_shard",
    "shard_json",
]


class ShardDoc(NamedTuple):
    """A shard as read: its JSON, its header checked (see :func:`open_shard`); the ranks'
    entries are parsed only when asked for (:meth:`parse`)."""

    position: Mapping[int, int]  # rank -> index in entries
    entries: Sequence[Section]

    def subset(self, ranks: Iterable[int]) -> ShardDoc:
        """The entries of ``ranks`` only (those this shard holds): what a shard's leader hands
        a rank of a restore, which parses them itself (:meth:`parse`)."""
        held = [r for r in ranks if r in self.position]
        return ShardDoc(
            {r: i for i, r in enumerate(held)}, [self.entries[self.position[r]] for r in held]
        )

    def parse(
        self, files: Mapping[str, FileEntry], memo: Memo | None = None
    ) -> dict[int, RankEntry]:
        """The entries of the ranks of ``files`` in this shard, parsed and checked: each names
        its file, and together they tile their files (their blocks agree with each other).

        Raises:
            ManifestError: a rank missing from the shard, or a malformed or misplaced entry.
        """
        wanted = sorted(r for f in files.values() for r in f.ranks)
        missing = [r for r in wanted if r not in self.position]
        if missing:
            raise ManifestError(f"holds no entry for ranks {missing[:4]}")
        memo = Memo() if memo is None else memo
        names = set(files)
        entries = {
            r: parse_rank(self.entries[self.position[r]], names, SCHEMA_VERSION, memo)
            for r in wanted
        }
        check_group_tiling(list(files.values()), entries)
        check_group_blocks(entries.values())
        return entries


def index_shards(top: Section, files: Sequence[FileEntry], nranks: int) -> ShardedRanks:
    """The shard list of an index: every file in exactly one shard, every rank in one file
    (read off the files' columns: files given as text are not decoded)."""
    cols = columns_of(files)
    listed = set(cols.names)
    shards: list[ShardEntry] = []
    named: set[str] = set()
    placed: set[str] = set()
    for sec in top.sections("shards"):
        name = sec.require("name", str)
        if not filenames.is_shard_name(name) or name in named:
            raise ManifestError(f"{sec.path}: illegal or repeated shard name {name!r}")
        names = sec.require("files", list)
        try:
            held = set(names)  # (the manifest's file names are strings: no other value is one)
        except TypeError:  # an unhashable value
            held = {None}
        if not names or not held <= listed:
            raise ManifestError(f"{sec.path}: names a file the manifest does not list")
        if not placed.isdisjoint(held) or len(held) != len(names):
            raise ManifestError(f"{sec.path}: a file is in two shards")
        placed.update(held)
        named.add(name)
        shards.append(
            ShardEntry(
                name,
                sec.require("size", int, minimum=1, maximum=MAX_INT),
                checked_checksum(sec.doc.get("checksum"), sec.path),
                tuple(names),
            )
        )
    if placed != listed:
        raise ManifestError(f"files in no shard: {sorted(listed - placed)[:4]}")
    covered = sorted(itertools.chain.from_iterable(cols.ranks))
    if covered != list(range(nranks)):
        raise ManifestError("the files do not list every rank exactly once")
    given = files if isinstance(files, EncodedFiles) else {f.name: f for f in files}
    return ShardedRanks(nranks, shards, given)


def open_shard(text: str | bytes, *, kind: str, step: int) -> ShardDoc:
    """Parse one shard of a sharded manifest (see :func:`shard_json`) and check its header:
    format, version, kind and step, and one entry per listed rank.

    Raises:
        ManifestError: a malformed shard, or one of another checkpoint.
    """
    doc = json_object(text)
    top = manifest_section(doc, "")
    if top.require("schema_version", int) != SHARDED_SCHEMA_VERSION:
        raise ManifestError("a shard of another schema version than its index")
    if top.require("kind", str) != f"{kind} shard" or top.require("step", int) != step:
        raise ManifestError(f"not a shard of this {kind} of step {step}")
    ranks = top.require("ranks", list)
    if not all(is_index(r, MAX_RANKS) for r in ranks) or len(set(ranks)) != len(ranks):
        raise ManifestError("bad or repeated rank in its rank list")
    sections = top.sections("entries")
    if len(sections) != len(ranks):
        raise ManifestError(f"{len(sections)} entries for {len(ranks)} ranks")
    return ShardDoc({r: i for i, r in enumerate(ranks)}, sections)


def parse_shard(
    text: str | bytes,
    files: Mapping[str, FileEntry],
    *,
    kind: str,
    step: int,
    memo: Memo | None = None,
) -> dict[int, RankEntry]:
    """:func:`open_shard`, then :meth:`ShardDoc.parse` of ``files``.

    Raises:
        ManifestError: see both.
    """
    return open_shard(text, kind=kind, step=step).parse(files, memo)


def shard_json(kind: str, step: int, entries: Mapping[int, RankEntry]) -> str:
    """A shard of a sharded manifest (schema 3): the entries of some ranks (a union of whole
    file groups), by rank, as the whole manifest of schema 2 writes them; its index
    (:func:`~resilient.model.codec.manifest_json` of a manifest with
    :class:`~resilient.model.manifest.ShardedRanks`) names it with its size
    and checksum."""
    ranks = sorted(entries)
    doc = {
        "format": FORMAT,
        "schema_version": SHARDED_SCHEMA_VERSION,
        "kind": f"{kind} shard",
        "step": step,
        "ranks": ranks,
        "entries": [rank_doc(entries[r]) for r in ranks],
    }
    return json.dumps(doc, allow_nan=True, separators=(",", ":"))
