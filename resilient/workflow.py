"""Checkpoint directories for workflow tasks, the same under every engine (Snakemake, Parsl,
sbatch scripts): one directory per task and parameter set, kept across attempts.

A task's directory is named after the task, its wildcard values and a hash of everything that
determines its result::

    from resilient.workflow import checkpoint_dir

    ckpt = checkpoint_dir("ckpt", "heat", {"nx": 512, "alpha": 0.2})   # ckpt/heat/heat-<12 hex>
    ckpt = checkpoint_dir("ckpt", "heat", params, wildcards={"case": "hot"})  # ckpt/heat/hot-<hex>

A retry of the same task gets the same directory and resumes from its newest valid checkpoint;
a changed parameter or input file gets a new directory and starts fresh (the old one is left
alone: :func:`stale_siblings` lists it, :func:`cleanup` can remove it). Never make the
directory an output of the task: engines delete a task's outputs before each retry.

Nothing here imports a workflow engine: these are functions of paths and mappings.
``python -m resilient.workflow cleanup CHECKPOINT_DIR OUTPUT...`` runs :func:`cleanup` from a shell
command.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from resilient._renamed import renamed_keyword
from resilient.errors import CheckpointLockedError
from resilient.io import storage
from resilient.io.checkpoints import latest_valid
from resilient.io.digests import digest_file_range
from resilient.model import filenames
from resilient.model.checksum import digest_text

__all__ = [
    "HASH_HEX",
    "checkpoint_dir",
    "cleanup",
    "fingerprint",
    "latest_checkpoint",
    "main",
    "stale_siblings",
    "task_key",
]

log = logging.getLogger(__name__)

HASH_HEX = 12
"""Hex digits of the fingerprint in a checkpoint directory's name (48 bits)."""

# Small files a checkpoint root keeps after cleanup, so that `resilient report` still works.
KEPT_FILES = frozenset(
    {
        filenames.ROOT_MARKER,
        filenames.ROOT_MARKER_COPY,
        filenames.LOCK_FILE,
        filenames.ATTEMPT_LEDGER,
        filenames.SAVE_LOG,
        filenames.PROGRESS_LOG,
        filenames.STOP_LOG,
    }
)

_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,@-]")
_HEX = re.compile(rf"[0-9a-f]{{{HASH_HEX}}}")
_SEP = "-"  # between the wildcard key and the fingerprint
_JOIN = "_"  # between wildcard values

PathLike = str | os.PathLike[str]


class _Items(Protocol):
    """A mapping, or Snakemake's ``Wildcards`` (a list with names and ``items()``)."""

    def items(self) -> Iterable[tuple[str, Any]]: ...


# --------------------------------------------------------------------------- naming


def task_key(wildcards: Mapping[str, str] | _Items) -> str:
    """The wildcard values joined into one safe path component (``""`` without wildcards).

    Characters other than letters, digits and ``. _ + = , @ -`` become ``_``, and a leading
    dot is escaped, so that a value can neither leave the directory (``..``, ``/``) nor hide
    it. Two values that sanitise alike still get different directories: the wildcards are
    part of the fingerprint too.
    """
    key = _JOIN.join(_UNSAFE.sub("_", str(v)) for _, v in wildcards.items())
    return "_" + key if key.startswith(".") else key


_digest_cache: dict[tuple[str, int, int, int, int], str] = {}


def _file_digest(path: Path, st: os.stat_result) -> str:
    """xxh3-64 of a file's content; cached per (path, device, inode, size, mtime)."""
    cache_key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _digest_cache.get(cache_key)
    if cached is not None:
        return cached
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = digest_file_range(functools.partial(os.preadv, fd), 0, st.st_size)
    finally:
        os.close(fd)
    _digest_cache[cache_key] = digest
    return digest


def _input_record(name: str) -> dict[str, Any]:
    """Path, size and content hash of one input file (or of every file below a directory)."""
    path = Path(name)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint_dir: input {name!r} does not exist (yet); the fingerprint needs its content"
        ) from None
    if stat.S_ISDIR(st.st_mode):
        tree = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for f in sorted(filenames):
                p = Path(dirpath) / f
                fst = p.stat()
                tree.append([p.relative_to(path).as_posix(), fst.st_size, _file_digest(p, fst)])
        return {"path": name, "tree": tree}
    return {"path": name, "size": st.st_size, "xxh3": _file_digest(path, st)}


