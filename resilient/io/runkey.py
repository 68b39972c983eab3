"""A run's identity: the parameters that define its result, recorded in its checkpoint root.

A program declares them (``CheckpointManager(..., run_key={"nx": 512, "alpha": 0.2})``). The
first save records them in ``<root>/run_key.json``; a later manager on the same root with a
different key is refused before it touches anything, so a changed parameter never "resumes"
another run's checkpoints. Keys are compared as JSON values; a root without a record (written
before run keys, or by a program that declares none) accepts any key and records it at its
next save.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resilient.errors import ConfigError, ForeignRunError
from resilient.io import storage
from resilient.model import filenames

__all__ = ["check_run_key", "normalize_run_key", "record_run_key"]

_MAX_RECORD = 1 << 20


def normalize_run_key(key: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``key`` as plain JSON values (pure).

    Raises:
        ConfigError: not a mapping with string keys, or a value JSON cannot hold.
    """
    if key is None:
        return None
    if not isinstance(key, Mapping) or not all(isinstance(k, str) for k in key):
        raise ConfigError(f"run_key must be a mapping with string keys, got {key!r}")
    try:
        out: dict[str, Any] = json.loads(json.dumps(dict(key), allow_nan=False, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"run_key must hold JSON values (numbers, strings, lists): {exc}"
        ) from None
    return out


def _recorded(root: Path) -> dict[str, Any] | None:
    path = root / filenames.RUN_KEY
    try:
        if path.stat().st_size > _MAX_RECORD:
            return None
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def check_run_key(root: Path, key: Mapping[str, Any] | None) -> None:
    """Refuse ``key`` if ``root`` records another one (local: reads one small file).

    Raises:
        ForeignRunError: the keys differ; the message names each differing key with both values,
            and the fix.
    """
    if key is None:
        return
    old = _recorded(root)
    if old is None or old == key:
        return
    names = sorted(set(old) | set(key))
    diff = [
        f"{k}: {_show(old, k)} there, {_show(key, k)} now"
        for k in names
        if old.get(k, _ABSENT) != key.get(k, _ABSENT)
    ]
    raise ForeignRunError(
        f"the checkpoint directory {root} belongs to another run ({'; '.join(diff)}): give "
        "these parameters a checkpoint directory of their own (one per parameter set, e.g. "
        f"named after a hash of them), or delete {root} to start this run from scratch"
    )


_ABSENT = object()


def _show(doc: Mapping[str, Any], key: str) -> str:
    return json.dumps(doc[key]) if key in doc else "absent"


def record_run_key(root: Path, key: Mapping[str, Any] | None) -> None:
    """Record ``key`` in ``root`` unless a key is recorded already (local, atomic, durable)."""
    if key is None or _recorded(root) is not None:
        return
    tmp = root / f".{filenames.RUN_KEY}.{storage.new_token()}"
    storage.write_durable(tmp, json.dumps(key, sort_keys=True, indent=1).encode())
    os.replace(tmp, root / filenames.RUN_KEY)
    storage.fsync_dir(root)
