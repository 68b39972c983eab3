"""Finding and validating checkpoints in a target (:class:`~resilient.io.targets.Target`: a
checkpoint directory on disk, or any other). No MPI: the CLI and the coordinator use it.

*Quick* validation checks the commit marker, the manifest (strictly parsed, its checksum
matching the marker) and that every data file is a regular file of the recorded size.
*Full* validation also re-reads every byte and compares checksums. Everything is read
through the target's primitives (:meth:`~resilient.io.targets.Target.manifest`,
:meth:`~resilient.io.targets.Target.stat`, :meth:`~resilient.io.targets.Target.open_reader`),
so a checkpoint validates alike wherever it lives.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from resilient.errors import InvalidCheckpointError, StaticDataError
from resilient.io.digests import digest_file_range, digest_file_stripes
from resilient.io.logs import PROTECTED
from resilient.io.manifests import MARKER_COPIES, load_entries
from resilient.io.targets import DirectoryTarget, SetKey, Target, as_target, set_files
from resilient.model import filenames
from resilient.model.checksum import digest_text
from resilient.model.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    columns_of,
)
from resilient.model.tiling import combine_checksums, file_segments, segment_label
from resilient.model.tree import Memo

__all__ = [
    "CheckpointRecord",
    "StaticSource",
    "check_file_sizes",
    "iter_checkpoints",
    "latest_valid",
    "list_checkpoints",
    "protected_steps",
    "resolve_static",
    "resumable_step",
    "static_copies_of",
    "statics_of",
    "validate_checkpoint",
    "validate_set",
    "verify_node_files",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A checkpoint as found in its target.

    Attributes:
        step: its step.
        path: its directory (a target's :meth:`~resilient.io.targets.Target.where`).
        status: ``valid``, ``invalid`` or ``quarantined``.
        reason: why it is not valid (empty when valid).
        manifest: its manifest, when it could be read.
    """

    step: int
    path: Path
    status: str
    reason: str = ""
    manifest: Manifest | None = None
    shared: bool = False  # invalid only because its static data is lost (not quarantined)



def _check_shards(
    target: Target, key: SetKey, manifest: Manifest, *, node_local: bool = False
) -> None:
    """Quick validation of a sharded manifest's shards: each a regular file of the size its
    index says, and no shard the index does not name (their contents are checked when read).
    ``node_local``: a node-local copy holds the shards of its node's files only (a shard
    never spans two nodes): a shard none of whose files is present may be absent."""
    sharded = manifest.sharded
    if sharded is None:
        return
    where = target.where(key)
    for shard in sharded.shards:
        found = target.stat(key, shard.name)
        if found is None:
            if node_local and not any(target.stat(key, f) is not None for f in shard.files):
                continue
            raise InvalidCheckpointError(where, f"manifest shard {shard.name} is missing")
        if not found.regular or found.size != shard.size:
            raise InvalidCheckpointError(
                where, f"manifest shard {shard.name} is not the file its index describes"
            )
    named = {s.name for s in sharded.shards}
    extra = sorted(
        n for n in target.file_names(key) if filenames.is_shard_name(n) and n not in named
    )
    if extra:
        raise InvalidCheckpointError(where, f"manifest shard {extra[0]} is not in the index")


def _check_files(
    target: Target,
    key: SetKey,
    manifest: Manifest,
    *,
    full: bool,
    node_local: bool,
    memo: Memo | None,
    data_files: bool = True,
) -> Manifest:
    """Check the shards and data files (a quick check without ``data_files``: the shards
    only); the manifest, with every entry a full validation needed loaded (those of the files
    present, for a node-local copy)."""
    _check_shards(target, key, manifest, node_local=node_local)
    try:
        if full:
            present = None  # every file: a missing one fails below
            if node_local:
                present = [
                    r for f in manifest.files if target.stat(key, f.name) is not None
                    for r in f.ranks
                ]  # fmt: skip
            manifest = load_entries(set_files(target, key), manifest, present, memo=memo)
        if full or data_files:
            _check_data_files(target, key, manifest, full=full, node_local=node_local)
    except ManifestError as exc:  # a shard read by a full validation
        raise InvalidCheckpointError(target.where(key), f"bad manifest: {exc}") from None
    return manifest


