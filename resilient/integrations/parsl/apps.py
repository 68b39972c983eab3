"""Parsl apps that run any program resumably through ``resilient run``.

One builder for every program and launcher: :func:`resumable_apps` gives

* ``bash`` -- a bash app for ``HighThroughputExecutor`` (or any executor): the program is
  started by ``mpiexec -n N``, ``srun -n N`` or directly, per :class:`Launch`;
* ``mpi_bash`` -- the same for ``MPIExecutor``: the program is started by
  ``$PARSL_MPI_PREFIX`` (``ranks``/``nodes`` become ``parsl_resource_specification``);
* ``python`` -- a python app (:func:`run_resumable`) that runs the command in a subprocess
  and raises :class:`~resilient.integrations.parsl.retry.ResumableCommandError` on failure.

Each call takes the program as ``command=[...]`` (an argv) or ``module="apps.heat"`` plus
``args=[...]`` (run with the worker's Python), the ``checkpoint_dir`` to watch, and how to run
it: ``launch=Launch(...)`` and ``run=RunOptions(...)``. At submission, relative paths are made
absolute against ``cwd`` and ``resume_from`` is set to the newest valid checkpoint already
there (so a resubmitted campaign does not count old checkpoints as progress); the retry
handler updates it before each relaunch. ``resume_from`` is ignored for caching.
"""

from __future__ import annotations

import inspect
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import parsl

from resilient.integrations.parsl.retry import ResumableCommandError
from resilient.launch import find_mpiexec
from resilient.validate import latest_valid

__all__ = [
    "Launch",
    "ResumableApps",
    "RunOptions",
    "resilient_argv",
    "resilient_command",
    "resumable_apps",
    "resumable_bash",
    "resumable_mpi_bash",
    "run_resumable",
]

