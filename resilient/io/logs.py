"""The append-only logs of a checkpoint root: their record shapes, the one reader, the one append.

The logs (one JSON object per line): ``attempts.jsonl`` (``resilient run``'s ledger),
``progress.jsonl`` (a Session's timeline), ``stops.jsonl`` (why a program stopped early),
``saves.jsonl`` (committed checkpoints), ``protected.jsonl`` (node-local steps whose partner
copies committed) and the sidecar ``.NAME.resilient-attempts`` beside a root. Each one's shape
is declared once here (:class:`LogKind`: required fields and the types of the optional ones).

:func:`read_log` never raises: a missing file has no records; a line that is torn, not UTF-8,
not JSON, not an object, or an object of the wrong shape (a string where a number belongs, a
list where an object belongs, a bool where an int belongs) is skipped, and one warning per
file per process says how many lines were skipped and that the rest is used. What decides
(the no-progress guard, requeue, the report, Parsl's retry handler) sees only valid records.

:func:`append_record` writes each record with one ``os.write`` of the whole encoded line on
an ``O_APPEND`` descriptor, so a crash leaves at most a torn last line; a record appended
after a torn line starts with a newline, so the torn line cannot swallow it.

Not collective: call on one rank (the coordinator, rank 0, or the wrapper).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "ATTEMPTS",
    "PROGRESS",
    "PROTECTED",
    "SAVES",
    "SIDECAR",
    "STOPS",
    "LogKind",
    "append_record",
    "parse_log",
    "read_log",
    "record_line",
]

log = logging.getLogger(__name__)

Types = tuple[type, ...]

INT: Final[Types] = (int,)
NUMBER: Final[Types] = (int, float)
TEXT: Final[Types] = (str,)
FLAG: Final[Types] = (bool,)
LIST: Final[Types] = (list,)
OBJECT: Final[Types] = (dict,)
NONE: Final[Types] = (type(None),)


def fits(value: object, types: Types) -> bool:
    """Whether a decoded JSON value is one of ``types`` (a bool is not an int or a number)."""
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


@dataclass(frozen=True, slots=True)
class LogKind:
    """The shape of one log's records: fields every record has, and the types of fields a
    record may have (absent is fine; fields not named here are kept as they are)."""

    name: str  # what a warning calls the log
    required: tuple[tuple[str, Types], ...]
    optional: tuple[tuple[str, Types], ...] = ()

    def fits(self, record: object) -> bool:
        """Whether ``record`` (a decoded JSON line) is a record of this log."""
        if not isinstance(record, dict):
            return False
        for key, types in self.required:
            if key not in record or not fits(record[key], types):
                return False
        return all(key not in record or fits(record[key], types) for key, types in self.optional)


ATTEMPTS: Final = LogKind(
    "attempt ledger",
    required=(("attempt", INT), ("exit_code", INT)),
    optional=(
        ("start", NUMBER), ("end", NUMBER), ("exit_status", INT + NONE), ("signal", TEXT + NONE),
        ("reason", TEXT), ("latest_before", INT + NONE), ("restored_step", INT + NONE),
        ("passed_over", LIST), ("latest_after", INT + NONE), ("progress", FLAG),
        ("host", TEXT), ("slurm_job_id", TEXT + NONE), ("slurm_restart_count", INT + NONE),
        ("command", LIST), ("program_stop", OBJECT + NONE), ("interrupted", TEXT + NONE),
        ("lost_nodes", LIST), ("fingerprint", TEXT + NONE), ("engine", TEXT + NONE),
        ("retry", TEXT + NONE), ("new_run", TEXT + NONE), ("startup_s", NUMBER + NONE),
        ("program_dir", TEXT + NONE),
    ),
)  # fmt: skip
"""``attempts.jsonl``: one line per attempt of ``resilient run``."""

PROGRESS: Final = LogKind(
    "timeline",
    required=(("time", NUMBER), ("step", INT + NONE)),
    optional=(
        ("event", TEXT), ("t0", NUMBER), ("resumed", FLAG), ("attempt", INT + NONE),
        ("session_start", NUMBER), ("passed_over", LIST), ("loop_end", NUMBER),
        ("stopped", FLAG), ("raised", TEXT + NONE),
    ),
)  # fmt: skip
"""``progress.jsonl``: a Session's samples and events (:mod:`resilient.job.timeline`)."""

