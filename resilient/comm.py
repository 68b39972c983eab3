"""The communicator the core talks to, and the one error-agreement helper.

The core never imports mpi4py. It talks to a :class:`Comm`: :class:`SerialComm` for one
process, :class:`resilient.mpi.MPIComm` for an mpi4py communicator. :func:`as_comm` turns what
the user passed into one.
"""

from __future__ import annotations

import traceback
from typing import Any, Protocol, TypeVar, runtime_checkable

from resilient.errors import CollectiveError, ResilientError

__all__ = ["Comm", "SerialComm", "agree", "as_comm", "describe_error"]

T = TypeVar("T")


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

    def barrier(self) -> None: ...

    def any_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one small allreduce: cheap enough per step)."""
        ...

    def split_node(self) -> Comm:
        """The ranks of this communicator that share a node (shared-memory domain)."""
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

    def barrier(self) -> None:
        return None

    def any_true(self, flag: bool) -> bool:
        return flag

    def split_node(self) -> Comm:
        return self


def as_comm(obj: Any) -> Comm:
    """Wrap ``obj`` (a :class:`Comm`, an mpi4py communicator, or ``None``) as a :class:`Comm`."""
    if obj is None:
        return SerialComm()
    if isinstance(obj, Comm):
        return obj
    if hasattr(obj, "Get_rank") and hasattr(obj, "Ibarrier"):
        from resilient.mpi import MPIComm  # the only place mpi4py objects are adapted

        return MPIComm(obj)
    raise TypeError(
        f"expected an mpi4py communicator or a resilient Comm, got {type(obj).__name__}"
    )


def describe_error(exc: BaseException) -> str:
    """One line for ``exc``: its type and message (last traceback frame for unexpected ones)."""
    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, (ResilientError, OSError)):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            f = frames[-1]
            text += f" (at {f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
    return text


def agree(comm: Comm, what: str, error: BaseException | None) -> None:
    """Collective over ``comm``: raise the same error on every rank if any rank has one.

    If exactly one kind of :class:`ResilientError` was raised (e.g. a layout mismatch seen by
    every rank), that error is re-raised everywhere; otherwise a :class:`CollectiveError`
    naming each failing rank.
    """
    payload: tuple[str, BaseException | None] | None = None
    if error is not None:
        keep = error if isinstance(error, ResilientError) and _picklable(error) else None
        payload = (describe_error(error), keep)
    results = comm.allgather(payload)
    failures = {r: p for r, p in enumerate(results) if p is not None}
    if not failures:
        return
    originals = [p[1] for p in failures.values()]
    if (
        all(o is not None for o in originals)
        and len({(type(o), str(o)) for o in originals}) == 1
        and len(failures) == comm.size
    ):
        first = originals[0]
        assert first is not None
        raise first
    raise CollectiveError(what, {r: p[0] for r, p in failures.items()})


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))  # an in-memory round trip of our own exception
    except Exception:
        return False
    return True
