"""``resilient run``: durations, signal specs, the exit-code table, real attempts, retry_io."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest.mock import ANY

import pytest

from resilient.errors import CollectiveError, CommitError, ConfigError, RankFailure
from resilient.io import logs, storage
from resilient.job import handoff
from resilient.job.exitcodes import EXIT_CONFIG, EXIT_NO_PROGRESS, EXIT_PERMANENT, EXIT_RESUME
from resilient.job.ledger import AttemptRecord, Where, read_ledger
from resilient.job.options import RunOptions, parse_duration, parse_signal_spec, task_label
from resilient.job.outcome import AttemptEnd, before_first_step, classify, say_startup
from resilient.job.protocol import ENV_ATTEMPT, ENV_DEADLINE, ENV_HANDOFF, program_stop
from resilient.job.run import run
from resilient.job.session import Session
from resilient.model import filenames
from tests.unit.ckutil import job_free_env

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("90s", 90.0),
        (" 90 s ", 90.0),
        ("1.5m", 90.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("1d", 86400.0),
        ("01:30:00", 5400.0),
        ("10:00", 600.0),
        ("0:05", 5.0),
        ("1-00:00:00", 86400.0),
        ("2-03:04:05", ((2 * 24 + 3) * 60 + 4) * 60 + 5.0),
        ("0", 0.0),
        ("23h50m", (23 * 60 + 50) * 60.0),
        ("1h30m", 5400.0),
        ("1h30m15s", 5415.0),
        ("2d4h", (2 * 24 + 4) * 3600.0),
        ("1d2h3m4s", ((24 + 2) * 60 + 3) * 60 + 4.0),
        ("1h 30m", 5400.0),
        ("5m30s", 330.0),
        ("1.5h30m", 7200.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "abc", "5x", "-5", "1.5.5", "1:2:3:4", "m", "5 minutes", "1-", ":30", "30m1h", "1h1h",
     "1hm", "h30m", "1h30", "1h-30m"],
)  # fmt: skip
def test_parse_duration_bad(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration") as err:
        parse_duration(text)
    for form in ("bare number of seconds", "23h50m", "HH:MM:SS", "D-HH:MM:SS"):
        assert form in str(err.value)


def test_parse_duration_does_not_misread_slurm_days_hours_minutes() -> None:
    # Bug: Slurm's --time accepts "days-hours:minutes" ("1-12:30" = 1 day 12 h 30 min), and
    # users copy it into `resilient run --walltime`. parse_duration's pattern
    # (?:(\d+)-)?(?:(\d+):)?(\d+):(\d+) reads it as 1 day + 12 min 30 s (87150 s) without a word.
    try:
        got = parse_duration("1-12:30")
    except ValueError:
        return  # refusing it is fine too
    assert got == (24 + 12) * 3600 + 30 * 60, f"'1-12:30' parsed as {got} s"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("USR1@30", (signal.SIGUSR1, 30.0)),
        ("SIGUSR2@1m", (signal.SIGUSR2, 60.0)),
        ("term@00:01:30", (signal.SIGTERM, 90.0)),
        (f"{int(signal.SIGUSR1)}@5", (signal.SIGUSR1, 5.0)),
    ],
)
def test_parse_signal_spec(text: str, want: tuple[signal.Signals, float]) -> None:
    assert parse_signal_spec(text) == want


@pytest.mark.parametrize("text", ["USR1", "USR1@", "NOPE@30", "USR1@soon", "@30", ""])
def test_parse_signal_spec_bad(text: str) -> None:
    with pytest.raises(ValueError):
        parse_signal_spec(text)


# --------------------------------------------------------------------------- the exit-code table


@pytest.mark.parametrize(
    ("status", "sent", "progress", "run_", "code", "words"),
    [
        (0, None, False, 0, 0, "finished"),
        (0, "SIGUSR1", True, 0, 0, "finished"),
        (EXIT_RESUME, None, True, 0, EXIT_RESUME, "stopped early"),
        (EXIT_RESUME, "SIGUSR1", True, 0, EXIT_RESUME, "stopped early"),
        # 75 promises progress: without a newer checkpoint it becomes a plain failure (1)
        (EXIT_RESUME, None, False, 1, 1, "no newer checkpoint"),  # below the limit
        (EXIT_RESUME, None, False, 2, 1, "no newer checkpoint"),
        (EXIT_RESUME, None, False, 3, EXIT_NO_PROGRESS, "no progress in 3"),  # at the limit
        (1, None, False, 3, EXIT_NO_PROGRESS, "no progress in 3"),
        (3, None, False, 4, EXIT_NO_PROGRESS, "crashed (exit 3)"),
        (-9, "SIGKILL", False, 3, EXIT_NO_PROGRESS, "killed (SIGKILL)"),
        (-15, None, False, 3, EXIT_NO_PROGRESS, "killed (SIGTERM)"),
        (-9, "SIGKILL", True, 0, EXIT_RESUME, "after a newer checkpoint"),
        (-9, None, True, 0, EXIT_RESUME, "killed (SIGKILL)"),  # killed by someone else
        (1, "SIGTERM", True, 0, EXIT_RESUME, "exited 1 after SIGTERM"),
        (-9, "SIGKILL", False, 1, 128 + 9, "killed (SIGKILL)"),
        (-9, None, False, 1, 128 + 9, "killed (SIGKILL)"),
        (-15, "SIGTERM", False, 2, 128 + 15, "killed (SIGTERM)"),
        (1, "SIGTERM", False, 1, 1, "exited 1 after SIGTERM"),
        (3, None, True, 0, 3, "crashed (exit 3)"),  # a crash with progress is still a crash
        (3, None, False, 1, 3, "crashed (exit 3)"),
        (EXIT_PERMANENT, None, False, 1, EXIT_PERMANENT, "permanent storage error"),
        (EXIT_PERMANENT, None, False, 5, EXIT_PERMANENT, "permanent storage error"),
        (EXIT_PERMANENT, None, True, 0, EXIT_PERMANENT, "permanent storage error"),
    ],
)
def test_classify(
    status: int, sent: str | None, progress: bool, run_: int, code: int, words: str
) -> None:
    reason, got = classify(
        AttemptEnd(
            status=status, sent=sent, progress=progress, no_progress_run=run_, max_no_progress=3
        )
    )
    assert got == code
    assert words in reason


def stop_record(**kw: object) -> dict[str, object]:
    """A Session's stop record (``stops.jsonl``) for a stop before the first checkpoint."""
    rec: dict[str, object] = {
        "time": 0.0,
        "attempt": 1,
        "step": None,
        "reason": "deadline in 1 s",
        "saved": False,
        "margin_s": 10.0,
        "margin_used_s": 1.2,
        "time_left_at_start_s": 2.4,
        "deadline_source": ENV_DEADLINE,
    }
    rec.update(kw)
    return rec


