"""Repairing a damaged copy of the static data from the intact one. Coordinator only.

Static data (``static/<hash>/``) has a second copy (``static/<hash>.copy/``): its manifest,
shards and ``COMMITTED`` always, its data files unless saved with ``static_copies=1``.
:func:`repair_static` validates both (:func:`resilient.io.checkpoints.resolve_static`) and
rebuilds a copy that failed from what passed, under a temporary name renamed into place, so
that a crash leaves the old copy or the repaired one. Call it only under the root's lock (the
restore's and the save's coordinator do).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from resilient.io import storage
from resilient.io.checkpoints import StaticSource, resolve_static
from resilient.model import filenames
from resilient.model.manifest import columns_of

__all__ = ["add_second_copy", "repair_static"]

log = logging.getLogger(__name__)


def repair_static(static_root: Path, content: str, *, full: bool = False) -> StaticSource:
    """Validate both copies of the static data ``content`` under ``static_root`` (the shards
    of a sharded manifest read and checked; ``full``: every checksum) and rebuild each copy that
    failed from the intact one, with one warning each naming what was repaired (a repair that
    fails is one warning too: the intact copy is read). Returns where to read it now.

    Raises:
        StaticDataError: no copy is intact (see :func:`~resilient.io.checkpoints.resolve_static`).
    """
    source = resolve_static(static_root, content, full=full, shards=True)
    if not source.damaged:
        return source
    for path, why in source.damaged:
        try:
            _rebuild(path, source)
        except OSError as exc:
            log.warning(
                "static data %s: %s/ failed its check (%s); could not repair it (%s): "
                "reading the other copy", content, path.name, why, exc,
            )  # fmt: skip
        else:
            log.warning(
                "static data %s: %s/ failed its check (%s); repaired it from the other copy",
                content, path.name, why,
            )  # fmt: skip
    return resolve_static(static_root, content, shards=True)


def add_second_copy(static_root: Path, source: StaticSource) -> bool:
    """Give static data written before the copies (one copy only, :attr:`StaticSource.copies`
    1 with no ``.copy`` directory) its second copy, metadata and data files, so that a root
    from an older library stops depending on one copy at its next save. One info line; a
    failure is one warning (the one copy is still read). Returns whether it added the copy.
    Coordinator only, under the root's lock."""
    second = static_root / filenames.STATIC_DIR / filenames.static_copy_dir_name(source.content)
    if source.copies != 1 or os.path.lexists(second) or not source.dirs:
        return False
    try:
        _rebuild(second, source, holds_data=True)
    except OSError as exc:
        log.warning("static data %s: could not add its second copy (%s)", source.content, exc)
        return False
    log.info(
        "static data %s was written before static data had two copies: added its second "
        "copy (%s/)", source.content, second.name,
    )  # fmt: skip
    return True


def _rebuild(path: Path, source: StaticSource, *, holds_data: bool | None = None) -> None:
    """Make ``path`` (a copy of ``source``) whole again: its metadata from the copy whose
    metadata passed, its data files (if it holds them; ``holds_data`` forces it) from the copy
    whose data files did."""
    base = path.parent
    first = base / filenames.static_dir_name(source.content)
    if holds_data is None:
        holds_data = path == first or source.copies == 2
    names = [filenames.COMMITTED, filenames.MANIFEST]
    sharded = source.manifest.sharded
    if sharded is not None:
        names += [s.name for s in sharded.shards]
    plan = [(source.meta / n, n) for n in names]
    if holds_data:
        plan += [(source.data / n, n) for n in columns_of(source.manifest.files).names]
    tmp = base / filenames.static_tmp_dir_name(storage.new_token())
    tmp.mkdir()
    try:
        for src, name in plan:
            shutil.copyfile(src, tmp / name, follow_symlinks=False)
        storage.fsync_files([tmp / name for _, name in plan])
        storage.fsync_dir(tmp)
        old = storage.move_to_trash(path) if os.path.lexists(path) else None
        os.rename(tmp, path)
        storage.fsync_dir(base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
