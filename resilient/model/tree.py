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
    ["a", path, {meta}]      an array leaf with metadata, e.g. {"torch": "bfloat16"}; a
                             :class:`~resilient.model.blocks.Block` leaf has
                             {"block": {"global_shape": [...], "start": [...]}}, a DTensor
                             leaf that and {"dtensor": {"mesh": [...], "placements": [...]}}
    ["r", node]              a :class:`~resilient.model.blocks.Replicated` subtree
    ["d", [[k, key, node]]]  a mapping; k is "s" (str key) or "i" (int key)
    ["p", path, [key, ...]]  a mapping of str keys to numpy arrays without metadata (a state
                             dict's thousands of arrays), at ``path/encode_key(key)`` each
    ["l", [node, ...]]       a list
    ["t", [node, ...]]       a tuple

No state is kept in the module: what is worth remembering between calls (a state dict's leaf
paths, its ``"p"`` node, paths already found valid) is kept in a :class:`Memo` that the caller
owns and passes in (a manager keeps one for its saves and restores; a parse of a manifest, one
for its ranks, which repeat the same names). Without one, nothing is remembered.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from resilient.model.blocks import Block, Replicated

__all__ = [
    "MAX_DEPTH",
    "Flat",
    "ElasticKinds",
    "Memo",
    "TreeError",
    "all_valid_paths",
    "elastic_kinds",
    "encode_key",
    "flatten",
    "is_valid_path",
    "leaf_metas",
    "leaf_paths",
    "structure_of",
    "unflatten",
]

MAX_DEPTH = 64
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-")
_COMPONENT_RE = re.compile(r"^(?:%|%i-?[0-9]{1,40}|(?:[A-Za-z0-9_.+\-]|%[0-9A-F]{2}){1,1024})\Z")
_SAFE_RE = re.compile(r"[A-Za-z0-9_.+\-]+\Z")
_SAFE_BYTES = "".join(sorted(_SAFE)).encode()
_DOTS_LINE_RE = re.compile(r"^\.+$", re.MULTILINE)
_MAX_PATH = 8192


class TreeError(ValueError):
    """A state that cannot be flattened, or a stored tree that is malformed or hostile."""


class Flat(NamedTuple):
    """A state flattened: its tree, its array leaves (the objects as given) by path, and the
    metadata of the leaves that have some (tensors, Blocks; plain numpy has none)."""

    tree: Any
    arrays: dict[str, Any]
    metas: dict[str, Mapping[str, Any]]


class Memo:
    """What calls of this module may remember for their caller, who owns it and passes it in:
    the nodes and leaf paths of the last few ``"p"`` nodes (a state dict's thousands of names:
    made once, not at every save and restore) and the leaf paths already found valid (the
    ranks of a manifest repeat the same names: 256 ranks parsed in half the time). Bounded
    (each part is emptied when full); local, for one thread at a time.
    """

    __slots__ = ("nodes", "paths", "valid")

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        self.paths: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        self.valid: set[str] = set()

    def clear(self) -> None:
        """Forget everything."""
        self.nodes.clear()
        self.paths.clear()
        self.valid.clear()

    def add_valid(self, paths: Iterable[str]) -> None:
        """Remember ``paths`` as valid leaf paths (the caller checked them)."""
        if len(self.valid) >= _VALID_MAX:
            self.valid.clear()
        self.valid.update(paths)


_MEMO_NODES = 256  # "p" nodes remembered (nodes and paths each)
_VALID_MAX = 1 << 16  # valid paths remembered


def encode_key(key: str) -> str:
    """``key`` as one path component (reversible; see the module docstring)."""
    if key == "":
        return "%"
    if _SAFE_RE.match(key) and key.strip("."):  # nothing to escape (most keys): no loop
        return key
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


def is_valid_path(path: str) -> bool:
    """Whether ``path`` is a well-formed leaf path (escaped components joined by ``/``)."""
    if not path or len(path) > _MAX_PATH:
        return False
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        return False
    return all(_COMPONENT_RE.match(p) and set(p) != {"."} for p in parts)


def all_valid_paths(paths: Sequence[str], *, memo: Memo | None = None) -> bool:
    """Whether every one of ``paths`` (strings) is :func:`is_valid_path`: a few numpy passes
    over all of them at once when none holds an escape (a state dict's names), else one call
    each for those not in ``memo`` (and those found valid are added to it)."""
    if not paths:
        return True
    joined = "\n".join(paths)
    if joined and joined.isascii():
        import numpy as np

        kind = np.frombuffer(joined.encode().translate(_PATH_CLASSES), np.uint8)
        ends = np.flatnonzero(kind == _NEWLINE)
        if (
            len(ends) == len(paths) - 1  # no newline in a path
            and kind.all()  # safe characters, "/" and newlines only
            and kind[0] == _PLAIN  # the first path starts with a component not of dots
            and kind[-1] <= _DOT  # the last one does not end with "/"
            # after a "/" or a newline comes a component not starting with a dot
            and not (kind[1:][kind[:-1] >= _SLASH] != _PLAIN).any()
            # none is longer than _SHORT_PATH, so no component is too long, nor too many
            and np.diff(ends, prepend=-1, append=len(kind)).max() <= _SHORT_PATH + 1
        ):
            return True
    if memo is None:
        return all(map(is_valid_path, paths))
    unknown = set(paths).difference(memo.valid)
    if not all(map(is_valid_path, unknown)):
        return False
    memo.add_valid(unknown)
    return True


_INVALID, _PLAIN, _DOT, _SLASH, _NEWLINE = range(5)
_PATH_CLASSES = bytes(  # each byte's class in a path: a bytes.translate table (immutable)
    _PLAIN if b in _SAFE_BYTES and b != ord(".") else
    {ord("."): _DOT, ord("/"): _SLASH, ord("\n"): _NEWLINE}.get(b, _INVALID)
    for b in range(256)
)  # fmt: skip
_SHORT_PATH = 2 * MAX_DEPTH - 1  # paths this long have at most MAX_DEPTH components


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
    plain: frozenset[type] = frozenset(),
    memo: Memo | None = None,
) -> Flat:
    """Split ``state`` into its tree, its array leaves by path and their metadata (:class:`Flat`).

    The tree is the caller's own: JSON containers are copied, so later changes to ``state``
    do not reach it. Parts of it may be shared with the trees of earlier calls given the same
    ``memo`` and must not be modified.

    Args:
        state: a mapping with string keys (the top level).
        is_array: returns the leaf's metadata (``{}`` for plain numpy) if a value is an array
            leaf, else ``None``.
        what: how to name the state in errors.
        plain: types whose instances are array leaves without metadata (``numpy.ndarray``):
            a mapping with string keys and only such values (a state dict's thousands of
            arrays) is flattened in one step, its tree node reused while its keys are unchanged.
        memo: the caller's :class:`Memo` (``None``: nothing is remembered).

    Raises:
        TreeError: a key that is neither a string nor an int, a value that is neither an
            array, a container nor JSON, a cycle or a nesting deeper than :data:`MAX_DEPTH`.
    """
    if not isinstance(state, Mapping):
        raise TreeError(f"{what} must be a mapping of names to values")
    out = Flat(None, {}, {})
    memo = Memo() if memo is None else memo
    tree = _flatten(state, "", out, is_array, what, 0, set(), False, plain, memo)
    return out._replace(tree=tree)


