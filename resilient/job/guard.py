"""When a task may start again after a run ended for good (exit 93 or 78).

``resilient run`` ends a run that cannot go on: 93 after ``--max-no-progress`` attempts in a row
without a newer checkpoint, 78 when the checkpoint directory belongs to another run. A workflow
engine retries a failed job anyway, whatever its exit code (Snakemake 9.27.1 restarts any failed
job while it has retries left: ``snakemake/scheduling/job_scheduler.py``, ``_handle_error``), so
each such retry must end at once, without starting the program. A person who fixed the cause and
starts the workflow again must not be refused, though. This module tells the two apart.

Each ledger line records its invocation (:class:`Invocation`): a fingerprint of the command
line and the program files it names, the engine process or job chain that started it, and,
when the engine says so, that it is a retry. Before it starts the program, ``resilient run``
asks :func:`verdict`:

* the command or a program file changed since the run ended: a new run;
* an engine's retry (Snakemake's ``--attempt N`` with N > 1 in a cluster job, Slurm's
  ``SLURM_RESTART_COUNT`` > 0, a later task of a Slurm job array), or the same engine process
  as the attempt that ended the run (Snakemake's main process running local jobs): refused at
  once, with the same exit code and reason;
* anything else (a new ``snakemake`` or Parsl script, a command typed by hand): a new run.

A new run is said in one line and recorded on its first attempt (``new_run``); the count of
attempts without progress starts again there (:func:`trailing_no_progress`).

Attempts killed from outside (SIGKILL, SIGTERM or SIGHUP that ``resilient run`` did not send: a
lost node, a preemption, the OOM killer, ``kill -9``) are *interrupted*: they say nothing of
whether the program can make progress, so they do not count towards 93. The engine's own retry
budget bounds how often that may happen.

Pure logic but for :meth:`Invocation.here`, which reads the environment and ``/proc``
(:mod:`resilient.job.process`).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.job.exitcodes import EXIT_FOREIGN_RUN, EXIT_NO_PROGRESS, EXIT_OK
from resilient.job.process import ancestors, cmdline, start_ticks

__all__ = [
    "SNAKEMAKE_JOB",
    "Invocation",
    "Verdict",
    "interrupted_from_outside",
    "trailing_no_progress",
    "verdict",
]

# exit statuses of a program killed by these signals: -N from Python's subprocess, N from
# MPICH's mpiexec (hydra), 128 + N from a shell or srun
_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGHUP)


def interrupted_from_outside(status: int, sent: str | None) -> str | None:
    """The signal that killed the program from outside (not sent by ``resilient run``), or
    ``None``. ``sent``: the last signal ``resilient run`` sent or forwarded."""
    if sent is not None or status == 0:
        return None
    for sig in _OUTSIDE:
        if status in (-sig, 128 + sig) or (status == sig and sig != signal.SIGHUP):
            return sig.name  # a bare 1 is the commonest failure, not SIGHUP
    return None


def trailing_no_progress(ledger: Sequence[Mapping[str, Any]]) -> int:
    """How many attempts at the end of the ledger failed without progress, in a row, since the
    run's last start (a ``new_run`` record).

    Attempts refused because the directory belongs to another run (exit 78) do not count: they
    say nothing of this run's progress. Nor do attempts interrupted from outside, or that
    lost a node of their Slurm job (:mod:`resilient.job.nodeloss`).
    """
    count = 0
    for rec in reversed(ledger):
        if rec.get("progress") or rec.get("exit_code") == EXIT_OK:
            break
        if (
            rec.get("exit_code") != EXIT_FOREIGN_RUN
            and not rec.get("interrupted")
            and not rec.get("lost_nodes")
        ):
            count += 1
        if rec.get("new_run"):
            break
    return count


@dataclass(frozen=True, slots=True)
class Invocation:
    """What tells a run of a task from an engine's retry of it."""

    fingerprint: str  # the command line and the program files it names (size, mtime)
    engine: str | None = None  # the engine process or job chain that started this invocation
    retry: str | None = None  # why this invocation is an engine's retry, if the engine says so

    @classmethod
    def here(
        cls, command: Sequence[str], environ: Mapping[str, str], *, pid: int | None = None
    ) -> Invocation:
        """This process's invocation of ``command`` (``pid``: whose ancestors to look at)."""
        engine, retry = _slurm(environ)
        if engine is None:
            engine, retry = _snakemake(os.getpid() if pid is None else pid)
        return cls(fingerprint(command), engine, retry)

    def to_record(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "engine": self.engine, "retry": self.retry}


