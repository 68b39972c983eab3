"""``resilient run [options] -- CMD ...``: run a program resumably, with an exit-code contract.

Engine-neutral: used from Snakemake rules, Parsl bash apps and sbatch scripts. Per attempt it
runs CMD in its own process group, forwards stop signals, optionally plays a local walltime
(warning signal, SIGTERM, SIGKILL: Slurm's sequence), and appends one JSON line to the ledger
``CHECKPOINT_DIR/attempts.jsonl``. Every line it logs names the task, ``resilient run [sim
case=a]: attempt 2: ...``: ``--task`` as given, else the checkpoint directory's last two path
components (:func:`task_label`), so the lines of concurrent runs in one log are told apart.

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

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilient.io import logs, storage
from resilient.io.checkpoints import latest_valid, protected_steps, resumable_step
from resilient.job import handoff, nodeloss, requeue, warning
from resilient.job.exitcodes import (
    EXIT_CONFIG,
    EXIT_FOREIGN_RUN,
    EXIT_NO_PROGRESS,
    EXIT_PERMANENT,
    EXIT_RESUME,
)
from resilient.job.guard import (
    SNAKEMAKE_JOB,
    Invocation,
    Verdict,
    interrupted_from_outside,
    trailing_no_progress,
    verdict,
)
from resilient.job.slurm import (
    ENV_ATTEMPT,
    ENV_CHECKPOINT_DIR,
    ENV_DEADLINE,
    ENV_HANDOFF,
    find_deadline,
    parse_signal,
)
from resilient.job.steps import narrow_step
from resilient.job.timeline import AttemptEvents, read_events
from resilient.model import filenames

__all__ = [
    "EXIT_PERMANENT",
    "AttemptRecord",
    "RunOptions",
    "main",
    "parse_duration",
    "run",
    "run_command_line",
    "sidecar_path",
    "task_label",
]

log = logging.getLogger("resilient.job.run")

_POLL_S = 0.05


DURATION_FORMS = (
    "a bare number of seconds (90; Slurm's bare number means minutes, this one does not), "
    "a number with a unit (90s, 5m, 1.5h, 1d), units combined from days down to seconds "
    "(23h50m, 1h30m15s, 2d4h), MM:SS, HH:MM:SS, or Slurm's D-HH, D-HH:MM, D-HH:MM:SS"
)

_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_NUMBER = r"\d+(?:\.\d+)?"
_UNITS_RE = re.compile(
    "".join(rf"(?:({_NUMBER})\s*{unit}\s*)?" for unit in _UNIT_S)  # days down to seconds
)


def parse_duration(text: str) -> float:
    """A duration in seconds.

    A bare number means SECONDS (``90``), unlike Slurm's ``--time``, where it means minutes.
    Also: a number with a unit (``90s``, ``5m``, ``1.5h``, ``1d``), units combined from days
    down to seconds, each at most once (``23h50m``, ``1h30m15s``, ``2d4h``), ``MM:SS``,
    ``HH:MM:SS``, and Slurm's day forms ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.

    Raises:
        ValueError: not a duration (the message lists the accepted forms).
    """
    t = text.strip()
    if re.fullmatch(_NUMBER, t):
        return float(t)  # a bare number: seconds
    m = _UNITS_RE.fullmatch(t)
    if t and m:
        return sum(float(v) * s for v, s in zip(m.groups(), _UNIT_S.values(), strict=True) if v)
    days = 0
    m = re.fullmatch(r"(\d+)-(\d+(?::\d+){0,2})", t)
    if m:  # Slurm: days-hours[:minutes[:seconds]]
        days, t = int(m.group(1)), m.group(2)
        parts = [int(x) for x in t.split(":")] + [0] * (3 - len(t.split(":")))
    elif re.fullmatch(r"\d+:\d+(?::\d+)?", t):
        parts = [int(x) for x in t.split(":")]
        parts = [0, *parts] if len(parts) == 2 else parts  # MM:SS or HH:MM:SS
    else:
        raise ValueError(f"not a duration: {text!r}; use {DURATION_FORMS}")
    hours, minutes, seconds = parts
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def parse_signal_spec(text: str) -> tuple[signal.Signals, float]:
    """``"USR1@30"`` -> (SIGUSR1, 30.0); the lead after ``@`` is a duration
    (:func:`parse_duration`: a bare number is seconds).

    Raises:
        ValueError: not ``SIG@SECONDS``.
    """
    name, _, secs = text.partition("@")
    if not secs:
        raise ValueError(f"not SIG@SECONDS: {text!r} (e.g. USR1@60, USR1@5m)")
    return parse_signal(name), parse_duration(secs)


def _duration_arg(text: str) -> float:
    """:func:`parse_duration` as an argparse ``type=``: argparse prints an
    ``ArgumentTypeError``'s message (it drops a ``ValueError``'s)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _signal_spec_arg(text: str) -> tuple[signal.Signals, float]:
    """:func:`parse_signal_spec` as an argparse ``type=`` (see :func:`_duration_arg`)."""
    try:
        return parse_signal_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """Settings of one ``resilient run`` invocation."""

    command: tuple[str, ...]
    checkpoint_dir: Path | None = None
    walltime_s: float | None = None
    warn_signal: signal.Signals = signal.SIGUSR1
    warn_before_s: float | None = None
    kill_wait_s: float = 5.0
    max_no_progress: int = 2
    retries: int = 0
    requeue: bool = False
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    task: str | None = None  # the workflow task's name, on every line logged (task_label)
    outputs: tuple[Path, ...] = ()  # the task's declared outputs: never the checkpoint directory


