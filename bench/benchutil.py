"""Helpers shared by the benchmark scripts (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import ctypes
import json
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


def write_json(path: str | None, results: object) -> None:
    """Write a benchmark's ``results`` as JSON to ``path`` (``--json``), if one was given."""
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


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


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start the writeback of a written range without waiting: Linux's ``sync_file_range``
    with ``SYNC_FILE_RANGE_WRITE`` (called here directly: the bench times the OS, not the
    library's helper); elsewhere nothing."""
    func = getattr(ctypes.CDLL(None), "sync_file_range", None) if os.name == "posix" else None
    if func is not None and length > 0:
        func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        func(fd, offset, length, 2)