def _flatten(
    value: Any,
    path: str,
    out: Flat,
    is_array: Callable[[Any], Mapping[str, Any] | None],
    what: str,
    depth: int,
    active: set[int],
    replicated: bool,
    plain: frozenset[type],
    memo: Memo,
) -> Any:
    if depth > MAX_DEPTH:
        raise TreeError(f"{_where(what, path)}: nested deeper than {MAX_DEPTH} levels")
    try:
        meta = is_array(value)
    except ValueError as exc:  # an array leaf that cannot be stored (a DTensor's placement)
        raise TreeError(f"{_where(what, path)}: {exc}") from None
    if meta is not None:
        if not path:
            raise TreeError(f"{what} must be a mapping, not an array")
        out.arrays[path] = value
        if not meta:
            return ["a", path]
        out.metas[path] = dict(meta)
        return ["a", path, dict(meta)]
    if isinstance(value, Replicated):
        if not path:
            raise TreeError(f"{what} must be a mapping, not Replicated (wrap its values)")
        inner = _flatten(
            value.value, path, out, is_array, what, depth + 1, active, True, plain, memo
        )
        return inner if replicated else ["r", inner]  # nested Replicated: once is enough
    if isinstance(value, Block):
        if replicated:
            raise TreeError(f"{_where(what, path)}: a Block inside a Replicated value")
        meta = is_array(value.local)
        if meta is None or not path:
            raise TreeError(f"{_where(what, path)}: a Block must wrap an array, inside a mapping")
        if "block" in meta:
            raise TreeError(f"{_where(what, path)}: a DTensor is a block already (unwrap it)")
        block = {"global_shape": list(value.global_shape), "start": list(value.start)}
        full = {**meta, "block": block}
        out.arrays[path] = value.local
        out.metas[path] = full
        return ["a", path, full]
    if path and _plain_json(value, depth):
        return ["j", _copy_json(value)]
    where = _where(what, path)
    if id(value) in active:
        raise TreeError(f"{where}: contains itself")
    if isinstance(value, Mapping):
        node = _plain_mapping(value, path, out.arrays, plain, memo) if plain and value else None
        if node is not None:
            return node
        active.add(id(value))
        items = []
        for key, child in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TreeError(f"{where}: key {key!r} is neither a string nor an int")
            tag = "s" if isinstance(key, str) else "i"
            name = encode_key(key) if isinstance(key, str) else f"%i{key}"  # never an escape
            sub = f"{path}/{name}" if path else name
            node = _flatten(
                child, sub, out, is_array, what, depth + 1, active, replicated, plain, memo
            )
            items.append([tag, key, node])
        active.discard(id(value))
        return ["d", items]
    if isinstance(value, (list, tuple)):
        active.add(id(value))
        children = [
            _flatten(
                child,
                f"{path}/{i}" if path else str(i),
                out,
                is_array,
                what,
                depth + 1,
                active,
                replicated,
                plain,
                memo,
            )
            for i, child in enumerate(value)
        ]
        active.discard(id(value))
        return ["t" if isinstance(value, tuple) else "l", children]
    if _is_json_scalar(value):
        return ["j", value]
    raise TreeError(
        f"{where}: {type(value).__name__} is neither an array, a mapping, a list, a tuple nor JSON"
    )


