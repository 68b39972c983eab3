"""Failing saves: injected I/O errors, bad arguments. Earlier checkpoints always survive."""

from __future__ import annotations

import errno
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.errors import CollectiveError, CommitError, ConfigError, ResilientError
from resilient.io import fileio
from resilient.io.checkpoints import list_checkpoints, validate_checkpoint
from tests.unit.ckutil import assert_state_equal, state_of, static_of


def entries(root: Path) -> list[str]:
    names = sorted(p.name for p in root.iterdir())
    static = root / "static"
    if static.is_dir():
        names += sorted(f"static/{p.name}" for p in static.iterdir())
    return names


def leftovers(root: Path) -> list[str]:
    prefixes = (".step_", ".trash-", ".tmp-")
    return [n for n in entries(root) if n.rpartition("/")[2].startswith(prefixes)]


@pytest.fixture
def two_steps(tmp_path: Path) -> Iterator[tuple[Path, CheckpointManager]]:
    root = tmp_path / "ck"
    m = CheckpointManager(root)
    m.save(1, state_of(1), static=static_of(1))
    m.save(2, state_of(2), static=static_of(1))
    yield root, m
    m.close()


def enospc(*args: Any, **kwargs: Any) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_step_2_restores(root: Path, m: CheckpointManager) -> None:
    step, state = m.restore()
    assert step == 2
    assert_state_equal(state, {**state_of(2), **static_of(1)})
    m.close()
    with CheckpointManager(root) as fresh:
        step, state = fresh.restore()
    assert step == 2
    assert_state_equal(state, {**state_of(2), **static_of(1)})
    validate_checkpoint(root / "step_00000002", full=True)


# --------------------------------------------------------------------------- injected I/O errors