def fingerprint(
    params: Mapping[str, Any] | None = None,
    inputs: Sequence[PathLike] | PathLike = (),
    wildcards: Mapping[str, str] | _Items | None = None,
) -> str:
    """:data:`HASH_HEX` hex digits of a hash of the parameters (JSON, sorted keys), the
    wildcards, and each input's path, size and content (xxh3-64).

    Inputs keep their order and their paths as given (relative paths stay relative, so a
    moved workflow directory keeps its fingerprints). Non-JSON parameter values are hashed as
    ``str(value)``.

    Raises:
        FileNotFoundError: an input does not exist.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    doc = {
        "params": dict(params or {}),
        "wildcards": {str(k): str(v) for k, v in (wildcards.items() if wildcards else ())},
        "inputs": [_input_record(os.fspath(p)) for p in inputs],
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return digest_text(text)[:HASH_HEX]


def checkpoint_dir(
    root: PathLike,
    name: str,
    params: Mapping[str, Any] | None = None,
    inputs: Sequence[PathLike] | PathLike = (),
    *,
    wildcards: Mapping[str, str] | _Items | None = None,
) -> str:
    """``ROOT/NAME/<wildcard values>-<fingerprint>``: the checkpoint directory of one task.

    Deterministic: the same name, wildcards, parameters and input files always give the same
    directory (so a retry resumes), any change gives a new one (so it starts fresh). Only the
    parameters that change the computation belong in ``params``: the physics, the sizes, the
    seed; not the checkpoint cadence or a demo's slow-down. The rank count belongs there only for a
    program whose checkpoints restore on the same rank count alone; one that saves
    :class:`~resilient.model.blocks.Block` and :class:`~resilient.model.blocks.Replicated` values resumes on
    any rank count, so leave it out and a retry with other ranks resumes. ``inputs`` are files
    (or directories) whose content is hashed too; ``wildcards`` (a mapping, or Snakemake's
    ``wildcards``) name the directory; without them the task's name does
    (``ckpt/train/train-<fingerprint>``), so reports name the task.

    Raises:
        ValueError: ``name`` is not a plain name.
        FileNotFoundError: an input does not exist.
    """
    if not name or _UNSAFE.search(name) or name.startswith("."):
        raise ValueError(
            f"name must be a plain name (letters, digits, . _ + = , @ -), got {name!r}"
        )
    key = (task_key(wildcards) if wildcards is not None else "") or name
    digest = fingerprint(params, inputs, wildcards)
    return os.fspath(Path(root) / name / f"{key}{_SEP}{digest}")


def _split_name(name: str) -> tuple[str, str] | None:
    """(key, fingerprint) of a checkpoint directory name, else ``None``."""
    key, _, digest = name.rpartition(_SEP)
    return (key, digest) if key and _HEX.fullmatch(digest) else None


@renamed_keyword("ckpt_dir", "checkpoint_dir")
def stale_siblings(checkpoint_dir: PathLike) -> list[str]:
    """Other checkpoint directories of the same task and wildcards (other fingerprints).

    They belong to earlier parameters or inputs of this task. Nothing removes them
    automatically (they may be wanted back); ``cleanup(..., remove_stale=True)`` does.
    """
    path = Path(checkpoint_dir)
    own = _split_name(path.name)
    if own is None:
        return []
    try:
        entries = sorted(os.scandir(path.parent), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        parsed = _split_name(entry.name)
        if (
            entry.name != path.name
            and parsed is not None
            and parsed[0] == own[0]
            and entry.is_dir(follow_symlinks=False)
        ):
            out.append(os.fspath(path.parent / entry.name))
    return out


# --------------------------------------------------------------------------- inspection


@renamed_keyword("ckpt_dir", "checkpoint_dir")
def latest_checkpoint(checkpoint_dir: PathLike) -> str | None:
    """Path of the newest valid checkpoint in ``checkpoint_dir`` (quick validation), else ``None``."""
    rec = latest_valid(Path(checkpoint_dir))
    return os.fspath(rec.path) if rec else None


# --------------------------------------------------------------------------- cleanup


def _is_checkpoint_data(name: str) -> bool:
    return (
        name == filenames.STATIC_DIR
        or filenames.parse_step_dir(name) is not None
        or filenames.parse_quarantined(name) is not None
        or filenames.parse_tmp_dir(name) is not None
        or filenames.is_trash(name)
    )


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        storage.remove_tree(path)


def _clean_root(root: Path, *, keep_logs: bool) -> list[str]:
    """Remove a root's checkpoint data (or, without ``keep_logs``, the root) under its lock."""
    lock = storage.RootLock(root)
    lock.acquire()  # CheckpointLockedError: a job is still writing here
    removed = []
    try:
        if keep_logs:
            for entry in sorted(root.iterdir()):
                if entry.name not in KEPT_FILES and _is_checkpoint_data(entry.name):
                    _remove(entry)
                    removed.append(os.fspath(entry))
            return removed
    finally:
        lock.release()
    storage.remove_tree(root)
    removed = [os.fspath(root)]
    # `resilient run`'s record beside the root: left behind, it would read as a root that an
    # engine deleted between attempts, and the task's next run would be refused
    absolute = Path(os.path.abspath(root))
    for name in (filenames.attempt_sidecar_name, filenames.handoff_sidecar_name):
        sidecar = absolute.parent / name(absolute.name)
        if sidecar.exists():
            sidecar.unlink()
            removed.append(os.fspath(sidecar))
    return removed


