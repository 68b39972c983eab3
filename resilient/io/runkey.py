"""A run's identity: the parameters that define its result, recorded in its checkpoint root.

A program declares them (``CheckpointManager(..., run_key={"nx": 512, "alpha": 0.2})``). The
first save records them in the root's ``run_key.json`` and, with a checksum, in its copy
``run_key.copy.json`` (either repairs the other); a later manager on the same root with a
different key is refused before it touches anything, so a changed parameter never "resumes"
another run's checkpoints. Keys are compared as JSON values; a root without a record (written
before run keys, or by a program that declares none) accepts any key and records it at its
next save.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from resilient.errors import ConfigError, ForeignRunError
from resilient.io.targets import Target
from resilient.model import filenames
from resilient.model.checksum import hash128

__all__ = ["check_run_key", "normalize_run_key", "record_run_key"]

_MAX_RECORD = 1 << 20

log = logging.getLogger(__name__)


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


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True)


def _read_json(target: Target, name: str) -> Any:
    """The JSON value in the root's file ``name``; ``_MISSING`` if absent, ``_DAMAGED`` if
    unreadable."""
    try:
        data = target.read_root(name)
        if data is None:
            return _MISSING
        if len(data) > _MAX_RECORD:
            return _DAMAGED
        return json.loads(data)
    except (OSError, ValueError, RecursionError):
        return _DAMAGED


_MISSING = object()
_DAMAGED = object()


def _recorded(root: Target) -> dict[str, Any] | None:
    """The recorded key: from ``run_key.json`` and its copy with a checksum
    (``run_key.copy.json``), the one that checks; a damaged or missing copy is written again
    from the other (one warning; a copy added to a root written before the copies: one info
    line). ``None``: no record, or none that reads (a warning if one was there)."""
    first, copy = _read_json(root, filenames.RUN_KEY), _read_json(root, filenames.RUN_KEY_COPY)
    checksum = copy.get("checksum") if isinstance(copy, dict) else None
    copied = copy.get("run_key") if isinstance(copy, dict) else None
    copy_ok = isinstance(copied, dict) and checksum == hash128(_canonical(copied))
    if not isinstance(first, dict):
        first_ok = False
    elif copy_ok:
        first_ok = _canonical(first) == _canonical(copied)  # type: ignore[arg-type]
    else:  # the copy is damaged: the first is all there is
        first_ok = True
    if copy_ok:
        assert isinstance(copied, dict)
        if not first_ok:
            _repair(
                root, copied, filenames.RUN_KEY, "damaged" if first is not _MISSING else "missing"
            )
        return copied
    if first_ok:
        assert isinstance(first, dict)
        _repair(root, first, filenames.RUN_KEY_COPY, "missing" if copy is _MISSING else "damaged")
        return first
    if first is not _MISSING or copy is not _MISSING:
        log.warning(
            "%s: the run key's record is damaged in both copies (%s, %s): accepting the key "
            "this run gives and recording it", root, filenames.RUN_KEY, filenames.RUN_KEY_COPY,
        )  # fmt: skip
    return None


def _repair(root: Target, key: Mapping[str, Any], name: str, state: str) -> None:
    """Write ``name`` (one copy of the run key) again from ``key``, the other copy's."""
    try:
        _write(root, key, names=(name,))
    except OSError as exc:
        log.warning("%s: could not repair the run key's %s (%s)", root, name, exc)
        return
    legacy = name == filenames.RUN_KEY_COPY and state == "missing"
    (log.info if legacy else log.warning)(
        "%s: %s the run key's %s from the other copy",
        root, "added the second copy" if legacy else f"repaired ({state})", name,
    )  # fmt: skip


def _write(
    root: Target,
    key: Mapping[str, Any],
    *,
    names: tuple[str, ...] = (filenames.RUN_KEY, filenames.RUN_KEY_COPY),
) -> None:
    """Write the copies ``names`` of the run key ``key`` (atomic, durable)."""
    docs = {
        filenames.RUN_KEY: json.dumps(key, sort_keys=True, indent=1),
        filenames.RUN_KEY_COPY: json.dumps(
            {"run_key": key, "checksum": hash128(_canonical(key))}, sort_keys=True, indent=1
        ),
    }
    for name in names:
        root.replace_root(name, docs[name].encode())


def check_run_key(root: Target, key: Mapping[str, Any] | None) -> None:
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


def record_run_key(root: Target, key: Mapping[str, Any] | None) -> None:
    """Record ``key`` in ``root`` unless a key is recorded already (local, atomic, durable)."""
    if key is None or _recorded(root) is not None:
        return
    _write(root, key)
