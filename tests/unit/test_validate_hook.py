"""``restore(validate=...)``: a rejected state is quarantined (never deleted) and the next tried."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager, CheckpointNotFoundError
from tests.unit.ckutil import assert_state_equal, state_of, static_of


def _state(step: int) -> dict[str, Any]:
    x = np.arange(50, dtype=np.float64) * step
    if step == 3:
        x[17] = np.nan  # the simulation blew up before this checkpoint
    return {"x": x, "it": step}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ck"
    with CheckpointManager(r) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    return r


def entries(root: Path) -> tuple[list[str], list[str]]:
    """(committed step dirs, quarantined dirs) under ``root``."""
    names = sorted(p.name for p in root.iterdir())
    return (
        [n for n in names if n.startswith("step_") and ".quarantined-" not in n],
        [n for n in names if ".quarantined-" in n],
    )


def finite(s: Any) -> bool:
    return not np.isnan(s["x"]).any()


def test_rejected_newest_falls_back_and_is_quarantined(root: Path) -> None:
    seen: list[int] = []

    def hook(s: Any) -> bool:
        seen.append(s["it"])
        return finite(s)

    with CheckpointManager(root) as m:
        step, state = m.restore(validate=hook)
    assert step == 2
    assert seen == [3, 2]
    assert_state_equal(state, _state(2))
    committed, quarantined = entries(root)
    assert committed == ["step_00000001", "step_00000002"]
    assert len(quarantined) == 1 and quarantined[0].startswith("step_00000003.quarantined-")
    q = root / quarantined[0]
    info = json.loads((q / "QUARANTINE.json").read_text())
    assert info["step"] == 3
    assert "validate hook" in info["reason"]
    assert (q / "manifest.json").is_file() and (q / "rank_00000.h5").is_file()  # kept whole


def test_quarantined_checkpoint_is_not_tried_again(root: Path) -> None:
    with CheckpointManager(root) as m:
        assert m.restore(validate=finite)[0] == 2
    calls: list[int] = []
    with CheckpointManager(root) as m:
        step, _ = m.restore(validate=lambda s: not calls.append(s["it"]))  # type: ignore[func-returns-value]
    assert step == 2 and calls == [2]
    assert len(entries(root)[1]) == 1


def test_a_hook_that_raises_counts_as_a_rejection(root: Path) -> None:
    def hook(s: Any) -> bool:
        if np.isnan(s["x"]).any():
            raise FloatingPointError("NaN in x")
        return True

    with CheckpointManager(root) as m:
        step, state = m.restore(validate=hook)
    assert step == 2
    assert_state_equal(state, _state(2))
    committed, quarantined = entries(root)
    assert committed == ["step_00000001", "step_00000002"]
    assert len(quarantined) == 1
    reason = json.loads((root / quarantined[0] / "QUARANTINE.json").read_text())["reason"]
    assert "validate hook raised" in reason
    assert "FloatingPointError" in reason and "NaN in x" in reason


def test_a_hook_rejecting_everything_quarantines_all_and_deletes_nothing(root: Path) -> None:
    files_before = sorted(
        p.relative_to(root).parts[1:]
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0].startswith("step_")
    )
    with CheckpointManager(root) as m, pytest.raises(CheckpointNotFoundError):
        m.restore(validate=lambda s: False)
    committed, quarantined = entries(root)
    assert committed == []
    assert sorted(n.split(".")[0] for n in quarantined) == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]
    files_after = sorted(
        p.relative_to(root).parts[1:]
        for p in root.rglob("*")
        if p.is_file() and ".quarantined-" in p.relative_to(root).parts[0]
    )
    # every file is still there, plus one QUARANTINE.json per checkpoint
    assert sorted(f for f in files_after if f != ("QUARANTINE.json",)) == files_before
    assert files_after.count(("QUARANTINE.json",)) == 3
    for name in quarantined:
        info = json.loads((root / name / "QUARANTINE.json").read_text())
        assert "validate hook" in info["reason"]
    # nothing left to restore, even without a hook
    with CheckpointManager(root) as m, pytest.raises(CheckpointNotFoundError):
        m.restore()


def test_explicit_step_rejected_by_the_hook(root: Path) -> None:
    with CheckpointManager(root) as m:
        with pytest.raises(CheckpointNotFoundError, match="step 3"):
            m.restore(3, validate=finite)
        assert m.restore(validate=finite)[0] == 2  # the others are untouched
    assert entries(root)[0] == ["step_00000001", "step_00000002"]


def test_the_hook_sees_static_entries_too(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(4, state_of(4), static=static_of(2))
    seen: list[set[str]] = []
    with CheckpointManager(root) as m:
        step, state = m.restore(validate=lambda s: not seen.append(set(s)))  # type: ignore[func-returns-value]
    assert step == 4
    assert seen == [set(state_of(4)) | set(static_of(2))]
    assert_state_equal(state, {**state_of(4), **static_of(2)})


def test_accepting_hook_changes_nothing(root: Path) -> None:
    with CheckpointManager(root) as m:
        step, state = m.restore(validate=lambda s: True)
    assert step == 3
    assert np.isnan(state["x"][17])
    assert entries(root) == (["step_00000001", "step_00000002", "step_00000003"], [])
