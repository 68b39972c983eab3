"""Blocks and replicated values: the arithmetic, the tree, partial reads, hostile manifests,
``resilient export``. One process (SerialComm); other rank counts are tests/test_elastic.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from resilient import (
    Block,
    BlockSpec,
    CheckpointManager,
    ConfigError,
    Replicated,
    block_1d,
    cartesian_block,
)
from resilient.errors import InvalidCheckpointError
from resilient.export import export
from resilient.io.checkpoints import validate_checkpoint
from resilient.io.manifests import marker_text
from resilient.model.blocks import (
    STRIPE_BYTES,
    STRIPE_MIN_BYTES,
    check_tiling,
    intersect,
    stripe_count,
    stripe_range,
    stripe_rows,
    unwrap,
)
from resilient.model.checksum import digest_bytes
from resilient.model.codec import parse_manifest
from resilient.model.manifest import DatasetTable, ManifestError
from resilient.model.tiling import check_blocks
from tests.mpirun import clean_env

G = (600, 700)  # float64 rows of 5600 bytes: 19 rows per stripe (600 / 32), 32 stripes
CLI = [sys.executable, "-m", "resilient.cli"]


def field(step: int = 1) -> np.ndarray:
    i, j = np.indices(G)
    return (i * 1000.0 + j + step).astype(np.float64)


def spec(
    start: tuple[int, ...], shape: tuple[int, ...], g: tuple[int, ...] = (10, 10)
) -> BlockSpec:
    return BlockSpec.of(g, start, shape)


# --------------------------------------------------------------------------- arithmetic


def _heat_split(n: int, parts: int, index: int) -> tuple[int, int]:  # apps/heat.py's, before
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@pytest.mark.parametrize("n", [0, 1, 7, 10, 13])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6])
def test_block_1d_is_balanced_and_tiles(n: int, parts: int) -> None:
    pieces = [block_1d(n, parts, i) for i in range(parts)]
    assert sum(size for _, size in pieces) == n
    assert all(pieces[i][0] + pieces[i][1] == pieces[i + 1][0] for i in range(parts - 1))
    assert max(s for _, s in pieces) - min(s for _, s in pieces) <= 1
    for i, (start, size) in enumerate(pieces):
        assert _heat_split(n, parts, i) == (start, start + size)


def test_cartesian_block_tiles_the_global_shape() -> None:
    g, dims = (13, 7), (3, 2)
    blocks = [
        BlockSpec(g, *cartesian_block(g, dims, (cx, cy))) for cx in range(3) for cy in range(2)
    ]
    assert check_tiling(g, blocks) is None
    assert cartesian_block(g, dims, (0, 0)) == ((0, 0), (5, 4))
    assert cartesian_block(g, dims, (2, 1)) == ((9, 4), (4, 3))
    with pytest.raises(ConfigError):
        cartesian_block(g, (3,), (0, 0))
    with pytest.raises(ConfigError):
        block_1d(5, 2, 2)


def test_intersect() -> None:
    a, b = spec((0, 0), (6, 4)), spec((4, 2), (6, 8))
    assert intersect(a, b) == BlockSpec((10, 10), (4, 2), (2, 2))
    assert intersect(a, spec((6, 0), (4, 10))) is None  # touching is not overlapping
    assert intersect(a, spec((0, 0), (0, 10))) is None  # empty
    assert intersect(a, a) == a


def test_check_tiling_finds_gaps_overlaps_and_outsiders() -> None:
    g = (10, 10)
    halves = [spec((0, 0), (5, 10)), spec((5, 0), (5, 10))]
    assert check_tiling(g, halves) is None
    assert check_tiling(g, [*halves, spec((3, 3), (0, 4))]) is None  # empty blocks are ignored
    problem = check_tiling(g, [spec((0, 0), (6, 10)), BlockSpec(g, (5, 0), (5, 10))])
    assert problem is not None and "elements" in problem
    # same total, one overlap and one hole
    problem = check_tiling(g, [spec((0, 0), (5, 10)), spec((4, 0), (5, 10))])
    assert problem == "blocks overlap"
    assert "outside" in str(check_tiling(g, [BlockSpec(g, (6, 0), (5, 10))]))
    assert "axes" in str(check_tiling(g, [BlockSpec((10,), (0,), (10,))]))


def test_check_tiling_pairwise_when_the_grid_is_huge(monkeypatch: pytest.MonkeyPatch) -> None:
    import resilient.model.blocks as blocks

    monkeypatch.setattr(blocks, "_MAX_GRID_CELLS", 1)
    g = (10, 10)
    assert check_tiling(g, [spec((0, 0), (5, 10)), spec((5, 0), (5, 10))]) is None
    both = [spec((0, 0), (5, 10)), spec((4, 0), (5, 10))]
    assert check_tiling(g, both) == "blocks overlap"


def test_stripes() -> None:
    assert stripe_rows((100_000, 700), 8) == STRIPE_BYTES // 5600 == 187  # at most ~1 MiB
    assert stripe_rows((600, 700), 8) == 19  # a 3.4-MB block in 32 stripes: 600 / 32 rounded up
    assert stripe_rows((512, 2048), 4) == 16  # a 4-MiB block of 8-KiB rows: 128-KiB stripes
    assert stripe_rows((64, 1024), 8) == STRIPE_MIN_BYTES // 8192 == 8  # not under 64 KiB
    assert stripe_rows((3, 10), 8) == 3  # a small block is one stripe
    assert stripe_rows((5,), 4) == 5
    assert stripe_rows((0, 4), 8) == 1
    assert stripe_rows((4, 0), 8) == 4
    assert stripe_count(600, 187) == 4 and stripe_count(0, 1) == 0
    assert stripe_range(0, 187, 187) == (0, 1)
    assert stripe_range(186, 188, 187) == (0, 2)
    assert stripe_range(400, 600, 187) == (2, 4)


def test_block_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="same"):
        Block(np.zeros(3), (3, 3), (0,))
    with pytest.raises(ConfigError, match="ints"):
        Block(np.zeros(3), (3.0,), (0,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="outside"):
        BlockSpec.of((4,), (2,), (3,))
    b = Block(np.zeros((2, 2)), [np.int64(4), 4], [2, 0])
    assert b.global_shape == (4, 4) and b.start == (2, 0)
    assert unwrap({"a": [b, Replicated((1, b))]})["a"][1][1] is b.local


# --------------------------------------------------------------------------- saving


def test_a_block_outside_its_global_shape_is_refused_at_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        with pytest.raises(ConfigError, match="outside global shape"):
            m.save(1, {"u": Block(np.zeros((4, 4)), (6, 6), (3, 0))})
        with pytest.raises(ConfigError, match="Block inside a Replicated"):
            m.save(1, {"u": Replicated({"x": Block(np.zeros(2), (2,), (0,))})})
        with pytest.raises(ConfigError, match="must wrap an array"):
            m.save(1, {"u": Block([1, 2], (2,), (0,))})


def test_same_rank_count_restore_is_transparent(tmp_path: Path) -> None:
    g = field()
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(1, {"u": Block(g, G, (0, 0)), "r": Replicated({"t": 0.5, "a": np.arange(3)})})
        step, state = m.restore()
    assert step == 1 and isinstance(state["u"], np.ndarray) and state["u"].tobytes() == g.tobytes()
    assert state["r"]["t"] == 0.5 and state["r"]["a"].tolist() == [0, 1, 2]
    doc = json.loads((tmp_path / "ck/step_00000001/manifest.json").read_text())
    stripes = doc["ranks"][0]["datasets"]["stripes"]
    assert stripes["u"]["rows"] == 19 and len(stripes["u"]["digests"]) == 32
    assert "r/a" not in stripes  # only Block leaves are striped


# --------------------------------------------------------------------------- partial reads


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        for step in (1, 2):
            m.save(step, {"u": Block(field(step), G, (0, 0)), "t": Replicated(step * 0.5)},
                   static={"k": Block(np.arange(50.0), (50,), (0,))})  # fmt: skip
    return root


def blocks_for(rows: tuple[int, int], cols: tuple[int, int]) -> dict[str, Any]:
    return {"u": (G, (rows[0], cols[0]), (rows[1] - rows[0], cols[1] - cols[0])),
            "k": ((50,), (10,), (5,))}  # fmt: skip


def test_a_sub_block_reads_only_the_stripes_it_needs(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        reads.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    with CheckpointManager(saved) as m:
        step, state = m.restore(blocks=blocks_for((200, 260), (100, 300)))
    assert step == 2
    assert state["u"].tobytes() == field(2)[200:260, 100:300].tobytes()
    assert state["k"].tolist() == list(np.arange(10.0, 15.0)) and state["t"] == 1.0
    # rows 200..260 lie in stripes 10..13 (rows 190..266): 76 rows of u, and all of k
    assert sum(reads) == 76 * 5600 + 50 * 8
    assert sum(reads) < field().nbytes / 3


def test_restore_into_block_templates_reads_in_place(saved: Path) -> None:
    target = np.empty((100, 700))
    into = {"u": Block(target, G, (500, 0))}
    with CheckpointManager(saved) as m:
        _, state = m.restore(into=into, blocks={"k": ((50,), (0,), (50,))})
        assert state["u"] is target and target.tobytes() == field(2)[500:].tobytes()
        with pytest.raises(ConfigError, match="no block given for Block leaf 'k'"):
            m.restore(into=into)
        with pytest.raises(ConfigError, match="global shape"):
            m.restore(blocks={"u": ((600, 701), (0, 0), (1, 1)), "k": ((50,), (0,), (1,))})
        with pytest.raises(ConfigError, match="global_shape, start, shape"):
            m.restore(blocks={"u": (G, (0, 0))})
    assert (saved / "step_00000002").is_dir()  # a caller's mistake quarantines nothing


def flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def u_offset(step_dir: Path) -> int:
    (u,) = [
        d
        for d in parse_manifest((step_dir / "manifest.json").read_text()).ranks[0].datasets
        if d.name == "u"
    ]
    assert u.offset is not None
    return u.offset


def test_a_corrupt_stripe_not_read_is_found_by_verify_full_only(saved: Path) -> None:
    step2 = saved / "step_00000002"
    flip(step2 / "rank_00000.h5", u_offset(step2) + 500 * 5600)  # row 500: stripe 2
    with CheckpointManager(saved) as m:
        step, state = m.restore(blocks=blocks_for((0, 100), (0, 700)))  # stripe 0 only
    assert step == 2 and state["u"].tobytes() == field(2)[:100].tobytes()
    validate_checkpoint(step2)  # the quick check sees sizes only
    with pytest.raises(InvalidCheckpointError, match="stripe"):
        validate_checkpoint(step2, full=True)
    proc = subprocess.run([*CLI, "verify", str(saved), "2", "--full"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and "INVALID" in proc.stdout


def test_a_corrupt_stripe_that_is_read_falls_back(saved: Path) -> None:
    step2 = saved / "step_00000002"
    flip(step2 / "rank_00000.h5", u_offset(step2) + 50 * 5600)  # row 50: stripe 0
    with CheckpointManager(saved) as m:
        step, state = m.restore(blocks=blocks_for((0, 100), (0, 700)))
    assert step == 1 and state["u"].tobytes() == field(1)[:100].tobytes()
    assert [p for p in saved.iterdir() if p.name.startswith("step_00000002.quarantined-")]


# --------------------------------------------------------------------------- hostile manifests


def forge(step_dir: Path, change: Any) -> None:
    doc = json.loads((step_dir / "manifest.json").read_text())
    change(doc)
    text = json.dumps(doc)
    (step_dir / "manifest.json").write_text(text)
    (step_dir / "COMMITTED").write_text(marker_text(doc["step"], digest_bytes(text.encode())))


def _u(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Dataset u's striped part (``{"stripes": ...}``, written back into the columns) and its
    tree metadata, to forge."""
    rank = doc["ranks"][0]
    (node,) = [n for _, key, n in rank["tree"][1] if key == "u"]
    return _StripesOf(rank["datasets"].setdefault("stripes", {}), "u"), node[2]


