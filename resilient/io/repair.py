"""Repairing a damaged copy of the static data from the intact one. Coordinator only.

Static data (``static/<hash>/``) has a second copy (``static/<hash>.copy/``): its manifest,
shards and ``COMMITTED`` always, its data files unless saved with ``static_copies=1``.
:func:`repair_static` validates both (:func:`resilient.io.checkpoints.resolve_static`) and
rebuilds a copy that failed from what passed, through the target that holds them
(:func:`resilient.io.checkpoints.statics_of`): a pending copy filled file by file, then
published in place of the old one (:meth:`~resilient.io.targets.Target.publish`), so that a
crash leaves the old copy or the repaired one. Call it only under the root's lock (the
restore's and the save's coordinator do).
"""

from __future__ import annotations

import logging

from resilient.errors import CommitError
from resilient.io.checkpoints import StaticSource, resolve_static
from resilient.io.targets import Target
from resilient.model import filenames
from resilient.model.manifest import columns_of

__all__ = ["add_second_copy", "repair_static"]

log = logging.getLogger(__name__)


def repair_static(statics: Target, content: str, *, full: bool = False) -> StaticSource:
    """Validate both copies of the static data ``content`` in ``statics`` (the shards
    of a sharded manifest read and checked; ``full``: every checksum) and rebuild each copy that
    failed from the intact one, with one warning each naming what was repaired (a repair that
    fails is one warning too: the intact copy is read). Returns where to read it now.

    Raises:
        StaticDataError: no copy is intact (see :func:`~resilient.io.checkpoints.resolve_static`).
    """
    source = resolve_static(statics, content, full=full, shards=True)
    if not source.damaged:
        return source
    for name, why in source.damaged:
        try:
            _rebuild(name, source)
        except (OSError, CommitError) as exc:
            log.warning(
                "static data %s: %s/ failed its check (%s); could not repair it (%s): "
                "reading the other copy", content, name, why, exc,
            )  # fmt: skip
        else:
            log.warning(
                "static data %s: %s/ failed its check (%s); repaired it from the other copy",
                content, name, why,
            )  # fmt: skip
    return resolve_static(statics, content, shards=True)


def add_second_copy(source: StaticSource) -> bool:
    """Give static data written before the copies (one copy only, :attr:`StaticSource.copies`
    1 with no ``.copy`` directory) its second copy, metadata and data files, so that a root
    from an older library stops depending on one copy at its next save. One info line; a
    failure is one warning (the one copy is still read). Returns whether it added the copy.
    Coordinator only, under the root's lock."""
    second = filenames.static_copy_dir_name(source.content)
    if source.copies != 1 or second in source.target.names() or not source.dirs:
        return False
    try:
        _rebuild(second, source, holds_data=True)
    except (OSError, CommitError) as exc:
        log.warning("static data %s: could not add its second copy (%s)", source.content, exc)
        return False
    log.info(
        "static data %s was written before static data had two copies: added its second "
        "copy (%s/)", source.content, second,
    )  # fmt: skip
    return True


def _rebuild(name: str, source: StaticSource, *, holds_data: bool | None = None) -> None:
    """Make the copy ``name`` of ``source`` whole again: its metadata from the copy whose
    metadata passed, its data files (if it holds them; ``holds_data`` forces it) from the copy
    whose data files did, each copied as it is."""
    statics = source.target
    if holds_data is None:
        holds_data = name == filenames.static_dir_name(source.content) or source.copies == 2
    names = [filenames.COMMITTED, filenames.MANIFEST]
    sharded = source.manifest.sharded
    if sharded is not None:
        names += [s.name for s in sharded.shards]
    plan = [(source.meta, n) for n in names]
    if holds_data:
        plan += [(source.data, n) for n in columns_of(source.manifest.files).names]
    pending = statics.pending(name)
    statics.create(pending)
    try:
        for copy, file in plan:
            statics.copy(pending, file, statics, copy)
        statics.publish(pending, what=f"repair of static data {source.content} ({name}/)")
    except BaseException:
        statics.rollback(pending)
        raise
