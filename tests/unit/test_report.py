"""resilient report: numbers from ledgers and logs (synthetic logs: pure logic), CLI and plot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.io import storage
from resilient.job.session import Session
from resilient.job.timeline import AttemptEvents, Phases, kept_until
from resilient.report import find_roots, format_table, task_report


def write_logs(root: Path, *, fallback: bool = False) -> None:
    """Three attempts of a task: two killed, one finished (``fallback``: the second one found
    step 30 corrupt and went on from step 10)."""
    storage.ensure_root(root)
    attempts = [
        {"attempt": 1, "start": 0.0, "end": 10.0, "exit_code": 75, "reason": "walltime",
         "latest_before": None, "latest_after": 30, "slurm_job_id": "101"},
        {"attempt": 2, "start": 11.0, "end": 20.0, "exit_code": 75, "reason": "walltime",
         "latest_before": 30, "latest_after": 50, "slurm_job_id": "102"},
        {"attempt": 3, "start": 21.0, "end": 25.0, "exit_code": 0, "reason": "finished",
         "latest_before": 50, "latest_after": 70, "slurm_job_id": "103"},
    ]  # fmt: skip
    saves = [{"step": 10, "time": 3.0}, {"step": 30, "time": 8.0}, {"step": 50, "time": 18.0},
             {"step": 70, "time": 24.6}]  # fmt: skip
    second = 10 if fallback else 30
    progress = [
        # attempt 1: starts at 1.0, saves 10 and 30, reaches 40, killed (SIGKILL: no end)
        {"time": 1.0, "step": 0, "event": "restored", "resumed": False},
        {"time": 3.0, "t0": 2.8, "step": 10, "event": "save"},
        {"time": 8.0, "t0": 7.8, "step": 30, "event": "save"},
        {"time": 9.5, "step": 40},
        # attempt 2: resumes (from 30, or 10 after quarantining 30), saves 50, reaches 55
        {"time": 12.0, "step": second, "event": "restored", "resumed": True,
         "passed_over": [30] if fallback else []},
        {"time": 18.0, "t0": 17.7, "step": 50, "event": "save"},
        {"time": 19.5, "step": 55},
        # attempt 3: resumes from 50, its loop ends at step 70 at 24.4, final save, end
        {"time": 22.0, "step": 50, "event": "restored", "resumed": True},
        {"time": 24.6, "t0": 24.4, "step": 70, "event": "save"},
        {"time": 24.8, "step": 70, "event": "end", "loop_end": 24.4, "stopped": False},
    ]  # fmt: skip
    for name, rows in (
        ("attempts.jsonl", attempts),
        ("saves.jsonl", saves),
        ("progress.jsonl", progress),
    ):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")


def test_numbers(tmp_path: Path) -> None:
    write_logs(tmp_path / "task")
    t = task_report(tmp_path / "task")
    assert len(t.attempts) == 3 and t.stops == 2 and t.kills == 0 and t.finished and t.timed
    assert [a.ending for a in t.attempts] == ["stop", "stop", "finished"]
    assert t.checkpoints_written == 4
    assert [a.max_step for a in t.attempts] == [40, 55, 70]
    assert t.steps_recomputed == (40 - 30) + (55 - 50)
    assert t.wall_spent_s == pytest.approx(10 + 9 + 4) and t.between_s == pytest.approx(2)
    one, two, three = (a.phases for a in t.attempts)
    # start-up to the restore; checkpoints held the loop; compute kept up to the step the
    # next attempt restored (30 at 7.8, 50 at 17.7), the rest lost; the last attempt keeps all
    assert astuple(one) == pytest.approx(astuple(Phases(1, 6.6, 2.0, 0.4, 0)))
    assert astuple(two) == pytest.approx(astuple(Phases(1, 5.7, 2.0, 0.3, 0)))
    assert three.startup_s == 1 and three.compute_lost_s == 0
    assert three.compute_kept_s == pytest.approx(2.4) and three.checkpoint_s == pytest.approx(0.4)
    assert three.exit_s == pytest.approx(0.2)
    for a in t.attempts:  # the parts add up to each attempt's wall time
        assert a.phases.total_s == pytest.approx(a.end - a.start)
    assert t.goodput == pytest.approx((6.6 + 5.7 + 2.4) / 25)
    text = format_table([t])
    assert text.startswith(f"{t.name}: 3 attempts (2 stops, 0 kills), 4 checkpoints written, ")
    assert "15 steps recomputed" in text and "job 102" in text
    assert "goodput 59%" in text and "between attempts 2.0 s" in text
    assert "finished (its last attempt exited 0)" in text


def test_a_fallback_keeps_only_what_the_run_went_on_from(tmp_path: Path) -> None:
    write_logs(tmp_path / "task", fallback=True)
    t = task_report(tmp_path / "task")
    one = t.attempts[0].phases
    assert one.compute_kept_s == pytest.approx(1.8)  # up to step 10 (2.8 s), not 30
    assert one.compute_lost_s == pytest.approx(8.6 - 1.8)
    assert t.attempts[1].restored_step == 10
    assert t.steps_recomputed == (40 - 10) + (55 - 50)


def test_a_task_still_running_keeps_what_its_next_attempt_went_on_from(tmp_path: Path) -> None:
    """Asked while attempt 3 runs (its ledger line not written yet, its saves already in the
    log): attempts 1 and 2 are judged as they were when attempt 2 ended."""
    root = tmp_path / "task"
    write_logs(root)
    lines = (root / "attempts.jsonl").read_text().splitlines()
    (root / "attempts.jsonl").write_text("\n".join(lines[:2]) + "\n")
    t = task_report(root)
    assert len(t.attempts) == 2 and not t.finished
    one, two = (a.phases for a in t.attempts)
    assert one.compute_kept_s == pytest.approx(6.6) and two.compute_kept_s == pytest.approx(5.7)
    assert t.goodput == pytest.approx((6.6 + 5.7) / 20)


def test_a_program_without_a_timeline_has_no_goodput(tmp_path: Path) -> None:
    write_logs(tmp_path / "task")
    (tmp_path / "task" / "progress.jsonl").unlink()
    t = task_report(tmp_path / "task")
    assert not t.timed and t.goodput is None and t.to_dict()["phases"] is None
    assert "goodput - (no timeline: the program does not use Session)" in format_table([t])


def test_kept_until_walks_back_from_the_end() -> None:
    events = [
        {"time": 1.0, "step": 0, "event": "restored", "resumed": False},
        {"time": 3.0, "t0": 2.0, "step": 10, "event": "save"},
        {"time": 12.0, "step": 10, "event": "restored", "resumed": True},  # no progress
        {"time": 22.0, "step": 10, "event": "restored", "resumed": True},
        {"time": 24.0, "step": 20, "event": "end", "loop_end": 23.0},
    ]
    attempts = [AttemptEvents.of(events, a, b) for a, b in ((0, 10), (11, 20), (21, 25))]
    assert kept_until(attempts, finished=True, committed=[10, 20]) == [2.0, None, 23.0]
    # not finished: the run goes on from its newest committed checkpoint (10)
    assert kept_until(attempts[:2], finished=False, committed=[10]) == [2.0, None]
    # a fresh start throws away what came before it
    fresh = [{**events[3], "resumed": False, "step": 0}, events[4]]
    again = [attempts[0], AttemptEvents.of(fresh, 21, 25)]
    assert kept_until(again, finished=True, committed=[10, 20]) == [None, 23.0]


def test_cli_json_and_plot(tmp_path: Path) -> None:
    write_logs(tmp_path / "campaign" / "heat" / "a")
    write_logs(tmp_path / "campaign" / "train")
    assert len(find_roots([tmp_path / "campaign"])) == 2
    png = tmp_path / "p.png"
    out = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "report", str(tmp_path / "campaign"), "--json", "--plot", str(png)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    doc = json.loads(out.stdout)
    assert {d["name"] for d in doc} == {"heat/a", "train"}  # as `resilient ls` names them
    assert all(d["stops"] == 2 and d["kills"] == 0 and d["finished"] for d in doc)
    assert all(d["goodput"] == pytest.approx(14.7 / 25) for d in doc)
    assert all(sum(d["phases"].values()) == pytest.approx(23) for d in doc)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(tmp_path: Path) -> None:
    missing = subprocess.run([sys.executable, "-m", "resilient.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = subprocess.run([sys.executable, "-m", "resilient.cli", "report", str(tmp_path)],
                           capture_output=True, text=True)  # fmt: skip
    assert empty.returncode == 1 and "no checkpoint roots" in empty.stderr


@pytest.mark.parametrize(
    ("status", "stop", "ending"),
    [
        (0, None, "finished"),
        (75, {"saved": True}, "stop"),
        (1, {"saved": False, "reason": "SIGUSR1"}, "stop"),  # stopped before its first checkpoint
        (-9, None, "kill"),  # SIGKILL after the grace, or from outside
        (-15, None, "kill"),
        (1, None, "kill"),  # a crash
        (139, None, "kill"),
        (74, None, "refused"),
        (78, None, "refused"),
    ],
)
def test_an_attempts_ending_is_a_stop_a_kill_or_neither(
    tmp_path: Path, status: int, stop: dict[str, object] | None, ending: str
) -> None:
    root = tmp_path / "task"
    storage.ensure_root(root)
    code = 75 if status in (-9, -15) else status  # a kill after progress exits 75 to the engine
    record = {"attempt": 1, "start": 0.0, "end": 1.0, "exit_code": code, "exit_status": status,
              "program_stop": stop, "reason": "r"}  # fmt: skip
    (root / "attempts.jsonl").write_text(json.dumps(record) + "\n")
    t = task_report(root)
    assert t.attempts[0].ending == ending
    assert (t.stops, t.kills) == ((ending == "stop") * 1, (ending == "kill") * 1)


def _session_loop(root: Path, steps: int, *, stop_at: int | None = None,
                  raise_at: int | None = None) -> None:  # fmt: skip
    """A program that uses Session and runs without `resilient run` (no ledger)."""
    with Session(root, environ={}) as s:
        step, state = s.restore_or({"x": np.zeros(2)})
        while step < steps and not s.should_stop():
            step += 1
            state["x"] += 1
            s.maybe_save(step, state)
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)  # a warning signal: stop at the next step
            if step == raise_at:
                raise RuntimeError("a bug")


def test_without_a_ledger_the_report_says_so_and_reads_finished_from_the_timeline(
    tmp_path: Path,
) -> None:
    done, stopped, failed, bare = (tmp_path / n for n in ("done", "stopped", "failed", "bare"))
    _session_loop(done, 5)
    with pytest.raises(SystemExit) as exit_75:
        _session_loop(stopped, 50, stop_at=3)
    assert exit_75.value.code == 75
    with pytest.raises(RuntimeError):
        _session_loop(failed, 50, raise_at=2)
    with CheckpointManager(bare) as m:
        m.save(1, {"x": np.zeros(2)})
    reports = {t.root: t for t in (task_report(r) for r in (done, stopped, failed, bare))}
    got = {root: (t.finished, t.finished_why) for root, t in reports.items()}
    assert got == {
        str(done): (True, "its last Session ended without a stop or an exception"),
        str(stopped): (False, "its last Session stopped early (a stop): run it again to resume"),
        str(failed): (False, "its last Session ended with an exception (RuntimeError)"),
        str(bare): (None, "no timeline either: the program does not use Session"),
    }
    for t in reports.values():
        assert t.attempts == () and t.goodput is None and (t.stops, t.kills) == (0, 0)
        line = format_table([t])
        assert line.startswith(
            f"{t.name}: no attempt ledger: the program did not run under `resilient run` (run "
            f"it as `resilient run --checkpoint-dir {t.root} -- PROGRAM...` to record its "
            "attempts, stops, kills and goodput); "
        )
        assert "no timeline: use Session" not in line and "goodput" in line
    assert format_table([reports[str(done)]]).endswith(
        "; finished (its last Session ended without a stop or an exception)"
    )
    assert format_table([reports[str(bare)]]).endswith(
        "; finished: unknown (no timeline either: the program does not use Session)"
    )
    # a Session that began again and has not ended (still running, or killed): unknown
    with (done / "progress.jsonl").open("a") as f:
        f.write(json.dumps({"time": 4e9, "step": 5, "event": "restored", "resumed": True}) + "\n")
    t = task_report(done)
    assert t.finished is None and t.finished_why == (
        "its last Session has no end in the timeline: still running, or killed"
    )


def test_a_timeline_written_before_the_raised_field_reads_as_unknown(tmp_path: Path) -> None:
    """An ``end`` event from before ``raised`` was recorded (older roots): the report says it
    cannot tell, and does not fail."""
    root = tmp_path / "old"
    _session_loop(root, 3)
    log = root / "progress.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e.get("event") == "end" and "raised" in e for e in lines)
    log.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "raised"}) + "\n"
                           for e in lines))  # fmt: skip
    t = task_report(root)
    assert (t.finished, t.finished_why) == (
        None, "its timeline does not say whether its last Session ended with an exception"
    )  # fmt: skip
    assert format_table([t]).endswith("; finished: unknown (its timeline does not say whether "
                                      "its last Session ended with an exception)")  # fmt: skip


@pytest.mark.parametrize(
    ("end", "finished"),
    [
        ({"stopped": False, "raised": None}, True),
        ({"stopped": True, "raised": None}, False),  # stopped early
        ({"stopped": False, "raised": "ValueError"}, False),
        ({"stopped": False}, False),  # an older end event: it does not say
    ],
)
def test_an_attempt_finished_when_its_sessions_loop_ended_on_its_own(
    end: dict[str, object], finished: bool
) -> None:
    events = [
        {"time": 1.0, "step": 0, "event": "restored", "resumed": False},
        {"time": 5.0, "step": 9, "event": "end", "loop_end": 4.9, **end},
    ]
    assert AttemptEvents.of(events, 0.0, 6.0).finished is finished
    assert not AttemptEvents.of(events, 5.5, 6.0).finished  # not in this attempt
