"""Run reports from the logs a checkpoint root keeps: attempts, phases, stops, kills, goodput.

Reads, per checkpoint root: ``attempts.jsonl`` (one line per ``resilient run`` attempt: its
start and end), ``saves.jsonl`` (one line per committed checkpoint) and ``progress.jsonl`` (the
program's timeline, written by :class:`~resilient.job.session.Session`: see
:mod:`resilient.job.timeline`); damaged lines are skipped with one warning
(:mod:`resilient.io.logs`). No MPI, no h5py.

Definitions:

* *phases* of an attempt (they add up to its wall time): start-up (the launch, imports and the
  restore, up to the first new step), compute kept (steps that the run went on from), compute
  lost (steps recomputed by a later attempt), checkpoint (saving that held the program), exit;
  and, between two attempts, the time no attempt ran (a requeue, the queue).
* *wall time*: the first attempt's start to the last one's end, gaps included.
* *goodput*: compute kept / wall time. A stopwatch bounds it: it is at most the share of the
  wall time that an uninterrupted run of the same steps would take. ``None`` when the program
  records no timeline (it does not use Session) or did not run under ``resilient run`` (no
  attempt ledger: no attempts to measure).
* *stops*: attempts the program ended itself on a warning signal: it checkpointed and exited
  75 (or stopped before its first checkpoint). *kills*: attempts a signal ended (SIGKILL after
  the grace, a kill from outside, a lost node) or that crashed. An attempt refused with 74 (a
  permanent storage error) or 78 (the directory is another run's) is neither.
* *steps recomputed*: for each attempt after the first, the highest step the previous attempt
  reached minus the step this attempt restored (work lost between the last checkpoint and the
  stop or kill).
* *finished*: from the ledger, whether the last attempt exited 0. Without a ledger (the program
  did not run under ``resilient run``), from the Session's timeline: its last session ended
  without a stop or an exception; ``None`` (unknown) when the timeline cannot tell.
* *name*: :func:`resilient.model.filenames.task_name`, as ``resilient ls`` names a task.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilient._renamed import renamed_keyword
from resilient.io import logs, storage
from resilient.job.exitcodes import EXIT_CONFIG, EXIT_PERMANENT, EXIT_RESUME
from resilient.job.timeline import END, RESTORED, AttemptEvents, Phases, kept_until, read_events
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
    phases: Phases = field(default_factory=Phases)
    ending: str = ""  # "finished", "stop", "kill" or "refused" (the module docstring)


@dataclass(frozen=True, slots=True)
class TaskReport:
    """Everything the report says about one checkpoint root."""

    name: str
    root: str
    attempts: tuple[AttemptSummary, ...]  # none without a ledger (no `resilient run`)
    stops: int
    kills: int
    checkpoints_written: int
    steps_recomputed: int
    wall_spent_s: float  # in attempts
    between_s: float  # between attempts
    finished: bool | None  # None: unknown (no ledger, and the timeline cannot tell)
    finished_why: str  # how that is known, or why it is not
    timed: bool  # the program recorded its timeline (a Session): the phases are known
    progress: tuple[tuple[float, int], ...] = field(default=())
    flush_s: tuple[float, ...] = ()  # seconds each flush from a node-local tier took

    @property
    def phases(self) -> Phases:
        """The attempts' phases, added up."""
        return sum((a.phases for a in self.attempts), Phases())

    @property
    def wall_s(self) -> float:
        """The first attempt's start to the last one's end."""
        return self.wall_spent_s + self.between_s

    @property
    def goodput(self) -> float | None:
        """Compute kept / wall time (``None`` without attempts or without a timeline)."""
        if not self.timed or self.wall_s <= 0:
            return None
        return self.phases.compute_kept_s / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["goodput"] = self.goodput
        doc["wall_s"] = self.wall_s
        doc["phases"] = asdict(self.phases) if self.timed else None
        doc.pop("progress")
        return doc


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(rec: dict[str, Any], key: str) -> int | None:
    v = rec.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _ending(rec: dict[str, Any]) -> str:
    """How one attempt of the ledger ended (the module docstring's words), from the program's
    own exit status (the ledger's ``exit_code`` where an older ledger has none)."""
    status = _int(rec, "exit_status")
    if status is None:
        status = int(rec["exit_code"])
    stop = rec.get("program_stop")
    if status == 0:
        return "finished"
    stopped_unsaved = status > 0 and isinstance(stop, dict) and stop.get("saved") is False
    if status == EXIT_RESUME or stopped_unsaved:  # checkpointed and exited 75, or had nothing
        return "stop"
    if status in (EXIT_PERMANENT, EXIT_CONFIG):
        return "refused"
    return "kill"


