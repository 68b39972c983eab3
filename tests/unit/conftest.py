"""Shared fixtures of the unit tests: a root with three committed checkpoints (every test's
signal dispositions are put back by tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient import CheckpointManager
from tests.unit.ckutil import SavedRoot, state_of, static_of


@pytest.fixture
def saved(tmp_path: Path) -> SavedRoot:
    """ROOT with steps 1, 2, 3 (arrays, JSON values, shared static data); manager closed."""
    root = tmp_path / "ck"
    states, statics = {}, {}
    with CheckpointManager(root) as m:
        for step in (1, 2, 3):
            states[step] = state_of(step)
            statics[step] = static_of(1)
            m.save(step, states[step], static=statics[step], metrics={"loss": 1.0 / step})
    return SavedRoot(root, states, statics)
