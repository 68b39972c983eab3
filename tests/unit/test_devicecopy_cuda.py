"""Device staging with CUDA tensors (marked ``cuda``: skipped where ``torch.cuda.is_available()``
is false, e.g. CI). The logic is tested on the CPU in ``test_devicecopy.py``; these run the CUDA
calls: the pinned arena, the stream of the library's own, the copies both ways (a restore's
copied as each tensor is verified, into the given tensors or new ones on the saved device), and
an NCCL process group as ``comm`` (one process: all one GPU allows)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resilient.checkpoint.manager import CheckpointManager
from resilient.io import devicecopy
from resilient.io.devicecopy import CudaEngine, Uploads
from resilient.io.staging import allocate as host_allocate

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'resilient-hpc[torch]')"
)
pytestmark = [
    pytest.mark.torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def trained(seed: int, steps: int = 3) -> tuple[Any, Any]:
    """A bf16 model and its AdamW on cuda:0, after ``steps`` steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 8)
    ).to(device="cuda:0", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(16, 256, device="cuda:0", dtype=torch.bfloat16)).float().pow(2)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    return model, opt


def snapshot(tree: Any) -> Any:
    """The bytes of every tensor of ``tree`` (on the host), for bit-identical comparisons."""
    if isinstance(tree, torch.Tensor):
        return (tree.dtype, tuple(tree.shape), bytes(tree.detach().cpu().contiguous()
                                                     .reshape(-1).view(torch.uint8).numpy()))  # fmt: skip
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [snapshot(v) for v in tree]
    return tree


def devices_of(tree: Any) -> set[str]:
    if isinstance(tree, torch.Tensor):
        return {str(tree.device)}
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ()
    return set().union(*map(devices_of, values)) if values else set()


def test_async_save_of_a_bf16_model_and_adamw_restores_bit_identical(tmp_path: Path) -> None:
    model, opt = trained(0)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = snapshot(state)
    with CheckpointManager(tmp_path) as m:
        m.save(1, state, blocking=False)
        trained_more = model(torch.randn(4, 256, device="cuda:0", dtype=torch.bfloat16))
        trained_more.float().sum().backward()
        opt.step()  # changes the parameters and AdamW's moments right after save returned
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        m.wait()
        devices = m._pipeline.devices
        assert devices.is_pinned and devices.nbytes >= sum(
            t.numel() * t.element_size() for t in model.state_dict().values()
        )
        _, got = m.restore()
        assert snapshot(got) == want and devices_of(got["model"]) == {"cuda:0"}
        fresh, fresh_opt = trained(1)
        into = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        weight = into["model"]["0.weight"]
        _, filled = m.restore(into=into)
        assert filled["model"]["0.weight"] is weight and weight.device.type == "cuda"
        assert snapshot(filled) == want
        cpu_into = {k: {n: t.cpu() for n, t in v.items()} for k, v in
                    {"model": fresh.state_dict()}.items()}  # fmt: skip
        _, on_cpu = m.restore(into=cpu_into)  # the target's device wins
        assert snapshot(on_cpu["model"]) == want["model"]
        assert devices_of(on_cpu["model"]) == {"cpu"}
    assert m._pipeline.devices.nbytes == 0  # close() unpinned and released the arena


def test_the_copy_sees_kernels_queued_before_save_on_another_stream(tmp_path: Path) -> None:
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 24, device="cuda:0")
    with torch.cuda.stream(side), CheckpointManager(tmp_path) as m:
        x.fill_(3.0)  # queued on the caller's current stream (side), maybe still running
        m.save(1, {"x": x})
        _, got = m.restore()
    assert bool((got["x"] == 3.0).all())


