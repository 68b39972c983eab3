"""One attempt's outcome: its reason and its exit code per the contract, rule by rule.

:func:`classify` turns what ``resilient run`` saw of an attempt's end (:class:`AttemptEnd`:
the program's exit status, the signal it sent, progress, the program's own stop record, a
signal or a lost node from outside) into the ledger's reason and the exit code, in two ordered
sequences of named rules: what happened (the first rule that applies says it), then which
exit code that makes (:mod:`resilient.job.exitcodes`: 93 after too many attempts without
progress, 75 only after progress, else the program's own code passed on).
:func:`refusal` says why an engine's retry is refused at once (:mod:`resilient.job.guard`).

:func:`say_mismatch` and :func:`say_startup` warn, once per invocation, about the directory
the program uses and about a walltime too short for its start-up.

Pure logic but for those two, which log.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.job.exitcodes import (
    EXIT_CONFIG,
    EXIT_FOREIGN_RUN,
    EXIT_NO_PROGRESS,
    EXIT_PERMANENT,
    EXIT_RESUME,
)
from resilient.job.guard import Invocation, Verdict
from resilient.job.ledger import AttemptRecord, Where, same_dir
from resilient.job.options import say_seconds
from resilient.job.protocol import ENV_CHECKPOINT_DIR
from resilient.model import filenames

__all__ = [
    "NO_DIRECTORY",
    "AttemptEnd",
    "before_first_step",
    "classify",
    "refusal",
    "resumed_from",
    "say_mismatch",
    "say_startup",
]

log = logging.getLogger("resilient.job.run")  # the lines of ``resilient run``


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptEnd:
    """What ``resilient run`` saw of one attempt's end."""

    status: int
    """The program's exit status (``-N``: killed by signal N)."""
    sent: str | None = None
    """The last signal ``resilient run`` sent or forwarded to it."""
    progress: bool = False
    """A newer step to resume from exists after it."""
    no_progress_run: int = 0
    """Attempts without progress in a row, this one included (0 when it does not count)."""
    max_no_progress: int = 2
    """``--max-no-progress``."""
    stop: Mapping[str, Any] | None = None
    """The program's own stop record for this attempt (:func:`resilient.job.protocol.program_stop`)."""
    walltime_s: float | None = None
    """The simulated walltime."""
    outside: str | None = None
    """The signal that killed it from outside (:func:`resilient.job.guard.interrupted_from_outside`)."""
    lost: str | None = None
    """The job's nodes that Slurm lost meanwhile (:mod:`resilient.job.nodeloss`)."""
    before_first_step: str | None = None
    """That the walltime ended it before its first step, and its start-up (:func:`before_first_step`)."""
    finished: bool = False
    """The program's Session ended its loop on its own in this attempt (its timeline's end)."""


Happened = Callable[[AttemptEnd], "tuple[str, bool] | None"]
"""A rule of what happened: (the reason, whether it was killed) if it applies, else ``None``."""

Decided = Callable[[AttemptEnd, str, bool], "tuple[str, int] | None"]
"""A rule of the exit code: (the reason, the exit code) if it applies, else ``None``."""


def _finished(end: AttemptEnd) -> tuple[str, int] | None:
    return ("finished", 0) if end.status == 0 else None


def _permanent_storage_error(end: AttemptEnd) -> tuple[str, int] | None:
    if end.status != EXIT_PERMANENT:
        return None
    return "permanent storage error (exit 74)", EXIT_PERMANENT


def _another_runs_directory(end: AttemptEnd) -> tuple[str, int] | None:
    if end.status != EXIT_FOREIGN_RUN:
        return None
    stop = end.stop
    said = stop.get("reason") if stop is not None and stop.get("foreign") else None
    why = f": {said}" if said else (
        ": other parameters than those recorded there; not retrying (give these parameters "
        "a directory of their own, or delete it)"
    )  # fmt: skip
    return (
        f"the checkpoint directory belongs to another run (exit {EXIT_FOREIGN_RUN}){why}",
        EXIT_FOREIGN_RUN,
    )


