"""Sharded manifests (schema 3): an index of shards, each holding some ranks' entries (issue 23,
point 4). Pure parsing and the validation of a directory; the save and restore of one under
real MPI ranks are in tests/test_mpi_core.py and tests/test_elastic.py."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from resilient.errors import InvalidCheckpointError
from resilient.io.checkpoints import validate_checkpoint
from resilient.io.manifests import SetFiles, load_entries, load_manifest, marker_text
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json, parse_manifest
from resilient.model.manifest import Manifest, ManifestError, ShardedRanks, ShardEntry
from resilient.model.shards import parse_shard, shard_json
from resilient.parallel.setcomms import shard_groups
from tests.unit.test_manifest import sample_manifest

# sample_manifest: node_00000.h5 holds ranks 0 and 1, node_00001.h5 rank 2


def write_sharded(directory: Path, whole: Manifest) -> Manifest:
    """``whole`` written as a sharded manifest, a shard per file, with its marker and empty
    data files of the right sizes (quick validation looks at their sizes); the index."""
    directory.mkdir()
    shards = []
    for i, f in enumerate(whole.files):
        text = shard_json(whole.kind, whole.step, {r: whole.ranks[r] for r in f.ranks}).encode()
        (directory / filenames.shard_name(i)).write_bytes(text)
        shards.append(ShardEntry(filenames.shard_name(i), len(text), digest_bytes(text), (f.name,)))
        with open(directory / f.name, "wb") as fh:
            fh.truncate(f.size)
    ranks = ShardedRanks(len(whole.ranks), shards, {f.name: f for f in whole.files})
    index = dataclasses.replace(whole, ranks=ranks, schema_version=3, static=None)
    text = manifest_json(index).encode()
    (directory / filenames.MANIFEST).write_bytes(text)
    (directory / filenames.COMMITTED).write_text(marker_text(whole.step, digest_bytes(text)))
    return index


def test_a_sharded_manifest_loads_the_shards_of_the_ranks_asked_for(tmp_path: Path) -> None:
    whole = sample_manifest()
    ck = tmp_path / "ck"
    write_sharded(ck, whole)
    doc = json.loads((ck / filenames.MANIFEST).read_text())
    assert doc["schema_version"] == 3 and "ranks" not in doc
    assert [s["files"] for s in doc["shards"]] == [["node_00000.h5"], ["node_00001.h5"]]
    index = load_manifest(ck)
    sharded = index.sharded
    assert sharded is not None and repr(sharded).endswith("0 loaded)")
    assert index.files == whole.files and index.nbytes == whole.nbytes
    with pytest.raises(LookupError, match=r"rank 2.s entry is in manifest-00001\.json, which was not"):
        index.ranks[2]  # a lookup never reads a file
    shard0 = (ck / filenames.shard_name(0)).read_bytes()
    (ck / filenames.shard_name(0)).unlink()  # rank 2's shard is the only one read
    two = load_entries(SetFiles.in_directory(ck), index, [2])
    assert two.ranks[2] == whole.ranks[2] and repr(two.sharded).endswith("1 loaded)")
    assert load_entries(SetFiles.in_directory(ck), two, [2]) is two  # nothing more to read
    with pytest.raises(InvalidCheckpointError, match=r"manifest-00000\.json is missing"):
        load_entries(SetFiles.in_directory(ck), two)
    (ck / filenames.shard_name(0)).write_bytes(shard0)
    assert list(load_entries(SetFiles.in_directory(ck), two).ranks) == list(whole.ranks)
    assert load_entries(SetFiles.in_directory(ck), whole) is whole  # a manifest of schema 2 holds its entries
    with pytest.raises(IndexError):
        index.ranks[3]


def test_a_part_holds_its_shard_only_and_pickles_small(tmp_path: Path) -> None:
    write_sharded(tmp_path / "ck", sample_manifest())
    loaded = load_manifest(tmp_path / "ck")
    part = loaded.part((2,))
    assert part.is_part and not loaded.is_part and [f.name for f in part.files] == ["node_00001.h5"]
    again = load_entries(SetFiles.in_directory(tmp_path / "ck"), pickle.loads(pickle.dumps(part)))  # (its files only)
    assert again.ranks[2] == sample_manifest().ranks[2]  # loaded on the receiving side
    assert again.is_part and repr(again.sharded).endswith("1 loaded)")
    with pytest.raises(LookupError, match="not in this part"):
        again.ranks[0]
    with pytest.raises(ValueError, match="cannot be written"):
        manifest_json(part)


def test_a_changed_missing_or_extra_shard_is_invalid(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    write_sharded(ck, sample_manifest())
    shard = ck / filenames.shard_name(1)
    text = shard.read_bytes()
    validate_checkpoint(ck, full=False)
    shard.write_bytes(text.replace(b'"step":1200', b'"step":1201'))  # same size, other bytes
    validate_checkpoint(ck, full=False)  # quick: sizes only
    with pytest.raises(InvalidCheckpointError, match="does not match its checksum in the index"):
        load_entries(SetFiles.in_directory(ck), load_manifest(ck))
    shard.write_bytes(text + b" ")
    with pytest.raises(InvalidCheckpointError, match="not the file its index describes"):
        validate_checkpoint(ck)
    shard.unlink()
    with pytest.raises(InvalidCheckpointError, match="manifest-00001\\.json is missing"):
        validate_checkpoint(ck)
    shard.write_bytes(text)
    (ck / filenames.shard_name(2)).write_bytes(text)
    with pytest.raises(InvalidCheckpointError, match="manifest-00002\\.json is not in the index"):
        validate_checkpoint(ck)


def _index(**change: object) -> str:
    whole = sample_manifest()
    shards = [
        ShardEntry(filenames.shard_name(i), 10, "0" * 16, (f.name,))
        for i, f in enumerate(whole.files)
    ]
    ranks = ShardedRanks(3, shards, {f.name: f for f in whole.files})
    doc = json.loads(manifest_json(dataclasses.replace(whole, ranks=ranks)))
    for key, value in change.items():
        doc["shards"][0][key] = value
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "../manifest-00000.json"}, "illegal or repeated shard name"),
        ({"name": "manifest-00001.json"}, "illegal or repeated shard name"),
        ({"files": ["node_00001.h5"]}, "a file is in two shards"),
        ({"files": ["node_00009.h5"]}, "names a file the manifest does not list"),
        ({"files": []}, "names a file the manifest does not list"),
        ({"size": 0}, "size"),
        ({"checksum": "xyz"}, "not a checksum"),
    ],
)
def test_a_hostile_index_is_rejected(change: dict[str, object], message: str) -> None:
    parse_manifest(_index())
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_index(**change))


def test_a_hostile_shard_is_rejected() -> None:
    whole = sample_manifest()
    files = {whole.files[0].name: whole.files[0]}
    good = json.loads(shard_json("checkpoint", 1200, {0: whole.ranks[0], 1: whole.ranks[1]}))
    assert parse_shard(json.dumps(good), files, kind="checkpoint", step=1200) == {
        0: whole.ranks[0],
        1: whole.ranks[1],
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"step": 7}, "not a shard of this checkpoint of step 1200"),
        ({"kind": "checkpoint"}, "not a shard of this checkpoint"),
        ({"ranks": [0]}, "2 entries for 1 ranks"),
        ({"ranks": [0, 0]}, "repeated rank"),
        ({"ranks": [0, 5]}, r"holds no entry for ranks \[1\]"),
        ({"entries": good["entries"][:1]}, "1 entries for 2 ranks"),
        ({"schema_version": 2}, "another schema version"),
    ]
    for change, message in cases:
        with pytest.raises(ManifestError, match=message):
            parse_shard(json.dumps({**good, **change}), files, kind="checkpoint", step=1200)
    other = {**good, "entries": [{**e, "file": "node_00001.h5"} for e in good["entries"]]}
    with pytest.raises(ManifestError, match="not listed in files"):
        parse_shard(json.dumps(other), files, kind="checkpoint", step=1200)


def test_shards_are_consecutive_whole_groups() -> None:
    assert shard_groups([(0,), (1,), (2,), (3,)], 2) == [0, 0, 1, 1]
    assert shard_groups([(0, 1, 2), (3,), (4, 5)], 2) == [0, 1, 1]
    assert shard_groups([(0, 1, 2, 3)], 1) == [0]  # a group is never split
    assert shard_groups([(0,), (1,), (2,)], 128) == [0, 0, 0]


def test_shards_of_a_node_local_tier_never_span_two_nodes() -> None:
    groups = [(0,), (1,), (2,), (3,), (4,)]
    # nodes of 3 and 2 ranks, shards of 2: node 0 fills shards 0 and 1, node 3 shard 2
    assert shard_groups(groups, 2, nodes=[0, 0, 0, 3, 3]) == [0, 0, 1, 2, 2]
    # a node's ranks need not be consecutive (round-robin placement): each node its own shards
    assert shard_groups(groups, 2, nodes=[0, 1, 0, 1, 0]) == [0, 1, 0, 1, 2]
    assert shard_groups(groups, 128, nodes=[0, 0, 0, 3, 3]) == [0, 0, 0, 1, 1]
