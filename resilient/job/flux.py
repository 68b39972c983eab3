"""Flux's time limit: SIGALRM five seconds before SIGKILL, and ``flux job timeleft``.

At a job's time limit Flux sends its tasks ``SIGALRM``, then ``SIGKILL`` once the job's
``exec.kill-timeout`` (5 s by default) has passed. An earlier warning comes only when the job
asked for one (``flux run --signal=USR1@60``: ``SIGUSR1`` 60 s before the limit), and Flux has
no requeue: a job that exits 75 is submitted again by whoever submitted it (the workflow engine,
a script). So, where ``$FLUX_JOB_ID`` says the process runs in a Flux job:

* ``SIGALRM`` is a stop signal that means *stop now* (:func:`time_limit_signals`): a
  :class:`~resilient.job.session.Session` stops at the next step and saves it only if its saves
  took less than :data:`SAVE_BEFORE_KILL_S` (:func:`save_before_kill`); otherwise it exits 75
  with the newest checkpoint it has, rather than be killed in the middle of a save whose
  time is wasted. ``resilient run`` passes a ``SIGALRM`` that reaches it on to the program.
* The deadline is read from ``flux job timeleft`` (:func:`flux_time_left`), so the Session's
  margin stops the loop before the limit as it does under Slurm.

Outside Flux nothing here applies: a program's own ``signal.alarm`` keeps its handler.

Pure logic, and one subprocess (``flux job timeleft``); nothing is collective.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping

__all__ = [
    "DEADLINE_SOURCE",
    "ENV_FLUX_JOB_ID",
    "KILL_TIMEOUT_S",
    "SAVE_BEFORE_KILL_S",
    "flux_time_left",
    "parse_timeleft",
    "save_before_kill",
    "time_limit_signals",
    "under_flux",
]

ENV_FLUX_JOB_ID = "FLUX_JOB_ID"
"""Set by Flux in every task of a job (and in a batch script, a Flux instance run as a job)."""

KILL_TIMEOUT_S = 5.0
"""Flux's default ``exec.kill-timeout``: ``SIGALRM`` at the limit, ``SIGKILL`` this much later."""

SAVE_BEFORE_KILL_S = 2.0
"""After ``SIGALRM``, a last save is tried only when a save has taken less than this (the
Session's running estimate), so that it, the commit and the exit fit in the 5 s before
``SIGKILL``."""

DEADLINE_SOURCE = "flux job timeleft"

_UNLIMITED = 2**32 - 1  # what ``flux job timeleft`` prints for a job without a time limit


def under_flux(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs in a Flux job (``$FLUX_JOB_ID`` set)."""
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_FLUX_JOB_ID, "").strip())


def time_limit_signals(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The signals that mean "the time limit is here, stop now": ``(SIGALRM,)`` in a Flux job,
    none elsewhere (a program's own ``signal.alarm`` is left alone)."""
    return (signal.SIGALRM,) if under_flux(environ) else ()


def save_before_kill(save_cost_s: float | None) -> bool:
    """Whether a last save fits between ``SIGALRM`` and ``SIGKILL``: yes when no save was
    measured yet (a save is then the only way to keep this run's progress), else when saves
    took less than :data:`SAVE_BEFORE_KILL_S`."""
    return save_cost_s is None or save_cost_s < SAVE_BEFORE_KILL_S


def parse_timeleft(text: str) -> float | None:
    """Seconds left from ``flux job timeleft``'s output (whole seconds; ``0`` once expired);
    ``None`` for a job without a limit (Flux prints ``UINT_MAX``) or output that is not a
    number."""
    word = text.strip().split("\n", 1)[0].strip()
    if not word.isdigit():
        return None
    left = int(word)
    return None if left >= _UNLIMITED else float(left)


def flux_time_left(*, timeout_s: float = 10.0) -> float | None:
    """Ask Flux how long this job has left (``flux job timeleft``); ``None`` when ``flux`` is
    missing, fails, takes longer than ``timeout_s`` or says there is no limit."""
    try:
        proc = subprocess.run(
            ["flux", "job", "timeleft"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return parse_timeleft(proc.stdout)
