"""Data-parallel PyTorch training (DDP or FSDP2; gloo on the CPU, NCCL on GPUs) under a Session.

A deterministic example (and test subject) for checkpoint/restart of a real PyTorch job: a
24 -> 64 -> 64 -> 4 MLP with dropout, classifying a synthetic data set that every rank generates
from a fixed seed (no downloads), trained with AdamW and a cosine learning-rate schedule.
Batches are augmented with noise whose strength comes from Python's ``random`` and whose values
come from a numpy ``Generator``; dropout draws from torch's generator. Every rank takes its
shard of each global batch through a ``DistributedSampler`` (``set_epoch`` per epoch).

``--strategy`` chooses how the ranks share the model: ``ddp`` (the default) wraps it in
``DistributedDataParallel``, which keeps a full copy on every rank and averages the gradients;
``fsdp2`` shards it with ``fully_shard`` (each ``Linear`` layer, then the root, over a 1-D mesh
of all ranks): each rank holds a shard of every parameter and of the optimizer's state, and the
gradients are averaged by reduce-scatter. ``--device cuda`` trains on the GPUs over NCCL (one
per rank, by the launcher's local rank) where CUDA is available; else, and by default, on the
CPU over gloo.

The checkpoint holds, per rank: the model's, the optimizer's and the scheduler's state dicts
(under FSDP2 the sharded ones, ``get_model_state_dict``/``get_optimizer_state_dict``, whose
parameters and moments are DTensors: each rank saves its shards, restored in place with
``Session.restore_or(..., into=)``), the random streams (:func:`resilient.rng_state`: torch's
generator, Python's, numpy's global one and the loop's own numpy ``Generator``), the data
position (epoch, batch in the epoch) and the loss. The sampler's order is a function of its seed
and the epoch, so the position alone restores the data stream. A run killed and resumed any
number of times ends bit-identical to an uninterrupted run with the same ``--strategy`` and
``--device`` on the same number of ranks.

Launch (the app never initialises MPI; it reads its rank from the launcher's environment)::

    torchrun --nproc-per-node 2 -m apps.train_torch --steps 200 --checkpoint-dir ckpt --out m.h5
    mpiexec -n 2 python -m apps.train_torch --steps 200 --checkpoint-dir ckpt --out m.h5
    torchrun --nproc-per-node 2 -m apps.train_torch --strategy fsdp2 --steps 200 ...
    srun -n 2 python -m apps.train_torch ...        # in a Slurm allocation
    python -m apps.train_torch ...                  # one process

Rank and size come from ``RANK``/``WORLD_SIZE`` (torchrun), ``PMI_RANK``/``PMI_SIZE`` (MPICH's
hydra, Intel MPI), ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (Open MPI) or
``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS`` (srun). The rendezvous address is ``MASTER_ADDR``,
else the step's first node under srun, else 127.0.0.1 (one host; set ``MASTER_ADDR`` for
``mpiexec`` across hosts); the port ``MASTER_PORT``, else one in 20000-39999 derived from the
checkpoint directory and ``SLURM_JOB_ID`` (the same on every rank, and different for two tasks
that share a host). The torch process group is the Session's communicator. With ``--device
cuda`` each rank uses the GPU of its local rank (``LOCAL_RANK``, ``MPI_LOCALRANKID``,
``OMPI_COMM_WORLD_LOCAL_RANK`` or ``SLURM_LOCALID``, else the rank) modulo the GPUs it sees.

Checkpoint policy: ``--config configs/checkpoint/training.yaml`` (see :mod:`resilient.config`),
else every 20 steps, keeping the newest 3 and the best 2 by loss; ``--checkpoint-every`` and
``--checkpoint-comm`` override either.

The output (``--out``, rank 0) holds the full weights under the same names for both
strategies (FSDP2's are gathered first).

Exit codes: 0 done (``--out`` written by rank 0), 75 stopped early by a signal or the deadline
with a final checkpoint written (run the same command again to resume), 2 bad arguments or
config.
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
import random
import re
import time
import zlib
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from resilient import rng_state, set_rng_state
from resilient.config import CheckpointConfig, load_checkpoint_config, tier_options
from resilient.errors import ConfigError
from resilient.job.session import Session
from resilient.model.policies import EverySteps, KeepBest, KeepLast

# FSDP2's modules (torch.distributed.fsdp, .device_mesh, .checkpoint.state_dict) are imported
# where --strategy fsdp2 uses them: they add seconds to every start-up on a busy node

__all__ = ["Launch", "find_launch", "main"]

log = logging.getLogger("apps.train_torch")

N_IN, N_HIDDEN, N_CLASSES = 24, 64, 4
N_SAMPLES = 1024
GLOBAL_BATCH = 32  # 32 steps per epoch
DROPOUT = 0.1
DATA_SEED, INIT_SEED, SHUFFLE_SEED, AUG_SEED = 20240611, 42, 7, 1234
LEARNING_RATE, WEIGHT_DECAY = 3e-3, 1e-2
MAX_NOISE = 0.1  # augmentation: N(0, s^2) input noise, s uniform in [0, MAX_NOISE) per batch
PROGRESS_EVERY = 10
PORT_BASE, PORT_RANGE = 20000, 20000  # without $MASTER_PORT: below Linux's ephemeral ports
DIST_TIMEOUT = timedelta(minutes=10)  # a rank that dies leaves the others waiting this long
PIDFILE_ENV = "RESILIENT_TEST_PIDFILE_DIR"  # test hook: write rank<r>.pid there once running
DEFAULT_CONFIG = CheckpointConfig(
    checkpoint_comm="self",
    save_when=EverySteps(20),
    keep=KeepLast(3) | KeepBest("loss", n=2),
)
EXIT_USAGE = 2
STRATEGIES = ("ddp", "fsdp2")
DEVICES = ("cpu", "cuda")
# the launchers' local rank (which GPU a rank takes), in find_launch's order
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


# --------------------------------------------------------------------------- launch


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # which launcher's variables were read


_RANK_VARS = (
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("hydra", "PMI_RANK", "PMI_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),  # set in a job step only, not a batch shell
)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``n[07-09,12],m1`` -> ``n07``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ConfigError(f"cannot read a host from the node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def find_launch(environ: Mapping[str, str], *, task: str = "") -> Launch:
    """Rank, size and rendezvous point from the launcher's environment (see the module doc).

    ``task`` names the run (the checkpoint directory): without ``$MASTER_PORT`` the port is
    derived from it and from ``$SLURM_JOB_ID``.

    Raises:
        ConfigError: the variables are malformed.
    """
    rank, size, source = 0, 1, "single process"
    for name, rank_var, size_var in _RANK_VARS:
        if rank_var in environ and size_var in environ:
            try:
                rank, size = int(environ[rank_var]), int(environ[size_var])
            except ValueError:
                raise ConfigError(
                    f"${rank_var}={environ[rank_var]!r}, ${size_var}={environ[size_var]!r}: "
                    "not integers"
                ) from None
            source = name
            break
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is not in a world of size {size} ({source})")
    addr = environ.get("MASTER_ADDR")
    if not addr:
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        addr = first_host(nodes) if source == "srun" and nodes else "127.0.0.1"
    port_text = environ.get("MASTER_PORT")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(f"$MASTER_PORT={port_text!r} is not a port number")
        port = int(port_text)
    else:  # deterministic, so every rank agrees; tasks and jobs sharing a host differ
        key = f"{environ.get('SLURM_JOB_ID', '')}:{task}".encode()
        port = PORT_BASE + zlib.crc32(key) % PORT_RANGE
    return Launch(rank=rank, world_size=size, master_addr=addr, master_port=port, source=source)


def pick_device(requested: str, environ: Mapping[str, str], launch: Launch) -> torch.device:
    """``cuda:<local rank modulo the GPUs>`` for ``--device cuda`` where CUDA is available (one
    warning and the CPU where it is not); else the CPU."""
    if requested != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if launch.rank == 0:
            log.warning("--device cuda: CUDA is not available here; training on the CPU (gloo)")
        return torch.device("cpu")
    local = next((environ[v] for v in _LOCAL_RANK_VARS if environ.get(v, "").isdigit()), None)
    index = (launch.rank if local is None else int(local)) % torch.cuda.device_count()
    return torch.device("cuda", index)


def init_process_group(launch: Launch, device: torch.device) -> None:
    """gloo on the CPU, NCCL on a GPU: a TCP rendezvous, or an in-memory store for one process."""
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL, and the Session's object collectives, use it
        backend = "nccl"
    if launch.world_size == 1:  # no port: concurrent single-process runs must not collide
        store = dist.HashStore()  # type: ignore[attr-defined,unused-ignore]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=DIST_TIMEOUT)
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=DIST_TIMEOUT,
    )


def session_comm() -> Any:
    """The Session's communicator: the torch process group (``resilient.parallel.torchdist``)."""
    return dist.group.WORLD


