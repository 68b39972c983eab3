"""An index (schema 3) read with its files kept as text (issue 38: a restore's coordinator at
100,000 ranks makes no object per file). :func:`parse_manifest` takes that path only for
the text this library writes; it accepts nothing the whole parse rejects and gives the same
manifest, and a part it hands on carries its files as text, decoded where they are used."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.errors import InvalidCheckpointError
from resilient.io.checkpoints import validate_checkpoint
from resilient.io.manifests import load_manifest
from resilient.model import filenames
from resilient.model.codec import _index_as_text, _parse_doc, manifest_json, parse_manifest
from resilient.model.entries import json_object
from resilient.model.layout import Layout
from resilient.model.manifest import (
    EncodedFiles,
    FileEntry,
    Manifest,
    ManifestError,
    Segment,
    ShardedRanks,
    ShardEntry,
)
from tests.unit.test_manifest import sample_manifest
from tests.unit.test_manifest_shards import write_sharded

H, H2 = "0123456789abcdef", "fedcba9876543210"


def index_of(nfiles: int, per_file: int = 1, per_shard: int = 2) -> Manifest:
    """An index of ``nfiles`` files of ``per_file`` ranks, ``per_shard`` files a shard."""
    files = tuple(
        FileEntry(filenames.file_name("self" if per_file == 1 else "custom", i), 4096 + i,
                  H if i % 2 else H2, tuple(range(i * per_file, (i + 1) * per_file)),
                  (Segment(0, 1024, H), Segment(1024 + i, 3072, H2))[: 1 + i % 2])
        for i in range(nfiles)
    )  # fmt: skip
    shards = [
        ShardEntry(filenames.shard_name(j), 100 + j, H, tuple(f.name for f in files[k : k + per_shard]))
        for j, k in enumerate(range(0, nfiles, per_shard))
    ]  # fmt: skip
    nranks = nfiles * per_file
    groups = tuple(f.ranks for f in files)
    return Manifest(
        step=7, time=1700000000.5, layout=Layout("self" if per_file == 1 else "custom", nranks, groups),
        files=files, ranks=ShardedRanks(nranks, shards, {f.name: f for f in files}),
        schema_version=3, metrics={"loss": 0.5},
    )  # fmt: skip


def whole_parse(text: str | bytes) -> Manifest:
    """The manifest as parsed without the text path (its files as objects)."""
    return _parse_doc(json_object(text), None, None)


def outcome(parse: object, text: str | bytes) -> object:
    """What ``parse`` makes of ``text``: the manifest's values, or that it was rejected."""
    try:
        m = parse(text)  # type: ignore[operator]
    except ManifestError:
        return "rejected"
    sharded = m.sharded
    assert sharded is not None
    return (dataclasses.replace(m, files=tuple(m.files), ranks=()), sharded.shards,
            [sharded.shard_of(r) for r in range(m.layout.nranks)],
            [sharded.file_of(r) for r in range(m.layout.nranks)])  # fmt: skip


@pytest.mark.parametrize(("nfiles", "per_file"), [(1, 1), (5, 1), (4, 3)])
def test_an_index_as_written_keeps_its_files_as_text_and_means_the_same(
    nfiles: int, per_file: int
) -> None:
    text = manifest_json(index_of(nfiles, per_file))
    m = parse_manifest(text.encode())
    assert isinstance(m.files, EncodedFiles) and m.files.columns is not None
    assert m.files.columns.names == tuple(f.name for f in index_of(nfiles, per_file).files)
    assert m.nbytes == sum(4096 + i for i in range(nfiles))
    assert outcome(parse_manifest, text) == outcome(whole_parse, text)
    assert tuple(m.files) == index_of(nfiles, per_file).files


def test_a_part_carries_its_files_as_text() -> None:
    m = parse_manifest(manifest_json(index_of(6)))
    parts = m.parts([[4, 5], [1], [0, 3]])
    for part, ranks in zip(parts, [[4, 5], [1], [0, 3]], strict=True):
        assert isinstance(part.files, EncodedFiles) and part.files.columns is not None
        assert [f.ranks for f in part.files] == [(r,) for r in ranks]
        assert part.nbytes == sum(4096 + r for r in ranks)
        again = pickle.loads(pickle.dumps(part))
        assert tuple(again.files) == tuple(part.files)
        assert again.sharded is not None and [again.sharded.file_of(r).name for r in ranks] == [
            filenames.file_name("self", r) for r in ranks
        ]
    assert [s.name for s in parts[2].sharded.shards] == ["manifest-00000.json", "manifest-00001.json"]  # type: ignore[union-attr]
    with pytest.raises(LookupError, match="rank 2"):
        parts[0].sharded.shard_of(2)  # type: ignore[union-attr]