class _StripesOf(dict):  # type: ignore[type-arg]
    """``{"stripes": ...}`` of one dataset, backed by a manifest's ``stripes`` column."""

    def __init__(self, column: dict[str, Any], name: str) -> None:
        super().__init__()
        self.column, self.name = column, name

    def __getitem__(self, key: str) -> Any:
        assert key == "stripes"
        return self.column[self.name]

    def __setitem__(self, key: str, value: Any) -> None:
        assert key == "stripes"
        self.column[self.name] = value

    def __delitem__(self, key: str) -> None:
        assert key == "stripes"
        del self.column[self.name]


def _outside(doc: dict[str, Any]) -> None:
    _u(doc)[1]["block"]["start"] = [1, 0]


def _not_tiling(doc: dict[str, Any]) -> None:
    _u(doc)[1]["block"]["global_shape"] = [601, 700]


def _short_stripes(doc: dict[str, Any]) -> None:
    _u(doc)[0]["stripes"]["digests"].pop()


def _rows_zero(doc: dict[str, Any]) -> None:
    _u(doc)[0]["stripes"]["rows"] = 0


def _no_stripes(doc: dict[str, Any]) -> None:
    del _u(doc)[0]["stripes"]


def _garbled_block(doc: dict[str, Any]) -> None:
    _u(doc)[1]["block"] = {"global_shape": [600, 700], "start": [0, 0], "x": 1}


