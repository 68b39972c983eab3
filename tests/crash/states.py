"""Crash states: what a crash at each point of a recorded operation may leave on disk (pure).

Given the directory as it was before the operation (:func:`tests.crash.record.snapshot`) and
the operation's calls in order (:func:`tests.crash.record.load_calls`), :func:`crash_states`
yields, for every prefix of the calls (a crash after call *p*, for *p* = 0 ... *n*), the states
that the file system may show after the restart, and :func:`replay` builds one as a tree of
files; :func:`materialize` writes it to a directory, where the library's own readers look at
it. The method is ALICE's (Pillai et al., OSDI 2014): an abstract persistence model of the
file system, states built by replaying a subset of the calls on the snapshot, each state
checked as the application would see it after a reboot.

The persistence model: ext4 (``data=ordered``, delayed allocation) and XFS, as their
journals behave and ALICE measured them:

1. **Metadata is journaled in order.** Creates, mkdirs, renames (and ``renameat2``'s
   exchanges), links, unlinks, rmdirs and truncates persist as a prefix of their order: a
   crash keeps the first *k* of them, any *k*. A rename is atomic (the old name or the new,
   never neither).
2. **An fsync forces the journal.** ``fsync`` (or ``fdatasync``) of any file or directory
   makes every metadata call issued before it durable (a journal commit holds everything
   before it; ext4's jbd2 commits the running transaction, XFS forces its log up to the
   inode's last change, which holds every earlier item). Nothing is assumed of ext4's
   ``auto_da_alloc`` (the flush on a rename over a file).
3. **Data is durable only once its file is fsynced.** A write not followed by an ``fsync``
   of its file (before the crash) may be kept, lost, or torn at a page (4 KiB; a prefix of
   its pages kept), independently of other writes and of the metadata order (delayed
   allocation: a renamed file may be empty).
4. **XFS only:** an un-fsynced write that extended its file may leave the new size with zeros
   in place of the data (the size is metadata, logged before the data reaches the disk).

The states tried at each crash point (ALICE's: one reordering at a time, not every subset):
everything issued kept; the metadata cut before each metadata call not yet forced (with the
un-fsynced data kept, and with it lost); each un-fsynced write alone lost, alone torn, and on
XFS alone zeroed; and the least the rules allow (only what was forced). States that build the
same tree are tried once (:attr:`CrashState.digest`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.crash.record import Call

__all__ = [
    "MODELS",
    "PAGE",
    "CrashState",
    "Model",
    "Tree",
    "crash_states",
    "materialize",
    "replay",
    "states_at",
]

PAGE = 4096
METADATA = frozenset(
    {"create", "mkdir", "rename", "exchange", "link", "unlink", "rmdir", "truncate"}
)


@dataclass(frozen=True)
class Model:
    """A file system's persistence model (the module's rules 1-3, and 4 where
    ``zero_fills``)."""

    name: str
    zero_fills: bool


MODELS = {"ext4": Model("ext4", zero_fills=False), "xfs": Model("xfs", zero_fills=True)}


@dataclass(frozen=True)
class CrashState:
    """Which calls of ``calls[:point]`` persisted: the metadata calls before ``meta_cut``,
    and every write but those ``lost``, ``torn`` (a prefix of its pages) or ``zeroed``."""

    point: int
    meta_cut: int
    lost: frozenset[int] = frozenset()
    torn: frozenset[int] = frozenset()
    zeroed: frozenset[int] = frozenset()
    label: str = "all kept"
    model: str = "ext4"
    digest: str = ""

    def describe(self, calls: Sequence[Call]) -> str:
        """One line: where it crashed and what was lost."""
        after = calls[self.point - 1].describe() if self.point else "before the first call"
        return f"{self.model}: crash after #{self.point} ({after}): {self.label}"


# ------------------------------------------------------------------ the file-system tree


@dataclass
class _Inode:
    is_dir: bool
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)
    symlink: str | None = None


class Tree:
    """A directory tree of inodes, on which calls are replayed."""

    def __init__(self, initial: Mapping[str, Any]) -> None:
        self.inodes: dict[int, _Inode] = {0: _Inode(True)}
        self.by_key: dict[str, int] = {}
        for rel in sorted(initial, key=lambda r: r.count(os.sep)):
            entry = initial[rel]
            parent, name = self._parent(rel)
            if parent is None:
                continue
            key = entry.get("key", "")
            if key and key in self.by_key and not entry.get("dir"):  # a hard link
                self.inodes[parent].entries[name] = self.by_key[key]
                continue
            if "symlink" in entry:
                inode = _Inode(False, symlink=entry["symlink"])
            else:
                inode = _Inode(bool(entry.get("dir")), bytearray(entry.get("data", b"")))
            ino = self._new(inode, key)
            self.inodes[parent].entries[name] = ino

    def _new(self, inode: _Inode, key: str) -> int:
        ino = len(self.inodes)
        self.inodes[ino] = inode
        if key:
            self.by_key[key] = ino
        return ino

    def _lookup(self, rel: str) -> int | None:
        ino = 0
        if rel in ("", "."):
            return ino
        for part in rel.split(os.sep):
            node = self.inodes[ino]
            if not node.is_dir or part not in node.entries:
                return None
            ino = node.entries[part]
        return ino

    def _parent(self, rel: str) -> tuple[int | None, str]:
        head, name = os.path.split(rel)
        parent = self._lookup(head)
        if parent is None or not self.inodes[parent].is_dir:
            return None, name
        return parent, name

    def apply(self, call: Call, *, data: bytes | None = None, zero: bool = False) -> None:
        """Replay ``call`` (a write with other ``data``: a torn one; ``zero``: its bytes as
        zeros). A call whose path does not resolve (its directory was not persisted) is
        dropped, as the file system would never have shown it."""
        op = call.op
        if op in ("create", "mkdir"):
            ino = self._new(_Inode(op == "mkdir"), call.key)
            parent, name = self._parent(call.path)
            if parent is not None:
                self.inodes[parent].entries[name] = ino
        elif op == "write":
            target = self.by_key.get(call.key)
            if target is None:
                return
            body = call.data if data is None else data
            buf = self.inodes[target].data
            if zero:  # the size grew, the data never came: old bytes, then zeros
                old = bytes(buf[call.offset : call.offset + len(body)])
                body = old + bytes(len(body) - len(old))
            end = call.offset + len(body)
            if len(buf) < end:
                buf.extend(bytes(end - len(buf)))
            buf[call.offset : end] = body
        elif op == "truncate":
            target = self.by_key.get(call.key)
            if target is not None:
                buf = self.inodes[target].data
                if call.size < len(buf):
                    del buf[call.size :]
                else:
                    buf.extend(bytes(call.size - len(buf)))
        elif op in ("rename", "link"):
            sparent, sname = self._parent(call.path)
            dparent, dname = self._parent(call.dest)
            if sparent is None or dparent is None or sname not in self.inodes[sparent].entries:
                return
            ino = self.inodes[sparent].entries[sname]
            if op == "rename":
                del self.inodes[sparent].entries[sname]
            self.inodes[dparent].entries[dname] = ino
        elif op == "exchange":
            aparent, aname = self._parent(call.path)
            bparent, bname = self._parent(call.dest)
            if aparent is None or bparent is None:
                return
            a, b = self.inodes[aparent].entries, self.inodes[bparent].entries
            if aname in a and bname in b:
                a[aname], b[bname] = b[bname], a[aname]
        elif op in ("unlink", "rmdir"):
            parent, name = self._parent(call.path)
            if parent is not None:
                self.inodes[parent].entries.pop(name, None)

    def files(self) -> dict[str, tuple[int, _Inode]]:
        """``{relative path: (inode number, inode)}`` of everything reachable."""
        out: dict[str, tuple[int, _Inode]] = {}
        todo = [("", 0)]
        while todo:
            prefix, ino = todo.pop()
            for name, child in sorted(self.inodes[ino].entries.items()):
                rel = f"{prefix}{name}"
                out[rel] = (child, self.inodes[child])
                if self.inodes[child].is_dir:
                    todo.append((rel + os.sep, child))
        return out

    def digest(self) -> str:
        """The same for two trees that hold the same names, kinds and bytes."""
        h = hashlib.sha256()
        for rel, (_, node) in sorted(self.files().items()):
            kind = "d" if node.is_dir else ("l" if node.symlink is not None else "f")
            h.update(f"{rel}\0{kind}\0".encode())
            h.update(
                hashlib.sha256(
                    node.data if node.symlink is None else node.symlink.encode()
                ).digest()
            )
        return h.hexdigest()


def replay(initial: Mapping[str, Any], calls: Sequence[Call], state: CrashState) -> Tree:
    """The tree that ``state`` leaves: the snapshot with the persisted calls replayed."""
    tree = Tree(initial)
    for i, call in enumerate(calls[: state.point]):
        if call.op in METADATA:
            if i < state.meta_cut:
                tree.apply(call)
            elif call.op in ("create", "mkdir"):
                tree.by_key.pop(call.key, None)  # an inode never linked: its writes go nowhere
        elif call.op == "write":
            if i in state.zeroed:
                tree.apply(call, zero=True)
            elif i in state.torn:
                tree.apply(call, data=call.data[: _torn_length(call)])
            elif i not in state.lost:
                tree.apply(call)
    return tree


def _torn_length(call: Call) -> int:
    """The bytes of a write kept when it tears: up to the page boundary nearest its middle
    (0 or all when it spans no boundary: then it does not tear)."""
    middle = call.offset + len(call.data) // 2
    cut = (middle // PAGE) * PAGE
    if cut <= call.offset:
        cut = (call.offset // PAGE + 1) * PAGE
    return max(0, min(len(call.data), cut - call.offset))


def materialize(tree: Tree, dest: Path) -> None:
    """Write ``tree`` under the new directory ``dest`` (hard links kept as links)."""
    dest.mkdir(parents=True)
    written: dict[int, Path] = {}
    for rel, (ino, node) in sorted(tree.files().items()):
        path = dest / rel
        if node.is_dir:
            path.mkdir()
        elif node.symlink is not None:
            path.symlink_to(node.symlink)
        elif ino in written:
            os.link(written[ino], path)
        else:
            path.write_bytes(bytes(node.data))
            written[ino] = path


# ------------------------------------------------------------------ the states


def crash_states(
    initial: Mapping[str, Any], calls: Sequence[Call], model: Model
) -> Iterator[CrashState]:
    """Every distinct state of the module's list, at every crash point, each with its
    tree's digest (the first state to build a tree stands for the others)."""
    seen: set[str] = set()
    for point in range(len(calls) + 1):
        for state in states_at(calls, point, model):
            tree = replay(initial, calls, state)
            digest = tree.digest()
            if digest not in seen:
                seen.add(digest)
                yield CrashState(**{**state.__dict__, "digest": digest, "model": model.name})


