"""The node-local tier: checkpoints on /dev/shm (tmpfs, like a compute node's RAM disk), flushed
to a shared root on disk."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from resilient.checkpoint.manager import CheckpointManager
from resilient.checkpoint.tiers import known_local_roots, local_root_of
from resilient.errors import ResilientError
from resilient.io.checkpoints import latest_valid, validate_checkpoint
from resilient.model.policies import KeepLast
from tests.unit.ckutil import assert_state_equal, flip_dataset_byte, state_of, static_of

SHM = Path("/dev/shm")


@pytest.fixture
def local_dir() -> Iterator[Path]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = Path(tempfile.mkdtemp(prefix="resilient-test-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilient.cli", *args], capture_output=True, text=True, timeout=60
    )


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


def crash(m: CheckpointManager) -> None:
    """Leave the manager as a killed job would (no flush, no collective)."""
    m.__exit__(RuntimeError, RuntimeError("killed"), None)


def test_saves_go_local_and_reach_the_shared_root_every_k_and_at_close(
    tmp_path: Path, local_dir: Path
) -> None:
    shared = tmp_path / "shared"
    local = local_root_of(local_dir, shared)
    with CheckpointManager(shared, local_dir=local_dir, flush_every=2, keep=KeepLast(5)) as m:
        for step in (1, 2, 3):
            m.save(step, state_of(step), static=static_of(), blocking=step != 2)
            m.wait()
            # flushed every 2nd checkpoint; the local tier keeps the newest 2 (local_keep)
            assert steps_in(shared) == ([2] if step >= 2 else [])
        assert steps_in(local) == [2, 3]
    assert steps_in(shared) == [2, 3]  # close() flushed the newest one
    for step in (2, 3):  # the shared copies pass full verification: same files, same manifest
        validate_checkpoint(shared / f"step_{step:08d}", full=True)
        assert (shared / f"step_{step:08d}" / "manifest.json").read_bytes() == (
            local / f"step_{step:08d}" / "manifest.json"
        ).read_bytes()
    with CheckpointManager(shared) as m:  # no local tier: the shared root alone restores
        step, got = m.restore()
    assert step == 3
    assert_state_equal(got, {**state_of(3), **static_of()})
    assert known_local_roots(shared) == [local]


def test_restore_prefers_a_newer_local_copy_and_flushes_it(tmp_path: Path, local_dir: Path) -> None:
    shared = tmp_path / "shared"
    m = CheckpointManager(shared, local_dir=local_dir, flush_every=10)
    for step in (1, 2):
        m.save(step, state_of(step))
    m.flush()
    m.save(3, state_of(3))
    crash(m)  # killed: step 3 is only on this node
    assert steps_in(shared) == [2]
    with CheckpointManager(shared, local_dir=local_dir, flush_every=10) as m:
        step, got = m.restore()
        assert step == 3
        assert_state_equal(got, state_of(3))
    assert steps_in(shared) == [2, 3]  # the restored local copy reached the shared root at close


def test_restore_uses_the_shared_root_when_it_is_newer(tmp_path: Path, local_dir: Path) -> None:
    shared = tmp_path / "shared"
    with CheckpointManager(shared, local_dir=local_dir) as m:
        m.save(1, state_of(1))
    with CheckpointManager(shared) as m:  # a job elsewhere went on without a local tier
        m.save(5, state_of(5))
    with CheckpointManager(shared, local_dir=local_dir) as m:
        step, got = m.restore()
    assert step == 5
    assert_state_equal(got, state_of(5))


def test_lost_local_tier_resumes_from_the_shared_root(tmp_path: Path, local_dir: Path) -> None:
    shared = tmp_path / "shared"
    with CheckpointManager(shared, local_dir=local_dir) as m:
        m.save(1, state_of(1))
        m.save(2, state_of(2))
    shutil.rmtree(local_dir)  # the next job lands on another node
    local_dir.mkdir()
    with CheckpointManager(shared, local_dir=local_dir) as m:
        step, got = m.restore()
    assert step == 2
    assert_state_equal(got, state_of(2))


def test_corrupt_local_copy_falls_back_to_the_shared_root(
    tmp_path: Path, local_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    local = local_root_of(local_dir, shared)
    m = CheckpointManager(shared, local_dir=local_dir, flush_every=1)
    m.save(1, state_of(1))
    m.save(2, state_of(2))
    m.wait()
    crash(m)
    flip_dataset_byte(local / "step_00000002")  # same size: passes the quick check
    with caplog.at_level(logging.WARNING), CheckpointManager(shared, local_dir=local_dir) as m:
        step, got = m.restore()
    assert step == 2  # the shared copy of step 2
    assert_state_equal(got, state_of(2))
    assert "failed validation" in caplog.text and "checksum mismatch" in caplog.text
    assert not (local / "step_00000002").exists()  # the bad copy is quarantined


def test_flush_refuses_a_corrupt_local_copy(tmp_path: Path, local_dir: Path) -> None:
    shared = tmp_path / "shared"
    local = local_root_of(local_dir, shared)
    with CheckpointManager(shared, local_dir=local_dir, flush_every=2) as m:
        m.save(1, state_of(1))
        m.save(2, {**state_of(2), "x": np.ones(2000)})
        m.wait()
        m.save(3, state_of(3))
        flip_dataset_byte(local / "step_00000003")
        with pytest.raises(ResilientError, match="checksum mismatch"):
            m.flush()
    record = latest_valid(shared)
    assert record is not None and record.step == 2
    assert [p.name for p in shared.iterdir() if p.name.startswith(".step")] == []


def test_world_layout_spanning_nodes_is_refused_but_one_node_is_fine(
    tmp_path: Path, local_dir: Path
) -> None:
    with CheckpointManager(tmp_path / "s", local_dir=local_dir, checkpoint_comm="world") as m:
        m.save(1, state_of(1))
    with pytest.raises(Exception, match="local_keep"):
        CheckpointManager(tmp_path / "t", local_dir=local_dir, local_keep=0)


def test_cli_shows_both_tiers_and_report_shows_flush_times(tmp_path: Path, local_dir: Path) -> None:
    shared = tmp_path / "shared"
    m = CheckpointManager(shared, local_dir=local_dir, flush_every=2)
    for step in (1, 2, 3):
        m.save(step, state_of(step), static=static_of())
    m.wait()
    crash(m)  # step 3 only in the local tier
    ls = cli("ls", str(shared))
    rows = [line.split()[:2] for line in ls.stdout.splitlines()[1:]]
    assert rows == [["2", "shared"], ["2", "local"], ["3", "local"]], ls.stdout
    assert all(" valid" in line for line in ls.stdout.splitlines()[1:]), ls.stdout
    doc = json.loads(cli("status", str(shared), "--json").stdout)
    assert doc["latest_step"] == 2 and doc["latest_local_step"] == 3
    assert [(c["step"], c["tier"]) for c in doc["checkpoints"]] == [
        (2, "shared"), (2, "local"), (3, "local"),
    ]  # fmt: skip
    report = cli("report", str(shared))
    assert "flushes from the local tier: 1" in report.stdout, report.stdout


def test_the_layout_note_names_nodes_only_for_a_file_per_node() -> None:
    from resilient.checkpoint.tiers import _per_node
    from resilient.model.layout import Layout

    assert _per_node(Layout("node", 4, ((0, 1), (2, 3)))) == "4 ranks on 2 nodes (2 + 2)"
    # a file per rank says nothing of nodes: no "4 ranks on 4 nodes (1 + 1 + 1 + 1)"
    assert (
        _per_node(Layout("self", 4, ((0,), (1,), (2,), (3,))))
        == "4 ranks in 4 files of checkpoint_comm='self'"
    )
