"""Checkpoint scenarios over a torch.distributed gloo process group; driven by tests/test_torchdist.py.

Usage: python tests/torch/scenario.py SCENARIO ROOT KIND [ARG]  (save, restore: KIND,KIND,...)

Started once per rank, by ``torch.distributed.run`` or by the test itself, with the env://
variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``). KIND is the
``checkpoint_comm``: self, node, world, node2 (``node`` with the hostname faked as
``host{rank // 2}``: two "nodes", so that ``split_node`` makes new groups) or split (a process
group per pair of ranks, passed as a custom ``checkpoint_comm``). Each rank prints
``RESULT <json>`` on success; any failure raises (the process then exits non-zero).
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import signal
import sys
from typing import Any

import numpy as np
import torch.distributed as dist

import resilient
from resilient import CheckpointManager, EverySteps, KeepLast, Session

# SCENARIO_ASYNC=1: the saves of roundtrip and fail are asynchronous (blocking=False), committed
# by the following wait()
BLOCKING = os.environ.get("SCENARIO_ASYNC") != "1"

faulthandler.register(signal.SIGQUIT)  # the test asks a hung rank where it is
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()


def checkpoint_comm(kind: str) -> Any:
    if kind == "node2":
        from resilient.parallel import torchdist

        torchdist._hostname = lambda: f"host{rank // 2}"
        return "node"
    if kind == "split":
        mine = None
        for first in range(0, size, 2):  # every rank creates every group, in the same order
            pg = dist.new_group(list(range(first, min(first + 2, size))))
            if first == rank - rank % 2:
                mine = pg
        return mine
    return kind


def make_state(step: int, r: int = rank) -> dict[str, Any]:
    rng = np.random.default_rng(1000 * r + step)
    return {
        "w": rng.standard_normal((r * 50 + 7, 3)).astype(np.float32),
        # > 1 MiB and not a multiple of the page size: the O_DIRECT path with an unaligned tail
        "big": rng.standard_normal(140_001 + 513 * r),
        "idx": np.arange(r + 1, dtype=np.int64) * step,
        "empty": np.zeros((0, 2) if r % 2 == 0 else (5, 2), dtype=np.float16),
        "count": step * 10 + r,
        "meta": {"rank": r, "lr": 0.1 / (step + 1)},
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        g = got[k]
        if isinstance(v, np.ndarray):
            assert isinstance(g, np.ndarray), (k, type(g))
            assert (g.dtype, g.shape) == (v.dtype, v.shape), (k, g.dtype, v.dtype, g.shape)
            assert g.tobytes() == v.tobytes(), f"{k} differs"
        else:
            assert g == v and type(g) is type(v), (k, g, v)


def result(**kw: Any) -> None:
    print("RESULT " + json.dumps({"rank": rank, **kw}), flush=True)


def committed_steps(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if d.startswith("step_"))


def scenario_save(root: str, kinds: str) -> None:
    """For each of the comma-separated KINDS (``node2`` last: it fakes the hostname for good),
    in ``ROOT/KIND``: save steps 1..5 keeping the last two (the group as ``comm``) and restore
    in this group. One process group for them all: a launch costs seconds of imports."""
    layouts = {kind: _save_one(os.path.join(root, kind), kind) for kind in kinds.split(",")}
    result(ok=True, layouts=layouts)


def _save_one(root: str, kind: str) -> Any:
    with CheckpointManager(
        root, comm=dist.group.WORLD, checkpoint_comm=checkpoint_comm(kind), keep=KeepLast(2)
    ) as m:
        assert type(m.comm).__name__ == "TorchComm", type(m.comm)
        for step in range(1, 6):
            m.save(step, make_state(step), metrics={"loss": 1.0 / step}, blocking=BLOCKING)
        m.wait()  # async: commits the last save (each save committed the one before)
        assert m.latest_step() == 5
        step, state = m.restore()
        assert step == 5
        assert_same(state, make_state(5))
    assert committed_steps(root) == ["step_00000004", "step_00000005"], committed_steps(root)
    with open(os.path.join(root, "step_00000005", "manifest.json")) as f:
        return json.load(f)["layout"]


def scenario_restore(root: str, kinds: str, expect: str) -> None:
    """A new process group (a new job) restores each of KINDS' ``ROOT/KIND`` bit-identically;
    the default group via ``dist``."""
    for kind in kinds.split(","):
        with CheckpointManager(
            os.path.join(root, kind), comm=dist, checkpoint_comm=checkpoint_comm(kind)
        ) as m:
            step, state = m.restore()
            assert step == int(expect), (kind, step, expect)
            assert_same(state, make_state(step))
            step, state = m.restore(step=int(expect) - 1)
            assert_same(state, make_state(step))
    result(ok=True, step=int(expect))


def scenario_fail(root: str, kind: str) -> None:
    """ENOSPC on the last rank inside save(): the same error on every rank, step 1 survives."""
    victim = size - 1
    with CheckpointManager(root, comm=dist.group.WORLD, checkpoint_comm=checkpoint_comm(kind)) as m:
        m.save(1, make_state(1))
        if rank == victim:
            from resilient.io import fileio

            def full(*_: Any) -> int:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            fileio.os.pwrite = full  # type: ignore[attr-defined]
        try:
            m.save(2, make_state(2), blocking=BLOCKING)
            m.wait()
        except resilient.ResilientError as exc:
            err = (type(exc).__name__, str(exc))
        else:
            err = ("none", "")
        errors: list[Any] = [None] * size
        dist.all_gather_object(errors, err)
        assert len({tuple(e) for e in errors}) == 1, errors
        assert [d for d in os.listdir(root) if d.startswith(".step_")] == []
        step, got = m.restore()
        assert step == 1
        assert_same(got, make_state(1))
    result(ok=True, error=err[0], message=err[1])


def scenario_subgroup(root: str, kind: str) -> None:
    """A sub-group as ``comm``: one checkpoint set per pair of ranks, each pair on two "hosts".

    ``checkpoint_comm="node"`` then splits a group that is not the world: each rank creates only
    its own host's group (the other pair is not there to create theirs).
    """
    from resilient.parallel import torchdist

    torchdist._hostname = lambda: f"host{rank % 2}"
    pair = checkpoint_comm("split")
    mine = os.path.join(root, f"pair{rank // 2}")
    with CheckpointManager(mine, comm=pair, checkpoint_comm=kind) as m:
        assert (m.comm.rank, m.comm.size) == (rank % 2, min(2, size - rank + rank % 2))
        for step in (1, 2):
            m.save(step, make_state(step))
    with CheckpointManager(mine, comm=pair, checkpoint_comm=kind) as m:
        step, state = m.restore()
        assert step == 2
        assert_same(state, make_state(2))
    with open(os.path.join(mine, "step_00000002", "manifest.json")) as f:
        layout = json.load(f)["layout"]
    result(ok=True, layout=layout)


def scenario_partner(root: str, kind: str, local: str, action: str) -> None:
    """Two "nodes" (``SLURMD_NODENAME`` = host0, host1), a local tier in ``local/<node>``, partner
    copies over gloo. ``action`` save: steps 1..3, asynchronous, left like a killed job (no
    flush); restore: the newest step, checked bit for bit."""
    _tier_scenario(root, kind, local, action, "partner", f"host{rank // 2}")


def scenario_xor(root: str, kind: str, local: str, action: str) -> None:
    """As :func:`scenario_partner` with XOR parity, one rank per "node" (host0, host1, ...)."""
    _tier_scenario(root, kind, local, action, "xor", f"host{rank}")


def _tier_scenario(
    root: str, kind: str, local: str, action: str, redundancy: str, node: str
) -> None:
    os.environ["SLURMD_NODENAME"] = node
    m = CheckpointManager(
        root, comm=dist.group.WORLD, checkpoint_comm=kind, local_dir=f"{local}/$SLURMD_NODENAME",
        redundancy=redundancy, flush_every=100,
    )  # fmt: skip
    if action == "save":
        for step in range(1, 4):
            m.save(step, make_state(step), blocking=False)
        m.wait()
        m.__exit__(RuntimeError, RuntimeError("killed"), None)
        result(ok=True)
        return
    with m:
        step, state = m.restore()
        assert_same(state, make_state(step))
    result(ok=True, step=step)


def scenario_session(root: str, kind: str) -> None:
    """A Session over the group: saves every 2 steps; a signal on the last rank stops everyone."""
    with Session(
        root, comm=dist.group.WORLD, checkpoint_comm=checkpoint_comm(kind),
        save_when=EverySteps(2), keep=KeepLast(2), exit_on_stop=False, async_save=not BLOCKING,
    ) as s:  # fmt: skip
        step, state = s.restore_or(lambda: make_state(0))
        first = step
        while step < first + 100 and not s.should_stop():
            step += 1
            state = make_state(step)
            s.maybe_save(step, state)
            if step == first + 5 and rank == size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # arrives on one rank only
    result(ok=True, first=first, step=step, stopped=s.stopped, reason=s.stop_reason)


def main() -> None:
    scenario, root, kind, *rest = sys.argv[1:]
    globals()[f"scenario_{scenario}"](root, kind, *rest)
    # Leave together: a rank that exits while a peer's gloo threads still talk to it can make
    # that peer abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
