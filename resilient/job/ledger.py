"""The attempts' ledger: one typed record per attempt, where it is kept, and its sidecar.

``resilient run`` appends one :class:`AttemptRecord` per attempt to ``attempts.jsonl``
(:data:`resilient.model.filenames.ATTEMPT_LEDGER`) in the task's checkpoint directory and reads
them back with :func:`read_ledger` (the CLI's ``resilient report``, the Parsl handler and the
guard read the same records). :class:`Where` says which directory holds it: ``--checkpoint-dir``,
else the program's own (its Session's hand-off, :mod:`resilient.job.handoff`), else the task's
own directory. Beside the checkpoint directory, :func:`sidecar_path` keeps each attempt's
outcome (:func:`note_beside`), where an engine that deletes the directory leaves it.

Reads and writes files; no process or signal here.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilient.io import logs, storage
from resilient.job import handoff
from resilient.model import filenames

__all__ = [
    "AttemptRecord",
    "Where",
    "note_beside",
    "read_ledger",
    "same_dir",
    "sidecar_path",
    "where_for",
]

log = logging.getLogger("resilient.job.run")  # the lines of ``resilient run``


@dataclass(slots=True)
class AttemptRecord:
    """One line of the attempt ledger."""

    attempt: int
    start: float
    end: float = 0.0
    exit_status: int | None = None
    signal: str | None = None
    reason: str = ""
    latest_before: int | None = None  # the newest checkpoint that passed the quick check
    restored_step: int | None = None  # the step the program restored (its Session's record)
    passed_over: list[int] = field(default_factory=list)  # newer steps it quarantined first
    latest_after: int | None = None
    progress: bool = False
    host: str = field(default_factory=socket.gethostname)
    slurm_job_id: str | None = None
    slurm_restart_count: int | None = None  # how often Slurm requeued the job (a requeue)
    command: list[str] = field(default_factory=list)
    exit_code: int = 0
    program_stop: dict[str, Any] | None = None  # the program's own stop record, if it wrote one
    interrupted: str | None = None  # the signal that killed it from outside (job.guard)
    lost_nodes: list[str] = field(default_factory=list)  # the job's nodes Slurm lost meanwhile
    fingerprint: str | None = None  # the invocation (job.guard.Invocation): command, files,
    engine: str | None = None  # ... the engine that started it ...
    retry: str | None = None  # ... and whether the engine says it retries
    new_run: str | None = None  # why a run that had ended started again with this attempt
    startup_s: float | None = None  # launch to the program's first step (its Session's timeline)
    program_dir: str | None = None  # the directory its Session said it uses (job.handoff)

    def to_record(self) -> dict[str, Any]:
        """The ledger line's fields (:data:`resilient.io.logs.ATTEMPTS`)."""
        return asdict(self)