def check_file_sizes(target: Target, key: SetKey, manifest: Manifest) -> None:
    """Quick validation of the data files ``manifest`` lists (of a part: its files only) in
    ``target``'s committed set ``key``: each a regular file of its size. What a restore's
    shard leader checks of its shard's files, which its coordinator does not look at
    (:func:`iter_checkpoints` without ``data_files``). Not collective.

    Raises:
        InvalidCheckpointError: a file is missing, not a regular file, or of another size.
    """
    _check_data_files(target, key, manifest, full=False, node_local=False)


def verify_node_files(target: Target, key: SetKey) -> Manifest:
    """Full validation of a node-local copy's files (a rebuilt one, before it is used): every
    checksum of every data file and manifest shard present, against the manifest. Its static
    data lives in the shared root and is not looked at. Not collective.

    Raises:
        InvalidCheckpointError: with the reason.
    """
    manifest = target.manifest(key)
    return _check_files(target, key, manifest, full=True, node_local=True, memo=None)


def _check_data_files(
    target: Target, key: SetKey, manifest: Manifest, *, full: bool, node_local: bool
) -> None:
    where = target.where(key)
    cols = columns_of(manifest.files)  # (a quick check decodes no file given as text)
    for at, (name, size) in enumerate(zip(cols.names, cols.sizes, strict=True)):
        found = target.stat(key, name)
        if found is None:
            if node_local:
                continue  # a node-local copy holds only its node's files
            raise InvalidCheckpointError(where, f"data file {name} is missing")
        if not found.regular:
            raise InvalidCheckpointError(where, f"data file {name} is not a regular file")
        if found.size != size:
            raise InvalidCheckpointError(
                where, f"data file {name} has {found.size} bytes, manifest says {size}"
            )
        if not full:
            continue
        entry = manifest.files[at]
        striped = _striped(manifest, entry)
        reader = target.open_reader(key, name)
        try:
            digests = []
            for offset, length, expected, owner in file_segments(manifest, entry):
                label = segment_label(owner)
                stripes = striped.get(offset)
                if stripes is None:
                    got = digest_file_range(reader.readv, offset, length)
                else:  # a Block leaf: its stripes' checksums too, in the same pass
                    got, parts = digest_file_stripes(reader.readv, offset, length, stripes[0])
                    bad = [
                        i for i, (a, b) in enumerate(zip(parts, stripes[1], strict=False)) if a != b
                    ]
                    if bad or len(parts) != len(stripes[1]):
                        raise InvalidCheckpointError(
                            where, f"checksum mismatch in {entry.name}: {label} stripe {bad[:1]}"
                        )
                if got != expected:
                    raise InvalidCheckpointError(
                        where,
                        f"checksum mismatch in {entry.name}: {label} (bytes {offset}-{offset + length})",
                    )
                digests.append((offset, length, got))
        except EOFError as exc:
            raise InvalidCheckpointError(
                where, f"data file {entry.name} truncated: {exc}"
            ) from None
        finally:
            reader.close()
        if digest_text(combine_checksums(digests)) != entry.checksum:
            raise InvalidCheckpointError(where, f"file checksum mismatch for {entry.name}")


