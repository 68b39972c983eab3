"""resilient report: numbers from ledgers and logs (synthetic logs: pure logic), CLI and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

import pytest

from resilient.io import storage
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
    assert len(t.attempts) == 3 and t.kills == 2 and t.finished and t.timed
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
    assert "2 kills" in text and "15 steps recomputed" in text and "job 102" in text
    assert "goodput 59%" in text and "between attempts 2.0 s" in text


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
    assert "goodput - (no timeline" in format_table([t])


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
    assert {d["name"] for d in doc} == {"a", "train"}
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
