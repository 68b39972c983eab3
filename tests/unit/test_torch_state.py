"""PyTorch state dicts: tensors (bfloat16, float16, 0-d, empty, non-contiguous), nested model
and optimizer state, restore as tensors and in place, fallback past a corrupt checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from resilient.checkpoint.manager import CheckpointManager
from resilient.errors import ConfigError

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'resilient-hpc[torch]')"
)
pytestmark = pytest.mark.torch


def trained(seed: int, steps: int = 3) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, where

        def raw(t: Any) -> bytes:
            return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())

        assert raw(got) == raw(want), where
        return
    assert type(got) is type(want) or (isinstance(want, dict) and isinstance(got, dict)), where
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, where


def test_state_dicts_round_trip_as_tensors(tmp_path: Path) -> None:
    model, opt, sched = trained(0)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
             "rng": torch.get_rng_state()}  # fmt: skip
    with CheckpointManager(tmp_path) as m:
        m.save(3, state)
        step, got = m.restore()
    assert step == 3
    assert_same(got, state)
    assert list(got["optim"]["state"]) == [0, 1, 2, 3]  # integer keys come back as integers
    fresh, fresh_opt, fresh_sched = trained(1, steps=0)
    fresh.load_state_dict(got["model"])
    fresh_opt.load_state_dict(got["optim"])
    fresh_sched.load_state_dict(got["sched"])
    x = torch.randn(2, 8)
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).to(torch.bfloat16).reshape(3, 4),
        torch.linspace(0, 1, 7, dtype=torch.float16),
        torch.tensor(3.5),
        torch.zeros(0, 5),
        torch.arange(24.0).reshape(4, 6).t(),  # non-contiguous
        torch.tensor([True, False]),
        torch.arange(5, dtype=torch.int64)[::2],
    ],
    ids=["bfloat16", "float16", "0-d", "empty", "transposed", "bool", "strided"],
)
def test_tensor_leaves(tmp_path: Path, tensor: Any) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": tensor, "nested": [tensor, {"again": tensor}]})
        _, got = m.restore()
    for leaf in (got["t"], got["nested"][0], got["nested"][1]["again"]):
        assert_same(leaf, tensor)


def test_bfloat16_is_readable_without_torch(tmp_path: Path) -> None:
    t = torch.tensor([1.0, -2.5, 3.25], dtype=torch.bfloat16)
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"w": t})
    with h5py.File(tmp_path / "step_00000001" / "rank_00000.h5", "r") as f:
        words = f["rank_00000/w"][()]
    assert (
        words.dtype == np.uint16
        and words.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    )
    tree = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())["ranks"][0][
        "tree"
    ]
    assert ["s", "w", ["a", "w", {"torch": "bfloat16"}]] in tree[1]


def test_restore_into_the_model_copies_in_place(tmp_path: Path) -> None:
    model, opt, _ = trained(0)
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        target, target_opt, _ = trained(5, steps=0)
        weight = target[0].weight
        _, got = m.restore(into={"model": target.state_dict()})
        assert got["model"]["0.weight"].data_ptr() == weight.data_ptr()  # no second copy
        target.load_state_dict(got["model"])
        target_opt.load_state_dict(got["optim"])
    assert torch.equal(target[0].weight, model[0].weight)


def test_restore_into_a_mismatched_model_is_a_clear_error(tmp_path: Path) -> None:
    model, _, _ = trained(0)
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"model": model.state_dict()})
        other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        with pytest.raises(ConfigError, match=r"'model/0.weight' is torch.float32 \(32, 8\) here"):
            m.restore(into={"model": other.state_dict()})
        half = {"model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}}
        with pytest.raises(ConfigError, match=r"torch.bfloat16 .* but torch.float32"):
            m.restore(into=half)
        step, _ = m.restore()  # the checkpoint was not quarantined
    assert step == 1


def test_fallback_to_an_older_checkpoint_when_the_newest_is_corrupt(tmp_path: Path) -> None:
    model, opt, _ = trained(0)
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        model2, opt2, _ = trained(0, steps=4)
        m.save(2, {"model": model2.state_dict(), "optim": opt2.state_dict()})
    path = tmp_path / "step_00000002"
    doc = json.loads((path / "manifest.json").read_text())
    cols = doc["ranks"][0]["datasets"]
    weight = {"offset": cols["offsets"][cols["names"].index("model/0.weight")]}
    raw = bytearray((path / "rank_00000.h5").read_bytes())
    raw[weight["offset"] + 5] ^= 0xFF  # a flipped bit inside the weights
    (path / "rank_00000.h5").write_bytes(bytes(raw))
    with CheckpointManager(tmp_path) as m:
        step, got = m.restore()
    assert step == 1
    assert_same(got["model"], model.state_dict())