STOPS: Final = LogKind(
    "stop log",
    required=(("time", NUMBER),),
    optional=(
        ("attempt", INT + NONE), ("step", INT + NONE), ("reason", TEXT + NONE),
        ("saved", FLAG), ("foreign", FLAG), ("margin_s", NUMBER + NONE),
        ("margin_used_s", NUMBER + NONE), ("time_left_at_start_s", NUMBER + NONE),
        ("deadline_source", TEXT + NONE),
    ),
)  # fmt: skip
"""``stops.jsonl``: why a program stopped early, or refused the directory (``foreign``)."""

SAVES: Final = LogKind(
    "save log",
    required=(("step", INT),),
    optional=(
        ("time", NUMBER), ("cost_s", NUMBER), ("flush_s", NUMBER), ("tier", TEXT),
        ("bytes", INT), ("manifest_time", NUMBER), ("metrics", OBJECT), ("static", TEXT + NONE),
    ),
)  # fmt: skip
"""``saves.jsonl``: one line per committed checkpoint (or flush of a node-local one)."""

PROTECTED: Final = LogKind(
    "partner-copy log",
    required=(("step", INT),),
    optional=(("time", NUMBER), ("protect_s", NUMBER), ("bytes", INT)),
)
"""``protected.jsonl``: node-local steps whose partner copies committed on other nodes."""

SIDECAR: Final = LogKind(
    "attempt record beside the checkpoint directory",
    required=(("attempt", INT), ("exit_code", INT)),
    optional=(("time", NUMBER),),
)
"""``PARENT/.NAME.resilient-attempts``: the attempts' outcomes, beside the directory."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(what: str, where: str, message: str, *args: object) -> None:
    """Log ``message`` at warning level the first time for ``what`` (reading, appending) of
    the log ``where`` (a path, or another target's name of it) in this process, at debug level
    after that."""
    key = f"{what}:{os.path.abspath(where)}"
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args)


def read_log(path: Path, kind: LogKind) -> list[dict[str, Any]]:
    """The valid records of the log at ``path``, in file order. Never raises.

    A missing file has none; a file that cannot be read has none (one warning); lines that
    are torn, undecodable or not of ``kind``'s shape are skipped (one warning per file per
    process, with their count)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        _warn_once(
            "read", str(path), "cannot read the %s %s (%s): going on without it", kind.name,
            path, exc,
        )  # fmt: skip
        return []
    return parse_log(data, kind, where=str(path))


def parse_log(data: bytes, kind: LogKind, *, where: str) -> list[dict[str, Any]]:
    """The valid records of a log's bytes ``data``, in order (see :func:`read_log`; ``where``
    names the log in the warning). Never raises."""
    out: list[dict[str, Any]] = []
    skipped = 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, torn, or nested beyond the decoder
            skipped += 1
            continue
        if kind.fits(rec):
            out.append(rec)
        else:
            skipped += 1
    if skipped:
        _warn_once(
            "read", where, "the %s %s has %d damaged line%s (torn, not UTF-8, or of the wrong "
            "shape): skipped, using its %d valid record%s", kind.name, where, skipped,
            "" if skipped == 1 else "s", len(out), "" if len(out) == 1 else "s",
        )  # fmt: skip
    return out


def record_line(record: Mapping[str, Any]) -> bytes:
    """``record`` as one line of a log (JSON, newline-terminated)."""
    return (json.dumps(record, allow_nan=True) + "\n").encode()


def append_record(path: Path, record: Mapping[str, Any], *, durable: bool = False) -> None:
    """Append ``record`` to the log at ``path`` as one JSON line, by one ``os.write`` on an
    ``O_APPEND`` descriptor (after a newline if the file ends in a torn line).

    Best effort by default: a log must never fail a save, so an ``OSError`` is one warning
    per file per process. ``durable=True`` (the attempt ledger): fsynced, and an ``OSError``
    is raised."""
    try:
        _append(path, record_line(record), durable=durable)
    except OSError as exc:
        if durable:
            raise
        _warn_once("append", str(path), "could not append to %s: %s", path, exc)


def _append(path: Path, line: bytes, *, durable: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # the torn line stays one (skipped) line of its own
        written = os.write(fd, line)
        if written != len(line):  # a full disk, or a signal mid-write: torn, but said
            raise OSError(errno.EIO, f"wrote {written} of {len(line)} bytes", str(path))
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