@pytest.fixture
def nccl(tmp_path: Path) -> Iterator[Any]:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_an_nccl_process_group_as_comm_saves_and_restores(nccl: Any, tmp_path: Path) -> None:
    model, opt = trained(2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = snapshot(state)
    with CheckpointManager(tmp_path / "ck", comm=nccl.group.WORLD) as m:
        assert type(m.comm).__name__ == "TorchComm"
        m.save(1, state, blocking=False)
        m.save(2, state)
        _, got = m.restore()
    assert snapshot(got) == want


class RecordingCudaEngine(CudaEngine):
    """The CUDA engine, recording each restore's copies: the targets as issued, and whether
    each source was page-locked (what makes the copy asynchronous)."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[list[Any]] = []
        self.pinned_sources: list[bool] = []

    def uploads(self, devices: Any) -> Uploads:
        self.sessions.append([])
        return _Recorded(super().uploads(devices), self)


class _Recorded(Uploads):
    def __init__(self, inner: Uploads, engine: RecordingCudaEngine) -> None:
        self.inner, self.engine = inner, engine

    def copy(self, host: Any, target: Any) -> None:
        self.engine.sessions[-1].append(target)
        self.engine.pinned_sources.append(bool(host.is_pinned()))
        self.inner.copy(host, target)

    def finish(self) -> None:
        self.inner.finish()


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> RecordingCudaEngine:
    recording = RecordingCudaEngine()
    monkeypatch.setattr(devicecopy, "default_engine", lambda: recording)
    return recording


def big(seed: float) -> dict[str, Any]:
    """Eight tensors of 8 MiB on cuda:0 (a read pipelined piece by piece), bf16 and fp32."""
    out = {}
    for i in range(8):
        dtype, rows = (torch.float32, 2048) if i % 2 else (torch.bfloat16, 4096)
        out[f"w{i}"] = torch.full((rows, 1024), seed + i, device="cuda:0", dtype=dtype)
    return out


def test_restore_into_cuda_tensors_copies_each_once_verified_and_allocates_nothing(
    tmp_path: Path, engine: RecordingCudaEngine
) -> None:
    want = snapshot(big(1.0))
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": big(1.0)})
    targets = big(0.0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with CheckpointManager(tmp_path) as m:
        _, got = m.restore(into={"t": targets})
        assert torch.cuda.memory_allocated() == before  # into the given tensors, no new ones
        assert all(got["t"][k] is targets[k] for k in targets)
        assert snapshot(targets) == want
        (session,) = engine.sessions
        assert sorted(map(id, session)) == sorted(map(id, targets.values()))
        assert engine.pinned_sources == [True] * len(targets)


def test_a_corrupt_newest_checkpoint_falls_back_fully_into_cuda_targets(
    tmp_path: Path, engine: RecordingCudaEngine
) -> None:
    import numpy as np

    want = snapshot(big(1.0))
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": big(1.0)})
        m.save(2, {"t": big(20.0)})
    path = tmp_path / "step_00000002" / "rank_00000.h5"
    data = bytearray(path.read_bytes())
    at = data.find(np.full(64, 25.0, np.float32).tobytes())  # inside w5 (fp32, 25.0)
    assert at > 0
    data[at + 4096] ^= 0xFF
    path.write_bytes(bytes(data))
    targets = big(0.0)
    with CheckpointManager(tmp_path) as m:
        step, _ = m.restore(into={"t": targets})
        assert m.passed_over == (2,)
    assert step == 1 and snapshot(targets) == want
    failed, fallback = engine.sessions
    assert id(targets["w5"]) not in set(map(id, failed)) and len(fallback) == len(targets)
    assert all(engine.pinned_sources)


def test_restore_gives_new_tensors_on_the_saved_device_through_the_arena(
    tmp_path: Path, engine: RecordingCudaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = big(3.0)
    want = snapshot(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": state})
    del state
    pageable: list[Any] = []

    def allocate(*args: Any, **kwargs: Any) -> Any:
        pageable.append(args)
        return host_allocate(*args, **kwargs)

    monkeypatch.setattr("resilient.checkpoint.reading.allocate", allocate)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with CheckpointManager(tmp_path) as m:
        _, got = m.restore()
        grown = torch.cuda.memory_allocated() - before
        assert pageable == []  # no host copy besides the pinned arena
        assert nbytes <= grown <= nbytes + 512 * len(got["t"])  # one allocation per tensor
        assert snapshot(got) == {"t": want} and devices_of(got) == {"cuda:0"}
        (session,) = engine.sessions
        assert sorted(map(id, session)) == sorted(map(id, got["t"].values()))
        assert m._pipeline.devices.is_pinned
