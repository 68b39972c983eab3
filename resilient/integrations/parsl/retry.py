"""Parsl's retry handler for resumable tasks: a try that made progress costs nothing.

:func:`resume_retry_handler` is a ``Config(retry_handler=...)``. It reads only what Parsl
documents for a retry handler -- the exception and the task record -- and writes nothing into
the record. It prices a failed try of any app whose command comes from
:func:`~resilient.integrations.parsl.commands.resilient_command` or
:func:`~resilient.integrations.parsl.commands.run_resilient`, whatever the app's parameters are
called:

* exit 75 costs ``walltime_cost`` (0): ``resilient run`` exits 75 only after a newer valid
  checkpoint was committed, and the next try finds the resume point itself;
* exit 93 (no progress for too long), 74 (permanent storage error) and 78 (the checkpoint
  directory belongs to another run) cost ``math.inf``: no more tries;
* a lost worker or manager (``WorkerLost``, ``ManagerLost``: a pilot job hit its walltime, or
  Slurm ended or requeued it after losing one of its nodes) is priced by progress:
  ``walltime_cost`` when a checkpoint root among the task's arguments has a newer step to
  resume from than at the task's previous failure (at its first: when the root's ledger has an
  attempt with progress that ended during this try, or, where the try's attempt was killed
  before it could say, a newer step than the ledger's last earlier attempt left), else
  ``failure_cost``. The step to resume from is the shared root's newest valid checkpoint or a
  newer node-local one protected by partner copies (:func:`resilient.io.checkpoints.
  resumable_step`); a node that Slurm lost meanwhile, as ``resilient run`` recorded it, is named
  in the log line;
* anything else costs ``failure_cost`` (1).

With ``Config(retries=N)`` a task is therefore relaunched as long as it advances and gives up
after N+1 tries that did not (Parsl#1905).

Each failed try gets one INFO line right after Parsl's own ``Task 1 try 0 failed with
exception of type BashExitFailure``, saying what it cost::

    resilient: task 1 (simulate) try 0 stopped early after a newer checkpoint (exit 75): costs 0 retries (0 of 1 used)
    resilient: task 2 (simulate) try 0 failed (exit 1): costs 1 retry (1 of 1 used)
    resilient: task 3 (simulate) try 0 failed with exit 93 (no progress for too long): not retried

Its logger is ``parsl.resilient``, a child of Parsl's ``parsl`` logger, so the lines land in
the run directory's ``parsl.log`` beside Parsl's (``parsl.load`` attaches the file handler to
``parsl``); ``resume_retry_handler(logger=...)`` sends them elsewhere.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parsl.app.errors import BashExitFailure
from parsl.executors.high_throughput.errors import ManagerLost, WorkerLost

from resilient.integrations.parsl.commands import (
    ForeignRunRefused,
    NoProgressRefused,
    ResumableCommandError,
)
from resilient.io.checkpoints import resumable_step
from resilient.io.storage import is_root
from resilient.job.exitcodes import EXIT_RESUME, FINAL, ends_run, is_final
from resilient.job.ledger import read_ledger

if TYPE_CHECKING:
    from parsl.dataflow.taskrecord import TaskRecord

__all__ = ["RetryHandler", "exit_code_of", "find_roots", "resume_retry_handler"]

log = logging.getLogger("parsl.resilient")
"""The handler's logger: a child of Parsl's ``parsl`` logger, whose handlers ``parsl.load``
sets up (``parsl.log`` in the run directory), so each decision is logged right after Parsl's
own ``Task 1 try 0 failed with exception of type BashExitFailure``."""

RetryHandler = Callable[[Exception, "TaskRecord"], float]

def exit_code_of(exc: BaseException) -> int | None:
    """The exit code a failed try reported (a bash app, :func:`run_resilient`), else ``None``."""
    if isinstance(exc, (BashExitFailure, ResumableCommandError)):
        code = exc.exitcode
        return code if isinstance(code, int) else None
    return None


def _paths(value: Any) -> Iterator[Path]:
    """Every path in an argument: strings, ``os.PathLike`` (Parsl ``File``), inside containers."""
    if isinstance(value, (str, os.PathLike)):
        try:
            yield Path(value)
        except TypeError:  # an os.PathLike whose __fspath__ returns bytes
            return
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _paths(item)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _paths(item)


def find_roots(args: Any, kwargs: Any) -> list[Path]:
    """The checkpoint roots (:func:`resilient.io.storage.is_root`) among a task's arguments."""
    found: dict[Path, None] = {}
    for path in _paths([args or (), kwargs or {}]):
        if path not in found and is_root(path):
            found[path] = None
    return list(found)


