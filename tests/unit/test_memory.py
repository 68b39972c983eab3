"""New memory for large arrays (resilient.memory)."""

from __future__ import annotations

import gc
import mmap
import weakref
from pathlib import Path

import numpy as np
import pytest

from resilient import memory


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 1 << 20, memory.HUGE_MIN, memory.HUGE_MIN + 5])
def test_new_bytes_are_zeroed_writable_and_page_aligned(nbytes: int) -> None:
    buf = memory.new_bytes(nbytes)
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,)
    assert buf.flags.writeable and buf.ctypes.data % mmap.PAGESIZE == 0
    assert not buf.any()
    buf[:] = 7
    assert (buf == 7).all()


def test_the_map_is_released_with_the_last_array_using_it() -> None:
    buf = memory.new_bytes(memory.HUGE_MIN)
    shared = buf.base  # numpy keeps a memoryview of the map
    assert isinstance(shared, memoryview) and isinstance(shared.obj, mmap.mmap)
    gone = weakref.ref(shared.obj)
    view = buf[10:20]
    del buf, shared
    gc.collect()
    assert gone() is not None  # a view of it is alive
    del view
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize(
    ("setting", "huge"),
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
        (None, False),  # no such file: not Linux, or no transparent huge pages
    ],
)
def test_huge_pages_are_asked_for_only_where_the_kernel_gives_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None, huge: bool
) -> None:
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(memory, "_THP", path)
    memory._huge_pages.cache_clear()
    try:
        assert memory._huge_pages() is huge
        assert not memory.new_bytes(memory.HUGE_MIN).any()  # either way, a usable buffer
    finally:
        memory._huge_pages.cache_clear()
