"""The operations the crash tests record: each a setup (not recorded) and an act (recorded on
every rank), run as ``mpiexec -n RANKS python -m tests.crash.ops NAME DIR``.

In ``DIR``: ``base/`` (what the operation works in: the checkpoint root ``base/ck``, and a
node-local tier ``base/local/<node>``), ``snapshot.*`` (``base`` after the setup),
``log-<rank>.*`` (each rank's calls during the act, :mod:`tests.crash.record`) and
``done.json`` (written last by rank 0: the act ended on every rank).

The state every rank saves (:func:`state`) is the rows of one global array (a
:class:`resilient.Block`) and the step (:class:`resilient.Replicated`), so that one process
restores any layout whole (:data:`BLOCKS`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BLOCKS", "OPERATIONS", "SHAPE", "Context", "Operation", "state"]

SHAPE = (48, 40)  # 15 KiB of float64: a rank's file spans pages, so a write can tear
#: what one process asks a restore of any layout for: the whole array
BLOCKS = {"g": (SHAPE, (0, 0), SHAPE)}


def global_array(step: int, version: int = 0) -> np.ndarray:
    i, j = np.indices(SHAPE)
    return (i * 100.0 + j + step + 0.25 * version).astype(np.float64)


def state(step: int, rank: int, size: int, version: int = 0) -> dict[str, Any]:
    """This rank's rows of the global array at ``step`` (``version``: another content for a
    save of the same step again) and the step."""
    from resilient import Block, Replicated, block_1d

    start, rows = block_1d(SHAPE[0], size, rank)
    rows_of = global_array(step, version)[start : start + rows]
    return {"g": Block(rows_of, SHAPE, (start, 0)), "meta": Replicated({"step": step})}


@dataclass
class Context:
    """What an operation's setup and act share on one rank."""

    base: Path
    comm: Any  # mpi4py's COMM_WORLD, or None on one process
    rank: int = 0
    size: int = 1
    keep: dict[str, Any] = field(default_factory=dict)  # the setup's objects for the act

    @property
    def root(self) -> Path:
        return self.base / "ck"

    def manager(self, **options: Any) -> Any:
        from resilient import CheckpointManager

        if "local_dir" in options:
            options["local_dir"] = options["local_dir"].replace("$BASE", str(self.base))
        return CheckpointManager(self.root, comm=self.comm, **options)

    def save(self, m: Any, step: int, version: int = 0, **kw: Any) -> None:
        m.save(step, state(step, self.rank, self.size, version), **kw)

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()


@dataclass(frozen=True)
class Operation:
    """One recorded operation: ``ranks`` processes (``hosts``: simulated nodes for
    ``mpiexec -hosts``), ``setup`` then ``act`` on each."""

    name: str
    what: str
    ranks: int
    setup: Callable[[Context], None]
    act: Callable[[Context], None]
    hosts: str | None = None


def _nothing(ctx: Context) -> None:
    return None


def _saved(*steps: int, open_: bool = False, **options: Any) -> Callable[[Context], None]:
    """Save ``steps``; ``open_``: keep the manager open for the act (what it holds between
    saves, e.g. a rotation's files for the next save to write over, is the act's)."""

    def setup(ctx: Context) -> None:
        m = ctx.manager(**options)
        for step in steps:
            ctx.save(m, step)
        if open_:
            ctx.keep["manager"] = m
        else:
            m.close()

    return setup


def _save_act(
    step: int, version: int = 0, *, blocking: bool = True, **options: Any
) -> Callable[[Context], None]:
    def act(ctx: Context) -> None:
        with ctx.keep.pop("manager", None) or ctx.manager(**options) as m:
            ctx.save(m, step, version, blocking=blocking)
            m.wait()

    return act


def _keep_last(n: int) -> Any:
    from resilient import KeepLast

    return KeepLast(n)