_NO_META: Mapping[str, Any] = MappingProxyType({})  # the metadata of every "p" leaf: none


def _plain_mapping(
    mapping: Mapping[Any, Any],
    path: str,
    arrays: dict[str, Any],
    plain: frozenset[type],
    memo: Memo,
) -> list[Any] | None:
    """The node of a mapping with string keys whose values are all of ``plain`` types (array
    leaves without metadata), its leaves added to ``arrays``; ``None`` for any other mapping.

    No per-leaf Python: the node (and, by :func:`_child_paths`, the leaves' paths) is kept in
    ``memo`` by ``(path, keys)``."""
    values = mapping.values()
    if not set(map(type, values)) <= plain:
        return None
    keys = tuple(mapping)
    node = memo.nodes.get((path, keys))
    if node is None:
        if set(map(type, keys)) != {str}:
            return None
        if len(memo.nodes) >= _MEMO_NODES:
            memo.nodes.clear()
        node = memo.nodes[(path, keys)] = ["p", path, list(keys)]
    paths = _child_paths(path, keys, memo)
    arrays.update(zip(paths, values, strict=True))
    return node


def _all_safe(keys: Sequence[str]) -> bool:
    """Whether no key needs escaping: each non-empty, of safe characters only, not all dots
    (C-speed passes over all keys at once: ~0.1 ms for 4,000, against ~1 ms for one regex)."""
    if not keys:
        return True
    if "" in keys:
        return False
    joined = "\n".join(keys)
    if not joined.isascii():
        return False
    # deleting every safe character leaves exactly the newlines between the keys if all are safe
    if len(joined.encode().translate(None, _SAFE_BYTES)) != len(keys) - 1:
        return False
    return not ("\n." in joined or joined.startswith(".")) or not _DOTS_LINE_RE.search(joined)