_LAUNCHERS = ("mpiexec", "srun", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """How a try starts the program (bash apps; ``mpi_bash`` always uses ``$PARSL_MPI_PREFIX``).

    Attributes:
        launcher: ``mpiexec`` (the one next to the worker's Python, else on ``PATH``), ``srun``,
            or ``none`` (run the program directly).
        ranks: the number of ranks (``-n``); required for ``mpiexec`` and ``srun``.
    """

    launcher: str = "mpiexec"
    ranks: int | None = None

    def __post_init__(self) -> None:
        if self.launcher not in _LAUNCHERS:
            raise ValueError(f"Launch.launcher: one of {list(_LAUNCHERS)}, got {self.launcher!r}")
        if self.launcher != "none" and (self.ranks is None or self.ranks < 1):
            raise ValueError(f"Launch.ranks: a positive rank count for {self.launcher}")

    def argv(self) -> list[str]:
        """The launcher's words (on the worker), empty for ``none``."""
        if self.launcher == "none":
            return []
        exe = find_mpiexec() if self.launcher == "mpiexec" else "srun"
        return [exe, "-n", str(self.ranks)]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """Options of ``resilient run`` for every try of a task.

    Attributes:
        walltime_s: a simulated walltime per try (``--walltime``), or ``None``.
        max_no_progress: tries without a newer checkpoint before exit 93.
        retries: relaunches of a crashed program inside one try.
        extra: more ``resilient run`` arguments (e.g. ``("--signal", "USR1@30")``).
    """

    walltime_s: float | None = None
    max_no_progress: int = 2
    retries: int = 0
    extra: tuple[str, ...] = field(default=())


def _duration(seconds: float) -> str:
    text = f"{float(seconds):.3f}".rstrip("0").rstrip(".")
    return text or "0"


def resilient_argv(
    program_argv: Sequence[str],
    *,
    checkpoint_dir: str | os.PathLike[str],
    run: RunOptions = RunOptions(),
    python: str | None = None,
) -> list[str]:
    """``[python, -m, resilient.cli, run, --checkpoint-dir, D, ..., --, *program_argv]``."""
    argv = [python or sys.executable, "-m", "resilient.cli", "run"]
    argv += ["--checkpoint-dir", os.fspath(checkpoint_dir)]
    if run.walltime_s is not None:
        argv += ["--walltime", _duration(run.walltime_s)]
    argv += ["--max-no-progress", str(int(run.max_no_progress)), "--retries", str(int(run.retries))]
    argv += [str(a) for a in run.extra]
    return [*argv, "--", *(str(a) for a in program_argv)]


def resilient_command(
    program_argv: Sequence[str],
    *,
    checkpoint_dir: str | os.PathLike[str],
    run: RunOptions = RunOptions(),
    launcher_prefix: str = "",
    python: str | None = None,
) -> str:
    """The shell command ``python -m resilient.cli run --checkpoint-dir D ... -- PROGRAM...``.

    Every word is shell-quoted (:func:`shlex.join`) except ``launcher_prefix``, raw shell text
    put between ``--`` and the program, e.g. ``"$PARSL_MPI_PREFIX"`` (expanded by the shell).
    ``python`` defaults to :data:`sys.executable` of the process building the command (for a
    bash app: the worker's), so nothing depends on ``PATH``.
    """
    argv = resilient_argv(program_argv, checkpoint_dir=checkpoint_dir, run=run, python=python)
    if not launcher_prefix:
        return shlex.join(argv)
    split = argv.index("--") + 1
    return f"{shlex.join(argv[:split])} {launcher_prefix} {shlex.join(argv[split:])}"


def _program(command: Sequence[str], module: str | None, args: Sequence[str]) -> list[str]:
    if (module is None) == (not command):
        raise ValueError("give either command=[...] or module=... (with args=[...])")
    head = [sys.executable, "-m", module] if module is not None else list(command)
    return [*head, *(str(a) for a in args)]


def _shell(
    program: list[str],
    prefix: list[str] | str,
    *,
    checkpoint_dir: str,
    run: RunOptions,
    cwd: str | None,
    resume_from: str | None,
) -> str:
    """``cd CWD && export PYTHONPATH=CWD:... && echo resume_from=... && exec resilient run ...``."""
    if isinstance(prefix, str):
        cmd = resilient_command(
            program, checkpoint_dir=checkpoint_dir, run=run, launcher_prefix=prefix
        )
    else:
        cmd = resilient_command([*prefix, *program], checkpoint_dir=checkpoint_dir, run=run)
    parts = []
    if cwd:
        q = shlex.quote(cwd)
        parts += [f"cd {q}", f"export PYTHONPATH={q}${{PYTHONPATH:+:$PYTHONPATH}}"]
    marker = f"resilient: resume_from={resume_from or 'none'}"
    parts += [f"echo {shlex.quote(marker)}", f"exec {cmd}"]
    return " && ".join(parts)


# Bash app bodies. They run on the worker (sys.executable and mpiexec are the worker's) and are
# module-level functions so that Parsl ships them by reference. `resume_from` is informative:
# the programs resume from their newest valid checkpoint by themselves; the command echoes it
# into the task's stdout.


def resumable_bash(
    *,
    checkpoint_dir: str,
    command: Sequence[str] = (),
    module: str | None = None,
    args: Sequence[str] = (),
    launch: Launch = Launch(launcher="none"),
    run: RunOptions = RunOptions(),
    cwd: str | None = None,
    resume_from: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> str:
    """Body of the ``bash`` app: ``resilient run ... -- [LAUNCHER -n N] PROGRAM``."""
    return _shell(
        _program(command, module, args), launch.argv(), checkpoint_dir=checkpoint_dir, run=run,
        cwd=cwd, resume_from=resume_from,
    )  # fmt: skip


# No default for parsl_resource_specification: a default would be copied into the call (BashApp
# does that) and an empty one hangs MPI mode (Parsl#3427).


def resumable_mpi_bash(
    *,
    parsl_resource_specification: Mapping[str, Any],
    checkpoint_dir: str,
    command: Sequence[str] = (),
    module: str | None = None,
    args: Sequence[str] = (),
    run: RunOptions = RunOptions(),
    cwd: str | None = None,
    resume_from: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> str:
    """Body of the ``mpi_bash`` app: ``resilient run ... -- $PARSL_MPI_PREFIX PROGRAM``."""
    return _shell(
        _program(command, module, args), "$PARSL_MPI_PREFIX", checkpoint_dir=checkpoint_dir,
        run=run, cwd=cwd, resume_from=resume_from,
    )  # fmt: skip


def run_resumable(
    argv: Sequence[str],
    checkpoint_dir: str,
    *,
    resume_from: str | None = None,
    run: RunOptions = RunOptions(),
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | None = None,
) -> dict[str, Any]:
    """Run ``argv`` under ``resilient run`` in a subprocess (the body of the python app).

    ``cwd`` is the working directory (also put first on ``PYTHONPATH``), ``env`` extra
    environment variables. Output goes to ``log_path`` (appended; it starts with a
    ``resilient: resume_from=...`` line per try) or is captured.

    Returns:
        ``{"exit_code": 0, "resume_from": resume_from, "checkpoint_dir": checkpoint_dir}``.

    Raises:
        ResumableCommandError: non-zero exit, with its code (classified by the retry handler
            like a bash app's exit code) and, without ``log_path``, the output's tail.
    """
    command = resilient_argv(argv, checkpoint_dir=checkpoint_dir, run=run)
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


# --------------------------------------------------------------------------- submit side


def _latest_path(root: str) -> str | None:
    rec = latest_valid(Path(root))
    return str(rec.path) if rec is not None else None


@dataclass(frozen=True, slots=True)
class Submit:
    """Calls a Parsl app with absolute paths, ``cwd`` and a submit-time ``resume_from``.

    Attributes:
        app: the Parsl app.
        body: the app's body, whose signature binds the call's arguments.
        cwd: the default working directory (relative paths are resolved against it).
        paths: names of path arguments made absolute.
        mpi_ranks: for an MPIExecutor app, turn ``ranks``/``nodes`` into
            ``parsl_resource_specification`` (this is the default rank count).
    """

    app: Callable[..., Any]
    body: Callable[..., Any]
    cwd: str
    paths: tuple[str, ...] = ("checkpoint_dir",)
    mpi_ranks: int | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mpi_ranks is not None:
            ranks = int(kwargs.pop("ranks", self.mpi_ranks))
            nodes = int(kwargs.pop("nodes", 1))
            kwargs.setdefault(
                "parsl_resource_specification",
                {"num_nodes": nodes, "ranks_per_node": -(-ranks // nodes), "num_ranks": ranks},
            )
        bound = inspect.signature(self.body).bind(*args, **kwargs).arguments
        bound.setdefault("cwd", self.cwd)
        base = Path(bound["cwd"])
        for name in self.paths:
            if bound.get(name) is not None:
                bound[name] = str(base / os.fspath(bound[name]))
        if "resume_from" not in bound and bound.get("checkpoint_dir") is not None:
            bound["resume_from"] = _latest_path(bound["checkpoint_dir"])
        return self.app(**bound)


@dataclass(frozen=True, slots=True)
class ResumableApps:
    """The apps of :func:`resumable_apps`; each call returns a Parsl ``AppFuture``.

    Keyword arguments are those of the bodies (:func:`resumable_bash`,
    :func:`resumable_mpi_bash` plus ``ranks``/``nodes``, :func:`run_resumable`).
    """

    bash: Submit
    mpi_bash: Submit
    python: Submit


def resumable_apps(
    executors: str | list[str] = "all",
    *,
    cwd: str | os.PathLike[str] | None = None,
    cache: bool = False,
    mpi_ranks: int = 1,
) -> ResumableApps:
    """Parsl apps that run any command or module resumably (see the module docstring).

    Creating them needs no loaded DataFlowKernel; calling them does. ``cwd`` (default: the
    current directory) is where the programs run and what relative ``checkpoint_dir`` and
    ``log_path`` are resolved against. ``mpi_ranks`` is the default ``ranks`` of ``mpi_bash``.
    """
    root = str(Path(cwd if cwd is not None else os.getcwd()).resolve())
    opts: dict[str, Any] = {
        "executors": executors,
        "cache": cache,
        "ignore_for_cache": ["resume_from"],
    }
    return ResumableApps(
        bash=Submit(parsl.bash_app(resumable_bash, **opts), resumable_bash, root),
        mpi_bash=Submit(
            parsl.bash_app(resumable_mpi_bash, **opts),
            resumable_mpi_bash,
            root,
            mpi_ranks=mpi_ranks,
        ),
        python=Submit(
            parsl.python_app(run_resumable, **opts),
            run_resumable,
            root,
            ("checkpoint_dir", "log_path"),
        ),
    )
