"""Deadlines, stop signals, walltime policies and the Session's stop/exit behaviour (serial)."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager, Session
from resilient.errors import ConfigError
from resilient.io import logs
from resilient.io.checkpoints import list_checkpoints
from resilient.job.exitcodes import EXIT_RESUME
from resilient.job.protocol import ENV_ATTEMPT, ENV_DEADLINE
from resilient.job.slurm import (
    StopSignals,
    find_deadline,
    parse_signal,
    parse_squeue_time_left,
)
from resilient.model import filenames
from resilient.model.policies import (
    SHORT_RUN_MARGIN_SHARE,
    BeforeWalltime,
    EverySteps,
    OnSignal,
    SaveContext,
    YoungDaly,
)
from tests.unit.ckutil import assert_state_equal, state_of, static_of


def ctx(step: int, **kw: Any) -> SaveContext:
    kw.setdefault("now", 0.0)
    return SaveContext(step=step, **kw)


def _wait_for(pred: Any, timeout: float = 2.0) -> bool:
    """Python runs signal handlers between bytecodes; give it a moment, never spin forever."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


# --------------------------------------------------------------------------- squeue %L


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1-02:03:04", ((1 * 24 + 2) * 60 + 3) * 60 + 4.0),
        ("02:03:04", (2 * 60 + 3) * 60 + 4.0),
        ("03:04", 3 * 60 + 4.0),
        ("0:00", 0.0),
        ("  59:59\n", 59 * 60 + 59.0),
        ("10-00:00:00", 10 * 86400.0),
    ],
)
def test_parse_squeue_time_left_formats(text: str, seconds: float) -> None:
    got = parse_squeue_time_left(text)
    assert got == seconds
    assert isinstance(got, float)


@pytest.mark.parametrize(
    "text",
    [
        "INVALID",
        "UNLIMITED",
        "NOT_SET",
        "",
        "   ",
        "garbage",
        "12",
        "1:2:3:4",
        "-1:00",
        "a:bc",
        "1-",
    ],
)
def test_parse_squeue_time_left_unknown_is_none(text: str) -> None:
    assert parse_squeue_time_left(text) is None


# --------------------------------------------------------------------------- find_deadline


class FakeSqueue:
    def __init__(self, left: float | None) -> None:
        self.left = left
        self.calls: list[str] = []

    def __call__(self, job: str) -> float | None:
        self.calls.append(job)
        return self.left


def test_find_deadline_slurm_job_end_time_wins() -> None:
    sq = FakeSqueue(100.0)
    env = {"SLURM_JOB_END_TIME": "2000000000", "SLURM_JOB_ID": "42", ENV_DEADLINE: "5.0"}
    assert find_deadline(env, now=lambda: 1000.0, time_left=sq) == (
        2000000000.0,
        "SLURM_JOB_END_TIME",
    )
    assert sq.calls == []  # squeue is not even asked


def test_find_deadline_squeue_wins_over_own_deadline() -> None:
    sq = FakeSqueue(300.0)
    env = {"SLURM_JOB_ID": " 42 ", ENV_DEADLINE: "5.0"}
    assert find_deadline(env, now=lambda: 1000.0, time_left=sq) == (1300.0, "squeue")
    assert sq.calls == ["42"]


def test_find_deadline_own_deadline_last() -> None:
    sq = FakeSqueue(None)
    env = {"SLURM_JOB_ID": "42", ENV_DEADLINE: "1234.5"}
    assert find_deadline(env, now=lambda: 1000.0, time_left=sq) == (1234.5, ENV_DEADLINE)
    assert sq.calls == ["42"]  # asked, said nothing, fell through
    assert find_deadline({ENV_DEADLINE: "77"}, time_left=sq) == (77.0, ENV_DEADLINE)
    assert sq.calls == ["42"]  # no job id: squeue not asked


@pytest.mark.parametrize("end", ["", "0", "-5", "abc", "1.5e9", "  "])
def test_find_deadline_bad_end_time_falls_through(end: str) -> None:
    sq = FakeSqueue(60.0)
    env = {"SLURM_JOB_END_TIME": end, "SLURM_JOB_ID": "7"}
    assert find_deadline(env, now=lambda: 10.0, time_left=sq) == (70.0, "squeue")