def _ended(record: Mapping[str, Any], since: float) -> bool:
    end = record.get("end")
    return isinstance(end, (int, float)) and end >= since


def _ledger_progress_since(root: Path, since: float | None, after: int | None) -> bool:
    """Whether the try that began at ``since`` advanced ``root``: its ledger has an attempt with
    progress that ended since; or none ended since (``resilient run`` was killed with it) and
    ``after`` is newer than what the ledger's last earlier attempt left."""
    if since is None:
        return False
    ledger = read_ledger(root)
    if any(_ended(r, since) for r in ledger):
        return any(r.get("progress") is True and _ended(r, since) for r in ledger)
    if not ledger or "latest_after" not in ledger[-1]:  # nothing to compare with
        return False
    left = ledger[-1]["latest_after"]
    return after is not None and (not isinstance(left, int) or after > left)


def _lost_nodes(root: Path, since: float | None) -> list[str]:
    """The nodes that the root's attempts since ``since`` lost (``resilient run``'s ledger)."""
    if since is None:
        return []
    return [
        str(node)
        for r in read_ledger(root)
        if _ended(r, since) and isinstance(r.get("lost_nodes"), list)
        for node in r["lost_nodes"]
    ]


def _timestamp(value: Any) -> float | None:
    return value.timestamp() if isinstance(value, datetime.datetime) else None


@dataclass(frozen=True, slots=True)
class _Progress:
    """What a lost try left behind: per root, the newest valid step before and after."""

    steps: dict[Path, tuple[int | None, int | None]]
    advanced: bool
    lost_nodes: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.steps:
            return "no checkpoint root among its arguments"
        text = ", ".join(f"{root}: step {_step(b)} -> {_step(a)}" for root, (b, a) in self.steps.items())
        lost = f"Slurm lost node {', '.join(self.lost_nodes)}; " if self.lost_nodes else ""
        return f"{lost}{text} ({'progress' if self.advanced else 'no progress'})"


def _step(step: int | None) -> str:
    return "none" if step is None else str(step)


