"""``@resumable``: in-process retries that resume from the latest checkpoint, bit for bit."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import EverySteps, Resume, resumable

_RNG = np.random.default_rng(1234)
X = _RNG.standard_normal((64, 4))
Y = X @ np.array([1.5, -2.0, 0.25, 3.0]) + 0.1 * _RNG.standard_normal(64)
N_STEPS = 23


def update(w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """One gradient-descent step of least squares (deterministic, float64)."""
    err = X @ w + b - Y
    loss = float(np.mean(err**2))
    w = w - 0.05 * (X.T @ err) * (2.0 / len(Y))
    b = b - 0.05 * np.array([err.mean() * 2.0])
    return w, b, loss


def make_train(
    ckdir: Path, *, retries: int, fail_at: dict[int, int], seen: list[tuple[int, int]]
) -> Any:
    @resumable(ckdir, retries=retries, save_when=EverySteps(5), sleep=lambda s: None)
    def train(ckpt: Resume, n_steps: int) -> dict[str, Any]:
        seen.append((ckpt.attempt, ckpt.step))
        step = ckpt.step
        if ckpt.state is None:
            w, b, loss = np.zeros(4), np.zeros(1), float("nan")
        else:
            w, b, loss = ckpt.state["w"], ckpt.state["b"], ckpt.state["loss"]
        while step < n_steps:
            w, b, loss = update(w, b)
            step += 1
            ckpt.maybe_save(step, {"w": w, "b": b, "loss": loss}, metrics={"loss": loss})
            if fail_at.get(ckpt.attempt) == step:
                raise RuntimeError(f"injected failure at step {step}")
        return {"w": w, "b": b, "loss": loss, "step": step}

    return train


def test_resumes_from_the_latest_checkpoint_and_matches_bit_for_bit(tmp_path: Path) -> None:
    ref_seen: list[tuple[int, int]] = []
    reference = make_train(tmp_path / "ref", retries=0, fail_at={}, seen=ref_seen)(N_STEPS)
    assert ref_seen == [(1, 0)]

    seen: list[tuple[int, int]] = []
    train = make_train(tmp_path / "ck", retries=3, fail_at={1: 12, 2: 18}, seen=seen)
    result = train(N_STEPS)
    # 1st call: fresh; failed at 12 after saving 10. 2nd: from 10; failed at 18 after saving 15.
    assert seen == [(1, 0), (2, 10), (3, 15)]
    assert result["step"] == N_STEPS
    assert result["w"].tobytes() == reference["w"].tobytes()
    assert result["b"].tobytes() == reference["b"].tobytes()
    assert result["loss"] == reference["loss"]
    steps = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000005", "step_00000010", "step_00000015", "step_00000020"]


def test_retries_exhausted_propagates_after_retries_plus_one_calls(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    train = make_train(tmp_path / "ck", retries=1, fail_at={1: 7, 2: 13, 3: 19}, seen=seen)
    with pytest.raises(RuntimeError, match="injected failure at step 13"):
        train(N_STEPS)
    assert seen == [(1, 0), (2, 5)]


def test_the_root_is_unlocked_after_a_failure(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    failing = make_train(tmp_path / "ck", retries=0, fail_at={1: 7}, seen=seen)
    with pytest.raises(RuntimeError):
        failing(N_STEPS)
    again: list[tuple[int, int]] = []
    assert make_train(tmp_path / "ck", retries=0, fail_at={}, seen=again)(N_STEPS)["step"] == 23
    assert again == [(1, 5)]  # a later call resumes (and could take the lock)


def test_enospc_is_not_retried(tmp_path: Path) -> None:
    calls: list[int] = []
    sleeps: list[float] = []

    @resumable(tmp_path / "ck", retries=3, save_when=EverySteps(5), sleep=sleeps.append)
    def train(ckpt: Resume) -> None:
        calls.append(ckpt.attempt)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as exc_info:
        train()
    assert exc_info.value.errno == errno.ENOSPC
    assert calls == [1]
    assert sleeps == []


def test_exception_outside_retry_on_is_not_retried(tmp_path: Path) -> None:
    calls: list[int] = []

    @resumable(tmp_path / "ck", retries=3, retry_on=(RuntimeError,), sleep=lambda s: None)
    def train(ckpt: Resume) -> None:
        calls.append(ckpt.attempt)
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        train()
    assert calls == [1]


def test_backoff_sleeps_between_calls(tmp_path: Path) -> None:
    sleeps: list[float] = []
    calls: list[int] = []

    @resumable(tmp_path / "ck", retries=2, backoff_s=1.0, backoff_max_s=60.0, sleep=sleeps.append)
    def train(ckpt: Resume) -> str:
        calls.append(ckpt.attempt)
        if ckpt.attempt < 3:
            raise RuntimeError("again")
        return "done"

    assert train() == "done"
    assert calls == [1, 2, 3]
    assert len(sleeps) == 2
    assert 0 < sleeps[0] <= sleeps[1] <= 60.0


def test_a_function_without_the_resume_argument_is_a_type_error_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sleeps: list[float] = []
    calls: list[Any] = []

    @resumable(tmp_path / "ck", retries=3, sleep=sleeps.append)  # type: ignore[arg-type]
    def train(cfg: dict[str, int]) -> None:  # the Resume is missing
        calls.append(cfg)

    with caplog.at_level("WARNING"), pytest.raises(TypeError) as err:
        train({"steps": 10})  # type: ignore[call-arg]
    message = str(err.value)
    assert message.startswith("@resumable ")
    assert "train(cfg: 'dict[str, int]') -> 'None': too many positional arguments" in message
    assert "receives a Resume as its first argument" in message
    assert calls == [] and sleeps == []  # never called, never retried
    assert "resuming" not in caplog.text
    assert not (tmp_path / "ck").exists()  # no checkpoint directory opened


def test_arguments_the_function_does_not_take_are_a_type_error_at_once(tmp_path: Path) -> None:
    calls: list[int] = []

    @resumable(tmp_path / "ck", retries=3, sleep=lambda s: None)
    def train(ckpt: Resume, n_steps: int) -> None:
        calls.append(n_steps)

    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        train(3, steps=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing a required argument: 'n_steps'"):
        train()  # type: ignore[call-arg]
    assert calls == []
    train(n_steps=3)
    train(4)
    assert calls == [3, 4]


def test_a_type_error_inside_the_function_is_retried_as_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    @resumable(tmp_path / "ck", retries=2, sleep=lambda s: None)
    def train(ckpt: Resume, n_steps: int) -> int:
        calls.append(ckpt.attempt)
        if ckpt.attempt == 1:
            raise TypeError("a bug inside, first attempt only")
        return n_steps

    with caplog.at_level("WARNING"):
        assert train(5) == 5
    assert calls == [1, 2]
    assert "a bug inside, first attempt only; resuming from the latest valid checkpoint" in (
        caplog.text
    )
    assert "receives a Resume" not in caplog.text
