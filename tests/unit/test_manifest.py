"""The manifest: round trip, and strict rejection of malformed or hostile documents."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from resilient import CheckpointManager
from resilient.model.codec import manifest_json, parse_manifest
from resilient.model.entries import dtype_itemsize
from resilient.model.layout import Layout
from resilient.model.manifest import (
    CHECKSUM_ALGORITHM,
    FORMAT,
    SCHEMA_VERSION,
    DatasetEntry,
    DatasetTable,
    FileEntry,
    Manifest,
    ManifestError,
    RankEntry,
    Segment,
)
from resilient.model.tiling import combine_checksums, file_checksum_text, file_segments
from resilient.model.tree import is_valid_path

DATA = Path(__file__).parent / "data"
H = "0123456789abcdef"  # a well-formed checksum
H2 = "fedcba9876543210"
STATIC = "0123456789abcdef0123456789abcdef"


def sample_manifest() -> Manifest:
    """Two ranks sharing one 'node' file, plus a second 'node' file for rank 2.

    node_00000.h5 (12288 bytes): meta 0-4096, rank 0 'a' 4096-8192, rank 1 'b' 8192-10240,
    meta 10240-12288. node_00001.h5 (4096 bytes): meta 0-1024, rank 2 'c' 1024-1025, meta.
    """
    return Manifest(
        step=1200,
        time=1700000000.25,
        layout=Layout("node", 3, ((0, 1), (2,))),
        files=(
            FileEntry(
                name="node_00000.h5",
                size=12288,
                checksum=H,
                ranks=(0, 1),
                meta_segments=(Segment(0, 4096, H), Segment(10240, 2048, H2)),
            ),
            FileEntry(
                name="node_00001.h5",
                size=4096,
                checksum=H2,
                ranks=(2,),
                meta_segments=(Segment(0, 1024, H), Segment(1025, 3071, H2)),
            ),
        ),
        ranks=(
            RankEntry(
                "node_00000.h5",
                DatasetTable.of(
                    [
                        DatasetEntry("a", (16, 32), "<f8", 4096, 4096, H),
                        DatasetEntry("empty", (0, 3), "<i4", None, 0, H2),
                    ]
                ),
                {"it": 7, "name": "ü", "nested": {"l": [1, None, True]}},
            ),
            RankEntry(
                "node_00000.h5", DatasetTable.of([DatasetEntry("b", (512,), "<i4", 8192, 2048, H2)])
            ),
            RankEntry("node_00001.h5", DatasetTable.of([DatasetEntry("c", (), "|b1", 1024, 1, H)])),
        ),
        kind="checkpoint",
        static=STATIC,
        metrics={"loss": 0.125},
        library_version="0.1.0",
    )


def sample_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(manifest_json(sample_manifest()))
    return doc


# --------------------------------------------------------------------------- round trip


def test_round_trip_is_exact() -> None:
    m = sample_manifest()
    text = manifest_json(m)
    parsed = parse_manifest(text)
    assert parsed == m
    assert manifest_json(parsed) == text
    assert parse_manifest(text.encode()) == m


def test_datasets_are_columns() -> None:
    doc = sample_doc()
    assert doc["ranks"][0]["datasets"] == {
        "names": ["a", "empty"],
        "shapes": [[16, 32], [0, 3]],
        "dtypes": ["<f8", "<i4"],
        "offsets": [4096, None],
        "checksums": H + H2,
    }
    assert doc["ranks"][0]["datasets"]["names"] == [
        d.name for d in sample_manifest().ranks[0].datasets
    ]


def test_a_schema_1_manifest_is_read() -> None:
    # written by the library before datasets became columns: one object per dataset
    text = (DATA / "v1_root" / "step_00000003" / "manifest.json").read_text()
    assert json.loads(text)["schema_version"] == 1
    parsed = parse_manifest(text)
    assert parsed.schema_version == 1 and parsed.step == 3
    assert [d.name for d in parsed.ranks[0].datasets][:2] == ["model/w", "model/b"]
    assert parsed.ranks[0].datasets[0].shape == (3, 4) and parsed.ranks[0].datasets[0].nbytes == 48
    again = parse_manifest(manifest_json(parsed))  # written again: the current schema, same content
    assert json.loads(manifest_json(parsed))["schema_version"] == SCHEMA_VERSION == 2
    assert again.ranks == parsed.ranks and again.files == parsed.files


def test_round_trip_fields() -> None:
    parsed = parse_manifest(manifest_json(sample_manifest()))
    assert parsed.step == 1200
    assert parsed.layout.groups == ((0, 1), (2,))
    assert parsed.layout.describe() == "node (3 ranks, 2 files)"
    assert parsed.files[0].meta_segments == (Segment(0, 4096, H), Segment(10240, 2048, H2))
    assert parsed.ranks[0].datasets[1] == DatasetEntry("empty", (0, 3), "<i4", None, 0, H2)
    assert parsed.ranks[2].datasets[0].shape == ()
    assert parsed.ranks[0].values == {"it": 7, "name": "ü", "nested": {"l": [1, None, True]}}
    assert parsed.static == STATIC
    assert parsed.metrics == {"loss": 0.125}
    assert parsed.nbytes == 12288 + 4096
    assert parsed.schema_version == SCHEMA_VERSION
    assert parsed.checksum_algorithm == CHECKSUM_ALGORITHM


def test_doc_header() -> None:
    doc = sample_doc()
    assert doc["format"] == FORMAT
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["checksum_algorithm"] == CHECKSUM_ALGORITHM


def test_a_real_manifest_round_trips(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(5, {"x": np.arange(1000.0), "y": np.zeros((2, 0)), "v": {"a": 1}})
    text = (tmp_path / "ck" / "step_00000005" / "manifest.json").read_text()
    parsed = parse_manifest(text)
    assert manifest_json(parsed) == text
    assert parsed.step == 5
    assert parsed.layout == Layout("self", 1, ((0,),))
    assert [f.name for f in parsed.files] == ["rank_00000.h5"]
    assert {d.name: d.dtype for d in parsed.ranks[0].datasets} == {"x": "<f8", "y": "<f8"}
    assert ["s", "v", ["j", {"a": 1}]] in parsed.ranks[0].tree[1]  # JSON values live in the tree


def test_dtype_itemsize_and_keys() -> None:
    assert dtype_itemsize("<f8") == 8
    assert dtype_itemsize("|b1") == 1
    assert dtype_itemsize(">c16") == 16
    assert dtype_itemsize("u2") == 2
    assert is_valid_path("a.b-c+d_1") and is_valid_path("model/layer1.weight/%i0/%25")
    for bad in ("", "..", ".", "a/..", "/a", "a/", "a b", "x" * 9000, "ü", "%4", "%zz", "a//b"):
        assert not is_valid_path(bad), bad


# --------------------------------------------------------------------------- hostile input

Mutation = Callable[[dict[str, Any]], None]


def _set_file_name(name: str) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        old = doc["files"][0]["name"]
        doc["files"][0]["name"] = name
        for r in doc["ranks"]:
            if r["file"] == old:
                r["file"] = name

    return mutate


def _set(path: tuple[Any, ...], value: Any) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]

    return mutate


_COLUMN = {"name": "names", "shape": "shapes", "dtype": "dtypes", "offset": "offsets"}


def _dataset(rank: int, i: int, **changes: Any) -> Mutation:
    """Change fields of one dataset in a rank's columns (``checksum``: its 16 characters)."""

    def mutate(doc: dict[str, Any]) -> None:
        cols = doc["ranks"][rank]["datasets"]
        for key, value in changes.items():
            if key == "checksum":
                sums = cols["checksums"]
                cols["checksums"] = sums[: 16 * i] + value + sums[16 * i + 16 :]
            else:
                cols[_COLUMN[key]][i] = value

    return mutate


