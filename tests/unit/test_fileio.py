"""Reading and writing arrays at file offsets (resilient.io.fileio): arrays as their own iovecs, spans
read into one buffer and returned as views, gaps, misaligned and large arrays, short transfers."""

from __future__ import annotations

import itertools
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from resilient.io import fileio
from resilient.io.staging import allocate, fault_in


def layout(arrays: list[np.ndarray], gaps: list[int]) -> list[int]:
    """Offsets of ``arrays`` laid out one after another with ``gaps[i]`` bytes before each."""
    offsets, pos = [], 0
    for arr, gap in zip(arrays, gaps, strict=True):
        pos += gap
        offsets.append(pos)
        pos += arr.nbytes
    return offsets


def sample(count: int = 300, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    kinds: list[Callable[[], np.ndarray]] = [
        lambda: rng.random(int(rng.integers(1, 700))),
        lambda: rng.integers(-9, 9, size=(3, int(rng.integers(1, 9))), dtype=np.int32),
        lambda: np.asarray(rng.random(), dtype=">f8"),  # 0-d, big-endian
        lambda: rng.random(5) > 0.5,
        lambda: (rng.random(4) + 1j * rng.random(4)).astype(np.complex64),
        lambda: rng.random(7).astype(np.float16),
        lambda: np.zeros((0, 3)),  # empty
    ]
    return [kinds[i % len(kinds)]() for i in range(count)]


def write(path: Path, arrays: list[np.ndarray], offsets: list[int]) -> None:
    fileio.write_file(
        path, [o if a.nbytes else None for o, a in zip(offsets, arrays, strict=True)], arrays
    )


def read_back(path: Path, arrays: list[np.ndarray], offsets: list[int]) -> list[Any]:
    reader = fileio.FileReader(path)
    try:
        return fileio.read_new(
            reader,
            [o if a.nbytes else None for o, a in zip(offsets, arrays, strict=True)],
            [a.shape for a in arrays],
            [a.dtype for a in arrays],
            allocate=allocate,
        )
    finally:
        reader.close()


@pytest.mark.parametrize("gap", [0, 8, 3, 70_000])
def test_read_new_gives_every_array_back_as_written(tmp_path: Path, gap: int) -> None:
    arrays = sample()
    rng = np.random.default_rng(gap)
    offsets = layout(arrays, [int(rng.integers(0, gap + 1)) for _ in arrays])
    write(tmp_path / "f", arrays, offsets)
    got = read_back(tmp_path / "f", arrays, offsets)
    for want, have in zip(arrays, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert have.tobytes() == want.tobytes()
        assert have.flags.aligned and have.flags.c_contiguous and have.flags.writeable


def test_read_new_in_any_order_with_large_and_misaligned_arrays(tmp_path: Path) -> None:
    big = np.arange(300_000, dtype=np.float64)  # 2.4 MB: its own allocation
    small = [np.full(5, i, dtype=np.float64) for i in range(6)]
    arrays = [small[0], big, *small[1:]]
    offsets = [3, 4096, 4096 + big.nbytes + 1, *range(4096 + big.nbytes + 100, 10**7, 1000)][:7]
    write(tmp_path / "f", arrays, offsets)
    order = [6, 2, 0, 5, 1, 4, 3]  # offsets given out of order
    got = read_back(tmp_path / "f", [arrays[i] for i in order], [offsets[i] for i in order])
    for i, have in zip(order, got, strict=True):
        assert have.tobytes() == arrays[i].tobytes() and have.flags.aligned
    # a view of the shared buffer is not kept for a misaligned one (offset 3: copied)
    assert got[2].base is None or got[2].base.base is not got[1].base


def test_read_many_fills_existing_arrays_across_gaps_and_iov_max(tmp_path: Path) -> None:
    arrays = [np.full(3 + i % 5, i, dtype=np.int64) for i in range(2500)]  # > IOV_MAX iovecs
    offsets = layout(arrays, [i % 3 * 8 for i in range(len(arrays))])
    write(tmp_path / "f", arrays, offsets)
    targets = [np.empty_like(a) for a in arrays]
    reader = fileio.FileReader(tmp_path / "f")
    try:
        fileio.read_many(reader, list(zip(offsets, targets, strict=True))[::-1])
    finally:
        reader.close()
    assert all(t.tobytes() == a.tobytes() for t, a in zip(targets, arrays, strict=True))


def test_a_truncated_file_is_an_eof_error(tmp_path: Path) -> None:
    arrays = sample(50)
    offsets = layout(arrays, [0] * len(arrays))
    write(tmp_path / "f", arrays, offsets)
    os.truncate(tmp_path / "f", offsets[-3])
    with pytest.raises(EOFError):
        read_back(tmp_path / "f", arrays, offsets)
    reader = fileio.FileReader(tmp_path / "f")
    try:
        with pytest.raises(EOFError):
            fileio.read_many(
                reader, [(o, np.empty_like(a)) for o, a in zip(offsets, arrays, strict=True)]
            )
    finally:
        reader.close()


def test_short_reads_and_writes_are_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kernel may transfer fewer bytes than asked (signals, some filesystems): every
    # transfer here stops after 1,000 bytes, inside an array
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def short(real: Callable[..., int]) -> Callable[..., int]:
        def call(fd: int, bufs: list[Any], pos: int) -> int:
            first = memoryview(bufs[0]).cast("B")
            return int(real(fd, [first[: min(len(first), 1000)]], pos))

        return call

    monkeypatch.setattr(os, "preadv", short(real_preadv))  # the module fileio calls
    monkeypatch.setattr(os, "pwritev", short(real_pwritev))
    arrays = sample(60)
    offsets = layout(arrays, [5] * len(arrays))
    write(tmp_path / "f", arrays, offsets)
    got = read_back(tmp_path / "f", arrays, offsets)
    assert all(h.tobytes() == w.tobytes() for h, w in zip(got, arrays, strict=True))
    targets = [np.empty_like(a) for a in arrays]
    reader = fileio.FileReader(tmp_path / "f")
    try:
        fileio.read_many(reader, list(zip(offsets, targets, strict=True)))
    finally:
        reader.close()
    assert all(t.tobytes() == w.tobytes() for t, w in zip(targets, arrays, strict=True))


def test_writeback_is_started_on_whole_pages_of_each_written_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte written lands in the file, and the kernel is asked to start writing each run
    of at most 2 MiB as it is written: whole pages only, never a zero length (which would mean
    "to the end of the file"), each page at most once, and all but the last partial page."""
    kicks: list[tuple[int, int]] = []
    real = fileio._start_writeback

    def record(fd: int, offset: int, length: int) -> None:
        kicks.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(fileio, "_start_writeback", record)
    rng = np.random.default_rng(1)
    arrays = [rng.random(int(n)) for n in rng.integers(1, 9000, size=700)]  # ~25 MiB, odd sizes
    offsets = layout(arrays, [0] * 350 + [13] * 350)  # one contiguous stretch, then gaps
    write(tmp_path / "f", arrays, offsets)
    for got, want in zip(read_back(tmp_path / "f", arrays, offsets), arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    page = fileio._PAGE
    assert len(kicks) > 10
    assert all(off % page == 0 and n > 0 and n % page == 0 for off, n in kicks)
    assert all(n <= fileio._WRITEBACK_BYTES + 2 * page for _, n in kicks)
    covered = sorted(kicks)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(covered))  # no page twice
    end = offsets[-1] + arrays[-1].nbytes
    assert sum(n for _, n in kicks) >= end - 2 * page * 350 - page  # each gap costs <= 2 pages


def test_writeback_hint_is_available_on_linux(tmp_path: Path) -> None:
    """On Linux the hint is libc's sync_file_range; it accepts a written range of a real file."""
    if not sys.platform.startswith("linux"):
        pytest.skip("sync_file_range is Linux's")
    func = fileio._sync_file_range()
    assert func is not None
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"x" * 3 * fileio._PAGE, 0)
        assert func(fd, 0, 2 * fileio._PAGE, fileio._SYNC_FILE_RANGE_WRITE) == 0
        assert func(-1, 0, fileio._PAGE, fileio._SYNC_FILE_RANGE_WRITE) == -1  # really called
    finally:
        os.close(fd)


class Watcher:
    """Records what a read tells: whole arrays, and large arrays assembled from their pieces."""

    def __init__(self) -> None:
        self.told: list[tuple[int, bytes]] = []
        self.partial: dict[int, bytearray] = {}
        self.faulted = 0

    def arrays(self, positions: Any, got: Any) -> None:
        self.told.extend((p, a.tobytes()) for p, a in zip(positions, got, strict=True))

    def piece(self, position: int, data: memoryview, last: bool) -> None:
        assert position not in dict(self.told), "told again after its last piece"
        self.partial.setdefault(position, bytearray()).extend(data)
        if last:
            self.told.append((position, bytes(self.partial.pop(position))))

    def fault(self, data: memoryview) -> Callable[[], object]:
        fault_in(data)
        self.faulted += len(data)
        return lambda: None


@pytest.mark.parametrize("reader", ["read_new", "read_many"])
def test_arrived_tells_each_array_once_complete_while_reading_on(
    tmp_path: Path, reader: str
) -> None:
    """With ``arrived``, every non-empty array is told exactly once, by its position in the
    request, and its bytes are complete when told; a span of ~10 MiB takes several reads, and
    an array of several MiB arrives in pieces, in order, the last one marked."""
    rng = np.random.default_rng(3)
    arrays = [*sample(600), rng.random(200_000), rng.random(9), *sample(900, seed=1)]
    arrays += [rng.random(int(n)) for n in rng.integers(100, 9000, size=400)]  # ~14 MiB
    arrays += [rng.random(1_100_000), rng.random(180_000)]  # 8.4 MiB: pieces; 1.4 MiB: whole
    offsets = layout(arrays, [int(g) for g in rng.integers(0, 40, size=len(arrays))])
    write(tmp_path / "f", arrays, offsets)
    watcher = Watcher()
    order = rng.permutation(len(arrays)).tolist()
    req = [arrays[i] for i in order]
    req_offsets = [offsets[i] for i in order]
    source = fileio.FileReader(tmp_path / "f")
    try:
        if reader == "read_new":
            fileio.read_new(
                source,
                [o if a.nbytes else None for o, a in zip(req_offsets, req, strict=True)],
                [a.shape for a in req],
                [a.dtype for a in req],
                allocate=allocate,
                arrived=watcher,
            )
        else:
            targets = [np.empty_like(a) for a in req]
            fileio.read_many(source, list(zip(req_offsets, targets, strict=True)), arrived=watcher)
    finally:
        source.close()
    positions = [p for p, _ in watcher.told]
    assert sorted(positions) == [i for i, a in enumerate(req) if a.nbytes]
    assert all(data == req[p].tobytes() for p, data in watcher.told)
    assert not watcher.partial
    # new memory of the large arrays (>= 1 MiB) is faulted in by the reader, ahead of its reads;
    # the caller's arrays are left as they are
    large = sum(a.nbytes for a in arrays if a.nbytes >= 1 << 20)
    assert watcher.faulted == (large if reader == "read_new" else 0)


def test_split_sends_whole_pages_of_large_arrays_direct_and_the_rest_through_the_cache() -> None:
    """The bytes of a write, split without I/O: a large array's page-aligned body for
    O_DIRECT, its unaligned head and tail and the small arrays for the page cache; empty
    arrays dropped; together the pieces are every byte once."""
    big = np.arange(300_000, dtype=np.float64)  # 2.4 MB, from an offset inside a page
    small = np.arange(10, dtype=np.int32)
    split = fileio._split([5000, None, 3_000_000], [big, np.zeros(0), small])
    (body,) = split.direct
    assert body.offset % mmap.PAGESIZE == 0 and len(body.data) % mmap.PAGESIZE == 0
    pieces = [(body.offset, bytes(body.data))]
    rest = zip(split.starts, split.bufs, strict=True)
    pieces += [(o, b.tobytes()) for o, b in rest]
    assert sum(len(b) for _, b in pieces) == big.nbytes + small.nbytes
    image = bytearray(3_000_000 + small.nbytes)
    for offset, data in pieces:
        image[offset : offset + len(data)] = data
    assert image[5000 : 5000 + big.nbytes] == big.tobytes()
    assert image[3_000_000:] == small.tobytes()


def test_work_alongside_runs_between_runs_of_data_and_the_rest_is_left(tmp_path: Path) -> None:
    """The caller's idle work after each run of data (~2 MiB), the skeleton first; the
    skeleton's bytes are written after the data."""
    arrays = [np.full(65536, i, dtype=np.float64) for i in range(5)]  # 5 x 512 KiB: 2 runs
    offsets = layout(arrays, [4096] + [0] * 4)
    done: list[str] = []

    image = b"\x89HDF-like header"
    end = offsets[-1] + arrays[-1].nbytes

    def skeleton() -> fileio.FileSkeleton:
        done.append("skeleton")
        assert os.path.getsize(tmp_path / "f") >= 2 << 20  # the first run is written
        return fileio.FileSkeleton({}, (), end + 64, ((0, image), (end, bytes(64))))

    fileio.write_file(
        tmp_path / "f", offsets, arrays, skeleton=skeleton, idle=lambda: done.append("idle")
    )
    assert done == ["skeleton", "idle"]
    data = (tmp_path / "f").read_bytes()
    assert data.startswith(image) and len(data) == end + 64
    assert data[offsets[3] : offsets[3] + 8] == np.float64(3).tobytes()


@hypothesis.settings(derandomize=True, max_examples=200, deadline=None)
@hypothesis.given(
    st.lists(
        st.tuples(
            st.sampled_from([(4,), (2, 2), (8,), (1,), (), (3, 1, 2)]),
            st.sampled_from(["<f8", "<i8", "<f4", "|u1"]),
            st.sampled_from([0, 0, 0, 8, 64]),  # padding after the array
            st.integers(1, 12),  # repeated this many times
        ),
        min_size=1,
        max_size=6,
    )
)
def test_views_of_a_span_are_each_arrays_own(runs: list[tuple[Any, str, int, int]]) -> None:
    """Runs of equal, equally spaced arrays become rows of one view; each view has its array's
    shape, dtype and bytes, whatever the mix of shapes, dtypes and spacings."""
    shapes: list[tuple[int, ...]] = []
    dtypes: list[np.dtype[Any]] = []
    starts: list[int] = []
    pos = 0
    for shape, name, pad, times in runs:
        for _ in range(times):
            shapes.append(shape)
            dtypes.append(np.dtype(name))
            starts.append(pos)
            pos += int(np.prod(shape)) * np.dtype(name).itemsize + pad
    arena = np.arange(pos + 8, dtype=np.uint8)
    sizes = np.array(
        [int(np.prod(s)) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)], np.int64
    )
    index = list(range(len(shapes)))
    views = fileio._views(arena, np.array(starts, np.int64), sizes, index, shapes, dtypes)
    for view, shape, dt, start, size in zip(views, shapes, dtypes, starts, sizes, strict=True):
        assert isinstance(view, np.ndarray)
        assert (view.shape, view.dtype) == (shape, dt)
        assert view.tobytes() == arena[start : start + size].tobytes()
        assert view.flags.c_contiguous and view.flags.writeable


def test_rows_of_a_block_write_through_to_the_buffer() -> None:
    """4,000 equal arrays back to back (one block): each view is its own piece of the read
    buffer, not a copy."""
    arena = np.zeros(4000 * 32, np.uint8)
    starts = np.arange(4000, dtype=np.int64) * 32
    views = fileio._views(
        arena, starts, np.full(4000, 32, np.int64), list(range(4000)), [(4,)] * 4000,
        [np.dtype("<f8")] * 4000,
    )  # fmt: skip
    assert all(np.shares_memory(v, arena) for v in views)
    views[3][1] = 7.0
    assert arena[3 * 32 + 8 : 3 * 32 + 16].view("<f8")[0] == 7.0