FIRST = "stopped before its first checkpoint"
SHORT = f"{FIRST}: walltime 3 s is shorter than the program's stop margin 10 s (2.4 s left"


@pytest.mark.parametrize(
    ("status", "sent", "run_", "stop", "code", "words"),
    [
        (1, None, 1, stop_record(), 1, SHORT),
        (1, None, 2, stop_record(), 1, SHORT),
        (1, None, 3, stop_record(), EXIT_NO_PROGRESS, SHORT),  # it counts: no endless loop
        (1, "SIGUSR1", 1, stop_record(reason="signal SIGUSR1"), 1, "started; signal SIGUSR1)"),
        (1, "SIGTERM", 1, stop_record(), 1, SHORT),  # it stopped on its own, not "after SIGTERM"
        (1, None, 1, stop_record(time_left_at_start_s=30.0), 1, f"{FIRST} (deadline in 1 s)"),
        (1, None, 1, stop_record(time_left_at_start_s=-2.0), 1, "deadline had passed"),
        (1, None, 1, stop_record(saved=True), 1, "crashed (exit 1)"),  # not what Session does
        # torchrun (under srun) after its workers stopped on Slurm's signal, checkpointed, exited 75
        (1, None, 0, stop_record(saved=True, reason="signal SIGUSR1"), EXIT_RESUME,
         "exited 1 after its Session's stop (signal SIGUSR1) after a newer checkpoint"),
        (138, None, 0, stop_record(saved=True, reason="signal SIGUSR1"), EXIT_RESUME,
         "exited 138 after its Session's stop"),
        (1, None, 1, stop_record(margin_s="?"), 1, f"{FIRST} (deadline in 1 s)"),
        (3, None, 1, None, 3, "crashed (exit 3)"),
        (-9, "SIGKILL", 1, stop_record(), 128 + 9, "killed (SIGKILL)"),  # died, did not stop
        (EXIT_RESUME, None, 0, stop_record(saved=True), EXIT_RESUME, "stopped early"),
    ],
)
def test_classify_a_stop_before_the_first_checkpoint(
    status: int,
    sent: str | None,
    run_: int,
    stop: dict[str, object] | None,
    code: int,
    words: str,
) -> None:
    progress = status == EXIT_RESUME or code == EXIT_RESUME
    reason, got = classify(
        AttemptEnd(
            status=status,
            sent=sent,
            progress=progress,
            no_progress_run=run_,
            max_no_progress=3,
            stop=stop,
            walltime_s=3.0,
        )
    )
    assert got == code
    assert words in reason, reason
    assert ("crashed" in reason) is (words == "crashed (exit 1)" or status == 3)