def read_ledger(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """The ledger's valid records (damaged lines are skipped with one warning:
    :mod:`resilient.io.logs`)."""
    return logs.read_log(checkpoint_dir / filenames.ATTEMPT_LEDGER, logs.ATTEMPTS)


def sidecar_path(checkpoint_dir: Path) -> Path:
    """``PARENT/.NAME.resilient-attempts``: the attempts' outcomes, beside the directory."""
    path = Path(os.path.abspath(checkpoint_dir))
    return path.parent / filenames.attempt_sidecar_name(path.name)


def note_beside(checkpoint_dir: Path, number: int, record: AttemptRecord) -> None:
    """Append the attempt's outcome to :func:`sidecar_path` (best effort, a warning if that
    fails: the record only serves the deleted-directory check, never the run itself)."""
    logs.append_record(
        sidecar_path(checkpoint_dir),
        {"attempt": number, "exit_code": record.exit_code, "time": record.end},
    )


@dataclass(slots=True)
class Where:
    """Where one task's files are, as far as ``resilient run`` knows so far.

    ``given``: ``--checkpoint-dir``; ``own``: without it, the task's own directory
    (:func:`resilient.job.handoff.task_dir`); ``handoff_file``: the file the program's Session names
    its directory in; ``program``: the directory it named (``None``: not told yet).

    Progress is judged on the program's directory, else the given one. The ledger is kept in
    the given directory; without one, in the program's directory once known (where ``resilient
    report`` finds it; the records kept in the task's own directory until then move there),
    else in the task's own directory; with none writable, in memory for this invocation.
    """

    given: Path | None
    own: Path | None = None
    handoff_file: Path | None = None
    program: Path | None = None
    told: bool = False  # the program has a Session: it handed off, now or before
    mine: list[dict[str, Any]] = field(default_factory=list)  # this invocation's records
    warned: set[str] = field(default_factory=set)

    @property
    def progress_dir(self) -> Path | None:
        return self.program or self.given

    @property
    def ledger_dir(self) -> Path | None:
        if self.given is not None:
            return self.given
        if self.program is not None and self.program.is_dir():
            return self.program
        return self.own

    def ledger(self) -> list[dict[str, Any]]:
        """The task's attempts so far."""
        where = self.ledger_dir
        return read_ledger(where) if where is not None else list(self.mine)

    def handoff_stamp(self) -> tuple[int, int] | None:
        """The hand-off file's identity now (a Session replaces it: a new inode)."""
        if self.handoff_file is None:
            return None
        try:
            st = os.stat(self.handoff_file)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def learn(self) -> handoff.HandOff | None:
        """Read the hand-off; remember the program's directory it names."""
        told = handoff.read(self.handoff_file) if self.handoff_file is not None else None
        if told is not None:
            self.told = True
            if told.root is not None:
                self.program = told.root
        return told

    def append(self, record: AttemptRecord) -> None:
        """Add ``record`` to the ledger; its number may change where the ledger moves from
        the task's own directory to the program's (appended after the records there)."""
        self.mine.append(record.to_record())
        target = self.ledger_dir
        if target is None:
            return
        if self.given is None and self.own is not None and not same_dir(target, self.own):
            pending = read_ledger(self.own)
            there = read_ledger(target)
            # a crash between these appends and the removal below leaves records in both:
            # those already moved are not moved again
            moved = {_identity(rec) for rec in there}
            done = len(there)
            for rec in (r for r in pending if _identity(r) not in moved):
                done += 1
                rec["attempt"] = done
                logs.append_record(target / filenames.ATTEMPT_LEDGER, rec, durable=True)
            if pending:
                storage.remove_file(self.own / filenames.ATTEMPT_LEDGER)
                log.info("the attempts' ledger is now %s", target / filenames.ATTEMPT_LEDGER)
            record.attempt = done + 1
        logs.append_record(target / filenames.ATTEMPT_LEDGER, record.to_record(), durable=True)


def _identity(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What tells one attempt from another whatever its number (a moved record's changes)."""
    return tuple(record.get(k) for k in ("start", "end", "host", "exit_code", "slurm_job_id"))


def same_dir(a: Path | None, b: Path | None) -> bool:
    """Whether ``a`` and ``b`` name the same directory (relative or not)."""
    if a is None or b is None:
        return a is b
    return os.path.realpath(a) == os.path.realpath(b)


def where_for(
    checkpoint_dir: Path | None, command: Sequence[str], task: str | None, env: Mapping[str, str]
) -> Where:
    """Where this task's files are, before its first attempt (a hand-off an earlier
    invocation received names the program's directory)."""
    if checkpoint_dir is not None:
        where = Where(given=checkpoint_dir, handoff_file=handoff.beside(checkpoint_dir))
    else:
        own = handoff.task_dir(env, cwd=os.getcwd(), command=command, task=task)
        try:
            own.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning(
                "no --checkpoint-dir, and cannot create this task's own directory %s (%s): "
                "its attempts are counted for this invocation only", own, exc,
            )  # fmt: skip
            where = Where(given=None)
        else:
            where = Where(given=None, own=own, handoff_file=own / handoff.HANDOFF_FILE)
    where.learn()
    return where