def _striped(manifest: Manifest, file: FileEntry) -> dict[int, tuple[int, tuple[str, ...]]]:
    """Datasets of ``file`` with stripe checksums: offset -> (bytes per stripe, digests)."""
    out = {}
    for r in file.ranks:
        rank = manifest.ranks[r]
        if rank.file != file.name:
            continue
        for d in rank.datasets:
            if d.stripes is not None and d.offset is not None and d.nbytes:
                out[d.offset] = (d.stripes.rows * (d.nbytes // d.shape[0]), d.stripes.digests)
    return out


def statics_of(root: Target) -> Target:
    """The target holding the static data of the checkpoint root ``root`` (its ``static``
    child: one committed set per content and copy, :mod:`resilient.checkpoint.statics`)."""
    return root.child(filenames.STATIC_DIR)


def validate_checkpoint(
    path: Path,
    *,
    full: bool = False,
    kind: str = "checkpoint",
    static_root: Path | Target | None = None,
    node_local: bool = False,
    memo: Memo | None = None,
    data_files: bool = True,
) -> Manifest:
    """Validate the committed directory ``path`` on disk (and its static data); return its
    manifest: :func:`validate_set` of its directory (what the CLI and tests name).

    Args:
        path: the checkpoint directory.
        static_root: the root holding its static data (default: ``path``'s parent).
        full, kind, node_local, memo, data_files: see :func:`validate_set`.

    Raises:
        InvalidCheckpointError: with the reason.
    """
    parent = DirectoryTarget(path.parent)
    return validate_set(
        parent, path.name, full=full, kind=kind,
        statics=statics_of(parent if static_root is None else as_target(static_root)),
        node_local=node_local, memo=memo, data_files=data_files,
    )  # fmt: skip


def validate_set(
    target: Target,
    key: SetKey,
    *,
    full: bool = False,
    kind: str = "checkpoint",
    statics: Target | None = None,
    node_local: bool = False,
    memo: Memo | None = None,
    data_files: bool = True,
) -> Manifest:
    """Validate one committed set of ``target`` (a checkpoint, and its static data); return
    its manifest.

    Args:
        target: where it is.
        key: its step (or its name).
        full: verify every checksum, not only sizes.
        kind: ``checkpoint`` or ``static``.
        statics: the target holding its static data (default: ``target``'s own,
            :func:`statics_of`).
        node_local: a node-local copy (:mod:`resilient.checkpoint.tiers`): files of other nodes are absent.
        memo: the caller's :class:`~resilient.model.tree.Memo` for parsing the manifest.
        data_files: ``False``: a quick validation does not look at the data files (its
            caller's readers check their own: :func:`check_file_sizes`; a restore's
            coordinator of 100,000 ranks would stat 100,000 files).

    Raises:
        InvalidCheckpointError: with the reason.
    """
    manifest = target.manifest(key, kind=kind, memo=memo)
    manifest = _check_files(
        target, key, manifest, full=full, node_local=node_local, memo=memo, data_files=data_files
    )
    if manifest.static is not None:
        held = statics_of(target) if statics is None else statics
        resolve_static(held, manifest.static, full=full, data_files=data_files)
    return manifest


@dataclass(frozen=True, slots=True)
class StaticSource:
    """Where to read a piece of static data (:func:`resolve_static`).

    Attributes:
        target: the target holding the static data (:func:`statics_of`): each copy is one
            committed set of it, by name (``<hash>``, ``<hash>.copy``).
        content: its content hash.
        manifest: its manifest (an index, for a sharded one).
        dirs: the copies that passed, first the one to read (each with its manifest, shards
            and data files: a copy of the metadata only, saved with ``static_copies=1``, is
            never listed). Empty when only a repair makes a whole copy (``static_copies=1``
            and the metadata of the copy that holds the data files failed).
        damaged: each copy that failed, with why (``(name, reason)``): what a repair redoes
            (:func:`resilient.io.repair.repair_static`).
        copies: the copies of its data files it was saved with (1: ``static_copies=1``, or a
            root written before the copies).
        meta: a copy whose metadata passed (the first of ``dirs`` when there is one).
        data: a copy whose data files passed (or were not looked at).
    """

    target: Target
    content: str
    manifest: Manifest
    dirs: tuple[str, ...]
    damaged: tuple[tuple[str, str], ...]
    copies: int
    meta: str
    data: str


def static_copies_of(statics: Target, name: str) -> int | None:
    """The copies of its data files the marker of the static data copy ``name`` records
    (``None``: it records none, written before the copies, or unreadable). Not collective."""
    try:
        doc = json.loads(statics.read_small(name, filenames.COMMITTED, 1 << 16) or b"")
        copies = doc.get(MARKER_COPIES) if isinstance(doc, dict) else None
    except (OSError, ValueError, InvalidCheckpointError, RecursionError):
        return None
    return copies if copies in (1, 2) and not isinstance(copies, bool) else None


def resolve_static(
    statics: Target,
    content: str,
    *,
    full: bool = False,
    data_files: bool = True,
    shards: bool = False,
) -> StaticSource:
    """Validate both copies of the static data ``content`` in ``statics`` (a root's
    :func:`statics_of`: its ``static/<hash>/`` and ``static/<hash>.copy/``) and say which to
    read. Writes nothing; one copy that fails is logged (info, once per process) and listed in
    :attr:`StaticSource.damaged` for a repair. Not collective.

    ``full``: every checksum; ``data_files``: ``False`` skips a quick check of the data files
    (see :func:`validate_set`); ``shards``: read the shards of a sharded manifest and
    check their checksums even in a quick check (what a restore's coordinator does before it
    repairs).

    Raises:
        StaticDataError: no copy passes (or no copy of the data files, saved with
            ``static_copies=1``): the message names the files and what the user can do.
    """
    first = filenames.static_dir_name(content)
    second = filenames.static_copy_dir_name(content)
    legacy = second not in statics.names() and static_copies_of(statics, first) is None
    copies = 1 if legacy else (
        static_copies_of(statics, first) or static_copies_of(statics, second) or 2
    )  # fmt: skip
    every = (first,) if legacy else (first, second)
    damaged: dict[str, str] = {}
    metas: dict[str, Manifest] = {}
    for name in every:
        try:
            manifest = statics.manifest(name, kind="static")
            _check_shards(statics, name, manifest)
            if shards or full:
                manifest = load_entries(set_files(statics, name), manifest)
        except InvalidCheckpointError as exc:
            damaged[name] = exc.reason
        except ManifestError as exc:
            damaged[name] = f"bad manifest: {exc}"
        else:
            metas[name] = manifest
    where = statics.where(first)
    if not metas:
        raise StaticDataError(where, _lost(content, damaged, copies, legacy, meta=False))
    meta, manifest = next(iter(metas.items()))
    holding = every if copies == 2 else (first,)  # the copies of the data files
    data = list(holding)
    if full or data_files:
        data = []
        for name in holding:
            try:
                _check_data_files(statics, name, manifest, full=full, node_local=False)
            except InvalidCheckpointError as exc:
                damaged.setdefault(name, exc.reason)
            else:
                data.append(name)
    if not data:
        raise StaticDataError(where, _lost(content, damaged, copies, legacy, meta=True))
    for name, why in damaged.items():
        _note_once(f"static data {content}: {name}: {why}; the other copy is intact")
    dirs = tuple(n for n in data if n in metas and n not in damaged)
    return StaticSource(
        statics, content, manifest, dirs, tuple(damaged.items()), copies, meta, data[0]
    )


def _lost(
    content: str,
    damaged: Mapping[str, str],
    copies: int,
    legacy: bool,
    *,
    meta: bool,
) -> str:
    """What :class:`StaticDataError` says: each copy's failure, why there is no other copy,
    and what the user can do."""
    what = "; ".join(f"{name}/: {why}" for name, why in damaged.items())
    if legacy:
        why = "it has one copy only (written by a library older than the static data's copies)"
    elif copies == 1 and meta:
        why = (
            "its data files have one copy only: it was saved with static_copies=1 (the "
            "default, 2, keeps a second copy)"
        )
    else:
        why = "both copies are damaged"
    return (
        f"the static data {content} cannot be read ({what}): {why}. The checkpoints that use "
        "it are intact but cannot be restored without it (none was quarantined). Put its "
        "directory back from a backup, or start over: delete the checkpoints that refer to it "
        "(or the whole checkpoint directory); a save of the same static data writes it again"
    )


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    """Log ``line`` once per process (info: the repair that follows says it as a warning)."""
    if line not in _NOTED:
        _NOTED.add(line)
        log.info("%s", line)


def iter_checkpoints(
    root: str | os.PathLike[str] | Target,
    *,
    full: bool = False,
    step: int | None = None,
    quarantined: bool = False,
    static_root: str | os.PathLike[str] | Target | None = None,
    node_local: bool = False,
    memo: Memo | None = None,
    data_files: bool = True,
) -> Iterator[CheckpointRecord]:
    """The checkpoints under ``root``, newest first, each with its verdict.

    The one way the library, the CLI, ``resilient run`` and the workflow adapters find
    checkpoints. Only the listing is read up front; each checkpoint is validated when
    the iteration reaches it, so "the newest valid one" costs one validation when it is the
    newest, however long the history. Temporary directories of saves in progress (or killed)
    are never listed.

    Args:
        root: the checkpoint directory, or its target (a missing root has no checkpoints).
        full: verify every checksum instead of the quick check.
        step: only the checkpoint(s) of this step.
        quarantined: also yield quarantined directories (status ``quarantined``), after the
            committed directory of the same step.
        static_root: the root holding the static data (default: ``root``), and
            node_local: for a node-local tier, see :func:`validate_set`.
        memo: the caller's :class:`~resilient.model.tree.Memo` for parsing manifests.
        data_files: see :func:`validate_set`.
    """
    target = as_target(root)
    statics = statics_of(target if static_root is None else as_target(static_root))
    found: list[tuple[int, bool, str]] = []
    for name in target.names():
        committed = filenames.parse_step_dir(name)
        if committed is not None:
            found.append((committed, True, name))
            continue
        moved = filenames.parse_quarantined(name) if quarantined else None
        if moved is not None:
            found.append((moved, False, name))
    if step is not None:
        found = [f for f in found if f[0] == step]
    found.sort(key=lambda f: (-f[0], not f[1], f[2]))
    for number, committed_dir, name in found:
        path = Path(target.where(name))
        if not committed_dir:
            yield CheckpointRecord(
                number, path, "quarantined", _quarantine_reason(target, name)
            )
            continue
        try:
            manifest = validate_set(
                target, number, full=full, statics=statics, node_local=node_local, memo=memo,
                data_files=data_files,
            )  # fmt: skip
        except StaticDataError as exc:
            yield CheckpointRecord(number, path, "invalid", exc.reason, shared=True)
        except InvalidCheckpointError as exc:
            yield CheckpointRecord(number, path, "invalid", exc.reason)
        else:
            yield CheckpointRecord(number, path, "valid", "", manifest)


def _quarantine_reason(target: Target, name: str) -> str:
    try:
        info = json.loads(target.read_small(name, filenames.QUARANTINE_INFO, 1 << 16) or b"")
        return str(info.get("reason", ""))
    except (OSError, ValueError, InvalidCheckpointError, AttributeError, RecursionError):
        return ""


def list_checkpoints(
    root: str | os.PathLike[str] | Target,
    *,
    full: bool = False,
    static_root: str | os.PathLike[str] | Target | None = None,
    node_local: bool = False,
) -> list[CheckpointRecord]:
    """Every checkpoint under ``root`` (a directory, or its target; quarantined ones too),
    oldest first, validated."""
    records = list(
        iter_checkpoints(
            root, full=full, quarantined=True, static_root=static_root, node_local=node_local
        )
    )
    records.sort(key=lambda r: (r.step, r.status != "valid", r.path.name))
    return records


def latest_valid(
    root: str | os.PathLike[str] | Target, *, full: bool = False
) -> CheckpointRecord | None:
    """The newest checkpoint under ``root`` (a directory, or its target) that validates, or
    ``None``."""
    return next((r for r in iter_checkpoints(root, full=full) if r.status == "valid"), None)


def protected_steps(
    root: str | os.PathLike[str] | Target, *, since: float | None = None
) -> set[int]:
    """Node-local steps whose partner copies committed on other nodes, recorded in the shared
    root (``protected.jsonl``, written once every node's copy is in place) at or after
    ``since`` (a ``time.time()``). Such a step survives the loss of any one node; the nodes'
    disks need not be visible from here."""
    found: set[int] = set()
    for rec in as_target(root).read_log(filenames.PROTECT_LOG, PROTECTED):
        step, when = rec["step"], rec.get("time")
        if since is None or (when is not None and when >= since):
            found.add(step)
    return found


def resumable_step(
    root: str | os.PathLike[str] | Target, *, protected_since: float | None = None
) -> int | None:
    """The newest step a restart resumes from, even one that lost a node: the newest valid
    checkpoint of the shared root, or a newer node-local step protected by partner copies
    (:func:`protected_steps`, those recorded at or after ``protected_since``); ``None``: none.

    Not collective: reads the shared root's files (quick validation)."""
    record = latest_valid(root)
    steps = protected_steps(root, since=protected_since)
    if record is not None:
        steps.add(record.step)
    return max(steps, default=None)
