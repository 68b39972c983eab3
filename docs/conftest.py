"""Every Python block of the pages runs as a test (Sybil), in a fresh temporary directory.

A page's blocks run in order in one namespace, like a user pasting them into one session.
Blocks in other languages (console, yaml, text) are not run here: the files behind them are
included from real files (``literalinclude``) that the integration tests run.
"""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Any

from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser, SkipParser

# what a page's Session may leave ignored (it ends so: its process is about to exit), which
# every later test's processes would inherit (tests/conftest.py puts them back per test)
SIGNALS = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGALRM,
)


def _setup(namespace: dict[str, Any]) -> None:
    namespace["_signals_before"] = {s: signal.getsignal(s) for s in SIGNALS}
    namespace["_cwd_before"] = os.getcwd()
    namespace["_tmp"] = tempfile.TemporaryDirectory(prefix="resilient-docs-")
    os.chdir(namespace["_tmp"].name)


def _teardown(namespace: dict[str, Any]) -> None:
    for s, handler in namespace["_signals_before"].items():
        if handler is not None:  # None: installed outside Python, cannot be put back
            signal.signal(s, handler)
    os.chdir(namespace["_cwd_before"])
    namespace["_tmp"].cleanup()


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["*.md"],
    excludes=["_build/*"],
    setup=_setup,
    teardown=_teardown,
).pytest()
