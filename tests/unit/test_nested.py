"""Nested states: any nesting of mappings, lists and tuples; restore into existing arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from resilient.checkpoint.manager import CheckpointManager
from resilient.errors import ConfigError
from resilient.io.checkpoints import list_checkpoints


def nested_state(step: int) -> dict[str, Any]:
    return {
        "model": {
            "layer1.weight": np.arange(12, dtype=np.float32).reshape(3, 4) * step,
            "layer1.bias": np.zeros(3, dtype=np.float16) + step,
            "scalar": np.float64(step),
        },
        "optim": {
            "state": {0: {"step": np.array(float(step)), "exp_avg": np.ones((3, 4)) * step},
                      1: {"step": np.array(float(step)), "exp_avg": np.full(3, 0.5)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "rng": (3, tuple(range(5)), None),
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "none": None,
        "empty_array": np.zeros((0, 4)),
        "mixed": [np.arange(3), "text", 2.5, [np.ones(1), {"deep": np.eye(2)}]],
        "weird keys": {"": 1, ".": 2, "a/b": np.arange(2), "ü": 3, 7: "int key", -1: "negative"},
    }  # fmt: skip


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, np.ndarray | np.generic):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want), where
        assert got.tobytes() == np.asarray(want).tobytes(), where
        return
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want), where  # same keys, same order, same key types
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, where


def test_nested_state_round_trips_with_its_structure(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, nested_state(1), static={"mesh": {"coords": np.linspace(0, 1, 5)}})
        m.save(2, nested_state(2), static={"mesh": {"coords": np.linspace(0, 1, 5)}})
        step, got = m.restore()
    assert step == 2
    assert_same(got, {**nested_state(2), "mesh": {"coords": np.linspace(0, 1, 5)}})


def test_every_array_leaf_is_its_own_dataset_in_nested_groups(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, nested_state(1))
    with h5py.File(tmp_path / "step_00000001" / "rank_00000.h5", "r") as f:
        g = f["rank_00000"]
        assert (
            g["model/layer1.weight"][()].tolist()
            == nested_state(1)["model"]["layer1.weight"].tolist()
        )
        assert g["model/layer1.bias"].dtype == np.float16
        assert g["optim/state/%i0/exp_avg"].shape == (3, 4)  # int key 0
        assert g["weird%20keys/a%2Fb"][()].tolist() == [0, 1]  # " " and "/" escaped
        assert g["mixed/3/1/deep"].shape == (2, 2)
    manifest = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    assert manifest["ranks"][0]["tree"][0] == "d"


def test_non_contiguous_arrays_are_saved_as_their_values(tmp_path: Path) -> None:
    base = np.arange(24.0).reshape(4, 6)
    state = {"t": base.T, "s": base[:, ::2], "f": np.asfortranarray(base)}
    with CheckpointManager(tmp_path) as m:
        m.save(1, state)
        _, got = m.restore()
    for k, v in state.items():
        assert got[k].tolist() == v.tolist() and got[k].flags.c_contiguous


def test_restore_into_existing_arrays(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, nested_state(1))
        m.save(2, nested_state(2))
        template = nested_state(0)
        weight = template["model"]["layer1.weight"]
        exp_avg = template["optim"]["state"][1]["exp_avg"]
        step, got = m.restore(into={"model": template["model"], "optim": template["optim"]})
    assert step == 2
    assert got["model"]["layer1.weight"] is weight  # filled in place: the very same array
    assert got["optim"]["state"][1]["exp_avg"] is exp_avg
    assert_same(got, nested_state(2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer1.weight": np.zeros((4, 3), dtype=np.float32)}, r"'model/layer1.weight' is <f4 \(4, 3\) here"),
        ({"layer1.weight": np.zeros((3, 4), dtype=np.float64)}, r"'model/layer1.weight' is <f8 \(3, 4\) here but <f4"),
        ({"layer1.weight": np.zeros((3, 4), dtype=">f4")}, r"'model/layer1.weight' is >f4 \(3, 4\) here but <f4"),
        ({"layer1.bias": np.broadcast_to(np.float16(0), (3,))}, "'model/layer1.bias' is read-only"),
    ],
)  # fmt: skip
def test_restore_into_mismatched_arrays_is_a_clear_error_and_loses_nothing(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, nested_state(1))
        template = {"model": {**nested_state(0)["model"], **change}}
        with pytest.raises(ConfigError, match=message):
            m.restore(into=template)
        step, got = m.restore()  # nothing was quarantined
    assert step == 1 and [r.status for r in list_checkpoints(tmp_path)] == ["valid"]
    assert_same(got, nested_state(1))


def test_restore_into_a_non_contiguous_array_fills_it(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"w": np.arange(12.0).reshape(3, 4)})
        target = np.zeros((4, 3)).T  # a transposed view: not C-contiguous
        _, got = m.restore(into={"w": target})
    assert got["w"] is target and target.tolist() == np.arange(12.0).reshape(3, 4).tolist()


def test_checkpoints_of_older_versions_still_restore(tmp_path: Path) -> None:
    """A manifest without a tree (flat names, JSON values beside them) reads as before."""
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"x": np.arange(3.0), "v": {"a": [1, 2]}})
    path = tmp_path / "step_00000001"
    doc = json.loads((path / "manifest.json").read_text())
    rank = doc["ranks"][0]
    del rank["tree"]
    rank["values"] = {"v": {"a": [1, 2]}}
    cols = rank["datasets"]
    i = cols["names"].index("x")
    rank["datasets"] = {k: v[16 * i : 16 * i + 16] if k == "checksums" else [v[i]]
                        for k, v in cols.items()}  # fmt: skip
    text = json.dumps(doc, indent=1).encode()
    (path / "manifest.json").write_bytes(text)
    import xxhash

    (path / "COMMITTED").write_text(
        json.dumps({"step": 1, "manifest_checksum": xxhash.xxh3_64_hexdigest(text)})
    )
    with CheckpointManager(tmp_path) as m:
        _, got = m.restore()
    assert got["x"].tolist() == [0.0, 1.0, 2.0] and got["v"] == {"a": [1, 2]}


def test_a_mapping_of_arrays_is_one_compact_tree_node(tmp_path: Path) -> None:
    keys = ["w", "", "..", "a b/ü", "%i3", "layer.0.weight"]
    model = {k: np.full(3, i, dtype=np.float32) for i, k in enumerate(keys)}
    state = {"model": model, "step": 4, "opt": {"lr": 0.5, "m": np.ones(2)}}
    with CheckpointManager(tmp_path) as m:
        m.save(1, state)
        m.save(2, state)  # the node cached from the first save
        _, got = m.restore()
    assert list(got["model"]) == keys and got["step"] == 4
    for i, k in enumerate(keys):
        assert got["model"][k].tolist() == [i] * 3 and got["model"][k].dtype == np.float32
    doc = json.loads((tmp_path / "step_00000002" / "manifest.json").read_text())
    (node,) = [n for _, key, n in doc["ranks"][0]["tree"][1] if key == "model"]
    assert node == ["p", "model", keys]
    (opt,) = [n for _, key, n in doc["ranks"][0]["tree"][1] if key == "opt"]
    assert opt[0] == "d"  # a JSON value among the arrays: the general node
    with h5py.File(tmp_path / "step_00000002" / "rank_00000.h5") as f:
        assert sorted(f["rank_00000/model"]) == sorted(
            ["w", "%", "%2E%2E", "a%20b%2F%C3%BC", "%25i3", "layer.0.weight"]
        )


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        (["p", "model", ["w", "w"]], "repeated leaf path"),
        (["p", "model", ["w", 3]], "malformed plain mapping"),
        (["p", "../x", ["w"]], "illegal plain mapping path"),
        (["p", "model", ["w", "x" * 5000]], "illegal leaf path"),
        (["p", "other", ["w", "b"]], "does not match the datasets"),
        (["p", "model"], "malformed tree node"),
        (["p", 3, ["w", "b"]], "malformed tree node"),
    ],
)
def test_a_forged_compact_node_is_a_manifest_error(
    tmp_path: Path, node: list[Any], reason: str
) -> None:
    from resilient.model.codec import parse_manifest
    from resilient.model.manifest import ManifestError

    with CheckpointManager(tmp_path) as m:
        m.save(1, {"model": {"w": np.zeros(2), "b": np.ones(2)}})
    doc = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    assert doc["ranks"][0]["tree"] == ["d", [["s", "model", ["p", "model", ["w", "b"]]]]]
    doc["ranks"][0]["tree"][1][0][2] = node
    with pytest.raises(ManifestError, match=reason):
        parse_manifest(json.dumps(doc))


@hypothesis.settings(derandomize=True, max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(st.text(alphabet=st.sampled_from("aZ09_.+-%/ \nü."), max_size=6), unique=True),
    st.sampled_from(["", "model", "a/%i3"]),
)
def test_the_paths_of_a_compact_node_are_its_escaped_keys(keys: list[str], path: str) -> None:
    # the one-regex shortcut for keys that need no escape gives what escaping each key gives
    from resilient.model.tree import _child_paths, encode_key

    expected = [f"{path}/{encode_key(k)}" if path else encode_key(k) for k in keys]
    assert _child_paths(path, keys) == expected


@hypothesis.settings(derandomize=True, max_examples=400, deadline=None)
@hypothesis.given(st.lists(st.text(alphabet="ab.%-_/\n é0", max_size=5), max_size=6))
def test_keys_need_no_escape_exactly_when_each_encodes_to_itself(keys: list[str]) -> None:
    """The one-pass check over all keys of a mapping (the fast path of a state dict's flatten)
    agrees with escaping each key."""
    from resilient.model.tree import _all_safe, encode_key

    assert _all_safe(tuple(keys)) == all(encode_key(k) == k for k in keys)


@hypothesis.settings(derandomize=True, max_examples=600, deadline=None)
@hypothesis.given(
    st.lists(
        st.one_of(
            st.text(alphabet="ab.%-_/\n é0A", max_size=8),
            st.lists(st.sampled_from(["a", ".", "..", "x.y", "%41", "%i3", ""]), max_size=4).map(
                "/".join
            ),
            st.integers(100, 200).map(lambda n: "a/" * (n // 2) + "b"),  # long and deep ones
        ),
        max_size=6,
    )
)
@hypothesis.example(["0\n0"])  # a newline in a path is not a separator
@hypothesis.example(["a/b", "a//b"])
def test_paths_are_valid_together_exactly_when_each_is(paths: list[str]) -> None:
    """The one-pass check over a manifest's dataset names agrees with checking each name."""
    from resilient.model.tree import Memo, all_valid_paths, is_valid_path

    expected = all(map(is_valid_path, paths))
    assert all_valid_paths(paths) == expected
    memo = Memo()  # the caller's: what it remembers changes no answer
    assert all_valid_paths(paths, memo=memo) == expected
    assert all_valid_paths(paths, memo=memo) == expected
    assert all(map(is_valid_path, memo.valid))


def test_the_leaves_with_metadata_are_those_of_the_full_walk() -> None:
    """`leaf_metas` (what a restore into a template consults) finds exactly the leaves with
    metadata of `leaf_paths`, with theirs, in every kind of node."""
    from resilient.model.arrays import leaf_meta
    from resilient.model.blocks import Block, Replicated
    from resilient.model.payload import _plain_types
    from resilient.model.tree import flatten, leaf_metas, leaf_paths

    a = np.zeros(3)
    state = {
        "model": {"w": a, "b": a},  # a compact "p" node: no metadata
        "u": Block(np.zeros((2, 2)), (4, 2), (0, 0)),
        "opt": {"state": {0: {"m": a}, 1: {"m": a}}, "lr": 0.1},
        "seq": [a, (a, {"k": Block(np.zeros(2), (4,), (2,))})],
        "rep": Replicated({"x": a, "y": [a]}),
        "j": {"n": 1},
    }
    tree = flatten(state, leaf_meta, plain=_plain_types()).tree
    full = leaf_paths(tree)
    found = leaf_metas(tree)
    assert set(found) <= set(full)
    assert {p: m for p, m in full.items() if m} == {p: m for p, m in found.items() if m}
    assert {p for p, m in found.items() if "block" in m} == {"u", "seq/1/1/k"}


def test_the_tree_module_keeps_no_state_of_its_own() -> None:
    """Nothing is remembered in the module (issue 23, point 5): its module-level values are
    constants (no caches, no mutable containers); what is worth remembering lives in a
    caller's Memo, and a tree flattened with one is the tree flattened without."""
    import types

    import numpy as np

    from resilient.model import tree
    from resilient.model.arrays import leaf_meta

    mutable = (dict, list, set, bytearray)
    for name, value in vars(tree).items():
        if name.startswith("__") or isinstance(value, (types.ModuleType, type)):
            continue
        assert not hasattr(value, "cache_info"), f"tree.{name} is a cache"
        assert not isinstance(value, mutable) or name == "__all__", f"tree.{name} is mutable"
    state = {"model": {f"l{i}.w": np.zeros(2) for i in range(50)}, "opt": {3: {"m": 1}}}
    memo = tree.Memo()
    first = tree.flatten(state, leaf_meta, plain=frozenset({np.ndarray}), memo=memo)
    again = tree.flatten(state, leaf_meta, plain=frozenset({np.ndarray}), memo=memo)
    alone = tree.flatten(state, leaf_meta, plain=frozenset({np.ndarray}))
    assert first.tree == again.tree == alone.tree and list(first.arrays) == list(alone.arrays)
    assert memo.nodes and memo.paths  # remembered by the caller's memo
    assert tree.leaf_paths(first.tree, memo=memo) == tree.leaf_paths(alone.tree)
