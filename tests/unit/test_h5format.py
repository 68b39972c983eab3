"""HDF5 metadata written by :mod:`resilient.model.h5format`, read back by real readers.

Every structure is created with :func:`resilient.io.fileio.build_skeleton`, filled with known data
by :func:`resilient.io.fileio.write_file`, then read with h5py (names, shapes, dtypes, values,
attributes, and exactly the expected objects) and, where installed, with ``h5dump`` and
``h5ls``. Datatypes are also compared byte for byte with what HDF5 itself writes in the same
(oldest) format, and dtypes with what h5py's own writer gives.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.io import fileio
from resilient.model import h5format
from resilient.model.h5format import ArraySpec, place_data, plan_file
from tests.unit.ckutil import sample

H5DUMP = shutil.which("h5dump")
H5LS = shutil.which("h5ls")

Ranks = Sequence[tuple[int, Sequence[ArraySpec]]]

# every dtype a checkpoint stores, in every spelling of its byte order
KINDS = [("b", 1), *((k, n) for k in "iu" for n in (1, 2, 4, 8))]
KINDS += [("f", n) for n in (2, 4, 8, 16)] + [("c", n) for n in (8, 16, 32)]
DTYPES = [
    f"{order}{kind}{size}"
    for kind, size in KINDS
    for order in (("|",) if size == 1 else ("<", ">", "="))
]


def specs_of(arrays: dict[str, npt.NDArray[Any]]) -> list[ArraySpec]:
    return [ArraySpec(k, a.shape, a.dtype.str) for k, a in arrays.items()]


def create_skeleton(
    path: Path, *, layout_kind: str, ranks: Sequence[tuple[int, Sequence[Any]]]
) -> fileio.FileSkeleton:
    """The skeleton, and its file created empty at its size (as a save's leader does)."""
    skeleton = fileio.build_skeleton(layout_kind, ranks)
    fileio.create_file(path)
    os.truncate(path, skeleton.size)
    return skeleton


def write(
    path: Path, data: dict[int, dict[str, npt.NDArray[Any]]], *, kind: str = "self"
) -> fileio.FileSkeleton:
    """Create the skeleton of ``data`` (per rank, its arrays) and write every array."""
    skeleton = create_skeleton(
        path, layout_kind=kind, ranks=[(r, specs_of(a)) for r, a in data.items()]
    )
    items: list[tuple[int, npt.NDArray[Any]]] = []
    for r, arrays in data.items():
        for offset, arr in zip(skeleton.offsets[r], arrays.values(), strict=True):
            if offset is not None:
                items.append((offset, arr))
    fileio.write_file(path, [o for o, _ in items], [a for _, a in items], skeleton=lambda: skeleton)
    return skeleton


def expected_objects(data: dict[int, dict[str, npt.NDArray[Any]]]) -> set[str]:
    """Every path ``h5py.File.visit`` must list: rank groups, nested groups, datasets."""
    out = set()
    for r, arrays in data.items():
        base = fileio.rank_group_name(r)
        out.add(base)
        for name in arrays:
            parts = name.split("/")
            out.update(f"{base}/{'/'.join(parts[:i])}" for i in range(1, len(parts) + 1))
    return out


def check_h5py(path: Path, data: dict[int, dict[str, npt.NDArray[Any]]], kind: str) -> None:
    """h5py reads exactly ``data`` back, with the attributes."""
    with h5py.File(path, "r") as f:
        seen: list[str] = []
        f.visit(seen.append)
        assert len(seen) == len(set(seen))
        assert set(seen) == expected_objects(data)
        assert f.attrs["resilient_layout"].decode() == kind
        np.testing.assert_array_equal(f.attrs["resilient_ranks"], list(data))
        assert f.attrs["resilient_ranks"].dtype == np.int64
        for r, arrays in data.items():
            group = f[fileio.rank_group_name(r)]
            assert int(group.attrs["rank"]) == r
            assert list(group.attrs) == ["rank"]
            for name, arr in arrays.items():
                dset = group[name]
                assert isinstance(dset, h5py.Dataset)
                assert dset.shape == arr.shape
                assert dset.dtype == arr.dtype, (name, dset.dtype, arr.dtype)
                if arr.dtype.str == ">c32":  # h5py reads it wrong: see H5PY_BE_C32_BUG
                    native = arr.astype("<c32")
                    np.testing.assert_array_equal(dset.astype("<c32")[()], native)
                    continue
                np.testing.assert_array_equal(dset[()], arr, strict=arr.ndim > 0)  # scalars: native


def roundtrip(
    tmp_path: Path, data: dict[int, dict[str, npt.NDArray[Any]]], *, kind: str = "self"
) -> Path:
    path = tmp_path / "file.h5"
    path.unlink(missing_ok=True)
    skeleton = write(path, data, kind=kind)
    assert path.stat().st_size == skeleton.size
    check_tiling(skeleton, data)
    check_h5py(path, data, kind)
    return path


def check_tiling(
    skeleton: fileio.FileSkeleton, data: dict[int, dict[str, npt.NDArray[Any]]]
) -> None:
    """Metadata pieces and non-empty datasets cover the file exactly once; alignment."""
    pieces = [(o, len(b)) for o, b in skeleton.meta_bytes]
    assert [(s.offset, s.length) for s in skeleton.meta_segments] == pieces
    for r, arrays in data.items():
        for offset, arr in zip(skeleton.offsets[r], arrays.values(), strict=True):
            assert (offset is None) == (arr.nbytes == 0)
            if offset is not None:
                pieces.append((offset, arr.nbytes))
                assert offset % (4096 if arr.nbytes >= fileio.DIRECT_MIN else 64) == 0
    pos = 0
    for offset, length in sorted(pieces):
        assert offset == pos
        pos += length
    assert pos == skeleton.size


def run_tool(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "error" not in proc.stderr.lower(), proc.stderr
    return proc.stdout


# --- datatypes ------------------------------------------------------------------------------


# h5py describes a big-endian complex256 with little-endian members (its type for the members
# ignores the byte order), so it writes (and reads) such data wrong; our file describes the
# bytes as they are (big-endian members): HDF5 and h5dump read them right, and h5py does when
# asked for little-endian values (``dset.astype("<c32")``)
H5PY_BE_C32_BUG = ">c32"


def h5py_dtype(tmp_path: Path, dtype: str) -> np.dtype[Any]:
    """The dtype h5py reads back from a dataset h5py itself wrote from ``dtype``."""
    path = tmp_path / f"ref-{dtype.replace('|', '_').replace('<', 'l').replace('>', 'b')}.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("x", shape=(2,), dtype=np.dtype(dtype))
    with h5py.File(path, "r") as f:
        return f["x"].dtype  # type: ignore[no-any-return]


def messages(raw: bytes, address: int) -> list[tuple[int, int, bytes]]:
    """(type, flags, body) of each message of the version 1 object header at ``address``,
    following continuation messages (HDF5 writes them when a header grows)."""
    version, count, size = raw[address], *struct.unpack_from("<H4xI", raw, address + 2)
    assert version == 1
    chunks, out = [(address + 16, size)], []
    while chunks:
        pos, size = chunks.pop(0)
        end = pos + size
        while pos < end:
            kind, length, flags = struct.unpack_from("<HHB", raw, pos)
            body = raw[pos + 8 : pos + 8 + length]
            if kind == 0x10:
                chunks.append(struct.unpack_from("<QQ", body))
            out.append((kind, flags, body))
            pos += 8 + length
    assert len(out) == count
    return [m for m in out if m[0] not in (0x0, 0x10)]


def dataset_header(raw: bytes, name: bytes) -> int:
    """The object header address of dataset ``name`` of the root group of a superblock 0 file
    whose root has a one-node B-tree."""
    btree, heap = struct.unpack_from("<QQ", raw, 56 + 24)
    data_size, _, data = struct.unpack_from("<QQQ", raw, heap + 8)
    names = raw[data : data + data_size]
    used = struct.unpack_from("<H", raw, btree + 6)[0]
    for child in struct.unpack_from(f"<{2 * used + 1}Q", raw, btree + 24)[1::2]:
        assert raw[child : child + 4] == b"SNOD"
        for i in range(struct.unpack_from("<H", raw, child + 6)[0]):
            offset, header = struct.unpack_from("<QQ", raw, child + 8 + 40 * i)
            if names[offset : names.index(b"\0", offset)] == name:
                return header  # type: ignore[no-any-return]
    raise KeyError(name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_datatype_message_is_hdf5s_own(tmp_path: Path, dtype: str) -> None:
    """Our datatype message is byte for byte the one HDF5 writes for h5py's type of ``dtype``
    in the same format, and h5py reads our dataset back with the dtype it gives its own."""
    ref = tmp_path / "ref.h5"
    with h5py.File(ref, "w", libver="earliest") as f:
        f.create_dataset("x", shape=(3,), dtype=np.dtype(dtype))
    raw = ref.read_bytes()
    (theirs,) = [body for kind, _, body in messages(raw, dataset_header(raw, b"x")) if kind == 3]
    ours, itemsize = h5format.datatype_message(dtype)
    assert itemsize == np.dtype(dtype).itemsize
    if dtype == H5PY_BE_C32_BUG:  # the same but for the members' byte order bit
        fixed = bytearray(theirs)
        for member_flags in (49, 49 + 60):
            fixed[member_flags] |= 1
        theirs = bytes(fixed)
    assert h5format._pad8(ours) == theirs
    arr = sample(dtype, (3,), seed=1)
    roundtrip(tmp_path, {0: {"x": arr}})
    with h5py.File(tmp_path / "file.h5", "r") as f:
        # (h5py's own big-endian complex256 comes back little-endian: see H5PY_BE_C32_BUG)
        expected = np.dtype(dtype) if dtype == H5PY_BE_C32_BUG else h5py_dtype(tmp_path, dtype)
        assert f["rank_00000/x"].dtype == expected


def test_dataset_header_is_hdf5s_own_but_for_padding(tmp_path: Path) -> None:
    """A dataset's messages (dataspace, datatype, fill value, layout) and their flags are the
    ones HDF5 writes for h5py's early-allocated, never-filled, untimed contiguous dataset."""
    ref = tmp_path / "ref.h5"
    with h5py.File(ref, "w", libver="earliest") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)
        for name, shape in (("x", (3, 4)), ("s", ()), ("e", (0, 2))):
            space = h5py.h5s.create(h5py.h5s.SCALAR) if not shape else h5py.h5s.create_simple(shape)
            h5py.h5d.create(f.id, name.encode(), h5py.h5t.IEEE_F32BE, space, dcpl=dcpl).close()
    path = tmp_path / "ours.h5"
    data = {
        0: {"x": sample(">f4", (3, 4), 0), "s": sample(">f4", (), 0), "e": np.zeros((0, 2), ">f4")}
    }
    write(path, data)
    raw_ref, raw = ref.read_bytes(), path.read_bytes()
    with h5py.File(path, "r") as f:
        # our datasets live in /rank_00000: find their headers through h5py
        addrs = {k: h5py.h5o.get_info(f[f"rank_00000/{k}"].id).addr for k in data[0]}
    for name in data[0]:
        theirs = messages(raw_ref, dataset_header(raw_ref, name.encode()))
        ours = messages(raw, addrs[name])
        assert [(k, fl) for k, fl, _ in ours] == [(k, fl) for k, fl, _ in theirs]
        for (kind, _, a), (_, _, b) in zip(ours, theirs, strict=True):
            if kind == 0x8:  # the layout: same but for the data's address
                assert a[:2] == b[:2] and a[10:] == b[10:]
            else:
                assert a == b, (name, kind)


# --- structures -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(), (0,), (5,), (2, 3), (3, 0, 2), (1, 2, 1, 2, 1, 2, 1, 2), (2,) * 8 + (1,)]
)
def test_every_dtype_and_shape(tmp_path: Path, dtype: str, shape: tuple[int, ...]) -> None:
    roundtrip(tmp_path, {0: {"a": sample(dtype, shape, 1), "b/c": sample(dtype, shape, 2)}})


def test_large_datasets_are_page_aligned_and_small_ones_packed(tmp_path: Path) -> None:
    data = {
        0: {
            "tiny": sample("<i2", (3,), 0),
            "big": sample("<f8", (300_001,), 1),  # > 1 MiB, odd size
            "after": sample("<c8", (5,), 2),
            "big2": sample(">f4", (2, 70_000, 2), 3),
            "wide": sample("|u1", (1, 1 << 18), 4),
            "last": sample("|b1", (1,), 5),
        }
    }
    skeleton = write(tmp_path / "file.h5", data)
    check_tiling(skeleton, data)
    check_h5py(tmp_path / "file.h5", data, "self")


def test_small_datasets_are_one_run_of_data(tmp_path: Path) -> None:
    """4,000 arrays of 4 KiB: the superblock, the data as one run right after it, then all
    the rest of the metadata as one piece, to the end of the file."""
    data = {0: {f"model/w{i}": sample("<f8", (512,), i) for i in range(4000)}}
    skeleton = write(tmp_path / "file.h5", data)
    (head_at, head), (meta_at, meta) = skeleton.meta_bytes
    offsets = sorted(o for o in skeleton.offsets[0] if o is not None)
    assert head_at == 0 and head[:8] == b"\x89HDF\r\n\x1a\n" and offsets[0] == len(head) == 128
    assert np.all(np.diff(offsets) == 4096)
    assert meta_at == offsets[-1] + 4096 and skeleton.size == meta_at + len(meta)
    check_h5py(tmp_path / "file.h5", data, "self")


def test_place_data_gives_the_offsets_of_plan_file() -> None:
    """The offsets a save writes at before the metadata exists are the file's."""
    rng = np.random.default_rng(7)
    kinds = ["<f8", ">i4", "|b1", "<c16", "<f2"]
    ranks = [
        (r, [ArraySpec(f"g{i % 3}/d{i}", tuple(int(x) for x in rng.integers(0, 40, size=i % 4)),
                       kinds[i % 5]) for i in range(60)])
        for r in (3, 0, 7)
    ]  # fmt: skip
    ranks[1][1].append(ArraySpec("huge", (300_000,), "<f8"))  # page-aligned
    placed = place_data(ranks)
    planned = plan_file("node", ranks).offsets
    assert placed == planned


def test_odd_sizes_leave_zero_pieces_between_datasets(tmp_path: Path) -> None:
    data = {0: {f"v{i}": sample("<i4", (i + 1,), i) for i in range(40)}}
    skeleton = write(tmp_path / "file.h5", data)
    assert all(set(b) <= {0} for _, b in skeleton.meta_bytes[1:-1])  # between superblock, metadata
    assert len(skeleton.meta_bytes) > 2
    check_tiling(skeleton, data)
    check_h5py(tmp_path / "file.h5", data, "self")


def test_no_datasets(tmp_path: Path) -> None:
    roundtrip(tmp_path, {0: {}})
    roundtrip(tmp_path, {4: {}, 1: {}, 7: {"x": sample("<f4", (2,), 0)}}, kind="node")


def test_one_dataset(tmp_path: Path) -> None:
    roundtrip(tmp_path, {0: {"x": sample("<f8", (7,), 0)}})


def test_several_ranks_in_any_order(tmp_path: Path) -> None:
    data = {
        r: {f"model/layer{i}.weight": sample("<f4", (i + 1, 3), r * 10 + i) for i in range(5)}
        | {"step": sample("<i8", (), r), "model/bias": sample(">f8", (3,), r)}
        for r in (5, 2, 9, 0)
    }
    roundtrip(tmp_path, data, kind="world")


def test_nested_groups_many_levels(tmp_path: Path) -> None:
    deep = "/".join(f"l{i}" for i in range(20))
    data = {
        3: {
            f"{deep}/x": sample("<f8", (2,), 0),
            f"{deep}/y": sample("<i4", (2,), 1),
            "a/b/c/d": sample("<u2", (1,), 2),
            "a/b/e": sample("<u2", (3,), 3),
            "a/f": sample("|b1", (), 4),
            "g": sample("<c16", (2, 2), 5),
            f"{deep[:5]}/z": sample("<f2", (4,), 6),
        }
    }
    roundtrip(tmp_path, data)


ODD_NAMES = [
    "with space", "tab\there", "new\nline", "per%cent", "%2E%2E", "%", "%i7", ".hidden",
    "a.b.c", "-", "+", "___", "ünïcödé", "名前", "emoji-\U0001f600", "\x7f", "\x01ctrl", "Z", "a",
    "A", "aa", "a" * 1024, "\u00ff", "\uffff", "\\back", "'quote\"", "*?[]", "...x", "..", "...",
]  # fmt: skip


def test_odd_names_in_strcmp_order(tmp_path: Path) -> None:
    data = {0: {name: sample("<i2", (2,), i) for i, name in enumerate(ODD_NAMES)}}
    data[0] |= {f"grp {n}/{n}": sample("<f4", (1,), i) for i, n in enumerate(ODD_NAMES[:8])}
    path = roundtrip(tmp_path, data)
    with h5py.File(path, "r") as f:
        # HDF5 lists a group's links in name order (strcmp of the UTF-8 bytes)
        listed = [k.encode() for k in f["rank_00000"]]
        assert listed == sorted(listed)


def test_many_groups(tmp_path: Path) -> None:
    """An optimizer state: a group per parameter, a few datasets each."""
    data = {
        0: {
            f"optim/state/%i{i}/{leaf}": sample(dtype, shape, i)
            for i in range(1500)
            for leaf, shape, dtype in (
                ("exp_avg", (4,), "<f4"),
                ("exp_avg_sq", (4,), "<f4"),
                ("step", (), "<f8"),
            )
        }
        | {f"model/p{i}": sample("<f4", (4,), i) for i in range(1500)}
    }
    roundtrip(tmp_path, data)


def test_100000_datasets_in_one_group(tmp_path: Path) -> None:
    data = {0: {f"x{i}": np.full((2,), i, "<i4") for i in range(100_000)}}
    path = tmp_path / "file.h5"
    skeleton = write(path, data)
    check_tiling(skeleton, data)
    with h5py.File(path, "r") as f:
        group = f["rank_00000"]
        assert len(group) == 100_000
        names = list(group)
        assert names == sorted(data[0], key=str.encode)
        for i in (0, 1, 99_999, 54_321):
            np.testing.assert_array_equal(group[f"x{i}"][()], data[0][f"x{i}"])
    if H5LS:
        assert run_tool(H5LS, str(path) + "/rank_00000").count("Dataset {2}") == 100_000


def test_large_groups_next_to_small_ones(tmp_path: Path) -> None:
    data = {
        0: {f"big/x{i}": np.full((1,), i, "<i8") for i in range(5000)}
        | {f"small{j}/y": np.full((1,), j, "<i8") for j in range(50)}
    }
    roundtrip(tmp_path, data)


@pytest.mark.parametrize("n", [8183, 8184])
def test_ranks_beyond_an_attribute_are_a_dataset(tmp_path: Path, n: int) -> None:
    """A header message holds 64 KiB: 8,183 ranks fit in the root's attribute, more do not."""
    ranks = list(range(3 * n, 0, -3))
    data: dict[int, dict[str, npt.NDArray[Any]]] = {r: {} for r in ranks}
    data[ranks[0]] = {"x": sample("<f4", (2,), 0)}
    path = tmp_path / "file.h5"
    skeleton = write(path, data, kind="world")
    check_tiling(skeleton, data)
    with h5py.File(path, "r") as f:
        seen: list[str] = []
        f.visit(seen.append)
        if n == 8183:
            assert set(seen) == expected_objects(data)
            stored = f.attrs["resilient_ranks"]
        else:
            assert set(seen) == expected_objects(data) | {"resilient_ranks"}
            assert "resilient_ranks" not in f.attrs
            stored = f["resilient_ranks"][()]
        assert stored.dtype == np.int64 and stored.tolist() == ranks
        assert int(f[fileio.rank_group_name(ranks[-1])].attrs["rank"]) == ranks[-1]
        np.testing.assert_array_equal(
            f[fileio.rank_group_name(ranks[0])]["x"][()], data[ranks[0]]["x"]
        )


def test_h5py_can_add_to_the_file(tmp_path: Path) -> None:
    """HDF5 itself can extend what we wrote (in place, opened for writing)."""
    data = {0: {f"m/x{i}": sample("<f4", (3,), i) for i in range(100)}}
    path = roundtrip(tmp_path, data)
    with h5py.File(path, "r+") as f:
        for i in range(100, 200):
            f[f"rank_00000/m/x{i}"] = sample("<f4", (3,), i)
        f["rank_00000/new/deep"] = np.arange(4)
        f.attrs["extra"] = 1
    data[0] |= {f"m/x{i}": sample("<f4", (3,), i) for i in range(100, 200)}
    with h5py.File(path, "r") as f:
        for name, arr in data[0].items():
            np.testing.assert_array_equal(f[f"rank_00000/{name}"][()], arr)
        np.testing.assert_array_equal(f["rank_00000/new/deep"][()], np.arange(4))


@pytest.mark.skipif(H5DUMP is None or H5LS is None, reason="h5dump/h5ls not installed")
def test_h5dump_and_h5ls_read_everything(tmp_path: Path) -> None:
    data = {
        r: {
            f"{dt.replace('|', 'p').replace('<', 'l').replace('>', 'b').replace('=', 'n')}/v": sample(
                dt, (2, 3), i + r
            )
            for i, dt in enumerate(DTYPES)
        }
        | {
            "zero-d": sample("<f8", (), r),
            "empty": np.zeros((0, 3), "<i4"),
            "odd name %": sample("<u1", (1,), 0),
        }
        for r in (0, 1)
    }
    path = roundtrip(tmp_path, data, kind="node")
    assert H5DUMP is not None and H5LS is not None
    dump = run_tool(H5DUMP, str(path))
    assert dump.count("DATASET ") == sum(len(a) for a in data.values())
    assert 'ATTRIBUTE "resilient_layout"' in dump and '"node"' in dump
    header = run_tool(H5DUMP, "-H", "-A", str(path))
    assert "H5T_IEEE_F64BE" in header and "H5T_STD_U16LE" in header and "H5T_COMPOUND" in header
    values = run_tool(H5DUMP, "-d", "/rank_00001/lf8/v", "-m", "%.17g", "-y", "-w", "0", str(path))
    numbers = [float(x) for x in values.split("DATA {")[1].split("}")[0].replace(",", " ").split()]
    np.testing.assert_allclose(numbers, data[1]["lf8/v"].reshape(-1))
    listing = run_tool(H5LS, "-r", str(path))
    for r, arrays in data.items():
        for name in arrays:
            assert f"/rank_{r:05d}/{name}" in listing.replace("\\ ", " ")


# --- determinism, errors ---------------------------------------------------------------------


def structure() -> list[tuple[int, list[ArraySpec]]]:
    return [
        (
            r,
            [
                ArraySpec(f"m{i % 7}/p{i}", (i % 5, 3), ("<f4", ">i8", "|b1")[i % 3])
                for i in range(300)
            ],
        )
        for r in (3, 1)
    ]


def test_equal_structures_give_equal_bytes(tmp_path: Path) -> None:
    a = plan_file("node", structure())
    b = plan_file(
        "node", [(r, [ArraySpec(s.name, s.shape, s.dtype) for s in ss]) for r, ss in structure()]
    )
    assert a == b
    # in another process too (str hashes differ between processes)
    code = (
        "import hashlib, sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.unit.test_h5format import structure;"
        "from resilient.model.h5format import plan_file;"
        "l = plan_file('node', structure());"
        "print(hashlib.sha256(repr((l.meta_bytes, l.offsets, l.size)).encode()).hexdigest())"
    )
    root = str(Path(__file__).resolve().parents[2])
    digests = {
        subprocess.run(
            [sys.executable, "-c", code, root],
            capture_output=True, text=True, check=True, timeout=60,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2)
    }  # fmt: skip
    assert digests == {hashlib.sha256(repr((a.meta_bytes, a.offsets, a.size)).encode()).hexdigest()}


def test_very_long_names_take_the_slow_path_to_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ranks = [
        *structure(),
        (7, [ArraySpec("ä" * 300 + "/x", (1,), "<f4"), ArraySpec("b", (2,), "<f4")]),
    ]
    fast = plan_file("custom", ranks)
    monkeypatch.setattr(h5format, "_FIXED_MAX", 1)
    assert plan_file("custom", ranks) == fast


@pytest.mark.parametrize(
    ("names", "match"),
    [
        ([""], "empty component"),
        (["a//b"], "empty component"),
        (["/a"], "empty component"),
        (["a/"], "empty component"),
        (["ok", "a/b/"], "empty component"),
        (["a\0b"], "NUL"),
        (["."], "component '.'"),
        (["./a"], "component '.'"),
        (["a/./b"], "component '.'"),
        (["ok", "a/."], "component '.'"),
        (["x", "x"], "two objects named 'x'"),
        (["a", "a/b"], "two objects named 'a'"),
        (["g/a", "g/b", "g/a"], "two objects named 'g/a'"),
    ],
)
def test_names_hdf5_cannot_hold(tmp_path: Path, names: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_skeleton(
            tmp_path / "f.h5",
            layout_kind="self",
            ranks=[(0, [ArraySpec(n, (1,), "<f4") for n in names])],
        )
    assert not (tmp_path / "f.h5").exists()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (ArraySpec("x", (1,), "<U3"), "unsupported dtype"),
        (ArraySpec("x", (1,), "<f3"), "unsupported dtype"),
        (ArraySpec("x", (1,), "O"), "unsupported dtype"),
        (ArraySpec("x", (1,), "V8"), "unsupported dtype"),
        (ArraySpec("x", (-1,), "<f4"), "negative"),
        (ArraySpec("x", (1,) * 33, "<f4"), "more than 32"),
        (ArraySpec("x", (1 << 40, 1 << 40), "<f4"), "too large"),
    ],
)
def test_structures_hdf5_cannot_hold(spec: ArraySpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_file("self", [(0, [spec])])


def test_a_rank_listed_twice() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        plan_file("self", [(1, []), (1, [])])


def test_an_existing_file_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "f.h5").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        create_skeleton(tmp_path / "f.h5", layout_kind="self", ranks=[(0, [])])
    assert (tmp_path / "f.h5").read_bytes() == b"keep"


