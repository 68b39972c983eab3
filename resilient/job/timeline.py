"""A run's timeline: where each attempt's wall time went, and the goodput that follows.

The writer is :class:`Timeline`, which :class:`~resilient.job.session.Session` keeps on rank 0;
it appends events to ``progress.jsonl`` in the checkpoint root. The readers are ``resilient
run`` (which step an attempt restored) and ``resilient report`` (the phases of each attempt).

Events, one JSON line each, every one with ``time`` (seconds since the epoch) and ``step``:

* a sample (no ``event`` key): the loop had reached ``step`` at ``time``, for the plot: every
  :data:`SAMPLE_EVERY_S` at first, then further apart (the session's age over
  :data:`SAMPLES_PER_SPAN`, at most a minute), so a day-long attempt writes a few thousand;
* ``restored``: the loop starts at ``step``, restored from a checkpoint (``resumed``) or the
  initial step; the end of the attempt's start-up. Also ``attempt``, ``session_start`` (when
  the Session was made: what came before was the launch and the imports) and ``passed_over``
  (newer checkpoints that failed validation and were quarantined on the way);
* ``save``: a checkpoint of ``step`` held the program from ``t0`` to ``time`` (for an
  asynchronous save, the copy to memory and any wait for the save before it);
* ``wait``: the program waited from ``t0`` to ``time`` for an earlier checkpoint (the commit
  of an asynchronous save);
* ``end``: the session ended at ``time``; its loop had left at ``loop_end``, after ``step``
  (``stopped``: early, for a walltime or a signal; ``raised``: the name of the exception that
  left the ``with`` block, ``None`` when none did).

The phases of one attempt, from its start and end in the attempt ledger, partition its wall
time (:meth:`AttemptEvents.phases`):

* start-up: the attempt's start to ``restored`` (the launch, imports, MPI, the restore);
* checkpoint: every ``save`` and ``wait`` before the loop left, then the loop's end to ``end`` (the final
  checkpoint and the session's close);
* compute: the rest of ``restored`` to the loop's end. *Kept* up to the moment the attempt
  reached the step the run went on from (the step the next attempt restored; the last step,
  for a run that finished); *lost* after it (recomputed by the next attempt);
* exit: ``end`` to the attempt's end (the processes' exit). Without ``end`` (a process killed
  by SIGKILL) the loop ran until the attempt's end, and that time is compute.

Pure logic over records: no MPI, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.io import logs
from resilient.model import filenames

__all__ = [
    "SAMPLE_EVERY_S",
    "AttemptEvents",
    "Phases",
    "Timeline",
    "kept_until",
    "read_events",
]

SAMPLE_EVERY_S = 0.25  # a step sample at most this often (the plot's resolution) ...
SAMPLES_PER_SPAN = 240  # ... and at most this many per span of time since the session began

RESTORED, SAVE, WAIT, END = "restored", "save", "wait", "end"


class Timeline:
    """Appends one run's events to ``root/progress.jsonl`` (best effort, like every log).

    Not collective: call it on one rank (Session uses rank 0's).
    """

    def __init__(self, root: Path, *, attempt: int | None) -> None:
        self.path = root / filenames.PROGRESS_LOG
        self.attempt = attempt
        self._began: float | None = None
        self._last_sample = float("-inf")

    def sample(self, now: float, step: int) -> None:
        """The loop reached ``step`` at ``now`` (written only if the last sample is old enough)."""
        age = now - (self._began if self._began is not None else now)
        if now - self._last_sample >= min(60.0, max(SAMPLE_EVERY_S, age / SAMPLES_PER_SPAN)):
            self._last_sample = now
            logs.append_record(self.path, {"time": now, "step": step})

    def restored(
        self, now: float, step: int, *, resumed: bool, session_start: float,
        passed_over: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """The loop starts at ``step`` (restored from a checkpoint if ``resumed``)."""
        self._began = self._last_sample = now
        logs.append_record(self.path, {
            "time": now, "step": step, "event": RESTORED, "resumed": resumed,
            "attempt": self.attempt, "session_start": session_start,
            "passed_over": list(passed_over),
        })  # fmt: skip

    def save(self, t0: float, now: float, step: int) -> None:
        """A checkpoint of ``step`` held the program from ``t0`` to ``now``."""
        logs.append_record(self.path, {"time": now, "t0": t0, "step": step, "event": SAVE})

    def wait(self, t0: float, now: float, step: int) -> None:
        """The program waited from ``t0`` to ``now`` at ``step`` for a checkpoint saved before
        (the commit of an asynchronous save)."""
        logs.append_record(self.path, {"time": now, "t0": t0, "step": step, "event": WAIT})

    def end(
        self, now: float, step: int | None, *, loop_end: float, stopped: bool,
        raised: str | None = None,
    ) -> None:  # fmt: skip
        """The session ended at ``now``; its loop left at ``loop_end``, after ``step``
        (``raised``: the name of the exception that left the ``with`` block, if one did)."""
        logs.append_record(self.path, {
            "time": now, "step": step, "event": END, "loop_end": loop_end,
            "stopped": stopped, "raised": raised, "attempt": self.attempt,
        })  # fmt: skip


def read_events(root: Path) -> list[dict[str, Any]]:
    """The timeline's records of a step, by time (damaged lines are skipped with one warning:
    :mod:`resilient.io.logs`)."""
    records = [
        r for r in logs.read_log(root / filenames.PROGRESS_LOG, logs.PROGRESS)
        if r["step"] is not None
    ]  # fmt: skip
    return sorted(records, key=lambda r: float(r["time"]))


@dataclass(frozen=True, slots=True)
class Phases:
    """Where one attempt's wall time went, in seconds (they add up to its wall time)."""

    startup_s: float = 0.0
    compute_kept_s: float = 0.0
    compute_lost_s: float = 0.0
    checkpoint_s: float = 0.0
    exit_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (
            self.startup_s + self.compute_kept_s + self.compute_lost_s + self.checkpoint_s
            + self.exit_s
        )  # fmt: skip

    def __add__(self, other: Phases) -> Phases:
        return Phases(
            self.startup_s + other.startup_s,
            self.compute_kept_s + other.compute_kept_s,
            self.compute_lost_s + other.compute_lost_s,
            self.checkpoint_s + other.checkpoint_s,
            self.exit_s + other.exit_s,
        )


