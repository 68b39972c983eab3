"""The hand-off: a program's :class:`~resilient.job.session.Session` tells ``resilient run``
which checkpoint directory it actually uses.

``resilient run`` names a small file in ``$RESILIENT_HANDOFF``
(:data:`~resilient.job.protocol.ENV_HANDOFF`); the Session's rank 0 replaces it, when the Session
is made, with one JSON object: ``{"root": "/abs/ckpt", "time": ..., "attempt": N}``, or
``"root": null`` when the program was given no directory at all. The wrapper reads it after
each attempt and judges progress on that directory, whatever ``--checkpoint-dir`` said.

The file outlives the attempt: it is also the pointer by which the next ``resilient run`` of
the same task finds the program's directory (and its ledger) before starting the program.
Where it lies (:func:`task_dir`):

* with ``--checkpoint-dir D``: beside ``D``, ``PARENT/.NAME.resilient-handoff`` (like the
  attempts' sidecar: where an engine that deletes ``D`` leaves it);
* without: in a directory of its own per task, ``STATE/tasks/<key>/``, where ``STATE`` is
  ``$RESILIENT_STATE_DIR``, else ``$XDG_STATE_HOME/resilient``, else
  ``~/.local/state/resilient`` (the home directory: shared by a cluster's nodes, as a requeued
  job on another node needs), and ``<key>`` hashes the working directory, the command's words
  and ``--task``: what a later invocation of the same task repeats. Not the program files'
  dates (:mod:`resilient.job.guard`'s fingerprint): an edited script is a new run of the same
  task, which must find its ledger to say so.

Best effort on both sides: the Session logs a warning if it cannot write the file and goes
on; the wrapper reads a missing, damaged or foreign file as "not told". Not collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from resilient.io import storage
from resilient.model import filenames

__all__ = ["HANDOFF_FILE", "HandOff", "beside", "read", "record", "state_dir", "task_dir"]

log = logging.getLogger(__name__)

HANDOFF_FILE = "handoff.json"
"""The hand-off's name in a task's own directory (:func:`task_dir`)."""


@dataclass(frozen=True, slots=True)
class HandOff:
    """What a Session told the wrapper: its directory (``None``: it had none) and when."""

    root: Path | None
    time: float
    attempt: int | None = None


def record(path: Path, root: Path | None, *, attempt: int | None, now: float) -> None:
    """Replace the hand-off at ``path`` (a Session's rank 0 calls it; never raises)."""
    data = {
        "root": None if root is None else os.path.abspath(root),
        "time": now,
        "attempt": attempt,
    }
    tmp = path.parent / f".{path.name}.{storage.new_token()}"
    try:  # no fsync: it is said again at every start, and this is the start-up's time
        tmp.write_bytes((json.dumps(data) + "\n").encode())
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        log.warning(
            "could not tell resilient run where the checkpoints are (%s: %s); it judges "
            "progress on its --checkpoint-dir", path, exc,
        )  # fmt: skip


def read(path: Path) -> HandOff | None:
    """The hand-off at ``path``; ``None`` if missing, unreadable or not one (never raises)."""
    try:
        data = json.loads(path.read_bytes().decode())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    root, when, attempt = data.get("root"), data.get("time"), data.get("attempt")
    if not isinstance(when, (int, float)) or isinstance(when, bool):
        return None
    if root is not None and (not isinstance(root, str) or not os.path.isabs(root)):
        return None
    return HandOff(
        root=Path(root) if root is not None else None,
        time=float(when),
        attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
    )


def beside(checkpoint_dir: Path) -> Path:
    """The hand-off of a run given ``--checkpoint-dir``: ``PARENT/.NAME.resilient-handoff``."""
    path = Path(os.path.abspath(checkpoint_dir))
    return path.parent / filenames.handoff_sidecar_name(path.name)


def state_dir(environ: Mapping[str, str]) -> Path:
    """Where ``resilient run`` keeps the directories of tasks run without
    ``--checkpoint-dir``."""
    own = environ.get("RESILIENT_STATE_DIR", "").strip()
    if own:
        return Path(own)
    xdg = environ.get("XDG_STATE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "resilient"
    home = environ.get("HOME", "").strip() or os.path.expanduser("~")
    return Path(home) / ".local" / "state" / "resilient"


def task_dir(
    environ: Mapping[str, str], *, cwd: str, command: Sequence[str], task: str | None
) -> Path:
    """The directory of a task run without ``--checkpoint-dir``: ``STATE/tasks/<key>``."""
    h = hashlib.sha256()
    for word in (os.path.realpath(cwd), task or "", *command):
        h.update(word.encode(errors="surrogateescape") + b"\0")
    return state_dir(environ) / "tasks" / h.hexdigest()[:20]
