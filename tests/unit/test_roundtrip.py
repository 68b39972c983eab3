"""Save -> restore round trips: every supported dtype and shape, and JSON values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.io.checkpoints import validate_checkpoint
from tests.unit.ckutil import assert_state_equal, sample

DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
    ">f8",
    ">i4",
    ">c16",
    "<f4",
    ">u2",
]


def round_trip(tmp_path: Path, state: dict[str, Any], **kw: Any) -> dict[str, Any]:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, state, **kw)
    validate_checkpoint(root / "step_00000001", full=True)
    with CheckpointManager(root) as m:
        step, got = m.restore()
    assert step == 1
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (5, 3), (2, 3, 4), (4099,)])
def test_dtype_and_shape_round_trip(tmp_path: Path, dtype: str, shape: tuple[int, ...]) -> None:
    arr = sample(dtype, shape)
    got = round_trip(tmp_path, {"a": arr})
    assert_state_equal(got, {"a": arr})
    assert got["a"].dtype.str == np.dtype(dtype).str
    if arr.size:
        np.testing.assert_array_equal(got["a"], arr)


def test_all_dtypes_in_one_checkpoint(tmp_path: Path) -> None:
    state = {
        f"a_{np.dtype(d).str[1:]}_{i}": sample(d, (17, 3), seed=i) for i, d in enumerate(DTYPES)
    }
    got = round_trip(tmp_path, state)
    assert_state_equal(got, state)


def test_special_float_values_round_trip(tmp_path: Path) -> None:
    arr = np.array([np.nan, np.inf, -np.inf, -0.0, 5e-324, np.finfo(np.float64).max])
    half = np.array([np.nan, np.inf, -0.0, 65504.0], dtype=np.float16)
    got = round_trip(tmp_path, {"f": arr, "h": half})
    assert_state_equal(got, {"f": arr, "h": half})


def test_big_endian_is_restored_as_big_endian(tmp_path: Path) -> None:
    arr = (np.arange(10) * 1.5).astype(">f8")
    assert arr.dtype.str == ">f8"
    got = round_trip(tmp_path, {"be": arr})
    assert got["be"].dtype == np.dtype(">f8")
    assert got["be"].tobytes() == arr.tobytes()
    np.testing.assert_array_equal(got["be"], np.arange(10) * 1.5)


@pytest.mark.parametrize(
    "make",
    [
        lambda base: base.T,
        lambda base: base[::2, ::3],
        lambda base: base[:, 1],
        lambda base: base[::-1],
        lambda base: np.asfortranarray(base),
        lambda base: np.broadcast_to(base[0], (4, base.shape[1])),
    ],
    ids=["transposed", "strided", "column", "reversed", "fortran", "broadcast"],
)
def test_non_contiguous_input(tmp_path: Path, make: Any) -> None:
    base = np.arange(60, dtype=np.int64).reshape(6, 10)
    view = make(base)
    expected = np.ascontiguousarray(view)
    got = round_trip(tmp_path, {"v": view})
    assert got["v"].shape == view.shape
    assert got["v"].dtype == view.dtype
    np.testing.assert_array_equal(got["v"], view)
    assert got["v"].tobytes() == expected.tobytes()
    assert got["v"].flags.c_contiguous
    np.testing.assert_array_equal(base, np.arange(60).reshape(6, 10))  # input untouched


def test_zero_d_and_numpy_scalars(tmp_path: Path) -> None:
    state = {
        "zd": np.array(3.25),
        "zi": np.array(-7, dtype=np.int16),
        "zb": np.array(True),
        "scalar": np.float32(1.5),
    }
    got = round_trip(tmp_path, state)
    assert got["zd"].shape == () and got["zd"].dtype == np.float64 and got["zd"] == 3.25
    assert got["zi"].shape == () and got["zi"].dtype == np.int16 and got["zi"] == -7
    assert got["zb"].shape == () and got["zb"].dtype == np.bool_ and bool(got["zb"]) is True
    assert got["scalar"].dtype == np.float32 and got["scalar"] == np.float32(1.5)


def test_restored_arrays_are_writable_and_independent(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, {"a": np.arange(5.0)})
        _, first = m.restore()
        first["a"][:] = -1
        _, second = m.restore()
    np.testing.assert_array_equal(second["a"], np.arange(5.0))


def test_large_array_round_trip(tmp_path: Path) -> None:
    arr = sample("float64", (3, 1 << 18), seed=5)  # 6 MiB
    got = round_trip(tmp_path, {"big": arr, "small": np.arange(3, dtype=np.uint8)})
    assert_state_equal(got, {"big": arr, "small": np.arange(3, dtype=np.uint8)})


JSON_VALUES: dict[str, Any] = {
    "none": None,
    "true": True,
    "false": False,
    "zero": 0,
    "neg": -17,
    "big": 2**80 + 1,
    "bigneg": -(2**70),
    "float": 0.1,
    "negzero": -0.0,
    "tiny": 5e-324,
    "str": "plain",
    "unicode": "héllo wörld ✓ 日本語 \U0001f600",
    "escapes": 'quote " backslash \\ newline \n tab \t nul \x00',
    "empty_str": "",
    "empty_list": [],
    "empty_dict": {},
    "list": [1, "two", 3.0, None, True, [False, {"x": []}]],
    "nested": {"a": {"b": {"c": [1, 2, {"d": "e"}]}}, "ü-key": 1, "": "empty key"},
}


def _same_json(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _same_json(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same_json(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert repr(got) == repr(want), where
    else:
        assert got == want, where


def test_json_values_round_trip_with_types(tmp_path: Path) -> None:
    got = round_trip(tmp_path, dict(JSON_VALUES))
    assert sorted(got) == sorted(JSON_VALUES)
    for key, want in JSON_VALUES.items():
        _same_json(got[key], want, key)


def test_json_values_in_static_and_mixed_with_arrays(tmp_path: Path) -> None:
    state = {"arr": np.arange(4, dtype=np.int8), "meta": {"it": 3, "tags": ["a", "b"]}}
    static = {"grid": np.linspace(0, 1, 5), "units": "m", "params": {"dt": 0.01, "n": None}}
    got = round_trip(tmp_path, state, static=static)
    assert_state_equal(got, {**state, **static})
    _same_json(got["params"], static["params"])


def test_metrics_are_stored_in_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    metrics = {"loss": 0.25, "epoch": 3, "name": "run-ü", "ok": True, "hist": [1, 2]}
    with CheckpointManager(root) as m:
        m.save(1, {"a": np.zeros(1)}, metrics=metrics)
    manifest = validate_checkpoint(root / "step_00000001", full=True)
    _same_json(dict(manifest.metrics), metrics)


def test_empty_state_round_trip(tmp_path: Path) -> None:
    assert round_trip(tmp_path, {}) == {}


def test_data_file_is_plain_hdf5(tmp_path: Path) -> None:
    """h5py reads what resilient wrote: same arrays under /rank_00000."""
    root = tmp_path / "ck"
    state = {
        "x": sample("float32", (4, 5), seed=1),
        "be": np.arange(6, dtype=">i4"),
        "b": np.array([True, False]),
        "c": sample("complex128", (3,), seed=2),
        "e": np.zeros((0, 2)),
        "zd": np.array(2.5),
        "v": {"k": [1, 2]},
    }
    with CheckpointManager(root) as m:
        m.save(4, state)
    with h5py.File(root / "step_00000004" / "rank_00000.h5", "r") as f:
        g = f["rank_00000"]
        for key in ("x", "be", "b", "c", "e", "zd"):
            data = g[key][()]
            np.testing.assert_array_equal(data, state[key])
            assert g[key].shape == np.asarray(state[key]).shape
        # a fixed-length string: h5py reads bytes
        assert int(g.attrs["rank"]) == 0 and f.attrs["resilient_layout"].decode() == "self"
        # the step and the JSON values live in the manifest (the file is structure + data only)
        assert "v" not in g and "values_json" not in g.attrs
    manifest = json.loads((root / "step_00000004" / "manifest.json").read_text())
    assert (
        manifest["step"] == 4
        and ["s", "v", ["j", {"k": [1, 2]}]] in manifest["ranks"][0]["tree"][1]
    )


def test_a_checkpoint_of_the_first_manifest_schema_restores(tmp_path: Path) -> None:
    # tests/unit/data/v1_root: written by the library before datasets became columns
    # (manifest schema 1, files made by h5py); a newer library restores it, then saves on
    root = tmp_path / "v1"
    shutil.copytree(Path(__file__).parent / "data" / "v1_root", root)
    with CheckpointManager(root) as m:
        step, state = m.restore()
        assert step == 3
        np.testing.assert_array_equal(
            state["model"]["w"], np.arange(12, dtype=np.float32).reshape(3, 4)
        )
        assert state["model"]["b"].tolist() == [1, 2] and state["model"]["b"].dtype == np.int64
        assert (
            state["optim"]["state"][0]["step"] == 3.0
            and state["optim"]["state"][0]["m"].tolist() == [1.0] * 4
        )
        assert state["optim"]["groups"] == [{"lr": 0.1, "params": [0]}]
        assert isinstance(state["pair"], tuple) and state["pair"][1] == "x" and state["it"] == 7
        m.save(4, state)
        step, again = m.restore()
    assert step == 4 and again["model"]["w"].tobytes() == state["model"]["w"].tobytes()
    assert json.loads((root / "step_00000004" / "manifest.json").read_text())["schema_version"] == 2
