"""The one way ranks agree: every step either succeeds on all ranks or raises the same error on all.

Every collective of the manager and the writer goes through :class:`Collective` (DCP's
``_DistWrapper``). A step is written as plain functions; the helper catches *any* exception a
rank raises (not only this library's), turns it into data (:class:`~resilient.errors.RankFailure`:
rank, message, errno), moves that data with the same collectives the success path uses, and
raises one error on every rank. So no rank ever waits for a peer that has left on an exception.

Four shapes cover the library:

* :meth:`Collective.broadcast` -- the coordinator (rank 0) runs ``fn``; every rank gets its
  result or the same exception ("rank 0 creates the temporary directory").
* :meth:`Collective.scatter` -- the coordinator runs ``fn``, which returns one value per rank;
  every rank gets its own value (and only it) or the same exception ("rank 0 sends each rank
  its part of the manifest").
* :meth:`Collective.check` -- every rank runs ``fn``; everyone learns who failed ("every rank
  checks its input").
* :meth:`Collective.all_reduce` -- every rank runs ``local``; the coordinator combines the
  results; everyone gets the combination or the same exception ("every rank writes its bytes,
  rank 0 commits").

Which error is raised: the coordinator's own :class:`~resilient.errors.ResilientError` as it is
(e.g. :class:`~resilient.errors.CheckpointNotFoundError`), the same resilient error when every
rank raised it (e.g. a :class:`~resilient.errors.LayoutMismatchError` seen by all), and a
:class:`~resilient.errors.CollectiveError` naming each failing rank otherwise.
"""

from __future__ import annotations

import functools
import pickle
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from resilient.errors import CollectiveError, RankFailure, ResilientError

if TYPE_CHECKING:
    from resilient.parallel.comm import Comm

__all__ = ["Collective", "describe_error", "failure_of"]

T = TypeVar("T")
R = TypeVar("R")

# What travels for a failed rank: the failure as data, plus the exception itself when it is one of
# ours (so that the same type can be raised everywhere).
_Payload = tuple[RankFailure, ResilientError | None]


def describe_error(exc: BaseException) -> str:
    """One line for ``exc``: its type and message (last traceback frame for unexpected ones)."""
    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, (ResilientError, OSError)):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            f = frames[-1]
            text += f" (at {f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
    return text


def failure_of(exc: BaseException, rank: int) -> RankFailure:
    """``exc`` as data: its rank, one line of text, and its errno if it carries one."""
    code = getattr(exc, "errno", None)
    return RankFailure(rank, describe_error(exc), code if isinstance(code, int) else None)


def _payload(exc: BaseException, rank: int) -> _Payload:
    own = exc if isinstance(exc, ResilientError) and _picklable(exc) else None
    return failure_of(exc, rank), own


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))  # an in-memory round trip of our own exception
    except Exception:
        return False
    return True


def _raise(what: str, payloads: Sequence[_Payload], required: int) -> None:
    """Raise the one error every rank raises for these failures (see the module docstring).

    The resilient error itself is raised when ``required`` ranks (or more) all raised it.
    """
    owns = [own for _, own in payloads]
    if (
        len(payloads) >= required
        and all(o is not None for o in owns)
        and len({(type(o), str(o)) for o in owns}) == 1
    ):
        first = owns[0]
        assert first is not None
        raise first
    raise CollectiveError(what, {f.rank: f for f, _ in payloads})