@pytest.mark.parametrize(
    ("status", "progress", "finished", "run_", "code", "words"),
    [
        # srun torchrun: Slurm's signal reached the agent as its workers finished the run
        (1, True, True, 0, EXIT_RESUME,
         "exited 1 after its Session finished its loop and saved its last step"),
        (1, True, False, 0, 1, "crashed (exit 1)"),  # the loop did not end on its own
        (1, False, True, 1, 1, "crashed (exit 1)"),  # nothing new saved: no retry for free
        (1, False, True, 2, EXIT_NO_PROGRESS, "crashed (exit 1)"),  # a failure after the loop
        (0, True, True, 0, 0, "finished"),
    ],
)  # fmt: skip
def test_classify_a_nonzero_exit_after_the_sessions_loop_finished(
    status: int, progress: bool, finished: bool, run_: int, code: int, words: str
) -> None:
    reason, got = classify(
        AttemptEnd(
            status=status,
            progress=progress,
            finished=finished,
            no_progress_run=run_,
            max_no_progress=2,
        )
    )
    assert (reason, got) == (reason, code)
    assert words in reason, reason


def test_classify_a_slow_start_in_a_long_enough_walltime_says_so() -> None:
    """4 s of walltime, a 2-s margin, a start that took 3.4 s: not a walltime too short."""
    stop = stop_record(margin_s=2.0, time_left_at_start_s=0.6)
    reason, code = classify(
        AttemptEnd(
            status=1,
            sent=None,
            progress=False,
            no_progress_run=1,
            max_no_progress=3,
            stop=stop,
            walltime_s=4.0,
        )
    )
    assert code == 1
    assert reason.startswith(
        f"{FIRST}: it started 3.4 s into its walltime of 4 s, leaving 0.6 s, less than the "
        "program's stop margin 2 s"
    ), reason


def test_classify_without_walltime_names_the_time_left_at_the_start() -> None:
    reason, _ = classify(
        AttemptEnd(
            status=1,
            sent=None,
            progress=False,
            no_progress_run=1,
            max_no_progress=3,
            stop=stop_record(),
            walltime_s=None,
        )
    )
    assert reason.startswith(f"{FIRST}: walltime 2.4 s is shorter than the program's stop margin")


def test_program_stop_takes_this_attempts_record(tmp_path: Path) -> None:
    storage.ensure_root(tmp_path)
    for rec in (
        stop_record(time=5.0, attempt=1, reason="before the attempt"),
        stop_record(time=15.0, attempt=1, reason="this one"),
        stop_record(time=16.0, attempt=7, reason="another attempt numbering"),
        stop_record(time=25.0, attempt=1, reason="after the attempt"),
    ):
        logs.append_record(tmp_path / filenames.STOP_LOG, rec)
    got = program_stop(tmp_path, attempt=1, start=10.0, end=20.0)
    assert got is not None and got["reason"] == "this one"
    assert program_stop(tmp_path, attempt=2, start=10.0, end=14.0) is None
    assert program_stop(None, attempt=1, start=0.0, end=1e12) is None
    assert program_stop(tmp_path / "missing", attempt=1, start=0.0, end=1e12) is None


# --------------------------------------------------------------------------- real attempts


clean_env = job_free_env


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", textwrap.dedent(code))


SAVE_AND_RESUME = py(
    """
    import os, sys
    import numpy as np
    from resilient import CheckpointManager
    step = int(os.environ["STEP"])
    with CheckpointManager(os.environ["RESILIENT_CHECKPOINT_DIR"]) as m:
        m.save(step, {"x": np.arange(4.0) * step})
    sys.exit(75)
    """
)


