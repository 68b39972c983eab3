"""Helpers shared by the unit tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def state_of(step: int) -> dict[str, Any]:
    """The per-step state the fixtures save (arrays large enough to be page-aligned)."""
    return {
        "x": np.arange(2000, dtype=np.float64) * step + 0.5,
        "i": (np.arange(12, dtype=np.int32) + step).reshape(3, 4),
        "it": step,
        "note": f"step {step}",
    }


def static_of(version: int = 1) -> dict[str, Any]:
    return {
        "grid": np.linspace(0.0, float(version), 700),
        "mesh": {"name": "cube", "version": version},
    }


def assert_state_equal(got: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Same keys; arrays bit-identical with the same dtype and shape; values equal, same type."""
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, np.ndarray):
            assert isinstance(have, np.ndarray), key
            assert have.dtype == want.dtype, key
            assert have.shape == want.shape, key
            assert have.tobytes() == want.tobytes(), key
        else:
            assert type(have) is type(want), key
            assert have == want, key


@dataclass
class SavedRoot:
    root: Path
    states: dict[int, dict[str, Any]]
    statics: dict[int, dict[str, Any]]

    def expected(self, step: int) -> dict[str, Any]:
        return {**self.states[step], **self.statics[step]}

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random-ish values that use the whole range of the dtype (not just zeros)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dt.kind == "b":
        flat = rng.integers(0, 2, n).astype(bool)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        flat = rng.integers(info.min, info.max, n, dtype=dt.newbyteorder("="), endpoint=True)
    elif dt.kind == "f":
        flat = rng.standard_normal(n) * 1e3
    else:
        flat = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    return np.asarray(flat.reshape(shape), dtype=dt)


def flip_dataset_byte(step_dir: Path, name: str | None = None) -> None:
    """Flip one byte in the middle of a dataset (``name``, or the largest) of the checkpoint in
    ``step_dir``'s first data file: same size, so only a checksum sees it."""
    from resilient.model.codec import parse_manifest

    manifest = parse_manifest((step_dir / "manifest.json").read_text())
    table = manifest.ranks[0].datasets
    i = table.names.index(name) if name is not None else table.nbytes.index(max(table.nbytes))
    path = step_dir / manifest.ranks[0].file
    data = bytearray(path.read_bytes())
    offset = table.offsets[i]
    assert offset is not None
    data[offset + table.nbytes[i] // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def job_free_env(**extra: str) -> dict[str, str]:
    """This process's environment without a job's (Slurm's, a ``resilient run`` attempt's),
    with the repository on ``PYTHONPATH``: for a ``resilient run`` started by a test."""
    from resilient.job.protocol import ENV_ATTEMPT, ENV_CHECKPOINT_DIR, ENV_DEADLINE, ENV_HANDOFF

    own = (ENV_DEADLINE, ENV_ATTEMPT, ENV_CHECKPOINT_DIR, ENV_HANDOFF)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in own}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env
