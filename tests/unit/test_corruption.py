"""Damaged, forged and hostile checkpoints: restore falls back and quarantines, nothing leaks."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.errors import (
    CheckpointNotFoundError,
    ConfigError,
    InvalidCheckpointError,
    StaticDataError,
)
from resilient.io.checkpoints import latest_valid, list_checkpoints, validate_checkpoint
from resilient.io.manifests import marker_text
from resilient.model.checksum import digest_bytes
from resilient.model.codec import parse_manifest
from tests.unit.ckutil import SavedRoot, assert_state_equal, state_of, static_of

DATA = "rank_00000.h5"
QUARANTINED_3 = re.compile(r"^step_00000003\.quarantined-[0-9a-f]{8,32}$")


# --------------------------------------------------------------------------- helpers


def manifest_doc(step_dir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((step_dir / "manifest.json").read_text())
    return doc


def dataset_entry(step_dir: Path, name: str) -> dict[str, Any]:
    for d in parse_manifest((step_dir / "manifest.json").read_text()).ranks[0].datasets:
        if d.name == name:
            return d._asdict()
    raise AssertionError(f"no dataset {name!r} in {step_dir}")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def forge(step_dir: Path, doc: dict[str, Any], step: int = 3) -> None:
    """Rewrite the manifest and a COMMITTED marker whose checksum matches it."""
    text = json.dumps(doc, indent=1).encode()
    (step_dir / "manifest.json").write_bytes(text)
    (step_dir / "COMMITTED").write_text(marker_text(step, digest_bytes(text)))


def snapshot(top: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``top`` (and ``top`` itself): kind, bytes, mode, mtime."""
    out: dict[str, tuple[Any, ...]] = {}
    paths = [top, *sorted(top.rglob("*"))] if top.is_dir() else [top]
    for p in paths:
        st = os.lstat(p)
        if p.is_symlink():
            out[str(p)] = ("link", os.readlink(p), st.st_mtime_ns)
        elif p.is_dir():
            out[str(p)] = ("dir", st.st_mode, st.st_mtime_ns)
        else:
            out[str(p)] = ("file", p.read_bytes(), st.st_mode, st.st_mtime_ns)
    return out


def restore_fresh(root: Path, caplog: pytest.LogCaptureFixture) -> tuple[int, dict[str, Any]]:
    caplog.set_level(logging.WARNING)
    with CheckpointManager(root) as m:
        return m.restore()


def quarantined(root: Path, step: int = 3) -> list[Path]:
    pat = re.compile(rf"^step_{step:08d}\.quarantined-[0-9a-f]{{8,32}}$")
    return sorted(p for p in root.iterdir() if pat.match(p.name))