class _ProgressTracker:
    """The newest valid step of each task's roots at its previous failure (one per handler)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, Any, Path], int | None] = {}
        self._lock = threading.Lock()

    def measure(self, task_record: Any) -> _Progress:
        """Compare each root's newest valid step with the previous failure's (or the ledger)."""
        roots = find_roots(task_record.get("args"), task_record.get("kwargs"))
        run_id = getattr(task_record.get("dfk"), "run_id", None)
        since = _timestamp(task_record.get("try_time_launched")) or _timestamp(
            task_record.get("time_invoked")
        )
        steps: dict[Path, tuple[int | None, int | None]] = {}
        advanced = False
        lost: dict[str, None] = {}
        for root in roots:
            key = (run_id, task_record.get("id"), root)
            after = resumable_step(root)
            with self._lock:
                known, before = key in self._seen, self._seen.get(key)
                self._seen[key] = after
            if known:
                advanced |= after is not None and (before is None or after > before)
            else:
                advanced |= _ledger_progress_since(root, since, after)
            steps[root] = (before, after)
            lost.update(dict.fromkeys(_lost_nodes(root, since)))
        return _Progress(steps, advanced, tuple(lost))


def resume_retry_handler(
    *,
    walltime_cost: float = 0.0,
    failure_cost: float = 1.0,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
) -> RetryHandler:
    """A Parsl ``retry_handler`` that prices a failed try by checkpoint progress.

    See the module docstring for the costs. Logs one INFO line per failed try, with the app's
    name, Parsl's task id and try number, and what the try cost, e.g. ``resilient: task 1
    (simulate) try 0 stopped early after a newer checkpoint (exit 75): costs 0
    retries (0 of 1 used)``, on ``logger`` (default :data:`log`, which Parsl's ``parsl.log``
    receives).
    """
    tracker = _ProgressTracker()
    out = log if logger is None else logger

    def handler(exc: Exception, task_record: TaskRecord) -> float:
        cost, what = _decide(exc, task_record, tracker, walltime_cost, failure_cost)
        out.info("resilient: %s %s: %s", _task_name(task_record), what, _price(cost, task_record))
        refused = _refusal(exc, task_record)
        if refused is exc:  # Parsl does not retry, and the app's future raises it
            raise exc
        if refused is not None:
            raise refused from exc
        return cost

    return handler


def _task_name(task_record: Any) -> str:
    """``task 1 (simulate) try 0``: Parsl's task id, the app's name and Parsl's try number (as
    in Parsl's own ``Task 1 try 0 failed`` line)."""
    name = task_record.get("func_name")
    app = f" ({name})" if name else ""
    return f"task {task_record.get('id')}{app} try {task_record.get('try_id')}"


def _price(cost: float, task_record: Any) -> str:
    """``costs 0 retries (0 of 1 used)``, ``costs 1 retry (...)`` or ``not retried``."""
    if math.isinf(cost):
        return "not retried"
    text = f"costs {cost:g} {'retry' if cost == 1 else 'retries'}"
    spent = task_record.get("fail_cost")  # before this try's cost: Parsl adds it afterwards
    budget = getattr(getattr(task_record.get("dfk"), "config", None), "retries", None)
    if isinstance(spent, (int, float)) and isinstance(budget, int):
        text += f" ({spent + cost:g} of {budget} used)"
    return text


def _refusal(exc: Exception, task_record: Any) -> ResumableCommandError | None:
    """For a try that ended the run for good (78, 93): the typed error the script sees
    (:class:`ForeignRunRefused`, :class:`NoProgressRefused`), with the ledger's reason."""
    code = exit_code_of(exc)
    if code is None or not ends_run(code):
        return None
    if isinstance(exc, (ForeignRunRefused, NoProgressRefused)):
        return exc  # run_resilient raised it already
    reasons = [
        str(ledger[-1].get("reason", ""))
        for root in find_roots(task_record.get("args"), task_record.get("kwargs"))
        if (ledger := read_ledger(root)) and ledger[-1].get("exit_code") == code
    ]
    reason = "; ".join(reasons) or "see the task's stderr (resilient run refused to start it)"
    return ResumableCommandError.of(code, reason=reason)


def _decide(
    exc: Exception,
    task_record: Any,
    tracker: _ProgressTracker,
    walltime_cost: float,
    failure_cost: float,
) -> tuple[float, str]:
    """(cost, what happened) of one failed try; every failure updates the steps seen per root."""
    progress = tracker.measure(task_record)
    code = exit_code_of(exc)
    if code == EXIT_RESUME:
        lost = f" (Slurm lost node {', '.join(progress.lost_nodes)})" if progress.lost_nodes else ""
        return walltime_cost, f"stopped early after a newer checkpoint{lost} (exit {code})"
    if code is not None and is_final(code):
        return math.inf, f"failed with exit {code} ({FINAL[code]})"
    if isinstance(exc, (ManagerLost, WorkerLost)):
        cost = walltime_cost if progress.advanced else failure_cost
        return cost, f"lost its worker ({type(exc).__name__}; {progress.describe()})"
    return failure_cost, f"failed (exit {code})" if code is not None else (
        f"failed ({type(exc).__name__})"
    )
