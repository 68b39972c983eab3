"""What a program and ``resilient run`` tell each other: environment variables and files.

``resilient run`` -> the program, in its environment (set per attempt):

* :data:`ENV_CHECKPOINT_DIR` ``RESILIENT_CHECKPOINT_DIR``: ``--checkpoint-dir``; a
  :class:`~resilient.job.session.Session` given no directory uses it.
* :data:`ENV_DEADLINE` ``RESILIENT_DEADLINE``: the attempt's end (Unix seconds), the simulated
  walltime's or the Slurm job's; read by :func:`resilient.job.slurm.find_deadline`.
* :data:`ENV_ATTEMPT` ``RESILIENT_ATTEMPT``: the attempt's number in the ledger; the Session
  puts it into its stop records (:func:`attempt_number`).
* :data:`ENV_HANDOFF` ``RESILIENT_HANDOFF``: the file the Session names its directory in
  (:mod:`resilient.job.handoff`).
* :data:`ENV_WARN_SIGNALS` ``RESILIENT_WARN_SIGNALS``: the warning signal the program starts
  with blocked (:mod:`resilient.job.warning`).
* :data:`ENV_TREE` ``RESILIENT_TREE``: a token new at each attempt, inherited by every process
  the program starts: what ``resilient run`` knows them by once their launcher is gone
  (:func:`resilient.job.process.end_what_it_left`).

The program -> ``resilient run``, in files (names in :mod:`resilient.model.filenames`):

* the hand-off file (``handoff.json``, written by the Session's rank 0, read after each
  attempt: :mod:`resilient.job.handoff`): the directory the program uses, or none;
* ``CHECKPOINT_DIR/stops.jsonl`` (:data:`~resilient.model.filenames.STOP_LOG`): one record per
  early stop, why, at which step, whether it saved (:func:`record_stop`, written by the Session;
  :func:`program_stop`, read by ``resilient run`` for the attempt's outcome and by
  :func:`resilient.job.requeue.decide`);
* the timeline (:data:`~resilient.model.filenames.PROGRESS_LOG`, written by the Session's
  :class:`~resilient.job.timeline.Timeline`, read by
  :func:`resilient.job.timeline.read_events`): the step restored and the start-up;
* the committed steps themselves and the partner copies' ``protected.jsonl``
  (:func:`resilient.io.checkpoints.resumable_step`): whether an attempt made progress.

``resilient run`` -> itself and the tools, in files: the ledger ``CHECKPOINT_DIR/attempts.jsonl``
and its sidecar beside the directory (:mod:`resilient.job.ledger`, read by ``resilient
report``, :mod:`resilient.job.guard` and the Parsl handler). And the exit code, the contract of
:mod:`resilient.job.exitcodes`.

Only the standard library and two modules that import only it (:mod:`resilient.io.logs`,
:mod:`resilient.model.filenames`): :mod:`resilient.job.warning` reads this at ``import
resilient``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resilient.io import logs
from resilient.model import filenames

__all__ = [
    "ENV_ATTEMPT",
    "ENV_CHECKPOINT_DIR",
    "ENV_DEADLINE",
    "ENV_HANDOFF",
    "ENV_TREE",
    "ENV_WARN_SIGNALS",
    "attempt_number",
    "program_stop",
    "record_stop",
]

ENV_CHECKPOINT_DIR = "RESILIENT_CHECKPOINT_DIR"
ENV_DEADLINE = "RESILIENT_DEADLINE"
ENV_ATTEMPT = "RESILIENT_ATTEMPT"
ENV_HANDOFF = "RESILIENT_HANDOFF"
ENV_WARN_SIGNALS = "RESILIENT_WARN_SIGNALS"
ENV_TREE = "RESILIENT_TREE"


def attempt_number(environ: Mapping[str, str]) -> int | None:
    """The attempt's number ``resilient run`` gave (:data:`ENV_ATTEMPT`), else ``None``."""
    text = environ.get(ENV_ATTEMPT, "")
    return int(text) if text.isdigit() else None


def record_stop(checkpoint_dir: Path, record: Mapping[str, Any]) -> None:
    """Append the program's stop record to ``stops.jsonl`` (rank 0 of a Session; best effort,
    a warning if that fails: :func:`resilient.io.logs.append_record`)."""
    logs.append_record(checkpoint_dir / filenames.STOP_LOG, record)


def program_stop(
    checkpoint_dir: Path | None, *, attempt: int, start: float, end: float
) -> dict[str, Any] | None:
    """The stop record a Session wrote during this attempt (``stops.jsonl``), if any."""
    if checkpoint_dir is None:
        return None
    found = None
    for rec in logs.read_log(checkpoint_dir / filenames.STOP_LOG, logs.STOPS):
        if not start <= rec["time"] <= end:
            continue
        if rec.get("attempt") in (None, attempt):
            found = rec
    return found
