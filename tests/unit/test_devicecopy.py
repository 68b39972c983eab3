"""Device staging (:mod:`resilient.io.devicecopy`) on the CPU: CPU tensors take the path of CUDA
tensors through :class:`HostEngine` (no pinning, no streams), so the staging logic, its reuse,
its release, the fallback when pinning fails and the asynchronous save's contract run in CI.
The CUDA calls themselves are tested in ``test_devicecopy_cuda.py`` (marked ``cuda``)."""

from __future__ import annotations

import logging
import mmap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient.checkpoint.manager import CheckpointManager
from resilient.errors import ConfigError, ResilientError
from resilient.io import devicecopy, fileio
from resilient.io.devicecopy import DeviceStaging, HostEngine, PinError, Uploads
from resilient.io.staging import allocate as host_allocate

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'resilient-hpc[torch]')"
)
pytestmark = pytest.mark.torch


class CountingEngine(HostEngine):
    """A host engine that counts pins and unpins, can be told to fail pinning, and records
    each restore's copies to the device (in ``events``, beside what a test adds there)."""

    def __init__(self, *, pin_fails: bool = False) -> None:
        self.pin_fails = pin_fails
        self.pinned: list[int] = []
        self.unpinned: list[int] = []
        self.copies = 0
        self.sessions: list[list[Any]] = []  # per restore (uploads()): the targets copied into
        self.events: list[tuple[str, Any]] = []
        self.uploaded = threading.Event()

    def pin(self, region: mmap.mmap) -> None:
        if self.pin_fails:
            raise PinError("cannot lock memory (injected)")
        self.pinned.append(len(region))

    def unpin(self, region: mmap.mmap) -> None:
        self.unpinned.append(len(region))

    def to_host(self, pairs: Any) -> None:
        self.copies += 1
        super().to_host(pairs)

    def uploads(self, devices: Any) -> Uploads:
        self.sessions.append([])
        return RecordedUploads(super().uploads(devices), self)


class RecordedUploads(Uploads):
    """Copies that an engine records as they are issued."""

    def __init__(self, inner: Uploads, engine: CountingEngine) -> None:
        self.inner, self.engine = inner, engine

    def copy(self, host: Any, target: Any) -> None:
        self.engine.sessions[-1].append(target)
        self.engine.events.append(("upload", target))
        self.engine.uploaded.set()
        self.inner.copy(host, target)

    def finish(self) -> None:
        self.engine.events.append(("finish", None))
        self.inner.finish()


def state(seed: float = 0.0) -> dict[str, Any]:
    return {
        "big": torch.full((512, 1024), seed, dtype=torch.float32),  # 2 MiB: page-aligned
        "bf16": (torch.arange(12, dtype=torch.float32) + seed).to(torch.bfloat16).reshape(3, 4),
        "strided": (torch.arange(24.0) + seed).reshape(4, 6).t(),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(seed),
    }


def raw(t: Any) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def test_stage_copies_each_tensor_into_one_arena_reused_while_the_structure_holds() -> None:
    engine = CountingEngine()
    staging = DeviceStaging(engine)
    first = staging.stage(state(1.0))
    assert staging.is_pinned and engine.pinned == [staging.nbytes]
    assert first["bf16"].dtype == np.dtype("<u2")  # stored as words, like to_numpy
    assert first["big"].ctypes.data % mmap.PAGESIZE == 0  # O_DIRECT takes it as it is
    for name, tensor in state(1.0).items():
        assert first[name].tobytes() == raw(tensor), name
    again = staging.stage(state(2.0))
    assert engine.pinned == [staging.nbytes]  # the same arena: nothing mapped or pinned again
    assert all(again[k].ctypes.data == first[k].ctypes.data for k in again)
    assert again["big"][0, 0] == 2.0
    assert staging.nbytes < 2 * (512 * 1024 * 4)  # the state's bytes plus alignment


def test_a_structure_change_maps_a_new_arena_and_unpins_the_old() -> None:
    engine = CountingEngine()
    staging = DeviceStaging(engine)
    staging.stage(state())
    before = staging.nbytes
    changed = {**state(), "big": torch.zeros(256, 1024)}
    staging.stage(changed)
    assert engine.unpinned == [before] and len(engine.pinned) == 2
    renamed = {("other" if k == "scalar" else k): v for k, v in changed.items()}
    staging.stage(renamed)
    assert len(engine.pinned) == 3


