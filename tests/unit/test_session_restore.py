"""``Session.restore_or``: a restore in place (``into=``) as ``CheckpointManager.restore`` does
it, and the checks of what it is given."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from resilient.errors import ConfigError
from resilient.job.session import Session


def _saved(root: Path) -> dict[str, np.ndarray]:
    state = {"u": np.arange(6.0).reshape(2, 3), "w": np.arange(4, dtype=np.int32)}
    with Session(root, environ={}) as s:
        s.restore_or({"u": np.zeros((2, 3)), "w": np.zeros(4, dtype=np.int32)})
        s.save(3, state)
    return state


def test_restore_or_into_fills_the_given_arrays(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Session(root, environ={}) as s:  # no checkpoint: the targets stay as they are
        u = np.full((2, 3), -1.0)
        step, state = s.restore_or({"u": u}, into={"u": u}, step=7)
        assert step == 7 and state["u"] is u and (u == -1.0).all()
    saved = _saved(root)
    targets = {"u": np.empty((2, 3)), "w": np.empty(4, dtype=np.int32)}
    with Session(root, environ={}) as s:
        step, state = s.restore_or(lambda: targets, into=targets)
    assert step == 3
    assert state["u"] is targets["u"] and state["w"] is targets["w"]  # no second copy
    assert targets["u"].tobytes() == saved["u"].tobytes()
    assert targets["w"].tobytes() == saved["w"].tobytes()


def test_restore_or_into_of_another_shape_names_the_leaf(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _saved(root)
    for wrong in ({"u": np.empty((3, 3))}, {"w": np.empty(4, dtype=np.int64)}):
        with Session(root, environ={}) as s, pytest.raises(ConfigError) as info:
            s.restore_or(wrong, into=wrong)
        (leaf,) = wrong
        assert repr(leaf) in str(info.value) or leaf in str(info.value), info.value
    with Session(root, environ={}) as s:  # nothing was quarantined: the checkpoint is intact
        assert s.restore_or(lambda: {})[0] == 3