def test_run_program_that_checkpoints_and_exits_75(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    opts = RunOptions(command=SAVE_AND_RESUME, checkpoint_dir=ck)
    assert run(opts, environ=clean_env(STEP="5")) == EXIT_RESUME
    ledger = read_ledger(ck)
    assert len(ledger) == 1
    rec = ledger[0]
    assert rec["progress"] is True
    assert (rec["attempt"], rec["exit_status"], rec["exit_code"]) == (1, 75, 75)
    assert (rec["latest_before"], rec["latest_after"]) == (None, 5)
    assert rec["signal"] is None
    assert "stopped early" in rec["reason"]
    assert rec["command"] == list(SAVE_AND_RESUME)
    assert rec["end"] >= rec["start"]

    # the same step again: no progress, still below the limit -> a failure (1), not 75
    assert run(opts, environ=clean_env(STEP="5")) == 1
    rec = read_ledger(ck)[-1]
    assert rec["attempt"] == 2 and rec["progress"] is False and rec["exit_code"] == 1
    assert (rec["latest_before"], rec["latest_after"]) == (5, 5)

    assert run(opts, environ=clean_env(STEP="9")) == EXIT_RESUME
    assert read_ledger(ck)[-1]["progress"] is True


SESSION_LOOP = py(
    """
    import numpy as np
    from resilient.model.policies import EverySteps
    from resilient.job.session import Session
    with Session(margin_s=10, save_when=EverySteps(1000)) as s:  # the root comes from run
        step, state = s.restore_or({"x": np.zeros(4)})
        while step < 10**9 and not s.should_stop():
            step += 1
            s.maybe_save(step, state)
    """
)


def test_run_reports_a_stop_before_the_first_checkpoint(tmp_path: Path) -> None:
    """A Session that stops before any step (the deadline has passed) exits 1: not a crash."""
    ck = tmp_path / "ck"
    opts = RunOptions(
        command=SESSION_LOOP, checkpoint_dir=ck, retries=2, backoff_s=0.01, max_no_progress=3
    )
    env = clean_env(**{ENV_DEADLINE: str(time.time() - 1.0)})
    assert run(opts, environ=env) == 1
    (rec,) = read_ledger(ck)  # --retries does not relaunch it: it stopped, it did not crash
    assert rec["reason"].startswith("stopped before its first checkpoint: the deadline had passed")
    assert "crashed" not in rec["reason"]
    assert rec["progress"] is False and rec["exit_status"] == 1
    stop = rec["program_stop"]
    assert stop["attempt"] == 1 and stop["saved"] is False and stop["margin_s"] == 10
    assert run(opts, environ=env) == 1
    assert run(opts, environ=env) == EXIT_NO_PROGRESS  # it counts towards the limit
    assert all(FIRST in r["reason"] for r in read_ledger(ck))


def test_run_does_not_relaunch_a_program_that_stopped_on_request(tmp_path: Path) -> None:
    """--retries relaunches crashes; a stop request is not one. One that came before the first
    step takes effect after it (the session saves it): exit 75, not 1 without progress."""
    ck = tmp_path / "ck"
    prog = py(
        """
        import os, signal
        import numpy as np
        from resilient.job.session import Session
        with Session(margin_s=10) as s:
            step, state = s.restore_or({"x": np.zeros(4)})
            os.kill(os.getpid(), signal.SIGUSR1)  # as if sent by scancel --signal=USR1
            while not s.should_stop():
                step += 1
                s.maybe_save(step, state)
        """
    )
    opts = RunOptions(command=prog, checkpoint_dir=ck, retries=2, backoff_s=0.01)
    assert run(opts, environ=clean_env()) == EXIT_RESUME
    (rec,) = read_ledger(ck)
    assert rec["reason"] == "stopped early (checkpointed and exited 75)"
    assert rec["latest_after"] == 1 and rec["program_stop"]["reason"] == "signal SIGUSR1"
    assert rec["program_stop"]["time_left_at_start_s"] is None  # no deadline known


def test_run_no_progress_limit_gives_93(tmp_path: Path) -> None:
    ck, starts = tmp_path / "ck", tmp_path / "starts"
    prog = py(f"open({str(starts)!r}, 'a').write('x'); import sys; sys.exit(75)")
    opts = RunOptions(command=prog, checkpoint_dir=ck, max_no_progress=2)
    assert run(opts, environ=clean_env()) == 1  # 75 without a newer checkpoint
    assert run(opts, environ=clean_env()) == EXIT_NO_PROGRESS
    assert [r["exit_code"] for r in read_ledger(ck)] == [1, 93]
    # an engine's retry of that run (here a requeued Slurm job) does not start the program
    retry = clean_env(SLURM_JOB_ID="77", SLURM_RESTART_COUNT="1")
    assert run(opts, environ=retry) == EXIT_NO_PROGRESS
    assert starts.read_text() == "xx" and len(read_ledger(ck)) == 2
    # a run started anew (by hand: no engine retries it) starts the program again, counting
    # its attempts without progress from 1
    assert run(opts, environ=clean_env()) == 1
    last = read_ledger(ck)[-1]
    assert starts.read_text() == "xxx" and last["new_run"].startswith("started anew")
    assert run(opts, environ=clean_env()) == EXIT_NO_PROGRESS
    # and a changed command is a new run even for an engine's retry
    changed = RunOptions(command=(*prog, "--fixed"), checkpoint_dir=ck, max_no_progress=2)
    assert run(changed, environ=retry) == 1
    assert "the command or a program file changed" in read_ledger(ck)[-1]["new_run"]


STUBBORN = py(
    """
    import signal, time
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(30)
    """
)


def test_walltime_escalates_to_sigkill(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    opts = RunOptions(command=STUBBORN, checkpoint_dir=ck, walltime_s=1.5, kill_wait_s=0.5)
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    code = run(opts, environ=clean_env())
    elapsed = time.monotonic() - t0
    assert code == 128 + signal.SIGKILL
    assert 1.9 <= elapsed < 10.0  # deadline 1.5 s + kill-wait 0.5 s; a behaviour bound
    rec = read_ledger(ck)[-1]
    assert rec["exit_status"] == -signal.SIGKILL
    assert rec["signal"] == "SIGKILL"
    assert "SIGKILL" in rec["reason"]
    assert rec["progress"] is False
    assert {s: signal.getsignal(s) for s in before} == before  # run() restored our handlers


def test_run_program_that_finishes(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    assert run(RunOptions(command=py("pass"), checkpoint_dir=ck), environ=clean_env()) == 0
    rec = read_ledger(ck)[-1]
    assert (rec["exit_status"], rec["exit_code"], rec["reason"]) == (0, 0, "finished")


def test_run_passes_a_crash_through(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    code = run(
        RunOptions(command=py("import sys; sys.exit(3)"), checkpoint_dir=ck), environ=clean_env()
    )
    assert code == 3
    assert "crashed (exit 3)" in read_ledger(ck)[-1]["reason"]


def test_attempt_number_and_environment(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    out = tmp_path / "seen.txt"
    prog = py(
        f"""
        import os
        with open({str(out)!r}, "a") as fh:
            fh.write(" ".join([os.environ["RESILIENT_ATTEMPT"],
                               os.environ["RESILIENT_CHECKPOINT_DIR"],
                               os.environ.get("RESILIENT_DEADLINE", "-")]) + "\\n")
        """
    )
    assert run(RunOptions(command=prog, checkpoint_dir=ck), environ=clean_env()) == 0
    t0 = time.time()
    assert (
        run(RunOptions(command=prog, checkpoint_dir=ck, walltime_s=600), environ=clean_env()) == 0
    )
    lines = [line.split() for line in out.read_text().splitlines()]
    assert [line[0] for line in lines] == ["1", "2"]
    assert {line[1] for line in lines} == {str(ck)}
    assert lines[0][2] == "-"  # no deadline anywhere
    assert t0 + 590 < float(lines[1][2]) < time.time() + 600.5  # --walltime exports a deadline
    assert [r["attempt"] for r in read_ledger(ck)] == [1, 2]


@pytest.mark.parametrize("extra", [[], ["--"]])
def test_cli_run_without_a_command_is_a_usage_error(tmp_path: Path, extra: list[str]) -> None:
    ck = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ck), *extra],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no command given" in proc.stderr
    assert not (ck / "attempts.jsonl").exists()


def test_cli_run_takes_compound_durations_and_lists_the_forms_of_a_bad_one(
    tmp_path: Path,
) -> None:
    ck = tmp_path / "ck"
    out = tmp_path / "deadline"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['RESILIENT_DEADLINE'])"

    def cli_run(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ck), *options,
             "--", sys.executable, "-c", code],
            capture_output=True, text=True, env=clean_env(), timeout=60, check=False,
        )  # fmt: skip

    t0 = time.time()
    ok = cli_run("--walltime", "23h50m", "--signal", "USR1@1m30s", "--kill-wait", "1m")
    assert ok.returncode == 0, ok.stderr
    walltime = (23 * 60 + 50) * 60
    assert t0 + walltime - 60 < float(out.read_text()) < time.time() + walltime
    for option, value in (("--walltime", "5x"), ("--kill-wait", "1h30"), ("--signal", "USR1@x")):
        bad = cli_run(option, value)
        assert bad.returncode == 2, bad.stderr
        assert f"argument {option}: not a duration: " in bad.stderr, bad.stderr
        assert "invalid" not in bad.stderr and "Traceback" not in bad.stderr
        for form in ("bare number of seconds", "90s", "23h50m", "HH:MM:SS", "D-HH:MM:SS"):
            assert form in bad.stderr, bad.stderr
    no_at = cli_run("--signal", "USR1")
    assert no_at.returncode == 2 and "argument --signal: not SIG@SECONDS: 'USR1'" in no_at.stderr


