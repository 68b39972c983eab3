"""DTensor states (FSDP2, tensor parallelism) over gloo; driven by tests/test_dtensor.py.

Usage: python tests/torch/dtensor_scenario.py ROOT  (started once per rank, env:// variables set)

On 4 ranks it saves; on any other count it restores what 4 ranks saved. Under ROOT:

* ``ex_full``, ``ex``: the docs' FSDP2 example (docs/examples/pytorch/fsdp2_train.py) run to
  step 4 uninterrupted, and run to step 2 then resumed to step 4 from new objects: the same
  weights, bit for bit. ``global_fsdp.npz``: the global model and optimizer state of step 4
  (rank 0), ``global_fsdp.json`` the optimizer's param groups.
* ``tp``: a model under FSDP2 over tensor parallelism (a 2x2 mesh: ``_StridedShard``,
  ``Shard(1)``, a replicated bias) after one step, restored onto the same mesh at once;
  ``global_tp.npz`` its global state.

On N != 4 ranks: the FSDP2 checkpoint of step 4 (a copy of ``ex``) restored into the example's
model on N ranks (global tensors equal the saved ones), 2 more steps, against a new FSDP2 run of
N ranks loaded with the same global state through torch's own full state dicts (the same
weights, bit for bit); and the tensor-parallel checkpoint restored into a model under tensor
parallelism over N ranks. Each rank prints ``RESULT <json>``; any failure raises.
"""

from __future__ import annotations

import faulthandler
import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from resilient import CheckpointManager, Replicated

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "pytorch"))
import fsdp2_train as example  # type: ignore[import-not-found]

faulthandler.register(signal.SIGQUIT)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
FULL = StateDictOptions(full_state_dict=True)


def global_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The global (full) tensors of a model's and its optimizer's state, by flat name; and the
    optimizer's param groups (JSON) under ``"groups"``."""
    out: dict[str, Any] = {}
    msd: dict[str, Any] = get_model_state_dict(model, options=FULL)
    for k, v in msd.items():
        out[f"model/{k}"] = v.detach().numpy().copy()
    osd: Any = get_optimizer_state_dict(model, optim, options=FULL)
    for fqn, entry in osd["state"].items():
        for k, v in entry.items():
            out[f"optim/{fqn}/{k}"] = v.detach().numpy().copy()
    out["groups"] = osd["param_groups"]
    return out


def full_of(state: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """The global tensors of a restored (sharded) state, by flat name as :func:`global_state`."""
    for k, v in state.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            full_of(v, name, out)
        elif isinstance(v, torch.Tensor):
            full = v.full_tensor() if isinstance(v, DTensor) else v
            out[name] = full.detach().numpy().copy()
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit for bit, every array."""
    arrays = sorted(k for k in a if k != "groups")
    assert arrays == sorted(k for k in b if k != "groups"), (arrays, sorted(b))
    for k in arrays:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def save_global(path: Path, state: dict[str, Any]) -> None:
    if rank == 0:
        np.savez(path.with_suffix(".npz"), **{k: v for k, v in state.items() if k != "groups"})
        path.with_suffix(".json").write_text(json.dumps(state["groups"]))
    dist.barrier()


def load_global(path: Path) -> dict[str, Any]:
    with np.load(path.with_suffix(".npz")) as f:
        out: dict[str, Any] = {k: f[k] for k in f.files}
    out["groups"] = json.loads(path.with_suffix(".json").read_text())
    return out


def restored_global(state: dict[str, Any]) -> dict[str, Any]:
    """A restored ``checkpoint_state``'s global tensors, named as :func:`global_state` names
    them (the optimizer's ``state`` entries)."""
    model = full_of(state["model"], "model", {})
    optim = full_of(state["train"]["optim"]["state"], "optim", {})
    return {**model, **optim}


# --------------------------------------------------------------------------- FSDP2


def check_gradients_are_averaged() -> None:
    """FSDP2's gradients over gloo are the full batch's (PyTorch issue 162338 reports gloo's
    AVG summing; with torch 2.14 it averages, so the example needs no
    ``set_force_sum_reduction_for_comms(True)``: this says so if that changes)."""
    model, _ = example.build()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    plain.load_state_dict(get_model_state_dict(model, options=FULL))
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(example.BATCH, 8, generator=gen),
        torch.randn(example.BATCH, 5, generator=gen),
    )
    mine = slice(rank * example.BATCH // size, (rank + 1) * example.BATCH // size)
    losses: list[Any] = [
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]),
        torch.nn.functional.mse_loss(plain(x), y),
    ]
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        got: Any = p.grad
        want: Any = q.grad
        assert torch.allclose(got.full_tensor(), want, rtol=1e-4, atol=1e-6), name


