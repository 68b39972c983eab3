"""Finding and validating checkpoints on disk. No MPI: the CLI and the coordinator use it.

*Quick* validation checks the commit marker, the manifest (strictly parsed, its checksum
matching the marker) and that every data file is a regular file of the recorded size.
*Full* validation also re-reads every byte and compares checksums.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from resilient.errors import InvalidCheckpointError, StaticDataError
from resilient.io.digests import digest_file_range, digest_file_stripes
from resilient.io.logs import PROTECTED, read_log
from resilient.model import filenames
from resilient.model.checksum import digest_bytes, digest_text
from resilient.model.codec import parse_manifest
from resilient.model.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    RankEntry,
    ShardEntry,
    columns_of,
)
from resilient.model.shards import ShardDoc, open_shard
from resilient.model.tiling import combine_checksums, file_segments, segment_label
from resilient.model.tree import Memo

__all__ = [
    "MAX_MANIFEST_BYTES",
    "CheckpointRecord",
    "StaticSource",
    "check_file_sizes",
    "check_manifest",
    "entries_from_shards",
    "iter_checkpoints",
    "latest_valid",
    "list_checkpoints",
    "load_entries",
    "load_manifest",
    "protected_steps",
    "read_shard",
    "read_shards",
    "resolve_static",
    "resumable_step",
    "static_copies_of",
    "validate_checkpoint",
]

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest a reader parses (a larger one is refused as implausible, so a save
never commits one: :meth:`resilient.io.commit.PendingDir.prepare`)."""


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A checkpoint directory as found on disk.

    Attributes:
        step: its step.
        path: its directory.
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


def _read_small(path: Path, limit: int) -> bytes:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidCheckpointError(str(path.parent), f"{path.name} is not a regular file")
    if st.st_size > limit:
        raise InvalidCheckpointError(str(path.parent), f"{path.name} is implausibly large")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        # ask for the size the file has, not for `limit` (a read(limit + 1) allocates that
        # much, 256 MiB for a manifest, however small the file); one byte more sees growth
        size = min(os.fstat(fh.fileno()).st_size, limit)
        data = fh.read(size + 1)
        if len(data) > size:  # it grew since: read on, up to the limit as before
            data += fh.read(limit - size)
        return data


def marker_text(step: int, manifest_checksum: str, *, copies: int | None = None) -> str:
    """Content of the ``COMMITTED`` marker; ``copies``: of static data, how many copies of
    its data files were written (1 or 2; its metadata always has two)."""
    doc: dict[str, object] = {"step": step, "manifest_checksum": manifest_checksum}
    if copies is not None:
        doc[_COPIES] = copies
    return json.dumps(doc)


_COPIES = "data_copies"


