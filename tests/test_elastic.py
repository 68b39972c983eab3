"""Elastic restore under real MPI ranks: saved on N, restored on M (1..6), every layout.

One ``mpiexec -n 6`` per case: the first N ranks save on a communicator of their own, then the
first M ranks restore on theirs (tests/mpi/elastic.py), for every N and M of the case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

SCRIPT = "tests/mpi/elastic.py"


@pytest.mark.parametrize("kind", ["self", "node", "world", "split"])
def test_saved_on_1_to_4_ranks_restores_on_1_to_6(tmp_path: Path, kind: str) -> None:
    got = results(run_mpi(6, [SCRIPT, "matrix", str(tmp_path / "ck"), kind, "1,2,3,4"]))
    assert [r["rank"] for r in got] == list(range(6))
    assert all(r["ok"] for r in got)
    # rank 0 restores in every case: it saw every (N, M) pair
    pairs = {(e["n"], e["m"]) for e in got[0]["report"]}
    assert pairs == {(n, m) for n in (1, 2, 3, 4) for m in range(1, 7)}
    for r in got:
        for e in r["report"]:
            if e["bytes"] is not None:  # an elastic read: within the stripe bound
                assert e["bytes"] <= e["bound"], e


@pytest.mark.parametrize("kind", ["self", "world"])
def test_a_corrupt_stripe_that_is_read_falls_back_on_every_rank(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "ck"
    got = results(run_mpi(4, [SCRIPT, "corrupt", str(root), kind, "700"]))
    assert [r["ok"] for r in got] == [True] * 4  # every restoring rank got step 1
    assert [p.name for p in root.iterdir() if ".quarantined-" in p.name]


def test_undeclared_keys_block_an_elastic_restore_on_every_rank(tmp_path: Path) -> None:
    got = results(run_mpi(4, [SCRIPT, "undeclared", str(tmp_path / "ck"), "node"]))
    restoring = [r for r in got if r["rank"] < 3]
    assert {r["error"] for r in restoring} == {"LayoutMismatchError"}
    assert len({r["message"] for r in restoring}) == 1
    assert restoring[0]["keys"] == ["note", "mine"]
    assert "'note', 'mine'" in restoring[0]["message"]
    assert "node (2 ranks, 1 files)" in restoring[0]["message"]
    assert len({r["missing"] for r in restoring}) == 1
    assert "no block given for Block leaf 'v'" in restoring[0]["missing"]


@pytest.mark.parametrize("kind", ["self", "split"])
def test_a_sharded_manifest_restores_on_other_rank_counts(tmp_path: Path, kind: str) -> None:
    """Saved with a shard per file group on 2-4 ranks, restored on 1-5: the coordinator reads
    every shard for the elastic plan, and a corrupt stripe still falls back."""
    args = [SCRIPT, "matrix", str(tmp_path / "ck"), kind, "2,4"]
    got = results(run_mpi(5, args, SCENARIO_SHARD_RANKS="1"))
    assert all(r["ok"] for r in got)
    assert {(e["n"], e["m"]) for e in got[0]["report"]} == {
        (n, m) for n in (2, 4) for m in range(1, 6)
    }
    root = tmp_path / "bad"
    args = [SCRIPT, "corrupt", str(root), kind, "700"]
    assert all(r["ok"] for r in results(run_mpi(4, args, SCENARIO_SHARD_RANKS="1")))
    assert [p.name for p in root.iterdir() if ".quarantined-" in p.name]


def test_a_sharded_checkpoint_exports_every_shard_and_refuses_a_changed_one(
    tmp_path: Path,
) -> None:
    """Export loads every shard's entries through io (a shard per rank here), and a shard
    whose bytes changed refuses the export, naming it."""
    got = results(run_mpi(2, ["tests/mpi/sharded_export.py", str(tmp_path / "ck")]))
    assert got[0]["shards"] == ["manifest-00000.json", "manifest-00001.json"]
    assert got[0]["same"] and sorted(got[0]["datasets"]) == ["k", "u"]
    assert "manifest shard manifest-00001.json does not match its checksum" in got[0]["refused"]
