"""One conformance suite for every storage target (zarr's ``StoreTests``), with injected faults.

:class:`TargetTests` states what every :class:`~resilient.io.targets.Target` does, including
what a crash or a failed write between two calls leaves; each implementation's class only says
how to make one, how to "restart" over the same storage, and how to break its writes or tear
one of its files, then adds what it alone does.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from resilient.errors import CheckpointLockedError, InvalidCheckpointError
from resilient.io import logs
from resilient.io.commit import PendingDir
from resilient.io.targets import DirectoryTarget, FileStat, MemoryTarget, Target
from resilient.io.wire import new_hash
from resilient.model import filenames
from resilient.model.manifest import Manifest
from tests.unit.test_manifest import sample_manifest

DATA = b"0123456789" * 1000


def _digest(data: bytes) -> str:
    h = new_hash()
    h.update(data)
    digest: str = h.hexdigest()
    return digest


def manifest_of(step: int) -> Manifest:
    return dataclasses.replace(sample_manifest(), step=step)


class TargetTests:
    """What every target does. Subclasses provide the fixtures and the fault injectors."""

    @pytest.fixture
    def target(self) -> Target:
        raise NotImplementedError

    def restart(self, target: Target) -> Target:
        """The same storage as a new process would find it after a crash."""
        raise NotImplementedError

    def break_writes(self, monkeypatch: pytest.MonkeyPatch, target: Target, code: int) -> None:
        """Make every later write store half its bytes, then fail with ``code``."""
        raise NotImplementedError

    def tear(self, target: Target, step: int, name: str) -> None:
        """Cut the committed file ``name`` of ``step`` in half."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def save(self, target: Target, step: int, files: dict[str, bytes] | None = None) -> None:
        pending = target.pending(step)
        target.create(pending)
        for name, data in (files or {"rank_00000.h5": DATA}).items():
            target.write(pending, name, data)
        target.commit(pending, manifest_of(step), what=f"step {step}")

    # ------------------------------------------------------------------ the call order

    def test_an_empty_target_lists_nothing(self, target: Target) -> None:
        assert target.steps() == []
        target.clean_up()
        assert target.steps() == []

    def test_a_committed_step_is_listed_and_reads_back(self, target: Target) -> None:
        target.clean_up()
        self.save(target, 7, {"rank_00000.h5": DATA, "rank_00001.h5": b""})
        assert target.steps() == [7]
        assert target.manifest(7) == manifest_of(7)
        assert target.read(7, "rank_00000.h5") == DATA
        assert target.stat(7, "rank_00000.h5") == FileStat(len(DATA), True)
        assert target.stat(7, "rank_00001.h5") == FileStat(0, True)
        assert target.stat(7, "rank_00002.h5") is None
        with pytest.raises(FileNotFoundError):
            target.read(7, "rank_00002.h5")
        with pytest.raises(FileNotFoundError):
            target.read(8, "rank_00000.h5")

    def test_a_committed_sets_files_are_listed_and_read_small(self, target: Target) -> None:
        self.save(target, 7, {"rank_00000.h5": DATA, "rank_00001.h5": b"x"})
        assert sorted(target.file_names(7)) == sorted(
            ["rank_00000.h5", "rank_00001.h5", filenames.MANIFEST, filenames.COMMITTED]
        )
        assert target.file_names(8) == []
        assert target.read_small(7, "rank_00001.h5", 1) == b"x"
        assert target.read_small(7, "rank_00002.h5", 1) is None
        with pytest.raises(InvalidCheckpointError, match="implausibly large"):
            target.read_small(7, "rank_00000.h5", len(DATA) - 1)

    def test_a_set_by_name_commits_publishes_and_records_its_copies(self, target: Target) -> None:
        first = target.pending("abc")
        assert first.final.name == "abc"
        target.create(first)
        target.write(first, "rank_00000.h5", DATA)
        target.commit(first, manifest_of(2), what="a set by name", copies=1)
        assert target.steps() == []  # (not a step)
        assert "abc" in target.names()
        assert target.manifest("abc") == manifest_of(2)
        assert b'"data_copies": 1' in target.read("abc", filenames.COMMITTED)
        again = target.pending("abc.copy")
        target.create(again)
        for name in target.file_names("abc"):
            target.copy(again, name, target, "abc")
        target.publish(again, what="a copy as it is")
        for name in target.file_names("abc"):
            assert target.read("abc.copy", name) == target.read("abc", name)

    def test_trash_takes_a_set_out_of_the_listing_until_deleted(self, target: Target) -> None:
        for step in (1, 2):
            self.save(target, step)
        trash = target.trash(1, durable=False)
        assert target.steps() == [2]
        with pytest.raises(FileNotFoundError):
            target.trash(1)
        pending = target.pending(3)
        target.create(pending)
        taken = target.reuse(pending, ["rank_00000.h5", "rank_00009.h5"], trash)
        assert taken <= {"rank_00000.h5"}  # (a target may gain nothing from it)
        trash.delete()
        trash.delete()  # idempotent
        assert target.steps() == [2]
        target.clean_up()
        assert [n for n in target.names() if filenames.is_trash(n)] == []

    def test_discard_removes_a_torn_pending_file(self, target: Target) -> None:
        pending = target.pending(1)
        target.create(pending)
        target.write(pending, "rank_00000.h5", DATA)
        target.discard(pending, "rank_00000.h5")
        target.discard(pending, "rank_00000.h5")  # (not there: nothing)
        target.write(pending, "rank_00000.h5", b"again")
        target.commit(pending, manifest_of(1), what="step 1")
        assert target.read(1, "rank_00000.h5") == b"again"

    def test_the_same_token_names_the_same_pending_copy(self, target: Target) -> None:
        assert target.pending(3, token="abc") == target.pending(3, token="abc")
        assert target.pending(3).path != target.pending(3).path
        assert target.pending(3).final == target.pending(3, token="x").final

    def test_a_pending_step_is_never_listed(self, target: Target) -> None:
        pending = target.pending(5)
        target.create(pending)
        target.write(pending, "rank_00000.h5", DATA)
        assert target.steps() == []
        with pytest.raises(InvalidCheckpointError):
            target.manifest(5)

    def test_a_rollback_leaves_nothing(self, target: Target) -> None:
        self.save(target, 1)
        pending = target.pending(2)
        target.create(pending)
        target.write(pending, "rank_00000.h5", DATA)
        target.rollback(pending)
        target.rollback(pending)  # idempotent
        assert target.steps() == [1]
        assert target.read(1, "rank_00000.h5") == DATA

    def test_a_file_is_written_once(self, target: Target) -> None:
        pending = target.pending(1)
        target.create(pending)
        target.write(pending, "rank_00000.h5", DATA)
        with pytest.raises(FileExistsError):
            target.write(pending, "rank_00000.h5", DATA)

    def test_a_recommit_replaces_the_step_whole(self, target: Target) -> None:
        self.save(target, 4, {"rank_00000.h5": b"old", "rank_00001.h5": b"old"})
        self.save(target, 4, {"rank_00000.h5": b"new"})
        assert target.steps() == [4]
        assert target.read(4, "rank_00000.h5") == b"new"
        assert target.stat(4, "rank_00001.h5") is None

    def test_remove_and_quarantine_take_a_step_out_of_the_listing(self, target: Target) -> None:
        for step in (1, 2, 3):
            self.save(target, step)
        target.remove(1)
        target.quarantine(2, "a checksum did not match")
        assert target.steps() == [3]
        target.clean_up()
        assert target.steps() == [3]

    # ------------------------------------------------------------------ crashes and faults

    def test_a_crash_between_write_and_commit_leaves_the_previous_state(
        self, target: Target
    ) -> None:
        self.save(target, 1)
        pending = target.pending(2)
        target.create(pending)
        target.write(pending, "rank_00000.h5", DATA)
        after = self.restart(target)  # the process died here
        assert after.steps() == [1]
        after.clean_up()  # the next start cleans up
        assert after.steps() == [1]
        self.save(after, 2)
        assert sorted(after.steps()) == [1, 2]

    def test_a_pending_copy_is_created_once_or_shared_by_the_ranks_of_a_node(
        self, target: Target
    ) -> None:
        pending = target.pending(3, token="t")
        target.create(pending)
        with pytest.raises(FileExistsError):
            target.create(target.pending(3, token="t"))
        target.create(target.pending(3, token="t"), shared=True)  # a second rank of the node
        target.write(pending, "rank_00000.h5", DATA)
        target.commit(pending, manifest_of(3), what="step 3")
        assert target.steps() == [3]
        assert target.read(3, "rank_00000.h5") == DATA

    def test_a_crash_after_create_leaves_nothing_listed(self, target: Target) -> None:
        target.create(target.pending(9))
        after = self.restart(target)
        after.clean_up()
        assert after.steps() == []

    @pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
    def test_a_write_that_fails_midway_is_never_listed(
        self, target: Target, monkeypatch: pytest.MonkeyPatch, code: int
    ) -> None:
        self.save(target, 1)
        pending = target.pending(2)
        target.create(pending)
        self.break_writes(monkeypatch, target, code)
        with pytest.raises(OSError) as caught:
            target.write(pending, "rank_00000.h5", DATA)
        assert caught.value.errno == code
        monkeypatch.undo()
        assert target.steps() == [1]
        target.rollback(pending)
        assert target.steps() == [1]
        assert target.read(1, "rank_00000.h5") == DATA

    def test_a_torn_file_shows_in_its_size(self, target: Target) -> None:
        self.save(target, 3)
        self.tear(target, 3, "rank_00000.h5")
        assert target.steps() == [3]  # listing is quick: the size check is the reader's
        assert target.stat(3, "rank_00000.h5") == FileStat(len(DATA) // 2, True)
        assert target.read(3, "rank_00000.h5") == DATA[: len(DATA) // 2]

    def test_listing_after_a_crash_in_remove_omits_the_step(
        self, target: Target, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for step in (1, 2):
            self.save(target, step)
        self.crash_in_remove(monkeypatch)
        with pytest.raises(OSError):
            target.remove(1)
        monkeypatch.undo()
        after = self.restart(target)
        assert after.steps() == [2]
        after.clean_up()
        assert after.steps() == [2]

    # ------------------------------------------------------------------ the data path

    def test_children_are_targets_of_their_own(self, target: Target) -> None:
        node = target.child(filenames.PARTNER_DIR).child("nodeA")
        self.save(node, 5)
        assert node.steps() == [5]
        assert target.steps() == []
        assert target.names() == [filenames.PARTNER_DIR]
        (child,) = target.children()
        assert child.children() == [node]
        node.drop()
        assert child.children() == []

    def test_a_file_written_by_ranges_reads_back_by_ranges(self, target: Target) -> None:
        pending = target.pending(1)
        target.create(pending)
        first = target.open_writer(pending, "rank_00000.h5", exclusive=False)
        second = target.open_writer(pending, "rank_00000.h5", exclusive=False)
        second.write(memoryview(DATA[5000:]), 5000)  # two writers fill parts of one file
        first.resize(len(DATA))
        first.write(memoryview(DATA[:5000]), 0)
        first.close(sync=True)
        second.close(sync=True)
        with pytest.raises(FileExistsError):
            target.open_writer(pending, "rank_00000.h5")
        target.commit(pending, manifest_of(1), what="step 1")
        assert target.read(1, "rank_00000.h5") == DATA
        reader = target.open_reader(1, "rank_00000.h5")
        try:
            piece = bytearray(10)
            reader.read(memoryview(piece), 4995)
            assert bytes(piece) == DATA[4995:5005]
            with pytest.raises(EOFError, match="ends at byte"):
                reader.read(memoryview(bytearray(10)), len(DATA) - 5)
            # a vectored read fills its buffers one after the other, and says how much it read
            # (less where the file ends, 0 past it)
            import numpy as np

            head, words = bytearray(3), np.zeros(2, dtype=np.int64)
            assert reader.readv([memoryview(head), words], 100) == 19
            assert bytes(head) + words.tobytes() == DATA[100:119]
            tail: list[Any] = [memoryview(bytearray(4)), memoryview(bytearray(8))]
            assert reader.readv(tail, len(DATA) - 6) == 6
            assert bytes(tail[0]) + bytes(tail[1][:2]) == DATA[-6:]
            assert reader.readv([memoryview(bytearray(4))], len(DATA)) == 0
        finally:
            reader.close()
        with pytest.raises(FileNotFoundError):
            target.open_reader(1, "rank_00009.h5")
        assert str(target.where(1)).endswith(filenames.step_dir_name(1))

    def test_a_data_file_is_written_at_its_offsets_with_its_skeleton(self, target: Target) -> None:
        import numpy as np

        from resilient.io import fileio

        arrays: list[np.ndarray[Any, Any]] = [
            np.arange(10, dtype=np.float64),
            np.ones((2, 3), dtype=np.int32),
        ]
        skeleton = fileio.build_skeleton("self", [(0, [("a", (10,), "<f8"), ("b", (2, 3), "<i4")])])
        offsets = skeleton.offsets[0]
        pending = target.pending(1)
        target.create(pending)
        target.create_file(pending, "rank_00000.h5")
        with pytest.raises(FileExistsError):
            target.create_file(pending, "rank_00000.h5")
        target.write_data(pending, "rank_00000.h5", offsets, arrays, skeleton=lambda: skeleton,
                          sync=False)  # fmt: skip
        target.sync_data(pending, "rank_00000.h5")
        target.commit(pending, manifest_of(1), what="step 1")
        data = target.read(1, "rank_00000.h5")
        assert len(data) == skeleton.size
        for offset, arr in zip(offsets, arrays, strict=True):
            assert offset is not None
            assert data[offset : offset + arr.nbytes] == arr.tobytes()
        for offset, meta in skeleton.meta_bytes:
            assert data[offset : offset + len(meta)] == meta

    def test_copy_and_link_bring_a_committed_file_into_a_pending_copy(self, target: Target) -> None:
        self.save(target.child("a"), 1, {"rank_00000.h5": DATA, "rank_00001.h5": DATA[:7]})
        source, other = target.child("a"), target.child("b")
        pending = other.pending(1)
        other.create(pending)
        other.link(pending, "rank_00000.h5", source, 1)
        digest = other.copy(pending, "rank_00001.h5", source, 1)
        with pytest.raises(FileExistsError):
            other.copy(pending, "rank_00001.h5", source, 1)
        with pytest.raises(FileNotFoundError):
            other.copy(pending, "rank_00002.h5", source, 1)
        other.commit(pending, manifest_of(1), what="a rebuilt step")
        assert other.read(1, "rank_00000.h5") == DATA
        assert other.read(1, "rank_00001.h5") == DATA[:7]
        assert digest == _digest(DATA[:7])

    def crash_in_remove(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make a removal fail after the step left the listing."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the root's own files

    def test_a_root_is_prepared_locked_once_and_released(self, target: Target) -> None:
        target.prepare_root()
        target.prepare_root()  # a root already: nothing changes
        held = target.lock({"job": "1"})
        with pytest.raises(CheckpointLockedError, match="in use by another job"):
            target.lock()
        held.release()
        held.release()  # idempotent
        target.lock().release()  # free again

    def test_small_files_of_the_root_are_replaced_whole(self, target: Target) -> None:
        target.prepare_root()
        assert target.read_root(filenames.RUN_KEY) is None
        target.replace_root(filenames.RUN_KEY, b"first")
        target.replace_root(filenames.RUN_KEY, b"second")
        assert target.read_root(filenames.RUN_KEY) == b"second"
        assert filenames.RUN_KEY in target.names()
        assert target.steps() == []
        target.clean_up()
        assert target.read_root(filenames.RUN_KEY) == b"second"

    def test_a_log_of_the_root_reads_back_its_records_past_a_torn_line(
        self, target: Target
    ) -> None:
        target.prepare_root()
        assert target.read_log(filenames.SAVE_LOG, logs.SAVES) == []
        target.append_record(filenames.SAVE_LOG, {"step": 1, "time": 1.0})
        self.tear_root(target, filenames.SAVE_LOG, b'{"step": 2, "ti')
        target.append_record(filenames.SAVE_LOG, {"step": 3, "time": 3.0})
        records = target.read_log(filenames.SAVE_LOG, logs.SAVES)
        assert [r["step"] for r in records] == [1, 3]

    def tear_root(self, target: Target, name: str, tail: bytes) -> None:
        """Append ``tail`` (a torn line) to the root's file ``name``."""
        target.replace_root(name, (target.read_root(name) or b"") + tail)


class TestDirectoryTarget(TargetTests):
    """A directory: the shared root, a node-local tier, a partner copy."""

    @pytest.fixture
    def target(self, tmp_path: Path) -> Target:
        return DirectoryTarget(tmp_path / "root")

    def restart(self, target: Target) -> Target:
        assert isinstance(target, DirectoryTarget)
        return DirectoryTarget(target.root)

    def break_writes(self, monkeypatch: pytest.MonkeyPatch, target: Target, code: int) -> None:
        real = os.write

        def half(fd: int, data: Any) -> int:
            real(fd, bytes(data)[: len(data) // 2])
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "write", half)

    def tear(self, target: Target, step: int, name: str) -> None:
        assert isinstance(target, DirectoryTarget)
        path = target.path(step) / name
        os.truncate(path, path.stat().st_size // 2)

    def crash_in_remove(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import shutil

        def killed(*_: Any, **__: Any) -> None:
            raise OSError(errno.EINTR, "killed while deleting")

        monkeypatch.setattr(shutil, "rmtree", killed)

    def test_leftovers_go_at_clean_up_and_not_before(self, target: Target) -> None:
        assert isinstance(target, DirectoryTarget)
        self.save(target, 1)
        target.create(target.pending(2))
        names = target.names()
        assert any(filenames.parse_tmp_dir(n) == 2 for n in names)
        target.clean_up()
        assert sorted(target.names()) == [filenames.step_dir_name(1)]

    def test_quarantine_keeps_the_files_and_the_reason(self, target: Target) -> None:
        assert isinstance(target, DirectoryTarget)
        self.save(target, 1)
        target.quarantine(1, "bad bytes")
        (name,) = target.names()
        assert filenames.parse_quarantined(name) == 1
        kept = target.root / name
        assert (kept / "rank_00000.h5").read_bytes() == DATA
        assert b"bad bytes" in (kept / filenames.QUARANTINE_INFO).read_bytes()

    def test_a_symlinked_step_file_is_not_followed_for_its_size(
        self, target: Target, tmp_path: Path
    ) -> None:
        assert isinstance(target, DirectoryTarget)
        self.save(target, 1, {"rank_00000.h5": b"x"})
        (tmp_path / "big").write_bytes(DATA)
        (target.path(1) / "rank_00001.h5").symlink_to(tmp_path / "big")
        assert target.stat(1, "rank_00001.h5") != FileStat(len(DATA), True)

    def test_a_missing_root_is_created_by_the_first_pending_copy(self, target: Target) -> None:
        assert isinstance(target, DirectoryTarget)
        target.clean_up()
        assert not target.root.exists()
        self.save(target, 1)
        assert target.steps() == [1]


class _FaultyMemory(MemoryTarget):
    """A memory target whose writes can be broken (half the bytes kept, then an error)."""

    __slots__ = ("fault",)

    def __init__(self) -> None:
        super().__init__()
        self.fault: int | None = None

    def write(self, pending: PendingDir, name: str, data: bytes) -> None:
        if self.fault is None:
            super().write(pending, name, data)
            return
        super().write(pending, name, data[: len(data) // 2])
        raise OSError(self.fault, os.strerror(self.fault))


class TestMemoryTarget(TargetTests):
    """A dictionary (tests)."""

    @pytest.fixture
    def target(self) -> Target:
        return _FaultyMemory()

    def restart(self, target: Target) -> Target:
        return target  # what the crash left is in the dictionary still

    def break_writes(self, monkeypatch: pytest.MonkeyPatch, target: Target, code: int) -> None:
        assert isinstance(target, _FaultyMemory)
        monkeypatch.setattr(target, "fault", code)

    def tear(self, target: Target, step: int, name: str) -> None:
        assert isinstance(target, MemoryTarget)
        files = target.dirs[filenames.step_dir_name(step)]
        files[name] = files[name][: len(files[name]) // 2]

    def crash_in_remove(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def killed(self: MemoryTarget, step: int) -> None:
            self.dirs.pop(filenames.step_dir_name(step))
            raise OSError(errno.EINTR, "killed while deleting")

        monkeypatch.setattr(MemoryTarget, "remove", killed)

    def test_a_garbled_marker_is_refused(self, target: Target) -> None:
        assert isinstance(target, MemoryTarget)
        self.save(target, 1)
        target.dirs[filenames.step_dir_name(1)][filenames.COMMITTED] = b"{"
        with pytest.raises(InvalidCheckpointError, match="garbled"):
            target.manifest(1)


@pytest.mark.parametrize("kinds", [("memory", "directory"), ("directory", "memory")])
def test_copies_cross_from_one_kind_of_target_to_another(
    kinds: tuple[str, str], tmp_path: Path
) -> None:
    def make(kind: str, name: str) -> Target:
        return MemoryTarget() if kind == "memory" else DirectoryTarget(tmp_path / name)

    source, dest = make(kinds[0], "source"), make(kinds[1], "dest")
    TargetTests().save(source, 2)
    pending = dest.pending(2)
    dest.create(pending)
    dest.link(pending, "rank_00000.h5", source, 2)
    dest.commit(pending, manifest_of(2), what="step 2")
    assert dest.read(2, "rank_00000.h5") == DATA