@pytest.mark.parametrize("own", ["", "soon", "12:00", "  "])
def test_find_deadline_bad_own_deadline_is_none(own: str) -> None:
    env = {"SLURM_JOB_END_TIME": "x", "SLURM_JOB_ID": "7", ENV_DEADLINE: own}
    assert find_deadline(env, time_left=FakeSqueue(None)) == (None, "none")


def test_find_deadline_none() -> None:
    sq = FakeSqueue(60.0)
    assert find_deadline({}, time_left=sq) == (None, "none")
    assert sq.calls == []


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize(
    ("name", "sig"),
    [
        ("USR1", signal.SIGUSR1),
        ("SIGUSR1", signal.SIGUSR1),
        ("usr2", signal.SIGUSR2),
        (" term ", signal.SIGTERM),
        ("term", signal.SIGTERM),
        (int(signal.SIGUSR1), signal.SIGUSR1),
        (str(int(signal.SIGTERM)), signal.SIGTERM),
    ],
)
def test_parse_signal(name: str | int, sig: signal.Signals) -> None:
    assert parse_signal(name) is sig


@pytest.mark.parametrize("name", ["NOPE", "SIGNOPE", "", "USR3", 9999, "9999"])
def test_parse_signal_unknown(name: str | int) -> None:
    with pytest.raises(ValueError):
        parse_signal(name)


def test_stop_signals_installs_only_inside_the_block_and_only_sets_a_flag() -> None:
    hits: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        hits.append(signum)

    old_usr1 = signal.signal(signal.SIGUSR1, mine)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
        stop = StopSignals(["USR1", "SIGUSR2"])
        assert not stop.is_active and not stop.is_set
        assert signal.getsignal(signal.SIGUSR1) is mine  # constructing installs nothing
        with stop as s:
            assert s is stop and stop.is_active
            assert signal.getsignal(signal.SIGUSR1) == stop._handler
            assert signal.getsignal(signal.SIGUSR2) == stop._handler
            assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]  # untouched
            os.kill(os.getpid(), signal.SIGUSR1)
            assert _wait_for(lambda: stop.is_set)
            assert stop.received is signal.SIGUSR1
            assert hits == []  # the previous handler is not chained
        assert not stop.is_active
        after = {s: signal.getsignal(s) for s in before}
        # a warning signal that was at its default is ignored from now on (resilient.job.warning)
        dfl = before[signal.SIGUSR2] == signal.SIG_DFL
        assert after == {
            **before,
            signal.SIGUSR2: signal.SIG_IGN if dfl else before[signal.SIGUSR2],
        }
        # the restored handler is live again, the StopSignals flag is not touched any more
        stop.received = None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: hits == [signal.SIGUSR1])
        assert stop.received is None
    finally:
        signal.signal(signal.SIGUSR1, old_usr1)
        signal.signal(signal.SIGUSR2, before[signal.SIGUSR2])


def test_stop_signals_entered_twice_restores_the_original() -> None:
    def mine(signum: int, frame: Any) -> None:
        pass

    before = signal.signal(signal.SIGUSR2, mine)
    try:
        stop = StopSignals(["USR2"])
        with stop, stop:  # programs install early, Session enters again: harmless
            assert signal.getsignal(signal.SIGUSR2) == stop._handler
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_stop_signals_ignore_keeps_a_late_warning_from_killing_a_finished_program() -> None:
    """After ``ignore()`` the signal is SIG_IGN (which CPython keeps through shutdown, unlike a
    Python handler): a warning that arrives then does nothing, and leaving the block does not
    put the flag handler back."""
    before = signal.getsignal(signal.SIGUSR2)
    try:
        with StopSignals(["USR2"]) as stop:
            stop.ignore()
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.01)
            assert stop.received is None
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_stop_signals_rejects_unknown_names_at_construction() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ValueError):
        StopSignals(["USR1", "BOGUS"])
    assert signal.getsignal(signal.SIGUSR1) == before