_PASSED_THROUGH: tuple[Callable[[AttemptEnd], tuple[str, int] | None], ...] = (
    _finished,
    _permanent_storage_error,
    _another_runs_directory,
)
"""The program's own verdicts (:data:`resilient.job.exitcodes.PASSED_THROUGH`), said and
passed on as they are."""


def _killed(end: AttemptEnd) -> bool:
    return end.status < 0 or end.sent is not None


def _stopped_early(end: AttemptEnd) -> tuple[str, bool] | None:
    if end.status != EXIT_RESUME:
        return None
    return "stopped early (checkpointed and exited 75)", _killed(end)


def _stopped_before_its_first_checkpoint(end: AttemptEnd) -> tuple[str, bool] | None:
    if not (end.status > 0 and end.stop is not None and end.stop.get("saved") is False):
        return None
    return _stopped_before_first_checkpoint(end.stop, end.walltime_s), False  # on its own


def _lost_a_node(end: AttemptEnd) -> tuple[str, bool] | None:
    if end.lost is None:
        return None
    reason = f"Slurm lost node {end.lost} under it"
    if not end.progress:
        reason += "; not counted as an attempt without progress"
    return reason, True  # from outside: 75 after progress, and never a crash


def _killed_from_outside(end: AttemptEnd) -> tuple[str, bool] | None:
    if end.outside is None:
        return None
    reason = (
        f"killed from outside ({end.outside}: a lost node, a preemption, the OOM killer or a kill)"
    )
    if not end.progress:
        reason += "; not counted as an attempt without progress"
    return reason, _killed(end)


def _killed_by_a_signal(end: AttemptEnd) -> tuple[str, bool] | None:
    if not _killed(end):
        return None
    name = end.sent or signal.Signals(-end.status).name
    reason = f"killed ({name})" if end.status < 0 else f"exited {end.status} after {name}"
    if end.before_first_step is not None and end.sent is not None:
        reason = f"{end.before_first_step}; {reason}"
    return reason, True


def _launcher_failed_after_a_stop(end: AttemptEnd) -> tuple[str, bool] | None:
    """The program's Session stopped, checkpointed and recorded it, yet the command exited
    nonzero: a launcher between (``torchrun``, whose agent reports its workers' exit 75 as a
    failure and exits 1; ``srun`` passing that on, or its task's death by a signal as 128+N)
    that a signal from outside reached too (Slurm's ``--signal`` of a job step)."""
    stop = end.stop
    if not (end.status > 0 and end.progress and stop is not None and stop.get("saved") is True):
        return None
    why = str(stop.get("reason") or "stop requested")
    return f"exited {end.status} after its Session's stop ({why})", True


def _launcher_failed_after_the_run_finished(end: AttemptEnd) -> tuple[str, bool] | None:
    """The program's Session finished its loop and saved its last step, yet the command exited
    nonzero: seen with ``srun torchrun`` when Slurm's ``--signal`` reaches the agent as its
    workers finish (the agent then exits 1). 75 like a stop: the next attempt restores the last
    step and finishes at once; a program that fails after its loop every time makes no
    progress the next time, and ends in 93."""
    if not (end.status > 0 and end.progress and end.finished):
        return None
    return f"exited {end.status} after its Session finished its loop and saved its last step", True


def _crashed(end: AttemptEnd) -> tuple[str, bool] | None:
    return f"crashed (exit {end.status})", False


WHAT_HAPPENED: tuple[Happened, ...] = (
    _stopped_early,
    _stopped_before_its_first_checkpoint,
    _lost_a_node,
    _killed_from_outside,
    _killed_by_a_signal,
    _launcher_failed_after_a_stop,
    _launcher_failed_after_the_run_finished,
    _crashed,
)
"""What happened to an attempt the program did not end with its own verdict: the first rule
that applies says it."""


