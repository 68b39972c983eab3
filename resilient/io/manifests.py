"""Reading a committed set's own files: its ``COMMITTED`` marker, its manifest and the shards of
a sharded manifest, each checked against the other (what every target's
:meth:`~resilient.io.targets.Target.manifest` returns, and what a restore's ranks read of the
shards). No MPI, no listing: finding and validating whole checkpoints is
:mod:`resilient.io.checkpoints`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from resilient.errors import InvalidCheckpointError
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import parse_manifest
from resilient.model.manifest import FileEntry, Manifest, ManifestError, RankEntry, ShardEntry
from resilient.model.shards import ShardDoc, open_shard
from resilient.model.tree import Memo

__all__ = [
    "MARKER_COPIES",
    "MAX_MANIFEST_BYTES",
    "SetFiles",
    "check_manifest",
    "checked_shard",
    "entries_from_shards",
    "load_entries",
    "load_manifest",
    "marker_text",
    "read_shard",
    "read_shards",
    "read_small",
]

MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest a reader parses (a larger one is refused as implausible, so a save
never commits one: :meth:`resilient.io.commit.PendingDir.prepare`)."""


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a symlink is not followed) of at most ``limit``
    bytes.

    Raises:
        FileNotFoundError: it is not there.
        InvalidCheckpointError: it is not a regular file, or larger than ``limit``.
    """
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
        doc[MARKER_COPIES] = copies
    return json.dumps(doc)


MARKER_COPIES = "data_copies"


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

    read = SetFiles.in_directory(path).read
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


@dataclass(frozen=True, slots=True)
class SetFiles:
    """The small files of one committed set, read by name: a directory's
    (:meth:`in_directory`) or a target's (:func:`resilient.io.targets.set_files`).

    Attributes:
        where: the set, for messages (a directory's path).
        read: ``read(name, limit)``, the bytes of the regular file ``name`` of at most
            ``limit`` bytes (``None``: it is not there; raises
            :class:`~resilient.errors.InvalidCheckpointError` for another kind of file or a
            larger one).
    """

    where: str
    read: Callable[[str, int], bytes | None]

    @classmethod
    def in_directory(cls, directory: Path) -> SetFiles:
        """The files of the committed directory ``directory`` (:func:`read_small`)."""

        def read(name: str, limit: int) -> bytes | None:
            try:
                return read_small(directory / name, limit)
            except (FileNotFoundError, NotADirectoryError):
                return None

        return cls(str(directory), read)


def read_shard(files: SetFiles, shard: ShardEntry) -> bytes:
    """The bytes of one shard of a sharded manifest (schema 3) in ``files``, checked
    against its index entry (size and checksum). Not collective.

    Raises:
        InvalidCheckpointError: the shard is missing, or not the one the index describes.
    """
    return checked_shard(files.where, shard, files.read(shard.name, MAX_MANIFEST_BYTES))


def checked_shard(where: str, shard: ShardEntry, text: bytes | None) -> bytes:
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
    files: SetFiles,
    manifest: Manifest,
    ranks: Iterable[int] | None = None,
    *,
    memo: Memo | None = None,
    read: Mapping[str, ShardDoc] | None = None,
) -> Manifest:
    """``manifest`` (of the checkpoint whose files are ``files``) with the entries of ``ranks`` loaded:
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
        manifest, ranks, lambda shard: _open_shard(files, manifest, shard), memo, read
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
        text = checked_shard(where, shard, shards.get(shard.name))
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
    files: SetFiles, manifest: Manifest, ranks: Iterable[int] | None = None
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
            out[shard.name] = _open_shard(files, manifest, shard)
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


def _open_shard(files: SetFiles, manifest: Manifest, shard: ShardEntry) -> ShardDoc:
    """One shard of ``manifest`` read, checked against its index entry, its header checked."""
    return open_shard(read_shard(files, shard), kind=manifest.kind, step=manifest.step)