def _add_dataset(rank: int, entry: dict[str, Any]) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        cols = doc["ranks"][rank]["datasets"]
        for key, column in _COLUMN.items():
            cols[column].append(entry[key])
        cols["checksums"] += entry["checksum"]

    return mutate


HOSTILE: dict[str, tuple[Mutation, str]] = {
    # file names: paths and tricks
    "parent-dir": (_set_file_name("../x.h5"), "illegal or repeated file name"),
    "parent-parent": (_set_file_name("../../rank_00000.h5"), "illegal or repeated file name"),
    "absolute": (_set_file_name("/etc/passwd"), "illegal or repeated file name"),
    "absolute-h5": (_set_file_name("/tmp/rank_00000.h5"), "illegal or repeated file name"),
    "subdir": (_set_file_name("sub/dir.h5"), "illegal or repeated file name"),
    "subdir-rank": (_set_file_name("sub/rank_00000.h5"), "illegal or repeated file name"),
    "not-h5": (_set_file_name("rank_00000.txt"), "illegal or repeated file name"),
    "short-index": (_set_file_name("rank_1.h5"), "illegal or repeated file name"),
    "unknown-prefix": (_set_file_name("evil_00000.h5"), "illegal or repeated file name"),
    "dotfile": (_set_file_name(".rank_00000.h5"), "illegal or repeated file name"),
    "empty-name": (_set_file_name(""), "illegal or repeated file name"),
    "nul": (_set_file_name("rank_00000.h5\x00"), "illegal or repeated file name"),
    "trailing-newline": (_set_file_name("rank_00000.h5\n"), "illegal or repeated file name"),
    "manifest-itself": (_set_file_name("manifest.json"), "illegal or repeated file name"),
    "repeated-file": (_set(("files", 1, "name"), "node_00000.h5"), "illegal or repeated file"),
    # dtypes
    "dtype-O": (_dataset(0, 0, dtype="|O"), "unsupported dtype"),
    "dtype-O-bare": (_dataset(0, 0, dtype="O"), "unsupported dtype"),
    "dtype-V8": (_dataset(0, 0, dtype="|V8"), "unsupported dtype"),
    "dtype-U4": (_dataset(0, 0, dtype="<U4"), "unsupported dtype"),
    "dtype-S8": (_dataset(0, 0, dtype="|S8"), "unsupported dtype"),
    "dtype-M8": (_dataset(0, 0, dtype="<M8"), "unsupported dtype"),
    "dtype-f3": (_dataset(0, 0, dtype="<f3"), "unsupported dtype"),
    "dtype-b2": (_dataset(0, 0, dtype="|b2"), "unsupported dtype"),
    "dtype-struct": (_dataset(0, 0, dtype="[('a', '<f8')]"), "unsupported dtype"),
    "dtype-newline": (_dataset(0, 0, dtype="<f8\n"), "unsupported dtype"),
    "dtype-not-str": (_dataset(0, 0, dtype=8), "wrong type int"),
    "dtype-null": (_dataset(0, 0, dtype=None), "wrong type NoneType"),
    # dataset numbers
    "negative-offset": (_dataset(0, 0, offset=-4096), "out of range"),
    "float-offset": (_dataset(0, 0, offset=4096.0), "wrong type float"),
    "shape-changes-size": (_dataset(0, 0, shape=[16, 31]), "gap or overlap"),
    "negative-dim": (_dataset(0, 0, shape=[-16, -32]), "illegal shape"),
    "shape-not-list": (_dataset(0, 0, shape=512), "illegal shape"),
    "shape-of-floats": (_dataset(0, 0, shape=[16.0, 32]), "illegal shape"),
    "huge-dim": (_dataset(0, 0, shape=[1 << 48]), "illegal shape"),
    "too-many-dims": (_dataset(0, 0, shape=[1] * 33), "illegal shape"),
    "missing-offset": (_dataset(0, 0, offset=None), "without an offset"),
    "bad-dataset-name": (_dataset(0, 0, name="../a"), "illegal dataset name"),
    "rooted-dataset-name": (_dataset(0, 0, name="/a/b"), "illegal dataset name"),
    "dotdot-component": (_dataset(0, 0, name="a/../b"), "illegal dataset name"),
    "repeated-dataset": (_dataset(0, 1, name="a"), "repeated dataset name"),
    "bad-checksum": (_dataset(0, 0, checksum="XYZ" * 5 + "0"), "not a checksum"),
    "short-checksums": (_dataset(0, 0, checksum="abc"), "columns of different lengths"),
    "checksums-not-str": (_set(("ranks", 0, "datasets", "checksums"), [H, H2]), "wrong type list"),
    "column-missing": (_delete(("ranks", 0, "datasets", "dtypes")), "missing field 'dtypes'"),
    "column-short": (_set(("ranks", 0, "datasets", "offsets"), [4096]), "different lengths"),
    "column-unknown": (_set(("ranks", 0, "datasets", "nbytes"), [1, 2]), "unknown fields"),
    "name-not-str": (_dataset(0, 0, name=7), "illegal dataset name"),
    "upper-checksum": (_dataset(0, 0, checksum=H.upper()), "not a checksum"),
    "datasets-not-object": (_set(("ranks", 0, "datasets"), [1, 2]), "not an object"),
    # booleans where ints are expected
    "bool-step": (_set(("step",), True), "boolean"),
    "bool-schema": (_set(("schema_version",), True), "boolean"),
    "bool-time": (_set(("time",), False), "boolean"),
    "bool-nranks": (_set(("layout", "nranks"), True), "boolean"),
    "bool-size": (_set(("files", 0, "size"), True), "boolean"),
    "bool-offset": (_dataset(0, 0, offset=True), "boolean"),
    "bool-shape": (_dataset(0, 0, shape=[True, 4096]), "illegal shape"),
    "bool-group-rank": (_set(("layout", "groups"), [[0, True], [2]]), "bad or repeated rank"),
    "bool-file-rank": (_set(("files", 1, "ranks"), [True]), "bad rank list"),
    "bool-segment": (_set(("files", 0, "meta_segments", 0), [False, 4096, H]), "malformed"),
    # layout groups
    "groups-miss-a-rank": (_set(("layout", "groups"), [[0, 1]]), "cover every rank"),
    "repeated-rank-in-group": (_set(("layout", "groups"), [[0, 0], [2]]), "repeated rank"),
    "repeated-rank-across": (_set(("layout", "groups"), [[0, 1], [1, 2]]), "repeated rank"),
    "rank-out-of-range": (_set(("layout", "groups"), [[0, 1], [3]]), "bad or repeated rank"),
    "empty-group": (_set(("layout", "groups"), [[0, 1, 2], []]), "non-empty list"),
    "nranks-zero": (_set(("layout", "nranks"), 0), "nranks must be >= 1"),
    "unknown-layout": (_set(("layout", "kind"), "cluster"), "unknown kind"),
    "ranks-count": (_set(("layout", "nranks"), 4), "groups do not cover"),
    "file-rank-out-of-range": (_set(("files", 1, "ranks"), [7]), "bad rank list"),
    "rank-in-two-files": (_set(("files", 1, "ranks"), [2, 1]), "listed in two files"),
    "rank-names-wrong-file": (_set(("ranks", 2, "file"), "node_00000.h5"), "does not list it"),
    "rank-names-unlisted-file": (_set(("ranks", 2, "file"), "rank_00009.h5"), "not listed"),
    # tiling: overlaps, gaps, beyond the end
    "overlap": (_dataset(1, 0, offset=8000, shape=[512]), "gap or overlap"),
    "overlap-datasets": (
        _add_dataset(
            1,
            {
                "name": "d",
                "shape": [8],
                "dtype": "<f8",
                "offset": 8192,
                "nbytes": 64,
                "checksum": H,
            },
        ),
        "gap or overlap",
    ),
    "gap": (_set(("files", 0, "meta_segments", 0), [0, 4000, H]), "gap or overlap"),
    "segment-beyond-size": (_set(("files", 0, "size"), 12000), "file size is 12000"),
    "file-larger-than-segments": (_set(("files", 0, "size"), 13000), "file size is 13000"),
    "dataset-beyond-end": (
        _add_dataset(
            2,
            {
                "name": "far",
                "shape": [1],
                "dtype": "<f8",
                "offset": 1 << 40,
                "nbytes": 8,
                "checksum": H,
            },
        ),
        "gap or overlap",
    ),
    "negative-segment": (_set(("files", 0, "meta_segments", 0), [-1, 4097, H]), "malformed"),
    "short-segment": (_set(("files", 0, "meta_segments", 0), [0, 4096]), "malformed"),
    # header
    "wrong-format": (_set(("format",), "hdf5"), "not a resilient manifest"),
    "no-format": (_delete(("format",)), "not a resilient manifest"),
    "schema-4": (_set(("schema_version",), 4), "unsupported schema version 4"),
    "schema-3-ranks": (_set(("schema_version",), 3), "lists its ranks in its shards"),
    "schema-0": (_set(("schema_version",), 0), "unsupported schema version 0"),
    "schema-str": (_set(("schema_version",), "1"), "wrong type str"),
    "checksum-algorithm": (_set(("checksum_algorithm",), "md5"), "checksum algorithm"),
    "kind": (_set(("kind",), "evil"), "unknown manifest kind"),
    "negative-step": (_set(("step",), -1), "out of range"),
    "float-step": (_set(("step",), 1.5), "wrong type float"),
    "missing-step": (_delete(("step",)), "missing field 'step'"),
    "missing-files": (_delete(("files",)), "missing field 'files'"),
    "files-not-list": (_set(("files",), {}), "wrong type dict"),
    "file-not-object": (_set(("files", 0), "node_00000.h5"), "not an object"),
    "ranks-not-object": (_set(("ranks", 0), None), "not an object"),
    "values-not-object": (_set(("ranks", 0, "values"), [1]), "wrong type list"),
    "static-bad": (_set(("static",), "../../etc"), "illegal static reference"),
    "static-int": (_set(("static",), 5), "illegal static reference"),
    "metrics-list": (_set(("metrics",), [1]), "metrics: not an object"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_is_rejected(case: str) -> None:
    mutate, reason = HOSTILE[case]
    doc = sample_doc()
    mutate(doc)
    text = json.dumps(doc)
    assert text != json.dumps(sample_doc()), "the mutation changed nothing"
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    assert reason in str(info.value)


def test_sample_doc_is_valid_after_json_dumps() -> None:
    # guards the hostile tests: the unmutated document parses
    assert parse_manifest(json.dumps(sample_doc())) == sample_manifest()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "not JSON"),
        ("{", "not JSON"),
        ("{'format': 1}", "not JSON"),
        (b"\xff\xfe\x00garbage", "not JSON"),
        ("[]", "not a JSON object"),
        ("null", "not a JSON object"),
        ('"resilient-checkpoint"', "not a JSON object"),
        ("42", "not a JSON object"),
        ("{}", "not a resilient manifest"),
    ],
)
def test_non_manifests_are_rejected(text: str | bytes, reason: str) -> None:
    with pytest.raises(ManifestError, match=reason):
        parse_manifest(text)


