"""Fault injection into every coordinator-only step; run under ``mpiexec -n N``.

Usage: python tests/mpi/faults.py BASE KIND

For every coordinator-only step in :data:`STEPS`, in a fresh root under BASE: rank 0 (the
coordinator) raises an arbitrary exception (a ``KeyError`` subclass, not one of resilient's)
inside that step. Every rank must then raise the same error (type and message) from the same
call, and none may wait: afterwards all ranks still meet in an allgather. Each rank prints one
``RESULT <json>`` per step with the error it saw.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import resilient.checkpoint.manager
import resilient.checkpoint.restorer
import resilient.checkpoint.saveset
import resilient.io.fileio
import resilient.io.logs
import resilient.io.storage
from resilient import CheckpointManager, EverySteps, KeepLast
from resilient.checkpoint.catalog import Catalog
from resilient.checkpoint.restorer import Restorer
from resilient.checkpoint.statics import StaticStore
from resilient.io.commit import PendingDir

world = MPI.COMM_WORLD
rank = world.rank


class Injected(KeyError):
    """The injected fault: an exception type the library knows nothing about."""


_undo: list[tuple[Any, str, Any]] = []


def _patch(owner: Any, name: str) -> None:
    """On rank 0 only, make ``owner.name`` raise :class:`Injected`."""
    if rank != 0:
        return

    def fail(*_: Any, **__: Any) -> Any:
        raise Injected(f"injected fault in {owner.__name__}.{name}")

    _undo.append((owner, name, owner.__dict__[name]))
    setattr(owner, name, fail)


def _unpatch() -> None:
    while _undo:
        owner, name, original = _undo.pop()
        setattr(owner, name, original)


def _state(step: int) -> dict[str, Any]:
    return {"u": np.full(1000 + rank, float(step)), "n": step}


def _static() -> dict[str, Any]:
    return {"mesh": np.arange(10.0 + rank)}


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(root, comm=world, checkpoint_comm=KIND, keep=KeepLast(1))


# STEP -> (patch it, the call that must fail everywhere)
def _open(root: Path) -> None:
    _manager(root).close()


def _latest(root: Path) -> None:
    with _manager(root) as m:
        m.latest_step()


def _save(root: Path) -> None:
    with _manager(root) as m:
        m.save(3, _state(3), static=_static())


def _save_new_static(root: Path) -> None:
    with _manager(root) as m:
        m.save(3, _state(3), static={"mesh": np.zeros(3 + rank)})


def _should_save(root: Path) -> None:
    with CheckpointManager(root, comm=world, checkpoint_comm=KIND, save_when=EverySteps(1)) as m:
        m.should_save(3)


def _restore(root: Path) -> None:
    with _manager(root) as m:
        m.restore()


STEPS: dict[str, tuple[Callable[[], None], Callable[[Path], None]]] = {
    "ensure-root": (lambda: _patch(resilient.io.storage, "ensure_root"), _open),
    "lock": (lambda: _patch(resilient.io.storage.RootLock, "acquire"), _open),
    "leftovers": (lambda: _patch(resilient.io.storage, "cleanup_leftovers"), _open),
    "latest": (lambda: _patch(resilient.checkpoint.manager, "latest_valid"), _latest),
    "save-decision": (lambda: _patch(CheckpointManager, "save_context"), _should_save),
    "static-lookup": (lambda: _patch(StaticStore, "is_stored"), _save),
    "static-tmpdir": (lambda: _patch(PendingDir, "create"), _save_new_static),
    "tmpdir": (lambda: _patch(PendingDir, "create"), _save),
    "create-file": (lambda: _patch(resilient.io.fileio, "create_file"), _save),
    "build-skeleton": (lambda: _patch(resilient.io.fileio, "build_skeleton"), _save),
    "manifest": (lambda: _patch(resilient.checkpoint.saveset, "build_manifest"), _save),
    "commit-prepare": (lambda: _patch(PendingDir, "prepare"), _save),
    "commit-publish": (lambda: _patch(PendingDir, "publish"), _save),
    "save-log": (lambda: _patch(resilient.io.logs, "append_record"), _save),
    "rotation": (lambda: _patch(Catalog, "apply"), _save),
    "choose": (lambda: _patch(resilient.checkpoint.restorer, "iter_checkpoints"), _restore),
    "judge": (lambda: _patch(Restorer, "_judge"), _restore),
}


def main() -> None:
    (base,) = map(Path, sys.argv[1:2])
    for step, (patch, call) in STEPS.items():
        root = base / step
        with _manager(root) as m:  # a committed checkpoint (and static data) to start from
            m.save(2, _state(2), static=_static())
        patch()
        try:
            call(root)
        except Exception as exc:
            seen = (type(exc).__name__, str(exc))
        else:
            seen = ("none", "")
        finally:
            _unpatch()
        everyone = world.allgather(seen)  # every rank gets here: nobody waits in a collective
        result = {"rank": rank, "step": step, "error": seen[0], "message": seen[1],
                  "same": len(set(everyone)) == 1}  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)


KIND = sys.argv[2] if len(sys.argv) > 2 else "world"

if __name__ == "__main__":
    main()