@dataclass(slots=True)
class AttemptRecord:
    """One line of the attempt ledger."""

    attempt: int
    start: float
    end: float = 0.0
    exit_status: int | None = None
    signal: str | None = None
    reason: str = ""
    latest_before: int | None = None  # the newest checkpoint that passed the quick check
    restored_step: int | None = None  # the step the program restored (its Session's record)
    passed_over: list[int] = field(default_factory=list)  # newer steps it quarantined first
    latest_after: int | None = None
    progress: bool = False
    host: str = field(default_factory=socket.gethostname)
    slurm_job_id: str | None = None
    slurm_restart_count: int | None = None  # how often Slurm requeued the job (a requeue)
    command: list[str] = field(default_factory=list)
    exit_code: int = 0
    program_stop: dict[str, Any] | None = None  # the program's own stop record, if it wrote one
    interrupted: str | None = None  # the signal that killed it from outside (job.guard)
    lost_nodes: list[str] = field(default_factory=list)  # the job's nodes Slurm lost meanwhile
    fingerprint: str | None = None  # the invocation (job.guard.Invocation): command, files,
    engine: str | None = None  # ... the engine that started it ...
    retry: str | None = None  # ... and whether the engine says it retries
    new_run: str | None = None  # why a run that had ended started again with this attempt
    startup_s: float | None = None  # launch to the program's first step (its Session's timeline)
    program_dir: str | None = None  # the directory its Session said it uses (job.handoff)

    def to_record(self) -> dict[str, Any]:
        """The ledger line's fields (:data:`resilient.io.logs.ATTEMPTS`)."""
        return asdict(self)


def read_ledger(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """The ledger's valid records (damaged lines are skipped with one warning:
    :mod:`resilient.io.logs`)."""
    return logs.read_log(checkpoint_dir / filenames.ATTEMPT_LEDGER, logs.ATTEMPTS)


def program_stop(
    checkpoint_dir: Path | None, *, attempt: int, start: float, end: float
) -> dict[str, Any] | None:
    """The stop record a Session wrote during this attempt (``stops.jsonl``), if any."""
    if checkpoint_dir is None:
        return None
    found = None
    for rec in logs.read_log(checkpoint_dir / filenames.STOP_LOG, logs.STOPS):
        if not start <= rec["time"] <= end:
            continue
        if rec.get("attempt") in (None, attempt):
            found = rec
    return found


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 or value == int(value) else f"{value:.1f} s"


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
                f"stopped before its first checkpoint: it started {_seconds(walltime_s - left)} "
                f"into its walltime of {_seconds(walltime_s)}, leaving {_seconds(left)}, less "
                f"than the program's stop margin {_seconds(margin)} ({why})"
            )
        walltime = walltime_s if walltime_s is not None else left
        return (
            f"stopped before its first checkpoint: walltime {_seconds(walltime)} is shorter than "
            f"the program's stop margin {_seconds(margin)} ({_seconds(left)} left when it "
            f"started; {why})"
        )
    return f"stopped before its first checkpoint ({why})"


def sidecar_path(checkpoint_dir: Path) -> Path:
    """``PARENT/.NAME.resilient-attempts``: the attempts' outcomes, beside the directory."""
    path = Path(os.path.abspath(checkpoint_dir))
    return path.parent / filenames.attempt_sidecar_name(path.name)


def _containing_output(checkpoint_dir: Path, outputs: Sequence[Path]) -> Path | None:
    """The first output that is ``checkpoint_dir`` or a directory above it, else ``None``."""
    ck = Path(os.path.realpath(checkpoint_dir))
    for out in outputs:
        resolved = Path(os.path.realpath(out))
        if ck == resolved or resolved in ck.parents:
            return out
    return None


_KEEP_OUT_OF_OUTPUTS = (
    "Keep checkpoints out of a task's outputs: the engine deletes a task's declared outputs "
    "before every retry and after a failure (Snakemake does), so each attempt would start "
    "again from step 0. In Snakemake make the directory a param, "
    '`params: ckpt=lambda wc: checkpoint_dir("ckpt", "<rule>", ..., wildcards=wc)`, and '
    "pass it with `--checkpoint-dir {params.ckpt:q}` (resilient_run() does)"
)


def _not_this_runs(opts: RunOptions, ckdir: Path) -> str | None:
    """Why ``ckdir`` belongs to the engine rather than this run (exit 78), else ``None``."""
    task = f"task {opts.task!r}" if opts.task else "the task"
    out = _containing_output(ckdir, opts.outputs)
    if out is not None:
        where = "is" if Path(os.path.realpath(out)) == Path(os.path.realpath(ckdir)) else "lies in"
        return (
            f"the checkpoint directory {ckdir} {where} the declared output {out} of {task}. "
            f"{_KEEP_OUT_OF_OUTPUTS}. Not starting (exit {EXIT_FOREIGN_RUN})"
        )
    damaged = storage.marker_problem(ckdir)
    if damaged is not None:
        return f"{damaged}. Not starting (exit {EXIT_FOREIGN_RUN})"
    records = logs.read_log(sidecar_path(ckdir), logs.SIDECAR)
    last = records[-1] if records else None
    if last is None or last["exit_code"] == 0:
        return None
    if storage.is_root(ckdir):  # still the same root (a reset ledger is fine: the 93 advice)
        return None
    return (
        f"the checkpoint directory {ckdir} of {task} was deleted after attempt {last['attempt']} "
        f"(exit {last.get('exit_code')}), with its checkpoints and its logs: most likely it "
        f"is (or lies in) a declared output of the task. {_KEEP_OUT_OF_OUTPUTS}. Not starting "
        f"again from step 0 (exit {EXIT_FOREIGN_RUN}). If you deleted it yourself to start "
        f"over, delete {sidecar_path(ckdir)} too"
    )