def test_task_label() -> None:
    cmd = ("/usr/bin/python3", "x.py")
    assert task_label(RunOptions(command=cmd, task="sim case=a", checkpoint_dir=Path("c"))) == (
        "sim case=a"
    )
    assert task_label(RunOptions(command=cmd, task="sim\ncase=a  n=1")) == "sim case=a n=1"
    deep = Path("/ck/sim/a-0123456789ab")
    assert task_label(RunOptions(command=cmd, checkpoint_dir=deep)) == "sim/a-0123456789ab"
    assert task_label(RunOptions(command=cmd, task=" ", checkpoint_dir=deep)) == (
        "sim/a-0123456789ab"
    )
    assert task_label(RunOptions(command=cmd, checkpoint_dir=Path("/ck"))) == "/ck"
    assert task_label(RunOptions(command=cmd), pid=42) == "python3 pid 42"


@pytest.mark.parametrize(
    ("task", "label"), [(None, "sim/a-0123456789ab"), ("sim case=a%b,n=1", "sim case=a%b,n=1")]
)
def test_every_line_names_the_task(tmp_path: Path, task: str | None, label: str) -> None:
    ck = tmp_path / "sim" / "a-0123456789ab"
    args = ["--task", task] if task else []
    code = "import sys; sys.exit(3)"
    proc = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ck), *args,
         "--retries", "1", "--backoff", "0.01", "--max-no-progress", "3", "--",
         sys.executable, "-c", code],
        capture_output=True, text=True, env=clean_env(), timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, lines  # attempt 1, the retry warning, attempt 2
    assert all(line.startswith(f"resilient run [{label}]: ") for line in lines), lines
    assert lines[-1] == (
        f"resilient run [{label}]: attempt 2: crashed (exit 3); started from scratch; newest "
        "step to resume from now None; exit 3"
    )


