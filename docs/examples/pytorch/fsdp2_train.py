"""A small FSDP2 training that checkpoints its sharded state and resumes on any number of ranks.

Usage (CPU, gloo)::

    torchrun --standalone --nproc-per-node 4 docs/examples/pytorch/fsdp2_train.py CKPT 4
    torchrun --standalone --nproc-per-node 2 docs/examples/pytorch/fsdp2_train.py CKPT 6

The first run trains steps 1-4 on 4 ranks, checkpointing every 2 steps; the second resumes from
step 4 on 2 ranks and trains steps 5 and 6. Each prints ``step N loss L`` on rank 0.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resilient import CheckpointManager, EverySteps, Replicated

BATCH = 12  # samples per step, split over the ranks


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, sharded by FSDP2 over all ranks, and its optimizer (the same on any rank
    count: the seed decides the weights before they are sharded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's share of the step's batch (a function of the step alone)."""
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 5, generator=gen)
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


def checkpoint_state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> Any:
    """The state to save: the sharded state dicts (their DTensors are this rank's shards).
    What is not a DTensor (the optimizer's step counts and hyperparameters, the step) is the
    same on every rank: Replicated says so, which lets another rank count restore it."""
    return {
        "model": get_model_state_dict(model),
        "train": Replicated({"optim": get_optimizer_state_dict(model, optim), "step": step}),
    }


def restore(mgr: CheckpointManager, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Restore the newest checkpoint into this run's DTensors (any rank count); its step."""
    template = checkpoint_state(model, optim, 0)  # this run's mesh and placements
    _, state = mgr.restore(into=template)  # each rank reads the pieces its shards need
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["train"]["optim"])
    return int(state["train"]["step"])


def main(checkpoint_dir: str, steps: int) -> dict[str, torch.Tensor]:
    """Train to ``steps``, resuming from the newest checkpoint; the final global weights."""
    model, optim = build()
    with CheckpointManager(checkpoint_dir, comm=dist.group.WORLD, save_when=EverySteps(2)) as mgr:
        first = restore(mgr, model, optim) if mgr.latest_step() is not None else 0
        for step in range(first + 1, steps + 1):
            loss = train_step(model, optim, step)
            if dist.get_rank() == 0:
                print(f"step {step} loss {loss:.6f}", flush=True)
            if mgr.should_save(step):
                mgr.save(step, checkpoint_state(model, optim, step))
    return {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(sys.argv[1], int(sys.argv[2]))
    dist.destroy_process_group()