def _huge_stripe_list(doc: dict[str, Any]) -> None:
    _u(doc)[0]["stripes"] = {"rows": 1, "digests": ["0" * 16] * 100_000}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_outside, "outside global shape"),
        (_not_tiling, "elements"),
        (_short_stripes, "stripe digests"),
        (_rows_zero, "rows"),
        (_no_stripes, "without stripe checksums"),
        (_garbled_block, "malformed block"),
        (_huge_stripe_list, "stripe digests"),
    ],
)
def test_hostile_block_metadata_is_an_invalid_checkpoint(
    saved: Path, change: Any, why: str
) -> None:
    step2 = saved / "step_00000002"
    forge(step2, change)
    with pytest.raises(InvalidCheckpointError, match=why):
        validate_checkpoint(step2)
    with CheckpointManager(saved) as m:
        step, state = m.restore(blocks=blocks_for((0, 10), (0, 10)))
    assert step == 1 and state["u"].tobytes() == field(1)[:10, :10].tobytes()


def test_overlapping_blocks_of_two_ranks_are_refused(saved: Path) -> None:
    manifest = parse_manifest((saved / "step_00000002/manifest.json").read_text())
    entry = manifest.ranks[0]

    def moved(start: list[int], rows: int) -> Any:
        tree = json.loads(json.dumps(entry.tree))
        for _, key, node in tree[1]:
            if key == "u":
                node[2]["block"]["start"] = start
        datasets = DatasetTable.of(
            [
                d._replace(shape=(rows, 700), nbytes=rows * 5600) if d.name == "u" else d
                for d in entry.datasets
            ]
        )
        return dataclasses.replace(entry, tree=tree, datasets=datasets)

    good = dataclasses.replace(manifest, ranks=(moved([0, 0], 300), moved([300, 0], 300)))
    check_blocks(good)
    bad = dataclasses.replace(manifest, ranks=(moved([0, 0], 300), moved([299, 0], 300)))
    with pytest.raises(ManifestError, match=r"overlap|elements"):
        check_blocks(bad)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("copy", [False, True])