def assert_quarantined(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture, reason: str, step: int = 3
) -> Path:
    """Step ``step`` was renamed aside with QUARANTINE.json, and the reason was logged."""
    root = saved.root
    assert not os.path.lexists(saved.step_dir(step))
    (q,) = quarantined(root, step)
    info = json.loads((q / "QUARANTINE.json").read_text())
    assert info["step"] == step
    assert reason in info["reason"], info["reason"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(reason in w and q.name in w for w in warnings), warnings
    records = {(r.step, r.status): r for r in list_checkpoints(root)}
    assert reason in records[(step, "quarantined")].reason
    return q


# --------------------------------------------------------------------------- corruptions


def truncate(saved: SavedRoot) -> str:
    path = saved.step_dir(3) / DATA
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"data file {DATA} has {size // 2} bytes, manifest says {size}"


def flip_dataset_byte(saved: SavedRoot) -> str:
    d = dataset_entry(saved.step_dir(3), "x")
    flip_byte(saved.step_dir(3) / DATA, d["offset"] + d["nbytes"] // 2)
    return f"checksum mismatch: rank 0 dataset 'x' in {DATA}"


def flip_small_dataset_byte(saved: SavedRoot) -> str:
    d = dataset_entry(saved.step_dir(3), "i")
    flip_byte(saved.step_dir(3) / DATA, d["offset"] + d["nbytes"] - 1)
    return f"checksum mismatch: rank 0 dataset 'i' in {DATA}"


def remove_data_file(saved: SavedRoot) -> str:
    (saved.step_dir(3) / DATA).unlink()
    return f"data file {DATA} is missing"


def garbage_manifest(saved: SavedRoot) -> str:
    (saved.step_dir(3) / "manifest.json").write_bytes(b"\x00\x01 not json {")
    return "manifest.json does not match its checksum in COMMITTED"


def garbage_manifest_forged_marker(saved: SavedRoot) -> str:
    text = b"{ this is not json"
    (saved.step_dir(3) / "manifest.json").write_bytes(text)
    (saved.step_dir(3) / "COMMITTED").write_text(marker_text(3, digest_bytes(text)))
    return "bad manifest: not JSON"


def remove_manifest(saved: SavedRoot) -> str:
    (saved.step_dir(3) / "manifest.json").unlink()
    return "manifest.json is missing"


def remove_committed(saved: SavedRoot) -> str:
    (saved.step_dir(3) / "COMMITTED").unlink()
    return "no COMMITTED marker (incomplete save)"


def garble_committed(saved: SavedRoot) -> str:
    (saved.step_dir(3) / "COMMITTED").write_text("{}")
    return "COMMITTED marker is garbled"


def marker_of_other_step(saved: SavedRoot) -> str:
    step_dir = saved.step_dir(3)
    text = (step_dir / "manifest.json").read_bytes()
    (step_dir / "COMMITTED").write_text(marker_text(2, digest_bytes(text)))
    return "manifest step differs from the marker's"


def forged_dataset_dtype(saved: SavedRoot) -> str:
    doc = manifest_doc(saved.step_dir(3))
    doc["ranks"][0]["datasets"]["dtypes"][0] = "|O"
    forge(saved.step_dir(3), doc)
    return "bad manifest: unsupported dtype '|O'"


def data_file_symlink(saved: SavedRoot) -> str:
    step_dir = saved.step_dir(3)
    outside = saved.root.parent / "decoy.h5"
    shutil.copyfile(step_dir / DATA, outside)  # a perfectly valid copy: must still be refused
    (step_dir / DATA).unlink()
    (step_dir / DATA).symlink_to(outside)
    return f"data file {DATA} is not a regular file"


def manifest_symlink(saved: SavedRoot) -> str:
    step_dir = saved.step_dir(3)
    outside = saved.root.parent / "manifest-decoy.json"
    shutil.copyfile(step_dir / "manifest.json", outside)
    (step_dir / "manifest.json").unlink()
    (step_dir / "manifest.json").symlink_to(outside)
    return "manifest.json is not a regular file"


CORRUPTIONS: dict[str, Callable[[SavedRoot], str]] = {
    "truncated": truncate,
    "flipped-dataset-byte": flip_dataset_byte,
    "flipped-small-dataset-byte": flip_small_dataset_byte,
    "missing-data-file": remove_data_file,
    "garbage-manifest": garbage_manifest,
    "garbage-manifest-forged-marker": garbage_manifest_forged_marker,
    "missing-manifest": remove_manifest,
    "missing-committed": remove_committed,
    "garbled-committed": garble_committed,
    "marker-of-other-step": marker_of_other_step,
    "forged-object-dtype": forged_dataset_dtype,
    "data-file-symlink": data_file_symlink,
    "manifest-symlink": manifest_symlink,
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_newest_falls_back_to_previous(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    reason = CORRUPTIONS[case](saved)
    outside_before = {p.name: p.read_bytes() for p in saved.root.parent.iterdir() if p.is_file()}
    step, state = restore_fresh(saved.root, caplog)
    assert step == 2
    assert_state_equal(state, saved.expected(2))
    assert_quarantined(saved, caplog, reason)
    # steps 1 and 2 are still there and valid; nothing outside the root changed
    assert [(r.step, r.status) for r in list_checkpoints(saved.root, full=True)] == [
        (1, "valid"),
        (2, "valid"),
        (3, "quarantined"),
    ]
    outside_after = {p.name: p.read_bytes() for p in saved.root.parent.iterdir() if p.is_file()}
    assert outside_after == outside_before


def test_the_corruption_is_seen_before_restore(saved: SavedRoot) -> None:
    """Quick validation sees the truncation; only full validation sees a flipped data byte."""
    truncate(saved)
    with pytest.raises(InvalidCheckpointError, match="manifest says"):
        validate_checkpoint(saved.step_dir(3))


def test_flipped_dataset_byte_seen_by_full_validation_only(saved: SavedRoot) -> None:
    flip_dataset_byte(saved)
    validate_checkpoint(saved.step_dir(3))  # sizes are right
    with pytest.raises(InvalidCheckpointError) as info:
        validate_checkpoint(saved.step_dir(3), full=True)
    assert info.value.reason.startswith(f"checksum mismatch in {DATA}: rank 0 dataset 'x'")
    assert info.value.path == str(saved.step_dir(3))
    rec = latest_valid(saved.root, full=True)
    assert rec is not None and rec.step == 2
    rec = latest_valid(saved.root)
    assert rec is not None and rec.step == 3


def test_flipped_metadata_byte_full_validation_only_restore_still_good(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture
) -> None:
    step_dir = saved.step_dir(3)
    meta = manifest_doc(step_dir)["files"][0]["meta_segments"]
    assert meta[0][0] == 0 and meta[0][1] >= 100
    flip_byte(step_dir / DATA, 50)
    validate_checkpoint(step_dir)  # quick validation cannot see it
    with pytest.raises(InvalidCheckpointError) as info:
        validate_checkpoint(step_dir, full=True)
    assert info.value.reason == (
        f"checksum mismatch in {DATA}: HDF5 metadata (bytes 0-{meta[0][1]})"
    )
    step, state = restore_fresh(saved.root, caplog)
    assert step == 3
    assert_state_equal(state, saved.expected(3))
    assert step_dir.is_dir()
    assert quarantined(saved.root) == []


def test_full_validation_of_intact_checkpoints_passes(saved: SavedRoot) -> None:
    for step in (1, 2, 3):
        m = validate_checkpoint(saved.step_dir(step), full=True)
        assert m.step == step
        assert m.static is not None
        assert m.metrics == {"loss": 1.0 / step}


@pytest.mark.parametrize("name", ["../x.h5", "../../outside.h5", "ABSOLUTE"])
def test_forged_manifest_with_path_traversal_is_rejected(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    step_dir = saved.step_dir(3)
    if name == "ABSOLUTE":
        name = str(saved.root.parent / "absolute.h5")
    decoy = (step_dir / name).resolve() if not os.path.isabs(name) else Path(name)
    shutil.copyfile(step_dir / DATA, decoy)  # following the name would "work": must not
    doc = manifest_doc(step_dir)
    doc["files"][0]["name"] = name
    doc["ranks"][0]["file"] = name
    forge(step_dir, doc)
    before = snapshot(decoy)

    step, state = restore_fresh(saved.root, caplog)

    assert step == 2
    assert_state_equal(state, saved.expected(2))
    assert_quarantined(saved, caplog, f"illegal or repeated file name {name!r}")
    assert snapshot(decoy) == before


def test_step_dir_symlink_to_outside_is_not_followed(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = saved.root.parent / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "step3"
    shutil.move(str(saved.step_dir(3)), target)  # a complete, valid checkpoint
    saved.step_dir(3).symlink_to(target, target_is_directory=True)
    before = snapshot(elsewhere)

    step, state = restore_fresh(saved.root, caplog)

    assert step == 2
    assert_state_equal(state, saved.expected(2))
    assert not os.path.lexists(saved.step_dir(3))
    (q,) = quarantined(saved.root)
    assert q.is_symlink()  # the link was renamed, not its target
    assert os.readlink(q) == str(target)
    assert snapshot(elsewhere) == before  # no QUARANTINE.json written through the link
    assert any(
        "is a symlink (not followed)" in r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
    )


@pytest.mark.parametrize("into", [False, True])
def test_a_large_state_checksummed_while_read_falls_back_on_a_flipped_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, into: bool
) -> None:
    """A state of many MiB is checksummed on a helper thread while it is read: a flipped byte in
    any of its arrays (new ones or the caller's) is still named, and restore falls back."""
    rng = np.random.default_rng(5)
    state = {f"w{i}": rng.random(8192 + i) for i in range(200)}  # ~13 MiB of 64 KiB arrays
    state["big"] = rng.random(400_000)  # 3.2 MB: its own read
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, state)
        m.save(3, {k: v + 1 for k, v in state.items()})
    for name in ("w117", "big"):
        d = dataset_entry(root / "step_00000003", name)
        flip_byte(root / "step_00000003" / DATA, d["offset"] + d["nbytes"] - 3)
    caplog.set_level(logging.WARNING)
    with CheckpointManager(root) as m:
        template = {k: np.zeros_like(v) for k, v in state.items()}
        step, got = m.restore(into=template) if into else m.restore()
    assert step == 1
    assert_state_equal(got, state)
    (q,) = quarantined(root)
    reason = json.loads((q / "QUARANTINE.json").read_text())["reason"]
    assert re.search(r"checksum mismatch: rank 0 dataset '(w117|big)'", reason), reason


def test_static_data_corrupted_in_one_copy_is_read_from_the_other_and_repaired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, state_of(1), static=static_of(1))
        m.save(2, state_of(2), static=static_of(2))
        m.save(3, state_of(3), static=static_of(2))
    hashes = {s: manifest_doc(root / f"step_{s:08d}")["static"] for s in (1, 2, 3)}
    assert hashes[2] == hashes[3] != hashes[1]
    static_dir = root / "static" / hashes[2]
    d = dataset_entry(static_dir, "grid")
    flip_byte(static_dir / DATA, d["offset"] + 8)

    step, state = restore_fresh(root, caplog)

    assert step == 3 and quarantined(root, 2) == [] and quarantined(root, 3) == []
    assert_state_equal(state, {**state_of(3), **static_of(2)})
    repaired = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    assert len(repaired) == 1 and f"{hashes[2]}/" in repaired[0], repaired
    copy = root / "static" / f"{hashes[2]}.copy"
    assert (static_dir / DATA).read_bytes() == (copy / DATA).read_bytes()
    validate_checkpoint(root / "step_00000003", full=True)


def test_static_data_corrupted_in_both_copies_falls_back_without_quarantine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, state_of(1), static=static_of(1))
        m.save(2, state_of(2), static=static_of(2))
        m.save(3, state_of(3), static=static_of(2))
    h2 = manifest_doc(root / "step_00000002")["static"]
    for name in (h2, f"{h2}.copy"):
        d = dataset_entry(root / "static" / name, "grid")
        flip_byte(root / "static" / name / DATA, d["offset"] + 8)

    step, state = restore_fresh(root, caplog)

    assert step == 1
    assert_state_equal(state, {**state_of(1), **static_of(1)})
    for s in (2, 3):  # their own files are intact: kept, not quarantined
        assert (root / f"step_{s:08d}").is_dir() and quarantined(root, s) == []
    lines = [
        r.getMessage() for r in caplog.records if "not restored (not quarantined)" in r.getMessage()
    ]
    assert len(lines) == 2 and all("checksum mismatch" in line for line in lines), lines


def test_static_data_missing_marker_is_repaired_from_the_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root) as m:
        m.save(1, state_of(1), static=static_of(1))
        m.save(2, state_of(2), static=static_of(2))
    h2 = manifest_doc(root / "step_00000002")["static"]
    (root / "static" / h2 / "COMMITTED").unlink()
    assert latest_valid(root).step == 2  # type: ignore[union-attr]

    step, state = restore_fresh(root, caplog)

    assert step == 2 and quarantined(root, 2) == []
    assert_state_equal(state, {**state_of(2), **static_of(2)})
    assert (root / "static" / h2 / "COMMITTED").is_file()
    assert any("no COMMITTED marker" in r.getMessage() and "repaired" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_shared_static_data_lost_in_both_copies_quarantines_nothing(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture
) -> None:
    h = manifest_doc(saved.step_dir(3))["static"]
    for name in (h, f"{h}.copy"):
        (saved.root / "static" / name / "manifest.json").write_text("{}")
    caplog.set_level(logging.WARNING)
    with CheckpointManager(saved.root) as m, pytest.raises(StaticDataError) as err:
        m.restore()
    assert "manifest.json does not match its checksum" in str(err.value)
    assert "backup" in str(err.value) and "start over" in str(err.value)
    for s in (1, 2, 3):
        assert quarantined(saved.root, s) == [] and saved.step_dir(s).is_dir()
    records = list_checkpoints(saved.root)
    assert [(r.status, r.shared) for r in records] == [("invalid", True)] * 3


def test_explicit_step_that_is_corrupt_is_not_replaced_by_another(
    saved: SavedRoot, caplog: pytest.LogCaptureFixture
) -> None:
    flip_dataset_byte(saved)
    caplog.set_level(logging.WARNING)
    with CheckpointManager(saved.root) as m:
        with pytest.raises(CheckpointNotFoundError, match="step 3"):
            m.restore(3)
        step, state = m.restore(2)
    assert step == 2
    assert_state_equal(state, saved.expected(2))


# --------------------------------------------------------------------------- leftovers


def test_leftovers_are_removed_and_never_listed(saved: SavedRoot) -> None:
    root = saved.root
    tmp4 = root / ".step_00000004.tmp-0123abcd"
    shutil.copytree(saved.step_dir(2), tmp4)  # complete-looking, but never committed
    trash = root / ".trash-89abcdef01234567"
    shutil.copytree(saved.step_dir(1), trash)
    static_tmp = root / "static" / ".tmp-abcdef0123"
    static_tmp.mkdir()
    (static_tmp / DATA).write_bytes(b"partial")
    outside = root.parent / "outside-dir"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    link_tmp = root / ".step_00000005.tmp-feedface"
    link_tmp.symlink_to(outside, target_is_directory=True)
    (root / "notes.txt").write_text("user notes")
    outside_before = snapshot(outside)

    listed = [(r.step, r.status) for r in list_checkpoints(root)]
    assert listed == [(1, "valid"), (2, "valid"), (3, "valid")]
    rec = latest_valid(root)
    assert rec is not None and rec.step == 3

    with CheckpointManager(root) as m:
        names = sorted(p.name for p in root.iterdir())
        assert names == [
            ".lock",
            ".resilient-root",
            ".resilient-root.copy",
            "notes.txt",
            "saves.jsonl",
            "static",
            "step_00000001",
            "step_00000002",
            "step_00000003",
        ]
        assert [p.name for p in (root / "static").iterdir() if p.name.startswith(".")] == []
        assert m.latest_step() == 3
        step, state = m.restore()
    assert step == 3
    assert_state_equal(state, saved.expected(3))
    assert snapshot(outside) == outside_before
    assert (root / "notes.txt").read_text() == "user notes"


def test_killed_save_leftover_does_not_shadow_restore(saved: SavedRoot) -> None:
    tmp = saved.root / ".step_00000009.tmp-0123abcd"
    shutil.copytree(saved.step_dir(3), tmp)
    assert [r.step for r in list_checkpoints(saved.root)] == [1, 2, 3]
    with CheckpointManager(saved.root) as m:
        assert not tmp.exists()
        assert m.restore()[0] == 3


# --------------------------------------------------------------------------- foreign roots


def test_foreign_non_empty_directory_is_refused_untouched(tmp_path: Path) -> None:
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "data.txt").write_text("important")
    (foreign / "sub").mkdir()
    (foreign / "sub" / "inner.bin").write_bytes(bytes(range(256)))
    (foreign / ".hidden").write_text("x")
    before = snapshot(foreign)
    with pytest.raises(ConfigError, match="not a resilient checkpoint root"):
        CheckpointManager(foreign)
    assert snapshot(foreign) == before
    assert not (foreign / ".lock").exists()
    assert not (foreign / ".resilient-root").exists()


def test_foreign_directory_with_fake_marker_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / ".resilient-root").write_text('{"format": "something-else"}')
    (foreign / "data.txt").write_text("important")
    before = snapshot(foreign)
    with pytest.raises(ConfigError):
        CheckpointManager(foreign)
    assert snapshot(foreign) == before


def test_empty_or_missing_directory_becomes_a_root(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "new" / "nested"):
        with CheckpointManager(root) as m:
            m.save(0, {"a": np.arange(3)})
        doc = json.loads((root / ".resilient-root").read_text())
        assert doc["format"] == "resilient-root"
        with CheckpointManager(root) as m:
            step, state = m.restore()
        assert step == 0
        assert_state_equal(state, {"a": np.arange(3)})


def test_no_checkpoint_raises_not_found(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        assert m.latest_step() is None
        with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint"):
            m.restore()
        with pytest.raises(FileNotFoundError):  # also a FileNotFoundError
            m.restore()
