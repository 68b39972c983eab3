"""Parsl's retry handler for resumable tasks: a try that made progress costs nothing.

:func:`resume_retry_handler` is a ``Config(retry_handler=...)`` that charges a failed try by
*progress*: a try that committed a newer valid checkpoint costs ``walltime_cost`` (0), one that
did not costs ``failure_cost`` (1), and the exits that must not be retried (93: no progress for
too long, 74: permanent storage error) cost ``math.inf``. With ``Config(retries=N)`` a task is
therefore relaunched as long as it advances, and gives up after N+1 tries that did not
(Parsl#1905). Before each relaunch the handler sets the task's ``resume_from`` keyword to the
newest valid checkpoint (Parsl re-reads ``task_record['kwargs']`` at relaunch).

The handler keeps its bookkeeping in the task's keyword arguments: the checkpoint root in
``checkpoint_dir`` and the checkpoint a try started from in ``resume_from`` (both names are
configurable). The apps of :mod:`resilient.integrations.parsl.apps` have both.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parsl.app.errors import BashExitFailure
from parsl.executors.high_throughput.errors import ManagerLost, WorkerLost

from resilient import layout
from resilient.exitcodes import EXIT_NO_PROGRESS, EXIT_PERMANENT, EXIT_RESUME
from resilient.validate import latest_valid

if TYPE_CHECKING:
    from parsl.dataflow.taskrecord import TaskRecord

__all__ = [
    "FAILURE",
    "NO_PROGRESS",
    "PERMANENT",
    "WALLTIME",
    "ResumableCommandError",
    "RetryHandler",
    "classify_failure",
    "exit_code_of",
    "resume_retry_handler",
]

log = logging.getLogger("resilient.integrations.parsl")

RetryHandler = Callable[[Exception, "TaskRecord"], float]

# failure classes (what the handler logs)
WALLTIME = "walltime/preemption"
NO_PROGRESS = "no progress"
PERMANENT = "permanent storage error"
FAILURE = "failure"


# --------------------------------------------------------------------------- exceptions


class ResumableCommandError(Exception):
    """A command run by :func:`run_resumable` exited non-zero. Picklable.

    Attributes:
        exitcode: the exit code of ``resilient run`` (0/75/93/74/other, see the README).
        command: the command, as an argument list.
        output: the tail of its output (empty when it went to a log file).
    """

    def __init__(self, exitcode: int, command: Sequence[str] = (), output: str = "") -> None:
        super().__init__(exitcode, list(command), output)
        self.exitcode = exitcode
        self.command = list(command)
        self.output = output

    def __str__(self) -> str:
        text = f"resumable command exited {self.exitcode}: {shlex.join(self.command)}"
        return f"{text}\n{self.output}" if self.output else text


# --------------------------------------------------------------------------- retry handler


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code a failed try reported: bash apps and :func:`run_resumable`, else ``None``."""
    if isinstance(exc, (BashExitFailure, ResumableCommandError)):
        code = exc.exitcode
        return code if isinstance(code, int) else None
    return None


def classify_failure(exc: BaseException) -> str:
    """:data:`WALLTIME`, :data:`NO_PROGRESS`, :data:`PERMANENT` or :data:`FAILURE`."""
    if isinstance(exc, (ManagerLost, WorkerLost)):
        return WALLTIME
    code = exit_code_of(exc)
    if code == EXIT_RESUME:
        return WALLTIME
    if code == EXIT_NO_PROGRESS:
        return NO_PROGRESS
    if code == EXIT_PERMANENT:
        return PERMANENT
    return FAILURE


def _step_of(resume_from: Any) -> int | None:
    """The step of a checkpoint path (``.../step_00001200``), else ``None``."""
    if not isinstance(resume_from, (str, os.PathLike)):
        return None
    return layout.parse_step_dir(Path(resume_from).name)


def resume_retry_handler(
    *,
    checkpoint_kwarg: str = "checkpoint_dir",
    resume_kwarg: str = "resume_from",
    walltime_cost: float = 0.0,
    failure_cost: float = 1.0,
) -> RetryHandler:
    """A Parsl ``retry_handler`` that charges a failed try by checkpoint progress.

    For each failed try it finds the newest valid checkpoint under
    ``task_record['kwargs'][checkpoint_kwarg]`` and compares its step with the step the try
    started from (the checkpoint named by ``kwargs[resume_kwarg]``; for apps without that
    keyword, the step this handler saw at the previous failure). The cost is

    * ``math.inf`` for exit 93 (no progress for ``--max-no-progress`` attempts) and exit 74
      (permanent storage error): no more tries;
    * ``walltime_cost`` when the try committed a newer valid checkpoint, whatever killed it
      (walltime or preemption -- ``ManagerLost``, ``WorkerLost``, exit 75 -- or a crash);
    * ``failure_cost`` otherwise, and when the task has no ``checkpoint_kwarg``.

    It then sets ``kwargs[resume_kwarg]`` (when the task has that keyword) to the path of the
    newest valid checkpoint as a string, or ``None``, and logs one INFO line.
    """
    seen: dict[tuple[str | None, Any], int | None] = {}
    lock = threading.Lock()

    def handler(exc: Exception, task_record: TaskRecord) -> float:
        kind = classify_failure(exc)
        code = exit_code_of(exc)
        what = f"{kind}, exit {code}" if code is not None else f"{kind}, {type(exc).__name__}"
        task_id = task_record.get("id")
        try_id = task_record.get("try_id")
        kwargs = task_record.get("kwargs")
        if not isinstance(kwargs, dict) or kwargs.get(checkpoint_kwarg) is None:
            cost = math.inf if kind in (NO_PROGRESS, PERMANENT) else failure_cost
            log.info(
                "task %s try %s failed (%s); no %r keyword, progress unknown; cost %s",
                task_id, try_id, what, checkpoint_kwarg, cost,
            )  # fmt: skip
            return cost
        root = Path(kwargs[checkpoint_kwarg])
        latest = latest_valid(root)
        after = latest.step if latest is not None else None
        dfk = task_record.get("dfk")
        key = (getattr(dfk, "run_id", None), task_id)
        with lock:
            before = _step_of(kwargs[resume_kwarg]) if resume_kwarg in kwargs else seen.get(key)
            seen[key] = after
        advanced = after is not None and (before is None or after > before)
        if kind in (NO_PROGRESS, PERMANENT):
            cost = math.inf
        elif advanced:
            cost = walltime_cost
        else:
            cost = failure_cost
        resume = str(latest.path) if latest is not None else None
        injected = resume_kwarg in kwargs
        if injected:
            kwargs[resume_kwarg] = resume
        log.info(
            "task %s try %s failed (%s); checkpoint step %s -> %s in %s (%s); cost %s; %s",
            task_id, try_id, what, before, after, root,
            "progress" if advanced else "no progress", cost,
            f"{resume_kwarg}={resume}" if injected else f"no {resume_kwarg!r} keyword to set",
        )  # fmt: skip
        return cost

    return handler
