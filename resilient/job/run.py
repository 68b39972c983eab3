"""``resilient run [options] -- CMD ...``: run a program resumably, with an exit-code contract.

Engine-neutral: used from Snakemake rules, Parsl bash apps and sbatch scripts. Per attempt it
runs CMD in its own process group, forwards stop signals, optionally plays a local walltime
(warning signal, SIGTERM, SIGKILL: Slurm's sequence), and appends one JSON line to the ledger
``CHECKPOINT_DIR/attempts.jsonl``. Every line it logs names the task, ``resilient run [sim
case=a]: attempt 2: ...``: ``--task`` as given, else the checkpoint directory's last two path
components (:func:`~resilient.job.options.task_label`), so the lines of concurrent runs in one
log are told apart. This module is the loop; its pieces are rooms of their own, listed in
:mod:`resilient.job` (options, ledger, process, outcome, outputs, requeue, protocol).

The program's :class:`~resilient.job.session.Session` tells ``resilient run`` which directory
it actually uses (:mod:`resilient.job.handoff`), and progress is judged there: with a
``--checkpoint-dir`` that differs from it, one warning names both and the fix (the ledger stays
in ``--checkpoint-dir``); without ``--checkpoint-dir`` the ledger is kept in the program's
directory once known, before that in the task's own directory (``STATE/tasks/<key>``, keyed by
the working directory, the command and ``--task``, where the next invocation of the same task
finds it), so attempts are numbered and 93 comes after ``--max-no-progress`` attempts without
progress either way. A program whose Session was given no directory at all says so on rank 0,
every rank exits 78, and ``resilient run`` ends the task with 78 and the fix. Each ledger line
records the attempt's start-up (``startup_s``: launch to the first step, from the Session's
timeline); an attempt that the walltime ended before its first step says so, with its start-up
and the walltime, and the first attempt warns when the walltime leaves less than five
start-ups of compute.

Exit codes (the contract):

* ``0``  the program finished;
* ``75`` stopped early but made progress (a newer valid checkpoint exists): resume me;
* ``93`` no progress for ``--max-no-progress`` consecutive attempts: do not retry;
* ``74`` a permanent storage error (disk full, permission denied, read-only): do not retry
  blindly (passed through from the program);
* ``78`` the checkpoint directory belongs to another run (the program's ``run_key`` differs from
  the one recorded there, or the restored arrays have another shape): do not retry; give the
  parameters a directory of their own (passed through from the program, which exits 78 through
  :class:`~resilient.job.session.Session`);
  ``resilient run`` itself exits 78 too, without starting the program, when the checkpoint
  directory is the workflow engine's rather than this run's: it is, or lies inside, one of the
  task's declared ``--outputs``, or it vanished since the last unfinished attempt (see below);
* anything else: the program's own failure, passed through (``128 + N`` if killed by signal N).

A checkpoint directory that an engine deletes between attempts (Snakemake deletes a job's
declared outputs before every retry and after a failure) would make every attempt start again
from step 0, silently. Two checks stop that:

* ``--outputs PATH...`` (and ``--task NAME`` for the message): the task's declared outputs; if
  the checkpoint directory is one of them or lies inside one, exit 78 before the first attempt.
  The Snakemake helper :func:`resilient.integrations.snakemake.resilient_run` passes them,
  and so do the Parsl ones given ``outputs=``. The outputs' folders are created before the
  program starts (Snakemake does that for its jobs, Parsl does not).
* For a prefix written by hand: after each attempt a record goes to ``PARENT/.NAME.resilient-
  attempts``, beside the checkpoint directory, where an engine that deletes the directory
  leaves it. If that record ends with an unfinished attempt and the directory is no longer a
  checkpoint root (missing, or empty: its ``.resilient-root`` marker is gone), the directory was
  deleted between attempts: exit 78 with the fix, instead of starting again from step 0. (A
  directory deleted together with its parent is not seen; the ``--outputs`` check covers
  that.) To start over on purpose, delete the record too.

After a run ended with 93 or 78, an engine's retry of it is refused at once, without starting
the program, while a new run (a new ``snakemake`` or Parsl script, a command typed by hand, a
changed command or program file) starts again with one logged line; attempts killed from
outside do not count towards 93 (:mod:`resilient.job.guard`). When the program refuses a
directory of another run (78), the declared ``--outputs`` on disk are renamed out of the way.

A program using :class:`~resilient.job.session.Session` that stops early (deadline, signal) records
why in ``CHECKPOINT_DIR/stops.jsonl``. An attempt that stopped that way before its first
checkpoint (it exits 1) is reported as such, not as a crash; it made no progress, so it counts
towards ``--max-no-progress`` like any attempt without progress (the same walltime would stop
the same way again), and ``--retries`` does not relaunch it.

With ``--requeue`` and a simulated ``--walltime`` a walltime stop does not end the run: the
program starts again at once with a new walltime, as a requeued job would (Slurm's ``scontrol
requeue`` keeps the job and its ID), so an engine around ``resilient run`` sees one job however
many walltime stops it takes. The run ends when the program finishes (0), after
``--max-no-progress`` consecutive stops without progress (93), on exit 74, on a crash (after
``--retries``), or when a stop signal comes from outside (75: the engine decides).

With ``--requeue`` inside a Slurm batch job (no ``--walltime``) that requeue is Slurm's: after a
stop at the job's own time limit that made progress, ``resilient run`` asks Slurm to requeue
the job in place and exits; where Slurm refuses it exits 75 with one warning
(:mod:`resilient.job.requeue`). Each ledger line records ``SLURM_RESTART_COUNT``.

Progress counts the node-local tier too: an attempt made progress when the newest step a
restart can resume from rose, on the shared root or as a node-local checkpoint whose partner
copies committed (``protected.jsonl``: it survives the loss of a node). An attempt that failed
in a Slurm job whose nodes Slurm says it lost meanwhile (down, failed or not responding:
:mod:`resilient.job.nodeloss`) is recorded as such (``lost_nodes``): 75 after progress, and
never counted towards 93.

Inside a Slurm job step with fewer nodes than its job (a multi-node Snakemake rule without the
executor plugin's ``mpi`` resource) it says so; under a Snakemake job it does not start the
program and exits 78, naming the rule and the fix (:mod:`resilient.job.steps`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.io import storage
from resilient.io.checkpoints import latest_valid, protected_steps, resumable_step
from resilient.job import flux, handoff, nodeloss, requeue
from resilient.job.exitcodes import (
    EXIT_CONFIG,
    EXIT_FOREIGN_RUN,
    EXIT_RESUME,
    of_the_contract,
    passed_through,
)
from resilient.job.guard import (
    SNAKEMAKE_JOB,
    Invocation,
    interrupted_from_outside,
    trailing_no_progress,
    verdict,
)
from resilient.job.launch import startup_hint
from resilient.job.ledger import AttemptRecord, Where, note_beside, same_dir, where_for
from resilient.job.options import (
    RunOptions,
    build_parser,
    options_from_args,
    say_seconds,
    task_label,
)
from resilient.job.outcome import (
    NO_DIRECTORY,
    AttemptEnd,
    before_first_step,
    classify,
    refusal,
    resumed_from,
    say_mismatch,
    say_startup,
)
from resilient.job.outputs import make_output_folders, not_this_runs, set_aside
from resilient.job.process import Attempt, Signals
from resilient.job.protocol import (
    ENV_ATTEMPT,
    ENV_CHECKPOINT_DIR,
    ENV_DEADLINE,
    ENV_HANDOFF,
    program_stop,
)
from resilient.job.slurm import find_deadline
from resilient.job.steps import narrow_step
from resilient.job.timeline import AttemptEvents, read_events

__all__ = ["main", "run", "run_command_line"]

log = logging.getLogger("resilient.job.run")


def _latest(checkpoint_dir: Path | None) -> int | None:
    """The newest step to resume from: the shared root's newest valid checkpoint, or a newer
    node-local one protected by partner copies."""
    return None if checkpoint_dir is None else resumable_step(checkpoint_dir)


def _latest_after(checkpoint_dir: Path | None, start: float) -> tuple[int | None, int | None]:
    """After an attempt that began at ``start``: the newest step to resume from, and the same
    counting only the partner copies recorded since ``start`` (what the attempt itself
    protected), from one scan of the shared root."""
    if checkpoint_dir is None:
        return None, None
    record = latest_valid(checkpoint_dir)
    shared = set() if record is None else {record.step}
    newest = max(shared | protected_steps(checkpoint_dir), default=None)
    made = max(shared | protected_steps(checkpoint_dir, since=start), default=None)
    return newest, made


def run(opts: RunOptions, *, environ: Mapping[str, str] | None = None) -> int:
    """Run ``opts.command`` per the exit-code contract; return the exit code."""
    env = dict(os.environ if environ is None else environ)
    ckdir = opts.checkpoint_dir
    slurm_job = requeue.slurm_job(opts, env)
    invocation = Invocation.here(opts.command, env)
    fresh: list[str] = []  # why an ended run starts again: for its first attempt's record
    narrow = narrow_step(env)
    if narrow is not None:
        if invocation.engine == SNAKEMAKE_JOB:  # the executor plugin's one-task step
            log.error("%s", narrow.message(opts.task, refuse=True))
            return EXIT_CONFIG
        log.warning("%s", narrow.message(opts.task, refuse=False))
    ready = False
    if slurm_job is not None:
        ready, line = slurm_job.readiness()
        (log.info if ready else log.warning)("%s", line)
    if ckdir is not None:
        engines = not_this_runs(opts, ckdir)
        if engines is not None:
            log.error("%s", engines)
            return EXIT_FOREIGN_RUN
        storage.ensure_root(ckdir)
        env[ENV_CHECKPOINT_DIR] = str(ckdir)
    where = where_for(opts.checkpoint_dir, opts.command, opts.task, env)
    if where.handoff_file is not None:
        env[ENV_HANDOFF] = str(where.handoff_file)
    ledger_dir = where.ledger_dir
    if ledger_dir is not None:
        decided = verdict(where.ledger(), invocation, max_no_progress=opts.max_no_progress)
        if decided.refuse is not None:
            log.error("%s", refusal(decided, ledger_dir, invocation))
            return decided.refuse
        if decided.new_run is not None:
            log.info("a new run of this task: %s", decided.new_run)
            fresh.append(decided.new_run)
    make_output_folders(opts.outputs)

    # stop signals passed on to the program (in a Flux job also SIGALRM, its time limit)
    handled = (
        signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT,
        *flux.time_limit_signals(env),
    )  # fmt: skip
    signals = Signals()
    unheard = signals.unheard
    job = slurm_job or requeue.job_facts(env)
    nodelist = nodeloss.job_nodelist(env, known=job.nodelist if job else None)
    previous = {s: signal.signal(s, signals.forward) for s in handled}
    try:
        while True:
            code, record, attempt = _Job(
                opts, env, signals, invocation, fresh, nodelist, where
            ).run()
            if slurm_job is not None:
                return requeue.after_job(opts, slurm_job, ready, (code, record, attempt), unheard)
            if not (opts.requeue and requeue.stopped_by_walltime(code, record, attempt)):
                return code
            if unheard:  # asked to stop between two launches: the engine decides
                log.info(
                    "%s before the requeue: not starting again", signal.Signals(unheard[0]).name
                )
                return code
            log.info(
                "requeued after attempt %d (%s): starting again with a new walltime of %s",
                record.attempt, "progress" if record.progress else "no progress",
                say_seconds(float(opts.walltime_s or 0)),
            )  # fmt: skip
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@dataclass(slots=True)
class _Job:
    """One allocation: its deadline and the program's attempts in it (``--retries``: crashes
    are relaunched while time is left).

    ``fresh`` holds why an ended run starts again, taken by the first attempt's record;
    ``nodelist``: the Slurm job's nodes, asked about after a failed attempt; ``where``: the
    task's directories (what the program's Session tells is learned after each attempt).
    """

    opts: RunOptions
    env: dict[str, str]
    signals: Signals
    invocation: Invocation
    fresh: list[str]
    nodelist: str
    where: Where
    deadline: float | None = None

    def run(self) -> tuple[int, AttemptRecord, Attempt]:
        """The exit code, and the last attempt's record and run."""
        from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_exponential

        opts = self.opts
        if opts.walltime_s is not None:
            self.deadline = time.time() + opts.walltime_s
        else:
            self.deadline, _ = find_deadline(self.env)
        if self.deadline is not None:
            self.env[ENV_DEADLINE] = f"{self.deadline:.3f}"
        retrying = Retrying(
            stop=stop_after_attempt(opts.retries + 1),
            wait=wait_exponential(multiplier=opts.backoff_s, max=opts.backoff_max_s),
            retry=retry_if_result(self._relaunch),
            before_sleep=self._say_relaunch,
            retry_error_callback=_last_result,
        )
        code, record, last = retrying(self.attempt)
        return int(code), record, last

    def attempt(self) -> tuple[int, AttemptRecord, Attempt]:
        """One launch of the program: judged, classified, recorded in the ledger and logged."""
        ledger = self.where.ledger()
        record, attempt, told, judged = self._launch(len(ledger) + 1)
        events = self._judge_progress(record, judged)
        end = self._end(record, attempt, ledger, events)
        record.reason, record.exit_code = classify(end)
        if told is not None and told.root is None:  # the program has no directory at all
            record.reason, record.exit_code = NO_DIRECTORY, EXIT_CONFIG
            log.error("%s", NO_DIRECTORY)
        ckdir = self.opts.checkpoint_dir
        if end.status == EXIT_FOREIGN_RUN and ckdir is not None and record.exit_code == end.status:
            set_aside(self.opts.outputs, ckdir)
        self.where.append(record)
        if ckdir is not None:
            note_beside(ckdir, record.attempt, record)
        log.info(
            "attempt %d: %s; %s; newest step to resume from now %s; exit %d",
            record.attempt, record.reason, resumed_from(record), record.latest_after,
            record.exit_code,
        )  # fmt: skip
        walltime = _walltime_of(self.opts, self.deadline, record.start)
        say_startup(
            self.where, record, walltime, end.before_first_step is not None,
            hint=lambda: startup_hint(self.opts.command, self.env),
        )  # fmt: skip
        return record.exit_code, record, attempt

    def _launch(
        self, number: int
    ) -> tuple[AttemptRecord, Attempt, handoff.HandOff | None, Path | None]:
        """Run the program as attempt ``number``: its record so far, its run, what its Session
        told (if anew) and the directory its newest step before was read from."""
        where, env = self.where, self.env
        env[ENV_ATTEMPT] = str(number)
        judged = where.progress_dir
        record = AttemptRecord(
            attempt=number,
            start=time.time(),
            latest_before=_latest(judged),
            slurm_job_id=env.get("SLURM_JOB_ID"),
            slurm_restart_count=requeue.restart_count(env),
            command=list(self.opts.command),
            new_run=self.fresh.pop() if self.fresh else None,
            **self.invocation.to_record(),
        )
        stamp = where.handoff_stamp()
        attempt = Attempt(self.opts, env, self.deadline)
        self.signals.attempt = attempt
        record.exit_status, record.signal = attempt.run()
        self.signals.attempt = None
        record.end = time.time()
        told = where.learn() if where.handoff_stamp() != stamp else None
        if told is not None and told.root is not None:
            say_mismatch(where, told.root)
        return record, attempt, told, judged

    def _judge_progress(
        self, record: AttemptRecord, judged: Path | None
    ) -> AttemptEvents | None:
        """Whether the attempt made progress, on the directory the program uses (``judged``:
        where the newest step before was read); the attempt's timeline events, if any."""
        where = self.where
        ckpt = where.progress_dir
        record.program_dir = str(where.program) if where.program is not None else None
        learned = not same_dir(ckpt, judged)  # the program named its directory only now
        if learned:
            record.latest_before = None
        record.latest_after, made = _latest_after(ckpt, record.start)
        events = _note_restore(ckpt, record)
        base = record.restored_step if record.restored_step is not None else record.latest_before
        record.progress = made is not None and (base is None or made > base)
        if learned and (events is None or not events.timed):
            record.progress = False  # its checkpoints there are older than this attempt
        return events

    def _end(
        self,
        record: AttemptRecord,
        attempt: Attempt,
        ledger: list[dict[str, Any]],
        events: AttemptEvents | None,
    ) -> AttemptEnd:
        """What ``resilient run`` saw of the attempt's end (put into its record too)."""
        status, sent = int(record.exit_status or 0), record.signal
        record.interrupted = interrupted_from_outside(status, sent)
        lost = _lost_nodes(status, self.nodelist)
        record.lost_nodes = [node.name for node in lost]
        no_progress_run = 0
        if not record.progress and status != 0 and record.interrupted is None and not lost:
            earlier = 0 if record.new_run else trailing_no_progress(ledger)
            here = trailing_no_progress(self.where.mine)  # this invocation's, wherever its ledger
            no_progress_run = 1 + max(earlier, here)
        record.program_stop = program_stop(
            self.where.progress_dir, attempt=record.attempt, start=record.start, end=record.end
        )
        first_step = None
        if (
            sent is not None
            and not passed_through(status)
            and not record.progress
            and record.startup_s is None
            and not attempt.forwarded
        ):
            first_step = before_first_step(
                record.end - record.start, self.opts.walltime_s, session=self.where.told
            )
        return AttemptEnd(
            status=status,
            sent=sent,
            progress=record.progress,
            no_progress_run=no_progress_run,
            max_no_progress=self.opts.max_no_progress,
            stop=record.program_stop,
            walltime_s=self.opts.walltime_s,
            outside=record.interrupted,
            lost=", ".join(node.describe() for node in lost) or None,
            before_first_step=first_step,
            finished=events is not None and events.finished,
        )

    def _relaunch(self, result: tuple[int, AttemptRecord, Attempt]) -> bool:
        """Whether the attempt crashed (no code of the contract, no stop signal, no stop of its
        own: deadline, signal) while time is left: relaunch it (``--retries``)."""
        code, rec, _ = result
        if of_the_contract(code) or rec.signal is not None or rec.program_stop is not None:
            return False
        return self.deadline is None or time.time() < self.deadline

    def _say_relaunch(self, rs: Any) -> None:
        log.warning(
            "program crashed (attempt %d of %d); retrying from the latest valid checkpoint in %.1f s",
            rs.attempt_number,
            self.opts.retries + 1,
            rs.next_action.sleep if rs.next_action else 0.0,
        )