def _no_progress_for_too_long(end: AttemptEnd, reason: str, killed: bool) -> tuple[str, int] | None:
    if end.progress or end.no_progress_run < end.max_no_progress:
        return None
    return f"{reason}; no progress in {end.no_progress_run} consecutive attempts", EXIT_NO_PROGRESS


def _resume_after_progress(end: AttemptEnd, reason: str, killed: bool) -> tuple[str, int] | None:
    if end.status != EXIT_RESUME:
        return None
    if end.progress:
        return reason, EXIT_RESUME
    return f"{reason}, but no newer checkpoint exists", 1  # 75 promises progress


def _killed_after_progress(end: AttemptEnd, reason: str, killed: bool) -> tuple[str, int] | None:
    if not (killed and end.progress):
        return None
    return f"{reason} after a newer checkpoint", EXIT_RESUME


def _the_programs_own(end: AttemptEnd, reason: str, killed: bool) -> tuple[str, int] | None:
    return reason, (128 - end.status) if end.status < 0 else end.status


EXIT_CODE: tuple[Decided, ...] = (
    _no_progress_for_too_long,
    _resume_after_progress,
    _killed_after_progress,
    _the_programs_own,
)
"""Which exit code an attempt's end makes: the first rule that applies decides."""


def classify(end: AttemptEnd) -> tuple[str, int]:
    """(reason, exit code) of one attempt, per the contract (:mod:`resilient.job.run`)."""
    for rule in _PASSED_THROUGH:
        if (said := rule(end)) is not None:
            return said
    happened = (rule(end) for rule in WHAT_HAPPENED)
    reason, killed = next(got for got in happened if got is not None)
    decided = (rule(end, reason, killed) for rule in EXIT_CODE)
    return next(got for got in decided if got is not None)


def _stopped_before_first_checkpoint(stop: Mapping[str, Any], walltime_s: float | None) -> str:
    """Why an attempt stopped before its first checkpoint, from the program's stop record."""
    margin, left = stop.get("margin_s"), stop.get("time_left_at_start_s")
    why = str(stop.get("reason") or "stop requested")
    if isinstance(margin, (int, float)) and isinstance(left, (int, float)) and left < margin:
        if left <= 0:
            return (
                "stopped before its first checkpoint: the deadline had passed when it started "
                f"({why})"
            )
        if walltime_s is not None and walltime_s >= margin:  # a slow start, not a short walltime
            return (
                f"stopped before its first checkpoint: it started {say_seconds(walltime_s - left)} "
                f"into its walltime of {say_seconds(walltime_s)}, leaving {say_seconds(left)}, less "
                f"than the program's stop margin {say_seconds(margin)} ({why})"
            )
        walltime = walltime_s if walltime_s is not None else left
        return (
            f"stopped before its first checkpoint: walltime {say_seconds(walltime)} is shorter than "
            f"the program's stop margin {say_seconds(margin)} ({say_seconds(left)} left when it "
            f"started; {why})"
        )
    return f"stopped before its first checkpoint ({why})"


NO_DIRECTORY = (
    "the program has no checkpoint directory: its Session was given none, and resilient run "
    f"had no --checkpoint-dir to give it (${ENV_CHECKPOINT_DIR}). Give `resilient run "
    "--checkpoint-dir DIR`, or give the program's Session a directory; not retrying (exit "
    f"{EXIT_CONFIG})"
)


def before_first_step(elapsed: float, walltime_s: float | None, *, session: bool) -> str | None:
    """Why an attempt that the walltime ended made no progress, when no first step of it was
    recorded: its start-up used the walltime (``session``: the program is known to record its
    steps, through a Session)."""
    if walltime_s is None:
        return None
    took = f"start-up took over {say_seconds(elapsed)} of the {say_seconds(walltime_s)} walltime"
    if session:
        return f"ended before its first step: {took}"
    return (
        f"ended before a first step was recorded: {took}, or the program records no steps "
        "(no Session)"
    )


