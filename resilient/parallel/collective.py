"""The one way ranks agree: every step either succeeds on all ranks or raises the same error on all.

Every collective of the manager and the writer goes through :class:`Collective` (DCP's
``_DistWrapper``). A step is written as plain functions; the helper catches *any* exception a
rank raises (not only this library's), turns it into data (:class:`~resilient.errors.RankFailure`:
rank, message, errno), moves that data with the same collectives the success path uses, and
raises one error on every rank. So no rank ever waits for a peer that has left on an exception.

Values, not callbacks: a step's own work stays in the caller, between these operations.

* :meth:`Collective.share` -- every rank passes its value (or its exception); every rank gets
  every value, or the same error ("every rank says it is ready to write").
* :meth:`Collective.gather` then :meth:`Collective.announce` -- every rank passes its value (or
  its exception) to the coordinator, which does its work with them (or with the error of
  :meth:`Gathered.values`) and announces the outcome; every rank gets it or the same error
  ("every rank writes its bytes, rank 0 commits").
* :meth:`Collective.gather` then :meth:`Collective.deal` -- the same, but the coordinator
  answers each rank its own value ("every rank's blocks up, its part of a checkpoint down").
* :meth:`Collective.broadcast` -- the coordinator (rank 0) runs ``fn``; every rank gets its
  result or the same exception ("rank 0 creates the temporary directory").
* :meth:`Collective.scatter` -- the coordinator runs ``fn``, which returns one value per rank;
  every rank gets its own value (and only it) or the same exception ("rank 0 sends each rank
  its part of the manifest").
* :meth:`Collective.check` -- every rank runs ``fn``; everyone learns who failed ("every rank
  checks its input").

Which error is raised: the coordinator's own :class:`~resilient.errors.ResilientError` as it is
(e.g. :class:`~resilient.errors.CheckpointNotFoundError`), the same resilient error when every
rank raised it (e.g. a :class:`~resilient.errors.LayoutMismatchError` seen by all), and a
:class:`~resilient.errors.CollectiveError` naming each failing rank otherwise.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from resilient.errors import CollectiveError, RankFailure, ResilientError

if TYPE_CHECKING:
    from resilient.parallel.comm import Comm

__all__ = ["Collective", "Gathered", "describe_error", "failure_of"]

T = TypeVar("T")

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
        name: the rank a failure of this rank names (default: its rank in ``comm``; e.g. its
            rank in the world for a collective over a manifest shard, whose failures its
            leader forwards: see :meth:`gather`).
    """

    __slots__ = ("_name", "comm")

    def __init__(self, comm: Comm, *, name: int | None = None) -> None:
        self.comm = comm
        self._name = name

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_coordinator(self) -> bool:
        return self.comm.rank == 0

    @property
    def name(self) -> int:
        """The rank this rank's failures name."""
        return self.comm.rank if self._name is None else self._name

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
                reply = (False, _payload(exc, self.name))
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
                replies = [(False, _payload(exc, self.name))] * self.comm.size
        ok, value = self.comm.scatter(replies, root=0)
        if not ok:
            assert isinstance(value, tuple)
            _raise(what, [value], 1)
        return value  # type: ignore[return-value]

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
            payload = _payload(exc, self.name)
        failed = [p for p in self.comm.allgather(payload) if p is not None]
        if failed:
            _raise(what, failed, self.comm.size)
        return result  # type: ignore[return-value]

    def share(self, what: str, value: T | Exception) -> list[T]:
        """Collective over ``comm`` (one allgather): call on all ranks, each with its value or
        the exception that kept it from making one.

        Returns:
            Every rank's value (in rank order), on every rank.

        Raises:
            ResilientError: the same error on every rank if any rank passed an exception.
        """
        mine = _payload(value, self.name) if isinstance(value, Exception) else None
        sent = self.comm.allgather((mine, None if mine is not None else value))
        failed = [p for p, _ in sent if p is not None]
        if failed:
            _raise(what, failed, self.comm.size)
        return [v for _, v in sent]  # type: ignore[misc]

    def gather(self, value: T | Exception) -> Gathered[T] | None:
        """Collective over ``comm`` (one gather): call on all ranks, each with its value or the
        exception that kept it from making one. Raises nothing: the coordinator must then
        :meth:`announce` what it made of them (another rank's error included).

        The exception :meth:`Gathered.values` raised on the coordinator of another gather
        (e.g. a manifest shard's leader) travels as the failures it carries, which this
        gather's coordinator then announces as if its own ranks' (a two-level gather).

        Returns:
            On the coordinator, what every rank sent; ``None`` on the other ranks.
        """
        mine: tuple[bool, Any]
        if isinstance(value, _RanksFailed):
            mine = (False, list(value.payloads))  # forwarded: the failures of other ranks
        elif isinstance(value, Exception):
            mine = (False, _payload(value, self.name))
        else:
            mine = (True, value)
        gathered = self.comm.gather(mine, root=0)
        return None if gathered is None else Gathered(tuple(gathered))

    def announce(self, what: str, answer: T | Exception | None, *, everywhere: bool = True) -> T:
        """Collective over ``comm`` (one broadcast): call on all ranks. The coordinator passes
        its answer (what it made of :meth:`gather`'s values) or the exception that kept it from
        making one (:meth:`Gathered.values`'s included); the other ranks pass ``None``.

        Returns:
            The coordinator's answer, on every rank; with ``everywhere=False`` on the
            coordinator only (the others get ``None``: a large answer is not sent to every rank).

        Raises:
            ResilientError: the same error on every rank: the ranks' errors that
                :meth:`Gathered.values` raised, or the coordinator's own.
        """
        reply: tuple[str, Any] = ("ok", None)  # ("ok", answer) or (who failed, payloads)
        if self.is_coordinator:
            if isinstance(answer, _RanksFailed):
                reply = ("local", answer.payloads)
            elif isinstance(answer, Exception):
                reply = ("combine", [_payload(answer, self.name)])
            else:
                reply = ("ok", answer if everywhere else None)
        status, value = self.comm.bcast(reply, root=0)
        self._settle(what, status, value)
        return answer if self.is_coordinator else value  # type: ignore[return-value]

    def deal(self, what: str, answers: Sequence[T] | Exception | None) -> T:
        """Collective over ``comm`` (one scatter): call on all ranks. The coordinator passes
        one answer per rank (rank order; what it made of :meth:`gather`'s values) or the
        exception that kept it from making them (:meth:`Gathered.values`'s included); the other
        ranks pass ``None``. Each rank receives only its own answer.

        Returns:
            This rank's answer, on every rank.

        Raises:
            ResilientError: the same error on every rank: the ranks' errors that
                :meth:`Gathered.values` raised, the coordinator's own, or answers that are not
                one per rank.
        """
        replies: list[tuple[str, Any]] | None = None
        if self.is_coordinator:
            size = self.comm.size
            if isinstance(answers, _RanksFailed):
                replies = [("local", answers.payloads)] * size
            elif isinstance(answers, Exception):
                replies = [("combine", [_payload(answers, self.name)])] * size
            elif answers is None or len(answers) != size:
                wrong = ValueError(
                    f"{0 if answers is None else len(answers)} values for {size} ranks"
                )
                replies = [("combine", [_payload(wrong, self.name)])] * size
            else:
                replies = [("ok", v) for v in answers]
        status, value = self.comm.scatter(replies, root=0)
        return self._settle(what, status, value)  # type: ignore[no-any-return]

    def _settle(self, what: str, status: str, value: Any) -> Any:
        """``value``, or the error every rank raises for the failures it carries."""
        if status == "local":
            _raise(what, value, self.comm.size)
        if status == "combine":
            _raise(what, value, 1)
        return value


class Gathered(Generic[T]):
    """The coordinator's view of a :meth:`Collective.gather`: every rank's value or failure."""

    __slots__ = ("_sent",)

    def __init__(self, sent: tuple[tuple[bool, Any], ...]) -> None:
        self._sent = sent

    def values(self) -> list[T]:
        """Every rank's value, in rank order.

        Raises:
            Exception: some rank sent an exception (pass it to :meth:`Collective.announce`).
        """
        failed = [p for ok, v in self._sent if not ok for p in (v if isinstance(v, list) else [v])]
        if failed:
            raise _RanksFailed(failed)
        return [v for _, v in self._sent]


class _RanksFailed(Exception):
    """Some ranks' exceptions, as :meth:`Gathered.values` raises them for
    :meth:`Collective.announce`."""

    def __init__(self, payloads: list[_Payload]) -> None:
        super().__init__(f"{len(payloads)} ranks failed")
        self.payloads = payloads