def _lost_nodes(status: int, nodelist: str) -> list[nodeloss.LostNode]:
    """After an attempt that failed in a Slurm job: the job's nodes Slurm says it lost."""
    if passed_through(status) or status == EXIT_RESUME or not nodelist:
        return []
    return nodeloss.lost_nodes(nodelist)


def _note_restore(checkpoint_dir: Path | None, record: AttemptRecord) -> AttemptEvents | None:
    """The step the program restored in this attempt and its start-up (launch to the first
    step), from its Session's timeline (none without a Session, or when it was killed before
    its restore); the attempt's events."""
    if checkpoint_dir is None:
        return None
    events = AttemptEvents.of(read_events(checkpoint_dir), record.start, record.end)
    if events.timed and events.restored_at is not None:
        record.restored_step = events.restored_step if events.resumed else None
        record.passed_over = list(events.passed_over)
        record.startup_s = round(max(0.0, events.restored_at - record.start), 3)
    return events


def _walltime_of(opts: RunOptions, deadline: float | None, start: float) -> float | None:
    """The attempt's walltime: the simulated one, else the time its deadline left it."""
    if opts.walltime_s is not None:
        return opts.walltime_s
    return None if deadline is None else max(0.0, deadline - start)


def _last_result(rs: Any) -> tuple[int, AttemptRecord, Attempt]:
    """What tenacity returns once it stops retrying: the last attempt's result."""
    result: tuple[int, AttemptRecord, Attempt] = rs.outcome.result()
    return result


def run_command_line(opts: RunOptions) -> int:
    """Log to stderr (``resilient run [TASK]: ...``, :func:`~resilient.job.options.task_label`) and :func:`run`:
    what the command line does."""
    label = task_label(opts).replace("%", "%%")  # a literal in the format
    logging.basicConfig(
        level=logging.INFO, format=f"resilient run [{label}]: %(message)s", stream=sys.stderr
    )
    return run(opts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``resilient run`` (also ``python -m resilient.job.run``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args, environ=os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    return run_command_line(opts)