def test_enospc_during_data_write(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, m = two_steps
    before = entries(root)
    monkeypatch.setattr("resilient.io.fileio.os.pwrite", enospc)
    monkeypatch.setattr("resilient.io.fileio.os.pwritev", enospc)
    with pytest.raises(ResilientError, match="No space left on device") as info:
        m.save(3, state_of(3), static=static_of(1))
    monkeypatch.undo()
    assert isinstance(info.value, CollectiveError)
    assert info.value.failures.keys() == {0}
    assert "step 3" in str(info.value)
    assert leftovers(root) == []
    assert entries(root) == before
    assert m.latest_step() == 2
    assert_step_2_restores(root, m)


@pytest.mark.parametrize("blocking", [True, False])
def test_eio_from_the_data_files_fsync(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    # a save fsyncs its data file on the writer thread while the manifest is made
    # (which is prepared in the temporary directory before the fsync is known to have failed)
    root, m = two_steps
    before = entries(root)
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".h5"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr("resilient.io.fileio.os.fsync", fsync)
    with pytest.raises(CollectiveError, match="Input/output error") as info:
        m.save(3, state_of(3), blocking=blocking)
        m.wait()
    monkeypatch.undo()
    assert info.value.failures.keys() == {0}
    assert leftovers(root) == [] and entries(root) == before
    assert m.latest_step() == 2
    m.save(3, state_of(3))  # the manager goes on
    step, state = m.restore()
    assert step == 3
    assert_state_equal(state, state_of(3))


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failure_after_the_data_was_written_waits_for_its_fsync(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    # the manifest entry is made after the bytes were handed to the writer thread for their
    # fsync (an asynchronous save queues the fsync behind its write there): when that fails,
    # the save waits for the fsync before it raises (no writer outlives its save)
    root, m = two_steps
    before = entries(root)
    synced: list[str] = []
    real_fsync = fileio.fsync_file

    def slow_fsync(path: Path) -> None:
        time.sleep(0.2)
        real_fsync(path)
        synced.append(path.name)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("checksum unit on fire")

    monkeypatch.setattr("resilient.io.fileio.fsync_file", slow_fsync)
    monkeypatch.setattr("resilient.checkpoint.saveset.RankPlan.entry", broken)
    with pytest.raises(CollectiveError, match="checksum unit on fire"):
        m.save(3, state_of(3), blocking=blocking)
        m.wait()
    assert synced == ["rank_00000.h5"]  # the fsync had finished when save() raised
    monkeypatch.undo()
    assert leftovers(root) == [] and entries(root) == before
    assert_step_2_restores(root, m)


def test_enospc_while_writing_new_static_data(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, m = two_steps
    before = entries(root)
    monkeypatch.setattr("resilient.io.fileio.os.pwrite", enospc)
    monkeypatch.setattr("resilient.io.fileio.os.pwritev", enospc)
    with pytest.raises(ResilientError, match="No space left on device"):
        m.save(3, state_of(3), static=static_of(2))  # new static content is written first
    monkeypatch.undo()
    assert leftovers(root) == []
    assert entries(root) == before
    assert_step_2_restores(root, m)


def test_manager_is_usable_after_a_failed_save(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, m = two_steps
    monkeypatch.setattr("resilient.io.fileio.os.pwrite", enospc)
    monkeypatch.setattr("resilient.io.fileio.os.pwritev", enospc)
    with pytest.raises(ResilientError):
        m.save(3, state_of(3))
    monkeypatch.undo()
    m.save(3, state_of(3))
    step, state = m.restore()
    assert step == 3
    assert_state_equal(state, state_of(3))


def _failing_replace(monkeypatch: pytest.MonkeyPatch, code: int, times: int = 1000) -> list[str]:
    """Make os.replace fail with ``code`` for step directories (the commit rename) only, and
    the exchange of a re-saved step's directories likewise."""
    real = os.replace
    calls: list[str] = []

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        name = os.path.basename(os.fspath(dst))
        if name.startswith("step_"):
            calls.append(name)
            if len(calls) <= times:
                raise OSError(code, f"injected rename failure ({errno.errorcode[code]})")
        real(src, dst, *args, **kwargs)

    def exchange(a: Any, b: Any) -> bool:  # a re-save's rename (storage.exchange_dirs)
        replace(a, b)
        return True

    monkeypatch.setattr("resilient.io.storage.os.replace", replace)
    monkeypatch.setattr("resilient.io.storage.exchange_dirs", exchange)
    return calls


@pytest.mark.parametrize("code", [errno.EBUSY, errno.EACCES, errno.EIO])
def test_commit_rename_failure_is_a_commit_error(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    root, m = two_steps
    before = entries(root)
    calls = _failing_replace(monkeypatch, code)
    with pytest.raises(CommitError, match="injected rename failure") as info:
        m.save(3, state_of(3), static=static_of(1))
    monkeypatch.undo()
    assert "save of checkpoint step 3: commit failed" in str(info.value)
    assert calls and set(calls) == {"step_00000003"}
    if code != errno.EIO:  # only transient errors are retried
        assert len(calls) == 1
    if code == errno.EACCES:
        assert "permanent: not retried" in str(info.value)
    assert leftovers(root) == []
    assert entries(root) == before
    assert_step_2_restores(root, m)


def test_transient_commit_rename_failure_is_retried(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, m = two_steps
    calls = _failing_replace(monkeypatch, errno.EIO, times=1)
    m.save(3, state_of(3))
    monkeypatch.undo()
    assert calls == ["step_00000003", "step_00000003"]
    assert leftovers(root) == []
    step, state = m.restore()
    assert step == 3
    assert_state_equal(state, {**state_of(3)})
    validate_checkpoint(root / "step_00000003", full=True)


@pytest.mark.parametrize("name", ["COMMITTED", "manifest.json", ".step_"])
def test_eio_from_a_commit_fsync_is_a_commit_error(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # the manifest, the marker and their directory are fsynced at the same time (helper
    # threads): an error from any of them fails the commit before the rename, after retries
    root, m = two_steps
    before = entries(root)
    real = os.fsync
    failed: list[str] = []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path).startswith(name):
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr("resilient.io.storage.os.fsync", fsync)
    with pytest.raises(CommitError, match="Input/output error") as info:
        m.save(3, state_of(3), static=static_of(1))
    monkeypatch.undo()
    assert "save of checkpoint step 3: commit failed" in str(info.value)
    assert len(failed) > 1  # EIO is transient: retried
    assert leftovers(root) == []
    assert entries(root) == before
    assert_step_2_restores(root, m)


def test_failed_commit_of_a_resave_keeps_the_old_checkpoint(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-save of step 2 that fails to commit must leave the committed step 2 in place."""
    root, m = two_steps
    _failing_replace(monkeypatch, errno.EBUSY)
    with pytest.raises(CommitError):
        m.save(2, state_of(99), static=static_of(1))
    monkeypatch.undo()
    assert leftovers(root) == []
    assert [(r.step, r.status) for r in list_checkpoints(root)] == [(1, "valid"), (2, "valid")]
    assert_step_2_restores(root, m)


# --------------------------------------------------------------------------- bad arguments


def _assert_nothing_written(root: Path, before: list[str]) -> None:
    assert entries(root) == before


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"o": object()}, r"state\['o'\]: object is neither an array"),
        ({"s": {1, 2}}, r"state\['s'\]: set is neither"),
        ({"b": b"bytes"}, r"state\['b'\]: bytes is neither"),
        ({"c": 1 + 2j}, r"state\['c'\]: complex is neither"),
        ({"d": {"nested": object()}}, r"state\['d/nested'\]: object is neither"),
        ({"u": np.array(["ab", "c"])}, r"state\['u'\]: dtype <U2 is not supported"),
        ({"v": np.array([object()], dtype=object)}, r"state\['v'\]: dtype object is not supported"),
        ({"t": np.array(["2024-01-01"], dtype="M8[D]")}, r"state\['t'\]: dtype datetime64"),
        ({"r": np.zeros(2, dtype=[("a", "<f8")])}, r"state\['r'\]: dtype"),
        ({(1, 2): 3}, r"key \(1, 2\) is neither a string nor an int"),
        ({"x": {1.5: 3}}, r"state\['x'\]: key 1.5 is neither"),
    ],
)
def test_unsupported_values_are_config_errors(
    tmp_path: Path, state: dict[str, Any], match: str
) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        before = entries(tmp_path / "ck")
        with pytest.raises(ConfigError, match=match):
            m.save(1, state)
        _assert_nothing_written(tmp_path / "ck", before)
        with pytest.raises(ConfigError, match=match.replace("state", "static", 1)):
            m.save(1, {"ok": 1}, static=state)
        _assert_nothing_written(tmp_path / "ck", before)


@pytest.mark.parametrize(
    "key", ["a/b", "", "..", ".", ".hidden", "a b", "x" * 300, 3, -4, "é", "a\n", "%", "%41"]
)
def test_any_string_or_int_key_is_escaped_and_round_trips(tmp_path: Path, key: Any) -> None:
    """Keys are never rejected: they are escaped into HDF5 names and come back as they were."""
    state = {key: np.arange(3), "nested": {key: 5, "list": [{key: np.ones(2)}]}}
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(1, state, static={"s": {key: np.zeros(1)}})
        _, got = m.restore()
    assert list(got) == [key, "nested", "s"]
    assert got[key].tolist() == [0, 1, 2] and got["nested"][key] == 5
    assert got["nested"]["list"][0][key].tolist() == [1.0, 1.0]
    assert list(got["s"]) == [key] and got["s"][key].tolist() == [0.0]


def test_good_keys_are_accepted(tmp_path: Path) -> None:
    state = {"a.b": np.arange(2), "c-d+e_f": 1, "0": "zero", "x" * 128: [1]}
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(1, state)
        step, got = m.restore()
    assert step == 1
    assert_state_equal(got, state)


@pytest.mark.parametrize("step", [-1, -100, True, False, 1.0, "3", None, np.int64(-1)])
def test_bad_steps_are_config_errors(tmp_path: Path, step: Any) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        before = entries(tmp_path / "ck")
        with pytest.raises(ConfigError, match="step must be a non-negative int"):
            m.save(step, {"a": np.arange(3)})
        _assert_nothing_written(tmp_path / "ck", before)


def test_state_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        with pytest.raises(ConfigError, match="state must be a mapping"):
            m.save(1, [("a", 1)])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="static must be a mapping"):
            m.save(1, {"a": 1}, static=np.arange(3))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "static"),
    [
        ({"grid": np.arange(3)}, {"grid": np.arange(3)}),
        ({"grid": np.arange(3)}, {"grid": 1}),
        ({"n": 1}, {"n": np.arange(2)}),
        ({"n": 1, "a": np.zeros(1)}, {"n": 2, "b": np.zeros(1)}),
    ],
)
def test_state_and_static_sharing_a_key(
    tmp_path: Path, state: dict[str, Any], static: dict[str, Any]
) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        before = entries(tmp_path / "ck")
        with pytest.raises(ConfigError, match=r"names in both state and static: \['(grid|n)'\]"):
            m.save(1, state, static=static)
        _assert_nothing_written(tmp_path / "ck", before)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, state_of(1))
        m.save(2, state_of(2))
        m.save(2, {"y": np.ones(3, dtype=np.uint8), "it": 22})
        assert [n for n in entries(root) if n.startswith("step_")] == [
            "step_00000001",
            "step_00000002",
        ]
        assert leftovers(root) == []
        step, state = m.restore()
    assert step == 2
    assert_state_equal(state, {"y": np.ones(3, dtype=np.uint8), "it": 22})
    validate_checkpoint(root / "step_00000002", full=True)
    with CheckpointManager(root) as m:
        step, state = m.restore(2)
    assert_state_equal(state, {"y": np.ones(3, dtype=np.uint8), "it": 22})


def test_saving_an_older_step_does_not_become_latest_by_time(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(5, state_of(5))
        m.save(3, state_of(3))
        assert m.latest_step() == 5
        step, state = m.restore()
    assert step == 5
    assert_state_equal(state, state_of(5))


def test_non_finite_metrics_can_be_saved(tmp_path: Path) -> None:
    """KeepBest documents that checkpoints may carry non-finite metrics (a diverged loss)."""
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(1, {"a": np.arange(2)}, metrics={"loss": 0.5})
        m.save(2, {"a": np.arange(2)}, metrics={"loss": math.nan})
        assert m.latest_step() == 2
    records = list_checkpoints(tmp_path / "ck")
    assert [r.step for r in records if r.status == "valid"] == [1, 2]
    loss = records[1].manifest.metrics["loss"]  # type: ignore[union-attr]
    assert math.isnan(loss)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, [1.0, math.nan]])
def test_non_finite_json_values_are_rejected_up_front_or_round_trip(
    tmp_path: Path, value: Any
) -> None:
    """The state accepts NaN (split_state uses allow_nan=True): then a save must not fail at
    commit time after all data was written. Either ConfigError before writing, or it works."""
    with CheckpointManager(tmp_path / "ck") as m:
        try:
            m.save(1, {"v": value, "a": np.arange(2)})
        except ConfigError:
            assert leftovers(tmp_path / "ck") == []
            return
        step, state = m.restore()
    assert step == 1
    assert repr(state["v"]) == repr(value)


def test_a_checksum_failure_while_writing_loses_nothing(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the checksums are taken between the runs of the data's write: a failure there fails the
    # save cleanly, with nothing left behind and the older checkpoints intact
    root, m = two_steps
    before = entries(root)

    def broken(arrays: Any) -> list[str]:
        raise RuntimeError("checksum unit on fire")

    monkeypatch.setattr("resilient.io.digests.digest_arrays", broken)
    with pytest.raises(CollectiveError, match="checksum unit on fire"):
        m.save(3, state_of(3))
    monkeypatch.undo()
    assert leftovers(root) == [] and entries(root) == before
    assert_step_2_restores(root, m)


def test_a_failed_metadata_build_fails_the_save_and_the_next_one_plans_anew(
    two_steps: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a new structure's HDF5 metadata is built during the leader's write: when that fails,
    # the save fails cleanly, and the next save of the structure builds it again
    root, m = two_steps
    before = entries(root)
    real = fileio.build_skeleton
    calls: list[str] = []

    def broken(kind: str, ranks: Any) -> Any:
        calls.append(kind)
        raise ValueError("metadata unit on fire")

    new_structure = {**state_of(3), "extra": np.arange(5.0)}
    monkeypatch.setattr(fileio, "build_skeleton", broken)
    with pytest.raises(CollectiveError, match="metadata unit on fire"):
        m.save(3, new_structure)
    assert calls and leftovers(root) == [] and entries(root) == before
    monkeypatch.setattr(fileio, "build_skeleton", real)
    created: list[Path] = []
    real_create = fileio.create_file

    def creating(path: Path) -> None:
        created.append(path)
        real_create(path)

    monkeypatch.setattr(fileio, "create_file", creating)
    m.save(3, new_structure)
    assert len(created) == 1  # planned anew: the failed skeleton was not offered again
    assert_state_equal(m.restore()[1], new_structure)


def test_a_manifest_no_restore_would_read_is_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the manifest size a restore reads (here made small: 16,384 ranks x 300 arrays
    reach the real 256 MiB), a save is refused with the sizes and a way out, on every rank;
    the checkpoint before it still restores and no temporary directory is left."""
    from resilient.io import manifests

    root = tmp_path / "ck"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"u": np.arange(4.0)})
        monkeypatch.setattr(manifests, "MAX_MANIFEST_BYTES", 20_000)
        many = {f"layer{i}.weight": np.full(3, float(i)) for i in range(400)}
        with pytest.raises(ConfigError, match=r"manifest would be 0 MB, over the 0 MiB .*fewer"):
            mgr.save(2, many)
        monkeypatch.undo()
        step, got = mgr.restore()
    assert step == 1 and np.array_equal(got["u"], np.arange(4.0))
    assert not leftovers(root)