# --------------------------------------------------------------------------- policies


def test_before_walltime_margin_plus_save_cost() -> None:
    p = BeforeWalltime(margin_s=60)
    assert p(ctx(5, time_left_s=60.0)) is True
    assert p(ctx(5, time_left_s=60.5)) is False
    assert p(ctx(5, time_left_s=70.0, save_cost_s=10.0)) is True  # 70 <= 60 + 10
    assert p(ctx(5, time_left_s=70.1, save_cost_s=10.0)) is False
    assert p(ctx(5, time_left_s=-3.0)) is True  # past the deadline: still save
    assert p(ctx(5, time_left_s=1.0, last_saved_step=5)) is False  # not twice for one step
    assert p(ctx(6, time_left_s=1.0, last_saved_step=5)) is True
    assert p(ctx(5, time_left_s=None)) is False  # no deadline known
    assert p(ctx(5, time_left_s=None, save_cost_s=1e9, stop_requested=True)) is False


def test_on_signal() -> None:
    p = OnSignal()
    assert p(ctx(3, stop_requested=True)) is True
    assert p(ctx(3, stop_requested=False)) is False
    assert p(ctx(3, stop_requested=True, last_saved_step=3)) is False
    assert p(ctx(4, stop_requested=True, last_saved_step=3)) is True


def test_young_daly_interval_from_the_measured_cost() -> None:
    p = YoungDaly(mtbf_s=86400)
    interval = p.interval_s(4.0)
    assert interval == pytest.approx(math.sqrt(2 * 4.0 * 86400))
    assert interval == pytest.approx(831.4, abs=0.05)
    assert p(ctx(7, now=1000.0 + 831.3, last_saved_time=1000.0, save_cost_s=4.0)) is False
    assert p(ctx(7, now=1000.0 + 831.4, last_saved_time=1000.0, save_cost_s=4.0)) is True
    assert p(ctx(7, now=1e9, last_saved_time=0.0, save_cost_s=4.0, last_saved_step=7)) is False
    assert p(ctx(7, now=0.0, last_saved_time=None)) is True  # never saved: save


def test_young_daly_initial_interval_before_any_measurement() -> None:
    p = YoungDaly(mtbf_s=86400, initial_interval_s=100)
    assert p.interval_s(None) == 100
    assert p(ctx(1, now=99.9, last_saved_time=0.0, save_cost_s=None)) is False
    assert p(ctx(1, now=100.0, last_saved_time=0.0, save_cost_s=None)) is True
    assert YoungDaly(mtbf_s=1.0).interval_s(None) == 600.0  # the default


