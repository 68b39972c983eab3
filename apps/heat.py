"""2D heat equation on a Cartesian domain decomposition, resumable with :mod:`resilient`.

Run from the repository root::

    mpiexec -n 4 python -m apps.heat --nx 256 --ny 256 --steps 2000 \\
        --checkpoint-dir ckpt/heat --out heat.h5

Explicit time stepping of dT/dt = kappa(x, y) * laplacian(T) with zero Dirichlet boundaries,
one halo exchange per step (``Create_cart`` + ``Sendrecv``). ``kappa`` is static data: stored
once, shared by every checkpoint. The run resumes from the newest valid checkpoint; stopped by
a signal or by its deadline it writes a final checkpoint and exits 75.

The field and ``kappa`` are saved as each rank's :class:`resilient.Block` of the global grid
(``resilient.cartesian_block`` of the Cartesian communicator's coordinates), so a checkpoint
written on N ranks resumes on any number of ranks. The explicit stencil computes every cell from
the same neighbours in the same order whatever the decomposition, so the output is
bit-identical however often the run was interrupted and on however many ranks it resumed.
"""

# ruff: noqa: E402  (stop-signal handlers are installed before the slow imports, on purpose)
from __future__ import annotations

# Install the stop-signal handlers before the slow imports. Under `resilient run` the warning
# signal is held back until a handler listens (resilient.job.warning), but the apps also run
# under a plain `srun` in sbatch scripts without `resilient run`, where nothing else would
# catch a warning that arrives during the imports.
from resilient.job.slurm import StopSignals

EARLY_SIGNALS = StopSignals().__enter__()

import argparse
import logging
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

from resilient.config import CheckpointConfig, load_checkpoint_config, tier_options
from resilient.job.session import Session
from resilient.model.blocks import Block, cartesian_block
from resilient.model.policies import EverySteps, KeepLast, OnSignal