@renamed_keyword("ckpt_dir", "checkpoint_dir")
def cleanup(
    checkpoint_dir: PathLike,
    output_paths: Sequence[PathLike] | PathLike,
    keep_logs: bool = True,
    *,
    remove_stale: bool = False,
) -> list[str]:
    """Once every output exists, delete the task's checkpoint data; return what was removed.

    Removes the ``step_*`` directories, ``static/``, quarantined checkpoints and leftovers of
    killed saves, under the root's lock. With ``keep_logs`` (the default) the small logs stay
    (``attempts.jsonl``, ``saves.jsonl``, ``progress.jsonl``, ``stops.jsonl``,
    ``.resilient-root``), so that ``resilient report`` still describes the run; without it the
    whole directory goes (and ``resilient run``'s record beside it). With ``remove_stale`` the
    task's :func:`stale_siblings` are removed entirely too (a locked one is skipped with a
    warning).

    Does nothing while an output is missing: the checkpoints are then the only way to resume.

    Raises:
        CheckpointLockedError: a job still holds ``checkpoint_dir``'s lock.
        OSError: a deletion failed.
    """
    if isinstance(output_paths, (str, os.PathLike)):
        output_paths = [output_paths]
    missing = [os.fspath(p) for p in output_paths if not os.path.exists(p)]
    if missing or not output_paths:
        log.warning(
            "not cleaning %s: %s",
            checkpoint_dir,
            f"missing outputs {missing}" if missing else "no outputs given",
        )
        return []
    root = Path(checkpoint_dir)
    removed: list[str] = []
    if storage.is_root(root):
        removed += _clean_root(root, keep_logs=keep_logs)
    if remove_stale:
        for sibling in stale_siblings(root):
            path = Path(sibling)
            try:
                if storage.is_root(path):
                    removed += _clean_root(path, keep_logs=False)
            except CheckpointLockedError as exc:
                log.warning("left %s alone: %s", sibling, exc)
    for p in removed:
        log.info("removed %s", p)
    return removed


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m resilient.workflow cleanup CHECKPOINT_DIR OUTPUT...``.

    Exits 0 even when the cleanup fails (after a warning): it runs after a finished job, and a
    failing command would make Snakemake delete that job's outputs and run it again.
    """
    p = argparse.ArgumentParser(
        prog="python -m resilient.workflow",
        description="Checkpoint-directory helpers for workflow tasks.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cleanup", help="delete a finished task's checkpoint data (keeps the logs)")
    c.add_argument("checkpoint_dir")
    c.add_argument(
        "outputs", nargs="+", help="the task's outputs; nothing is removed unless all exist"
    )
    c.add_argument("--remove-logs", action="store_true", help="remove the whole directory")
    c.add_argument("--remove-stale", action="store_true", help="also remove stale siblings")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="resilient cleanup: %(message)s", stream=sys.stderr
    )
    try:
        cleanup(
            args.checkpoint_dir,
            args.outputs,
            keep_logs=not args.remove_logs,
            remove_stale=args.remove_stale,
        )
    except (OSError, CheckpointLockedError) as exc:
        log.warning("could not clean up %s (left as is): %s", args.checkpoint_dir, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