def _finished_without_ledger(root: Path) -> tuple[bool | None, str]:
    """Whether a program that did not run under ``resilient run`` finished, from its Session's
    timeline: the last session's ``end`` event, after its last ``restored``."""
    events = sorted(
        logs.read_log(root / filenames.PROGRESS_LOG, logs.PROGRESS), key=lambda e: float(e["time"])
    )
    if not events:
        return None, "no timeline either: the program does not use Session"
    starts = [float(e["time"]) for e in events if e.get("event") == RESTORED]
    began = starts[-1] if starts else float("-inf")
    ends = [e for e in events if e.get("event") == END and float(e["time"]) >= began]
    if not ends:
        return None, "its last Session has no end in the timeline: still running, or killed"
    end = ends[-1]
    if end.get("raised"):
        return False, f"its last Session ended with an exception ({end['raised']})"
    if end.get("stopped"):
        return False, "its last Session stopped early (a stop): run it again to resume"
    if "raised" not in end:
        return None, "its timeline does not say whether its last Session ended with an exception"
    return True, "its last Session ended without a stop or an exception"


@renamed_keyword("root", "checkpoint_dir")
def task_report(checkpoint_dir: str | os.PathLike[str], *, name: str | None = None) -> TaskReport:
    """The report of one checkpoint directory (a task); ``name`` defaults to
    :func:`~resilient.model.filenames.task_name` of it (``root`` is its deprecated alias)."""
    r = Path(checkpoint_dir)
    ledger = [
        rec for rec in logs.read_log(r / filenames.ATTEMPT_LEDGER, logs.ATTEMPTS)
        if _num(rec, "start") is not None and _num(rec, "end") is not None
    ]  # fmt: skip
    saves = [s for s in logs.read_log(r / filenames.SAVE_LOG, logs.SAVES) if "time" in s]
    # what the attempts on record committed: not the saves of one still running (its work is
    # neither kept nor lost yet; counting them would make every finished attempt's work lost)
    last_end = max((float(rec["end"]) for rec in ledger), default=float("-inf"))
    committed = [int(s["step"]) for s in saves if float(s["time"]) <= last_end]
    events = read_events(r)
    progress = tuple((float(e["time"]), int(e["step"])) for e in events)
    timeline = [AttemptEvents.of(events, float(rec["start"]), float(rec["end"])) for rec in ledger]
    codes = [int(rec["exit_code"]) for rec in ledger]
    finished: bool | None = bool(codes) and codes[-1] == 0
    kept = kept_until(timeline, finished=bool(finished), committed=committed)
    attempts: list[AttemptSummary] = []
    recomputed = 0
    prev_max: int | None = None
    for rec, ev, code, until in zip(ledger, timeline, codes, kept, strict=True):
        start, end = ev.start, ev.end
        inside = [s for s in saves if start <= float(s["time"]) <= end]
        steps_seen = [st for _, st in ev.samples]
        steps_seen += [int(s["step"]) for s in inside]
        after = _int(rec, "latest_after")
        restored = _int(rec, "restored_step")
        if restored is None:
            restored = ev.restored_step if ev.resumed else _int(rec, "latest_before")
        if after is not None:
            steps_seen.append(after)
        max_step = max(steps_seen) if steps_seen else None
        if prev_max is not None:
            recomputed += max(0, prev_max - (restored or 0))
        prev_max = max_step
        attempts.append(
            AttemptSummary(
                attempt=int(rec["attempt"]), start=start, end=end,
                exit_code=code, reason=str(rec.get("reason", "")), restored_step=restored,
                latest_after=after, max_step=max_step, checkpoints=len(inside),
                slurm_job_id=rec.get("slurm_job_id"),
                phases=ev.phases(until), ending=_ending(rec),
            )
        )  # fmt: skip
    spent = sum(a.end - a.start for a in attempts)
    wall = attempts[-1].end - attempts[0].start if attempts else 0.0
    if ledger:
        why = f"its last attempt exited {codes[-1]}"
    else:
        finished, why = _finished_without_ledger(r)
    return TaskReport(
        name=name or filenames.task_name(r),
        root=str(r),
        attempts=tuple(attempts),
        stops=sum(1 for a in attempts if a.ending == "stop"),
        kills=sum(1 for a in attempts if a.ending == "kill"),
        checkpoints_written=len(saves),
        steps_recomputed=recomputed,
        wall_spent_s=spent,
        between_s=max(0.0, wall - spent),
        finished=finished,
        finished_why=why,
        timed=any(ev.timed for ev in timeline),
        progress=progress,
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


def _phases_text(p: Phases) -> str:
    return (
        f"start-up {p.startup_s:.1f} s, compute kept {p.compute_kept_s:.1f} s, lost "
        f"{p.compute_lost_s:.1f} s, checkpoints {p.checkpoint_s:.1f} s, exit {p.exit_s:.1f} s"
    )


def _finished_text(t: TaskReport) -> str:
    if t.finished is None:
        return f"finished: unknown ({t.finished_why})"
    return f"{'finished' if t.finished else 'NOT finished'} ({t.finished_why})"


def format_table(reports: Sequence[TaskReport]) -> str:
    """A human-readable report: one block per task, one line per attempt."""
    lines = []
    for t in reports:
        if not t.attempts:
            lines.append(
                f"{t.name}: no attempt ledger: the program did not run under `resilient run` "
                f"(run it as `resilient run --checkpoint-dir {t.root} -- PROGRAM...` to record "
                f"its attempts, stops, kills and goodput); {t.checkpoints_written} checkpoints "
                f"written; {_finished_text(t)}"
            )
        else:
            gp = (
                f"{100 * t.goodput:.0f}%" if t.goodput is not None
                else "- (no timeline: the program does not use Session)"
            )  # fmt: skip
            lines.append(
                f"{t.name}: {len(t.attempts)} attempts ({t.stops} stops, {t.kills} kills), "
                f"{t.checkpoints_written} checkpoints written, {t.steps_recomputed} steps "
                f"recomputed, goodput {gp}, {_finished_text(t)}"
            )
        if t.timed:
            lines.append(
                f"  wall {t.wall_s:.1f} s = {_phases_text(t.phases)}, between attempts "
                f"{t.between_s:.1f} s"
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
                f"  #{a.attempt:<3} {a.end - a.start:6.1f} s  exit {a.exit_code:<3} steps {_step(a.restored_step)} -> "
                f"{_step(a.latest_after)} (reached {a.max_step}), {a.checkpoints} ckpt{job}: {a.reason}"
            )
            if t.timed:
                lines.append(f"        {_phases_text(a.phases)}")
    return "\n".join(lines)


# the plot's colour of each phase (the same names as the table's)
_PHASE_COLOURS = (
    ("startup_s", "start-up", "tab:orange"),
    ("compute_kept_s", "compute kept", "tab:green"),
    ("compute_lost_s", "compute lost", "tab:red"),
    ("checkpoint_s", "checkpoints", "tab:blue"),
    ("exit_s", "exit", "tab:gray"),
)


def plot(reports: Sequence[TaskReport], path: str | os.PathLike[str]) -> None:
    """Write a PNG: progress (step) against wall-clock time, stops and kills marked, and below it
    one bar per task with each attempt's phases (start-up, compute kept and lost, checkpoints,
    exit).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'resilient-hpc[report]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in reports if t.attempts]
    t0 = min((a.start for t in shown for a in t.attempts), default=0.0)
    fig, (ax, bars) = plt.subplots(
        2, 1, sharex=True, figsize=(9, 4.5 + 0.3 * len(shown)), dpi=110,
        gridspec_kw={"height_ratios": [3, max(1, len(shown)) * 0.35 + 0.4]},
    )  # fmt: skip
    for row, t in enumerate(shown):
        xs = [x - t0 for x, _ in t.progress]
        (line,) = ax.plot(
            xs, [s for _, s in t.progress], ".-", markersize=3, linewidth=1, label=t.name
        )
        for a in t.attempts:
            ax.axvspan(a.start - t0, a.end - t0, color=line.get_color(), alpha=0.06)
            marker = {"stop": "o", "kill": "x"}.get(a.ending)
            if marker is not None and a.max_step is not None:
                ax.plot([a.end - t0], [a.max_step], marker, color=line.get_color(),
                        markersize=8, mew=2, fillstyle="none")  # fmt: skip
            if t.timed:
                _phase_bar(bars, row, a, t0)
    handles = [
        matplotlib.patches.Patch(color=colour, label=label) for _, label, colour in _PHASE_COLOURS
    ]
    bars.set_yticks(range(len(shown)), [t.name for t in shown], fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("wall-clock time (s); a gap between bars: between attempts (requeue, queue)")
    ax.set_ylabel("step")
    ax.set_title(
        "progress per task (o = a stop: warning signal, checkpoint, exit 75; "
        "x = a kill: SIGKILL, preemption, crash)", fontsize=9,
    )  # fmt: skip
    ax.grid(alpha=0.3)
    ax.add_artist(ax.legend(loc="upper left", fontsize=8))
    ax.legend(handles=handles, loc="lower right", fontsize=8, title="phases (bars below)",
              title_fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _phase_bar(ax: Any, row: int, a: AttemptSummary, t0: float) -> None:
    """One attempt's phases as a bar in ``row``, in the order they happen (compute kept before
    compute lost: a kill loses the end of the loop)."""
    x = a.start - t0
    for attr, _, colour in _PHASE_COLOURS:
        width = getattr(a.phases, attr)
        if width > 0:
            ax.broken_barh([(x, width)], (row - 0.35, 0.7), color=colour)
            x += width


def _step(step: int | None) -> str:
    """A step as the report prints it: ``none`` where there was no checkpoint."""
    return "none" if step is None else str(step)
