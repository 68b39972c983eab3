"""No process-wide side effects (issue 23, point 5): the cyclic garbage collector is
process-wide, so a save or restore leaves it alone unless the user asks
(``RESILIENT_PAUSE_GC=1``), as the program's other threads see it too; the buffers that
``O_DIRECT`` writes go through belong to a manager and are unmapped by its ``close()``; and
no thread of the library outlives the save, restore or manager that started it."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager, KeepLast
from resilient.checkpoint.manager import PAUSE_GC_ENV
from resilient.io import fileio
from resilient.io.digests import Digests


class Watched:
    """An array leaf that notes whether the collector was enabled when it was read."""

    def __init__(self, seen: list[bool]) -> None:
        self.seen = seen

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.seen.append(gc.isenabled())
        return np.arange(4.0)


@pytest.mark.parametrize(("value", "paused"), [(None, False), ("0", False), ("1", True)])
def test_the_collector_is_paused_only_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None, paused: bool
) -> None:
    if value is None:
        monkeypatch.delenv(PAUSE_GC_ENV, raising=False)
    else:
        monkeypatch.setenv(PAUSE_GC_ENV, value)
    assert gc.isenabled()
    seen: list[bool] = []
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"u": Watched(seen)})
        step, state = mgr.restore()
    assert step == 1 and np.array_equal(state["u"], np.arange(4.0))
    assert seen and all(enabled is not paused for enabled in seen), seen
    assert gc.isenabled()  # on again after the save and the restore either way


class Poller:
    """A thread of the program's own that keeps looking at ``gc.isenabled()``."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.during: list[bool] = []  # what it saw while ``watching`` was set
        self.watching = threading.Event()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            enabled = gc.isenabled()
            self.seen.append(enabled)
            if self.watching.is_set():
                self.during.append(enabled)
            self._first.set()

    def __enter__(self) -> Poller:
        self._thread.start()
        self._first.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def few_mib_state() -> dict[str, Any]:
    """A few MiB: thousands of small arrays (many small objects: what a pause was for) and
    large ones (written with O_DIRECT)."""
    rng = np.random.default_rng(5)
    return {
        "small": {f"w{i}": rng.random(64) for i in range(2000)},
        "large": [rng.random(1 << 18) for _ in range(4)],  # 4 x 2 MiB
        "step": 3,
    }


@pytest.fixture
def default_gc_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(PAUSE_GC_ENV, raising=False)
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.usefixtures("default_gc_setting")
@pytest.mark.parametrize("user_disabled", [False, True])
@pytest.mark.parametrize("blocking", [True, False])
def test_another_thread_sees_the_collector_as_the_user_left_it(
    tmp_path: Path, user_disabled: bool, blocking: bool
) -> None:
    if user_disabled:
        gc.disable()
    else:
        gc.enable()
    state = few_mib_state()
    with Poller() as poller, CheckpointManager(tmp_path / "ck") as mgr:
        poller.watching.set()
        for step in (1, 2):
            mgr.save(step, state, blocking=blocking)
        mgr.wait()
        got_step, got = mgr.restore()
        poller.watching.clear()
        assert gc.isenabled() is not user_disabled
    assert got_step == 2 and np.array_equal(got["large"][3], state["large"][3])
    assert poller.during, "the other thread never ran during the saves and the restore"
    assert set(poller.seen) == {not user_disabled}, "the other thread saw the collector switched"
    assert gc.isenabled() is not user_disabled


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # (the view is gone at once)


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (``/proc/self/maps``)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= address < high:
            return True
    return False


@pytest.fixture
def maps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[mmap.mmap]:
    """Every bounce buffer the library maps from now on (O_DIRECT must work in tmp_path)."""
    probe = tmp_path / "probe"
    probe.touch()
    fd = fileio.open_direct(probe)
    if fd is None:
        pytest.skip("no O_DIRECT here: no bounce buffer is used")
    os.close(fd)
    made: list[mmap.mmap] = []
    real = fileio._map

    def recorded(nbytes: int) -> mmap.mmap:
        made.append(real(nbytes))
        return made[-1]

    monkeypatch.setattr(fileio, "_map", recorded)
    return made


def misaligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of float64 that do not start on a page (O_DIRECT needs the bounce)."""
    raw = np.random.default_rng(1).random(nbytes // 8 + 1024)
    skip = (-raw.ctypes.data % mmap.PAGESIZE) // 8 + 1  # one float past a page boundary
    out = raw[skip : skip + nbytes // 8]
    assert out.ctypes.data % mmap.PAGESIZE
    return out


@pytest.mark.parametrize("local", [False, True])
def test_the_bounce_buffer_is_reused_then_unmapped_at_close(
    tmp_path: Path, maps: list[mmap.mmap], local: bool
) -> None:
    """One buffer per manager, reused by its saves (and, with a local tier, its flushes), and
    gone from the process once the manager is closed; no thread keeps one."""
    big = misaligned(4 << 20)
    mgr = CheckpointManager(tmp_path / "ck", local_dir=tmp_path / "local" if local else None)
    try:
        for step in (1, 2, 3):
            mgr.save(step, {"big": big, "step": step})
        mgr.flush()
        assert len(maps) == 1, "every save and flush reuses the manager's one buffer"
        address = _address(maps[0])
        assert not maps[0].closed and _mapped(address)
    finally:
        mgr.close()
    assert maps[0].closed and not _mapped(address), "the buffer outlived its manager"
    with CheckpointManager(tmp_path / "ck") as again:  # the data went through it intact
        _, got = again.restore()
    assert np.array_equal(got["big"], big)


def test_a_write_without_an_owner_unmaps_its_buffer(tmp_path: Path, maps: list[mmap.mmap]) -> None:
    big = misaligned(2 << 20)
    path = tmp_path / "f"
    fileio.write_file(path, [0], [big])
    assert len(maps) == 1 and maps[0].closed
    assert path.read_bytes() == big.tobytes()
    # from another thread too: nothing stays behind when it ends
    worker = threading.Thread(target=fileio.write_file, args=(tmp_path / "g", [0], [big]))
    worker.start()
    worker.join()
    assert len(maps) == 2 and maps[1].closed


def test_a_bounce_lent_while_closed_is_unmapped_when_returned(maps: list[mmap.mmap]) -> None:
    bounce = fileio.Bounce(1 << 20)
    with bounce.lend() as view:
        view[:3] = b"abc"
        with bounce.lend() as second:  # lent already: a buffer of its own for this one
            assert len(maps) == 2 and len(second) == 1 << 20
        assert not maps[0].closed and not maps[1].closed  # the second one is kept for later
        bounce.close()
        assert maps[1].closed and not maps[0].closed  # the lent one: still in use
    assert maps[0].closed


def library_threads(before: set[threading.Thread]) -> list[str]:
    """Names of the live ``resilient-*`` threads not in ``before``."""
    now = set(threading.enumerate()) - before
    return sorted(t.name for t in now if t.name.startswith("resilient-"))


def test_no_thread_of_the_library_outlives_its_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checksums are taken on a helper thread (arrays of 1 MiB or more in a save, reads of
    4 MiB or more in a restore) and asynchronous saves run on a writer thread: all of them
    belong to the save, the restore or the manager, and are gone after ``close()``."""
    before = set(threading.enumerate())
    seen: list[list[str]] = []  # the library's threads when each Digests was about to finish
    real = Digests.result

    def watched(self: Digests) -> list[str]:
        seen.append(library_threads(before))
        return real(self)

    monkeypatch.setattr(Digests, "result", watched)
    big = np.random.default_rng(2).random(1 << 20)  # 8 MiB
    mgr = CheckpointManager(tmp_path / "ck", keep=KeepLast(1))
    try:
        mgr.save(1, {"big": big, "step": 1})
        mgr.save(2, {"big": big, "step": 2}, blocking=False)
        mgr.wait()
        step, got = mgr.restore()
        into = np.zeros_like(big)
        mgr.restore(into={"big": into})
    finally:
        mgr.close()
    assert step == 2 and np.array_equal(got["big"], big) and np.array_equal(into, big)
    used = {name.rsplit("_", 1)[0] for names in seen for name in names}  # (pools add "_0")
    assert {"resilient-digest", "resilient-writer"} <= used, used
    assert library_threads(before) == []
