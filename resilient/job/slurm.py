"""The job's deadline and stop signals: Slurm environment, ``squeue``, Flux's ``flux job
timeleft`` (:mod:`resilient.job.flux`), and ``resilient run``.

Nothing happens at import. Signal handlers are installed only by :class:`StopSignals` (a
context manager) and only set a flag: no I/O, no MPI, no exceptions inside a handler. How a
warning signal arriving before or after them is kept from killing the program:
:mod:`resilient.job.warning`.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType, TracebackType
from typing import Any

from resilient.job import flux, warning
from resilient.job.protocol import ENV_DEADLINE

__all__ = [
    "DEFAULT_STOP_SIGNALS",
    "StopSignals",
    "find_deadline",
    "job_of",
    "parse_signal",
    "parse_squeue_time_left",
    "squeue_time_left",
]

DEFAULT_STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")

_SQUEUE_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_signal(name: str | int) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"`` or ``10`` -> ``signal.SIGUSR1``.

    Raises:
        ValueError: not a signal.
    """
    if isinstance(name, int):
        return signal.Signals(name)
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        return signal.Signals[text]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}") from None


def parse_squeue_time_left(text: str) -> float | None:
    """Parse ``squeue -o %L``: ``days-hh:mm:ss``, ``hh:mm:ss``, ``mm:ss``; ``None`` if unlimited/invalid."""
    text = text.strip()
    m = _SQUEUE_RE.match(text)
    if not m:
        return None  # UNLIMITED, INVALID, NOT_SET, empty
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def squeue_time_left(job_id: str, *, timeout_s: float = 10.0) -> float | None:
    """Ask Slurm how long ``job_id`` has left (``None`` if squeue is missing or says nothing)."""
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%L"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return parse_squeue_time_left(proc.stdout.splitlines()[0] if proc.stdout else "")


def find_deadline(
    environ: Mapping[str, str] | None = None,
    *,
    now: Callable[[], float] = time.time,
    time_left: Callable[[str], float | None] = squeue_time_left,
    flux_time_left: Callable[[], float | None] = flux.flux_time_left,
) -> tuple[float | None, str]:
    """The job's deadline (Unix seconds) and where it came from.

    Sources, in order: ``SLURM_JOB_END_TIME`` (Slurm >= 23.02), ``squeue -j $SLURM_JOB_ID -o
    %L``, ``flux job timeleft`` in a Flux job (``$FLUX_JOB_ID``), ``RESILIENT_DEADLINE``
    (exported by ``resilient run --walltime``), none.
    """
    env = os.environ if environ is None else environ
    end = env.get("SLURM_JOB_END_TIME", "").strip()
    if end.isdigit() and int(end) > 0:
        return float(end), "SLURM_JOB_END_TIME"
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        left = time_left(job)
        if left is not None:
            return now() + left, "squeue"
    if flux.under_flux(env):
        left = flux_time_left()
        if left is not None:
            return now() + left, flux.DEADLINE_SOURCE
    own = env.get(ENV_DEADLINE, "").strip()
    if own:
        try:
            value = float(own)
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return value, ENV_DEADLINE
    return None, "none"


def job_of(environ: Mapping[str, str]) -> dict[str, str]:
    """What identifies this batch job (for the root's lock file): its Slurm job id, if any."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    return {"slurm_job_id": job} if job else {}


class StopSignals:
    """Context manager: on any of ``signals``, set a flag (and nothing else). Not collective.

    ``signals`` defaults to :data:`DEFAULT_STOP_SIGNALS`, and in a Flux job (``$FLUX_JOB_ID``)
    also ``SIGALRM``, Flux's time limit (:mod:`resilient.job.flux`).

    Entering installs the handlers, takes over a warning signal recorded since ``import
    resilient`` (:func:`resilient.job.warning.arm`), and unblocks ``signals``: one held back
    since the program started (``resilient run`` starts it with the warning signal blocked) is
    delivered then and sets the flag. On exit the previous handlers come back, except that a
    warning signal (not SIGTERM, SIGINT, SIGHUP, SIGQUIT) whose previous disposition was the
    default becomes ``SIG_IGN``: one that arrives while the program writes its output or
    finalizes MPI must not kill it. Use in the main thread only.
    """

    def __init__(self, signals: Iterable[str | int] | None = None) -> None:
        if signals is None:  # the default: in a Flux job also SIGALRM, its time limit
            signals = (*DEFAULT_STOP_SIGNALS, *flux.time_limit_signals())
        self.signals = tuple(dict.fromkeys(parse_signal(s) for s in signals))  # once each
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def is_set(self) -> bool:
        """Whether a stop signal arrived."""
        return self.received is not None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    @property
    def is_active(self) -> bool:
        """Whether the handlers are installed."""
        return bool(self._previous)

    def __enter__(self) -> StopSignals:
        if not self._previous:  # entering twice is harmless (programs may install them early)
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
            early = warning.take_early(self.signals)
            if early is not None and self.received is None:
                self.received = early
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)  # pending: delivered now
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, old in self._previous.items():
            if warning.is_warning(sig) and (
                old in (signal.SIG_DFL, None) or warning.is_recorder(old)
            ):
                old = signal.SIG_IGN  # nothing more to save: a late warning must not kill
            signal.signal(sig, old)
        self._previous.clear()

    def ignore(self) -> None:
        """Ignore these signals from now on: the program has saved all it will save.

        Call it once a program is done (output written) or about to exit after a stop. CPython
        gives signals with Python handlers their default action back during shutdown (for
        SIGUSR1 and SIGUSR2: terminate), so a warning signal arriving while MPI finalizes would
        turn a finished run into a killed one; ``SIG_IGN`` is kept.
        """
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()
