"""The program's processes: its tree in ``/proc``, the signals sent to it, one launch of it.

:func:`descendants` and :func:`ancestors` read the process tree from ``/proc`` (MPI launchers
put their ranks in sessions of their own, so a signal to the program's process group misses
them): :func:`signal_tree` sends a signal to all of them, and :mod:`resilient.job.guard` tells
the engine above ``resilient run`` by its ancestors (:func:`cmdline`, :func:`start_ticks`).
:class:`Attempt` is one launch of the command: the warning signal held until the program
listens (:mod:`resilient.job.warning`), the local walltime played as Slurm's sequence (warning
signal, SIGTERM, SIGKILL) and the stop signals that reach ``resilient run`` passed on
(:class:`Signals`, its signal handler).

Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping
from typing import Any

from resilient.job import warning
from resilient.job.options import RunOptions, say_seconds
from resilient.job.protocol import ENV_TREE, ENV_WARN_SIGNALS

__all__ = [
    "Attempt",
    "Signals",
    "ancestors",
    "become_subreaper",
    "cmdline",
    "descendants",
    "end_what_it_left",
    "of_tree",
    "parent",
    "signal_tree",
    "start_ticks",
]

log = logging.getLogger("resilient.job.run")  # the lines of ``resilient run``

POLL_S = 0.05
"""How often ``resilient run`` looks at the program and the clock."""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state, ppid, ...), or
    ``None`` (gone, or not readable)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent(pid: int) -> int | None:
    """The parent of ``pid``, or ``None``."""
    fields = _stat(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> str:
    """When ``pid`` started, in clock ticks after boot (``?`` if unknown): with the pid, it
    names one process across pid reuse."""
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else "?"


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty if unknown)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [w.decode(errors="replace") for w in fh.read().split(b"\0") if w]
    except OSError:
        return []


def ancestors(pid: int) -> list[int]:
    """The parent of ``pid``, its parent, and so on up to init (at most 64)."""
    out: list[int] = []
    while pid > 1 and len(out) < 64:
        up = parent(pid)
        if up is None:
            break
        pid = up
        out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (MPI launchers put ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        up = parent(int(entry))
        if up is not None:
            children.setdefault(up, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_tree(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the child's process group and every descendant."""
    targets = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


_PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def become_subreaper() -> bool:
    """Make this process the one that adopts its descendants' orphans (Linux's
    ``PR_SET_CHILD_SUBREAPER``), so that ranks whose launcher died stay in its tree, where
    :func:`end_what_it_left` finds them. Returns whether that worked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


LEFT_GRACE_S = 1.0
"""How long processes the program left behind get to exit on their own (a launcher's proxies
end their ranks when it dies) before :func:`end_what_it_left` kills them."""


def _reap(pids: set[int]) -> None:
    """Collect the exit of those of ``pids`` that ended and are this process's children
    (adopted orphans become so: :func:`become_subreaper`). Never ``waitpid(-1)``: another
    thread's child (a test harness's, an engine's) keeps its exit status for its own wait."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] != "Z"]


def of_tree(pid: int, token: str) -> bool:
    """Whether process ``pid`` was started with ``RESILIENT_TREE=token`` in its environment
    (:data:`~resilient.job.protocol.ENV_TREE`: a process of one attempt's program)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False
    return f"{ENV_TREE}={token}".encode() in environ


def end_what_it_left(token: str, grace_s: float = LEFT_GRACE_S) -> list[int]:
    """After the program exited: the processes it left behind in this tree (those started
    with its ``RESILIENT_TREE=token``: :func:`of_tree`; a daemon this process started some
    other way, or adopted, is not the program's) get ``grace_s`` to end, then SIGKILL; returns
    the pids killed. Call it only once the program was waited for. Those that ended before
    they were seen stay zombies until this process exits (a zombie's environment cannot be
    read: nothing says it was the program's).

    A launcher killed alone (``mpiexec`` SIGKILLed, or crashed) may leave its ranks running.
    Measured here: MPICH's proxies end their ranks at once; Open MPI 5's ranks ran on for
    0.5-1 s after their ``prterun`` was SIGKILLed, and one committed a checkpoint meanwhile.
    Waiting for them keeps the ledger's newest step true and nothing of this attempt writing
    beside the next; a launcher that does not end its ranks (or a rank stuck in I/O) would
    leave them for ever, or hanging in a collective, and those are killed, as Slurm ends every
    process of a job step when the step ends. A save they were in is never committed."""
    deadline = time.monotonic() + grace_s
    seen: set[int] = set()  # the program's processes found alive: reaped once they end

    def program_left() -> list[int]:
        alive = [pid for pid in _running(descendants(os.getpid())) if of_tree(pid, token)]
        seen.update(alive)
        return alive

    while True:
        _reap(seen)
        left = program_left()
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if not left:
        return []
    log.warning(
        "the program exited and left %d of its processes running (%s): killing them, so that "
        "nothing of this attempt writes beside the next one",
        len(left), ", ".join(f"{pid} {' '.join(cmdline(pid)[:3])}" for pid in left[:4]),
    )  # fmt: skip
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while program_left() and time.monotonic() < end:
        time.sleep(POLL_S)
    _reap(seen)
    return left


class Attempt:
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
        token = env[ENV_TREE] = uuid.uuid4().hex
        held = (warn,) if warning.is_warning(warn) else ()
        if held:
            env[ENV_WARN_SIGNALS] = warn.name
        become_subreaper()
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
                signal_tree(proc, sig)
                last = sig.name
                self.forwarded.append(sig.name)
                if sig in (signal.SIGTERM, signal.SIGINT) and term_sent_at is None:
                    term_sent_at = now
            if warn_at is not None and now >= warn_at:
                log.info(
                    "walltime: %s %s before the limit",
                    self.opts.warn_signal.name,
                    say_seconds(max(0.0, term_at - now) if term_at else 0.0),
                )
                signal_tree(proc, self.opts.warn_signal)
                last, warn_at = self.opts.warn_signal.name, None
            if term_at is not None and now >= term_at:
                log.info("walltime reached: SIGTERM")
                signal_tree(proc, signal.SIGTERM)
                last, term_at = "SIGTERM", None
                term_sent_at = now
            if (kill_at is not None and now >= kill_at) or (
                term_sent_at is not None and now >= term_sent_at + self.opts.kill_wait_s
            ):
                log.info("kill-wait over: SIGKILL")
                signal_tree(proc, signal.SIGKILL)
                last, kill_at, term_sent_at = "SIGKILL", None, None
            time.sleep(POLL_S)
        end_what_it_left(token)
        return proc.returncode, last

    def on_signal(self, signum: int, frame: Any) -> None:
        self.pending.append(signum)  # acted upon by the polling loop


class Signals:
    """Where the stop signals ``resilient run`` handles go: to the attempt running now
    (:attr:`attempt`), else into :attr:`unheard` (they came while no program ran)."""

    def __init__(self) -> None:
        self.attempt: Attempt | None = None
        self.unheard: list[int] = []

    def forward(self, signum: int, frame: Any) -> None:
        """The signal handler."""
        if self.attempt is not None:
            self.attempt.on_signal(signum, frame)
        else:
            self.unheard.append(signum)
