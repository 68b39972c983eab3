"""The options of ``resilient run``: :class:`RunOptions`, its command line and its parser.

One place for each option: :class:`RunOptions` holds them, :func:`build_parser` and
:func:`options_from_args` read a command line into them, and :meth:`RunOptions.argv` writes them
back as one (the Snakemake and Parsl helpers build their ``resilient run`` commands with it), so
that ``options_from_args(build_parser().parse_args(opts.argv()))`` is ``opts`` again (a test
round-trips every option). Durations are read by :func:`parse_duration` (a bare number is
seconds), the warning signal and its lead by :func:`parse_signal_spec`; :func:`task_label` is
the name on every line ``resilient run`` logs.

Pure logic.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, fields
from decimal import Decimal
from pathlib import Path

from resilient.job.slurm import parse_signal
from resilient.model import filenames

__all__ = [
    "DURATION_FORMS",
    "RunOptions",
    "build_parser",
    "format_duration",
    "options_from_args",
    "parse_duration",
    "parse_signal_spec",
    "say_seconds",
    "task_label",
]

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


def format_duration(seconds: float) -> str:
    """``seconds`` as :func:`parse_duration` reads it back exactly: ``90``, ``0.5``,
    ``0.00001`` (the shortest decimal that is the same float, without an exponent)."""
    text = format(Decimal(repr(float(seconds))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def say_seconds(value: float) -> str:
    """A duration in a message: ``90 s``, ``2.5 s``."""
    return f"{value:.0f} s" if value >= 10 or value == int(value) else f"{value:.1f} s"


_DEFAULT_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """Settings of one ``resilient run`` invocation."""

    command: tuple[str, ...]
    checkpoint_dir: Path | None = None
    walltime_s: float | None = None
    warn_signal: signal.Signals = _DEFAULT_SIGNAL
    warn_before_s: float | None = None
    kill_wait_s: float = 5.0
    max_no_progress: int = 2
    retries: int = 0
    requeue: bool = False
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    task: str | None = None  # the workflow task's name, on every line logged (task_label)
    outputs: tuple[Path, ...] = ()  # the task's declared outputs: never the checkpoint directory

    def option_words(self) -> list[str]:
        """The options of :meth:`argv`, without ``--`` and the command: only those that differ
        from ``resilient run``'s defaults, so that its defaults apply to the rest.

        Raises:
            ValueError: a warning signal other than SIGUSR1 without its lead (the command
                line names both, ``--signal SIG@SECONDS``).
        """
        default = {f.name: f.default for f in fields(RunOptions) if f.name != "command"}
        words: list[str] = []
        if self.checkpoint_dir is not None:
            words += ["--checkpoint-dir", os.fspath(self.checkpoint_dir)]
        if self.outputs:
            words += ["--outputs", *(os.fspath(out) for out in self.outputs)]
        if self.task is not None:
            words += ["--task", self.task]
        if self.walltime_s is not None:
            words += ["--walltime", format_duration(self.walltime_s)]
        if self.warn_before_s is not None:
            lead = format_duration(self.warn_before_s)
            words += ["--signal", f"{self.warn_signal.name.removeprefix('SIG')}@{lead}"]
        elif self.warn_signal != _DEFAULT_SIGNAL:
            raise ValueError(
                f"warning signal {self.warn_signal.name} without its lead (warn_before_s): "
                "the command line names both (--signal SIG@SECONDS)"
            )
        if self.kill_wait_s != default["kill_wait_s"]:
            words += ["--kill-wait", format_duration(self.kill_wait_s)]
        if self.max_no_progress != default["max_no_progress"]:
            words += ["--max-no-progress", str(int(self.max_no_progress))]
        if self.retries != default["retries"]:
            words += ["--retries", str(int(self.retries))]
        if self.requeue:
            words.append("--requeue")
        if (self.backoff_s, self.backoff_max_s) != (default["backoff_s"], default["backoff_max_s"]):
            backoff = f"{format_duration(self.backoff_s)}:{format_duration(self.backoff_max_s)}"
            words += ["--backoff", backoff]
        return words

    def argv(self) -> list[str]:
        """This invocation's command line after ``resilient run``: ``[OPTIONS..., --,
        *command]`` (:meth:`option_words`); :func:`options_from_args` reads it back as these
        options.

        Raises:
            ValueError: as :meth:`option_words`.
        """
        return [*self.option_words(), "--", *self.command]


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