# --------------------------------------------------------------------------- data and model


def make_data(device: torch.device) -> TensorDataset:
    """The synthetic classification set, identical on every rank (fixed seed), on ``device``."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    proj = torch.randn(N_IN, N_CLASSES, generator=g) / N_IN**0.5
    logits = torch.tanh(2.0 * x @ proj) + 0.3 * torch.randn(N_SAMPLES, N_CLASSES, generator=g)
    return TensorDataset(x.to(device), logits.argmax(dim=1).to(device))


def make_model() -> nn.Sequential:
    """The MLP, with the same initial weights on every rank (seeded)."""
    torch.manual_seed(INIT_SEED)
    return nn.Sequential(
        nn.Linear(N_IN, N_HIDDEN),
        nn.GELU(),
        nn.Dropout(DROPOUT),
        nn.Linear(N_HIDDEN, N_HIDDEN),
        nn.GELU(),
        nn.Dropout(DROPOUT),
        nn.Linear(N_HIDDEN, N_CLASSES),
    )


def shard_model(model: nn.Sequential, device: torch.device) -> nn.Module:
    """FSDP2: ``fully_shard`` each ``Linear`` layer, then the root, over a 1-D mesh of all ranks
    (collective). The parameters become DTensors, ``Shard(0)`` of the full ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@dataclasses.dataclass
