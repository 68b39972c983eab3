"""Data-parallel training of a small MLP under :class:`resilient.job.session.Session`.

A deterministic example (and test subject) for checkpoint/restart: a 16 -> 32 -> 1 tanh MLP
trained with Adam in pure numpy on a synthetic regression set that every rank generates from a
fixed seed. Each rank takes its shard of every global minibatch; gradients are summed with
``Allreduce`` and divided by the global batch size. The checkpointed state is the weights, the
Adam moments and step count, the shuffling RNG's state and the position in the data, so a run
that is killed and resumed any number of times ends bit-identical to an uninterrupted run on the
same number of ranks.

Every value of the state is the same on every rank (data parallelism: the gradients are summed
over all ranks), so it is saved as :class:`resilient.Replicated`, and the data position is a
global sample index; a checkpoint therefore resumes on any number of ranks with the same global
batch. On another rank count the gradient sum is added up in another order (each rank's shard
changes), so the result then differs from the uninterrupted run in the last bits (see the
README for the tolerance)::

    mpiexec -n 2 python -m apps.train --steps 200 --checkpoint-dir ckpt --out out.h5

Checkpoint policy: ``--config configs/checkpoint/training.yaml`` (see :mod:`resilient.config`),
else every 20 steps, keeping the newest 3 and the best 2 by loss; ``--checkpoint-every`` and
``--checkpoint-comm`` override either.

Exit codes: 0 done (``--out`` written), 75 stopped early by a signal or the deadline with a
final checkpoint written (run the same command again to resume), 2 bad arguments or config.
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
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt
from mpi4py import MPI

from resilient.config import CheckpointConfig, load_checkpoint_config, tier_options
from resilient.errors import ConfigError
from resilient.job.session import Session
from resilient.model.blocks import Replicated
from resilient.model.policies import EverySteps, KeepBest, KeepLast

__all__ = ["main"]

log = logging.getLogger("apps.train")

Array = npt.NDArray[np.float64]

N_IN, N_HIDDEN, N_OUT = 16, 32, 1
N_SAMPLES = 512
GLOBAL_BATCH = 32  # 16 steps per epoch
DATA_SEED, INIT_SEED, SHUFFLE_SEED = 20240501, 42, 7
LEARNING_RATE, BETA1, BETA2, EPSILON = 1e-2, 0.9, 0.999, 1e-8
PARAMS = ("w1", "b1", "w2", "b2")
PROGRESS_EVERY = 10
PIDFILE_ENV = "RESILIENT_TEST_PIDFILE_DIR"  # test hook: write rank<r>.pid there once running
DEFAULT_CONFIG = CheckpointConfig(
    checkpoint_comm="self",
    save_when=EverySteps(20),
    keep=KeepLast(3) | KeepBest("loss", n=2),
)
EXIT_USAGE = 2


# --------------------------------------------------------------------------- data and model


def make_data() -> tuple[Array, Array]:
    """The synthetic regression set ``(x, y)``, identical on every rank (fixed seed)."""
    rng = np.random.Generator(np.random.PCG64(DATA_SEED))
    x = rng.standard_normal((N_SAMPLES, N_IN))
    teacher = rng.standard_normal(N_IN) / np.sqrt(N_IN)
    noise = 0.05 * rng.standard_normal((N_SAMPLES, N_OUT))
    y = np.sin(2.0 * (x @ teacher))[:, None] + 0.1 * x[:, :1] ** 2 + noise
    return x, y


def initial_state() -> dict[str, Any]:
    """Step-0 state: initial weights, zero Adam moments, the shuffler's seed state."""
    rng = np.random.Generator(np.random.PCG64(INIT_SEED))
    params: dict[str, Array] = {
        "w1": rng.standard_normal((N_IN, N_HIDDEN)) / np.sqrt(N_IN),
        "b1": np.zeros(N_HIDDEN),
        "w2": rng.standard_normal((N_HIDDEN, N_OUT)) / np.sqrt(N_HIDDEN),
        "b2": np.zeros(N_OUT),
    }
    state: dict[str, Any] = dict(params)
    for name, p in params.items():
        state[f"adam_m_{name}"] = np.zeros_like(p)
        state[f"adam_v_{name}"] = np.zeros_like(p)
    state["adam_t"] = 0
    state["epoch"] = 0
    state["index"] = 0  # position in this epoch's permutation, in samples
    state["rng_state"] = np.random.PCG64(SHUFFLE_SEED).state  # as of this epoch's start
    state["loss"] = None  # global mean loss of the last step
    return state


