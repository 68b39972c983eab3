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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["BackgroundWriter"]

T = TypeVar("T")


class BackgroundWriter:
    """One long-lived worker thread per manager, started at the first background job.

    A thread started per save cost up to 18 ms here (``Thread.start`` waits until the new thread
    runs, and with 4 ranks on 2 cores that waits for a time slice); handing work to a thread that
    is already running costs microseconds.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(
        self, fn: Callable[[], T], *, inline: bool = False, started: bool = False
    ) -> Future[T]:
        """Run ``fn`` on the worker thread (or now, on this thread, with ``inline``).

        ``fn`` must not communicate. Its result or exception is kept in the returned future.
        With ``started``, return only once the worker runs ``fn``: a job that soon releases
        the GIL (an fsync) then starts at once, instead of waiting up to the interpreter's
        switch interval (5 ms) for a caller that keeps computing.
        """
        if inline:
            done: Future[T] = Future()
            try:
                done.set_result(fn())
            except BaseException as exc:  # kept for the next collective, raised there
                done.set_exception(exc)
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        if not started:
            return self._pool.submit(fn)
        running = threading.Event()

        def signalled() -> T:
            running.set()
            return fn()

        future = self._pool.submit(signalled)
        running.wait()
        return future

    def shutdown(self) -> None:
        """Stop the worker thread once its current job is done."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