def _note_beside(checkpoint_dir: Path, number: int, record: AttemptRecord) -> None:
    """Append the attempt's outcome to :func:`sidecar_path` (best effort, a warning if that
    fails: the record only serves the deleted-directory check, never the run itself)."""
    logs.append_record(
        sidecar_path(checkpoint_dir),
        {"attempt": number, "exit_code": record.exit_code, "time": record.end},
    )


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


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (MPI launchers put ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_tree(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the child's process group and every descendant."""
    targets = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass(slots=True)
class _Where:
    """Where one task's files are, as far as ``resilient run`` knows so far.

    ``given``: ``--checkpoint-dir``; ``own``: without it, the task's own directory
    (:func:`resilient.job.handoff.task_dir`); ``handoff_file``: the file the program's Session names
    its directory in; ``program``: the directory it named (``None``: not told yet).

    Progress is judged on the program's directory, else the given one. The ledger is kept in
    the given directory; without one, in the program's directory once known (where ``resilient
    report`` finds it; the records kept in the task's own directory until then move there),
    else in the task's own directory; with none writable, in memory for this invocation.
    """

    given: Path | None
    own: Path | None = None
    handoff_file: Path | None = None
    program: Path | None = None
    told: bool = False  # the program has a Session: it handed off, now or before
    mine: list[dict[str, Any]] = field(default_factory=list)  # this invocation's records
    warned: set[str] = field(default_factory=set)

    @property
    def progress_dir(self) -> Path | None:
        return self.program or self.given

    @property
    def ledger_dir(self) -> Path | None:
        if self.given is not None:
            return self.given
        if self.program is not None and self.program.is_dir():
            return self.program
        return self.own

    def ledger(self) -> list[dict[str, Any]]:
        """The task's attempts so far."""
        where = self.ledger_dir
        return read_ledger(where) if where is not None else list(self.mine)

    def handoff_stamp(self) -> tuple[int, int] | None:
        """The hand-off file's identity now (a Session replaces it: a new inode)."""
        if self.handoff_file is None:
            return None
        try:
            st = os.stat(self.handoff_file)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def learn(self) -> handoff.HandOff | None:
        """Read the hand-off; remember the program's directory it names."""
        told = handoff.read(self.handoff_file) if self.handoff_file is not None else None
        if told is not None:
            self.told = True
            if told.root is not None:
                self.program = told.root
        return told

    def append(self, record: AttemptRecord) -> None:
        """Add ``record`` to the ledger; its number may change where the ledger moves from
        the task's own directory to the program's (appended after the records there)."""
        self.mine.append(record.to_record())
        target = self.ledger_dir
        if target is None:
            return
        if self.given is None and self.own is not None and not _same_dir(target, self.own):
            pending = read_ledger(self.own)
            done = len(read_ledger(target))
            for i, rec in enumerate(pending):
                rec["attempt"] = done + i + 1
                logs.append_record(target / filenames.ATTEMPT_LEDGER, rec, durable=True)
            if pending:
                storage.remove_file(self.own / filenames.ATTEMPT_LEDGER)
                log.info("the attempts' ledger is now %s", target / filenames.ATTEMPT_LEDGER)
            record.attempt = done + len(pending) + 1
        logs.append_record(target / filenames.ATTEMPT_LEDGER, record.to_record(), durable=True)


def _same_dir(a: Path | None, b: Path | None) -> bool:
    """Whether ``a`` and ``b`` name the same directory (relative or not)."""
    if a is None or b is None:
        return a is b
    return os.path.realpath(a) == os.path.realpath(b)


def _where(opts: RunOptions, env: Mapping[str, str]) -> _Where:
    """Where this task's files are, before its first attempt (a hand-off an earlier
    invocation received names the program's directory)."""
    if opts.checkpoint_dir is not None:
        where = _Where(given=opts.checkpoint_dir, handoff_file=handoff.beside(opts.checkpoint_dir))
    else:
        own = handoff.task_dir(env, cwd=os.getcwd(), command=opts.command, task=opts.task)
        try:
            own.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning(
                "no --checkpoint-dir, and cannot create this task's own directory %s (%s): "
                "its attempts are counted for this invocation only", own, exc,
            )  # fmt: skip
            where = _Where(given=None)
        else:
            where = _Where(given=None, own=own, handoff_file=own / handoff.HANDOFF_FILE)
    where.learn()
    return where


class _Attempt:
    """One launch of the command, with timers and signal forwarding."""

    def __init__(self, opts: RunOptions, env: Mapping[str, str], deadline: float | None) -> None:
        self.opts = opts
        self.env = env
        self.deadline = deadline
        self.pending: list[int] = []
        self.forwarded: list[str] = []  # signals from outside, passed on to the program

    def run(self) -> tuple[int, str | None]:
        """Run to completion; return (exit status or -signal, our last signal sent).

        The program starts with the warning signal blocked and named in
        ``$RESILIENT_WARN_SIGNALS`` (:mod:`resilient.job.warning`): one that arrives before it
        listens waits, instead of killing it, until its ``StopSignals`` takes it.
        """
        warn = self.opts.warn_signal
        env = dict(self.env)
        held = (warn,) if warning.is_warning(warn) else ()
        if held:
            env[warning.ENV_WARN_SIGNALS] = warn.name
        with warning.blocked(held):
            proc = subprocess.Popen(list(self.opts.command), env=env, start_new_session=True)
        warn_at = term_at = kill_at = None
        if self.deadline is not None and self.opts.walltime_s is not None:
            warn_before = self.opts.warn_before_s
            if warn_before is None:
                warn_before = max(1.0, min(60.0, 0.1 * self.opts.walltime_s))
            warn_at, term_at = self.deadline - warn_before, self.deadline
            kill_at = self.deadline + self.opts.kill_wait_s
        last: str | None = None
        term_sent_at: float | None = None
        while proc.poll() is None:
            now = time.time()
            while self.pending:
                sig = signal.Signals(self.pending.pop(0))
                log.info("forwarding %s to the program", sig.name)
                _signal_tree(proc, sig)
                last = sig.name
                self.forwarded.append(sig.name)
                if sig in (signal.SIGTERM, signal.SIGINT) and term_sent_at is None:
                    term_sent_at = now
            if warn_at is not None and now >= warn_at:
                log.info(
                    "walltime: %s %s before the limit",
                    self.opts.warn_signal.name,
                    _seconds(max(0.0, term_at - now) if term_at else 0.0),
                )
                _signal_tree(proc, self.opts.warn_signal)
                last, warn_at = self.opts.warn_signal.name, None
            if term_at is not None and now >= term_at:
                log.info("walltime reached: SIGTERM")
                _signal_tree(proc, signal.SIGTERM)
                last, term_at = "SIGTERM", None
                term_sent_at = now
            if (kill_at is not None and now >= kill_at) or (
                term_sent_at is not None and now >= term_sent_at + self.opts.kill_wait_s
            ):
                log.info("kill-wait over: SIGKILL")
                _signal_tree(proc, signal.SIGKILL)
                last, kill_at, term_sent_at = "SIGKILL", None, None
            time.sleep(_POLL_S)
        return proc.returncode, last

    def on_signal(self, signum: int, frame: Any) -> None:
        self.pending.append(signum)  # acted upon by the polling loop


def _classify(
    status: int,
    sent: str | None,
    progress: bool,
    no_progress_run: int,
    max_no_progress: int,
    *,
    stop: Mapping[str, Any] | None = None,
    walltime_s: float | None = None,
    outside: str | None = None,
    lost: str | None = None,
    before_first_step: str | None = None,
) -> tuple[str, int]:
    """(reason, exit code) of one attempt, per the contract in the module docstring.

    ``stop`` is the program's own stop record for this attempt (see :func:`program_stop`);
    ``lost``: the job's nodes that Slurm lost meanwhile (:mod:`resilient.job.nodeloss`);
    ``before_first_step``: that it ended before its first step, and its start-up
    (:func:`_before_first_step`), said of an attempt that the walltime ended.
    """
    if status == 0:
        return "finished", 0
    if status == EXIT_PERMANENT:
        return "permanent storage error (exit 74)", EXIT_PERMANENT
    if status == EXIT_FOREIGN_RUN:
        said = stop.get("reason") if stop is not None and stop.get("foreign") else None
        why = f": {said}" if said else (
            ": other parameters than those recorded there; not retrying (give these parameters "
            "a directory of their own, or delete it)"
        )  # fmt: skip
        return f"the checkpoint directory belongs to another run (exit {EXIT_FOREIGN_RUN}){why}", EXIT_FOREIGN_RUN
    killed = status < 0 or sent is not None
    if status == EXIT_RESUME:
        reason = "stopped early (checkpointed and exited 75)"
    elif status > 0 and stop is not None and stop.get("saved") is False:
        reason = _stopped_before_first_checkpoint(stop, walltime_s)
        killed = False  # it stopped on its own, whatever we had sent
    elif lost is not None:
        reason = f"Slurm lost node {lost} under it"
        killed = True  # from outside: 75 after progress, and never a crash
        if not progress:
            reason += "; not counted as an attempt without progress"
    elif outside is not None:
        reason = (
            f"killed from outside ({outside}: a lost node, a preemption, the OOM killer or a "
            "kill)"
        )
        if not progress:
            reason += "; not counted as an attempt without progress"
    elif killed:
        name = sent or signal.Signals(-status).name
        reason = f"killed ({name})" if status < 0 else f"exited {status} after {name}"
        if before_first_step is not None and sent is not None:
            reason = f"{before_first_step}; {reason}"
    else:
        reason = f"crashed (exit {status})"
    if not progress and no_progress_run >= max_no_progress:
        return f"{reason}; no progress in {no_progress_run} consecutive attempts", EXIT_NO_PROGRESS
    if status == EXIT_RESUME:
        if progress:
            return reason, EXIT_RESUME
        return f"{reason}, but no newer checkpoint exists", 1  # 75 promises progress
    if killed and progress:
        return f"{reason} after a newer checkpoint", EXIT_RESUME
    return reason, (128 - status) if status < 0 else status


def make_output_folders(outputs: Sequence[Path]) -> None:
    """Create the folders the declared outputs go into, as Snakemake does for a job's outputs
    (Parsl does not: a program writing ``out/sim.h5`` would fail without ``out/``). A folder
    that cannot be made is logged and left to the program to report."""
    for out in outputs:
        try:
            Path(os.path.abspath(out)).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cannot create the folder of the output %s: %s", out, exc)


def run(opts: RunOptions, *, environ: Mapping[str, str] | None = None) -> int:
    """Run ``opts.command`` per the exit-code contract; return the exit code."""
    env = dict(os.environ if environ is None else environ)
    ckdir = opts.checkpoint_dir
    slurm_job = _requeue_job(opts, env)
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
        refusal = _not_this_runs(opts, ckdir)
        if refusal is not None:
            log.error("%s", refusal)
            return EXIT_FOREIGN_RUN
        storage.ensure_root(ckdir)
        env[ENV_CHECKPOINT_DIR] = str(ckdir)
    where = _where(opts, env)
    if where.handoff_file is not None:
        env[ENV_HANDOFF] = str(where.handoff_file)
    ledger_dir = where.ledger_dir
    if ledger_dir is not None:
        decided = verdict(where.ledger(), invocation, max_no_progress=opts.max_no_progress)
        if decided.refuse is not None:
            log.error("%s", _refusal(decided, ledger_dir, invocation))
            return decided.refuse
        if decided.new_run is not None:
            log.info("a new run of this task: %s", decided.new_run)
            fresh.append(decided.new_run)
    make_output_folders(opts.outputs)

    handled = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    signals = _Signals()
    unheard = signals.unheard
    job = slurm_job or _job_facts(env)
    nodelist = nodeloss.job_nodelist(env, known=job.nodelist if job else None)
    previous = {s: signal.signal(s, signals.forward) for s in handled}
    try:
        while True:
            code, record, attempt = _run_job(
                opts, env, signals, invocation, fresh, nodelist, where
            )
            if slurm_job is not None:
                return _requeue_on_slurm(opts, slurm_job, ready, (code, record, attempt), unheard)
            if not (opts.requeue and _stopped_by_walltime(code, record, attempt)):
                return code
            if unheard:  # asked to stop between two launches: the engine decides
                log.info(
                    "%s before the requeue: not starting again", signal.Signals(unheard[0]).name
                )
                return code
            log.info(
                "requeued after attempt %d (%s): starting again with a new walltime of %s",
                record.attempt, "progress" if record.progress else "no progress",
                _seconds(float(opts.walltime_s or 0)),
            )  # fmt: skip
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _requeue_job(opts: RunOptions, env: dict[str, str]) -> requeue.SlurmJob | None:
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
    return _with_restarts(requeue.SlurmJob.query(job_id), env)


def _job_facts(env: dict[str, str]) -> requeue.SlurmJob | None:
    """In a Slurm job step that lacks the job's variables (the Snakemake executor plugin keeps
    few ``SLURM_*`` in its step): what ``scontrol show job`` says, its restart count put into
    ``env`` (for the ledger), its node list kept (for :mod:`resilient.job.nodeloss`)."""
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id or env.get("SLURM_NNODES"):
        return None
    return _with_restarts(requeue.SlurmJob.query(job_id, config=False), env)


def _with_restarts(job: requeue.SlurmJob, env: dict[str, str]) -> requeue.SlurmJob:
    """``job``, its restart count put into ``env`` where the engine dropped Slurm's variable."""
    if job.restarts is not None and "SLURM_RESTART_COUNT" not in env:
        env["SLURM_RESTART_COUNT"] = str(job.restarts)
    return job


def _restarts(env: Mapping[str, str]) -> int | None:
    """``SLURM_RESTART_COUNT`` (Slurm sets it from the first requeue on); 0 in a batch
    environment without it, ``None`` outside Slurm or where an engine dropped it."""
    text = env.get("SLURM_RESTART_COUNT", "").strip()
    if text.isdigit():
        return int(text)
    return 0 if env.get("SLURM_JOB_ID") and env.get("SLURM_NNODES") else None


_REQUEUE_WAIT_S = 60.0  # after scontrol requeue: Slurm ends the job's processes (KillWait)


def _requeue_on_slurm(
    opts: RunOptions,
    job: requeue.SlurmJob,
    ready: bool,
    outcome: tuple[int, AttemptRecord, _Attempt],
    unheard: list[int],
) -> int:
    """After the job's attempts: requeue the job in place if its time limit stopped the
    program after progress (:mod:`resilient.job.requeue`), else pass the exit code on. Where
    Slurm refuses, exit 75 (the engine's retry resumes) with one warning."""
    code, record, attempt = outcome
    decided = requeue.decide(
        exit_code=code,
        stop=record.program_stop,
        deadline=attempt.deadline,
        window=requeue.window_s(opts.warn_before_s),
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
    done, said = requeue.request(job.job_id)
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
        time.sleep(_POLL_S)
    if not unheard:
        log.warning("Slurm did not end job %s within %.0f s of its requeue: exit 75", job.job_id,
                    _REQUEUE_WAIT_S)  # fmt: skip
    return code


def _stopped_by_walltime(code: int, record: AttemptRecord, attempt: _Attempt) -> bool:
    """Did the simulated walltime end this attempt (and nothing else)?

    Not if a signal came from outside (a user's Ctrl-C, a real scheduler), nor for a finished
    program, exit 93 or 74, or a crash that no stop signal or deadline caused.
    """
    if attempt.forwarded or code in (0, EXIT_NO_PROGRESS, EXIT_PERMANENT, EXIT_FOREIGN_RUN):
        return False
    return code == EXIT_RESUME or record.signal is not None or record.program_stop is not None


class _Signals:
    """Where the stop signals ``resilient run`` handles go: to the attempt running now
    (:attr:`attempt`), else into :attr:`unheard` (they came while no program ran)."""

    def __init__(self) -> None:
        self.attempt: _Attempt | None = None
        self.unheard: list[int] = []

    def forward(self, signum: int, frame: Any) -> None:
        """The signal handler."""
        if self.attempt is not None:
            self.attempt.on_signal(signum, frame)
        else:
            self.unheard.append(signum)


def _run_job(
    opts: RunOptions,
    env: dict[str, str],
    signals: _Signals,
    invocation: Invocation,
    fresh: list[str],
    nodelist: str,
    where: _Where,
) -> tuple[int, AttemptRecord, _Attempt]:
    """One allocation: its deadline, the program's attempts in it (``--retries``: crashes are
    relaunched while time is left); the exit code and the last attempt's record and run.
    ``fresh`` holds why an ended run starts again, taken by the first attempt's record;
    ``nodelist``: the Slurm job's nodes, asked about after a failed attempt; ``where``: the
    task's directories (what the program's Session tells is learned after each attempt)."""
    from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_exponential

    ckdir = opts.checkpoint_dir
    deadline: float | None
    if opts.walltime_s is not None:
        deadline = time.time() + opts.walltime_s
    else:
        deadline, _ = find_deadline(env)
    if deadline is not None:
        env[ENV_DEADLINE] = f"{deadline:.3f}"

    def one_attempt() -> tuple[int, AttemptRecord, _Attempt]:
        ledger = where.ledger()
        number = len(ledger) + 1
        env[ENV_ATTEMPT] = str(number)
        judged = where.progress_dir  # what the newest step before is read from
        record = AttemptRecord(
            attempt=number,
            start=time.time(),
            latest_before=_latest(judged),
            slurm_job_id=env.get("SLURM_JOB_ID"),
            slurm_restart_count=_restarts(env),
            command=list(opts.command),
            new_run=fresh.pop() if fresh else None,
            **invocation.to_record(),
        )
        stamp = where.handoff_stamp()
        attempt = _Attempt(opts, env, deadline)
        signals.attempt = attempt
        status, sent = attempt.run()
        signals.attempt = None
        record.end = time.time()
        record.exit_status = status
        record.signal = sent
        told = where.learn() if where.handoff_stamp() != stamp else None
        if told is not None and told.root is not None:
            _say_mismatch(opts, where, told.root)
        ckpt = where.progress_dir
        record.program_dir = str(where.program) if where.program is not None else None
        learned = not _same_dir(ckpt, judged)  # the program named its directory only now
        if learned:
            record.latest_before = None
        record.latest_after, made = _latest_after(ckpt, record.start)
        events = _note_restore(ckpt, record)
        base = record.restored_step if record.restored_step is not None else record.latest_before
        record.progress = made is not None and (base is None or made > base)
        if learned and (events is None or not events.timed):
            record.progress = False  # its checkpoints there are older than this attempt
        no_progress_run = 0
        record.interrupted = interrupted_from_outside(status, sent)
        lost = _lost_nodes(status, nodelist)
        record.lost_nodes = [node.name for node in lost]
        if not record.progress and status != 0 and record.interrupted is None and not lost:
            earlier = 0 if record.new_run else trailing_no_progress(ledger)
            here = trailing_no_progress(where.mine)  # this invocation's, wherever its ledger
            no_progress_run = 1 + max(earlier, here)
        record.program_stop = program_stop(
            ckpt, attempt=number, start=record.start, end=record.end
        )
        walltime = _walltime_of(opts, deadline, record.start)
        first_step = None
        if (
            sent is not None
            and status not in (0, EXIT_PERMANENT, EXIT_FOREIGN_RUN)
            and not record.progress
            and record.startup_s is None
            and not attempt.forwarded
        ):
            first_step = _before_first_step(
                record.end - record.start, opts.walltime_s, session=where.told
            )
        record.reason, record.exit_code = _classify(
            status,
            sent,
            record.progress,
            no_progress_run,
            opts.max_no_progress,
            stop=record.program_stop,
            walltime_s=opts.walltime_s,
            outside=record.interrupted,
            lost=", ".join(node.describe() for node in lost) or None,
            before_first_step=first_step,
        )
        if told is not None and told.root is None:  # the program has no directory at all
            record.reason, record.exit_code = _NO_DIRECTORY, EXIT_CONFIG
            log.error("%s", _NO_DIRECTORY)
        if status == EXIT_FOREIGN_RUN and ckdir is not None and record.exit_code == status:
            _set_aside(opts.outputs, ckdir)
        where.append(record)
        if ckdir is not None:
            _note_beside(ckdir, record.attempt, record)
        log.info(
            "attempt %d: %s; %s; newest step to resume from now %s; exit %d",
            record.attempt,
            record.reason,
            _resumed_from(record),
            record.latest_after,
            record.exit_code,
        )
        _say_startup(where, record, walltime, first_step is not None)
        return record.exit_code, record, attempt

    def should_retry(result: tuple[int, AttemptRecord, _Attempt]) -> bool:
        code, rec, _ = result
        if code in (0, EXIT_RESUME, EXIT_NO_PROGRESS, EXIT_PERMANENT, EXIT_FOREIGN_RUN):
            return False
        if rec.signal is not None:
            return False
        if rec.program_stop is not None:  # stopped on its own (deadline, signal): not a crash
            return False
        return deadline is None or time.time() < deadline

    def before_sleep(rs: Any) -> None:
        log.warning(
            "program crashed (attempt %d of %d); retrying from the latest valid checkpoint in %.1f s",
            rs.attempt_number,
            opts.retries + 1,
            rs.next_action.sleep if rs.next_action else 0.0,
        )

    retrying = Retrying(
        stop=stop_after_attempt(opts.retries + 1),
        wait=wait_exponential(multiplier=opts.backoff_s, max=opts.backoff_max_s),
        retry=retry_if_result(should_retry),
        before_sleep=before_sleep,
        retry_error_callback=_last_result,
    )
    code, record, last = retrying(one_attempt)
    return int(code), record, last


def _lost_nodes(status: int, nodelist: str) -> list[nodeloss.LostNode]:
    """After an attempt that failed in a Slurm job: the job's nodes Slurm says it lost."""
    if status in (0, EXIT_RESUME, EXIT_PERMANENT, EXIT_FOREIGN_RUN) or not nodelist:
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


_NO_DIRECTORY = (
    "the program has no checkpoint directory: its Session was given none, and resilient run "
    f"had no --checkpoint-dir to give it (${ENV_CHECKPOINT_DIR}). Give `resilient run "
    "--checkpoint-dir DIR`, or give the program's Session a directory; not retrying (exit "
    f"{EXIT_CONFIG})"
)


def _walltime_of(opts: RunOptions, deadline: float | None, start: float) -> float | None:
    """The attempt's walltime: the simulated one, else the time its deadline left it."""
    if opts.walltime_s is not None:
        return opts.walltime_s
    return None if deadline is None else max(0.0, deadline - start)


def _before_first_step(elapsed: float, walltime_s: float | None, *, session: bool) -> str | None:
    """Why an attempt that the walltime ended made no progress, when no first step of it was
    recorded: its start-up used the walltime (``session``: the program is known to record its
    steps, through a Session)."""
    if walltime_s is None:
        return None
    took = f"start-up took over {_seconds(elapsed)} of the {_seconds(walltime_s)} walltime"
    if session:
        return f"ended before its first step: {took}"
    return (
        f"ended before a first step was recorded: {took}, or the program records no steps "
        "(no Session)"
    )


def _say_mismatch(opts: RunOptions, where: _Where, root: Path) -> None:
    """One warning when the program's Session uses another directory than --checkpoint-dir."""
    given = where.given
    if given is None or "mismatch" in where.warned:
        return
    if _same_dir(root, given):
        return
    where.warned.add("mismatch")
    log.warning(
        "the program keeps its checkpoints in %s, not in the --checkpoint-dir %s given to "
        "resilient run: progress is judged on %s (the ledger stays in %s). Give resilient "
        "run --checkpoint-dir %s, or let the program's Session take its directory from $%s "
        "(no ckpt_dir)", root, given, root, given, root, ENV_CHECKPOINT_DIR,
    )  # fmt: skip


_STARTUPS = 5  # the compute a walltime should leave, in start-ups


def _say_startup(
    where: _Where, record: AttemptRecord, walltime_s: float | None, before_first_step: bool
) -> None:
    """Once per invocation: a warning when the walltime leaves less than five start-ups of
    compute (or did not cover the start-up at all)."""
    if walltime_s is None or "startup" in where.warned:
        return
    took = record.startup_s
    if took is not None:
        where.warned.add("startup")
        if walltime_s - took >= _STARTUPS * took:
            return
        log.warning(
            "start-up (launch to the first step) took %s of the %s walltime: that leaves %s of "
            "compute per attempt, less than %d start-ups, and every stop costs another "
            "start-up. Give a walltime of at least %s, or make the program start faster",
            _seconds(took), _seconds(walltime_s), _seconds(max(0.0, walltime_s - took)),
            _STARTUPS, _seconds((_STARTUPS + 1) * took),
        )  # fmt: skip
    elif before_first_step:
        where.warned.add("startup")
        log.warning(
            "the program did not reach its first step within its %s walltime: give a walltime "
            "of at least %d times its start-up, or make it start faster",
            _seconds(walltime_s), _STARTUPS + 1,
        )  # fmt: skip


def _resumed_from(record: AttemptRecord) -> str:
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


def _refusal(decided: Verdict, ckdir: Path, invocation: Invocation) -> str:
    """Why an engine's retry is refused at once, and what a person does about it."""
    retry = f" ({invocation.retry})" if invocation.retry else ""
    if decided.refuse == EXIT_CONFIG and decided.reason == _NO_DIRECTORY:
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


def _set_aside(outputs: Sequence[Path], ckdir: Path) -> None:
    """After the program refused a directory of another run (78): the declared outputs on disk
    are that other run's results, not this one's. Rename each out of the way (never delete),
    unless it holds the checkpoint directory."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for out in outputs:
        if not out.exists() or _containing_output(ckdir, [out]) is not None:
            continue
        aside = out.with_name(f"{out.name}.other-run-{stamp}")
        try:
            os.rename(out, aside)
        except OSError as exc:
            log.warning("could not set %s aside: %s", out, exc)
            continue
        log.warning(
            "set %s aside as %s: written by another run (the checkpoint directory's parameters "
            "differ), it is not this run's result", out, aside.name,
        )  # fmt: skip


def _last_result(rs: Any) -> tuple[int, AttemptRecord, _Attempt]:
    """What tenacity returns once it stops retrying: the last attempt's result."""
    result: tuple[int, AttemptRecord, _Attempt] = rs.outcome.result()
    return result


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``resilient run`` (added to ``parser`` if given)."""
    p = parser or argparse.ArgumentParser(prog="resilient run")
    p.description = "Run CMD resumably: walltime, signal forwarding, retries, attempt ledger."
    p.add_argument("--checkpoint-dir", type=Path, help="checkpoint root to watch for progress")
    p.add_argument(
        "--walltime",
        type=_duration_arg,
        metavar="DURATION",
        help="local deadline: 90 (a bare number is seconds, not Slurm's minutes), 90s, 5m, "
        "23h50m, 1h30m15s, 2d4h, 01:00:00 or 1-12:00:00",
    )
    p.add_argument(
        "--signal",
        dest="signal_spec",
        type=_signal_spec_arg,
        metavar="SIG@SECONDS",
        help="warning signal and its lead before the walltime, a duration as for --walltime "
        "(a bare number is seconds; default USR1@10%% of the walltime, <= 60 s); with "
        "--requeue in a Slurm job, the job's --signal lead (a stop within it, plus 90 s, "
        "counts as the time limit's; default 900 s)",
    )
    p.add_argument(
        "--kill-wait",
        type=_duration_arg,
        default=5.0,
        metavar="DURATION",
        help="SIGTERM to SIGKILL, a duration as for --walltime (a bare number is seconds; "
        "default 5 s)",
    )
    p.add_argument(
        "--max-no-progress",
        type=int,
        default=2,
        metavar="N",
        help="exit 93 after N consecutive attempts without a newer checkpoint (default 2)",
    )
    p.add_argument("--retries", type=int, default=0, help="relaunch a crashed program N times")
    p.add_argument(
        "--requeue",
        action="store_true",
        help="with --walltime: after a walltime stop, start the program again here with a "
        "new walltime (a requeue) instead of exiting 75 to the engine; ends with 0, 93, 74, a "
        "crash, or 75 when the stop signal came from outside. In a Slurm batch job (no "
        "--walltime): after a stop at the job's time limit that made progress, requeue the job "
        "in place (scontrol requeue: same job ID) and exit; 75 where Slurm refuses",
    )
    p.add_argument(
        "--backoff",
        default="1:60",
        metavar="BASE[:MAX]",
        help="exponential backoff between retries, seconds (default 1:60)",
    )
    p.add_argument(
        "--task",
        help="the workflow task's name, on every line logged (default: the checkpoint "
        "directory's last two path components)",
    )
    p.add_argument(
        "--outputs",
        nargs="*",
        type=Path,
        default=[],
        metavar="PATH",
        help="the task's declared outputs: their folders are created before the program starts; "
        "exit 78 if the checkpoint directory is one of them or lies inside one (the engine "
        "would delete it before each retry)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.epilog = (
        "exit codes: 0 finished; 75 stopped early after a newer checkpoint (run it again: it "
        "resumes); 93 no newer checkpoint in --max-no-progress attempts in a row (do not "
        "retry); 74 permanent storage error; 78 the checkpoint directory is not this run's "
        "(another run key, a declared output, deleted) or none was given, or a multi-node rule "
        "runs in a one-node job step (do not retry: fix what the message says); 1 stopped "
        "before any checkpoint, or 75 without a newer one; 128+N killed by signal N; else the "
        "program's own exit code"
    )
    return p


def options_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> RunOptions:
    """The options of a parsed command line (``environ``: whether this is a Slurm job).

    Raises:
        ValueError: no command, or ``--requeue`` with neither ``--walltime`` nor a Slurm job.
    """
    env = os.environ if environ is None else environ
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no command given (resilient run [options] -- CMD ...)")
    if args.requeue and args.walltime is None and not env.get("SLURM_JOB_ID"):
        raise ValueError(
            "--requeue needs --walltime (it replays a simulated walltime's requeue) or a Slurm "
            "batch job (it requeues the job in place: scontrol requeue)"
        )
    base, _, most = str(args.backoff).partition(":")
    warn_sig, warn_before = args.signal_spec if args.signal_spec else (signal.SIGUSR1, None)
    return RunOptions(
        command=tuple(command),
        checkpoint_dir=args.checkpoint_dir,
        walltime_s=args.walltime,
        warn_signal=warn_sig,
        warn_before_s=warn_before,
        kill_wait_s=args.kill_wait,
        max_no_progress=args.max_no_progress,
        retries=args.retries,
        requeue=args.requeue,
        backoff_s=float(base),
        backoff_max_s=float(most) if most else 60.0,
        task=args.task,
        outputs=tuple(args.outputs),
    )


def task_label(opts: RunOptions, *, pid: int | None = None) -> str:
    """The name on every line ``resilient run`` logs, so that concurrent runs are told apart.

    ``--task`` as given (the Snakemake helper passes the rule and its wildcards, ``sim
    case=a``); else the checkpoint directory's last two path components (``sim/a-1a2b3c4d5e6f``:
    :func:`resilient.workflow.checkpoint_dir` makes them unique per task, wildcards and
    parameters; :func:`resilient.model.filenames.task_name`, as ``resilient ls`` and
    ``resilient report`` name it); else the program's name and this process's id (``python pid 4242``).
    Whitespace, newlines included, becomes single spaces: one record stays one line.
    """
    if opts.task and opts.task.strip():
        text = opts.task
    elif opts.checkpoint_dir is not None:
        text = filenames.task_name(opts.checkpoint_dir)
    else:
        text = f"{os.path.basename(opts.command[0])} pid {os.getpid() if pid is None else pid}"
    return " ".join(text.split())


def run_command_line(opts: RunOptions) -> int:
    """Log to stderr (``resilient run [TASK]: ...``, :func:`task_label`) and :func:`run`:
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