def epoch_permutation(rng_state: Mapping[str, Any]) -> tuple[npt.NDArray[np.int64], dict[str, Any]]:
    """This epoch's shuffle of the data, and the generator's state after drawing it."""
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = dict(rng_state)
    perm = rng.permutation(N_SAMPLES)
    return perm, rng.bit_generator.state


def local_batch(state: Mapping[str, Any], rank: int, size: int) -> npt.NDArray[np.int64]:
    """This rank's shard (by rank index) of the current global minibatch's sample indices."""
    perm, _ = epoch_permutation(state["rng_state"])
    start = int(state["index"])
    batch = perm[start : start + GLOBAL_BATCH]
    return np.array_split(batch, size)[rank]


def advance_position(state: dict[str, Any]) -> None:
    """Move past the current minibatch; at an epoch's end, advance the shuffling RNG."""
    state["index"] = int(state["index"]) + GLOBAL_BATCH
    if state["index"] + GLOBAL_BATCH > N_SAMPLES:
        _, state["rng_state"] = epoch_permutation(state["rng_state"])
        state["epoch"] = int(state["epoch"]) + 1
        state["index"] = 0


def forward_backward(
    params: Mapping[str, Array], x: Array, y: Array
) -> tuple[dict[str, Array], float]:
    """Summed (not averaged) squared-error loss of this shard and its gradients."""
    hidden = np.tanh(x @ params["w1"] + params["b1"])
    err = hidden @ params["w2"] + params["b2"] - y
    d_out = 2.0 * err
    d_hidden = (d_out @ params["w2"].T) * (1.0 - hidden**2)
    grads = {
        "w1": x.T @ d_hidden,
        "b1": d_hidden.sum(axis=0),
        "w2": hidden.T @ d_out,
        "b2": d_out.sum(axis=0),
    }
    return grads, float(np.sum(err**2))


def allreduce_mean(
    comm: MPI.Comm, grads: Mapping[str, Array], loss_sum: float
) -> tuple[dict[str, Array], float]:
    """Sum gradients and loss over ranks (one Allreduce), divide by the global batch size."""
    send = np.concatenate([grads[name].ravel() for name in PARAMS] + [np.array([loss_sum])])
    recv = np.empty_like(send)
    comm.Allreduce(send, recv, op=MPI.SUM)
    recv /= GLOBAL_BATCH
    out: dict[str, Array] = {}
    offset = 0
    for name in PARAMS:
        n = grads[name].size
        out[name] = recv[offset : offset + n].reshape(grads[name].shape)
        offset += n
    return out, float(recv[-1])


def adam_update(state: dict[str, Any], grads: Mapping[str, Array]) -> None:
    """One Adam step on the parameters in ``state`` (new arrays; nothing is changed in place)."""
    t = int(state["adam_t"]) + 1
    state["adam_t"] = t
    for name in PARAMS:
        g = grads[name]
        m = BETA1 * state[f"adam_m_{name}"] + (1.0 - BETA1) * g
        v = BETA2 * state[f"adam_v_{name}"] + (1.0 - BETA2) * g * g
        m_hat = m / (1.0 - BETA1**t)
        v_hat = v / (1.0 - BETA2**t)
        state[name] = state[name] - LEARNING_RATE * m_hat / (np.sqrt(v_hat) + EPSILON)
        state[f"adam_m_{name}"] = m
        state[f"adam_v_{name}"] = v


def train_step(state: dict[str, Any], data: tuple[Array, Array], comm: MPI.Comm) -> float:
    """One data-parallel step: shard, gradients, Allreduce, Adam, advance. Returns the loss."""
    idx = local_batch(state, comm.Get_rank(), comm.Get_size())
    grads, loss_sum = forward_backward(state, data[0][idx], data[1][idx])
    mean_grads, loss = allreduce_mean(comm, grads, loss_sum)
    adam_update(state, mean_grads)
    advance_position(state)
    state["loss"] = loss
    return loss


