"""Requeue in place on Slurm: ``resilient run --requeue`` inside a batch job.

Without it, a stop at a job's time limit ends the job: the program checkpoints and exits 75,
the job fails, and the engine around it (Snakemake's retries, a chain of jobs) submits the next
one, each stop costing one of its retries. With ``--requeue`` inside a Slurm batch job,
``resilient run`` asks Slurm to put the same job back in the queue instead (``scontrol
requeue $SLURM_JOB_ID``): the job keeps its ID, ``SLURM_RESTART_COUNT`` grows by one, and the
batch script runs again from the top, which resumes from the newest checkpoint. An engine that
watches the job sees it pending again, not failed.

Only a stop caused by the job's own time limit is requeued (:func:`decide`): exit 75 (stopped
after a newer checkpoint), the program's own stop record (``stops.jsonl``) naming the deadline
or a warning signal, that signal arriving near the job's end, and no stop signal from outside
(``SIGTERM``: a preemption or ``scancel``). Never a finished run, 93 (no progress), 78 (another
run's directory), 74, a crash or a kill.

What it needs (:meth:`SlurmJob.readiness`, said once at the start): a batch job that Slurm may
requeue, ``Requeue=1`` in ``scontrol show job`` (``sbatch --requeue``, or the site's
``JobRequeue=1``, Slurm's default; ``--no-requeue`` turns it off). Slurm 22.05 answers a
requeue of any other job "Requested operation is presently disabled"; ``resilient run`` then
exits 75, so the engine's retry still resumes. ``MaxBatchRequeue`` (``scontrol show config``,
Slurm >= 23.02; a fixed 5 before) bounds only the requeues Slurm makes by itself after a
failed launch, not those asked with ``scontrol requeue``.

What it costs: a requeued job may not start again before ``AuthInfo=cred_expire`` + 1 s
(default 120 s: slurmctld holds it with ``Reason=BeginTime`` until the old job's credential
has expired), plus its wait in the queue.

``resilient run`` asks for the job at its start (:func:`slurm_job`, :func:`job_facts`) and,
after the job's attempts, requeues it or passes the exit code on (:func:`after_job`); with a
simulated walltime the requeue is its own: :func:`stopped_by_walltime` says when to start the
program again.

Pure logic but for :meth:`SlurmJob.query`, :func:`request` and :func:`after_job`, which run
``scontrol``.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resilient.job.exitcodes import EXIT_RESUME, is_over
from resilient.job.ledger import AttemptRecord
from resilient.job.options import RunOptions
from resilient.job.process import POLL_S, Attempt

__all__ = [
    "DEFAULT_WINDOW_S",
    "Decision",
    "SlurmJob",
    "after_job",
    "decide",
    "job_facts",
    "request",
    "restart_count",
    "slurm_job",
    "stopped_by_walltime",
    "window_s",
]

log = logging.getLogger("resilient.job.run")  # the lines of ``resilient run``

Scontrol = Callable[[Sequence[str]], tuple[int, str]]
"""Runs ``scontrol ARGS``: (exit status, its output, stderr included)."""

DEFAULT_WINDOW_S = 900.0
"""How close to the job's end a warning signal must stop the program to count as the time
limit's, when ``resilient run`` is not told the job's ``--signal`` lead (``--signal SIG@N``)."""

_SLURM_EARLY_S = 90.0  # Slurm sends --signal up to 60 s early (its 30-s timer), plus slack

# a stop for one of these did not come from the time limit: a preemption, scancel, a hangup
_FROM_OUTSIDE = frozenset({"SIGTERM", "SIGINT", "SIGHUP", "SIGKILL", "SIGQUIT"})


def _scontrol(args: Sequence[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _fields(text: str) -> dict[str, str]:
    """``Key=Value`` words of ``scontrol show job -o`` (values without spaces)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(?:^|\s)(\w+)=(\S*)", text)}


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """What ``scontrol`` says about this batch job, for a requeue in place."""

    job_id: str
    requeueable: bool | None = None
    """The job's ``Requeue=`` flag; ``None``: unknown."""
    batch: bool | None = None
    """``BatchFlag=1``: a batch job (only those can be requeued)."""
    restarts: int | None = None
    """``Restarts=``: how often it was requeued (``SLURM_RESTART_COUNT``)."""
    max_batch_requeue: int | None = None
    """``MaxBatchRequeue`` of ``scontrol show config`` (Slurm >= 23.02), if shown."""
    nodelist: str = ""
    """``NodeList=``: the job's nodes (``n[1-2]``)."""
    error: str = ""
    """Why the facts are unknown (``scontrol`` failed)."""

    @classmethod
    def query(cls, job_id: str, *, config: bool = True, scontrol: Scontrol = _scontrol) -> SlurmJob:
        """Ask ``scontrol show job -o JOB`` and (``config``) ``scontrol show config``."""
        status, text = scontrol(["show", "job", "-o", job_id])
        if status != 0:
            return cls(job_id, error=f"scontrol show job {job_id}: {text or f'exit {status}'}")
        got = _fields(text)
        most = None
        status, config_text = scontrol(["show", "config"]) if config else (1, "")
        if status == 0:
            m = re.search(r"^MaxBatchRequeue\s*=\s*(\d+)", config_text, re.M)
            most = int(m.group(1)) if m else None
        return cls(
            job_id,
            requeueable=_flag(got.get("Requeue")),
            batch=_flag(got.get("BatchFlag")),
            restarts=int(got["Restarts"]) if got.get("Restarts", "").isdigit() else None,
            max_batch_requeue=most,
            nodelist=got.get("NodeList", ""),
        )

    def readiness(self) -> tuple[bool, str]:
        """(whether a time-limit stop can be requeued, the line that says so at the start)."""
        job = f"Slurm job {self.job_id}"
        if self.error:
            return False, (
                f"--requeue: cannot tell whether {job} may be requeued ({self.error}); a "
                "time-limit stop will exit 75 instead, for the engine's retry"
            )
        if self.batch is False:
            return False, (
                f"--requeue: {job} is not a batch job (salloc, srun): Slurm requeues batch "
                "jobs only; a time-limit stop will exit 75 instead, for the engine's retry"
            )
        if self.requeueable is False:
            return False, (
                f"--requeue: {job} cannot be requeued (Requeue=0: submitted with --no-requeue, "
                "or the site sets JobRequeue=0); a time-limit stop will exit 75 instead, for "
                "the engine's retry. Submit it with sbatch --requeue (Snakemake's Slurm "
                "executor: `slurm-requeue: true` in the profile)"
            )
        limit = (
            f"; MaxBatchRequeue={self.max_batch_requeue} counts only Slurm's own requeues "
            "after failed launches"
            if self.max_batch_requeue is not None
            else ""
        )
        return True, (
            f"--requeue: a time-limit stop after progress requeues {job} in place "
            f"(Requeue=1, restarts so far {self.restarts if self.restarts is not None else '?'}"
            f"{limit}); it starts again after Slurm's AuthInfo cred_expire (default 120 s) "
            "and its queue wait"
        )