def _child_paths(
    path: str, keys: list[str] | tuple[str, ...], memo: Memo | None = None
) -> list[str]:
    """The leaf paths of a ``"p"`` node's keys (no Python per key unless one needs an escape;
    the paths of the last few nodes are kept in ``memo``)."""
    key = (path, tuple(keys))
    found = None if memo is None else memo.paths.get(key)
    if found is None:
        if _all_safe(keys):
            components: Iterable[str] = keys  # nothing to escape: no call per key
        else:
            components = map(encode_key, keys)
        found = list(map(f"{path}/".__add__, components) if path else components)
        if memo is None:
            return found
        if len(memo.paths) >= _MEMO_NODES:
            memo.paths.clear()
        memo.paths[key] = found
    return list(found)


def _copy_json(value: Any) -> Any:
    """A private copy of a plain JSON value (scalars are immutable: themselves)."""
    if type(value) is list or type(value) is dict:
        return json.loads(json.dumps(value, allow_nan=True))
    return value


def _where(what: str, path: str) -> str:
    return f"{what}[{path!r}]" if path else what


def leaf_paths(tree: Any, *, memo: Memo | None = None) -> dict[str, Mapping[str, Any]]:
    """Every array leaf of a tree: path -> metadata, checking the tree (``memo``: the caller's
    :class:`Memo`, if any).

    Raises:
        TreeError: a malformed tree, an illegal or a repeated leaf path.
    """
    out: dict[str, Mapping[str, Any]] = {}
    _walk(tree, out, 0, Memo() if memo is None else memo)
    return out


def leaf_metas(tree: Any) -> dict[str, Mapping[str, Any]]:
    """The array leaves of a (checked, see :func:`leaf_paths`) tree that have metadata: path ->
    metadata (no Python per leaf of a ``"p"`` node: they have none)."""
    out: dict[str, Mapping[str, Any]] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        tag = node[0]
        if tag == "a":
            if len(node) == 3:
                out[node[1]] = node[2]
        elif tag == "d":
            stack.extend(item[2] for item in node[1])
        elif tag in ("l", "t"):
            stack.extend(node[1])
        elif tag == "r":
            stack.append(node[1])
    return out


def _walk(node: Any, out: dict[str, Mapping[str, Any]], depth: int, memo: Memo) -> None:
    if depth > MAX_DEPTH + 1:
        raise TreeError("tree nested too deeply")
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise TreeError(f"malformed tree node {str(node)[:60]!r}")
    tag = node[0]
    if tag == "j" and len(node) == 2:
        return
    if tag == "a" and len(node) in (2, 3) and isinstance(node[1], str):
        path = node[1]
        if path not in memo.valid:
            if not is_valid_path(path):
                raise TreeError(f"illegal or repeated leaf path {path[:80]!r}")
            memo.add_valid((path,))
        if path in out:
            raise TreeError(f"illegal or repeated leaf path {path[:80]!r}")
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
            _walk(item[2], out, depth + 1, memo)
        return
    if tag == "p" and len(node) == 3 and type(node[1]) is str and type(node[2]) is list:
        keys = node[2]
        if keys and set(map(type, keys)) != {str}:
            raise TreeError(f"malformed plain mapping {str(node)[:60]!r}")
        if node[1] and not is_valid_path(node[1]):
            raise TreeError(f"illegal plain mapping path {node[1][:80]!r}")
        paths = _child_paths(node[1], keys, memo)
        if not all_valid_paths(paths, memo=memo):
            raise TreeError(f"illegal leaf path under {node[1][:80]!r}")
        before = len(out)
        out.update(zip(paths, itertools.repeat(_NO_META)))
        if len(out) != before + len(paths):
            raise TreeError(f"repeated leaf path under {node[1][:80]!r}")
        return
    if tag in ("l", "t") and len(node) == 2 and isinstance(node[1], list):
        for child in node[1]:
            _walk(child, out, depth + 1, memo)
        return
    if tag == "r" and len(node) == 2:
        _walk(node[1], out, depth + 1, memo)
        return
    raise TreeError(f"malformed tree node {str(node)[:60]!r}")


