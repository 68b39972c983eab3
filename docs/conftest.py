"""Every Python block of the pages runs as a test (Sybil), in a fresh temporary directory.

A page's blocks run in order in one namespace, like a user pasting them into one session.
Blocks in other languages (console, yaml, text) are not run here: the files behind them are
included from real files (``literalinclude``) that the integration tests run.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser, SkipParser

from tests import signals  # (the repository root is on pytest's path: pyproject.toml)


def _setup(namespace: dict[str, Any]) -> None:
    namespace["_signals_before"] = signals.taken()  # a page's Session may leave them ignored
    namespace["_cwd_before"] = os.getcwd()
    namespace["_tmp"] = tempfile.TemporaryDirectory(prefix="resilient-docs-")
    os.chdir(namespace["_tmp"].name)


def _teardown(namespace: dict[str, Any]) -> None:
    signals.put_back(namespace["_signals_before"])
    os.chdir(namespace["_cwd_before"])
    namespace["_tmp"].cleanup()


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["*.md"],
    excludes=["_build/*"],
    setup=_setup,
    teardown=_teardown,
).pytest()