class SteppingClock:
    """A clock that advances by ``tick`` at every reading (so a save takes measurable time)."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.tick = 0.0

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def test_young_daly_with_the_managers_measured_cost(tmp_path: Path) -> None:
    clock = SteppingClock(1000.0)
    policy = YoungDaly(mtbf_s=86400, initial_interval_s=50)
    with CheckpointManager(tmp_path / "ck", save_when=policy, clock=clock) as m:
        assert m.should_save(1) is False  # the start counts as the last save
        clock.t = 1050.0
        assert m.should_save(1) is True  # initial interval (no measurement yet)
        clock.tick = 2.0
        m.save(1, {"x": np.zeros(3)})
        clock.tick = 0.0
        cost = m.save_cost_s
        assert cost is not None and cost >= 2.0
        end = m.save_context(2).last_saved_time
        assert end is not None
        interval = math.sqrt(2 * cost * 86400)
        assert interval > 50  # no longer the initial interval
        clock.t = end + interval - 0.01
        assert m.should_save(2) is False
        clock.t = end + interval + 0.01
        assert m.should_save(2) is True


@pytest.mark.parametrize("bad", [0, -1.0, "86400", None, True, float("nan")])
def test_young_daly_rejects_bad_mtbf(bad: Any) -> None:
    with pytest.raises(ConfigError, match="mtbf_s"):
        YoungDaly(mtbf_s=bad)


@pytest.mark.parametrize("bad", [-1.0, "600", None, True])
def test_young_daly_rejects_bad_initial_interval(bad: Any) -> None:
    # Bug: YoungDaly.__post_init__ validates mtbf_s only. A negative interval silently saves at
    # every step; a string or None is accepted and fails later with TypeError inside the policy.
    with pytest.raises(ConfigError, match="initial_interval_s"):
        YoungDaly(mtbf_s=86400, initial_interval_s=bad)


@pytest.mark.parametrize("bad", [-1, -0.5, "60", None, True])
def test_before_walltime_rejects_bad_margin(bad: Any) -> None:
    with pytest.raises(ConfigError, match="margin_s"):
        BeforeWalltime(margin_s=bad)


# --------------------------------------------------------------------------- Session


def _state(step: int) -> dict[str, Any]:
    return {"x": np.full(16, float(step)), "step": step}


class Clock:
    """A clock the test moves by hand (Session(clock=...) measures the time left with it)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_session_deadline_near_stops(tmp_path: Path) -> None:
    clock = Clock(0.0)
    env = {ENV_DEADLINE: "1000"}
    with (
        pytest.raises(SystemExit) as exc_info,
        Session(tmp_path / "ck", environ=env, margin_s=60, clock=clock) as s,
    ):
        assert s.deadline_source == ENV_DEADLINE
        assert s.time_left_s == 1000
        assert s.should_stop() is False
        clock.now = 940.0  # 60 s left: the margin
        assert s.should_stop() is True
        assert "deadline" in s.stop_reason
        clock.now = 0.0
        assert s.should_stop() is True  # sticky
    assert exc_info.value.code == 1  # stopped before any progress: not 75


def test_session_stops_right_after_saving_the_current_step_near_the_deadline(
    tmp_path: Path,
) -> None:
    """The deadline rule is BeforeWalltime's, but "this step is saved" must not delay the stop:
    the loop would run one more step and pay one more save."""
    clock = Clock(0.0)
    env = {ENV_DEADLINE: "1000"}
    with (
        pytest.raises(SystemExit) as exc_info,
        Session(
            tmp_path / "ck", environ=env, margin_s=60, save_when=EverySteps(1), clock=clock
        ) as s,
    ):
        assert s.maybe_save(5, {"u": np.zeros(3)}) is True
        clock.now = 950.0
        assert s.should_stop() is True
        assert "deadline" in s.stop_reason
    assert exc_info.value.code == 75  # progress was saved in this run
    assert [r.step for r in list_checkpoints(tmp_path / "ck")] == [5]  # no second save


def test_session_stop_rule_is_a_before_walltime_policy(tmp_path: Path) -> None:
    with Session(tmp_path / "ck", environ={}, margin_s=42) as s:
        assert s._stop_before_deadline == BeforeWalltime(margin_s=42.0)
    with pytest.raises(ConfigError):
        Session(tmp_path / "ck2", environ={}, margin_s=-1)


# --------------------------------------------------------------------------- a margin that does not fit


@pytest.mark.parametrize(
    ("margin", "left", "used"),
    [
        (10.0, None, 10.0),  # no deadline known
        (10.0, 30.0, 10.0),  # fits
        (10.0, 20.0, 10.0),  # leaves the loop half the time left: fits
        (10.0, 19.9, 9.95),  # would leave the loop less than half: half the time left
        (10.0, 10.01, 5.005),
        (10.0, 10.0, 5.0),  # would stop at the first check: half the time left
        (10.0, 3.0, 1.5),
        (1e6, 1000.0, 500.0),
        (10.0, 0.0, 0.0),  # the deadline is here, or has passed: stop at once
        (10.0, -5.0, 0.0),
        (0.0, 3.0, 0.0),
        (10.0, math.nan, 10.0),
    ],
)
def test_before_walltime_fit_to_the_time_left(
    margin: float, left: float | None, used: float
) -> None:
    rule = BeforeWalltime(margin_s=margin)
    fitted = rule.fit_to(left)
    assert fitted.margin_s == pytest.approx(used)
    if used == margin:
        assert fitted is rule
    assert SHORT_RUN_MARGIN_SHARE == 0.5


