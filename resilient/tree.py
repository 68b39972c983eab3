"""Nested states: mappings, lists and tuples of arrays and JSON values, as named leaves. Pure.

A state such as ``{"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}`` is
flattened into array leaves, each named by its path (``model/layer1.weight``,
``optim/state/0/exp_avg``: one HDF5 dataset each, in nested groups, so ``h5ls -r`` shows them)
and a JSON *tree* that records the structure (dict or list or tuple, key order, integer keys)
with the JSON leaves inline. :func:`unflatten` rebuilds the same structure from the tree and the
arrays read back.

Keys are escaped reversibly into path components: letters, digits and ``_ . + -`` stay, every
other byte of the UTF-8 key becomes ``%XX``; ``""`` is ``%``, and a key made only of dots has its
dots escaped (``.`` and ``..`` are not HDF5 link names); an integer key ``7`` is ``%i7``, a name
no string key is escaped to. Nothing is rejected that is a string or an integer.

Tree nodes (JSON arrays, first element the tag)::

    ["j", value]             a plain JSON subtree (str-keyed dicts, lists, scalars)
    ["a", path]              an array leaf (numpy)
    ["a", path, {meta}]      an array leaf with metadata, e.g. {"torch": "bfloat16"}
    ["d", [[k, key, node]]]  a mapping; k is "s" (str key) or "i" (int key)
    ["l", [node, ...]]       a list
    ["t", [node, ...]]       a tuple
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "ArrayLeaf",
    "TreeError",
    "decode_key",
    "encode_key",
    "flatten",
    "is_valid_path",
    "leaf_paths",
    "unflatten",
]

MAX_DEPTH = 64
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-")
_COMPONENT_RE = re.compile(r"^(?:%|%i-?[0-9]{1,40}|(?:[A-Za-z0-9_.+\-]|%[0-9A-F]{2}){1,1024})\Z")
_ESCAPE_RE = re.compile(r"%([0-9A-F]{2})")
_MAX_PATH = 8192


class TreeError(ValueError):
    """A state that cannot be flattened, or a stored tree that is malformed or hostile."""


@dataclass(frozen=True, slots=True)
class ArrayLeaf:
    """An array leaf found while flattening: the object as given and its metadata for the tree."""

    value: Any
    meta: Mapping[str, Any]


@functools.lru_cache(maxsize=1 << 16)  # the same keys come back at every save
def encode_key(key: str) -> str:
    """``key`` as one path component (reversible; see the module docstring)."""
    if key == "":
        return "%"
    out = []
    for ch in key:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    text = "".join(out)
    if set(text) == {"."}:
        text = "%2E" * len(text)
    return text


def decode_key(component: str) -> str:
    """Inverse of :func:`encode_key`."""
    if component == "%":
        return ""
    raw = bytearray()
    pos = 0
    for m in _ESCAPE_RE.finditer(component):
        raw += component[pos : m.start()].encode("ascii")
        raw.append(int(m.group(1), 16))
        pos = m.end()
    raw += component[pos:].encode("ascii")
    return raw.decode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=1 << 16)  # the same names come back at every save and restore
def is_valid_path(path: str) -> bool:
    """Whether ``path`` is a well-formed leaf path (escaped components joined by ``/``)."""
    if not path or len(path) > _MAX_PATH:
        return False
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        return False
    return all(_COMPONENT_RE.match(p) and set(p) != {"."} for p in parts)


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _plain_json(value: Any, depth: int) -> bool:
    """Whether ``value`` round-trips through JSON unchanged (no tuples, no int keys)."""
    if depth > MAX_DEPTH:
        return False
    if _is_json_scalar(value):
        return True
    if type(value) is list:
        return all(_plain_json(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _plain_json(v, depth + 1) for k, v in value.items())
    return False


def flatten(
    state: Mapping[str, Any],
    is_array: Callable[[Any], Mapping[str, Any] | None],
    *,
    what: str = "state",
) -> tuple[Any, dict[str, ArrayLeaf]]:
    """Split ``state`` into its tree and its array leaves by path.

    Args:
        state: a mapping with string keys (the top level).
        is_array: returns the leaf's metadata (``{}`` for plain numpy) if a value is an array
            leaf, else ``None``.
        what: how to name the state in errors.

    Raises:
        TreeError: a key that is neither a string nor an int, a value that is neither an
            array, a container nor JSON, a cycle or a nesting deeper than :data:`MAX_DEPTH`.
    """
    if not isinstance(state, Mapping):
        raise TreeError(f"{what} must be a mapping of names to values")
    arrays: dict[str, ArrayLeaf] = {}
    tree = _flatten(state, "", arrays, is_array, what, 0, set())
    return tree, arrays


def _flatten(
    value: Any,
    path: str,
    arrays: dict[str, ArrayLeaf],
    is_array: Callable[[Any], Mapping[str, Any] | None],
    what: str,
    depth: int,
    active: set[int],
) -> Any:
    if depth > MAX_DEPTH:
        raise TreeError(f"{_where(what, path)}: nested deeper than {MAX_DEPTH} levels")
    meta = is_array(value)
    if meta is not None:
        if not path:
            raise TreeError(f"{what} must be a mapping, not an array")
        if not meta:
            arrays[path] = ArrayLeaf(value, {})
            return ["a", path]
        arrays[path] = ArrayLeaf(value, dict(meta))
        return ["a", path, dict(meta)]
    if path and _plain_json(value, depth):
        return ["j", value]
    where = _where(what, path)
    if id(value) in active:
        raise TreeError(f"{where}: contains itself")
    if isinstance(value, Mapping):
        active.add(id(value))
        items = []
        for key, child in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TreeError(f"{where}: key {key!r} is neither a string nor an int")
            tag = "s" if isinstance(key, str) else "i"
            name = encode_key(key) if isinstance(key, str) else f"%i{key}"  # never an escape
            sub = f"{path}/{name}" if path else name
            items.append([tag, key, _flatten(child, sub, arrays, is_array, what, depth + 1, active)])
        active.discard(id(value))
        return ["d", items]
    if isinstance(value, (list, tuple)):
        active.add(id(value))
        children = [
            _flatten(child, f"{path}/{i}" if path else str(i), arrays, is_array, what, depth + 1, active)
            for i, child in enumerate(value)
        ]
        active.discard(id(value))
        return ["t" if isinstance(value, tuple) else "l", children]
    if _is_json_scalar(value):
        return ["j", value]
    raise TreeError(
        f"{where}: {type(value).__name__} is neither an array, a mapping, a list, a tuple nor JSON"
    )


def _where(what: str, path: str) -> str:
    return f"{what}[{path!r}]" if path else what


def leaf_paths(tree: Any) -> dict[str, Mapping[str, Any]]:
    """Every array leaf of a (checked) tree: path -> metadata."""
    out: dict[str, Mapping[str, Any]] = {}
    _walk(tree, out, 0)
    return out


def _walk(node: Any, out: dict[str, Mapping[str, Any]], depth: int) -> None:
    if depth > MAX_DEPTH + 1:
        raise TreeError("tree nested too deeply")
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise TreeError(f"malformed tree node {str(node)[:60]!r}")
    tag = node[0]
    if tag == "j" and len(node) == 2:
        return
    if tag == "a" and len(node) in (2, 3) and isinstance(node[1], str):
        if not is_valid_path(node[1]) or node[1] in out:
            raise TreeError(f"illegal or repeated leaf path {node[1][:80]!r}")
        meta = node[2] if len(node) == 3 else {}
        if not isinstance(meta, dict):
            raise TreeError(f"leaf {node[1]!r}: metadata is not a mapping")
        out[node[1]] = meta
        return
    if tag == "d" and len(node) == 2 and isinstance(node[1], list):
        for item in node[1]:
            if (
                not isinstance(item, list)
                or len(item) != 3
                or item[0] not in ("s", "i")
                or not isinstance(item[1], str if item[0] == "s" else int)
                or isinstance(item[1], bool)
            ):
                raise TreeError(f"malformed mapping item {str(item)[:60]!r}")
            _walk(item[2], out, depth + 1)
        return
    if tag in ("l", "t") and len(node) == 2 and isinstance(node[1], list):
        for child in node[1]:
            _walk(child, out, depth + 1)
        return
    raise TreeError(f"malformed tree node {str(node)[:60]!r}")


def unflatten(tree: Any, leaf: Callable[[str, Mapping[str, Any]], Any]) -> Any:
    """Rebuild a structure from a (checked, see :func:`leaf_paths`) tree; ``leaf(path, meta)``
    gives each array leaf's value."""
    tag = tree[0]
    if tag == "j":
        return tree[1]
    if tag == "a":
        return leaf(tree[1], tree[2] if len(tree) == 3 else {})
    if tag == "d":
        return {key: unflatten(node, leaf) for _, key, node in tree[1]}
    children = [unflatten(node, leaf) for node in tree[1]]
    return tuple(children) if tag == "t" else children
