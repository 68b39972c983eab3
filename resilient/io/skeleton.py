"""A data file's skeleton (HDF5's own bytes, :class:`~resilient.io.fileio.FileSkeleton`) on
its group's leader, built once and kept: :class:`Skeleton`."""

from __future__ import annotations

from collections.abc import Callable

from resilient.io import fileio

__all__ = ["Skeleton"]


class Skeleton:
    """A file's skeleton on its group's leader: built when first asked for (a new structure's,
    by the leader's write, between two runs of data, while the disk is busy), then kept for
    the later saves of the same structure. A build that failed fails again when asked."""

    def __init__(self, build: Callable[[], fileio.FileSkeleton]) -> None:
        self._build: Callable[[], fileio.FileSkeleton] | None = build
        self._built: fileio.FileSkeleton | None = None

    @classmethod
    def of(cls, skeleton: fileio.FileSkeleton) -> Skeleton:
        """An already built skeleton."""
        done = cls(lambda: skeleton)
        done.get()
        return done

    def get(self) -> fileio.FileSkeleton:
        """The skeleton (built now, if it is not yet).

        Raises:
            RuntimeError: its build failed before (that failure raised its own error).
        """
        if self._built is None:
            if self._build is None:
                raise RuntimeError("this file's skeleton could not be built")
            build, self._build = self._build, None
            self._built = build()  # if this raises, the skeleton is never used again
        return self._built

    @property
    def usable(self) -> bool:
        """Whether it is built, or not tried yet (a failed build is not reused)."""
        return self._built is not None or self._build is not None
