"""The command of a resumable Parsl app: ``resilient run -- PROGRAM`` for your own apps.

Two forms, for the two kinds of Parsl app:

* :func:`resilient_command` returns the shell command a ``@bash_app`` returns::

      @bash_app
      def simulate(nx, ckpt, inputs=(), outputs=(), stdout=None, stderr=None):
          from resilient.integrations.parsl import resilient_command  # on the worker
          return resilient_command(["mpiexec", "-n", "4", "./sim", "--nx", nx,
                                    "--out", outputs[0]], checkpoint_dir=ckpt, outputs=outputs)

* :func:`run_resilient` runs the same command in a subprocess inside a ``@python_app`` and
  raises :class:`ResumableCommandError` (picklable, with the exit code) when it fails.

Both produce ``python -m resilient.cli run --checkpoint-dir D [options] -- PROGRAM...``. Given
the app's ``outputs`` (paths or Parsl ``File`` objects), ``resilient run`` creates their folders
before the program starts (Parsl does not: ``File("out/sim.h5")`` needs ``out/``) and refuses a
checkpoint directory that is, or lies in, one of them (exit 78). The
exit code is ``resilient run``'s contract (0, 75, 93, 74, 78, or the program's own), which
:func:`~resilient.integrations.parsl.retry.resume_retry_handler` turns into a retry cost.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from resilient.job.exitcodes import EXIT_FOREIGN_RUN, EXIT_NO_PROGRESS
from resilient.job.ledger import read_ledger
from resilient.job.options import RunOptions, parse_signal_spec

__all__ = [
    "ForeignRunRefused",
    "NoProgressRefused",
    "ResumableCommandError",
    "resilient_argv",
    "resilient_command",
    "run_resilient",
]

PathLike = str | os.PathLike[str]

_OUTPUT_TAIL = 4000  # characters of captured output kept in a ResumableCommandError


class ResumableCommandError(Exception):
    """A command run by :func:`run_resilient` exited non-zero. Picklable.

    Attributes:
        exitcode: the exit code of ``resilient run`` (75, 93, 74, 78 or the program's own).
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

    @classmethod
    def of(
        cls, exitcode: int, command: Sequence[str] = (), output: str = "", *, reason: str = ""
    ) -> ResumableCommandError:
        """The error for ``exitcode``: a :class:`ForeignRunRefused` for 78, a
        :class:`NoProgressRefused` for 93 (with ``reason``), else this class."""
        if exitcode == EXIT_FOREIGN_RUN:
            return ForeignRunRefused(command, output, reason=reason)
        if exitcode == EXIT_NO_PROGRESS:
            return NoProgressRefused(command, output, reason=reason)
        return ResumableCommandError(exitcode, command, output)


class _Refused(ResumableCommandError):
    """A run ``resilient run`` ended for good: retrying it cannot help. Picklable.

    Attributes:
        reason: why, from the task's attempt ledger or ``resilient run``'s refusal.
    """

    code = 0
    what = ""

    def __init__(self, command: Sequence[str] = (), output: str = "", *, reason: str = "") -> None:
        ResumableCommandError.__init__(self, self.code, command, output)
        self.args = (list(command), output, reason)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.command, self.output, self.reason))

    def __str__(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"{self.what} (exit {self.code}){why}"


def _rebuild(
    cls: type[_Refused], command: Sequence[str], output: str, reason: str
) -> _Refused:
    return cls(command, output, reason=reason)


class ForeignRunRefused(_Refused):
    """Exit 78: the checkpoint directory belongs to another run (other parameters, or it is
    the engine's: one of the task's outputs). Give the parameters a directory of their own."""

    code = EXIT_FOREIGN_RUN
    what = "the checkpoint directory belongs to another run"


class NoProgressRefused(_Refused):
    """Exit 93: ``--max-no-progress`` attempts in a row made no progress. Fix the cause, then
    run the task again (a new task starts it again; a retry of this one is refused)."""

    code = EXIT_NO_PROGRESS
    what = "no progress for too long"


def _word(value: Any) -> str:
    """One argument as text: a path (``os.PathLike``, e.g. a Parsl ``File``) or ``str(value)``."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)  # type: ignore[no-any-return]
    return str(value)


def resilient_argv(
    argv: Sequence[Any],
    *,
    checkpoint_dir: PathLike,
    outputs: Sequence[Any] = (),
    walltime_s: float | None = None,
    signal: str | None = None,
    max_no_progress: int | None = None,
    retries: int | None = None,
    requeue: bool = False,
    python: str | None = None,
    task: str | None = None,
) -> list[str]:
    """``[python, -m, resilient.cli, run, --checkpoint-dir, D, OPTIONS..., --, *argv]``.

    Options left ``None`` (or ``requeue=False``) are not passed: ``resilient run``'s defaults
    apply. ``outputs`` are the app's declared outputs (paths or Parsl ``File`` objects,
    ``--outputs``): their folders are created before the program starts. ``signal`` is
    ``SIG@SECONDS`` (``"USR1@30"``; :func:`resilient.job.options.parse_signal_spec`). The words
    are :meth:`resilient.job.options.RunOptions.argv`'s. ``python`` defaults to :data:`sys.executable` of the process
    that builds the command. ``task`` names every line ``resilient run`` logs (``resilient run
    [simulate hot]: attempt 2: ...``); left ``None``, ``resilient run`` names them after the
    checkpoint directory's last two path components (``heat/hot-1a2b3c4d5e6f`` for
    ``checkpoint_dir(root, "heat", params, wildcards={"case": "hot"})``), which already tell two
    tasks apart.
    """
    given: dict[str, Any] = {}
    if signal is not None:
        given["warn_signal"], given["warn_before_s"] = parse_signal_spec(signal)
    if max_no_progress is not None:
        given["max_no_progress"] = int(max_no_progress)
    if retries is not None:
        given["retries"] = int(retries)
    opts = RunOptions(
        command=tuple(_word(a) for a in argv),
        checkpoint_dir=Path(_word(checkpoint_dir)),
        outputs=tuple(Path(_word(o)) for o in outputs),
        walltime_s=walltime_s,
        requeue=requeue,
        task=task,
        **given,
    )
    return [python or sys.executable, "-m", "resilient.cli", "run", *opts.argv()]


def resilient_command(
    argv: Sequence[Any],
    *,
    checkpoint_dir: PathLike,
    outputs: Sequence[Any] = (),
    walltime_s: float | None = None,
    signal: str | None = None,
    max_no_progress: int | None = None,
    retries: int | None = None,
    requeue: bool = False,
    launcher_prefix: str = "",
    python: str | None = None,
    task: str | None = None,
) -> str:
    """The shell command ``python -m resilient.cli run --checkpoint-dir D ... -- PROGRAM...``.

    For the body of a ``@bash_app``. Every word is shell-quoted except ``launcher_prefix``, raw
    shell text put between ``--`` and the program, e.g. ``"$PARSL_MPI_PREFIX"`` under an
    ``MPIExecutor`` (the shell expands it). Values in ``argv`` may be numbers, paths or Parsl
    ``File`` objects. The options are :func:`resilient_argv`'s.
    """
    words = resilient_argv(
        argv, checkpoint_dir=checkpoint_dir, outputs=outputs, walltime_s=walltime_s, signal=signal,
        max_no_progress=max_no_progress, retries=retries, requeue=requeue, python=python,
        task=task,
    )  # fmt: skip
    if not launcher_prefix:
        return shlex.join(words)
    split = words.index("--") + 1
    return f"{shlex.join(words[:split])} {launcher_prefix} {shlex.join(words[split:])}"


def run_resilient(
    argv: Sequence[Any],
    *,
    checkpoint_dir: PathLike,
    outputs: Sequence[Any] = (),
    walltime_s: float | None = None,
    signal: str | None = None,
    max_no_progress: int | None = None,
    retries: int | None = None,
    requeue: bool = False,
    python: str | None = None,
    task: str | None = None,
    cwd: PathLike | None = None,
    env: Mapping[str, str] | None = None,
    log_path: PathLike | None = None,
) -> int:
    """Run ``argv`` under ``resilient run`` in a subprocess: the body of a ``@python_app``.

    ``cwd`` is the working directory, ``env`` extra environment variables (added to this
    process's). Output is appended to ``log_path``, else captured (its tail goes into the
    error). The options are :func:`resilient_argv`'s.

    Returns:
        ``0`` (a non-zero exit raises).

    Raises:
        ResumableCommandError: ``resilient run`` exited non-zero (its exit code, for
            :func:`~resilient.integrations.parsl.retry.resume_retry_handler`).
    """
    command = resilient_argv(
        argv, checkpoint_dir=checkpoint_dir, outputs=outputs, walltime_s=walltime_s, signal=signal,
        max_no_progress=max_no_progress, retries=retries, requeue=requeue, python=python,
        task=task,
    )  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    if log_path is None:
        done = subprocess.run(
            command, cwd=cwd, env=full_env, capture_output=True, text=True, check=False
        )
        code, output = done.returncode, (done.stdout + done.stderr)[-_OUTPUT_TAIL:]
    else:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as fh:
            code = subprocess.run(
                command, cwd=cwd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, check=False
            ).returncode
        output = ""
    if code != 0:
        raise ResumableCommandError.of(code, command, output, reason=_last_reason(checkpoint_dir))
    return 0


def _last_reason(checkpoint_dir: PathLike) -> str:
    """The reason of the last attempt in the ledger (what a refusal refers to)."""
    ledger = read_ledger(Path(checkpoint_dir))
    return str(ledger[-1].get("reason", "")) if ledger else ""
