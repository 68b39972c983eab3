"""The recorder and the crash-state generator of the crash tests (tests/crash), on calls made
here: what is recorded, and which states each rule of the persistence model allows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.crash.record import Call, load_calls, recording, snapshot
from tests.crash.states import (
    MODELS,
    PAGE,
    CrashState,
    crash_states,
    materialize,
    replay,
    states_at,
)


def _record(tmp_path: Path) -> tuple[dict[str, object], list[Call]]:
    """A small commit: a file written and fsynced in a new directory, a second file not
    fsynced, the directory renamed in, an old file unlinked."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "old").write_bytes(b"old")
    snap = snapshot(base)
    with recording(base, tmp_path / "log"):
        os.mkdir(base / "tmp")
        fd = os.open(base / "tmp" / "data", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(fd, b"A" * (2 * PAGE), 0)
        os.fsync(fd)
        os.close(fd)
        fd = os.open(base / "tmp" / "note", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"B" * (3 * PAGE))
        os.close(fd)
        os.rename(base / "tmp", base / "final")
        os.unlink(base / "old")
    calls, unrecorded = load_calls([tmp_path / "log"])
    assert not unrecorded
    return snap, calls


def test_the_recorder_sees_each_call_with_its_bytes(tmp_path: Path) -> None:
    _, calls = _record(tmp_path)
    assert [c.describe() for c in calls] == [
        "mkdir tmp",
        "create tmp/data",
        f"write tmp/data @0 +{2 * PAGE}",
        "fsync tmp/data",
        "create tmp/note",
        f"write tmp/note @0 +{3 * PAGE}",
        "rename tmp -> final",
        "unlink old",
    ]
    assert calls[2].data == b"A" * (2 * PAGE) and calls[2].key == calls[1].key == calls[3].key


def test_the_recorder_resolves_rmtree_and_ignores_other_directories(tmp_path: Path) -> None:
    base, other = tmp_path / "base", tmp_path / "other"
    (base / "d" / "e").mkdir(parents=True)
    (base / "d" / "e" / "f").write_bytes(b"x")
    other.mkdir()
    with recording(base, tmp_path / "log"):
        shutil.rmtree(base / "d")  # unlinks and rmdirs through dir_fd
        (other / "g").write_bytes(b"y")  # outside: not recorded, not listed
        with open(base / "h", "w") as fh:  # a buffered write under base: listed as missed
            fh.write("z")
    calls, unrecorded = load_calls([tmp_path / "log"])
    assert [c.describe() for c in calls] == ["unlink d/e/f", "rmdir d/e", "rmdir d"]
    assert unrecorded == ["open('h', 'w'): a buffered write"]


def _trees(
    snap: dict[str, object], calls: list[Call], model: str, point: int
) -> list[dict[str, bytes | None]]:
    out = []
    for state in states_at(calls, point, MODELS[model]):
        files = replay(snap, calls, state).files()
        out.append(
            {rel: (None if node.is_dir else bytes(node.data)) for rel, (_, node) in files.items()}
        )
    assert out
    return out


def test_metadata_persists_in_order_and_data_only_when_fsynced(tmp_path: Path) -> None:
    snap, calls = _record(tmp_path)
    trees = _trees(snap, calls, "ext4", len(calls))
    # rule 1: never the unlink without the rename before it, never the rename without the mkdir
    assert all(not ("old" not in t and "final" not in t) for t in trees)
    assert all("final/data" in t or "tmp/data" in t for t in trees)  # created before the fsync
    # rule 2/3: the fsynced file always whole; the other kept, lost or torn at a page
    assert all(t.get("final/data", t.get("tmp/data")) == b"A" * (2 * PAGE) for t in trees)
    notes = {t.get("final/note") for t in trees if "final/note" in t}
    assert notes == {b"B" * (3 * PAGE), b"", b"B" * PAGE}
    # the state the rules allow least: only what the fsync forced
    (least,) = [s for s in states_at(calls, len(calls), MODELS["ext4"]) if "fsynced" in s.label]
    assert set(replay(snap, calls, least).files()) == {"tmp", "tmp/data", "old"}


def test_xfs_may_leave_zeros_where_an_unsynced_append_was(tmp_path: Path) -> None:
    snap, calls = _record(tmp_path)
    ext4 = {t.get("final/note") for t in _trees(snap, calls, "ext4", len(calls))}
    xfs = {t.get("final/note") for t in _trees(snap, calls, "xfs", len(calls))}
    assert bytes(3 * PAGE) in xfs and bytes(3 * PAGE) not in ext4


def test_an_fsync_forces_every_earlier_metadata_call(tmp_path: Path) -> None:
    """A crash after the fsync: the mkdir and the create before it are always there."""
    snap, calls = _record(tmp_path)
    for t in _trees(snap, calls, "ext4", 4):
        assert t["tmp"] is None and t["tmp/data"] == b"A" * (2 * PAGE)


def test_states_are_distinct_and_materialize(tmp_path: Path) -> None:
    snap, calls = _record(tmp_path)
    states = list(crash_states(snap, calls, MODELS["xfs"]))
    assert len({s.digest for s in states}) == len(states)
    assert states[0] == CrashState(0, 0, model="xfs", digest=states[0].digest)  # the start
    materialize(replay(snap, calls, states[-1]), tmp_path / "out")
    assert (tmp_path / "out" / "old").exists() or (tmp_path / "out" / "final").is_dir()


def test_an_exchange_swaps_two_names_at_once() -> None:
    snap = {"a": {"dir": True, "key": "1:1"}, "b": {"dir": True, "key": "1:2"},
            "a/x": {"key": "1:3", "data": b"x"}}  # fmt: skip
    calls = [Call((1, 1, 1), "exchange", path="a", dest="b")]
    tree = replay(snap, calls, CrashState(1, 1))
    assert set(tree.files()) == {"a", "b", "b/x"}
    assert set(replay(snap, calls, CrashState(1, 0)).files()) == {"a", "b", "a/x"}


@pytest.mark.parametrize("model", ["ext4", "xfs"])
def test_a_write_to_an_inode_never_linked_goes_nowhere(model: str) -> None:
    """A create cut by the metadata prefix: its later write must not land in an older inode
    that had the same number."""
    snap = {"f": {"key": "9:7", "data": b"old"}}
    calls = [
        Call((1, 1, 1), "unlink", path="f"),
        Call((2, 1, 2), "create", path="g", key="9:7"),
        Call((3, 1, 3), "write", path="g", key="9:7", data=b"new"),
    ]
    for state in crash_states(snap, calls, MODELS[model]):
        files = {rel: bytes(n.data) for rel, (_, n) in replay(snap, calls, state).files().items()}
        assert files.get("f", b"old") == b"old", state