def test_an_unsupported_dtype_is_named_where_it_is() -> None:
    # (was "unsupported dtype '|O'" alone, which still starts it; the first in column order)
    doc = sample_doc()
    _dataset(0, 1, dtype="<U4")(doc)
    _dataset(0, 0, dtype="|O")(doc)
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(doc))
    assert str(info.value) == "unsupported dtype '|O' at ranks[0].datasets.dtypes[0]"


def test_manifest_error_is_a_value_error() -> None:
    assert issubclass(ManifestError, ValueError)


def test_parsing_does_not_mutate_or_share_the_input() -> None:
    doc = sample_doc()
    before = copy.deepcopy(doc)
    parse_manifest(json.dumps(doc))
    assert doc == before


def test_legal_file_names_are_accepted() -> None:
    for name in ("rank_00000.h5", "node_00003.h5", "group_123456.h5", "world.h5"):
        doc = sample_doc()
        _set_file_name(name)(doc)
        assert parse_manifest(json.dumps(doc)).files[0].name == name


def test_file_checksum_text_from_the_columns_is_the_segments() -> None:
    """Two ranks in one file (datasets interleaved, an empty one), a file of its own: the text
    built from the columns is the one built segment by segment (what --full verifies)."""
    m = sample_manifest()
    for f in m.files:
        want = combine_checksums([s[:3] for s in file_segments(m, f)])
        assert file_checksum_text(m.ranks, f) == want and want.startswith("0:")


