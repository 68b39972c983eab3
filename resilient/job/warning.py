"""The walltime's warning signal never kills the program: held back, then recorded, then ignored.

A warning signal (``resilient run --signal USR1@L``, Slurm's ``--signal=USR1@L``) asks a
program to checkpoint and stop. Its default action is to terminate, so one that arrives before
the program listens (its imports, its set-up) or after it stopped listening (writing its output,
``MPI_Finalize``) would kill it. Three pieces close those windows:

* ``resilient run`` starts the program with the warning signal **blocked** (:func:`blocked`) and
  names it in ``$RESILIENT_WARN_SIGNALS``. A blocked signal stays pending, and the mask
  survives ``fork``, ``exec`` and MPICH's ``mpiexec`` (its proxies pass it on to the ranks);
  Slurm's ``srun`` does not pass it on (slurmstepd starts tasks with an empty mask), the
  environment variable does.
* ``import resilient`` calls :func:`arm`: with ``$RESILIENT_WARN_SIGNALS`` set, a signal there
  whose disposition is the default gets a handler that only records it, then it is unblocked
  (one that arrived before is delivered now, and recorded).
  :class:`~resilient.job.slurm.StopSignals` takes the record over (:func:`take_early`).
* When :class:`~resilient.job.slurm.StopSignals` stops listening, a warning signal whose
  previous disposition was the default (or :func:`arm`'s recorder) becomes ``SIG_IGN``, not the
  default: the program has nothing more to save, and CPython gives signals with Python handlers
  their default action back while it shuts down, before MPI finalizes.

Terminating signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT) are never warnings here: they keep
their meaning, "stop now". Only the standard library is imported (and :mod:`resilient.job.protocol`,
which names ``$RESILIENT_WARN_SIGNALS`` and imports only it): this runs at ``import
resilient``. No function here is collective; all are per process, main thread only.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator, Mapping
from types import FrameType

from resilient.job.protocol import ENV_WARN_SIGNALS

__all__ = [
    "arm",
    "blocked",
    "is_warning",
    "is_recorder",
    "take_early",
    "warning_signals",
]

_TERMINATING = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL, signal.SIGSTOP}
)

_early: list[int] = []  # signals recorded by arm()'s handler, not yet taken by a StopSignals


def is_warning(sig: signal.Signals) -> bool:
    """Whether ``sig`` can be a warning: held back and ignored rather than left to kill."""
    return sig not in _TERMINATING


def warning_signals(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The warning signals ``$RESILIENT_WARN_SIGNALS`` names (``"SIGUSR1"``, ``"USR1,USR2"``,
    ``"10"``); unknown and terminating names are left out."""
    env = os.environ if environ is None else environ
    found: list[signal.Signals] = []
    for word in env.get(ENV_WARN_SIGNALS, "").replace(",", " ").split():
        text = word.upper()
        try:
            sig = (
                signal.Signals(int(text))
                if text.isdigit()
                else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
            )
        except (KeyError, ValueError):
            continue
        if is_warning(sig) and sig not in found:
            found.append(sig)
    return tuple(found)


def _record(signum: int, frame: FrameType | None) -> None:
    _early.append(signum)


def is_recorder(handler: object) -> bool:
    """Whether ``handler`` is :func:`arm`'s recording handler."""
    return handler is _record


def arm(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """Listen early for the warning signals ``$RESILIENT_WARN_SIGNALS`` names: record them.

    Called by ``import resilient``. A signal with a handler of its own (the program's) keeps it;
    every named signal is unblocked, so one held back since the program started is delivered
    now. Does nothing outside the main thread (Python runs handlers there only). Returns the
    signals it unblocked.
    """
    sigs = warning_signals(environ)
    if not sigs:
        return ()
    try:
        for sig in sigs:
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _record)
    except ValueError:  # not the main thread
        return ()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
    return sigs


def take_early(signals: Iterable[signal.Signals]) -> signal.Signals | None:
    """The first of ``signals`` that :func:`arm`'s handler recorded, forgetting those."""
    wanted = set(signals)
    first = next((s for s in _early if s in wanted), None)
    _early[:] = [s for s in _early if s not in wanted]
    return None if first is None else signal.Signals(first)


@contextlib.contextmanager
def blocked(signals: Iterable[signal.Signals]) -> Iterator[None]:
    """Block ``signals`` in this thread for the ``with`` block: a child started inside it (by
    ``subprocess.Popen``) inherits the mask. One that arrives meanwhile is delivered on exit."""
    sigs = [s for s in signals if is_warning(s)]
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