# a word that names an existing file with one of these suffixes, or an executable file, is a
# program: its size and modification time are part of the fingerprint (data files, configs and
# outputs are not: a failed attempt may have rewritten them)
_SCRIPT_SUFFIXES = frozenset({".py", ".sh", ".bash", ".jl", ".r", ".pl", ".lua", ".m"})


def fingerprint(command: Sequence[str]) -> str:
    """A digest of the command's words and of the program files among them (scripts and
    executables: their size and modification time): an edited script or a rebuilt binary
    is another command."""
    h = hashlib.sha256()
    for word in command:
        h.update(word.encode(errors="surrogateescape") + b"\0")
        path = Path(word)
        try:
            if len(word) >= 4096 or not path.is_file():
                continue
            if path.suffix.lower() in _SCRIPT_SUFFIXES or os.access(path, os.X_OK):
                st = path.stat()
                h.update(f"{st.st_size}:{st.st_mtime_ns}\0".encode())
        except (OSError, ValueError):
            continue
    return h.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether to start the program: ``refuse`` (an exit code) with ``reason``, or start, with
    ``new_run`` saying why a run that had ended starts again."""

    refuse: int | None = None
    reason: str = ""
    new_run: str | None = None


def verdict(
    ledger: Sequence[Mapping[str, Any]], now: Invocation, *, max_no_progress: int
) -> Verdict:
    """Whether ``now`` may start the program, after the attempts of ``ledger``."""
    if not ledger:
        return Verdict()
    last = ledger[-1]
    if last.get("exit_code") == EXIT_FOREIGN_RUN:  # the program refused the directory
        code, why = EXIT_FOREIGN_RUN, str(last.get("reason") or "belongs to another run")
    elif (stalled := trailing_no_progress(ledger)) >= max_no_progress:
        code = EXIT_NO_PROGRESS
        why = f"{stalled} consecutive attempts made no progress (the last: {last.get('reason')})"
    else:
        return Verdict()
    new = _new_run(last, now)
    if new is not None:
        return Verdict(new_run=f"{new}; the run had ended with exit {code}: {why}")
    return Verdict(refuse=code, reason=why)


def _new_run(last: Mapping[str, Any], now: Invocation) -> str | None:
    """Why ``now`` starts a new run rather than retrying the one that ended at ``last``."""
    if last.get("fingerprint") != now.fingerprint:
        return "the command or a program file changed"
    if now.retry is not None:
        return None
    if now.engine is not None and now.engine == last.get("engine"):
        return None
    if now.engine is not None:
        return f"started anew ({now.engine})"
    return "started anew"


def _slurm(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the Slurm job chain, why this job retries it) from Slurm's variables."""
    array = environ.get("SLURM_ARRAY_JOB_ID")
    if array:
        task, first = environ.get("SLURM_ARRAY_TASK_ID"), environ.get("SLURM_ARRAY_TASK_MIN")
        later = task is not None and first is not None and task != first
        return f"slurm array job {array}", f"task {task} of job array {array}" if later else None
    job = environ.get("SLURM_JOB_ID")
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    if job and restarts.isdigit() and int(restarts) > 0:
        return f"slurm job {job}", f"requeue {restarts} of Slurm job {job}"
    return None, None


SNAKEMAKE_JOB = "snakemake job"
"""The engine of an invocation under a Snakemake job of a cluster executor (``--attempt N``)."""

_ATTEMPT = re.compile(r"^--attempt(?:=(\d+))?$")


def _snakemake(pid: int) -> tuple[str | None, str | None]:
    """(the Snakemake process above ``pid``, why this is its retry): a cluster job's Snakemake
    carries ``--attempt N``; the main process running local jobs is told by its pid and start."""
    for ancestor in ancestors(pid):
        argv = cmdline(ancestor)
        if not any(Path(w).name == "snakemake" or w == "snakemake" for w in argv[:3]):
            continue
        for i, word in enumerate(argv):
            m = _ATTEMPT.match(word)
            if m is None:
                continue
            n = m.group(1) or (argv[i + 1] if i + 1 < len(argv) else "")
            if n.isdigit():
                return SNAKEMAKE_JOB, f"Snakemake attempt {n}" if int(n) > 1 else None
        return f"snakemake pid {ancestor} started at tick {start_ticks(ancestor)}", None
    return None, None