def test_file_checksum_text_of_a_real_save(tmp_path: Path) -> None:
    state = {f"w{i}": np.full(i % 7, i, dtype=np.int16) for i in range(300)}  # some empty
    with CheckpointManager(tmp_path) as m:
        m.save(1, state)
    manifest = parse_manifest((tmp_path / "step_00000001" / "manifest.json").read_text())
    (f,) = manifest.files
    assert file_checksum_text(manifest.ranks, f) == combine_checksums(
        [s[:3] for s in file_segments(manifest, f)]
    )


@hypothesis.settings(derandomize=True, max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(
        st.tuples(
            st.lists(st.one_of(st.integers(0, 9), st.sampled_from([2**47, 2**48 - 1])), max_size=4),
            st.sampled_from(["<f8", "|b1", "<c16", ">i2", "<f2"]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_dataset_sizes_from_the_columns_are_exact(rows: list[tuple[list[int], str]]) -> None:
    """The sizes found with numpy (vectors, mixed and 0-d shapes, several dtypes) are the exact
    products, and shapes whose product could overflow 64 bits are sized exactly too."""
    import itertools
    import math

    from resilient.model.entries import _sizes

    shapes, dtypes = [r[0] for r in rows], [r[1] for r in rows]
    dims = list(itertools.chain.from_iterable(shapes))
    expected = [math.prod(s) * dtype_itemsize(d) for s, d in rows]
    assert _sizes(shapes, dims, dtypes) == expected