class Trainer:
    """Everything that changes during training, and the checkpoint state made of it."""

    strategy: str  # "ddp" | "fsdp2"
    model: nn.Module  # the DDP-wrapped module's ``.module``; under FSDP2 the sharded model
    net: nn.Module  # what a step calls: the DDP wrapper, or the sharded model itself
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    sampler: DistributedSampler[Any]
    data: TensorDataset
    np_rng: np.random.Generator
    local_batch: int
    epoch: int = 0
    batch: int = 0  # next batch of this epoch
    loss: float | None = None  # global mean loss of the last step

    @property
    def batches_per_epoch(self) -> int:
        return len(self.sampler) // self.local_batch

    def state(self) -> dict[str, Any]:
        """This rank's checkpoint state (tensors by reference: the save copies what it needs).

        Under FSDP2 the sharded state dicts: DTensors of this rank's shards. (For an optimizer
        without state yet, ``get_optimizer_state_dict`` makes it: one step with zero gradients
        and learning rate 0, which changes no weight; AdamW counts it.)
        """
        if self.strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            model = get_model_state_dict(self.model)
            optim = get_optimizer_state_dict(self.model, self.optim)
        else:
            model, optim = self.model.state_dict(), self.optim.state_dict()
        return {
            "model": model,
            "optim": optim,
            "sched": self.sched.state_dict(),
            "rng": rng_state({"augment": self.np_rng}),  # every stream a step draws from
            "data": {"epoch": self.epoch, "batch": self.batch},
            "loss": self.loss,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Set everything from a checkpoint state (or from :meth:`state`'s own output)."""
        if self.strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            set_model_state_dict(self.model, state["model"])
            set_optimizer_state_dict(self.model, self.optim, state["optim"])
        else:
            self.model.load_state_dict(state["model"])
            self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        set_rng_state(state["rng"], {"augment": self.np_rng})
        self.epoch, self.batch = int(state["data"]["epoch"]), int(state["data"]["batch"])
        self.loss = None if state["loss"] is None else float(state["loss"])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of the current global batch; advances the position."""
        self.sampler.set_epoch(self.epoch)  # the order is a function of (seed, epoch)
        indices = list(self.sampler)
        start = self.batch * self.local_batch
        idx = torch.tensor(indices[start : start + self.local_batch])
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        x, y = self.data.tensors
        return x[idx], y[idx]

    def step(self) -> float:
        """One step: augment, forward, backward (the gradients are averaged over the ranks:
        DDP's all-reduce, FSDP2's reduce-scatter), AdamW, schedule."""
        x, y = self.next_batch()
        scale = MAX_NOISE * random.random()
        noise = self.np_rng.standard_normal(x.shape, dtype=np.float32)
        x = x + scale * torch.from_numpy(noise).to(x.device)
        self.net.train()  # type: ignore[no-untyped-call,unused-ignore]
        self.optim.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        self.optim.step()
        self.sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        self.loss = float(total) / dist.get_world_size()
        return self.loss

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full weights on the CPU, by name; under FSDP2 gathered (collective), on rank 0
        only (the other ranks get an empty dict)."""
        if self.strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return cast("dict[str, torch.Tensor]", get_model_state_dict(self.model, options=full))
        return {name: t.detach().cpu() for name, t in self.model.state_dict().items()}


def build_trainer(
    steps: int, rank: int, world: int, *, strategy: str = "ddp", device: torch.device | None = None
) -> Trainer:
    """Model (wrapped in DDP, or sharded by FSDP2; collective), AdamW, cosine schedule, sampler
    and RNGs at their step-0 state."""
    if GLOBAL_BATCH % world:
        raise ConfigError(f"the global batch {GLOBAL_BATCH} does not split over {world} ranks")
    device = device or torch.device("cpu")
    model = make_model().to(device)
    if strategy == "fsdp2":
        net = shard_model(model, device)
    else:
        net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=max(steps, 1))
    data = make_data(device)
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=SHUFFLE_SEED, drop_last=True
    )
    # per-rank streams: dropout masks and augmentation differ between ranks
    torch.manual_seed(AUG_SEED + rank)
    random.seed(AUG_SEED + rank)
    np_rng = np.random.Generator(np.random.PCG64(AUG_SEED + rank))
    return Trainer(strategy, model, net, optim, sched, sampler, data, np_rng, GLOBAL_BATCH // world)


# --------------------------------------------------------------------------- run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m apps.train_torch", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--steps", type=int, required=True, help="total training steps")
    p.add_argument("--checkpoint-dir", type=Path, required=True, help="checkpoint root")
    p.add_argument("--out", type=Path, required=True, help="HDF5 file written at completion")
    p.add_argument(
        "--strategy", choices=STRATEGIES, default="ddp",
        help="ddp: a full model on every rank (default); fsdp2: sharded by fully_shard",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=DEVICES, default="cpu",
        help="cpu: gloo (default); cuda: a GPU per rank over NCCL, where CUDA is available",
    )  # fmt: skip
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


def write_output(
    path: Path, weights: Mapping[str, torch.Tensor], steps: int, loss: float | None
) -> None:
    """Rank 0: the final weights as HDF5 datasets, with attrs ``steps`` and ``final_loss``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        for name, tensor in weights.items():
            f.create_dataset(name, data=tensor.numpy())
        f.attrs["steps"] = steps
        f.attrs["final_loss"] = float("nan") if loss is None else float(loss)
    os.replace(tmp, path)


def run_key(args: argparse.Namespace, world: int, device: torch.device) -> dict[str, Any]:
    """What defines the result: --steps sets the cosine schedule's length, each rank has its own
    RNG streams and data shard, and the strategy and the device change the arithmetic. (The
    defaults, ddp and cpu, are left out: the key of a DDP run on the CPU is what it always was.)"""
    key: dict[str, Any] = {"app": "apps.train_torch", "steps": args.steps, "ranks": world}
    if args.strategy != "ddp":
        key["strategy"] = args.strategy
    if device.type != "cpu":
        key["device"] = device.type
    return key


def train(args: argparse.Namespace, cfg: CheckpointConfig, device: torch.device) -> None:
    """Train under a Session; raises ``SystemExit(75)`` when stopped early."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = build_trainer(args.steps, rank, world, strategy=args.strategy, device=device)
    with Session(
        args.checkpoint_dir,
        comm=session_comm(),
        signals=EARLY_SIGNALS,
        **cfg.session_options(),
        run_key=run_key(args, world, device),
    ) as s:
        # FSDP2's DTensors are restored in place, into this run's shards: the template is this
        # run's sharded state dicts (building it gives a fresh optimizer its state, in every
        # run alike)
        into = None
        if args.strategy == "fsdp2":
            template = trainer.state()
            into = {"model": template["model"], "optim": template["optim"]}
        step, state = s.restore_or(trainer.state, into=into)
        trainer.load(state)  # a no-op on a fresh start
        write_pidfile(rank)
        saved = step
        while step < args.steps and not s.should_stop():
            loss = trainer.step()
            step += 1
            if s.maybe_save(step, trainer.state(), metrics={"loss": loss}):
                saved = step
            if rank == 0 and step % PROGRESS_EVERY == 0:
                print(f"step {step} epoch {trainer.epoch} loss {loss:.6f}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
        if s.stopped:
            print(f"STOPPED rank={rank} step={step} reason={s.stop_reason}", flush=True)
            return  # the Session writes the final checkpoint and raises SystemExit(75)
        if saved != step:
            s.save(step, trainer.state(), metrics={"loss": trainer.loss})
    weights = trainer.full_weights()  # collective under FSDP2
    if rank == 0:
        write_output(args.out, weights, step, trainer.loss)
        print(f"done: {step} steps, final loss {trainer.loss}, wrote {args.out}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``torchrun --nproc-per-node N -m apps.train_torch ...`` (or mpiexec, srun)."""
    args = parse_args(argv)
    try:
        # the checkpoint directory names the task (abspath: no symlinks resolved, so every rank
        # of one launch derives the same port)
        launch = find_launch(os.environ, task=os.path.abspath(args.checkpoint_dir))
    except ConfigError as exc:
        log.error("%s", exc)
        raise SystemExit(EXIT_USAGE) from None
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {launch.rank}] %(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    try:
        cfg = checkpoint_config(args)
    except ConfigError as exc:  # every rank reads the same file and fails alike: no collective
        if launch.rank == 0:
            log.error("%s", exc)
        raise SystemExit(EXIT_USAGE) from None
    device = pick_device(args.device, os.environ, launch)
    if device.type == "cuda":  # cuBLAS is deterministic only with a fixed workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    init_process_group(launch, device)
    try:
        train(args, cfg, device)
    finally:
        dist.destroy_process_group()
    # Finished, output written: a warning signal that arrives now (the walltime's, just too
    # late) must not kill the process during shutdown and turn a success into a failure.
    EARLY_SIGNALS.ignore()


if __name__ == "__main__":
    main()