# --------------------------------------------------------------------------- run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m apps.train", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--steps", type=int, required=True, help="total training steps")
    p.add_argument("--checkpoint-dir", type=Path, required=True, help="checkpoint root")
    p.add_argument("--out", type=Path, required=True, help="HDF5 file written at completion")
    p.add_argument("--config", type=Path, help="checkpoint policy YAML (configs/checkpoint/)")
    p.add_argument(
        "--checkpoint-every", type=int, help="save every N steps (default 20; overrides --config)"
    )
    p.add_argument(
        "--checkpoint-comm",
        choices=("self", "node", "world"),
        help="ranks sharing a checkpoint file (default self; overrides --config)",
    )
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
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep seconds per step")
    args = p.parse_args(argv)
    if args.steps < 0 or args.step_delay < 0:
        p.error("--steps and --step-delay must be >= 0")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    return args


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """``--config`` (else the defaults), with the explicitly given flags overriding it.

    Raises:
        ConfigError: the config file is unreadable or invalid.
    """
    cfg = DEFAULT_CONFIG if args.config is None else load_checkpoint_config(args.config)
    changes: dict[str, Any] = {}
    if args.checkpoint_every is not None:
        changes["save_when"] = EverySteps(args.checkpoint_every)
    if args.checkpoint_comm is not None:
        changes["checkpoint_comm"] = args.checkpoint_comm
    changes.update(tier_options(args))
    return dataclasses.replace(cfg, **changes)


def write_pidfile(rank: int) -> None:
    """Test hook: with ``$RESILIENT_TEST_PIDFILE_DIR`` set, write ``rank<r>.pid`` there."""
    where = os.environ.get(PIDFILE_ENV)
    if not where:
        return
    folder = Path(where)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.pid.tmp"
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, folder / f"rank{rank}.pid")


def write_output(path: Path, state: Mapping[str, Any], steps: int) -> None:
    """Rank 0: the final weights as HDF5 datasets, with attrs ``steps`` and ``final_loss``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    loss = state["loss"]
    with h5py.File(tmp, "w") as f:
        for name in PARAMS:
            f.create_dataset(name, data=state[name])
        f.attrs["steps"] = steps
        f.attrs["final_loss"] = float("nan") if loss is None else float(loss)
    os.replace(tmp, path)


def replicated(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state as saved: every value the same on every rank, so restorable on any rank count."""
    return {key: Replicated(value) for key, value in state.items()}


def train(args: argparse.Namespace, cfg: CheckpointConfig, comm: MPI.Comm) -> None:
    """Train under a Session; raises ``SystemExit(75)`` when stopped early."""
    rank = comm.Get_rank()
    data = make_data()
    with Session(
        args.checkpoint_dir,
        comm=comm,
        signals=EARLY_SIGNALS,
        **cfg.session_options(),
        # the data, model and learning rate are fixed: only the program defines the result (not
        # --steps: a longer run continues a shorter one; not the rank count: the state is
        # Replicated and restores on any rank count)
        run_key={"app": "apps.train"},
    ) as s:
        step, state = s.restore_or(initial_state)
        write_pidfile(rank)
        saved = step
        while step < args.steps and not s.should_stop():
            loss = train_step(state, data, comm)
            step += 1
            if s.maybe_save(step, replicated(state), metrics={"loss": loss}):
                saved = step
            if rank == 0 and step % PROGRESS_EVERY == 0:
                print(f"step {step} loss {loss:.6f}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
        if s.stopped:
            print(f"STOPPED rank={rank} step={step} reason={s.stop_reason}", flush=True)
            return  # the Session writes the final checkpoint and raises SystemExit(75)
        if saved != step:
            s.save(step, replicated(state), metrics={"loss": state["loss"]})
    if rank == 0:
        write_output(args.out, state, step)
        print(f"done: {step} steps, final loss {state['loss']}, wrote {args.out}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``mpiexec -n N python -m apps.train ...``."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {comm.Get_rank()}] %(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    try:
        cfg = checkpoint_config(args)
    except ConfigError as exc:  # every rank reads the same file and fails alike: no collective
        if comm.Get_rank() == 0:
            log.error("%s", exc)
        raise SystemExit(EXIT_USAGE) from None
    train(args, cfg, comm)
    # Finished, output written: a warning signal that arrives now (the walltime's, just too
    # late) must not kill a rank while MPI finalizes and turn a success into a failure.
    EARLY_SIGNALS.ignore()


if __name__ == "__main__":
    main()
