"""The contract of :class:`resilient.parallel.collective.Collective` on several ranks, without MPI: any
exception on any rank becomes the same error on every rank, and no rank is left waiting.

The ranks are threads of this process over :class:`ThreadComm`, an in-memory communicator
(pure logic: the real MPI and torch communicators are tested under ``mpiexec`` in
tests/test_mpi_core.py and tests/test_torchdist.py). Every collective of ``ThreadComm`` waits
at a barrier with a timeout, so a rank that skipped a collective fails the test instead of
hanging it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from resilient.errors import CheckpointNotFoundError, CollectiveError, ConfigError
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Channel, Comm

T = TypeVar("T")
SIZES = (1, 2, 3, 5)
TIMEOUT_S = 10.0


class _World:
    """What the ranks of one ThreadComm share: a barrier and one slot per rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list[Any] = [None] * size


class ThreadComm:
    """Rank ``rank`` of ``world``: every collective is two barrier waits around the slots."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self._rank = world, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.world.size

    def _round(self, mine: Any, read: Callable[[list[Any]], T]) -> T:
        self.world.barrier.wait()  # (the previous round's reads are done)
        self.world.slots[self._rank] = mine
        self.world.barrier.wait()
        out = read(list(self.world.slots))
        self.world.barrier.wait()  # (every rank read before the next round writes)
        return out

    def allgather(self, obj: T) -> list[T]:
        return self._round(obj, lambda slots: slots)

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        return self._round(obj, lambda slots: slots if self._rank == root else None)

    def bcast(self, obj: T, root: int = 0) -> T:
        out: T = self._round(obj, lambda slots: slots[root])
        return out

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        out: T = self._round(objs, lambda slots: slots[root][self._rank])
        return out

    def barrier(self) -> None:
        self._round(None, lambda slots: None)

    def any_true(self, flag: bool) -> bool:
        return self._round(flag, any)

    def split_node(self) -> Comm:
        raise NotImplementedError

    def split(self, color: int) -> Comm:
        raise NotImplementedError

    def channel(self) -> Channel:
        raise NotImplementedError


def on_ranks(size: int, body: Callable[[Collective], Any]) -> list[tuple[str, Any]]:
    """Run ``body`` on ``size`` thread ranks; each rank's ``("ok", value)`` or ``("raised",
    exception)``. A rank still running after the timeout fails the test (a hang)."""
    world = _World(size)
    out: list[tuple[str, Any]] = [("missing", None)] * size

    def run(rank: int) -> None:
        try:
            out[rank] = ("ok", body(Collective(ThreadComm(world, rank))))
        except BaseException as exc:  # (the outcome is what is tested)
            out[rank] = ("raised", exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return out


def same_error_everywhere(outcomes: list[tuple[str, Any]]) -> BaseException:
    """The one error every rank raised (asserting that they all raised it)."""
    assert all(kind == "raised" for kind, _ in outcomes), outcomes
    errors: list[BaseException] = [exc for _, exc in outcomes]
    assert not any(isinstance(e, threading.BrokenBarrierError) for e in errors), errors
    assert len({(type(e), str(e)) for e in errors}) == 1, errors
    return errors[0]


class Unpicklable(Exception):
    """An exception of the user's that cannot travel as it is."""

    def __init__(self) -> None:
        super().__init__("with a lock inside")
        self.lock = threading.Lock()


def failing_sets(size: int) -> list[tuple[int, ...]]:
    """Every non-empty set of failing ranks (all of them for small sizes)."""
    ranks = range(size)
    return [c for k in range(1, size + 1) for c in itertools.combinations(ranks, k)]


@pytest.mark.parametrize("size", SIZES)
def test_every_shape_succeeds_on_every_rank(size: int) -> None:
    def body(coll: Collective) -> Any:
        r = coll.rank
        return (
            coll.broadcast("b", lambda: "from 0"),
            coll.scatter("s", lambda: [f"to {k}" for k in range(size)]),
            coll.check("c", lambda: r * 2),
            announced(coll, "a", lambda: r, total),
            announced(coll, "k", lambda: r, total, everywhere=False),
            exchanged(coll, "x", lambda: r, lambda got: [g + 100 for g in got]),
            coll.share("h", r * 3),
            announced(coll, "n", lambda: r, total),
        )

    outcomes = on_ranks(size, body)
    everyone = sum(range(size))
    for r, (kind, value) in enumerate(outcomes):
        assert kind == "ok", value
        assert value == (
            "from 0",
            f"to {r}",
            r * 2,
            everyone,
            everyone if r == 0 else None,
            r + 100,
            [k * 3 for k in range(size)],
            everyone,
        )


