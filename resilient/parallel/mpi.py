"""Adapter from an mpi4py communicator to :class:`resilient.parallel.comm.Comm`. The sole mpi4py user.

Imports nothing from the rest of the library (:class:`MPIComm` satisfies the ``Comm`` protocol
structurally), so :func:`resilient.parallel.comm.as_comm` can import it lazily without a cycle.

Waiting ranks never spin inside a blocking MPI call: ``barrier``, ``allgather``, ``gather``,
``bcast`` and ``scatter`` first wait in a non-blocking barrier polled with short sleeps, because
a rank waiting there may wait for a slow writer. With MPICH on oversubscribed cores a plain ``Barrier`` made the
writing rank 5-10x slower (ranks spinning steal its core). ``any_true`` (called every step, when
ranks arrive together) is one small allreduce without that barrier, and ``split_node`` is a plain
``Split_type``.
"""

from __future__ import annotations

import os
import time
from typing import Any, TypeVar

__all__ = ["MPIChannel", "MPIComm"]

T = TypeVar("T")

_YIELD_S = 0.001
_SLEEP_MIN_S = 0.0002
# At most 0.5 ms between tests: a rank that arrives last is let through within about that (a
# barrier of 4 ranks takes log2(4) rounds, each moving only while its ranks test). With 2 ms,
# the rounds of a save's commit and of a restore cost 10-25 ms of wake-ups (4 x 128 MiB on 2
# cores: sync save 0.208-0.232 s -> 0.176-0.181 s, restore(into=) 0.182-0.193 -> 0.165-0.171);
# a waiting rank then wakes 2,000 times a second, ~1-2% of a core.
_SLEEP_MAX_S = 0.0005


class MPIComm:
    """A :class:`Comm` over an mpi4py intracommunicator (not duplicated: tags are not used)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._rank = int(comm.Get_rank())
        self._size = int(comm.Get_size())

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def barrier(self) -> None:
        """Collective: a barrier that sleeps instead of spinning."""
        if self._size == 1:
            return
        req = self.comm.Ibarrier()
        # First yield the core for a short while (ranks that arrive together finish in
        # microseconds), then sleep with a growing delay (a rank waiting for a writer).
        start = time.perf_counter()
        while time.perf_counter() - start < _YIELD_S:
            if req.Test():
                return
            os.sched_yield()
        delay = _SLEEP_MIN_S
        while not req.Test():
            time.sleep(delay)
            delay = min(delay * 1.5, _SLEEP_MAX_S)

    def allgather(self, obj: T) -> list[T]:
        self.barrier()
        return list(self.comm.allgather(obj))

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        self.barrier()
        out = self.comm.gather(obj, root=root)
        return None if out is None else list(out)

    def bcast(self, obj: T, root: int = 0) -> T:
        self.barrier()
        result: T = self.comm.bcast(obj, root=root)
        return result

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        self.barrier()
        result: T = self.comm.scatter(objs if self._rank == root else None, root=root)
        return result

    def any_true(self, flag: bool) -> bool:
        """Collective: logical OR of ``flag`` over ranks (one small allreduce, no extra barrier)."""
        from mpi4py import MPI

        return bool(self.comm.allreduce(1 if flag else 0, op=MPI.MAX))

    def split_node(self) -> MPIComm:
        from mpi4py import MPI

        return MPIComm(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank))

    def split(self, color: int) -> MPIComm:
        return MPIComm(self.comm.Split(color, key=self._rank))

    def channel(self) -> MPIChannel:
        """Collective: a :class:`MPIChannel` on a duplicate of this communicator.

        Raises:
            ConfigError: MPI was initialised without ``MPI_THREAD_MULTIPLE`` (mpi4py asks for
                it unless ``mpi4py.rc.thread_level`` says otherwise).
        """
        from mpi4py import MPI

        from resilient.errors import ConfigError

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ConfigError(
                "transfers on a background thread need MPI_THREAD_MULTIPLE, but MPI was "
                "initialised with a lower thread level (mpi4py.rc.thread_level)"
            )
        return MPIChannel(self.comm.Dup())


class MPIChannel:
    """Point-to-point transfers on a duplicated communicator, waited for with short sleeps
    (a background thread spinning in ``MPI_Recv`` would steal the computing thread's core)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def send(self, dest: int, data: bytes | bytearray | memoryview) -> None:
        from mpi4py import MPI

        _wait(self.comm.Isend([data, MPI.BYTE], dest=dest, tag=_TAG), None, *_CHANNEL_POLL)

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        _wait(self.comm.Irecv([into, MPI.BYTE], source=source, tag=_TAG), status, *_CHANNEL_POLL)
        got = status.Get_count(MPI.BYTE)
        if got != len(into):
            raise ValueError(f"expected {len(into)} bytes from rank {source}, got {got}")


_TAG = 7
# A transfer between nodes (MPICH's TCP netmod) moves only while someone tests it: with sleeps
# of up to 2 ms between tests, 8-MiB messages between two nodes of this machine ran at
# 0.36 GB/s; with sleeps of 20-200 us at 2.2 GB/s for 30% of a core (blocking MPI_Send: 3.2
# GB/s, a whole core spinning).
_CHANNEL_POLL = (0.002, 0.00002, 0.0002)


def _wait(
    req: Any,
    status: Any = None,
    yield_s: float = _YIELD_S,
    sleep_min_s: float = _SLEEP_MIN_S,
    sleep_max_s: float = _SLEEP_MAX_S,
) -> None:
    """Wait for ``req``: yield the core for a moment, then sleep between tests."""
    start = time.perf_counter()
    while time.perf_counter() - start < yield_s:
        if req.Test(status):
            return
        os.sched_yield()
    delay = sleep_min_s
    while not req.Test(status):
        time.sleep(delay)
        delay = min(delay * 1.5, sleep_max_s)
