"""Helpers shared by the benchmark scripts (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import os
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


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(path: Path) -> list[Path]:
    """``path`` if it is a file, else every file below it, sorted."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (or the file ``path``), then ``path``."""
    dirs = [] if path.is_file() else [p for p in path.rglob("*") if p.is_dir()]
    for p in [*files_under(path), *dirs, path]:
        fsync_path(p)