def load_manifest(path: Path, *, kind: str = "checkpoint", memo: Memo | None = None) -> Manifest:
    """Read and check the marker and manifest of a committed directory (``memo``: the caller's
    :class:`~resilient.model.tree.Memo`, see :func:`~resilient.model.codec.parse_manifest`).

    Raises:
        InvalidCheckpointError: with the reason.
    """
    where = str(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise InvalidCheckpointError(where, "does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidCheckpointError(where, "is a symlink (not followed)")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidCheckpointError(where, "is not a directory")

    def read(name: str, limit: int) -> bytes | None:
        try:
            return _read_small(path / name, limit)
        except FileNotFoundError:
            return None

    return check_manifest(
        where, read(filenames.COMMITTED, 1 << 16),
        lambda: read(filenames.MANIFEST, MAX_MANIFEST_BYTES), kind=kind, memo=memo,
    )  # fmt: skip


def check_manifest(
    where: str,
    marker: bytes | None,
    manifest_bytes: Callable[[], bytes | None],
    *,
    kind: str = "checkpoint",
    memo: Memo | None = None,
) -> Manifest:
    """The manifest of a committed set from the bytes of its ``COMMITTED`` marker and of its
    manifest (read by ``manifest_bytes`` once the marker parses; ``None``: the file is
    missing), checked against each other: what every target's
    :meth:`~resilient.io.targets.Target.manifest` returns. ``where`` names the set in errors.

    Raises:
        InvalidCheckpointError: with the reason.
    """
    if marker is None:
        raise InvalidCheckpointError(where, "no COMMITTED marker (incomplete save)")
    if len(marker) > 1 << 16:
        raise InvalidCheckpointError(where, f"{filenames.COMMITTED} is implausibly large")
    try:
        doc = json.loads(marker)
        expected = doc["manifest_checksum"]
        marked_step = doc["step"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise InvalidCheckpointError(where, "COMMITTED marker is garbled") from None
    text = manifest_bytes()
    if text is None:
        raise InvalidCheckpointError(where, "manifest.json is missing")
    if len(text) > MAX_MANIFEST_BYTES:
        raise InvalidCheckpointError(where, f"{filenames.MANIFEST} is implausibly large")
    if digest_bytes(text) != expected:
        raise InvalidCheckpointError(
            where, "manifest.json does not match its checksum in COMMITTED"
        )
    try:
        manifest = parse_manifest(text, memo=memo)
    except ManifestError as exc:
        raise InvalidCheckpointError(where, f"bad manifest: {exc}") from None
    if manifest.kind != kind:
        raise InvalidCheckpointError(
            where, f"manifest is of kind {manifest.kind!r}, expected {kind!r}"
        )
    if manifest.step != marked_step:
        raise InvalidCheckpointError(where, "manifest step differs from the marker's")
    return manifest


def read_shard(directory: Path, shard: ShardEntry) -> bytes:
    """The bytes of one shard of a sharded manifest (schema 3) in ``directory``, checked
    against its index entry (size and checksum). Not collective.

    Raises:
        InvalidCheckpointError: the shard is missing, or not the one the index describes.
    """
    try:
        text = _read_small(directory / shard.name, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        text = None
    return _checked_shard(str(directory), shard, text)


def _checked_shard(where: str, shard: ShardEntry, text: bytes | None) -> bytes:
    """``text``, the bytes of ``shard`` (``None``: missing), checked against its index entry."""
    if text is None:
        raise InvalidCheckpointError(where, f"manifest shard {shard.name} is missing")
    if len(text) != shard.size:
        raise InvalidCheckpointError(
            where,
            f"manifest shard {shard.name} has {len(text)} bytes, its index says {shard.size}",
        )
    if digest_bytes(text) != shard.checksum:
        raise InvalidCheckpointError(
            where, f"manifest shard {shard.name} does not match its checksum in the index"
        )
    return text


def load_entries(
    directory: Path,
    manifest: Manifest,
    ranks: Iterable[int] | None = None,
    *,
    memo: Memo | None = None,
    read: Mapping[str, ShardDoc] | None = None,
) -> Manifest:
    """``manifest`` (of the checkpoint in ``directory``) with the entries of ``ranks`` loaded:
    of a sharded manifest (schema 3), the shards holding those ranks not loaded yet are read
    (each once: :func:`read_shards`) and parsed, the entries of the ranks' file groups kept;
    any other manifest holds its entries already and is returned as it is. ``ranks``:
    ``None``, every rank of the files the manifest (or part) lists. ``read``: shards read
    already, by name (e.g. by a restore's shard leader: :func:`read_shards`), not read again.
    Not collective: a restoring rank asks for its own rank only, an elastic restore or an
    export for all.

    Raises:
        InvalidCheckpointError: a shard is missing or not the one the index describes.
        ManifestError: a shard is malformed, of another checkpoint, or its entries are.
    """
    return _with_entries(
        manifest, ranks, lambda shard: _open_shard(directory, manifest, shard), memo, read
    )


def entries_from_shards(
    manifest: Manifest, shards: Mapping[str, bytes], *, where: str, memo: Memo | None = None
) -> Manifest:
    """``manifest`` with every entry loaded from ``shards``, the bytes of its shards by name,
    read elsewhere (on the nodes holding them: an elastic restore from the node-local tier,
    :mod:`resilient.checkpoint.tierstaging`), each checked against the index as
    :func:`load_entries` checks what it reads. No I/O; ``where`` names them in errors.

    Raises:
        InvalidCheckpointError: a shard is not in ``shards`` or not the one the index describes.
        ManifestError: a shard is malformed, of another checkpoint, or its entries are.
    """

    def opened(shard: ShardEntry) -> ShardDoc:
        text = _checked_shard(where, shard, shards.get(shard.name))
        return open_shard(text, kind=manifest.kind, step=manifest.step)

    return _with_entries(manifest, None, opened, memo, None)


def _with_entries(
    manifest: Manifest,
    ranks: Iterable[int] | None,
    opened: Callable[[ShardEntry], ShardDoc],
    memo: Memo | None,
    read: Mapping[str, ShardDoc] | None,
) -> Manifest:
    """:func:`load_entries`, each shard not in ``read`` opened by ``opened`` (its bytes
    checked against the index, its header checked)."""
    sharded = manifest.sharded
    if sharded is None:
        return manifest
    files = _unloaded(manifest, ranks)
    if not files:
        return manifest
    memo = Memo() if memo is None else memo
    entries: dict[int, RankEntry] = {}
    for shard, of_shard in files.values():
        doc = read[shard.name] if read and shard.name in read else None
        try:
            if doc is None:
                doc = opened(shard)
            entries.update(doc.parse(of_shard, memo))
        except ManifestError as exc:
            raise ManifestError(f"{shard.name}: {exc}") from None
    return dataclasses.replace(manifest, ranks=sharded.with_entries(entries))


def read_shards(
    directory: Path, manifest: Manifest, ranks: Iterable[int] | None = None
) -> dict[str, ShardDoc]:
    """The shards of a sharded manifest (schema 3) holding the entries of ``ranks`` not
    loaded yet (``None``: of every rank of its files), each read once, checked against its
    index entry and its header checked, by name; their entries are not parsed (see
    :meth:`~resilient.model.shards.ShardDoc.parse`, :func:`load_entries`). Empty for any
    other manifest.

    Raises:
        InvalidCheckpointError: a shard is missing or not the one the index describes.
        ManifestError: a shard is malformed or of another checkpoint.
    """
    out = {}
    for shard, _ in _unloaded(manifest, ranks).values():
        try:
            out[shard.name] = _open_shard(directory, manifest, shard)
        except ManifestError as exc:
            raise ManifestError(f"{shard.name}: {exc}") from None
    return out


def _unloaded(
    manifest: Manifest, ranks: Iterable[int] | None
) -> dict[str, tuple[ShardEntry, dict[str, FileEntry]]]:
    """By shard name: the shard holding entries of ``ranks`` not loaded yet (``None``: every
    rank of the manifest's files), and the files of those ranks in it (empty: none, or not a
    sharded manifest)."""
    sharded = manifest.sharded
    if sharded is None:
        return {}
    wanted = [r for f in manifest.files for r in f.ranks] if ranks is None else list(ranks)
    out: dict[str, tuple[ShardEntry, dict[str, FileEntry]]] = {}
    for r in wanted:
        if sharded.loaded(r):
            continue
        shard = sharded.shard_of(r)
        file = sharded.file_of(r)
        out.setdefault(shard.name, (shard, {}))[1][file.name] = file
    return out


def _open_shard(directory: Path, manifest: Manifest, shard: ShardEntry) -> ShardDoc:
    """One shard of ``manifest`` read, checked against its index entry, its header checked."""
    return open_shard(read_shard(directory, shard), kind=manifest.kind, step=manifest.step)


def _check_shards(path: Path, manifest: Manifest, *, node_local: bool = False) -> None:
    """Quick validation of a sharded manifest's shards: each a regular file of the size its
    index says, and no shard the index does not name (their contents are checked when read).
    ``node_local``: a node-local copy holds the shards of its node's files only (a shard
    never spans two nodes): a shard none of whose files is present may be absent."""
    sharded = manifest.sharded
    if sharded is None:
        return
    where = str(path)
    for shard in sharded.shards:
        try:
            st = os.lstat(path / shard.name)
        except FileNotFoundError:
            if node_local and not any(os.path.lexists(path / f) for f in shard.files):
                continue
            raise InvalidCheckpointError(where, f"manifest shard {shard.name} is missing") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != shard.size:
            raise InvalidCheckpointError(
                where, f"manifest shard {shard.name} is not the file its index describes"
            )
    named = {s.name for s in sharded.shards}
    extra = sorted(n for n in os.listdir(path) if filenames.is_shard_name(n) and n not in named)
    if extra:
        raise InvalidCheckpointError(where, f"manifest shard {extra[0]} is not in the index")


def _check_files(
    path: Path,
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
    where = str(path)
    _check_shards(path, manifest, node_local=node_local)
    try:
        if full:
            present = None  # every file: a missing one fails below
            if node_local:
                present = [
                    r for f in manifest.files if os.path.lexists(path / f.name) for r in f.ranks
                ]
            manifest = load_entries(path, manifest, present, memo=memo)
        if full or data_files:
            _check_data_files(path, manifest, full=full, node_local=node_local)
    except ManifestError as exc:  # a shard read by a full validation
        raise InvalidCheckpointError(where, f"bad manifest: {exc}") from None
    return manifest


def check_file_sizes(path: Path, manifest: Manifest) -> None:
    """Quick validation of the data files ``manifest`` lists (of a part: its files only) in
    ``path``: each a regular file of its size. What a restore's shard leader checks of its
    shard's files, which its coordinator does not look at (:func:`iter_checkpoints` without
    ``data_files``). Not collective.

    Raises:
        InvalidCheckpointError: a file is missing, not a regular file, or of another size.
    """
    _check_data_files(path, manifest, full=False, node_local=False)


def _check_data_files(path: Path, manifest: Manifest, *, full: bool, node_local: bool) -> None:
    where = str(path)
    cols = columns_of(manifest.files)  # (a quick check decodes no file given as text)
    for at, (name, size) in enumerate(zip(cols.names, cols.sizes, strict=True)):
        fpath = path / name
        try:
            st = os.lstat(fpath)
        except FileNotFoundError:
            if node_local:
                continue  # a node-local copy holds only its node's files
            raise InvalidCheckpointError(where, f"data file {name} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidCheckpointError(where, f"data file {name} is not a regular file")
        if st.st_size != size:
            raise InvalidCheckpointError(
                where, f"data file {name} has {st.st_size} bytes, manifest says {size}"
            )
        if not full:
            continue
        entry = manifest.files[at]
        striped = _striped(manifest, entry)
        fd = os.open(fpath, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            digests = []
            for offset, length, expected, owner in file_segments(manifest, entry):
                label = segment_label(owner)
                stripes = striped.get(offset)
                if stripes is None:
                    got = digest_file_range(fd, offset, length)
                else:  # a Block leaf: its stripes' checksums too, in the same pass
                    got, parts = digest_file_stripes(fd, offset, length, stripes[0])
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
            os.close(fd)
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


def validate_checkpoint(
    path: Path,
    *,
    full: bool = False,
    kind: str = "checkpoint",
    static_root: Path | None = None,
    node_local: bool = False,
    memo: Memo | None = None,
    data_files: bool = True,
) -> Manifest:
    """Validate one committed checkpoint (and its static data); return its manifest.

    Args:
        path: the checkpoint directory.
        full: verify every checksum, not only sizes.
        kind: ``checkpoint`` or ``static``.
        static_root: the root holding its static data (default: ``path``'s parent).
        node_local: a node-local copy (:mod:`resilient.checkpoint.tiers`): files of other nodes are absent.
        memo: the caller's :class:`~resilient.model.tree.Memo` for parsing the manifest.
        data_files: ``False``: a quick validation does not look at the data files (its
            caller's readers check their own: :func:`check_file_sizes`; a restore's
            coordinator of 100,000 ranks would stat 100,000 files).

    Raises:
        InvalidCheckpointError: with the reason.
    """
    manifest = load_manifest(path, kind=kind, memo=memo)
    manifest = _check_files(
        path, manifest, full=full, node_local=node_local, memo=memo, data_files=data_files
    )
    if manifest.static is not None:
        parent = path.parent if static_root is None else static_root
        resolve_static(parent, manifest.static, full=full, data_files=data_files)
    return manifest


@dataclass(frozen=True, slots=True)
class StaticSource:
    """Where to read a piece of static data (:func:`resolve_static`).

    Attributes:
        content: its content hash.
        manifest: its manifest (an index, for a sharded one).
        dirs: the copies that passed, first the one to read (each with its manifest, shards
            and data files: a copy of the metadata only, saved with ``static_copies=1``, is
            never listed). Empty when only a repair makes a whole copy (``static_copies=1``
            and the metadata of the copy that holds the data files failed).
        damaged: each copy that failed, with why (``(path, reason)``): what a repair redoes
            (:func:`resilient.io.repair.repair_static`).
        copies: the copies of its data files it was saved with (1: ``static_copies=1``, or a
            root written before the copies).
        meta: a copy whose metadata passed (the first of ``dirs`` when there is one).
        data: a copy whose data files passed (or were not looked at).
    """

    content: str
    manifest: Manifest
    dirs: tuple[Path, ...]
    damaged: tuple[tuple[Path, str], ...]
    copies: int
    meta: Path
    data: Path


def static_copies_of(path: Path) -> int | None:
    """The copies of its data files a static data directory's marker records (``None``: it
    records none, written before the copies, or unreadable). Not collective."""
    try:
        doc = json.loads(_read_small(path / filenames.COMMITTED, 1 << 16))
        copies = doc.get(_COPIES) if isinstance(doc, dict) else None
    except (OSError, ValueError, InvalidCheckpointError, RecursionError):
        return None
    return copies if copies in (1, 2) and not isinstance(copies, bool) else None


def resolve_static(
    static_root: Path,
    content: str,
    *,
    full: bool = False,
    data_files: bool = True,
    shards: bool = False,
) -> StaticSource:
    """Validate both copies of the static data ``content`` under ``static_root`` (its
    ``static/<hash>/`` and ``static/<hash>.copy/``) and say which to read. Writes nothing;
    one copy that fails is logged (info, once per process) and listed in
    :attr:`StaticSource.damaged` for a repair. Not collective.

    ``full``: every checksum; ``data_files``: ``False`` skips a quick check of the data files
    (see :func:`validate_checkpoint`); ``shards``: read the shards of a sharded manifest and
    check their checksums even in a quick check (what a restore's coordinator does before it
    repairs).

    Raises:
        StaticDataError: no copy passes (or no copy of the data files, saved with
            ``static_copies=1``): the message names the files and what the user can do.
    """
    base = static_root / filenames.STATIC_DIR
    first = base / filenames.static_dir_name(content)
    second = base / filenames.static_copy_dir_name(content)
    legacy = not os.path.lexists(second) and static_copies_of(first) is None
    copies = 1 if legacy else (static_copies_of(first) or static_copies_of(second) or 2)
    every = (first,) if legacy else (first, second)
    damaged: dict[Path, str] = {}
    metas: dict[Path, Manifest] = {}
    for path in every:
        try:
            manifest = load_manifest(path, kind="static")
            _check_shards(path, manifest)
            if shards or full:
                manifest = load_entries(path, manifest)
        except InvalidCheckpointError as exc:
            damaged[path] = exc.reason
        except ManifestError as exc:
            damaged[path] = f"bad manifest: {exc}"
        else:
            metas[path] = manifest
    if not metas:
        raise StaticDataError(str(first), _lost(content, damaged, copies, legacy, meta=False))
    meta, manifest = next(iter(metas.items()))
    holding = every if copies == 2 else (first,)  # the copies of the data files
    data = list(holding)
    if full or data_files:
        data = []
        for path in holding:
            try:
                _check_data_files(path, manifest, full=full, node_local=False)
            except InvalidCheckpointError as exc:
                damaged.setdefault(path, exc.reason)
            else:
                data.append(path)
    if not data:
        raise StaticDataError(str(first), _lost(content, damaged, copies, legacy, meta=True))
    for path, why in damaged.items():
        _note_once(f"static data {content}: {path.name}: {why}; the other copy is intact")
    dirs = tuple(p for p in data if p in metas and p not in damaged)
    return StaticSource(content, manifest, dirs, tuple(damaged.items()), copies, meta, data[0])


def _lost(
    content: str,
    damaged: Mapping[Path, str],
    copies: int,
    legacy: bool,
    *,
    meta: bool,
) -> str:
    """What :class:`StaticDataError` says: each copy's failure, why there is no other copy,
    and what the user can do."""
    what = "; ".join(f"{p.name}/: {why}" for p, why in damaged.items())
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
    root: Path,
    *,
    full: bool = False,
    step: int | None = None,
    quarantined: bool = False,
    static_root: Path | None = None,
    node_local: bool = False,
    memo: Memo | None = None,
    data_files: bool = True,
) -> Iterator[CheckpointRecord]:
    """The checkpoints under ``root``, newest first, each with its verdict.

    The one way the library, the CLI, ``resilient run`` and the workflow adapters find
    checkpoints. Only the directory listing is read up front; each checkpoint is validated when
    the iteration reaches it, so "the newest valid one" costs one validation when it is the
    newest, however long the history. Temporary directories of saves in progress (or killed)
    are never listed.

    Args:
        root: the checkpoint root (a missing root has no checkpoints).
        full: verify every checksum instead of the quick check.
        step: only the checkpoint(s) of this step.
        quarantined: also yield quarantined directories (status ``quarantined``), after the
            committed directory of the same step.
        static_root, node_local: for a node-local tier, see :func:`validate_checkpoint`.
        memo: the caller's :class:`~resilient.model.tree.Memo` for parsing manifests.
        data_files: see :func:`validate_checkpoint`.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    found: list[tuple[int, bool, str]] = []
    for name in names:
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
        path = root / name
        if not committed_dir:
            yield CheckpointRecord(number, path, "quarantined", _quarantine_reason(path))
            continue
        try:
            manifest = validate_checkpoint(
                path, full=full, static_root=static_root, node_local=node_local, memo=memo,
                data_files=data_files,
            )  # fmt: skip
        except StaticDataError as exc:
            yield CheckpointRecord(number, path, "invalid", exc.reason, shared=True)
        except InvalidCheckpointError as exc:
            yield CheckpointRecord(number, path, "invalid", exc.reason)
        else:
            yield CheckpointRecord(number, path, "valid", "", manifest)


def _quarantine_reason(path: Path) -> str:
    try:
        info = json.loads(_read_small(path / filenames.QUARANTINE_INFO, 1 << 16))
        return str(info.get("reason", ""))
    except (OSError, ValueError, InvalidCheckpointError, AttributeError, RecursionError):
        return ""


def list_checkpoints(
    root: Path, *, full: bool = False, static_root: Path | None = None, node_local: bool = False
) -> list[CheckpointRecord]:
    """Every checkpoint directory under ``root`` (quarantined ones too), oldest first, validated."""
    records = list(
        iter_checkpoints(
            root, full=full, quarantined=True, static_root=static_root, node_local=node_local
        )
    )
    records.sort(key=lambda r: (r.step, r.status != "valid", r.path.name))
    return records


def latest_valid(root: Path, *, full: bool = False) -> CheckpointRecord | None:
    """The newest checkpoint under ``root`` that validates, or ``None``."""
    return next((r for r in iter_checkpoints(root, full=full) if r.status == "valid"), None)


def protected_steps(root: Path, *, since: float | None = None) -> set[int]:
    """Node-local steps whose partner copies committed on other nodes, recorded in the shared
    root (``protected.jsonl``, written once every node's copy is in place) at or after
    ``since`` (a ``time.time()``). Such a step survives the loss of any one node; the nodes'
    disks need not be visible from here."""
    found: set[int] = set()
    for rec in read_log(root / filenames.PROTECT_LOG, PROTECTED):
        step, when = rec["step"], rec.get("time")
        if since is None or (when is not None and when >= since):
            found.add(step)
    return found


def resumable_step(root: Path, *, protected_since: float | None = None) -> int | None:
    """The newest step a restart resumes from, even one that lost a node: the newest valid
    checkpoint of the shared root, or a newer node-local step protected by partner copies
    (:func:`protected_steps`, those recorded at or after ``protected_since``); ``None``: none.

    Not collective: reads the shared root's files (quick validation)."""
    record = latest_valid(root)
    steps = protected_steps(root, since=protected_since)
    if record is not None:
        steps.add(record.step)
    return max(steps, default=None)
