"""Every exception of resilient.errors survives pickling (they cross MPI and Parsl workers)."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import resilient.errors as errors

ALL = sorted(
    (
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    ),
    key=lambda c: c.__name__,
)

# constructor arguments and the attributes they must set
SAMPLES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "ResilientError": (("something failed",), {}),
    "ConfigError": (("bad setting 'x'",), {}),
    "ForeignRunError": (("the checkpoint directory /scratch/ck belongs to another run",), {}),
    "CheckpointNotFoundError": (("no valid checkpoint in /scratch/ck",), {}),
    "InvalidCheckpointError": (
        ("/scratch/ck/step_00000003", "data file rank_00000.h5 is missing"),
        {"path": "/scratch/ck/step_00000003", "reason": "data file rank_00000.h5 is missing"},
    ),
    "StaticDataError": (
        ("/scratch/ck/static/7b53", "manifest.json does not match its checksum in COMMITTED"),
        {
            "path": "/scratch/ck/static/7b53",
            "reason": "manifest.json does not match its checksum in COMMITTED",
        },
    ),
    "LayoutMismatchError": (
        ("self (4 ranks, 4 files)", "self (8 ranks, 8 files)"),
        {"saved": "self (4 ranks, 4 files)", "current": "self (8 ranks, 8 files)"},
    ),
    "CommitError": (("save of step 3: commit failed: OSError: [Errno 28] no space",), {}),
    "CheckpointLockedError": (("/scratch/ck is in use by another job (pid 12)",), {}),
    "CollectiveError": (
        ("save of step 12", {3: "OSError: [Errno 28] No space left on device", 1: "boom"}),
        {
            "what": "save of step 12",
            "failures": {3: "OSError: [Errno 28] No space left on device", 1: "boom"},
        },
    ),
}


def test_every_class_has_a_sample() -> None:
    names = {c.__name__ for c in ALL}
    assert names == set(SAMPLES)
    assert names | {"RankFailure"} == set(errors.__all__)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip(cls: type[BaseException], protocol: int) -> None:
    args, attrs = SAMPLES[cls.__name__]
    exc = cls(*args)
    copy = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert type(copy) is cls
    assert str(copy) == str(exc)
    assert copy.args == exc.args
    for name, value in attrs.items():
        assert getattr(copy, name) == value
    assert vars(copy) == vars(exc)
    assert issubclass(cls, errors.ResilientError)


def test_str_of_the_structured_errors() -> None:
    e = errors.InvalidCheckpointError("/r/step_00000001", "no COMMITTED marker")
    assert str(e) == "invalid checkpoint /r/step_00000001: no COMMITTED marker"
    c = errors.CollectiveError("save of step 12", {3: "late", 1: "first"})
    assert str(c) == "save of step 12 failed on rank(s) [1, 3]: first"
    n = errors.CheckpointNotFoundError("none here")
    assert str(n) == "none here"
    lm = errors.LayoutMismatchError("a", "b")
    assert str(lm).startswith("checkpoint layout a does not match this run's layout b")


def test_collective_error_copies_failures() -> None:
    failures = {0: "x"}
    e = errors.CollectiveError("op", failures)
    failures[1] = "y"
    assert e.failures == {0: "x"}


def test_builtin_bases() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.CheckpointNotFoundError, FileNotFoundError)


def test_collective_error_keeps_errno_per_rank_through_pickle() -> None:
    e = errors.CollectiveError(
        "save of step 3", {2: errors.RankFailure(2, "OSError: no space", errno=28), 0: "x"}
    )
    copy = pickle.loads(pickle.dumps(e))
    assert copy.details[2].errno == 28 and copy.details[0].errno is None
    assert copy.failures == {2: "OSError: no space", 0: "x"}


def test_commit_error_keeps_errno_through_pickle() -> None:
    copy = pickle.loads(pickle.dumps(errors.CommitError("commit failed", 28)))
    assert copy.errno == 28 and str(copy) == "commit failed"
