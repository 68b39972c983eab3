"""The signal dispositions a test must leave as it found them (tests/conftest.py after each
test, docs/conftest.py after each page).

A ``Session`` ends with ``SIG_IGN`` for its warning signals (and for all its signals after a
stop: its process is about to exit). Left so in the pytest process, every process it starts
later inherits it (a Parsl interchange that ignores SIGTERM costs 10 s to shut down, a program
of a later test ignores a SIGTERM sent to it), and a test's result depends on the tests before it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["KEPT", "put_back", "taken"]

#: the signals a Session or `resilient run` in this process handles: the stop signals, Flux's
#: SIGALRM, and the terminating ones
KEPT = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGALRM,
)

Dispositions = Mapping[signal.Signals, Callable[[int, Any], Any] | int | None]


def taken() -> Dispositions:
    """The dispositions of :data:`KEPT` now."""
    return {s: signal.getsignal(s) for s in KEPT}


def put_back(saved: Dispositions) -> None:
    """Install ``saved`` (what :func:`taken` returned) again."""
    for s, handler in saved.items():
        if handler is not None:  # None: installed outside Python, cannot be put back
            signal.signal(s, handler)
