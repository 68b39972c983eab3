"""One piece of local work on a background thread, its outcome kept for a later collective.

The writer of an asynchronous save is a thread of the rank's own process, not a separate
process fed through shared memory (DCP's and NVRx's choice in PyTorch): what it runs, ``pwrite``,
``fsync``, ``copy_file_range`` and xxh3 over large buffers, releases the GIL, so the program's
thread keeps running (bench/README.md: measured GIL drag); errors come back as plain exceptions;
and no second process needs the staged bytes mapped. It never communicates: every collective of
a save stays on the program's thread, so MPI needs no thread support.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BackgroundTask"]

T = TypeVar("T")


class BackgroundTask(Generic[T]):
    """Run ``fn`` on a daemon thread (or here, with ``inline=True``); keep its result or error.

    Args:
        fn: the work; it must not communicate.
        name: the thread's name.
        inline: run ``fn`` now on the calling thread (a blocking save takes the same path).
    """

    def __init__(self, fn: Callable[[], T], *, name: str, inline: bool = False) -> None:
        self._fn = fn
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if inline:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # kept for the next collective, raised there
            self._error = exc

    def done(self) -> bool:
        """Whether the work has finished (no waiting)."""
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> T:
        """Wait for the work; return its result or raise its error."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
