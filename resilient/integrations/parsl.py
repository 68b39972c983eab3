"""Parsl integration: resume-aware retries, resumable MPI apps and YAML executor configs.

Three pieces, each usable alone:

* :func:`resume_retry_handler` -- a ``Config(retry_handler=...)`` that charges a failed try by
  *progress*: a try that committed a newer valid checkpoint costs ``walltime_cost`` (0), one
  that did not costs ``failure_cost`` (1), and the exits that must not be retried
  (93: no progress for too long, 74: permanent storage error) cost ``math.inf``. With
  ``Config(retries=N)`` a task is therefore relaunched as long as it advances, and gives up
  after N+1 tries that did not. Before each relaunch the handler sets the task's
  ``resume_from`` keyword to the newest valid checkpoint (Parsl re-reads ``task_record['kwargs']``
  at relaunch), so the app can log or use it.
* App helpers: :func:`resilient_command` (a shell command ``python -m resilient.cli run ... --
  PROGRAM``), :func:`make_apps` (bash apps for ``apps.heat`` / ``apps.train`` through
  ``mpiexec`` or ``$PARSL_MPI_PREFIX``, and the python app :func:`run_resumable`).
* :func:`load_config` -- one strict loader for ``configs/parsl/*.yaml``.

Config schema (every key optional unless marked; unknown keys, keys of another ``kind`` and
wrong types raise :class:`~resilient.errors.ConfigError` naming the file and the key)::

    retries: 3                  # int >= 0: tries *without progress* tolerated after the first
    retry_handler: resume       # resume (resume_retry_handler()) | none (Parsl: every failure costs 1)
    run_dir: runinfo            # Parsl's run directory, relative to the working directory
    strategy: simple            # simple | htex_auto_scale | none
    strategy_period: 5          # seconds between scaling decisions (number > 0)
    executor:                   # required
      kind: htex                # required: htex (HighThroughputExecutor) | mpi (MPIExecutor)
      label: local              # default: the kind
      drain_period: null        # seconds after a block starts when its workers stop taking tasks
      heartbeat_threshold: 120  # seconds without heartbeat before ManagerLost / WorkerLost
      heartbeat_period: 30
      # kind htex only:
      max_workers_per_node: 2   # concurrent tasks per node (each task runs its own mpiexec)
      cores_per_worker: 1.0
      # kind mpi only:
      max_workers_per_block: 1  # concurrent MPI tasks per block
      mpi_launcher: srun        # srun | mpiexec | aprun: what $PARSL_MPI_PREFIX expands to
    provider:                   # required
      kind: local               # required: local (LocalProvider) | slurm (SlurmProvider)
      nodes_per_block: 1
      init_blocks: 1
      min_blocks: 0
      max_blocks: 1
      worker_init: ""           # shell lines run before the workers start
      launcher: single_node     # single_node | srun | simple (kind mpi needs simple, the default there)
      # kind slurm only:
      partition: debug
      account: null
      qos: null
      constraint: null
      cores_per_node: null      # int; not with executor kind mpi (Parsl#3006)
      mem_per_node: null        # int, GB
      walltime: "00:10:00"      # a string: quote it (YAML reads 1:00:00 as a number)
      exclusive: true
      scheduler_options: ""     # raw "#SBATCH ..." lines

The handler keeps its bookkeeping in the task's keyword arguments: the checkpoint root in
``checkpoint_dir`` and the checkpoint a try started from in ``resume_from`` (both names are
configurable). Bash apps get ``resume_from`` from their signature's default; pass it explicitly
(``resume_from=None``) to python apps, or the handler cannot inject it. The apps made by
:func:`make_apps` do all this, and set ``resume_from`` at submission to the newest valid
checkpoint already there, so a resubmitted campaign does not count old checkpoints as progress.

The core of ``resilient`` never imports this module.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import parsl
from parsl.app.errors import BashExitFailure
from parsl.executors.high_throughput.errors import ManagerLost, WorkerLost

from resilient import layout
from resilient.errors import ConfigError
from resilient.exitcodes import EXIT_NO_PROGRESS, EXIT_PERMANENT, EXIT_RESUME
from resilient.validate import latest_valid

if TYPE_CHECKING:
    from parsl.dataflow.taskrecord import TaskRecord

__all__ = [
    "FAILURE",
    "NO_PROGRESS",
    "PERMANENT",
    "WALLTIME",
    "ResumableApps",
    "ResumableCommandError",
    "build_config",
    "classify_failure",
    "exit_code_of",
    "heat_bash",
    "heat_mpi_bash",
    "load_config",
    "make_apps",
    "resilient_argv",
    "resilient_command",
    "resume_retry_handler",
    "run_resumable",
    "train_bash",
    "train_mpi_bash",
]

log = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------- commands


def _duration(seconds: float) -> str:
    text = f"{float(seconds):.3f}".rstrip("0").rstrip(".")
    return text or "0"


def resilient_argv(
    program_argv: Sequence[str],
    *,
    checkpoint_dir: str | os.PathLike[str],
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    retries: int = 0,
    extra: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """``[python, -m, resilient.cli, run, --checkpoint-dir, D, ..., --, *program_argv]``."""
    argv = [python or sys.executable, "-m", "resilient.cli", "run"]
    argv += ["--checkpoint-dir", os.fspath(checkpoint_dir)]
    if walltime_s is not None:
        argv += ["--walltime", _duration(walltime_s)]
    argv += ["--max-no-progress", str(int(max_no_progress)), "--retries", str(int(retries))]
    argv += [str(a) for a in extra]
    return [*argv, "--", *(str(a) for a in program_argv)]


def resilient_command(
    program_argv: Sequence[str],
    *,
    checkpoint_dir: str | os.PathLike[str],
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    retries: int = 0,
    extra: Sequence[str] = (),
    launcher_prefix: str = "",
    python: str | None = None,
) -> str:
    """The shell command ``python -m resilient.cli run --checkpoint-dir D ... -- PROGRAM...``.

    Every word is shell-quoted (:func:`shlex.join`) except ``launcher_prefix``, raw shell text
    put between ``--`` and the program, e.g. ``"$PARSL_MPI_PREFIX"`` (expanded by the shell).
    ``python`` defaults to :data:`sys.executable` of the process building the command (for a
    bash app: the worker's), so nothing depends on ``PATH``.
    """
    argv = resilient_argv(
        program_argv,
        checkpoint_dir=checkpoint_dir,
        walltime_s=walltime_s,
        max_no_progress=max_no_progress,
        retries=retries,
        extra=extra,
        python=python,
    )
    if not launcher_prefix:
        return shlex.join(argv)
    split = argv.index("--") + 1
    return f"{shlex.join(argv[:split])} {launcher_prefix} {shlex.join(argv[split:])}"


def _mpiexec() -> str:
    """The ``mpiexec`` next to this interpreter (the mpich wheel in a venv), else ``mpiexec``."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def _in_dir(cwd: str | None, command: str, resume_from: str | None) -> str:
    """``cd CWD && export PYTHONPATH=CWD:... && echo resume_from=... && exec COMMAND``."""
    parts = []
    if cwd:
        q = shlex.quote(cwd)
        parts += [f"cd {q}", f"export PYTHONPATH={q}${{PYTHONPATH:+:$PYTHONPATH}}"]
    marker = f"resilient: resume_from={resume_from or 'none'}"
    parts.append(f"echo {shlex.quote(marker)}")
    parts.append(f"exec {command}")
    return " && ".join(parts)


def _app_command(
    args: list[str],
    ranks: int | None,
    *,
    checkpoint_dir: str,
    walltime_s: float | None,
    max_no_progress: int,
    run_extra: Sequence[str],
    cwd: str | None,
    resume_from: str | None,
) -> str:
    """``resilient run ... -- mpiexec -n RANKS python ARGS`` (``$PARSL_MPI_PREFIX python ARGS``
    for MPIExecutor when ``ranks`` is None), run in ``cwd``."""
    if ranks is None:
        program, prefix = [sys.executable, *args], "$PARSL_MPI_PREFIX"
    else:
        program, prefix = [_mpiexec(), "-n", str(ranks), sys.executable, *args], ""
    cmd = resilient_command(
        program, checkpoint_dir=checkpoint_dir, walltime_s=walltime_s,
        max_no_progress=max_no_progress, extra=run_extra, launcher_prefix=prefix,
    )  # fmt: skip
    return _in_dir(cwd, cmd, resume_from)


def _opt(flag: str, value: Any) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _heat_args(
    nx: int, ny: int, steps: int, alpha: float, out: str, checkpoint_dir: str,
    checkpoint_every: int | None, step_delay: float, config: str | None,
) -> list[str]:  # fmt: skip
    return [
        "-m", "apps.heat", "--nx", str(nx), "--ny", str(ny), "--steps", str(steps),
        "--alpha", repr(float(alpha)), "--checkpoint-dir", checkpoint_dir, "--out", out,
        *_opt("--checkpoint-every", checkpoint_every), "--step-delay", repr(float(step_delay)),
        *_opt("--config", config),
    ]  # fmt: skip


def _train_args(
    steps: int, out: str, checkpoint_dir: str, checkpoint_every: int | None,
    step_delay: float, config: str | None,
) -> list[str]:  # fmt: skip
    return [
        "-m", "apps.train", "--steps", str(steps), "--checkpoint-dir", checkpoint_dir,
        "--out", out, *_opt("--checkpoint-every", checkpoint_every),
        "--step-delay", repr(float(step_delay)), *_opt("--config", config),
    ]  # fmt: skip


# Bash app bodies. They run on the worker (sys.executable, mpiexec are the worker's) and are
# module-level functions so that Parsl ships them by reference. `resume_from` is informative
# for these apps: they resume from their newest valid checkpoint by themselves; the command
# echoes it into the task's stdout.


def heat_bash(
    *,
    nx: int,
    ny: int,
    steps: int,
    out: str,
    checkpoint_dir: str,
    ranks: int = 4,
    alpha: float = 0.2,
    checkpoint_every: int | None = None,
    step_delay: float = 0.0,
    config: str | None = None,
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    run_extra: Sequence[str] = (),
    cwd: str | None = None,
    resume_from: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> str:
    """Command of the ``heat`` bash app: ``resilient run ... -- mpiexec -n RANKS python -m apps.heat``."""
    args = _heat_args(
        nx, ny, steps, alpha, out, checkpoint_dir, checkpoint_every, step_delay, config
    )
    return _app_command(
        args, ranks, checkpoint_dir=checkpoint_dir, walltime_s=walltime_s,
        max_no_progress=max_no_progress, run_extra=run_extra, cwd=cwd, resume_from=resume_from,
    )  # fmt: skip


def train_bash(
    *,
    steps: int,
    out: str,
    checkpoint_dir: str,
    ranks: int = 2,
    checkpoint_every: int | None = None,
    step_delay: float = 0.0,
    config: str | None = None,
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    run_extra: Sequence[str] = (),
    cwd: str | None = None,
    resume_from: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> str:
    """Command of the ``train`` bash app: ``resilient run ... -- mpiexec -n RANKS python -m apps.train``."""
    args = _train_args(steps, out, checkpoint_dir, checkpoint_every, step_delay, config)
    return _app_command(
        args, ranks, checkpoint_dir=checkpoint_dir, walltime_s=walltime_s,
        max_no_progress=max_no_progress, run_extra=run_extra, cwd=cwd, resume_from=resume_from,
    )  # fmt: skip


# The MPIExecutor variants take no default for parsl_resource_specification: a default would be
# copied into the call (BashApp does that) and an empty one hangs MPI mode (Parsl#3427).


def heat_mpi_bash(
    *,
    parsl_resource_specification: Mapping[str, Any],
    nx: int,
    ny: int,
    steps: int,
    out: str,
    checkpoint_dir: str,
    alpha: float = 0.2,
    checkpoint_every: int | None = None,
    step_delay: float = 0.0,
    config: str | None = None,
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    run_extra: Sequence[str] = (),
    cwd: str | None = None,
    resume_from: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> str:
    """Command of the ``heat`` app for MPIExecutor: ``resilient run ... -- $PARSL_MPI_PREFIX python -m apps.heat``."""
    args = _heat_args(
        nx, ny, steps, alpha, out, checkpoint_dir, checkpoint_every, step_delay, config
    )
    return _app_command(
        args, None, checkpoint_dir=checkpoint_dir, walltime_s=walltime_s,
        max_no_progress=max_no_progress, run_extra=run_extra, cwd=cwd, resume_from=resume_from,
    )  # fmt: skip


def train_mpi_bash(
    *,
    parsl_resource_specification: Mapping[str, Any],
    steps: int,
    out: str,
    checkpoint_dir: str,
    checkpoint_every: int | None = None,
    step_delay: float = 0.0,
    config: str | None = None,
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    run_extra: Sequence[str] = (),
    cwd: str | None = None,
    resume_from: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> str:
    """Command of the ``train`` app for MPIExecutor: ``resilient run ... -- $PARSL_MPI_PREFIX python -m apps.train``."""
    args = _train_args(steps, out, checkpoint_dir, checkpoint_every, step_delay, config)
    return _app_command(
        args, None, checkpoint_dir=checkpoint_dir, walltime_s=walltime_s,
        max_no_progress=max_no_progress, run_extra=run_extra, cwd=cwd, resume_from=resume_from,
    )  # fmt: skip


def run_resumable(
    argv: Sequence[str],
    checkpoint_dir: str,
    *,
    resume_from: str | None = None,
    walltime_s: float | None = None,
    max_no_progress: int = 3,
    retries: int = 0,
    extra: Sequence[str] = (),
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | None = None,
) -> dict[str, Any]:
    """Run ``argv`` under ``resilient run`` in a subprocess (the body of a python app).

    ``cwd`` is the working directory (also put first on ``PYTHONPATH``), ``env`` extra
    environment variables. Output goes to ``log_path`` (appended; it starts with a
    ``resilient: resume_from=...`` line per try) or is captured.

    Returns:
        ``{"exit_code": 0, "resume_from": resume_from, "checkpoint_dir": checkpoint_dir}``.

    Raises:
        ResumableCommandError: non-zero exit, with its code (classified by the retry handler
            like a bash app's exit code) and, without ``log_path``, the output's tail.
    """
    command = resilient_argv(
        argv, checkpoint_dir=checkpoint_dir, walltime_s=walltime_s,
        max_no_progress=max_no_progress, retries=retries, extra=extra,
    )  # fmt: skip
    full_env = dict(os.environ)
    if cwd:
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (cwd, full_env.get("PYTHONPATH", "")) if p
        )
    full_env.update(env or {})
    header = f"resilient: resume_from={resume_from or 'none'}\n"
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as fh:
            fh.write(header)
            fh.flush()
            returncode = subprocess.run(
                command, cwd=cwd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, check=False
            ).returncode
        output = ""
    else:
        done = subprocess.run(
            command, cwd=cwd, env=full_env, capture_output=True, text=True, check=False
        )
        returncode = done.returncode
        output = (header + done.stdout + done.stderr)[-4000:]
    if returncode != 0:
        raise ResumableCommandError(returncode, command, output)
    return {"exit_code": 0, "resume_from": resume_from, "checkpoint_dir": checkpoint_dir}


# --------------------------------------------------------------------------- submit-side apps


def _latest_path(root: str) -> str | None:
    rec = latest_valid(Path(root))
    return str(rec.path) if rec is not None else None


@dataclass(frozen=True, slots=True)
class _Submit:
    """Calls a Parsl app with absolute paths, ``cwd`` and a submit-time ``resume_from``."""

    app: Callable[..., Any]
    cwd: str
    paths: tuple[str, ...]
    positional: tuple[str, ...] = ()  # names of the positional arguments accepted
    mpi_ranks: int | None = None  # default rank count of an MPIExecutor app

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > len(self.positional):
            raise TypeError(f"at most {len(self.positional)} positional arguments, got {len(args)}")
        for name, value in zip(self.positional, args, strict=False):
            if name in kwargs:
                raise TypeError(f"got multiple values for argument {name!r}")
            kwargs[name] = value
        kwargs.setdefault("cwd", self.cwd)
        base = Path(kwargs["cwd"])
        for name in self.paths:
            if kwargs.get(name) is not None:
                kwargs[name] = str(base / os.fspath(kwargs[name]))
        if "resume_from" not in kwargs and kwargs.get("checkpoint_dir") is not None:
            kwargs["resume_from"] = _latest_path(kwargs["checkpoint_dir"])
        if self.mpi_ranks is not None:
            ranks = int(kwargs.pop("ranks", self.mpi_ranks))
            nodes = int(kwargs.pop("nodes", 1))
            kwargs.setdefault(
                "parsl_resource_specification",
                {"num_nodes": nodes, "ranks_per_node": -(-ranks // nodes), "num_ranks": ranks},
            )
        return self.app(**kwargs)


@dataclass(frozen=True, slots=True)
class ResumableApps:
    """The apps of :func:`make_apps`; each call returns a Parsl ``AppFuture``.

    Keyword arguments are those of the bodies (:func:`heat_bash`, :func:`train_bash`,
    :func:`heat_mpi_bash`, :func:`train_mpi_bash`, :func:`run_resumable`), plus ``stdout`` /
    ``stderr`` for the bash apps and, for the MPI ones, ``ranks`` and ``nodes`` (turned into
    ``parsl_resource_specification``).
    """

    heat: Callable[..., Any]
    train: Callable[..., Any]
    heat_mpi: Callable[..., Any]
    train_mpi: Callable[..., Any]
    run_resumable: Callable[..., Any]


def make_apps(
    executors: str | list[str] = "all",
    *,
    cwd: str | os.PathLike[str] | None = None,
    cache: bool = False,
) -> ResumableApps:
    """Parsl apps for ``apps.heat``, ``apps.train`` and any command, run via ``resilient run``.

    Creating them needs no loaded DataFlowKernel; calling them does. ``cwd`` (default: the
    current directory) is where the programs run (``python -m apps.heat`` needs the repository
    root) and what relative ``checkpoint_dir`` / ``out`` / ``config`` / ``log_path`` are resolved
    against. ``resume_from`` is ignored for caching (``ignore_for_cache``), so the handler's
    change of it never changes a task's memo hash.
    """
    root = str(Path(cwd if cwd is not None else os.getcwd()).resolve())
    opts: dict[str, Any] = {
        "executors": executors,
        "cache": cache,
        "ignore_for_cache": ["resume_from"],
    }
    files = ("checkpoint_dir", "out", "config")
    return ResumableApps(
        heat=_Submit(parsl.bash_app(heat_bash, **opts), root, files),
        train=_Submit(parsl.bash_app(train_bash, **opts), root, files),
        heat_mpi=_Submit(parsl.bash_app(heat_mpi_bash, **opts), root, files, mpi_ranks=4),
        train_mpi=_Submit(parsl.bash_app(train_mpi_bash, **opts), root, files, mpi_ranks=2),
        run_resumable=_Submit(
            parsl.python_app(run_resumable, **opts),
            root,
            ("checkpoint_dir", "log_path"),
            positional=("argv", "checkpoint_dir"),
        ),
    )


# --------------------------------------------------------------------------- config loading

_TOP = {
    "retries",
    "retry_handler",
    "run_dir",
    "strategy",
    "strategy_period",
    "executor",
    "provider",
}
_EXECUTOR_COMMON = {"kind", "label", "drain_period", "heartbeat_threshold", "heartbeat_period"}
_EXECUTOR_ONLY = {
    "htex": {"max_workers_per_node", "cores_per_worker"},
    "mpi": {"max_workers_per_block", "mpi_launcher"},
}
_PROVIDER_COMMON = {
    "kind", "nodes_per_block", "init_blocks", "min_blocks", "max_blocks", "worker_init", "launcher",
}  # fmt: skip
_PROVIDER_ONLY = {
    "local": set[str](),
    "slurm": {
        "partition", "account", "qos", "constraint", "cores_per_node", "mem_per_node",
        "walltime", "exclusive", "scheduler_options",
    },
}  # fmt: skip
_LAUNCHERS = ("single_node", "srun", "simple")
_MPI_LAUNCHERS = ("srun", "mpiexec", "aprun")
_STRATEGIES = ("simple", "htex_auto_scale", "none")
_WALLTIME_RE = re.compile(r"^(?:\d+-)?\d+(?::\d{1,2}){0,2}$")


class _Section:
    """A mapping being read, with the file and the key path for error messages."""

    def __init__(self, doc: Any, where: str, path: str) -> None:
        if not isinstance(doc, Mapping):
            raise ConfigError(
                f"{where}: {path or 'top level'}: expected a mapping, got {type(doc).__name__}"
            )
        self.doc: Mapping[str, Any] = doc
        self.where = where
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def only(
        self, allowed: set[str], *, other: Mapping[str, set[str]] | None = None, kind: str = ""
    ) -> None:
        for key in sorted(map(str, self.doc)):
            if key in allowed:
                continue
            owner = [k for k, keys in (other or {}).items() if key in keys]
            if owner:
                raise ConfigError(
                    f"{self.where}: {self.name(key)}: only for kind {owner[0]!r}, not {kind!r}"
                )
            raise ConfigError(
                f"{self.where}: unknown key {self.name(key)!r}; allowed: {sorted(allowed)}"
            )

    def get(
        self,
        key: str,
        typ: type | tuple[type, ...],
        default: Any = None,
        *,
        minimum: float | None = None,
    ) -> Any:
        value: Any = self.doc.get(key)
        if value is None:
            return default
        types = typ if isinstance(typ, tuple) else (typ,)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(
                f"{self.where}: {self.name(key)}: expected {names}, got {type(value).__name__} {value!r}"
            )
        if minimum is not None and isinstance(value, (int, float)) and value < minimum:
            raise ConfigError(
                f"{self.where}: {self.name(key)}: must be >= {minimum}, got {value!r}"
            )
        return value

    def choice(self, key: str, choices: Sequence[str], default: str | None) -> str | None:
        value: str | None = self.get(key, str, default)
        if value is not None and value not in choices:
            raise ConfigError(
                f"{self.where}: {self.name(key)}: one of {list(choices)}, got {value!r}"
            )
        return value

    def section(self, key: str) -> _Section:
        if key not in self.doc or self.doc[key] is None:
            raise ConfigError(f"{self.where}: {self.name(key)}: required")
        return _Section(self.doc[key], self.where, self.name(key))


def _launcher(name: str) -> Any:
    from parsl.launchers import SimpleLauncher, SingleNodeLauncher, SrunLauncher

    if name == "simple":
        return SimpleLauncher()
    if name == "srun":
        return SrunLauncher()
    return SingleNodeLauncher()


def _provider(sec: _Section, executor_kind: str) -> Any:
    from parsl.providers import LocalProvider, SlurmProvider

    kind = sec.choice("kind", tuple(_PROVIDER_ONLY), None)
    if kind is None:
        raise ConfigError(f"{sec.where}: {sec.name('kind')}: required (local or slurm)")
    sec.only(_PROVIDER_COMMON | _PROVIDER_ONLY[kind], other=_PROVIDER_ONLY, kind=kind)
    default_launcher = "simple" if executor_kind == "mpi" else "single_node"
    launcher = sec.choice("launcher", _LAUNCHERS, default_launcher)
    if executor_kind == "mpi" and launcher != "simple":
        raise ConfigError(
            f"{sec.where}: {sec.name('launcher')}: executor kind 'mpi' needs launcher 'simple', got {launcher!r}"
        )
    common: dict[str, Any] = {
        "nodes_per_block": sec.get("nodes_per_block", int, 1, minimum=1),
        "init_blocks": sec.get("init_blocks", int, 1, minimum=0),
        "min_blocks": sec.get("min_blocks", int, 0, minimum=0),
        "max_blocks": sec.get("max_blocks", int, 1, minimum=1),
        "worker_init": sec.get("worker_init", str, ""),
        "launcher": _launcher(str(launcher)),
    }
    if common["min_blocks"] > common["max_blocks"]:
        raise ConfigError(f"{sec.where}: {sec.name('min_blocks')}: larger than max_blocks")
    if kind == "local":
        return LocalProvider(**common)  # type: ignore[no-untyped-call]
    walltime = sec.get("walltime", str, "00:10:00")
    if not _WALLTIME_RE.match(walltime):
        raise ConfigError(
            f'{sec.where}: {sec.name("walltime")}: a Slurm time such as "01:00:00", got {walltime!r}'
        )
    cores = sec.get("cores_per_node", int, None, minimum=1)
    if cores is not None and executor_kind == "mpi":
        raise ConfigError(
            f"{sec.where}: {sec.name('cores_per_node')}: do not set it with executor kind 'mpi' (Parsl#3006)"
        )
    return SlurmProvider(
        partition=sec.get("partition", str, None),
        account=sec.get("account", str, None),
        qos=sec.get("qos", str, None),
        constraint=sec.get("constraint", str, None),
        cores_per_node=cores,
        mem_per_node=sec.get("mem_per_node", int, None, minimum=1),
        walltime=walltime,
        exclusive=sec.get("exclusive", bool, True),
        scheduler_options=sec.get("scheduler_options", str, ""),
        **common,
    )


def _executor(sec: _Section, provider_sec: _Section) -> Any:
    from parsl.executors import HighThroughputExecutor, MPIExecutor

    kind = sec.choice("kind", tuple(_EXECUTOR_ONLY), None)
    if kind is None:
        raise ConfigError(f"{sec.where}: {sec.name('kind')}: required (htex or mpi)")
    sec.only(_EXECUTOR_COMMON | _EXECUTOR_ONLY[kind], other=_EXECUTOR_ONLY, kind=kind)
    common: dict[str, Any] = {
        "label": sec.get("label", str, kind),
        "provider": _provider(provider_sec, kind),
        "drain_period": sec.get("drain_period", int, None, minimum=1),
        "heartbeat_threshold": sec.get("heartbeat_threshold", int, 120, minimum=1),
        "heartbeat_period": sec.get("heartbeat_period", int, 30, minimum=1),
    }
    if kind == "mpi":
        return MPIExecutor(
            max_workers_per_block=sec.get("max_workers_per_block", int, 1, minimum=1),
            mpi_launcher=str(sec.choice("mpi_launcher", _MPI_LAUNCHERS, "mpiexec")),
            **common,
        )
    workers = sec.get("max_workers_per_node", int, None, minimum=1)
    return HighThroughputExecutor(
        max_workers_per_node=workers,
        cores_per_worker=float(sec.get("cores_per_worker", (int, float), 1.0, minimum=1e-9)),
        **common,
    )


def build_config(doc: Any, *, where: str = "config") -> parsl.Config:
    """A ``parsl.Config`` from a parsed YAML mapping (schema in the module docstring).

    Constructs only: no block is submitted and no Slurm is needed until ``parsl.load``.

    Raises:
        ConfigError: unknown keys, keys of another kind, wrong types or values.
    """
    top = _Section(doc, where, "")
    top.only(_TOP)
    retries = top.get("retries", int, 0, minimum=0)
    handler_name = top.choice("retry_handler", ("resume", "none"), "resume")
    run_dir = top.get("run_dir", str, "runinfo")
    if "strategy" in top.doc and top.doc["strategy"] is None:
        strategy: str | None = None
    else:
        strategy = top.choice("strategy", _STRATEGIES, "simple")
        strategy = None if strategy == "none" else strategy
    period = float(top.get("strategy_period", (int, float), 5.0, minimum=0))
    if period <= 0:
        raise ConfigError(f"{where}: strategy_period: must be > 0")
    executor = _executor(top.section("executor"), top.section("provider"))
    return parsl.Config(
        executors=[executor],
        retries=retries,
        retry_handler=resume_retry_handler() if handler_name == "resume" else None,
        run_dir=run_dir,
        strategy=strategy,
        strategy_period=period,
    )


def load_config(path: str | os.PathLike[str]) -> parsl.Config:
    """Read a ``configs/parsl/*.yaml`` file into a ``parsl.Config`` (not loaded).

    Raises:
        ConfigError: unreadable file, bad YAML, unknown keys, wrong types or values; the
            message names the file and the key.
    """
    from resilient.config import load_yaml

    p = Path(path)
    doc = load_yaml(p)
    return build_config(doc if doc is not None else {}, where=str(p))