def _flag(value: str | None) -> bool | None:
    return None if value is None or not value.isdigit() else value != "0"


def window_s(warn_before_s: float | None) -> float:
    """How close to the end a warning signal's stop counts as the time limit's: the job's
    ``--signal`` lead plus Slurm's early delivery, else :data:`DEFAULT_WINDOW_S`."""
    return DEFAULT_WINDOW_S if warn_before_s is None else warn_before_s + _SLURM_EARLY_S


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to requeue the job, and why (or why not)."""

    requeue: bool
    why: str


def decide(
    *,
    exit_code: int,
    stop: Mapping[str, Any] | None,
    deadline: float | None,
    window: float,
    outside: Sequence[str] = (),
    interrupted: str | None = None,
) -> Decision:
    """Was this attempt stopped by the job's own time limit, after progress?

    Args:
        exit_code: the attempt's exit code per the contract (75: stopped after progress).
        stop: the program's own stop record for the attempt (``stops.jsonl``), if any.
        deadline: the job's end (Unix seconds), if known.
        window: seconds before the end within which a warning signal's stop counts.
        outside: stop signals that reached ``resilient run`` itself during the attempt or
            after it (forwarded to the program, or unheard).
        interrupted: the signal that killed the program from outside, if any.
    """
    if exit_code != EXIT_RESUME:
        return Decision(False, f"exit {exit_code} is not a stop after progress (75)")
    came = [s for s in outside if s in _FROM_OUTSIDE]
    if came or interrupted is not None:
        what = came[0] if came else interrupted
        return Decision(False, f"{what} came from outside (a preemption, scancel or a kill)")
    if stop is None:
        return Decision(False, "the program wrote no stop record: not a stop it chose")
    reason = str(stop.get("reason") or "")
    if reason.startswith("deadline"):
        return Decision(True, f"the job's time limit ({reason})")
    m = re.match(r"signal (\w+)", reason)
    if m and m.group(1) in _FROM_OUTSIDE:
        return Decision(False, f"stopped by {m.group(1)}: a preemption or scancel, not the limit")
    when = stop.get("time")
    if deadline is None or not isinstance(when, (int, float)):
        return Decision(False, f"{reason or 'a stop'} at an unknown time before the job's end")
    left = deadline - float(when)
    if left > window:
        return Decision(
            False,
            f"{reason or 'a stop'} {left:.0f} s before the job's end, more than {window:.0f} s: "
            "not the time limit's warning (tell resilient run the job's lead: --signal SIG@N)",
        )
    return Decision(True, f"the job's time limit ({reason}, {max(left, 0.0):.0f} s before its end)")


def request(job_id: str, *, scontrol: Scontrol = _scontrol) -> tuple[bool, str]:
    """``scontrol requeue JOB``: (done, what Slurm said)."""
    status, text = scontrol(["requeue", job_id])
    return status == 0, text or f"exit {status}"


def slurm_job(opts: RunOptions, env: dict[str, str]) -> SlurmJob | None:
    """With ``--requeue`` and no simulated walltime: this Slurm batch job (what ``scontrol``
    says of it). Its restart count goes into ``env`` if the engine dropped Slurm's variable
    (the Snakemake executor plugin keeps few ``SLURM_*`` variables in its job step).

    Raises:
        ValueError: ``--requeue`` with neither a simulated walltime nor a Slurm job.
    """
    if not opts.requeue or opts.walltime_s is not None:
        return None
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        raise ValueError("requeue needs a simulated walltime (walltime_s) or a Slurm batch job")
    return _with_restarts(SlurmJob.query(job_id), env)


def job_facts(env: dict[str, str]) -> SlurmJob | None:
    """In a Slurm job step that lacks the job's variables (the Snakemake executor plugin keeps
    few ``SLURM_*`` in its step): what ``scontrol show job`` says, its restart count put into
    ``env`` (for the ledger), its node list kept (for :mod:`resilient.job.nodeloss`)."""
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id or env.get("SLURM_NNODES"):
        return None
    return _with_restarts(SlurmJob.query(job_id, config=False), env)


def _with_restarts(job: SlurmJob, env: dict[str, str]) -> SlurmJob:
    """``job``, its restart count put into ``env`` where the engine dropped Slurm's variable."""
    if job.restarts is not None and "SLURM_RESTART_COUNT" not in env:
        env["SLURM_RESTART_COUNT"] = str(job.restarts)
    return job


