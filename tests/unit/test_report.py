"""resilient report: numbers from ledgers and logs (synthetic logs: pure logic), CLI and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.io import storage
from resilient.report import find_roots, format_table, task_report


def write_logs(root: Path) -> None:
    storage.ensure_root(root)
    attempts = [
        # killed at t=10 after reaching step 40; last checkpoint step 30 at t=8
        {"attempt": 1, "start": 0.0, "end": 10.0, "exit_code": 75, "reason": "walltime",
         "latest_before": None, "latest_after": 30, "slurm_job_id": "101"},
        # restores 30, reaches 55, killed; last checkpoint 50 at t=18
        {"attempt": 2, "start": 11.0, "end": 20.0, "exit_code": 75, "reason": "walltime",
         "latest_before": 30, "latest_after": 50, "slurm_job_id": "102"},
        {"attempt": 3, "start": 21.0, "end": 25.0, "exit_code": 0, "reason": "finished",
         "latest_before": 50, "latest_after": 70, "slurm_job_id": "103"},
    ]  # fmt: skip
    saves = [{"step": 10, "time": 3.0}, {"step": 30, "time": 8.0}, {"step": 50, "time": 18.0},
             {"step": 70, "time": 24.5}]  # fmt: skip
    progress = [{"time": 1.0, "step": 0}, {"time": 9.5, "step": 40}, {"time": 12.0, "step": 30},
                {"time": 19.5, "step": 55}, {"time": 22.0, "step": 50}, {"time": 24.9, "step": 70}]  # fmt: skip
    for name, rows in (
        ("attempts.jsonl", attempts),
        ("saves.jsonl", saves),
        ("progress.jsonl", progress),
    ):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")


def test_numbers(tmp_path: Path) -> None:
    write_logs(tmp_path / "task")
    t = task_report(tmp_path / "task")
    assert len(t.attempts) == 3 and t.kills == 2 and t.finished
    assert t.checkpoints_written == 4
    assert [a.max_step for a in t.attempts] == [40, 55, 70]
    assert t.steps_recomputed == (40 - 30) + (55 - 50)
    assert t.wall_spent_s == pytest.approx(10 + 9 + 4)
    assert t.wall_kept_s == pytest.approx(8 + 7 + 4)  # to the last checkpoint, whole final attempt
    assert t.goodput == pytest.approx(19 / 23)
    assert [a.slurm_job_id for a in t.attempts] == ["101", "102", "103"]
    text = format_table([t])
    assert "2 kills" in text and "15 steps recomputed" in text and "job 102" in text


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
    assert all(d["goodput"] == pytest.approx(19 / 23) for d in doc)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(tmp_path: Path) -> None:
    missing = subprocess.run([sys.executable, "-m", "resilient.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = subprocess.run([sys.executable, "-m", "resilient.cli", "report", str(tmp_path)],
                           capture_output=True, text=True)  # fmt: skip
    assert empty.returncode == 1 and "no checkpoint roots" in empty.stderr