def test_close_unpins_and_releases() -> None:
    engine = CountingEngine()
    staging = DeviceStaging(engine)
    staging.stage(state())
    held = staging.nbytes
    staging.close()
    assert staging.nbytes == 0 and not staging.is_pinned and engine.unpinned == [held]
    staging.close()  # twice: nothing more
    assert engine.unpinned == [held]


def test_pinning_that_fails_falls_back_to_pageable_memory_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = CountingEngine(pin_fails=True)
    staging = DeviceStaging(engine)
    with caplog.at_level(logging.DEBUG, logger=devicecopy.__name__):
        got = staging.stage(state(3.0))
        staging.stage({**state(), "big": torch.zeros(8)})  # a new arena, pinning fails again
    assert not staging.is_pinned and got["big"][0, 0] == 3.0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "pageable" in warnings[0].getMessage()
    staging.close()
    assert engine.unpinned == []  # never pinned: nothing to unpin


def test_without_cuda_the_default_engine_copies_nothing() -> None:
    staging = DeviceStaging()
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the default engine is the CUDA one")
    assert not staging.wants(torch.zeros(3))


@pytest.fixture
def host_engine(monkeypatch: pytest.MonkeyPatch) -> CountingEngine:
    """Every manager's device staging takes CPU tensors through a counting host engine."""
    engine = CountingEngine()
    monkeypatch.setattr(devicecopy, "default_engine", lambda: engine)
    return engine


def test_async_save_keeps_the_bytes_of_when_save_returned(
    tmp_path: Path, host_engine: CountingEngine
) -> None:
    tensors = state(1.0)
    want = {k: v.clone() for k, v in tensors.items()}
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": tensors, "n": 7}, blocking=False)
        for t in tensors.values():  # the caller changes the state at once
            t.add_(100.0) if t.dtype != torch.bool else None
        m.wait()
        assert m._pipeline._staging.nbytes == 0  # no second host copy of the device tensors
        assert m._pipeline.devices.nbytes > 0
        _, got = m.restore()
    assert got["n"] == 7
    for k, v in want.items():
        assert got["t"][k].dtype == v.dtype and raw(got["t"][k]) == raw(v), k


def test_saves_reuse_the_arena_and_close_releases_it(
    tmp_path: Path, host_engine: CountingEngine
) -> None:
    with CheckpointManager(tmp_path) as m:
        for step in range(3):
            m.save(step, {"t": state(float(step))}, blocking=step % 2 == 0)
        m.wait()
        _, got = m.restore()
        assert host_engine.copies == 3 and len(host_engine.pinned) == 1
    assert host_engine.unpinned == host_engine.pinned  # released by close()
    assert raw(got["t"]["big"]) == raw(state(2.0)["big"])


def test_sync_save_writes_from_the_arena(tmp_path: Path, host_engine: CountingEngine) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": state(5.0)})
        assert m._pipeline.devices.nbytes > 0
        into = {"t": {k: torch.empty_like(v) for k, v in state().items()}}
        _, got = m.restore(into=into)
    assert got["t"]["big"] is into["t"]["big"]
    for k, v in state(5.0).items():
        assert raw(into["t"][k]) == raw(v), k


def test_restore_into_goes_through_the_arena_that_the_next_save_reuses(
    tmp_path: Path, host_engine: CountingEngine
) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": state(4.0), "x": np.arange(3.0)})
    with CheckpointManager(tmp_path) as m:  # a restart: no arena yet
        tensors = {k: torch.empty_like(v) for k, v in state().items()}
        into: dict[str, Any] = {"t": tensors, "x": np.zeros(3)}
        _, got = m.restore(into=into)
        assert len(host_engine.sessions) == 1 and len(host_engine.pinned) == 2  # one per manager
        assert got["t"]["bf16"] is tensors["bf16"] and got["x"] is into["x"]
        for k, v in state(4.0).items():
            assert raw(tensors[k]) == raw(v), k
        m.save(2, into)  # the same structure: the restore's arena is the save's
        assert len(host_engine.pinned) == 2 and host_engine.copies == 2


