"""Names on disk. Pure: the only module that knows how files and directories are called.

A checkpoint root looks like::

    ROOT/
      .resilient-root                 marker: this directory belongs to resilient
      .resilient-root.copy            its second copy (either one repairs the other)
      run_key.json, run_key.copy.json the run key, and its second copy with a checksum
      .lock                           held (flock) by the job that writes here
      attempts.jsonl, saves.jsonl,    small append-only logs (resilient run, saves, progress,
      progress.jsonl, stops.jsonl     early stops)
      step_00001200/                  a committed checkpoint
        manifest.json
        COMMITTED                     written last; holds the manifest's checksum
        rank_00000.h5 ...             "self" layout: one file per rank
        node_00000.h5 ...             "node" layout: one file per node
        world.h5                      "world" layout: one shared file
        group_00000.h5 ...            any other communicator: one file per group
      step_00001100.quarantined-3fa2c1d0/   failed validation; kept for inspection
      .step_00001300.tmp-<hex>/        a save in progress (or killed)
      .trash-<hex>/                    being deleted
      static/<32 hex>/                 static data, shared by checkpoints by content hash
      static/<32 hex>.copy/            its second copy: the manifest, its shards and COMMITTED,
                                       and the data files unless saved with static_copies=1
      static/.tmp-<hex>/               static data being written

Beside the root, in its parent directory, ``resilient run`` keeps two files of its own::

    PARENT/.ROOTNAME.resilient-attempts   the outcome of each attempt (JSON lines), where a
                                          workflow engine that deletes ROOT (a declared output)
                                          leaves it: the next attempt sees that ROOT was lost
    PARENT/.ROOTNAME.resilient-handoff    the directory the program's Session said it uses
                                          (job.handoff): progress is judged there
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "COMMITTED",
    "LOCK_FILE",
    "MANIFEST",
    "QUARANTINE_INFO",
    "ROOT_MARKER",
    "ROOT_MARKER_COPY",
    "RUN_KEY_COPY",
    "STATIC_DIR",
    "file_name",
    "is_data_file_name",
    "parse_quarantined",
    "rank_group_name",
    "parse_step_dir",
    "parse_tmp_dir",
    "quarantine_dir_name",
    "static_dir_name",
    "static_copy_dir_name",
    "parse_static_copy",
    "static_tmp_dir_name",
    "shard_name",
    "is_shard_name",
    "step_dir_name",
    "task_name",
    "tmp_dir_name",
    "trash_dir_name",
    "attempt_sidecar_name",
    "handoff_sidecar_name",
    "replacement_name",
    "replacement_target",
]

MANIFEST = "manifest.json"  # the whole manifest, or the index of a sharded one
COMMITTED = "COMMITTED"
ROOT_MARKER = ".resilient-root"
ROOT_MARKER_COPY = ".resilient-root.copy"  # the marker's second copy
LOCK_FILE = ".lock"
STATIC_DIR = "static"
QUARANTINE_INFO = "QUARANTINE.json"
ATTEMPT_LEDGER = "attempts.jsonl"  # one line per `resilient run` attempt
SAVE_LOG = "saves.jsonl"  # one line per committed checkpoint (step, time, cost, bytes)
LOCAL_TIERS = "local_tiers.json"  # where node-local copies live: [{"host", "path"}]
PROGRESS_LOG = "progress.jsonl"  # the timeline a Session writes (job.timeline): samples, restore, saves, end
STOP_LOG = "stops.jsonl"  # one line per early stop of a Session: why, step, margins, saved?
RUN_KEY = "run_key.json"  # the parameters that define the run whose checkpoints these are
RUN_KEY_COPY = "run_key.copy.json"  # its second copy, with a checksum
PROTECT_LOG = "protected.jsonl"  # one line per local checkpoint whose partner copies committed
PARTNER_DIR = "partner"  # in a local tier root: partner copies, one directory per origin node
PARTNER_RECORD = "PARTNER.json"  # in a partner copy: each file's size and whole-file digest
XOR_DIR = "xor"  # in a local tier root: this node's XOR parities, one committed step each
XOR_PARITY = "parity.xor"  # in an XOR parity step: the parity bytes of this node's column
XOR_RECORD = "XOR.json"  # in an XOR parity step: its set, chunk and digest
ELASTIC_DIR = "elastic"  # in a local tier root: steps staged for an elastic restore (transient)

_STEP_RE = re.compile(r"^step_(\d{8,})\Z")
_TMP_RE = re.compile(r"^\.step_(\d{8,})\.tmp-[0-9a-f]{8,32}\Z")
_QUARANTINED_RE = re.compile(r"^step_(\d{8,})\.quarantined-[0-9a-f]{8,32}\Z")
_STATIC_RE = re.compile(r"^[0-9a-f]{32}\Z")
_STATIC_COPY_RE = re.compile(r"^([0-9a-f]{32})\.copy\Z")
_STATIC_TMP_RE = re.compile(r"^\.tmp-[0-9a-f]{8,32}\Z")
_TRASH_RE = re.compile(r"^\.trash-[0-9a-f]{8,32}\Z")
_REPLACEMENT_RE = re.compile(r"^\.(.+)\.[0-9a-f]{16}\Z")
_SHARD_RE = re.compile(r"^manifest-(\d{5,})\.json\Z")
_DATA_FILE_RE = re.compile(r"^(?:(?:rank|node|group)_\d{5,}|world)\.h5\Z")

_FILE_PREFIX = {"self": "rank", "node": "node", "custom": "group"}


def step_dir_name(step: int) -> str:
    """Name of the committed directory of ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def set_dir_name(key: int | str) -> str:
    """Name of the entry of a committed set: of a step (:func:`step_dir_name`), or ``key``
    itself (static data's, a quarantined step's)."""
    return key if isinstance(key, str) else step_dir_name(key)