# --- random structures ----------------------------------------------------------------------

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

COMPONENT = st.text(
    st.characters(blacklist_characters="/\0", blacklist_categories=["Cs"]), min_size=1, max_size=12
).filter(lambda c: c != ".")  # "." is the group itself: not a name (a ValueError, tested above)
PATH = st.lists(
    st.sampled_from(["a", "b", "ab", "é", "x y"]) | COMPONENT, min_size=1, max_size=4
).map("/".join)
SHAPE = st.lists(st.integers(0, 4), max_size=4).map(tuple) | st.just((70_000, 3))


@st.composite
def structures(draw: st.DrawFn) -> dict[int, dict[str, tuple[tuple[int, ...], str]]]:
    ranks = draw(st.lists(st.integers(0, 99_999), min_size=1, max_size=3, unique=True))
    out: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}
    for r in ranks:
        names = draw(st.lists(PATH, max_size=12, unique=True))
        # drop names that are a prefix group of another (a name is a dataset or a group)
        names = [
            n
            for n in names
            if not any(m.startswith(n + "/") or n.startswith(m + "/") for m in names if m != n)
        ]
        out[r] = {n: (draw(SHAPE), draw(st.sampled_from(DTYPES))) for n in names}
    return out


@SETTINGS
@given(structures())
def test_random_structures_read_back(
    tmp_path_factory: pytest.TempPathFactory,
    shape: dict[int, dict[str, tuple[tuple[int, ...], str]]],
) -> None:
    data = {
        r: {n: sample(dt, s, i) for i, (n, (s, dt)) in enumerate(arrays.items())}
        for r, arrays in shape.items()
    }
    roundtrip(tmp_path_factory.mktemp("h5"), data, kind="custom")


def test_a_save_does_not_need_h5py(tmp_path: Path) -> None:
    """Checkpoints are written without h5py (it is imported only to export a global file)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'h5py':\n"
        "            raise ImportError('h5py is blocked by the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import numpy as np\n"
        "from resilient import CheckpointManager\n"
        "with CheckpointManager(sys.argv[1]) as m:\n"
        "    m.save(1, {'model': {'w': np.arange(6.0).reshape(2, 3)}, 'step': np.int64(1)})\n"
        "    m.save(2, {'model': {'w': np.ones((2, 3))}, 'step': np.int64(2)})\n"
        "print('h5py' in sys.modules)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ck"), root],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]
    with h5py.File(tmp_path / "ck" / "step_00000002" / "rank_00000.h5", "r") as f:
        np.testing.assert_array_equal(f["rank_00000/model/w"][()], np.ones((2, 3)))