def states_at(calls: Sequence[Call], point: int, model: Model) -> Iterator[CrashState]:
    """The module's list of states for a crash after ``calls[:point]`` (some may build the
    same tree)."""
    prefix = calls[:point]
    last_sync = max((i for i, c in enumerate(prefix) if c.op == "fsync"), default=-1)
    meta = [i for i, c in enumerate(prefix) if c.op in METADATA]
    unforced = [i for i in meta if i > last_sync]
    synced_keys: dict[str, int] = {}  # key -> index of its last fsync in the prefix
    for i, c in enumerate(prefix):
        if c.op == "fsync":
            synced_keys[c.key] = i
    loose = [
        i for i, c in enumerate(prefix)
        if c.op == "write" and synced_keys.get(c.key, -1) < i
    ]  # fmt: skip
    all_lost = frozenset(loose)
    yield CrashState(point, point, label="all kept")
    for cut in unforced:
        what = f"metadata from #{cut + 1} ({calls[cut].describe()}) on lost"
        yield CrashState(point, cut, label=what + ", unsynced data kept")
        if loose:
            yield CrashState(point, cut, lost=all_lost, label=what + ", unsynced data lost")
    for w in loose:
        call = calls[w]
        yield CrashState(
            point, point, lost=frozenset({w}), label=f"#{w + 1} ({call.describe()}) lost"
        )
        if 0 < _torn_length(call) < len(call.data):
            yield CrashState(
                point, point, torn=frozenset({w}), label=f"#{w + 1} ({call.describe()}) torn"
            )
        if model.zero_fills:
            yield CrashState(
                point, point, zeroed=frozenset({w}), label=f"#{w + 1} ({call.describe()}) zeros"
            )
    yield CrashState(point, last_sync + 1, lost=all_lost, label="only what was fsynced")
