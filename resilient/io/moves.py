"""Moves between targets: bytes of a committed step of one target into a pending step of another.

A node-local tier's flush (:mod:`resilient.checkpoint.tiers`) moves its committed step to the
shared root this way: every rank moves its own byte ranges of one data file (the file's leader
also HDF5's own bytes and sets the file's size), hashing them as they are read, so a corrupt
source is never moved as if it were good. The bytes go through the targets' range readers
and writers (:meth:`~resilient.io.targets.Target.open_reader`,
:meth:`~resilient.io.targets.Target.open_writer`) and :func:`resilient.io.fileio.copy_ranges`
(O_DIRECT where the ranges are large enough, through the caller's
:class:`~resilient.io.fileio.Bounce`). Local: no communication; the destination's commit is
the caller's (:meth:`~resilient.io.targets.Target.commit`).
"""

from __future__ import annotations

from collections.abc import Sequence

from resilient.errors import InvalidCheckpointError
from resilient.io import fileio, storage
from resilient.io.commit import PendingDir
from resilient.io.targets import Target

__all__ = ["move_ranges"]


def move_ranges(
    source: Target,
    step: int,
    name: str,
    into: Target,
    pending: PendingDir,
    ranges: Sequence[tuple[int, int, str, str]],
    *,
    size: int | None = None,
    bounce: fileio.Bounce | None = None,
) -> None:
    """Copy byte ranges of the file ``name`` of ``source``'s committed ``step`` to the same
    offsets of ``name`` in ``pending`` (``into``'s pending step), verifying each range, then
    fsync; transient I/O errors are retried.

    Args:
        ranges: ``(offset, length, xxh3-64 hex digest, label)`` each.
        size: the file's size, set by the one caller passing it (its other ranges may be
            moved by other ranks at the same time).
        bounce: the caller's buffer (none: one mapped for this call).

    Raises:
        InvalidCheckpointError: a range's bytes do not match its digest, or the file ends early.
        OSError: the copy failed (after retries for transient errors).
    """
    where = f"{source.where(step)}/{name}"
    direct = max((n for _, n, _, _ in ranges), default=0) >= fileio.DIRECT_MIN

    def move() -> None:
        reader = source.open_reader(step, name)
        try:
            writer = into.open_writer(pending, name, direct=direct, exclusive=False)
            try:
                fileio.copy_ranges(reader, writer, ranges, where=where, size=size, bounce=bounce)
            except BaseException:
                writer.close(sync=False)
                raise
            writer.close(sync=True)
        finally:
            reader.close()

    try:
        storage.retry_io(move, what=f"copying {where} to {pending.path / name}")
    except (ValueError, EOFError) as exc:
        raise InvalidCheckpointError(source.where(step), str(exc)) from None
