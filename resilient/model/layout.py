"""The layout of a checkpoint set: how its ranks are grouped into files. Pure (no I/O).

The word *layout* means this everywhere; the names of files on disk are
:mod:`resilient.model.filenames`, and where the bytes of one file go is
:class:`resilient.model.h5format.FileMap`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """The layout of a set: how its ranks are grouped into files (``kind``: ``self``, ``node``,
    ``world`` or ``custom``; the word *layout* means this everywhere, and the names of files on
    disk are :mod:`resilient.model.filenames`)."""

    kind: str
    nranks: int
    groups: tuple[tuple[int, ...], ...]

    def describe(self) -> str:
        """A short human description, e.g. ``'node (4 ranks, 2 files)'``."""
        return f"{self.kind} ({self.nranks} ranks, {len(self.groups)} files)"