def _first_static(ctx: Context) -> None:
    from resilient import Replicated

    with ctx.manager() as m:
        mesh = Replicated(np.linspace(0.0, 1.0, 3000))
        m.save(10, state(10, ctx.rank, ctx.size), static={"mesh": mesh})


def _corrupt_newest(ctx: Context) -> None:
    _saved(10, 20)(ctx)
    ctx.barrier()
    if ctx.rank == 0:
        data = ctx.root / "step_00000020" / "rank_00000.h5"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))


def _restore_quarantines(ctx: Context) -> None:
    with ctx.manager() as m:
        step, _ = m.restore(blocks=BLOCKS)
    assert step == 10, step


def _prune(ctx: Context) -> None:
    from resilient import cli

    assert cli.main(["prune", "--keep-last", "1", str(ctx.root)]) == 0


def _ledger_setup(ctx: Context) -> None:
    from resilient.job.ledger import AttemptRecord, Where, note_beside

    _saved(10)(ctx)
    where = Where(given=ctx.root)
    for n in (1, 2):
        rec = AttemptRecord(attempt=n, start=100.0 * n, end=100.0 * n + 50, exit_code=75)
        where.append(rec)
        note_beside(ctx.root, n, rec)


def _ledger_append(ctx: Context) -> None:
    from resilient.job.ledger import AttemptRecord, Where, note_beside

    rec = AttemptRecord(attempt=3, start=300.0, end=350.0, exit_code=0, progress=True)
    Where(given=ctx.root).append(rec)
    note_beside(ctx.root, 3, rec)


def _own_ledger_setup(ctx: Context) -> None:
    """Two attempts counted in the task's own directory (``base/own``: ``resilient run``
    without ``--checkpoint-dir``, before the program named its directory), a root beside."""
    from resilient.job.ledger import AttemptRecord, Where

    _saved(10)(ctx)
    own = ctx.base / "own"
    own.mkdir()
    where = Where(given=None, own=own)
    for n in (1, 2):
        where.append(AttemptRecord(attempt=n, start=100.0 * n, end=100.0 * n + 50, exit_code=75))


def _ledger_moves(ctx: Context) -> None:
    """The third attempt, once the program named its directory: the ledger moves there."""
    from resilient.job.ledger import AttemptRecord, Where

    where = Where(given=None, own=ctx.base / "own", program=ctx.root, told=True)
    where.append(AttemptRecord(attempt=3, start=300.0, end=350.0, exit_code=0, progress=True))


TWO_NODES = "nodeA:1,nodeB:1"
THREE_NODES = "nodeA:1,nodeB:1,nodeC:1"


def _tiered(redundancy: str, **options: Any) -> dict[str, Any]:
    """A node-local tier on each simulated node (``base/local/<node>``)."""
    return {"local_dir": "$BASE/local/$PMI_HOSTNAME", "redundancy": redundancy,
            "checkpoint_comm": "node", **options}  # fmt: skip


def _tier_saved(redundancy: str, *, wipe: str | None = None) -> Callable[[Context], None]:
    """Step 10 on every node's tier with its copies, not flushed (a killed job); ``wipe``:
    then that node's tier is lost (a replaced node)."""

    def setup(ctx: Context) -> None:
        m = ctx.manager(**_tiered(redundancy, flush_every=1000))
        ctx.save(m, 10)
        m.wait()
        m.__exit__(RuntimeError, RuntimeError("killed"), None)
        ctx.barrier()
        if wipe is not None and ctx.rank == 0:
            import shutil

            shutil.rmtree(ctx.base / "local" / wipe)

    return setup


def _tier_save(redundancy: str) -> Callable[[Context], None]:
    def act(ctx: Context) -> None:
        with ctx.manager(**_tiered(redundancy, flush_every=1)) as m:
            ctx.save(m, 20)
            m.wait()

    return act


