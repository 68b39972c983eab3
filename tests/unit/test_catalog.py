"""Rotation works from what the manager knows: history is validated once per process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import resilient.checkpoint.catalog
import resilient.io.checkpoints
from resilient import CheckpointManager, KeepEvery, KeepLast
from resilient.checkpoint.catalog import Catalog
from resilient.checkpoint.statics import StaticStore
from resilient.io.checkpoints import list_checkpoints
from resilient.io.targets import DirectoryTarget, SetKey, Target
from resilient.model.manifest import Manifest


def _fill(root: Path, steps: range) -> None:
    with CheckpointManager(root) as m:
        for s in steps:
            m.save(s, {"u": np.full(4, float(s))}, static={"mesh": np.arange(3.0)})


@pytest.mark.parametrize("with_log", [True, False])
def test_saves_validate_the_history_at_most_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_log: bool
) -> None:
    root = tmp_path / "ck"
    _fill(root, range(1, 41))
    if not with_log:  # e.g. written by an older library: each checkpoint is validated once
        (root / "saves.jsonl").unlink()
    calls: list[SetKey] = []
    real = resilient.io.checkpoints.validate_set

    def counting(target: Target, key: SetKey, **kwargs: Any) -> Manifest:
        calls.append(key)
        return real(target, key, **kwargs)

    monkeypatch.setattr("resilient.checkpoint.catalog.validate_set", counting)
    with CheckpointManager(root, keep=KeepEvery(steps=1)) as m:
        m.save(41, {"u": np.zeros(4)}, static={"mesh": np.arange(3.0)})
        first = len(calls)
        for s in range(42, 52):
            m.save(s, {"u": np.zeros(4)}, static={"mesh": np.arange(3.0)})
    # the save log knows what this library committed; without it, the history is read once;
    # either way the newest logged checkpoint (41) is checked: a log line does not prove that
    # a checkpoint is still intact, and rotation always keeps the newest valid one
    assert first == (1 if with_log else 41)
    assert len(calls) == first  # later saves validate nothing already known
    assert [r.step for r in list_checkpoints(root)] == list(range(1, 52))


def test_a_checkpoint_the_log_does_not_know_is_validated(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _fill(root, range(1, 4))
    log = root / "saves.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines[:-1], "{torn"]) + "\n")  # step 3's line lost
    (root / "step_00000002" / "COMMITTED").unlink()  # known to the log, broken on disk
    catalog = Catalog(DirectoryTarget(root), StaticStore(DirectoryTarget(root)))
    # step 3 was validated and kept; step 2 is trusted from the log (restore would catch it)
    assert [i.step for i in catalog.infos()] == [1, 2, 3]


def test_catalog_keeps_steps_in_order_after_an_older_step_is_saved_again(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _fill(root, range(1, 6))
    with CheckpointManager(root, keep=KeepLast(2)) as m:
        m.restore(step=3)
        m.save(3, {"u": np.ones(4)})  # after a fallback: step 3 again, newer than 4 and 5 on disk
    steps = [r.step for r in list_checkpoints(root)]
    assert steps == [4, 5]  # KeepLast(2) by step: 3 is older than 4 and 5

    catalog = Catalog(DirectoryTarget(root), StaticStore(DirectoryTarget(root)))
    assert [i.step for i in catalog.infos()] == [4, 5]
    plan = catalog.plan(KeepLast(1))
    assert plan.delete == {4} and plan.keep == {5}


def test_rotation_collects_static_data_no_checkpoint_uses(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root, keep=KeepLast(1)) as m:
        m.save(1, {"u": np.zeros(2)}, static={"mesh": np.arange(3.0)})
        m.save(2, {"u": np.zeros(2)}, static={"mesh": np.arange(4.0)})
        m.save(3, {"u": np.zeros(2)}, static={"mesh": np.arange(4.0)})
    assert len(list((root / "static").iterdir())) == 2  # one content: its two copies
    assert [r.step for r in list_checkpoints(root)] == [3]