def edited(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text, old
    return text.replace(old, new, count)


GOOD = manifest_json(index_of(5))
CASES = {
    "as written": GOOD,
    "a trailing newline": GOOD + "\n",
    "keys in another order": edited(GOOD, '{"name":"rank_00001.h5","size":4097,',
                                    '{"size":4097,"name":"rank_00001.h5",'),
    "a size of 19 digits under the limit": edited(GOOD, '"size":4097', '"size":1000000000000000000'),
    "a size over the limit": edited(GOOD, '"size":4097', '"size":' + str(1 << 63)),
    "a repeated name": edited(GOOD, "rank_00001.h5", "rank_00000.h5", 3),
    "an illegal name": edited(GOOD, "rank_00001.h5", "../rank_00001.h5", 3),
    "a rank out of range": edited(GOOD, '"ranks":[4]', '"ranks":[5]'),
    "a rank twice": edited(GOOD, '"ranks":[4]', '"ranks":[3]'),
    "no ranks": edited(GOOD, '"ranks":[4]', '"ranks":[]'),
    "a negative size": edited(GOOD, '"size":4097', '"size":-1'),
    "a float size": edited(GOOD, '"size":4097', '"size":4097.0'),
    "a leading zero": edited(GOOD, '"size":4097', '"size":04097'),
    "an upper-case checksum": edited(GOOD, H2, H2.upper()),
    "an extra key": edited(GOOD, '"ranks":[4],', '"ranks":[4],"x":"},{",'),
    "a file too few": GOOD[: GOOD.rindex(',{"name":"rank_00004.h5"')] + "]}",
    "a second files key": edited(GOOD, '"metrics":{', '"files":[],"metrics":{'),
    "a files key in the metrics": edited(GOOD, '"metrics":{"loss":0.5}', '"metrics":{"files":[1]}'),
    "files not last": edited(GOOD, '"metrics":{"loss":0.5},', "") [:-1] + ',"metrics":{}}',
    "a nested files key last": edited(GOOD, ',"files":[', ',"metrics2":{"a":1,"files":['),
    "schema 2": edited(GOOD, '"schema_version":3', '"schema_version":2'),
    "a segment of two values": edited(GOOD, '[0,1024,"' + H + '"]', "[0,1024]"),
    "no segments": edited(GOOD, '"meta_segments":[[0,1024,"' + H + '"]]', '"meta_segments":[]'),
}  # fmt: skip


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_the_text_path_accepts_what_the_whole_parse_accepts_and_no_more(text: str) -> None:
    assert outcome(parse_manifest, text) == outcome(whole_parse, text)
    assert outcome(parse_manifest, text.encode()) == outcome(whole_parse, text.encode())


# (accepted, taken on the text path): the cases reach both outcomes on both paths
EXPECTED = {
    "as written": (True, True), "a trailing newline": (True, False),
    "keys in another order": (True, False), "a size of 19 digits under the limit": (True, False),
    "a size over the limit": (False, False), "a repeated name": (False, True),
    "an illegal name": (False, False), "a rank out of range": (False, True),
    "a rank twice": (False, True), "no ranks": (False, False), "a negative size": (False, False),
    "a float size": (False, False), "a leading zero": (False, False),
    "an upper-case checksum": (False, False), "an extra key": (True, False),
    "a file too few": (False, True), "a second files key": (True, False),
    "a files key in the metrics": (True, True), "files not last": (True, False),
    "a nested files key last": (False, False), "schema 2": (False, False),
    "a segment of two values": (False, False), "no segments": (True, True),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_which_path_each_case_takes(name: str) -> None:
    accepted = outcome(parse_manifest, CASES[name]) != "rejected"
    assert (accepted, _index_as_text(CASES[name]) is not None) == EXPECTED[name]


@settings(max_examples=300, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(min_value=0, max_value=len(GOOD) - 1),
    st.integers(min_value=0, max_value=3),
    st.sampled_from([*'{}[],:"0123456789afz.-_ \\', "", "files", "rank_00009.h5", '"x"']),
)
def test_an_edited_index_means_the_same_either_way(at: int, cut: int, put: str) -> None:
    text = GOOD[:at] + put + GOOD[at + cut :]
    assert outcome(parse_manifest, text) == outcome(whole_parse, text)


def test_a_quick_validation_decodes_no_file(tmp_path: Path) -> None:
    index = write_sharded(tmp_path / "ck", sample_manifest())
    loaded = load_manifest(tmp_path / "ck")
    assert isinstance(loaded.files, EncodedFiles) and loaded.files._entries is None
    checked = validate_checkpoint(tmp_path / "ck")
    assert isinstance(checked.files, EncodedFiles) and checked.files._entries is None
    assert tuple(checked.files) == tuple(index.files)
    (tmp_path / "ck" / "node_00001.h5").write_bytes(b"x")
    with pytest.raises(InvalidCheckpointError, match=r"node_00001\.h5 has 1 bytes, manifest says 4096"):
        validate_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("given", ["text", "objects"])
def test_the_files_columns_are_made_once_for_all_parts(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore makes a part per rank (or shard): the files' columns are read off once, not
    once per part (which at 16,384 files is 16,384 times 16,384)."""
    import resilient.model.manifest as manifest_module

    m = index_of(64, 1, 8)
    m = parse_manifest(manifest_json(m)) if given == "text" else m
    calls: list[int] = []
    real = manifest_module.columns_of

    def counted(files: object) -> object:
        calls.append(1)
        return real(files)  # type: ignore[arg-type]

    monkeypatch.setattr(manifest_module, "columns_of", counted)
    parts = m.parts([[r] for r in range(64)])
    assert [[f.ranks for f in p.files] for p in parts] == [[(r,)] for r in range(64)]
    assert len(calls) == 1