def fsdp_on_four(root: Path) -> dict[str, Any]:
    check_gradients_are_averaged()
    full = example.main(str(root / "ex_full"), 4)  # uninterrupted
    example.main(str(root / "ex"), 2)  # stops after step 2 ...
    resumed = example.main(str(root / "ex"), 4)  # ... and resumes from new objects
    for k in full:
        assert full[k].numpy().tobytes() == resumed[k].numpy().tobytes(), k
    model, optim = example.build()
    with CheckpointManager(root / "ex", comm=dist.group.WORLD) as mgr:
        step = example.restore(mgr, model, optim)
    save_global(root / "global_fsdp", global_state(model, optim))
    return {"resumed_step": step, "tensors": len(full)}


def fsdp_elsewhere(root: Path) -> dict[str, Any]:
    mine = root / f"ex_{size}"  # a copy: the runs of 2 and 3 ranks each continue from step 4
    if rank == 0:
        shutil.copytree(root / "ex", mine)
    dist.barrier()
    saved = load_global(root / "global_fsdp")
    model, optim = example.build()
    with CheckpointManager(mine, comm=dist.group.WORLD) as mgr:
        template = example.checkpoint_state(model, optim, 0)
        step, state = mgr.restore(into=template)
    same(restored_global(state), saved)  # the global tensors, bit for bit
    assert all(isinstance(v, DTensor) for v in state["model"].values())
    assert all(state["model"][k] is template["model"][k] for k in template["model"])
    example.set_model_state_dict(model, state["model"])
    example.set_optimizer_state_dict(model, optim, state["train"]["optim"])
    for s in (5, 6):
        example.train_step(model, optim, s)
    after = global_state(model, optim)
    # a new FSDP2 run of this size, loaded with the same global state by torch itself
    fresh, fresh_optim = example.build()
    set_model_state_dict(
        fresh, {k[6:]: torch.from_numpy(v) for k, v in saved.items() if k.startswith("model/")},
        options=FULL,
    )  # fmt: skip
    osd: dict[str, Any] = {"state": {}, "param_groups": saved["groups"]}
    for k, v in saved.items():
        if k.startswith("optim/"):
            fqn, _, key = k[6:].rpartition("/")
            osd["state"].setdefault(fqn, {})[key] = torch.from_numpy(v)
    set_optimizer_state_dict(fresh, fresh_optim, osd, options=FULL)
    for s in (5, 6):
        example.train_step(fresh, fresh_optim, s)
    same(after, global_state(fresh, fresh_optim))
    return {"restored_step": step}


# --------------------------------------------------------------------------- tensor parallelism


def tp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A two-layer MLP under tensor parallelism over all ranks; on 4 ranks, FSDP2 over it
    (a 2x2 mesh: dp x tp)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    if size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    else:
        mesh = tp = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if size == 4:
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def tp_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "train": Replicated({"optim": get_optimizer_state_dict(model, optim)}),
    }


def tp_on_four(root: Path) -> dict[str, Any]:
    model, optim, _ = tp_model()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    model(x).square().mean().backward()
    optim.step()
    state = tp_state(model, optim)
    placements = sorted({str(v.placements) for v in state["model"].values()})
    with CheckpointManager(root / "tp", comm=dist.group.WORLD) as mgr:
        mgr.save(1, state)
        again, again_optim, _ = tp_model()
        _, got = mgr.restore(into=tp_state(again, again_optim))  # the same mesh
    saved = global_state(model, optim)
    same(restored_global(got), saved)
    save_global(root / "global_tp", saved)
    return {"placements": placements}


def tp_elsewhere(root: Path) -> dict[str, Any]:
    model, optim, _ = tp_model()
    with CheckpointManager(root / "tp", comm=dist.group.WORLD) as mgr:
        _, got = mgr.restore(into=tp_state(model, optim))
    same(restored_global(got), load_global(root / "global_tp"))
    return {}


def main() -> None:
    root = Path(sys.argv[1])
    if size == 4:
        out = {**fsdp_on_four(root), **tp_on_four(root)}
    else:
        out = {**fsdp_elsewhere(root), **tp_elsewhere(root)}
    print("RESULT " + json.dumps({"rank": rank, **out}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