Array = npt.NDArray[np.float64]
log = logging.getLogger("apps.heat")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nx", type=int, default=128)
    p.add_argument("--ny", type=int, default=128)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--out", required=True, help="HDF5 file for the final field")
    p.add_argument("--config", help="checkpoint policy YAML (configs/checkpoint/*.yaml)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="overrides the config")
    p.add_argument("--checkpoint-comm", choices=["self", "node", "world"], default=None)
    p.add_argument("--async-save", action="store_true", help="save in the background")
    p.add_argument("--local-dir", help="node-local checkpoint tier (e.g. /dev/shm, $SLURM_TMPDIR)")
    p.add_argument("--flush-every", type=int, default=None, help="with --local-dir (default 1)")
    p.add_argument(
        "--redundancy", choices=["partner", "xor", "none"], default=None,
        help="with --local-dir: 'partner' keeps a copy of each node's checkpoint on the next "
        "node; 'xor' keeps XOR parity over sets of nodes (one lost node per set)",
    )  # fmt: skip
    p.add_argument(
        "--xor-set-size", type=int, default=None, help="with --redundancy xor (default 8)"
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (demos, tests)")
    p.add_argument("--alpha", type=float, default=0.2, help="diffusion number (<= 0.25 is stable)")
    return p.parse_args(argv)


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    cfg = (
        load_checkpoint_config(args.config)
        if args.config
        else CheckpointConfig(
            checkpoint_comm="node",
            save_when=EverySteps(50) | OnSignal(),
            keep=KeepLast(3),
            walltime_margin_s=10.0,
        )
    )
    changes: dict[str, Any] = {}
    if args.checkpoint_every:
        changes["save_when"] = EverySteps(args.checkpoint_every) | OnSignal()
    if args.checkpoint_comm:
        changes["checkpoint_comm"] = args.checkpoint_comm
    changes.update(tier_options(args))
    import dataclasses

    return dataclasses.replace(cfg, **changes) if changes else cfg


class Domain:
    """This rank's block of the global grid and its neighbours."""

    def __init__(self, comm: Any, nx: int, ny: int) -> None:
        dims = MPI.Compute_dims(comm.size, 2)
        self.cart = comm.Create_cart(dims, periods=[False, False], reorder=False)
        self.dims = dims
        coords = self.cart.Get_coords(self.cart.rank)
        (self.x0, self.y0), (sx, sy) = cartesian_block((nx, ny), dims, coords)
        self.x1, self.y1 = self.x0 + sx, self.y0 + sy
        self.nx, self.ny = nx, ny
        self.up, self.down = self.cart.Shift(0, 1)
        self.left, self.right = self.cart.Shift(1, 1)

    def block(self, interior: Array) -> Block:
        """This rank's block (without halo) of a global field, as a checkpoint leaf."""
        return Block(interior, (self.nx, self.ny), (self.x0, self.y0))

    def blocks(self, *names: str) -> dict[str, Any]:
        """This rank's block of each named global field, for ``restore(blocks=...)``."""
        shape = (self.x1 - self.x0, self.y1 - self.y0)
        return {n: ((self.nx, self.ny), (self.x0, self.y0), shape) for n in names}

    def padded(self, interior: Array) -> Array:
        """``interior`` inside a one-cell halo (zero; every step refills it first)."""
        u = np.zeros((interior.shape[0] + 2, interior.shape[1] + 2))
        u[1:-1, 1:-1] = interior
        return u

    def coords(self) -> tuple[Array, Array]:
        x = (np.arange(self.x0, self.x1) + 0.5) / self.nx
        y = (np.arange(self.y0, self.y1) + 0.5) / self.ny
        return np.meshgrid(x, y, indexing="ij")

    def exchange(self, u: Array) -> None:
        """Fill the one-cell halo of ``u`` from the neighbours (zero at the domain edge)."""
        c = self.cart
        send, recv = np.ascontiguousarray(u[1, 1:-1]), np.empty(u.shape[1] - 2)
        c.Sendrecv(send, self.up, 0, recv, self.down, 0)
        u[-1, 1:-1] = recv if self.down != MPI.PROC_NULL else 0.0
        send = np.ascontiguousarray(u[-2, 1:-1])
        c.Sendrecv(send, self.down, 1, recv, self.up, 1)
        u[0, 1:-1] = recv if self.up != MPI.PROC_NULL else 0.0
        send, recv = np.ascontiguousarray(u[1:-1, 1]), np.empty(u.shape[0] - 2)
        c.Sendrecv(send, self.left, 2, recv, self.right, 2)
        u[1:-1, -1] = recv if self.right != MPI.PROC_NULL else 0.0
        send = np.ascontiguousarray(u[1:-1, -2])
        c.Sendrecv(send, self.right, 3, recv, self.left, 3)
        u[1:-1, 0] = recv if self.left != MPI.PROC_NULL else 0.0


def initial_state(dom: Domain) -> tuple[dict[str, Any], dict[str, Any]]:
    """The initial temperature (a hot spot and a ripple) and the static conductivity."""
    x, y = dom.coords()
    temp = np.exp(-80.0 * ((x - 0.35) ** 2 + (y - 0.6) ** 2)) + 0.1 * np.sin(6 * np.pi * x)
    kappa = 0.5 + 0.5 * (x > 0.5) * (y < 0.5) + 0.25 * np.cos(2 * np.pi * y) ** 2
    u = np.zeros((x.shape[0] + 2, x.shape[1] + 2))
    u[1:-1, 1:-1] = temp
    top = dom.cart.allreduce(float(kappa.max()), op=MPI.MAX)  # global: the same on any ranks
    return {"u": u}, {"kappa": kappa / top}


def advance(dom: Domain, u: Array, kappa: Array, alpha: float) -> Array:
    """One explicit Euler step."""
    dom.exchange(u)
    lap = u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4.0 * u[1:-1, 1:-1]
    new: Array = u.copy()
    new[1:-1, 1:-1] += alpha * kappa * lap
    return new


def write_output(dom: Domain, u: Array, path: str, steps: int) -> None:
    """Gather the global field on rank 0 and write it to HDF5."""
    block = (dom.x0, dom.x1, dom.y0, dom.y1, np.ascontiguousarray(u[1:-1, 1:-1]))
    blocks = dom.cart.gather(block, root=0)
    if dom.cart.rank != 0:
        return
    import h5py

    field = np.empty((dom.nx, dom.ny))
    for x0, x1, y0, y1, b in blocks:
        field[x0:x1, y0:y1] = b
    with h5py.File(path, "w") as f:
        f.create_dataset("T", data=field)
        f.attrs["steps"] = steps
        f.attrs["ranks"] = dom.cart.size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    logging.basicConfig(
        level=logging.INFO if comm.rank == 0 else logging.WARNING,
        format=f"%(asctime)s [heat rank {comm.rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    cfg = checkpoint_config(args)
    dom = Domain(comm, args.nx, args.ny)
    state0, static = initial_state(dom)
    with Session(
        args.checkpoint_dir,
        comm=comm,
        signals=EARLY_SIGNALS,
        **cfg.session_options(),
        validate=lambda s: bool(np.isfinite(s["u"]).all()),
        # what defines the result; not --steps (a longer run continues a shorter one) and not
        # the rank count (u and kappa are Blocks: restored on any rank count)
        run_key={"app": "apps.heat", "nx": args.nx, "ny": args.ny, "alpha": args.alpha},
    ) as s:
        step, state = s.restore_or(
            {"u": dom.block(state0["u"][1:-1, 1:-1])},
            static={"kappa": dom.block(static["kappa"])},
            blocks=dom.blocks("u", "kappa"),  # used when the checkpoint has another rank count
        )
        u, kappa = dom.padded(state["u"]), state["kappa"]
        t0, first = time.perf_counter(), step
        while step < args.steps and not s.should_stop():
            u = advance(dom, u, kappa, args.alpha)
            step += 1
            s.maybe_save(step, {"u": dom.block(u[1:-1, 1:-1])})
            if args.step_delay:
                time.sleep(args.step_delay)
            if step % 100 == 0:
                log.info(
                    "step %d/%d (%.1f steps/s)",
                    step,
                    args.steps,
                    (step - first) / (time.perf_counter() - t0 + 1e-9),
                )
        if s.stopped:
            log.info("stopping at step %d: %s", step, s.stop_reason)
    write_output(dom, u, args.out, step)
    log.info("done: %d steps, wrote %s", step, args.out)
    # Finished, output written: a warning signal that arrives now (the walltime's, just too
    # late) must not kill a rank while MPI finalizes and turn a success into a failure.
    EARLY_SIGNALS.ignore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
