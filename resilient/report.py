"""Run reports from the logs a checkpoint root keeps: attempts, kills, recomputation, goodput.

Reads, per checkpoint root: ``attempts.jsonl`` (one line per ``resilient run`` attempt),
``saves.jsonl`` (one line per committed checkpoint) and ``progress.jsonl`` ((time, step)
samples from :class:`~resilient.job.session.Session`). No MPI, no h5py.

Definitions:

* *kills*: attempts that ended early (exit 75, or killed by a signal) — walltime, preemption.
* *steps recomputed*: for each attempt after the first, the highest step the previous attempt
  reached minus the step this attempt restored (work lost between the last checkpoint and the
  kill).
* *goodput*: wall time kept as progress / wall time spent in attempts. An attempt keeps the time
  from its start to its last committed checkpoint (to its end when it finished); the rest
  (work after the last checkpoint, the kill) is lost.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilient.io import storage
from resilient.model import filenames

__all__ = ["AttemptSummary", "TaskReport", "find_roots", "format_table", "plot", "task_report"]


@dataclass(frozen=True, slots=True)
class AttemptSummary:
    """One attempt of a task as the report shows it."""

    attempt: int
    start: float
    end: float
    exit_code: int
    reason: str
    restored_step: int | None
    latest_after: int | None
    max_step: int | None
    checkpoints: int
    slurm_job_id: str | None


@dataclass(frozen=True, slots=True)
class TaskReport:
    """Everything the report says about one checkpoint root."""

    name: str
    root: str
    attempts: tuple[AttemptSummary, ...]
    kills: int
    checkpoints_written: int
    steps_recomputed: int
    wall_spent_s: float
    wall_kept_s: float
    finished: bool
    progress: tuple[tuple[float, int], ...] = field(default=())
    flush_s: tuple[float, ...] = ()  # seconds each flush from a node-local tier took

    @property
    def goodput(self) -> float | None:
        """Share of attempt wall time kept as progress (``None`` without attempts)."""
        return self.wall_kept_s / self.wall_spent_s if self.wall_spent_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["goodput"] = self.goodput
        doc.pop("progress")
        return doc


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def task_report(root: str | os.PathLike[str], *, name: str | None = None) -> TaskReport:
    """The report of one checkpoint root (a task)."""
    r = Path(root)
    attempts_raw = storage.read_jsonl(r / filenames.ATTEMPT_LEDGER)
    saves = [s for s in storage.read_jsonl(r / filenames.SAVE_LOG) if _num(s, "time") is not None]
    progress = sorted(
        (float(p["time"]), int(p["step"]))
        for p in storage.read_jsonl(r / filenames.PROGRESS_LOG)
        if _num(p, "time") is not None and isinstance(p.get("step"), int)
    )
    attempts: list[AttemptSummary] = []
    spent = kept = 0.0
    recomputed = 0
    prev_max: int | None = None
    for rec in attempts_raw:
        start, end = _num(rec, "start"), _num(rec, "end")
        if start is None or end is None:
            continue
        code = int(rec.get("exit_code", rec.get("exit_status", 1)) or 0)
        inside = [s for s in saves if start <= float(s["time"]) <= end]
        steps_seen = [st for t, st in progress if start <= t <= end]
        steps_seen += [int(s["step"]) for s in inside if isinstance(s.get("step"), int)]
        after = rec.get("latest_after") if isinstance(rec.get("latest_after"), int) else None
        before = rec.get("latest_before") if isinstance(rec.get("latest_before"), int) else None
        if after is not None:
            steps_seen.append(after)
        max_step = max(steps_seen) if steps_seen else None
        if prev_max is not None:
            recomputed += max(0, prev_max - (before or 0))
        prev_max = max_step
        spent += end - start
        if code == 0:
            kept += end - start
        elif inside:
            kept += max(float(s["time"]) for s in inside) - start
        attempts.append(
            AttemptSummary(
                attempt=int(rec.get("attempt", len(attempts) + 1)), start=start, end=end,
                exit_code=code, reason=str(rec.get("reason", "")), restored_step=before,
                latest_after=after, max_step=max_step, checkpoints=len(inside),
                slurm_job_id=rec.get("slurm_job_id") if isinstance(rec.get("slurm_job_id"), str) else None,
            )
        )  # fmt: skip
    return TaskReport(
        name=name or r.name,
        root=str(r),
        attempts=tuple(attempts),
        kills=sum(1 for a in attempts if a.exit_code != 0),
        checkpoints_written=len(saves),
        steps_recomputed=recomputed,
        wall_spent_s=spent,
        wall_kept_s=kept,
        finished=bool(attempts) and attempts[-1].exit_code == 0,
        progress=tuple(progress),
        flush_s=tuple(f for s in saves if (f := _num(s, "flush_s")) is not None),
    )


def find_roots(paths: Iterable[str | os.PathLike[str]], *, max_depth: int = 4) -> list[Path]:
    """Checkpoint roots at or below ``paths`` (a root is a directory with ``.resilient-root``)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if storage.is_root(p):
            found.append(p)
            continue
        base_depth = len(p.parts)
        for dirpath, dirnames, _ in os.walk(p):
            d = Path(dirpath)
            if len(d.parts) - base_depth >= max_depth:
                dirnames.clear()
            if storage.is_root(d):
                found.append(d)
                dirnames.clear()
            else:
                dirnames[:] = sorted(n for n in dirnames if not n.startswith((".", "step_")))
    return sorted(set(found))


def format_table(reports: Sequence[TaskReport]) -> str:
    """A human-readable report: one block per task, one line per attempt."""
    lines = []
    for t in reports:
        gp = f"{100 * t.goodput:.0f}%" if t.goodput is not None else "-"
        lines.append(
            f"{t.name}: {len(t.attempts)} attempts, {t.kills} kills, {t.checkpoints_written} checkpoints written, "
            f"{t.steps_recomputed} steps recomputed, goodput {gp}, {'finished' if t.finished else 'NOT finished'}"
        )
        if t.flush_s:
            ordered = sorted(t.flush_s)
            lines.append(
                f"  flushes from the local tier: {len(ordered)}, median "
                f"{ordered[len(ordered) // 2]:.2f} s, max {ordered[-1]:.2f} s"
            )
        for a in t.attempts:
            job = f" job {a.slurm_job_id}" if a.slurm_job_id else ""
            lines.append(
                f"  #{a.attempt:<3} {a.end - a.start:6.1f} s  exit {a.exit_code:<3} steps {a.restored_step} -> "
                f"{a.latest_after} (reached {a.max_step}), {a.checkpoints} ckpt{job}: {a.reason}"
            )
    return "\n".join(lines)


def plot(reports: Sequence[TaskReport], path: str | os.PathLike[str]) -> None:
    """Write a PNG of progress (step) against wall-clock time, kills marked.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'resilient-hpc[report]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((a.start for t in reports for a in t.attempts), default=0.0)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for t in reports:
        if not t.attempts:
            continue
        xs = [x - t0 for x, _ in t.progress]
        (line,) = ax.plot(
            xs, [s for _, s in t.progress], ".-", markersize=3, linewidth=1, label=t.name
        )
        for a in t.attempts:
            ax.axvspan(a.start - t0, a.end - t0, color=line.get_color(), alpha=0.06)
            if a.exit_code != 0 and a.max_step is not None:
                ax.plot(
                    [a.end - t0], [a.max_step], "x", color=line.get_color(), markersize=9, mew=2
                )
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("step")
    ax.set_title("progress per task (x = attempt killed: walltime / preemption / crash)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