@dataclass(frozen=True, slots=True)
class AttemptEvents:
    """The timeline's events during one attempt (``start`` to ``end``: the ledger's)."""

    start: float
    end: float
    restored_at: float | None = None
    restored_step: int | None = None
    resumed: bool = False
    passed_over: tuple[int, ...] = ()
    saves: tuple[tuple[float, float, int], ...] = ()  # (t0, time, step)
    waits: tuple[tuple[float, float, int], ...] = ()  # (t0, time, step)
    loop_end: float | None = None
    ended_at: float | None = None
    final_step: int | None = None
    finished: bool = False
    """The Session ended its loop on its own: neither stopped early nor left by an exception
    (an ``end`` event that does not say, from an older version, does not count)."""
    samples: tuple[tuple[float, int], ...] = field(default=())

    @classmethod
    def of(cls, events: Iterable[Mapping[str, Any]], start: float, end: float) -> AttemptEvents:
        """The events of :func:`read_events` that fall in ``[start, end]``."""
        restored: Mapping[str, Any] | None = None
        ended: Mapping[str, Any] | None = None
        saves: list[tuple[float, float, int]] = []
        waits: list[tuple[float, float, int]] = []
        samples: list[tuple[float, int]] = []
        for ev in events:
            when, step = float(ev["time"]), int(ev["step"])
            if not start <= when <= end:
                continue
            kind = ev.get("event")
            if kind == RESTORED and restored is None:
                restored = ev
            elif kind == SAVE and (t0 := _num(ev, "t0")) is not None:
                saves.append((max(t0, start), when, step))
            elif kind == WAIT and (t0 := _num(ev, "t0")) is not None:
                waits.append((max(t0, start), when, step))
            elif kind == END and _num(ev, "loop_end") is not None:
                ended = ev
            samples.append((when, step))
        passed = restored.get("passed_over") if restored is not None else None
        return cls(
            start=start,
            end=end,
            restored_at=float(restored["time"]) if restored is not None else None,
            restored_step=int(restored["step"]) if restored is not None else None,
            resumed=bool(restored.get("resumed")) if restored is not None else False,
            passed_over=tuple(s for s in passed if isinstance(s, int))
            if isinstance(passed, list) else (),
            saves=tuple(saves),
            waits=tuple(waits),
            loop_end=min(end, float(ended["loop_end"])) if ended is not None else None,
            ended_at=float(ended["time"]) if ended is not None else None,
            final_step=_int(ended, "step") if ended is not None else None,
            finished=ended is not None and ended.get("stopped") is False
            and "raised" in ended and ended["raised"] is None,
            samples=tuple(samples),
        )  # fmt: skip

    @property
    def timed(self) -> bool:
        """Whether the program recorded its start (a Session); else its phases are unknown."""
        return self.restored_at is not None

    def reached_at(self, step: int) -> float | None:
        """When the loop reached ``step`` in this attempt (``None``: it did not, or no record
        says so): the loop's end if ``step`` was its last, else the start of that step's save."""
        if self.restored_at is None or (self.resumed and step <= (self.restored_step or 0)):
            return None
        if self.final_step == step and self.loop_end is not None:
            return self.loop_end  # no step after it: all of the loop counts
        stop = self.loop_end if self.loop_end is not None else self.end
        for t0, _, saved in self.saves:
            if saved == step and t0 <= stop:
                return t0
        return None

    def phases(self, kept_until: float | None) -> Phases:
        """Where this attempt's wall time went; compute is kept up to ``kept_until`` (a time
        of :meth:`reached_at`; ``None``: nothing this attempt computed was kept)."""
        start, end = self.start, self.end
        if self.restored_at is None:  # never got to its first step
            return Phases(startup_s=end - start)
        began = _clip(self.restored_at, start, end)
        left = _clip(self.loop_end if self.loop_end is not None else end, began, end)
        ended = _clip(self.ended_at if self.ended_at is not None else end, left, end)
        held = (*self.saves, *self.waits)
        blocked = _overlap(held, began, left)
        compute = max(0.0, left - began - blocked)
        kept = 0.0
        if kept_until is not None:
            until = _clip(kept_until, began, left)
            kept = min(compute, max(0.0, until - began - _overlap(held, began, until)))
        return Phases(
            startup_s=began - start,
            compute_kept_s=kept,
            compute_lost_s=compute - kept,
            checkpoint_s=blocked + (ended - left),
            exit_s=end - ended,
        )