def test_export_reads_as_plain_global_arrays(saved: Path, tmp_path: Path, copy: bool) -> None:
    out = tmp_path / "elsewhere" / "global.h5"
    out.parent.mkdir()
    args = [*CLI, "export", str(saved), "1", str(out)] + (["--copy"] if copy else [])
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert f["u"].shape == G and f["u"][()].tobytes() == field(1).tobytes()
        assert f["k"][()].tolist() == list(np.arange(50.0))
        assert int(f.attrs["step"]) == 1 and list(f["u"].attrs["global_shape"]) == list(G)
        assert f["u"].is_virtual is (not copy)


def test_export_copy_verifies_and_skips_undeclared(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    with CheckpointManager(root) as m:
        m.save(
            1, {"u": Block(field(), G, (0, 0)), "mine": np.arange(4), "r": Replicated(np.ones(2))}
        )
    result = export(root, tmp_path / "a.h5", copy=True)
    assert set(result.datasets) == {"u", "r"} and any("mine" in s for s in result.skipped)
    with h5py.File(tmp_path / "a.h5") as f:
        assert f["r"][()].tolist() == [1.0, 1.0] and "mine" not in f
    flip(root / "step_00000001/rank_00000.h5", u_offset(root / "step_00000001") + 10)
    with pytest.raises(InvalidCheckpointError, match=r"stripe 0"):
        export(root, tmp_path / "b.h5", copy=True)
    assert not (tmp_path / "b.h5").exists()
    proc = subprocess.run([*CLI, "export", str(root), str(tmp_path / "c.h5"), "--copy"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and "INVALID" in proc.stderr


def test_elastic_restore_and_export_read_the_intact_copy_of_the_static_data(
    saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (h,) = [p.name for p in (saved / "static").iterdir() if len(p.name) == 32]
    first = saved / "static" / h
    (first / "manifest.json").write_bytes(b"")  # emptied: the export reads the copy
    result = export(saved, tmp_path / "g.h5", copy=True)
    assert "k" in result.datasets
    with h5py.File(tmp_path / "g.h5") as f:
        assert f["k"][()].tolist() == list(np.arange(50.0))
    caplog.set_level(logging.WARNING)
    data = first / "rank_00000.h5"
    with CheckpointManager(saved) as m:  # repairs the manifest (one warning), then reads
        raw = bytearray(data.read_bytes())  # ... a data file damaged since: the copy's
        at = raw.find(np.arange(50.0).tobytes())
        raw[at + 80 : at + 88] = bytes(8)
        data.write_bytes(bytes(raw))
        step, state = m.restore(blocks=blocks_for((200, 260), (100, 300)))
    assert step == 2 and state["k"].tolist() == list(np.arange(10.0, 15.0))
    assert not [p for p in saved.iterdir() if ".quarantined-" in p.name]
    repaired = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    assert len(repaired) == 2 and all(f"{h}/" in line for line in repaired), repaired
    assert data.read_bytes() == (saved / "static" / f"{h}.copy" / "rank_00000.h5").read_bytes()
