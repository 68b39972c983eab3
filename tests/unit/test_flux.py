"""Flux's time limit (resilient.job.flux): SIGALRM means stop now, the deadline from ``flux job
timeleft``; a stand-in ``flux`` on ``PATH`` plays Flux (serial, real signals)."""

from __future__ import annotations

import logging
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from resilient import Session
from resilient.io.checkpoints import list_checkpoints
from resilient.job import flux
from resilient.job.slurm import find_deadline
from resilient.model.policies import EverySteps

IN_FLUX = {flux.ENV_FLUX_JOB_ID: "f3Vq8Z1rN2"}


def stand_in_flux(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A ``flux`` command first on ``PATH`` that runs ``body`` (a shell script's lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "flux"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {bin_dir}/calls\n{body}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir / "calls"


@pytest.mark.parametrize(
    ("text", "left"),
    [("93\n", 93.0), ("0", 0.0), ("4294967295\n", None), ("inf", None), ("", None),
     ("-3", None), ("12s", None)],
)  # fmt: skip
def test_timeleft_output_is_whole_seconds_and_uint_max_is_no_limit(
    text: str, left: float | None
) -> None:
    assert flux.parse_timeleft(text) == left


def test_time_left_asks_flux_job_timeleft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = stand_in_flux(tmp_path, monkeypatch, "echo 42")
    assert flux.flux_time_left() == 42.0
    assert calls.read_text().split() == ["job", "timeleft"]


def test_time_left_is_none_when_flux_fails_or_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_flux(tmp_path, monkeypatch, "echo 'flux-job: not running in a job' >&2; exit 1")
    assert flux.flux_time_left() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert flux.flux_time_left() is None


def test_the_deadline_comes_from_flux_only_in_a_flux_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = stand_in_flux(tmp_path, monkeypatch, "echo 600")
    assert find_deadline(IN_FLUX, now=lambda: 1000.0) == (1600.0, "flux job timeleft")
    calls.unlink()
    assert find_deadline({"RESILIENT_DEADLINE": "5"}, now=lambda: 1000.0) == (
        5.0,
        "RESILIENT_DEADLINE",
    )
    assert not calls.exists()  # outside Flux, flux is not asked
    unlimited = {**IN_FLUX, "RESILIENT_DEADLINE": "5"}
    stand_in_flux(tmp_path, monkeypatch, "echo 4294967295")
    assert find_deadline(unlimited, now=lambda: 1000.0) == (5.0, "RESILIENT_DEADLINE")


def test_a_last_save_is_tried_when_it_fits_before_the_kill() -> None:
    assert flux.save_before_kill(None)  # nothing measured: a save is the only way to keep progress
    assert flux.save_before_kill(0.3)
    assert not flux.save_before_kill(flux.SAVE_BEFORE_KILL_S)
    assert flux.KILL_TIMEOUT_S > flux.SAVE_BEFORE_KILL_S


def _state(step: int) -> dict[str, np.ndarray]:
    return {"u": np.full(8, float(step))}


def _alarm() -> None:
    os.kill(os.getpid(), signal.SIGALRM)


@pytest.fixture(autouse=True)
def _alarm_handler_kept() -> Iterator[None]:
    """SIGALRM's handler as it was (pytest-timeout's ``signal`` method uses it)."""
    old = signal.getsignal(signal.SIGALRM)
    yield
    signal.signal(signal.SIGALRM, old)


def test_in_a_flux_job_sigalrm_stops_and_the_step_is_saved_when_saves_are_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no flux: no deadline, only the signal
    root = tmp_path / "ck"
    with (
        pytest.raises(SystemExit) as exit_,
        Session(root, environ=IN_FLUX, save_when=EverySteps(100)) as s,
    ):
        s.restore_or(_state(0))
        assert s.maybe_save(1, _state(1)) is False
        _alarm()
        assert s.maybe_save(2, _state(2)) is False
        assert s.should_stop() and s.stop_reason == "signal SIGALRM"  # saved on the way out
    assert exit_.value.code == 75
    assert [r.step for r in list_checkpoints(root)] == [2]
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN  # a second one cannot kill now


def test_in_a_flux_job_sigalrm_exits_75_without_a_save_that_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(flux, "SAVE_BEFORE_KILL_S", 0.0)  # every measured save is too slow
    root = tmp_path / "ck"
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(SystemExit) as exit_,
        Session(root, environ=IN_FLUX, save_when=EverySteps(2)) as s,
    ):
        s.restore_or(_state(0))
        assert s.maybe_save(2, _state(2)) is True  # measured: a save's cost
        _alarm()
        assert s.maybe_save(3, _state(3)) is False  # no stop's save
        assert s.maybe_save(4, _state(4)) is False  # nor the policy's
        assert s.should_stop()
    assert exit_.value.code == 75  # progress of this run: step 2
    assert [r.step for r in list_checkpoints(root)] == [2]
    (line,) = [r.getMessage() for r in caplog.records if "not saving step 4" in r.getMessage()]
    assert "signal SIGALRM" in line and "killed in 5 s" in line and "stays step 2" in line


def test_outside_flux_a_programs_own_alarm_keeps_its_handler(tmp_path: Path) -> None:
    rang: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda signum, frame: rang.append(signum))
    try:
        with Session(tmp_path / "ck", environ={}) as s:
            assert signal.SIGALRM not in s._signals.signals
            _alarm()
            assert rang == [signal.SIGALRM] and not s.should_stop()
    finally:
        signal.signal(signal.SIGALRM, old)


def test_sigalrm_named_twice_is_installed_once_and_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    mine = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    mine = signal.getsignal(signal.SIGALRM)
    with Session(tmp_path / "ck", environ=IN_FLUX, signals=("USR1", "ALRM")) as s:
        assert s._signals.signals == (signal.SIGUSR1, signal.SIGALRM)
        assert signal.getsignal(signal.SIGALRM) != mine
    assert signal.getsignal(signal.SIGALRM) is mine  # finished, not stopped: the program's again
