"""Schema 1's dataset entries: the fast path inside :func:`_parse_rows` accepts nothing its
strict walk rejects and gives the same entries; errors name the first faulty entry."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient.model.entries as entries_module
from resilient.model.codec import parse_manifest
from resilient.model.entries import _parse_rows, manifest_section
from resilient.model.manifest import DatasetEntry, ManifestError
from resilient.model.tree import Memo

H = "0123456789abcdef"
GOOD: dict[str, Any] = {
    "name": "model/layer1.weight",
    "shape": [4, 3],
    "dtype": "<f8",
    "offset": 4096,
    "nbytes": 96,
    "checksum": H,
}

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True)
    | st.sampled_from(["<f8", "|b1", "<f2", "<c16", ">i4", "|O", "x", "", "..", "a/../b", "%i1"])
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def parsed(entries: Any, *, fast: bool) -> Any:
    """The entries of a rank parsed, or the error's text."""
    rank = manifest_section({"file": "rank_00000.h5", "datasets": entries}, "ranks[0]")
    try:
        return _parse_rows(rank, Memo(), fast=fast)
    except ManifestError as exc:
        return f"rejected: {exc}"


def same_either_way(entries: Any) -> Any:
    fast = parsed(entries, fast=True)
    assert fast == parsed(entries, fast=False)
    return fast


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*GOOD, "stripes", "other"]), values, max_size=8))
def test_arbitrary_entries(doc: dict[str, Any]) -> None:
    same_either_way([doc])


@settings(max_examples=400, derandomize=True)
@given(st.sampled_from(sorted(GOOD)), values)
def test_one_field_of_a_good_entry_replaced(key: str, value: Any) -> None:
    same_either_way([GOOD, {**GOOD, "name": "b", key: value}])


def test_the_good_entry_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rank = manifest_section({"file": "rank_00000.h5", "datasets": [GOOD]}, "ranks[0]")

    def strict(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the strict walk was taken")

    monkeypatch.setattr(entries_module, "Section", strict)
    (entry,) = _parse_rows(rank, Memo())
    assert entry == DatasetEntry("model/layer1.weight", (4, 3), "<f8", 4096, 96, H)


def test_an_entry_with_stripes_is_read_by_the_strict_walk() -> None:
    striped = {**GOOD, "stripes": {"rows": 2, "digests": [GOOD["checksum"]] * 2}}
    (entry,) = same_either_way([striped])
    assert entry.stripes is not None and entry.stripes.rows == 2


# (Section's own errors start with "manifest: ", as they did before)
BAD = "rejected: ranks[0]"
SEC = "rejected: manifest: ranks[0]"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"name": "../a"}, ".datasets[1]: illegal dataset name '../a'"),
        ({"name": 7}, SEC + ".datasets[1].name: wrong type int 7, expected str"),
        ({"shape": [-1, 3]}, ".datasets[1]: illegal shape [-1, 3]"),
        ({"shape": [True, 3]}, ".datasets[1]: illegal shape [True, 3]"),
        ({"dtype": "|O"}, "rejected: unsupported dtype '|O' at ranks[0].datasets[1].dtype"),
        ({"nbytes": 95}, ".datasets[1]: nbytes 95 does not match shape (4, 3) x <f8"),
        (
            {"nbytes": True},
            SEC + ".datasets[1].nbytes: wrong type bool: expected int, got a boolean",
        ),
        ({"offset": None}, ".datasets[1]: non-empty dataset without an offset"),
        ({"offset": -1}, SEC + ".datasets[1].offset: out of range: must be >= 0, got -1"),
        ({"checksum": "ABC"}, ".datasets[1]: not a checksum: 'ABC'"),
        (
            {"stripes": {"rows": 2, "digests": []}},
            BAD + ".datasets[1].stripes: 0 stripe digests for 4 rows by 2",
        ),
        ({"name": "a"}, ": repeated dataset name"),
    ],
)
def test_errors_name_the_entry(change: dict[str, Any], error: str) -> None:
    entries = [{**GOOD, "name": "a"}, {**GOOD, "name": "b", **change}]
    got = same_either_way(entries)
    assert got == (error if error.startswith("rejected") else BAD + error)


def test_the_first_faulty_entry_is_named() -> None:
    # (an entry that is not an object after a faulty one was named before it: no longer)
    got = same_either_way([GOOD, {**GOOD, "name": "b", "checksum": "x"}, 5])
    assert got == f"{BAD}.datasets[1]: not a checksum: 'x'"
    assert same_either_way([GOOD, 5]) == (
        f"{SEC}.datasets[1]: not an object: expected a mapping, got int"
    )


def test_a_schema_1_manifest_with_a_bad_entry_names_it() -> None:
    doc: dict[str, Any] = {
        "format": "resilient-checkpoint",
        "schema_version": 1,
        "kind": "checkpoint",
        "step": 1,
        "time": 1.0,
        "checksum_algorithm": "xxh3_64",
        "layout": {"kind": "self", "nranks": 1, "groups": [[0]]},
        "files": [
            {
                "name": "rank_00000.h5",
                "size": 4192,
                "checksum": H,
                "ranks": [0],
                "meta_segments": [[0, 4096, H]],
            }
        ],
        "ranks": [{"file": "rank_00000.h5", "datasets": [GOOD], "values": {}}],
    }
    assert parse_manifest(json.dumps(doc)).ranks[0].datasets[0].name == GOOD["name"]
    doc["ranks"][0]["datasets"] = [{**GOOD, "dtype": "<U4"}]
    with pytest.raises(
        ManifestError, match=r"^unsupported dtype '<U4' at ranks\[0\]\.datasets\[0\]\.dtype$"
    ):
        parse_manifest(json.dumps(doc))
