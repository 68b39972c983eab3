"""CPU work to do between the runs of data a write hands to the kernel: :class:`IdleWork`."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

__all__ = ["IdleWork"]


class IdleWork:
    """CPU work to do while the disk writes: a writer (the checkpoint's ``WriteJob.write``)
    hands :meth:`run_one` to :func:`resilient.io.fileio.write_file` as its ``idle``, called
    after each run of data the kernel writes back without the CPU; the tasks not reached then
    are the owner's to :meth:`finish` (while the fsync runs). In order, each once, on the
    calling thread."""

    def __init__(self, tasks: Iterable[Callable[[], None]]) -> None:
        self._tasks = collections.deque(tasks)

    def run_one(self) -> None:
        """Run the next task, if one is left."""
        if self._tasks:
            self._tasks.popleft()()

    def finish(self) -> None:
        """Run every task left."""
        while self._tasks:
            self.run_one()
