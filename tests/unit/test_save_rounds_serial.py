"""The collective operations of a save, counted on one process (a counting SerialComm): the
script of tests/test_save_rounds.py without MPI, so that a round added to the save shows in
the unit tests already."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from resilient import CheckpointManager, KeepLast
from resilient.parallel.comm import SerialComm

T = TypeVar("T")


class CountingComm(SerialComm):
    """A communicator of one process that counts its collective calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def allgather(self, obj: T) -> list[T]:
        self.calls.append("allgather")
        return super().allgather(obj)

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        self.calls.append("gather")
        return super().gather(obj, root)

    def bcast(self, obj: T, root: int = 0) -> T:
        self.calls.append("bcast")
        return super().bcast(obj, root)

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        self.calls.append("scatter")
        return super().scatter(objs, root)

    def barrier(self) -> None:
        self.calls.append("barrier")

    def any_true(self, flag: bool) -> bool:
        self.calls.append("any_true")
        return flag


def state(step: int) -> dict[str, Any]:
    return {"u": np.full(1000, float(step)), "v": np.arange(10), "n": step}


@pytest.mark.parametrize("kind", ["self", "world"])
@pytest.mark.parametrize("local", [False, True])
def test_a_save_of_an_unchanged_structure_takes_three_operations(
    tmp_path: Path, kind: str, local: bool
) -> None:
    comm = CountingComm()
    tier = {"local_dir": str(tmp_path / "local"), "flush_every": 1000} if local else {}
    per_save = []
    with CheckpointManager(
        tmp_path / "ck",
        comm=comm,
        checkpoint_comm=kind,
        keep=KeepLast(2),
        **tier,  # type: ignore[arg-type]
    ) as mgr:
        for step in range(1, 5):
            del comm.calls[:]
            mgr.save(step, state(step), static={"mesh": np.ones(3)})
            per_save.append(list(comm.calls))
    assert all(len(calls) <= 3 for calls in per_save[1:]), per_save
    expected = ["allgather"] * 3 if local else ["allgather", "gather", "bcast"]
    assert per_save[1:] == [expected] * 3