# --------------------------------------------------------------------------- retry_io


def test_retry_io_retries_transient_errors() -> None:
    calls: list[int] = []
    cleanups: list[int] = []
    sleeps: list[float] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise OSError(errno.EIO, "Input/output error")
        return "value"

    got = storage.retry_io(
        fn, what="writing x", cleanup=lambda: cleanups.append(1), sleep=sleeps.append
    )
    assert got == "value"
    assert len(calls) == 3
    assert len(cleanups) == 2
    assert len(sleeps) == 2
    assert 0 < sleeps[0] < sleeps[1]


def test_retry_io_gives_up_after_attempts() -> None:
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        raise OSError(errno.ESTALE, "Stale file handle")

    with pytest.raises(OSError) as exc_info:
        storage.retry_io(fn, what="reading", attempts=3, sleep=lambda s: None)
    assert exc_info.value.errno == errno.ESTALE
    assert len(calls) == 3


def test_retry_io_permanent_error_at_once() -> None:
    calls: list[int] = []
    cleanups: list[int] = []
    sleeps: list[float] = []

    def fn() -> None:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as exc_info:
        storage.retry_io(
            fn,
            what="writing rank_00000.h5",
            cleanup=lambda: cleanups.append(1),
            sleep=sleeps.append,
        )
    assert len(calls) == 1
    assert cleanups == [] and sleeps == []
    assert exc_info.value.errno == errno.ENOSPC
    msg = str(exc_info.value)
    assert "permanent: not retried" in msg
    assert "writing rank_00000.h5" in msg
    assert storage.is_permanent_storage_error(exc_info.value)


