"""A whole manager's cycle in a :class:`~resilient.io.targets.MemoryTarget`, with no file opened
on disk: ``CheckpointManager(checkpoint_dir=MemoryTarget())`` saves several steps with static
data (written once) and ``KeepLast`` rotation, a byte flipped in the newest step is caught by a
full validation and by the restore, which quarantines it (one warning) and falls back to the
step before, bit-identical; everything through the storage seam
(:class:`~resilient.io.targets.Target`)."""

from __future__ import annotations

import builtins
import logging
import os
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.errors import ConfigError, InvalidCheckpointError
from resilient.io.checkpoints import latest_valid, list_checkpoints, statics_of, validate_set
from resilient.io.targets import MemoryTarget
from resilient.model import filenames
from resilient.model.policies import KeepLast


def state_of(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "u": np.arange(40_000, dtype=np.float64) * step,
        "grid": np.full((3, 4), step, dtype=np.int32),
        "nested": {"v": np.linspace(0, 1, 7, dtype=np.float32) + step, "note": f"at {step}"},
    }


def static_of() -> dict[str, Any]:
    return {"mesh": np.arange(1_000, dtype=np.float64) / 7, "coefficients": np.ones((4, 4))}


@pytest.fixture
def no_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file opened on disk fails the test (``os.open`` and ``open``)."""

    def refused(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a file was opened: {path}")

    monkeypatch.setattr(os, "open", refused)
    monkeypatch.setattr(builtins, "open", refused)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, dict):
            assert_same(got[key], value)
        elif isinstance(value, np.ndarray):
            have = got[key]
            assert have.dtype == value.dtype and have.shape == value.shape
            assert have.tobytes() == value.tobytes()  # bit-identical
        else:
            assert got[key] == value


def test_a_manager_saves_rotates_validates_and_restores_in_memory(
    no_disk: None, caplog: pytest.LogCaptureFixture
) -> None:
    memory = MemoryTarget()
    with CheckpointManager(checkpoint_dir=memory, keep=KeepLast(2)) as m:
        assert m.root is None and m.target is memory
        for step in range(1, 6):
            m.save(step, state_of(step), static=static_of())
        assert m.latest_step() == 5
    assert sorted(memory.steps()) == [4, 5]  # rotation kept the newest two
    statics = statics_of(memory)
    (content,) = {n.removesuffix(".copy") for n in statics.names()}
    assert sorted(statics.names()) == [content, f"{content}.copy"]  # both copies, once
    assert statics.manifest(content, kind="static").step == 1  # written by the first save only
    assert [r.step for r in list_checkpoints(memory, full=True)] == [4, 5]

    # a byte flipped in a dataset of the newest step: a full validation names it
    entry = memory.manifest(5).ranks[0]
    at = entry.datasets.offsets[entry.datasets.names.index("u")]
    assert at is not None
    files = memory.dirs[filenames.step_dir_name(5)]
    data = files[entry.file]
    files[entry.file] = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
    with pytest.raises(InvalidCheckpointError, match="checksum mismatch"):
        validate_set(memory, 5, full=True)
    newest = latest_valid(memory)
    assert newest is not None and newest.step == 5  # (a quick validation sees sizes only)

    caplog.clear()
    with caplog.at_level(logging.WARNING), CheckpointManager(memory, keep=KeepLast(2)) as m:
        step, state = m.restore()
        assert step == 4 and m.passed_over == (5,)
        assert_same(state, {**state_of(4), **static_of()})
        m.save(6, state_of(6), static=static_of())  # the first save after a restore
        assert m.latest_step() == 6
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "quarantined checkpoint of step 5" in warnings[0].getMessage()
    assert sorted(memory.steps()) == [4, 6]
    quarantined = [n for n in memory.dirs if filenames.parse_quarantined(n) == 5]
    assert len(quarantined) == 1
    with CheckpointManager(memory) as m:
        step, state = m.restore()
        assert step == 6
        assert_same(state, {**state_of(6), **static_of()})


def test_a_target_that_is_no_directory_takes_no_node_local_tier(no_disk: None) -> None:
    with pytest.raises(ConfigError, match=r"local_dir='/tmp/x' .* a directory, not a target"):
        CheckpointManager(MemoryTarget(), local_dir="/tmp/x")
