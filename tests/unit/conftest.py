"""Shared fixtures of the unit tests: a root with three committed checkpoints; every test's
signal dispositions put back."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient import CheckpointManager
from tests.unit.ckutil import SavedRoot, state_of, static_of


@pytest.fixture
def saved(tmp_path: Path) -> SavedRoot:
    """ROOT with steps 1, 2, 3 (arrays, JSON values, shared static data); manager closed."""
    root = tmp_path / "ck"
    states, statics = {}, {}
    with CheckpointManager(root) as m:
        for step in (1, 2, 3):
            states[step] = state_of(step)
            statics[step] = static_of(1)
            m.save(step, states[step], static=statics[step], metrics={"loss": 1.0 / step})
    return SavedRoot(root, states, statics)


# the signals a Session or `resilient run` in this process handles: the stop signals, Flux's
# SIGALRM, and the terminating ones
KEPT = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGALRM,
)


@pytest.fixture(autouse=True)
def _signal_dispositions_kept() -> Iterator[None]:
    """Each test leaves these signals as it found them. A Session ends with ``SIG_IGN`` for its
    warning signals (and for all its signals after a stop: its process is about to exit); left
    so in the pytest process, every process it starts later inherits it (a Parsl interchange
    that ignores SIGTERM costs 10 s to shut down, a program of a later test ignores a SIGTERM
    sent to it), and a test's result depends on the tests before it."""
    old = {s: signal.getsignal(s) for s in KEPT}
    yield
    for s, handler in old.items():
        if handler is not None:  # None: installed outside Python, cannot be put back
            signal.signal(s, handler)