def kept_until(
    attempts: Sequence[AttemptEvents], *, finished: bool, committed: Iterable[int]
) -> list[float | None]:
    """For each attempt, until when its compute was kept (see :meth:`AttemptEvents.phases`).

    Walks the run back from its end: the run went on from its last step if it finished,
    else from its newest committed checkpoint (``committed``: the steps of the save log). The
    newest attempt that reached that step kept its compute up to it, and the run before that
    attempt went on from the step it restored. An attempt whose work nothing later went on
    from (killed before its next checkpoint, a fallback past it, anything before a fresh
    start) kept nothing.
    """
    out: list[float | None] = [None] * len(attempts)
    if not attempts:
        return out
    need = attempts[-1].final_step if finished else max(committed, default=None)
    for i in range(len(attempts) - 1, -1, -1):
        if need is None:
            break
        ev = attempts[i]
        when = ev.reached_at(need)
        if when is None:
            continue
        out[i] = when
        need = ev.restored_step if ev.resumed else None
    return out


def _num(rec: Mapping[str, Any] | None, key: str) -> float | None:
    v = rec.get(key) if rec is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(rec: Mapping[str, Any] | None, key: str) -> int | None:
    v = rec.get(key) if rec is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _overlap(intervals: Iterable[tuple[float, float, int]], lo: float, hi: float) -> float:
    """Seconds of ``intervals`` (``(t0, t1, _)``) inside ``[lo, hi]``."""
    return sum(max(0.0, min(t1, hi) - max(t0, lo)) for t0, t1, _ in intervals)