def _tier_restore(redundancy: str) -> Callable[[Context], None]:
    def act(ctx: Context) -> None:
        from resilient import block_1d

        start, rows = block_1d(SHAPE[0], ctx.size, ctx.rank)
        with ctx.manager(**_tiered(redundancy, flush_every=1000)) as m:
            step, _ = m.restore(blocks={"g": (SHAPE, (start, 0), (rows, SHAPE[1]))})
        assert step == 10, step

    return act


OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation("save-first", "a blocking save into a new root (file per rank)", 2,
                  _nothing, _save_act(10)),
        Operation("save-self", "a blocking save, a file per rank", 2,
                  _saved(10), _save_act(20)),
        Operation("save-node", "a blocking save, a file per node", 2,
                  _saved(10, checkpoint_comm="node"), _save_act(20, checkpoint_comm="node")),
        Operation("save-world", "a blocking save, one shared file", 2,
                  _saved(10, checkpoint_comm="world"), _save_act(20, checkpoint_comm="world")),
        Operation("save-over-dropped", "a save writing over a dropped checkpoint's files", 2,
                  _saved(10, 20, open_=True, keep=_keep_last(1)), _save_act(30)),
        Operation("save-async", "an async save", 2,
                  _saved(10), _save_act(20, blocking=False)),
        Operation("save-again", "a save of the newest step's number again", 2,
                  _saved(10, 20), _save_act(20, version=1)),
        Operation("rotation", "a save whose rotation drops two steps", 1,
                  _saved(10, 20, 30), _save_act(40, keep=_keep_last(2))),
        Operation("static-first", "the static data's first write", 2,
                  _nothing, _first_static),
        Operation("quarantine", "a restore that quarantines a damaged newest step", 1,
                  _corrupt_newest, _restore_quarantines),
        Operation("prune", "resilient prune --keep-last 1", 1,
                  _saved(10, 20, 30), _prune),
        Operation("ledger", "an attempt's ledger record and its note beside the root", 1,
                  _ledger_setup, _ledger_append),
        Operation("ledger-move", "the ledger moved from the task's own directory to the root", 1,
                  _own_ledger_setup, _ledger_moves),
        Operation("tier-partner", "a node-local save, its partner copies and its flush", 2,
                  _tier_saved("partner"), _tier_save("partner"), TWO_NODES),
        Operation("tier-rebuild", "a restore rebuilding a lost node's tier from its partner", 2,
                  _tier_saved("partner", wipe="nodeB"), _tier_restore("partner"), TWO_NODES),
        Operation("tier-xor", "a node-local save, its XOR parity and its flush", 3,
                  _tier_saved("xor"), _tier_save("xor"), THREE_NODES),
        Operation("xor-rebuild", "a restore rebuilding a lost node's tier from XOR parity", 3,
                  _tier_saved("xor", wipe="nodeB"), _tier_restore("xor"), THREE_NODES),
    )
}  # fmt: skip


def main(argv: list[str]) -> int:
    """``python -m tests.crash.ops NAME DIR`` on every rank (see the module)."""
    from tests.crash.record import recording, snapshot, write_snapshot

    name, where = argv[0], Path(argv[1])
    op = OPERATIONS[name]
    comm = None
    if op.ranks > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    ctx = Context(where / "base", comm)
    if comm is not None:
        ctx.rank, ctx.size = comm.Get_rank(), comm.Get_size()
    if ctx.rank == 0:
        ctx.base.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    op.setup(ctx)
    ctx.barrier()
    if ctx.rank == 0:
        write_snapshot(snapshot(ctx.base), where / "snapshot")
    ctx.barrier()
    with recording(ctx.base, where / f"log-{ctx.rank}"):
        op.act(ctx)
    ctx.barrier()
    if ctx.rank == 0:
        (where / "done.json").write_text(json.dumps({"op": name, "ranks": ctx.size}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RESILIENT_LOG", "warning")
    sys.exit(main(sys.argv[1:]))
