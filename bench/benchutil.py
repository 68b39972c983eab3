"""Helpers shared by the benchmark scripts (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import resilient


def library_revision() -> str:
    """Git commit of the ``resilient`` being measured (``-dirty`` if its sources are modified)."""
    src = Path(resilient.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "-uno", "--", "."],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("-dirty" if dirty else "")
