"""The communicator the core talks to.

The core never imports mpi4py or torch. It talks to a :class:`Comm`: :class:`SerialComm` for one
process, :class:`resilient.parallel.mpi.MPIComm` for an mpi4py communicator,
:class:`resilient.parallel.torchdist.TorchComm` for a torch.distributed process group. :func:`as_comm`
turns what the user passed into one. How ranks agree on success or failure is :mod:`resilient.parallel.collective`.
"""

from __future__ import annotations

import types
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Channel", "Comm", "SerialComm", "as_comm"]

T = TypeVar("T")


Buffer = bytes | bytearray | memoryview


class Channel(Protocol):
    """Point-to-point transfers of bytes between the ranks of a communicator.

    A channel runs on a duplicate of its communicator, so a background thread may use it while
    the main thread runs collectives (under MPI this needs ``MPI_THREAD_MULTIPLE``). Messages
    from one rank to another arrive in the order sent. A blocked call sleeps, never spins. Not
    collective: each call pairs with one call on the peer.
    """

    def send(self, dest: int, data: Buffer) -> None:
        """Send ``data`` to rank ``dest``; returns once the buffer may be reused."""
        ...

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        """Receive exactly ``len(into)`` bytes from rank ``source`` into ``into``.

        Raises:
            ValueError: the message has another length.
        """
        ...


@runtime_checkable
class Comm(Protocol):
    """What the core needs of a communicator. Every method is collective but ``rank``/``size``.

    Implementations must not busy-wait while some ranks are slow (``barrier``): on
    oversubscribed cores a spinning rank starves the one that writes.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, obj: T) -> list[T]: ...

    def gather(self, obj: T, root: int = 0) -> list[T] | None: ...

    def bcast(self, obj: T, root: int = 0) -> T: ...

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        """Rank ``r`` gets ``objs[r]`` (``objs``: one per rank on ``root``, ignored elsewhere):
        each rank receives only its own object, not all of them."""
        ...

    def barrier(self) -> None: ...

    def any_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one small allreduce: cheap enough per step)."""
        ...

    def split_node(self) -> Comm:
        """The ranks of this communicator that share a node (shared-memory domain)."""
        ...

    def split(self, color: int) -> Comm:
        """The ranks of this communicator that pass the same ``color``, in rank order."""
        ...

    def channel(self) -> Channel:
        """A :class:`Channel` over these ranks for a background thread (collective)."""
        ...


class SerialComm:
    """A communicator of one process (no MPI at all)."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def allgather(self, obj: T) -> list[T]:
        return [obj]

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        return [obj]

    def bcast(self, obj: T, root: int = 0) -> T:
        return obj

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        assert objs is not None and len(objs) == 1
        return objs[0]

    def barrier(self) -> None:
        return None

    def any_true(self, flag: bool) -> bool:
        return flag

    def split_node(self) -> Comm:
        return self

    def split(self, color: int) -> Comm:
        return self

    def channel(self) -> Channel:
        return _NoPeers()


class _NoPeers:
    """The channel of a communicator of one process: there is no one to talk to."""

    def send(self, dest: int, data: Buffer) -> None:
        raise ValueError(f"no rank {dest} in a communicator of one process")

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        raise ValueError(f"no rank {source} in a communicator of one process")


def _is_torch_group(obj: Any) -> bool:
    """Whether ``obj`` is a torch.distributed process group or the ``torch.distributed`` module.

    Decided from names alone: this module never imports torch.
    """
    if isinstance(obj, types.ModuleType):
        return obj.__name__ == "torch.distributed"
    cls = type(obj)
    return cls.__module__.partition(".")[0] == "torch" and cls.__name__.startswith("ProcessGroup")


def as_comm(obj: Any) -> Comm:
    """Wrap ``obj`` as a :class:`Comm`.

    ``obj`` is a :class:`Comm`, an mpi4py communicator, a torch.distributed process group (or
    the ``torch.distributed`` module: its default group), or ``None`` (one process).
    """
    if obj is None:
        return SerialComm()
    if isinstance(obj, Comm):
        return obj
    if _is_torch_group(obj):
        # torchdist.py is the only module that touches torch; imported only when the caller
        # already holds a process group (so torch is loaded and the group initialised).
        from resilient.parallel.torchdist import TorchComm

        return TorchComm(obj)
    if hasattr(obj, "Get_rank") and hasattr(obj, "Ibarrier"):
        # mpi.py is the only module that touches mpi4py; it is imported only when the caller
        # already holds an mpi4py communicator (so mpi4py is loaded and MPI initialised).
        from resilient.parallel.mpi import MPIComm

        return MPIComm(obj)
    raise TypeError(
        "expected an mpi4py communicator, a torch.distributed process group or a resilient Comm, "
        f"got {type(obj).__name__}"
    )
