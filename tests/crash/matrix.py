"""Run the crash tests of one operation: record it, build its crash states, check each.

:func:`record` runs the operation (:mod:`tests.crash.ops`) on its ranks with every rank's
calls recorded; :func:`examine` builds the states of each file-system model
(:mod:`tests.crash.states`), checks them (:mod:`tests.crash.check`) on ``workers`` processes,
all of them or a seeded sample, and returns one :class:`Row` of the published matrix per
model (``bench/bench_crash.py`` prints them; ``tests/test_crash.py`` asserts no violation).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.crash.check import Expected, expected, violations
from tests.crash.ops import OPERATIONS, Operation
from tests.crash.record import Call, load_calls, load_snapshot
from tests.crash.states import MODELS, CrashState, crash_states, materialize, replay
from tests.roothealth import REPO, child_env

__all__ = ["PLANTED", "Found", "Row", "examine", "record", "run"]


def record(op: Operation, where: Path, *, timeout: float = 180) -> None:
    """Run ``op`` with its calls recorded into ``where`` (a new directory)."""
    from resilient.job.launch import find_mpiexec

    cmd = [sys.executable, "-m", "tests.crash.ops", op.name, str(where)]
    if op.ranks > 1 or op.hosts:
        launch = [find_mpiexec(), "-n", str(op.ranks)]
        if op.hosts:
            launch += ["-hosts", op.hosts, "-launcher", "fork"]
        cmd = [*launch, *cmd]
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0 or not (where / "done.json").exists():
        raise AssertionError(
            f"operation {op.name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-5000:]}"
        )


@dataclass(frozen=True)
class Found:
    """A state that breaks an invariant."""

    state: CrashState
    where: str  # the state's crash point and what was lost, in words
    problems: tuple[str, ...]


@dataclass
class Row:
    """One line of the matrix: an operation under one model."""

    op: str
    model: str
    calls: int  # the recorded calls (crash points: calls + 1)
    states: int  # distinct states
    tried: int  # checked (all, or the sample)
    found: list[Found] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)
    seconds: float = 0.0


#: Faults planted in a recording, to show that the checks find what they are for (the
#: negative controls of tests/test_crash.py): the calls each drops.
PLANTED: dict[str, Callable[[Call], bool]] = {
    "no data fsync": lambda c: c.op == "fsync" and c.path.endswith(".h5"),
    "no manifest fsync": lambda c: (
        c.op == "fsync" and c.path.endswith(("manifest.json", "COMMITTED"))
    ),
}


def _calls(where: Path, planted: str | None) -> tuple[list[Call], list[str]]:
    calls, unrecorded = load_calls(_logs(where))
    if planted is not None:
        calls = [c for c in calls if not PLANTED[planted](c)]
    return calls, unrecorded


# ------------------------------------------------------------ the worker processes

_work: dict[str, Any] = {}


def _init(where: str, want: Expected, planted: str | None) -> None:
    import logging

    logging.getLogger("resilient").setLevel(logging.ERROR)  # the restarts' repairs, each once
    calls, _ = _calls(Path(where), planted)
    _work.update(
        snap=load_snapshot(Path(where) / "snapshot"),
        calls=calls,
        want=want,
        tmp=Path(tempfile.mkdtemp(prefix="crash-state-")),
    )


def _logs(where: Path) -> list[Path]:
    return sorted(p.with_suffix("") for p in where.glob("log-*.jsonl"))


def _check(state: CrashState) -> tuple[CrashState, list[str]]:
    tree = replay(_work["snap"], _work["calls"], state)
    dest = _work["tmp"] / "base"
    shutil.rmtree(dest, ignore_errors=True)
    materialize(tree, dest)
    try:
        return state, violations(dest, _work["want"])
    except Exception as exc:  # the checker itself: reported as the state's problem
        return state, [f"the checker failed: {type(exc).__name__}: {exc}"]


def examine(
    name: str,
    where: Path,
    *,
    models: Sequence[str] = ("ext4", "xfs"),
    sample: int | None = None,
    seed: int = 0,
    workers: int = 2,
    planted: str | None = None,
) -> list[Row]:
    """Check the crash states of the recorded operation ``name`` in ``where`` (see the
    module): all of them, or ``sample`` of each model's (seeded). ``planted``: a fault of
    :data:`PLANTED` put into the recording first."""
    snap = load_snapshot(where / "snapshot")
    calls, unrecorded = _calls(where, planted)
    scratch = Path(tempfile.mkdtemp(prefix="crash-ends-"))
    try:
        ends = [
            _tree(snap, calls, 0, scratch / "before"),
            _tree(snap, calls, len(calls), scratch / "after"),
        ]
        want = expected(*ends)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for model in models:
        t0 = time.monotonic()
        states = list(crash_states(snap, calls, MODELS[model]))
        tried = states
        if sample is not None and len(states) > sample:
            rng = random.Random(f"{seed}:{name}:{model}")
            tried = rng.sample(states, sample)
        row = Row(name, model, len(calls), len(states), len(tried), unrecorded=unrecorded)
        with ProcessPoolExecutor(
            workers, initializer=_init, initargs=(str(where), want, planted)
        ) as pool:
            for state, problems in pool.map(_check, tried, chunksize=4):
                if problems:
                    row.found.append(Found(state, state.describe(calls), tuple(problems)))
        row.seconds = time.monotonic() - t0
        rows.append(row)
    return rows


def _tree(snap: dict[str, Any], calls: list[Call], point: int, dest: Path) -> Path:
    materialize(replay(snap, calls, CrashState(point, point)), dest)
    return dest


def run(name: str, work: Path, **kw: Any) -> list[Row]:
    """Record the operation ``name`` in ``work/name`` and examine it."""
    where = work / name
    record(OPERATIONS[name], where)
    return examine(name, where, **kw)


if __name__ == "__main__":  # python -m tests.crash.matrix OP [OP...]: a quick look
    os.environ.setdefault("RESILIENT_LOG", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        for op_name in sys.argv[1:] or list(OPERATIONS):
            for r in run(op_name, Path(tmp)):
                print(f"{r.op:18} {r.model:5} calls {r.calls:4} states {r.states:5} "
                      f"tried {r.tried:5} violations {len(r.found):3} {r.seconds:6.1f} s")  # fmt: skip
                for u in r.unrecorded:
                    print(f"    unrecorded: {u}")
                for f in r.found[:5]:
                    print(f"    {f.where}\n        " + "\n        ".join(f.problems))