def resumed_from(record: AttemptRecord) -> str:
    """How the attempt began, for its log line."""
    if record.passed_over:
        skipped = ", ".join(map(str, record.passed_over))
        where = f"step {record.restored_step}" if record.restored_step is not None else "scratch"
        return f"resumed from {where} (step {skipped} failed validation: quarantined)"
    if record.restored_step is not None:
        return f"resumed from step {record.restored_step}"
    if record.latest_before is not None:  # no Session record: what the quick check found
        return f"latest valid step at the start {record.latest_before}"
    return "started from scratch"


def refusal(decided: Verdict, ckdir: Path, invocation: Invocation) -> str:
    """Why an engine's retry is refused at once, and what a person does about it."""
    retry = f" ({invocation.retry})" if invocation.retry else ""
    if decided.refuse == EXIT_CONFIG and decided.reason == NO_DIRECTORY:
        return (
            f"{decided.reason}. Not starting the program again for this retry{retry}; the "
            f"attempts' ledger is {ckdir / filenames.ATTEMPT_LEDGER}"
        )
    if decided.refuse == EXIT_FOREIGN_RUN:
        return (
            f"the checkpoint directory {ckdir} belongs to another run: {decided.reason}. Not "
            f"starting the program again for this retry{retry} (exit {EXIT_FOREIGN_RUN}); give "
            "these parameters a directory of their own, or delete it"
        )
    return (
        f"{decided.reason}, in {ckdir}: not starting again for this retry{retry} (exit "
        f"{EXIT_NO_PROGRESS}). Fix the cause, then start the workflow again: a new run (a new "
        f"snakemake or Parsl run, a changed command or program file) starts the task again, "
        f"an engine's retry does not; or remove {ckdir / filenames.ATTEMPT_LEDGER}"
    )


def say_mismatch(where: Where, root: Path) -> None:
    """One warning when the program's Session uses another directory than --checkpoint-dir."""
    given = where.given
    if given is None or "mismatch" in where.warned:
        return
    if same_dir(root, given):
        return
    where.warned.add("mismatch")
    log.warning(
        "the program keeps its checkpoints in %s, not in the --checkpoint-dir %s given to "
        "resilient run: progress is judged on %s (the ledger stays in %s). Give resilient "
        "run --checkpoint-dir %s, or let the program's Session take its directory from $%s "
        "(no checkpoint_dir)", root, given, root, given, root, ENV_CHECKPOINT_DIR,
    )  # fmt: skip


_STARTUPS = 5  # the compute a walltime should leave, in start-ups


def say_startup(
    where: Where,
    record: AttemptRecord,
    walltime_s: float | None,
    before_first_step: bool,
    hint: Callable[[], str | None] = lambda: None,
) -> None:
    """Once per invocation: a warning when the walltime leaves less than five start-ups of
    compute (or did not cover the start-up at all), with ``hint()``, a faster start the MPI
    offers (:func:`resilient.job.launch.startup_hint`), where there is one."""
    if walltime_s is None or "startup" in where.warned:
        return
    took = record.startup_s
    if took is not None:
        where.warned.add("startup")
        if walltime_s - took >= _STARTUPS * took:
            return
        faster = hint()
        log.warning(
            "start-up (launch to the first step) took %s of the %s walltime: that leaves %s of "
            "compute per attempt, less than %d start-ups, and every stop costs another "
            "start-up. Give a walltime of at least %s, or make the program start faster%s",
            say_seconds(took), say_seconds(walltime_s), say_seconds(max(0.0, walltime_s - took)),
            _STARTUPS, say_seconds((_STARTUPS + 1) * took), f" ({faster})" if faster else "",
        )  # fmt: skip
    elif before_first_step:
        where.warned.add("startup")
        log.warning(
            "the program did not reach its first step within its %s walltime: give a walltime "
            "of at least %d times its start-up, or make it start faster",
            say_seconds(walltime_s), _STARTUPS + 1,
        )  # fmt: skip