def unflatten(
    tree: Any,
    leaf: Callable[[str, Mapping[str, Any]], Any],
    plain: Callable[[list[str]], Iterable[Any]] | None = None,
    *,
    memo: Memo | None = None,
) -> Any:
    """Rebuild a structure from a (checked, see :func:`leaf_paths`) tree; ``leaf(path, meta)``
    gives each array leaf's value, and ``plain(paths)``, if given, the values of a ``"p"``
    node's leaves at once (else ``leaf`` is called for each). ``memo``: the caller's
    :class:`Memo`, if any."""
    tag = tree[0]
    if tag == "j":
        return tree[1]
    if tag == "r":
        return unflatten(tree[1], leaf, plain, memo=memo)
    if tag == "a":
        return leaf(tree[1], tree[2] if len(tree) == 3 else {})
    if tag == "d":
        return {key: unflatten(node, leaf, plain, memo=memo) for _, key, node in tree[1]}
    if tag == "p":
        paths = _child_paths(tree[1], tree[2], memo)
        values = plain(paths) if plain is not None else (leaf(p, _NO_META) for p in paths)
        return dict(zip(tree[2], values, strict=True))
    children = [unflatten(node, leaf, plain, memo=memo) for node in tree[1]]
    return tuple(children) if tag == "t" else children


@dataclass(frozen=True, slots=True)
class ElasticKinds:
    """What each part of a (checked) tree is for a restore on another rank count.

    Attributes:
        blocks: Block leaves: path -> their metadata (with ``"block"``); a DTensor leaf is
            one, inside a Replicated subtree too (its global tensor is the same on every rank).
        replicated: array leaves inside a Replicated subtree.
        blocking: paths of everything else (plain arrays and JSON values outside a Replicated
            subtree): per-rank data that cannot be given to another rank count.
    """

    blocks: Mapping[str, Mapping[str, Any]]
    replicated: frozenset[str]
    blocking: tuple[str, ...]


def elastic_kinds(tree: Any) -> ElasticKinds:
    """Sort the leaves of a checked tree (see :func:`leaf_paths`) by :class:`ElasticKinds`."""
    blocks: dict[str, Mapping[str, Any]] = {}
    replicated: set[str] = set()
    blocking: list[str] = []

    def walk(node: Any, path: str, inside: bool) -> None:
        tag = node[0]
        if tag == "r":
            walk(node[1], path, True)
        elif tag == "a":
            meta = node[2] if len(node) == 3 else {}
            if "block" in meta:  # (inside a Replicated value: a DTensor, the same global tensor)
                blocks[node[1]] = meta
            elif inside:
                replicated.add(node[1])
            else:
                blocking.append(node[1])
        elif tag == "j":
            if not inside:
                blocking.append(path)
        elif tag == "d":
            for kind, key, child in node[1]:
                name = encode_key(key) if kind == "s" else f"%i{key}"
                walk(child, f"{path}/{name}" if path else name, inside)
        elif tag == "p":
            paths = _child_paths(node[1], node[2])
            if inside:
                replicated.update(paths)
            else:
                blocking.extend(paths)
        else:
            for i, child in enumerate(node[1]):
                walk(child, f"{path}/{i}" if path else str(i), inside)

    walk(tree, "", False)
    return ElasticKinds(blocks, frozenset(replicated), tuple(blocking))


def structure_of(tree: Any) -> Any:
    """A checked tree without what may differ between the ranks of an elastic checkpoint: JSON
    values and block starts (so that equal structures compare equal)."""
    tag = tree[0]
    if tag == "j":
        return ["j"]
    if tag == "a":
        meta = dict(tree[2]) if len(tree) == 3 else {}
        if isinstance(meta.get("block"), dict):
            meta["block"] = {k: v for k, v in meta["block"].items() if k != "start"}
        return ["a", tree[1], meta]
    if tag == "r":
        return ["r", structure_of(tree[1])]
    if tag == "p":
        return tree
    if tag == "d":
        return ["d", [[k, key, structure_of(node)] for k, key, node in tree[1]]]
    return [tag, [structure_of(node) for node in tree[1]]]