def restart_count(env: Mapping[str, str]) -> int | None:
    """``SLURM_RESTART_COUNT`` (Slurm sets it from the first requeue on); 0 in a batch
    environment without it, ``None`` outside Slurm or where an engine dropped it."""
    text = env.get("SLURM_RESTART_COUNT", "").strip()
    if text.isdigit():
        return int(text)
    return 0 if env.get("SLURM_JOB_ID") and env.get("SLURM_NNODES") else None


_REQUEUE_WAIT_S = 60.0  # after scontrol requeue: Slurm ends the job's processes (KillWait)


def after_job(
    opts: RunOptions,
    job: SlurmJob,
    ready: bool,
    outcome: tuple[int, AttemptRecord, Attempt],
    unheard: list[int],
) -> int:
    """After the job's attempts: requeue the job in place if its time limit stopped the
    program after progress (:mod:`resilient.job.requeue`), else pass the exit code on. Where
    Slurm refuses, exit 75 (the engine's retry resumes) with one warning."""
    code, record, attempt = outcome
    decided = decide(
        exit_code=code,
        stop=record.program_stop,
        deadline=attempt.deadline,
        window=window_s(opts.warn_before_s),
        outside=[*attempt.forwarded, *(signal.Signals(s).name for s in unheard)],
        interrupted=record.interrupted,
    )
    if not decided.requeue:
        if code == EXIT_RESUME:
            log.info("not requeuing Slurm job %s: %s; exit 75", job.job_id, decided.why)
        return code
    if not ready:
        log.info(
            "stopped by %s; Slurm job %s cannot be requeued (see the start): exit 75",
            decided.why, job.job_id,
        )  # fmt: skip
        return code
    done, said = request(job.job_id)
    if not done:
        log.warning(
            "stopped by %s, but Slurm refused to requeue job %s (%s): exit 75, so the engine "
            "resubmits and the next job resumes. To requeue in place submit with --requeue "
            "(Snakemake's Slurm executor: `slurm-requeue: true`)",
            decided.why, job.job_id, said,
        )  # fmt: skip
        return code
    log.info(
        "stopped by %s after attempt %d: requeued Slurm job %s in place (restart %d); it "
        "starts again from the top after Slurm's AuthInfo cred_expire and its queue wait",
        decided.why, record.attempt, job.job_id, (record.slurm_restart_count or 0) + 1,
    )  # fmt: skip
    deadline = time.monotonic() + _REQUEUE_WAIT_S
    while not unheard and time.monotonic() < deadline:  # Slurm now ends this job's processes
        time.sleep(POLL_S)
    if not unheard:
        log.warning("Slurm did not end job %s within %.0f s of its requeue: exit 75", job.job_id,
                    _REQUEUE_WAIT_S)  # fmt: skip
    return code


def stopped_by_walltime(code: int, record: AttemptRecord, attempt: Attempt) -> bool:
    """Did the simulated walltime end this attempt (and nothing else)?

    Not if a signal came from outside (a user's Ctrl-C, a real scheduler), nor for a finished
    program, exit 93 or 74, or a crash that no stop signal or deadline caused.
    """
    if attempt.forwarded or is_over(code):
        return False
    return code == EXIT_RESUME or record.signal is not None or record.program_stop is not None