def test_retry_io_other_errors_are_not_retried() -> None:
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        raise ValueError("bad")

    with pytest.raises(ValueError):
        storage.retry_io(fn, what="x", sleep=lambda s: None)
    assert len(calls) == 1


def test_is_transient() -> None:
    assert storage.is_transient(OSError(errno.EIO, "x"))
    assert storage.is_transient(OSError(errno.ESTALE, "x"))
    assert not storage.is_transient(OSError(errno.ENOSPC, "x"))
    assert not storage.is_transient(ValueError("x"))


def test_is_permanent_storage_error() -> None:
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
        assert storage.is_permanent_storage_error(OSError(code, os.strerror(code)))
    assert not storage.is_permanent_storage_error(OSError(errno.EIO, "x"))
    assert not storage.is_permanent_storage_error(RuntimeError("disk full?"))
    full = CollectiveError(
        "save of step 3",
        {0: "ok?", 2: RankFailure(2, "OSError: No space left on device", errno.ENOSPC)},
    )
    assert storage.is_permanent_storage_error(full)
    io = CollectiveError("save of step 3", {1: RankFailure(1, "OSError: I/O", errno.EIO)})
    assert not storage.is_permanent_storage_error(io)
    # errnos travel as data: a message that merely looks like one is not parsed
    lookalike = CollectiveError("save", {1: "OSError: [Errno 13] Permission denied"})
    assert not storage.is_permanent_storage_error(lookalike)
    assert storage.is_permanent_storage_error(CommitError("commit failed", errno.EROFS))
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("commit failed") from inner
    except RuntimeError as outer:
        assert storage.is_permanent_storage_error(outer)


# --------------------------------------------------------------------------- the hand-off (issue 44)