def test_a_corrupt_checkpoint_leaves_device_targets_untouched(
    tmp_path: Path, host_engine: CountingEngine
) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(1 << 18)})
    path = tmp_path / "step_00000001" / "rank_00000.h5"
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0xFF  # inside the tensor's bytes (the file ends with them)
    path.write_bytes(bytes(data))
    target = torch.zeros(1 << 18)
    with CheckpointManager(tmp_path) as m, pytest.raises(ResilientError):
        m.restore(into={"w": target})
    assert host_engine.sessions == [[]] and not bool(target.any())


def _saved_on(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Make every tensor leaf of the next saves read as saved on ``device``."""
    from resilient.model import arrays, payload

    real = arrays.leaf_meta

    def on_device(value: Any) -> Any:
        meta = real(value)
        return {**meta, "device": device} if meta and "torch" in meta else meta

    monkeypatch.setattr(payload, "leaf_meta", on_device)


@pytest.mark.parametrize("device", ["cuda:0", "cuda:99"])
def test_a_tensor_of_an_absent_device_comes_back_on_the_cpu_with_one_log_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    device: str,
) -> None:
    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("cuda:0 exists here")
    with CheckpointManager(tmp_path) as m:
        with monkeypatch.context() as patch:
            _saved_on(patch, device)
            state = {"a": torch.ones(3), "b": [torch.zeros(2, dtype=torch.bfloat16)]}
            m.save(1, state, static={"mesh": torch.arange(4.0)})  # static data read apart
        with caplog.at_level(logging.INFO, logger="resilient"):
            _, got = m.restore()  # one line for the state and the static data
        into = {"a": torch.empty(3), "b": [torch.empty(2, dtype=torch.bfloat16)],
                "mesh": torch.empty(4)}  # fmt: skip
        _, filled = m.restore(into=into)  # the target's device wins: not an error
    assert got["a"].device.type == "cpu" and torch.equal(got["a"], torch.ones(3))
    assert got["b"][0].dtype == torch.bfloat16 and got["mesh"].device.type == "cpu"
    said = [r for r in caplog.records if device in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert filled["a"] is into["a"] and torch.equal(into["a"], torch.ones(3))


def test_restore_into_a_target_of_another_shape_or_dtype_names_the_leaf(
    tmp_path: Path, host_engine: CountingEngine
) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": state()})
        for bad in (torch.empty(3, 4), torch.empty(3, 5, dtype=torch.bfloat16)):
            with pytest.raises(ConfigError, match="bf16"):
                m.restore(into={"t": {**state(), "bf16": bad}})


def test_a_non_contiguous_target_is_filled_in_place(tmp_path: Path) -> None:
    src = torch.arange(24.0).reshape(6, 4)
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"w": src})
        target = torch.zeros(4, 6).t()  # not contiguous: no view to read into
        _, got = m.restore(into={"w": target})
    assert got["w"] is target and torch.equal(target, src)


@pytest.mark.filterwarnings("ignore:ComplexHalf support")
def test_a_dtype_that_cannot_be_stored_names_the_leaf() -> None:
    staging = DeviceStaging(CountingEngine())
    with pytest.raises(ConfigError, match="'q'"):
        staging.stage({"q": torch.zeros(2, dtype=torch.complex32)})


def four(seed: float) -> dict[str, Any]:
    """Four tensors of 3 MiB (each read in two pieces), each of its own value."""
    return {k: torch.full((768, 1024), seed + i) for i, k in enumerate("abcd")}


def logged_reads(monkeypatch: pytest.MonkeyPatch, engine: CountingEngine) -> list[bool]:
    """Log each read of a restore's file into ``engine.events``; before the sixth (the third
    tensor's second piece), wait until a copy to the device was issued (what it says, per
    wait, is returned)."""
    real = fileio._preadv_all
    waited: list[bool] = []

    def read(reader: fileio.RangeReader, bufs: Any, pos: int, total: int | None = None) -> None:
        if engine.sessions:  # (a restore's reads: its copies are set up first)
            if sum(kind == "read" for kind, _ in engine.events) == 5:
                waited.append(engine.uploaded.wait(10.0))
            engine.events.append(("read", pos))
        real(reader, bufs, pos, total)

    monkeypatch.setattr(fileio, "_preadv_all", read)
    return waited


def test_restore_into_copies_each_tensor_once_verified_while_the_next_are_read(
    tmp_path: Path, host_engine: CountingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": four(1.0)})
    with CheckpointManager(tmp_path) as m:
        waited = logged_reads(monkeypatch, host_engine)
        targets = four(0.0)
        m.restore(into={"t": targets})
    for k, v in four(1.0).items():
        assert torch.equal(targets[k], v), k
    events = host_engine.events
    (session,) = host_engine.sessions
    assert sorted(map(id, session)) == sorted(map(id, targets.values()))  # each once
    assert waited == [True]  # a copy was issued before the last tensor was read
    ups = [i for i, (kind, _) in enumerate(events) if kind == "upload"]
    for n, at in enumerate(ups):  # each after both pieces of its tensor were read
        assert sum(kind == "read" for kind, _ in events[:at]) >= 2 * (n + 1)
    assert ups[0] < max(i for i, (kind, _) in enumerate(events) if kind == "read")
    assert events[-1] == ("finish", None)  # one synchronisation, at the end


def test_a_checksum_mismatch_stops_later_copies_and_the_fallback_fills_the_targets(
    tmp_path: Path, host_engine: CountingEngine
) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"t": four(1.0)})
        m.save(2, {"t": four(10.0)})
    path = tmp_path / "step_00000002" / "rank_00000.h5"
    data = bytearray(path.read_bytes())
    at = {k: data.find(np.full(256, 10.0 + i, np.float32).tobytes()) for i, k in enumerate("abcd")}
    in_file = sorted(at, key=at.__getitem__)
    data[at[in_file[2]] + 4096] ^= 0xFF  # the third tensor in the file fails its checksum
    path.write_bytes(bytes(data))
    targets = four(0.0)
    name = {id(t): k for k, t in targets.items()}
    with CheckpointManager(tmp_path) as m:
        step, got = m.restore(into={"t": targets})
        assert m.passed_over == (2,)
    assert step == 1 and got["t"]["c"] is targets["c"]
    failed, fallback = host_engine.sessions
    # step 2's first two tensors were verified and copied; none from the bad one on
    assert [name[id(t)] for t in failed] == in_file[:2]
    assert sorted(name[id(t)] for t in fallback) == list("abcd")
    for k, v in four(1.0).items():  # the older checkpoint overwrote every target
        assert torch.equal(targets[k], v), k


def test_restore_reads_tensors_of_an_existing_device_through_the_arena_into_new_ones(
    tmp_path: Path, host_engine: CountingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path) as m, monkeypatch.context() as patch:
        _saved_on(patch, "cpu")  # a device that exists here, whose tensors the engine copies
        m.save(1, {"t": four(1.0), "x": np.arange(3.0)})
    allocated: list[Any] = []
    real = host_allocate

    def allocate(*args: Any, **kwargs: Any) -> Any:
        allocated.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr("resilient.checkpoint.reading.allocate", allocate)
    with CheckpointManager(tmp_path) as m:
        waited = logged_reads(monkeypatch, host_engine)
        _, got = m.restore()
        assert allocated == []  # no pageable host memory: the arena, then the new tensors
        (session,) = host_engine.sessions
        assert sorted(map(id, session)) == sorted(id(got["t"][k]) for k in "abcd")
        assert waited == [True]  # copied as read, as into targets are
        for k, v in four(1.0).items():
            assert got["t"][k].device.type == "cpu" and torch.equal(got["t"][k], v), k
        assert isinstance(got["x"], np.ndarray)
        pinned = len(host_engine.pinned)
        m.save(2, got)  # the restore's arena is the next save's
        assert len(host_engine.pinned) == pinned


def test_upload_copies_each_path_once_and_nothing_after_stop() -> None:
    engine = CountingEngine()
    staging = DeviceStaging(engine)
    targets = {k: torch.zeros(4) for k in "abc"}
    for buf in staging.bounce(targets).values():
        buf[:] = 7.0
    upload = staging.upload(targets)
    upload.put(["a", "a"])
    upload.stop()
    upload.put(["b"])
    upload.finish()
    assert engine.sessions == [[targets["a"]]] and upload.pending == ["b", "c"]
    assert torch.equal(targets["a"], torch.full((4,), 7.0)) and not bool(targets["b"].any())
