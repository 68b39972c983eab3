"""The cyclic garbage collector is process-wide: a save or restore leaves it alone unless the
user asks (``RESILIENT_PAUSE_GC=1``)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.manager import PAUSE_GC_ENV


class Watched:
    """An array leaf that notes whether the collector was enabled when it was read."""

    def __init__(self, seen: list[bool]) -> None:
        self.seen = seen

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.seen.append(gc.isenabled())
        return np.arange(4.0)


@pytest.mark.parametrize(("value", "paused"), [(None, False), ("0", False), ("1", True)])
def test_the_collector_is_paused_only_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None, paused: bool
) -> None:
    if value is None:
        monkeypatch.delenv(PAUSE_GC_ENV, raising=False)
    else:
        monkeypatch.setenv(PAUSE_GC_ENV, value)
    assert gc.isenabled()
    seen: list[bool] = []
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"u": Watched(seen)})
        step, state = mgr.restore()
    assert step == 1 and np.array_equal(state["u"], np.arange(4.0))
    assert seen and all(enabled is not paused for enabled in seen), seen
    assert gc.isenabled()  # on again after the save and the restore either way
