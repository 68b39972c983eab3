"""The fast path for well-formed dataset entries accepts nothing the full parser rejects."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.model.manifest import ManifestError, _dataset_fast, _parse_dataset, _section

GOOD = {
    "name": "model/layer1.weight",
    "shape": [4, 3],
    "dtype": "<f8",
    "offset": 4096,
    "nbytes": 96,
    "checksum": "0123456789abcdef",
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


def full(doc: Any) -> Any:
    try:
        return _parse_dataset(_section(doc, "ranks[0].datasets[0]"))
    except ManifestError:
        return "rejected"


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*GOOD, "stripes", "other"]), values, max_size=8))
def test_arbitrary_entries(doc: dict[str, Any]) -> None:
    fast = _dataset_fast(doc)
    assert fast is None or fast == full(doc)


@settings(max_examples=400, derandomize=True)
@given(st.sampled_from(sorted(GOOD)), values)
def test_one_field_of_a_good_entry_replaced(key: str, value: Any) -> None:
    doc = {**GOOD, key: value}
    fast = _dataset_fast(doc)
    assert fast is None or fast == full(doc)


def test_the_good_entry_takes_the_fast_path() -> None:
    fast = _dataset_fast(GOOD)
    assert fast is not None and fast == full(GOOD)