class Collective:
    """Steps over a communicator that succeed on every rank or raise the same error on every rank.

    Args:
        comm: the ranks taking part; its rank 0 is the coordinator.
    """

    __slots__ = ("comm",)

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_coordinator(self) -> bool:
        return self.comm.rank == 0

    def broadcast(self, what: str, fn: Callable[[], T]) -> T:
        """Collective over ``comm``: call on all ranks. The coordinator runs ``fn``.

        Returns:
            ``fn``'s result, on every rank.

        Raises:
            ResilientError: the coordinator's own resilient error, on every rank.
            CollectiveError: for any other exception of ``fn`` (naming rank 0), on every rank.
        """
        reply: tuple[bool, T | _Payload | None] = (True, None)
        if self.is_coordinator:
            try:
                reply = (True, fn())
            except Exception as exc:
                reply = (False, _payload(exc, self.rank))
        ok, value = self.comm.bcast(reply, root=0)
        if not ok:
            assert isinstance(value, tuple)
            _raise(what, [value], 1)
        return value  # type: ignore[return-value]

    def scatter(self, what: str, fn: Callable[[], Sequence[T]]) -> T:
        """Collective over ``comm``: call on all ranks. The coordinator runs ``fn``, which
        returns one value per rank (rank order); each rank receives only its own.

        Returns:
            This rank's value of ``fn``'s result, on every rank.

        Raises:
            ResilientError: the coordinator's own resilient error, on every rank.
            CollectiveError: for any other exception of ``fn`` (naming rank 0), or a result
                that is not one value per rank, on every rank.
        """
        replies: list[tuple[bool, T | _Payload]] | None = None
        if self.is_coordinator:
            try:
                values = fn()
                if len(values) != self.comm.size:
                    raise ValueError(f"{len(values)} values for {self.comm.size} ranks")
                replies = [(True, v) for v in values]
            except Exception as exc:
                replies = [(False, _payload(exc, self.rank))] * self.comm.size
        ok, value = self.comm.scatter(replies, root=0)
        if not ok:
            assert isinstance(value, tuple)
            _raise(what, [value], 1)
        return value  # type: ignore[return-value]

    def exchange(
        self, what: str, local: Callable[[], T], answer: Callable[[list[T]], Sequence[R]]
    ) -> R:
        """Collective over ``comm``: call on all ranks. Every rank runs ``local``; the
        coordinator runs ``answer`` on the results of all ranks (in rank order), which returns
        one value per rank; each rank receives only its own. Two operations (a gather and a
        scatter), where :meth:`check` then :meth:`scatter` would take three.

        ``answer`` runs only when every ``local`` succeeded.

        Returns:
            This rank's value of ``answer``'s result, on every rank.

        Raises:
            ResilientError: the same error on every rank if any ``local`` or ``answer`` raised
                (or ``answer`` did not return one value per rank).
        """
        gathered = self.comm.gather(self._outcome(local), root=0)
        replies: list[tuple[str, Any]] | None = None
        if self.is_coordinator:
            assert gathered is not None
            status, values = self._decide(gathered, functools.partial(self._per_rank, answer))
            replies = (
                [(status, v) for v in values]
                if status == "ok"
                else [(status, values)] * self.comm.size
            )
        status, value = self.comm.scatter(replies, root=0)
        return self._settle(what, status, value)  # type: ignore[no-any-return]

    def _per_rank(self, answer: Callable[[list[T]], Sequence[R]], results: list[T]) -> Sequence[R]:
        values = answer(results)
        if len(values) != self.comm.size:
            raise ValueError(f"{len(values)} values for {self.comm.size} ranks")
        return values

    def check(self, what: str, fn: Callable[[], T]) -> T:
        """Collective over ``comm``: call on all ranks. Every rank runs ``fn``.

        Returns:
            This rank's result of ``fn``, once every rank has succeeded.

        Raises:
            ResilientError: the same error on every rank if any rank's ``fn`` raised.
        """
        result: T | None = None
        payload: _Payload | None = None
        try:
            result = fn()
        except Exception as exc:
            payload = _payload(exc, self.rank)
        failed = [p for p in self.comm.allgather(payload) if p is not None]
        if failed:
            _raise(what, failed, self.comm.size)
        return result  # type: ignore[return-value]

    @overload
    def all_reduce(
        self,
        what: str,
        local: Callable[[], T],
        combine: Callable[[list[T]], R],
        *,
        everywhere: Literal[True] = ...,
    ) -> R: ...

    @overload
    def all_reduce(
        self,
        what: str,
        local: Callable[[], T],
        combine: Callable[[list[T]], R],
        *,
        everywhere: bool,
    ) -> R | None: ...

    def all_reduce(
        self,
        what: str,
        local: Callable[[], T],
        combine: Callable[[list[T]], R],
        *,
        everywhere: bool = True,
    ) -> R | None:
        """Collective over ``comm``: call on all ranks. Every rank runs ``local``; then the
        coordinator runs ``combine`` on the results of all ranks (in rank order).

        ``combine`` runs only when every ``local`` succeeded.

        Returns:
            ``combine``'s result, on every rank; with ``everywhere=False`` on the coordinator
            only (the others get ``None``: a large result is not sent to every rank).

        Raises:
            ResilientError: the same error on every rank if any ``local`` or ``combine`` raised.
        """
        gathered = self.comm.gather(self._outcome(local), root=0)
        reply: tuple[str, Any] = ("ok", None)  # ("ok", result) or (who failed, payloads)
        if self.is_coordinator:
            assert gathered is not None
            reply = self._decide(gathered, combine)
        kept = reply[1]
        if not everywhere and reply[0] == "ok":
            reply = ("ok", None)
        status, value = self.comm.bcast(reply, root=0)
        value = self._settle(what, status, value)
        result: R | None = kept if self.is_coordinator else value
        return result

    def _outcome(self, fn: Callable[[], T]) -> tuple[bool, T | _Payload]:
        """``fn``'s result, or its failure as data, to send to the coordinator."""
        try:
            return True, fn()
        except Exception as exc:
            return False, _payload(exc, self.rank)

    def _decide(
        self, gathered: list[tuple[bool, Any]], combine: Callable[[list[Any]], Any]
    ) -> tuple[str, Any]:
        """Coordinator: ``("ok", combine(results))``, or who failed (``"local"``: ranks'
        payloads; ``"combine"``: the coordinator's own)."""
        failed = [v for ok, v in gathered if not ok]
        if failed:
            return "local", failed
        try:
            return "ok", combine([v for _, v in gathered])
        except Exception as exc:
            return "combine", [_payload(exc, self.rank)]

    def _settle(self, what: str, status: str, value: Any) -> Any:
        """``value``, or the error every rank raises for the failures it carries."""
        if status == "local":
            _raise(what, value, self.comm.size)
        if status == "combine":
            _raise(what, value, 1)
        return value
