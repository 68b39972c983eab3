"""A small PyTorch training stopped by a signal under a ``Session`` and resumed: bit-identical to
an uninterrupted run with ``rng_state``/``set_rng_state``, and not without them; and
``Session.restore_or(into=)`` fills the model's own tensors.

The training draws from every stream a real one does: dropout from torch's generator, an
augmentation from a numpy ``Generator`` the loop owns and a scale from Python's ``random``;
its data comes through a shuffled ``DataLoader`` whose order is a function of the epoch (a
``torch.Generator`` seeded per epoch), so the position (epoch, batch) restores the stream.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import EverySteps, Session, rng_state, set_rng_state
from resilient.errors import ConfigError

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'resilient-hpc[torch]')"
)
pytestmark = pytest.mark.torch

STEPS, STOP_AT, BATCH, SHUFFLE_SEED = 20, 7, 8, 11


class Training:
    """The model, optimizer, data stream and random streams of one process."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(40, 6, generator=g), torch.randint(0, 2, (40,), generator=g)
        self.data = torch.utils.data.TensorDataset(x, y)
        self.aug = np.random.default_rng(5)  # the loop's own generator
        random.seed(7)
        torch.manual_seed(8)
        self.epoch, self.batch = 0, 0  # the next batch the training consumes
        self._batches: Iterator[Any] | None = None

    def next_batch(self) -> Any:
        """The batch at (epoch, batch): the loader's order is a function of the epoch."""
        if self._batches is None:
            order = torch.Generator().manual_seed(SHUFFLE_SEED + self.epoch)
            loader = torch.utils.data.DataLoader(
                self.data, batch_size=BATCH, shuffle=True, generator=order, drop_last=True
            )
            self._batches = iter(loader)
            for _ in range(self.batch):  # resuming inside an epoch: skip what was consumed
                next(self._batches)
        x, y = next(self._batches)
        self.batch += 1
        if self.batch == len(self.data) // BATCH:
            self.epoch, self.batch, self._batches = self.epoch + 1, 0, None
        return x, y

    def step(self) -> None:
        x, y = self.next_batch()
        x = x + random.random() * torch.from_numpy(self.aug.standard_normal(x.shape, np.float32))
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()

    def state(self, *, rng: bool) -> dict[str, Any]:
        state = {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "data": {"epoch": self.epoch, "batch": self.batch},
        }
        if rng:
            state["rng"] = rng_state({"aug": self.aug})
        return state

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.epoch, self.batch = int(state["data"]["epoch"]), int(state["data"]["batch"])
        if "rng" in state:
            set_rng_state(state["rng"], {"aug": self.aug})


def train(root: Path, *, rng: bool, stop_at: int | None = None) -> tuple[int, Training]:
    """Run (or resume) under a Session; a SIGUSR1 after step ``stop_at`` stops it."""
    t = Training()
    with Session(root, save_when=EverySteps(5), exit_on_stop=False, environ={}) as s:
        step, state = s.restore_or(lambda: t.state(rng=rng))
        t.load(state)
        while step < STEPS and not s.should_stop():
            t.step()
            step += 1
            s.maybe_save(step, t.state(rng=rng))
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)
    return step, t


def weights(t: Training) -> dict[str, bytes]:
    return {k: v.numpy().tobytes() for k, v in t.model.state_dict().items()}


def test_a_stopped_training_resumes_bit_identically_only_with_its_random_streams(
    tmp_path: Path,
) -> None:
    torch.use_deterministic_algorithms(True)
    step, reference = train(tmp_path / "uninterrupted", rng=True)
    assert step == STEPS
    for rng in (True, False):
        root = tmp_path / f"rng-{rng}"
        stopped, _ = train(root, rng=rng, stop_at=STOP_AT)
        assert stopped == STOP_AT  # stopped at the next should_stop, with a final save
        step, resumed = train(root, rng=rng)
        assert step == STEPS
        same = weights(resumed) == weights(reference)
        assert same is rng, f"rng={rng}: bit-identical {same}"


def test_restore_or_into_fills_the_models_own_tensors(tmp_path: Path) -> None:
    train(tmp_path, rng=True, stop_at=3)
    t = Training()
    targets = {"model": t.model.state_dict()}
    pointers = {k: v.data_ptr() for k, v in targets["model"].items()}
    with Session(tmp_path, exit_on_stop=False, environ={}) as s:
        step, state = s.restore_or(lambda: t.state(rng=True), into=targets)
    assert step == 3
    for k, v in state["model"].items():
        assert v is targets["model"][k] and v.data_ptr() == pointers[k], k
        assert t.model.state_dict()[k].data_ptr() == pointers[k]  # the model itself holds it
    wrong = {"model": {"0.weight": torch.zeros(16, 5), "0.bias": torch.zeros(16)}}
    with Session(tmp_path, exit_on_stop=False, environ={}) as s, pytest.raises(ConfigError) as info:
        s.restore_or(lambda: t.state(rng=True), into=wrong)
    assert "model/0.weight" in str(info.value), info.value