def test_the_hand_off_round_trip_and_what_is_not_one(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    assert handoff.read(path) is None  # not told
    handoff.record(path, tmp_path / "ck", attempt=3, now=12.5)
    told = handoff.read(path)
    assert told == handoff.HandOff(root=tmp_path / "ck", time=12.5, attempt=3)
    handoff.record(path, None, attempt=None, now=13.0)  # a Session without a directory
    assert handoff.read(path) == handoff.HandOff(root=None, time=13.0)
    for bad in (b"", b"\xff\xfe", b"[1]", b'{"root": "rel/ative", "time": 1}',
                b'{"root": "/x", "time": true}', b'{"root": 5, "time": 1}'):  # fmt: skip
        path.write_bytes(bad)
        assert handoff.read(path) is None, bad


def test_the_hand_off_of_a_checkpoint_dir_lies_beside_it(tmp_path: Path) -> None:
    assert handoff.beside(tmp_path / "ckpt" / "hot") == tmp_path / "ckpt" / ".hot.resilient-handoff"


def test_a_tasks_own_directory_is_keyed_by_where_and_what_it_runs(tmp_path: Path) -> None:
    env = {"RESILIENT_STATE_DIR": str(tmp_path)}
    one = handoff.task_dir(env, cwd="/a", command=["python", "x.py"], task=None)
    assert one.parent == tmp_path / "tasks"
    assert one == handoff.task_dir(env, cwd="/a", command=["python", "x.py"], task=None)
    others = {
        handoff.task_dir(env, cwd="/b", command=["python", "x.py"], task=None),
        handoff.task_dir(env, cwd="/a", command=["python", "y.py"], task=None),
        handoff.task_dir(env, cwd="/a", command=["python", "x.py"], task="sim case=a"),
    }
    assert one not in others and len(others) == 3
    assert handoff.state_dir({"XDG_STATE_HOME": "/s"}) == Path("/s/resilient")
    assert handoff.state_dir({"HOME": "/h"}) == Path("/h/.local/state/resilient")


@pytest.mark.parametrize(
    ("session", "words"),
    [
        (True, "ended before its first step: start-up took over 8.2 s of the 8 s walltime"),
        (False, "ended before a first step was recorded: start-up took over 8.2 s of the 8 s"),
    ],
)
def test_an_attempt_the_walltime_ended_before_its_first_step_says_so(
    session: bool, words: str
) -> None:
    first = before_first_step(8.2, 8.0, session=session)
    assert first is not None and first.startswith(words), first
    assert before_first_step(8.2, None, session=session) is None  # no walltime of its own
    reason, code = classify(
        AttemptEnd(
            status=-15,
            sent="SIGTERM",
            progress=False,
            no_progress_run=1,
            max_no_progress=2,
            before_first_step=first,
        )
    )
    assert reason == f"{first}; killed (SIGTERM)" and code == 128 + 15
    reason, code = classify(
        AttemptEnd(
            status=-9,
            sent="SIGKILL",
            progress=False,
            no_progress_run=2,
            max_no_progress=2,
            before_first_step=first,
        )
    )
    assert reason.startswith(first) and code == EXIT_NO_PROGRESS
    # killed from outside, not by the walltime: said as such
    reason, _ = classify(
        AttemptEnd(
            status=-9,
            sent=None,
            progress=False,
            no_progress_run=1,
            max_no_progress=2,
            outside="SIGKILL",
            before_first_step=first,
        )
    )
    assert reason.startswith("killed from outside")


def test_a_session_under_resilient_run_tells_it_its_directory(tmp_path: Path) -> None:
    told = tmp_path / "handoff.json"
    env = {ENV_HANDOFF: str(told), ENV_ATTEMPT: "2"}
    with Session(tmp_path / "ck", environ=env) as s:
        s.restore_or({"x": 0})
    assert handoff.read(told) == handoff.HandOff(root=tmp_path / "ck", time=ANY, attempt=2)


def test_a_session_without_a_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Outside `resilient run`: a ConfigError. Under it: one line, the wrapper told, exit 78."""
    with pytest.raises(ConfigError, match="no checkpoint directory given"):
        Session(environ={})
    told = tmp_path / "handoff.json"
    with pytest.raises(SystemExit) as exc:
        Session(environ={ENV_HANDOFF: str(told)})
    assert exc.value.code == EXIT_CONFIG
    assert [r.levelname for r in caplog.records if "no checkpoint directory" in r.message] == [
        "ERROR"
    ]
    assert "--checkpoint-dir DIR" in caplog.text
    got = handoff.read(told)
    assert got is not None and got.root is None


def test_the_first_attempt_warns_below_five_start_ups_of_compute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="resilient.job.run")
    where = Where(given=None)
    say_startup(where, AttemptRecord(attempt=1, start=0.0, startup_s=1.0), 6.0, False)
    assert not caplog.records  # 5 s of compute: five start-ups
    where = Where(given=None)
    say_startup(where, AttemptRecord(attempt=1, start=0.0, startup_s=1.25), 6.0, False)
    say_startup(where, AttemptRecord(attempt=2, start=0.0, startup_s=1.25), 6.0, False)
    (said,) = [r.getMessage() for r in caplog.records]  # once
    assert "took 1.2 s of the 6 s walltime" in said and "at least 7.5 s" in said, said
    caplog.clear()
    where = Where(given=None)
    say_startup(where, AttemptRecord(attempt=1, start=0.0), None, True)  # no walltime: none
    say_startup(where, AttemptRecord(attempt=1, start=0.0), 8.0, True)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "did not reach its first step within its 8 s walltime" in said


def test_the_ledger_moves_from_the_tasks_directory_to_the_programs(tmp_path: Path) -> None:
    """Attempts before the Session named its directory are kept in the task's own; once it
    did, they go after the records there, renumbered, and the task's own ledger is gone."""
    own, mine = tmp_path / "own", tmp_path / "mine"
    own.mkdir()
    mine.mkdir()
    where = Where(given=None, own=own)
    for n in (1, 2):
        where.append(AttemptRecord(attempt=n, start=float(n), reason=f"before {n}"))
    logs.append_record(
        mine / filenames.ATTEMPT_LEDGER, {"attempt": 1, "exit_code": 75, "reason": "earlier"}
    )
    assert len(read_ledger(own)) == 2 and where.ledger_dir == own
    where.program = mine
    record = AttemptRecord(attempt=3, start=3.0, reason="now")
    where.append(record)
    assert [(r["attempt"], r["reason"]) for r in read_ledger(mine)] == [
        (1, "earlier"), (2, "before 1"), (3, "before 2"), (4, "now"),
    ]  # fmt: skip
    assert record.attempt == 4 and not (own / filenames.ATTEMPT_LEDGER).exists()
    assert [r["reason"] for r in where.mine] == ["before 1", "before 2", "now"]