@pytest.mark.parametrize("size", SIZES)
def test_any_rank_failing_a_local_step_is_one_error_everywhere(size: int) -> None:
    """check, share, gather then announce (kept or not), and gather then deal: whichever ranks
    raise, whatever they raise (a ResilientError, an OSError with errno, an exception that
    cannot be pickled), every rank
    raises the same error, naming every failing rank; the next collective still works."""
    errors: list[Callable[[], BaseException]] = [
        lambda: ValueError("bad value"),
        lambda: OSError(28, "No space left on device"),
        Unpicklable,
        lambda: ConfigError("a wrong setting"),
    ]
    shapes: list[Callable[[Collective, Callable[[], Any]], Any]] = [
        lambda coll, local: coll.check("checking", local),
        lambda coll, local: announced(coll, "keeping", local, len, everywhere=False),
        lambda coll, local: exchanged(coll, "exchanging", local, lambda got: list(got)),
        lambda coll, local: coll.share("sharing", outcome(local)),
        lambda coll, local: announced(coll, "announcing", local, len),
    ]
    for failing, make, shape in itertools.product(failing_sets(size), errors, shapes):

        def body(
            coll: Collective,
            failing: tuple[int, ...] = failing,
            make: Callable[[], BaseException] = make,
            shape: Callable[[Collective, Callable[[], Any]], Any] = shape,
        ) -> Any:
            def local() -> int:
                if coll.rank in failing:
                    raise make()
                return coll.rank

            try:
                shape(coll, local)
            finally:
                after = announced(coll, "after", lambda: 1, total)  # nobody left behind
                assert after == size
            return None

        err = same_error_everywhere(on_ranks(size, body))
        if isinstance(err, CollectiveError):
            assert sorted(err.failures) == list(failing)
        else:  # every rank raised the same resilient error: that error itself
            assert isinstance(err, ConfigError) and len(failing) == size


@pytest.mark.parametrize("size", SIZES)
def test_a_coordinator_step_failing_is_one_error_everywhere(size: int) -> None:
    """broadcast, scatter and the coordinator's work after a gather raise on the coordinator
    only (or return the wrong number of parts): every rank raises the same error. The
    coordinator's own ResilientError is raised as it is."""
    cases: list[tuple[Callable[[Collective], Any], type[BaseException]]] = [
        (lambda c: c.broadcast("b", _raises(KeyError("k"))), CollectiveError),
        (
            lambda c: c.broadcast("b", _raises(CheckpointNotFoundError("none"))),
            CheckpointNotFoundError,
        ),
        (lambda c: c.scatter("s", _raises(Unpicklable())), CollectiveError),
        (lambda c: c.scatter("s", lambda: ["too few"] * (size + 1)), CollectiveError),
        (
            lambda c: announced(c, "k", lambda: 1, _raises(ValueError("kept")), everywhere=False),
            CollectiveError,
        ),
        (lambda c: exchanged(c, "x", lambda: 1, lambda got: [0] * (len(got) - 1)), CollectiveError),
        (lambda c: exchanged(c, "x", lambda: 1, _raises(KeyError("k"))), CollectiveError),
        (lambda c: announced(c, "n", lambda: 1, _raises(RuntimeError("commit"))), CollectiveError),
        (
            lambda c: announced(c, "n", lambda: 1, _raises(CheckpointNotFoundError("none"))),
            CheckpointNotFoundError,
        ),
    ]
    for step, expected in cases:
        err = same_error_everywhere(on_ranks(size, step))
        assert type(err) is expected, err


def total(values: list[int]) -> int:
    return sum(values)


def outcome(local: Callable[[], Any]) -> Any:
    """``local()``, or the exception it raised (what a rank passes to a value collective)."""
    try:
        return local()
    except Exception as exc:
        return exc


def announced(
    coll: Collective,
    what: str,
    local: Callable[[], Any],
    work: Callable[[list[Any]], Any],
    *,
    everywhere: bool = True,
) -> Any:
    """Every rank's value to the coordinator, its work on them announced to every rank (with
    ``everywhere=False`` kept by the coordinator)."""
    gathered = coll.gather(outcome(local))
    answer = None
    if gathered is not None:
        answer = outcome(lambda: work(gathered.values()))
    return coll.announce(what, answer, everywhere=everywhere)


def exchanged(
    coll: Collective, what: str, local: Callable[[], Any], answer: Callable[[list[Any]], Any]
) -> Any:
    """Every rank's value to the coordinator, which deals each rank its own answer."""
    gathered = coll.gather(outcome(local))
    answers = None
    if gathered is not None:
        answers = outcome(lambda: answer(gathered.values()))
    return coll.deal(what, answers)


def _raises(exc: BaseException) -> Callable[..., Any]:
    def fn(*_: Any) -> Any:
        raise exc

    return fn
