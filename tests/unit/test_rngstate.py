"""``rng_state``/``set_rng_state``: Python's and numpy's random streams (the global ones and
those a loop owns) saved in a checkpoint as arrays and restored draw for draw; a damaged or
foreign state is refused, naming the part, and sets nothing."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager, rng_state, set_rng_state
from resilient.errors import ConfigError


def draws(owned: dict[str, Any]) -> list[float]:
    """A few numbers from every stream (the Gaussians leave a cached second value behind)."""
    out = [random.random(), random.gauss(0, 1), float(np.random.standard_normal())]
    out += [float(np.random.randint(1 << 30))]
    out += [float(owned["aug"].standard_normal()), float(owned["aug"].integers(1 << 62))]
    out += [owned["mt"].random(), owned["own"].gauss(0, 1), float(owned["philox"].random())]
    return out


def generators(seed: int) -> dict[str, Any]:
    return {
        "aug": np.random.default_rng(seed),  # PCG64: 128-bit integers in its state
        "mt": np.random.Generator(np.random.MT19937(seed)),
        "own": random.Random(seed),
        "philox": np.random.Generator(np.random.Philox(seed)),
    }


def test_a_restored_state_draws_what_the_uninterrupted_run_draws(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    owned = generators(3)
    draws(owned)  # somewhere in the middle, with a cached Gaussian
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(1, {"rng": rng_state(owned)})
    want = draws(owned)

    random.seed(99)  # a new process: other seeds, other positions
    np.random.seed(99)
    fresh = generators(99)
    with CheckpointManager(tmp_path / "ck") as m:
        _, state = m.restore()
    assert state["rng"]["format"] == "resilient.rng/1"
    set_rng_state(state["rng"], fresh)
    assert draws(fresh) == want


def test_every_numeric_part_is_an_array_and_nothing_is_pickled() -> None:
    def leaves(value: Any) -> list[Any]:
        if isinstance(value, dict):
            return [leaf for v in value.values() for leaf in leaves(v)]
        return [value]

    got = rng_state(generators(1))
    assert {type(v) for v in leaves(got)} <= {np.ndarray, str}


def test_a_damaged_or_foreign_state_is_refused_and_sets_nothing() -> None:
    owned = generators(5)
    saved = rng_state(owned)
    before = rng_state(owned)

    def refused(state: Any, match: str, given: dict[str, Any] | None = None) -> None:
        with pytest.raises(ConfigError, match=match):
            set_rng_state(state, owned if given is None else given)
        after = rng_state(owned)  # nothing was set (the first parts were fine)
        for part in ("python", "numpy"):
            for k, v in before[part].items():
                assert after[part][k].tobytes() == v.tobytes(), (part, k)

    draws(owned)
    before = rng_state(owned)
    refused({"u": np.zeros(3)}, "not a random-stream state")
    refused({**saved, "format": "other/2"}, "format 'other/2'")
    refused({**saved, "numpy": {**saved["numpy"], "key": np.zeros(600, np.uint32)}}, "numpy/key")
    short = {**saved["python"], "internal": saved["python"]["internal"][:10]}
    refused({**saved, "python": short}, "python/internal")
    gens = saved["generators"]
    refused({**saved, "generators": {**gens, "aug": gens["mt"]}}, "generators/aug")
    refused(saved, "give the same names", {"aug": owned["aug"]})
    refused(saved, "a python generator, given a numpy one", {**owned, "own": owned["mt"]})
    with pytest.raises(ConfigError, match="generator 'x' is a list"):
        rng_state({"x": []})