@pytest.mark.parametrize("left", [0.001, 0.5, 3.0, 9.99, 10.0, 60.0, 1e5])
def test_fitted_before_walltime_never_stops_a_run_at_its_first_check(left: float) -> None:
    """With time left at the start, the fitted rule leaves room for steps before it fires."""
    fitted = BeforeWalltime(margin_s=10.0).fit_to(left)
    assert fitted(ctx(0, time_left_s=left)) is False
    assert fitted(ctx(0, time_left_s=fitted.margin_s)) is True  # it still stops, later


def test_session_clamps_a_margin_longer_than_the_time_left_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(0.0)
    env = {ENV_DEADLINE: "3", ENV_ATTEMPT: "2"}
    root = tmp_path / "ck"
    with (
        caplog.at_level(logging.WARNING, logger="resilient.job.session"),
        pytest.raises(SystemExit) as exc_info,
        Session(root, environ=env, margin_s=10, save_when=EverySteps(100), clock=clock) as s,
    ):
        step, _ = s.restore_or(_state(0))
        assert s.margin_s == 10.0  # the setting is kept; the rule uses the clamped margin
        assert s._stop_before_deadline == BeforeWalltime(margin_s=1.5)
        while not s.should_stop():
            step += 1
            s.maybe_save(step, _state(step))
            clock.now += 0.5  # a step takes half a second
        assert "deadline" in s.stop_reason
    assert exc_info.value.code == EXIT_RESUME  # progress saved: resume me
    assert step == 3  # stopped once 1.5 s were left
    assert [r.step for r in list_checkpoints(root)] == [3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert all(x in warnings[0] for x in ("10.0 s", "3.0 s", "1.5 s")), warnings
    (stop,) = logs.read_log(root / filenames.STOP_LOG, logs.STOPS)
    assert stop["saved"] is True and stop["step"] == 3 and stop["attempt"] == 2
    assert (stop["margin_s"], stop["margin_used_s"], stop["time_left_at_start_s"]) == (10, 1.5, 3)
    assert stop["deadline_source"] == ENV_DEADLINE


def test_session_with_a_margin_that_fits_does_not_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {ENV_DEADLINE: "1000"}
    with (
        caplog.at_level(logging.WARNING, logger="resilient.job.session"),
        Session(tmp_path / "ck", environ=env, margin_s=10, clock=Clock(0.0)) as s,
    ):
        assert s._stop_before_deadline == BeforeWalltime(margin_s=10.0)
    with Session(tmp_path / "ck2", environ={}, margin_s=10) as s:  # no deadline at all
        assert s._stop_before_deadline == BeforeWalltime(margin_s=10.0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_session_stopped_before_any_progress_records_why(tmp_path: Path) -> None:
    """The stop log tells `resilient run` that exit 1 was a stop before the first checkpoint."""
    root = tmp_path / "ck"
    env = {ENV_DEADLINE: "100"}
    with (
        pytest.raises(SystemExit) as exc_info,
        Session(root, environ=env, margin_s=10, clock=Clock(101.0)) as s,  # deadline passed
    ):
        s.restore_or(_state(0))
        assert s.should_stop() is True
    assert exc_info.value.code == 1
    (stop,) = logs.read_log(root / filenames.STOP_LOG, logs.STOPS)
    assert stop["saved"] is False and stop["step"] is None and stop["attempt"] is None
    assert (stop["margin_s"], stop["margin_used_s"], stop["time_left_at_start_s"]) == (10, 0, -1)
    assert "deadline" in stop["reason"]


def test_session_that_finishes_writes_no_stop_record(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Session(root, environ={ENV_DEADLINE: "3"}, margin_s=10, clock=Clock(0.0)) as s:
        s.restore_or(_state(0))
        assert s.should_stop() is False
        s.maybe_save(1, _state(1))
    assert not (root / filenames.STOP_LOG).exists()


def test_session_far_deadline_does_not_stop(tmp_path: Path) -> None:
    env = {ENV_DEADLINE: str(time.time() + 1000)}
    with Session(tmp_path / "ck", environ=env, margin_s=10) as s:
        assert s.should_stop() is False
        assert s.stop_reason == ""


def test_session_ignores_the_process_environment_when_given_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DEADLINE, str(time.time() + 5))
    with Session(tmp_path / "ck", environ={}, margin_s=60) as s:
        assert s.deadline is None and s.deadline_source == "none"
        assert s.should_stop() is False


def _loop_with_signal(
    s: Session, *, n_steps: int, signal_at: int, seen: list[int]
) -> tuple[int, dict[str, Any]]:
    step, state = s.restore_or({"x": np.zeros(16), "step": 0})
    while step < n_steps and not s.should_stop():
        step += 1
        state = _state(step)
        s.maybe_save(step, state)
        seen.append(step)
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
    return step, state


def test_session_sigusr1_final_checkpoint_and_exit_75(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    seen: list[int] = []
    with (
        pytest.raises(SystemExit) as exc_info,
        Session(root, environ={}, save_when=EverySteps(10)) as s,
    ):
        _loop_with_signal(s, n_steps=100, signal_at=13, seen=seen)
        assert s.stopped is True
        assert "SIGUSR1" in s.stop_reason
        assert not (root / "step_00000013").exists()  # not yet: written on leaving
    assert exc_info.value.code == EXIT_RESUME
    # no handler of the Session left; ignored from now on, as the program is about to exit (a
    # second warning must not kill it)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    last = seen[-1]
    assert 13 <= last < 20  # stopped at the next step (handlers run between bytecodes)
    with CheckpointManager(root) as m:
        assert m.latest_step() == last
        step, state = m.restore()
    assert step == last
    assert_state_equal(state, _state(last))
    assert (root / "step_00000010").is_dir()  # the regular save happened too


def test_session_exit_on_stop_false_does_not_raise(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    seen: list[int] = []
    with Session(root, environ={}, save_when=EverySteps(10), exit_on_stop=False) as s:
        _loop_with_signal(s, n_steps=100, signal_at=4, seen=seen)
    assert s.stopped is True
    with CheckpointManager(root) as m:
        assert m.latest_step() == seen[-1]


def test_session_on_signal_policy_saves_at_the_signalled_step(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    seen: list[int] = []
    with Session(root, environ={}, save_when=EverySteps(50) | OnSignal(), exit_on_stop=False) as s:
        _loop_with_signal(s, n_steps=100, signal_at=7, seen=seen)
    assert s.stopped
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert steps == [f"step_{seen[-1]:08d}"]  # saved by OnSignal; the exit found nothing new


def test_session_that_completes_exits_normally_with_a_final_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Session(root, environ={}, save_when=EverySteps(10)) as s:
        step, state = s.restore_or({"x": np.zeros(16), "step": 0})
        while step < 23 and not s.should_stop():
            step += 1
            state = _state(step)
            s.maybe_save(step, state)
    assert not s.stopped
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000010", "step_00000020", "step_00000023"]
    with Session(root, environ={}) as s2:
        step, state = s2.restore_or({"x": np.zeros(16), "step": 0})
        assert step == 23
        assert_state_equal(state, _state(23))


def test_session_restore_or_empty_and_after_save(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    initial = state_of(0)
    with Session(root, environ={}) as s:
        step, state = s.restore_or(initial)
        assert step == 0
        assert_state_equal(state, initial)
    with Session(tmp_path / "ck2", environ={}) as s:
        step, state = s.restore_or(lambda: state_of(0), static=static_of(1), step=4)
        assert step == 4
        assert_state_equal(state, {**state_of(0), **static_of(1)})
        s.save(5, {**state_of(5), **static_of(1)})  # static entries are stripped and shared
    with Session(tmp_path / "ck2", environ={}) as s:
        step, state = s.restore_or(initial, static=static_of(1))
        assert step == 5
        assert_state_equal(state, {**state_of(5), **static_of(1)})