def tmp_dir_name(step: int, token: str) -> str:
    """Name of the temporary directory a save of ``step`` writes into."""
    return f".step_{step:08d}.tmp-{token}"


def quarantine_dir_name(step: int, token: str) -> str:
    """Name a failed checkpoint of ``step`` is renamed to."""
    return f"step_{step:08d}.quarantined-{token}"


def replacement_name(name: str, token: str) -> str:
    """Name of the hidden file a small file ``name`` is written under before it is renamed
    over ``name`` (:func:`resilient.io.storage.replace_file`)."""
    return f".{name}.{token}"


def replacement_target(name: str) -> str | None:
    """The file a :func:`replacement_name` was to replace (``None``: not one)."""
    m = _REPLACEMENT_RE.match(name)
    return m.group(1) if m else None


def trash_dir_name(token: str) -> str:
    """Name a directory gets just before it is deleted."""
    return f".trash-{token}"


def static_dir_name(content_hash: str) -> str:
    """Name of the directory holding the static data with ``content_hash``."""
    if not _STATIC_RE.match(content_hash):
        raise ValueError(f"not a static content hash: {content_hash!r}")
    return content_hash


def static_copy_dir_name(content_hash: str) -> str:
    """Name of the second copy of the static data with ``content_hash`` (beside the first)."""
    return f"{static_dir_name(content_hash)}.copy"


def parse_static_copy(name: str) -> str | None:
    """The content hash of a static data's second copy's directory name, else ``None``."""
    m = _STATIC_COPY_RE.match(name)
    return m.group(1) if m else None


def static_tmp_dir_name(token: str) -> str:
    """Name of the temporary directory static data is written into (inside ``static/``)."""
    return f".tmp-{token}"


def local_tier_dir_name(shared_root_name: str, path_digest: str) -> str:
    """Name of a node-local tier's root (in the node-local storage) for a shared root called
    ``shared_root_name`` whose absolute path hashes to ``path_digest``."""
    return f"{shared_root_name}-{path_digest[:12]}"


def partner_dir_name(node: str) -> str:
    """Name of the directory (in :data:`PARTNER_DIR`) holding the partner copies of ``node``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"


def task_name(root: str | os.PathLike[str], under: str | os.PathLike[str] | None = None) -> str:
    """How a task's checkpoint directory is named to a user, the same by ``resilient ls``,
    ``status``, ``report`` and ``resilient run``'s log lines: its path relative to ``under``
    (the directory named on the command line) when it lies below it, else its last two path
    components (``sim/a-1a2b3c4d5e6f``: :func:`resilient.workflow.checkpoint_dir` makes them
    unique per task), or the whole path when it has no more."""
    path = Path(os.path.abspath(root))
    if under is not None:
        base = Path(os.path.abspath(under))
        if path != base and path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return "/".join(path.parts[-2:]) if len(path.parts) > 2 else str(path)


def attempt_sidecar_name(root_name: str) -> str:
    """Name of ``resilient run``'s record beside the root ``root_name`` (in its parent)."""
    if not root_name or root_name in (".", "..") or "/" in root_name:
        raise ValueError(f"not a directory name: {root_name!r}")
    return f".{root_name}.resilient-attempts"


def handoff_sidecar_name(root_name: str) -> str:
    """Name of the hand-off beside the root ``root_name`` (in its parent): the directory its
    program's Session actually uses (:mod:`resilient.job.handoff`)."""
    return attempt_sidecar_name(root_name).replace(".resilient-attempts", ".resilient-handoff")


def file_name(kind: str, group_index: int) -> str:
    """Name of the HDF5 file of group ``group_index`` in a layout of ``kind``."""
    if kind == "world":
        return "world.h5"
    return f"{_FILE_PREFIX[kind]}_{group_index:05d}.h5"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed-looking directory name, else ``None``."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_tmp_dir(name: str) -> int | None:
    """The step of a temporary save directory name, else ``None``."""
    m = _TMP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_quarantined(name: str) -> int | None:
    """The step of a quarantined directory name, else ``None``."""
    m = _QUARANTINED_RE.match(name)
    return int(m.group(1)) if m else None


def is_static_dir(name: str) -> bool:
    """Whether ``name`` names a committed static-data directory."""
    return bool(_STATIC_RE.match(name))


def is_static_tmp(name: str) -> bool:
    """Whether ``name`` names a static-data directory still being written."""
    return bool(_STATIC_TMP_RE.match(name))


def is_trash(name: str) -> bool:
    """Whether ``name`` names a directory that was being deleted."""
    return bool(_TRASH_RE.match(name))


def is_data_file_name(name: str) -> bool:
    """Whether ``name`` is a legal name for a checkpoint data file (no paths, no tricks)."""
    return bool(_DATA_FILE_RE.match(name))


def shard_name(index: int) -> str:
    """Name of the ``index``-th shard of a sharded manifest (schema 3), beside its index
    :data:`MANIFEST`."""
    return f"manifest-{index:05d}.json"


def is_shard_name(name: str) -> bool:
    """Whether ``name`` names a shard of a sharded manifest (see :func:`shard_name`)."""
    return bool(_SHARD_RE.match(name))


def rank_group_name(rank: int) -> str:
    """Name of the HDF5 group holding ``rank``'s datasets in its file."""
    return f"rank_{rank:05d}"
