"""How many collective operations a blocking save costs, counted on real MPI ranks.

A blocking save whose structure and static data are those of the previous save reads as a
script of three raw collective calls: every rank says it is ready (one allgather, the
coordinator's temporary directory included), every rank writes and fsyncs its bytes, every
rank's outcome goes to the coordinator (one gather), which commits and announces the outcome
(one broadcast). With a node-local tier every rank builds the manifest and every node commits
its own copy: three allgathers. So does the first save after a restart, with the restored
file's skeleton. The calls of every communicator split from the save's (a file group's, a
manifest shard's) count too. A sharded save with a node-local tier takes six: the first
allgather, each shard's gather and broadcast (its leader writes the shard into its node's
copy), the shards to the coordinator, the index it builds to every rank, and every node's
commit of its copy (an allgather).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

SCENARIO = "tests/mpi/scenario.py"


@pytest.mark.parametrize("tier", ["shared", "local"])
@pytest.mark.parametrize("kind", ["self", "node", "world", "split"])
def test_a_blocking_save_of_an_unchanged_structure_takes_three_operations(
    tmp_path: Path, kind: str, tier: str
) -> None:
    got = results(run_mpi(3, [SCENARIO, "rounds", str(tmp_path / "ck"), kind, tier]))
    assert len(got) == 3 and all(r["ok"] for r in got)
    for r in got:
        later = r["calls"][1:]  # the first save plans its files and stores the static data
        assert len(later) == 4, later  # three saves, then the first after a restart
        assert all(len(calls) <= 3 for calls in later), (kind, tier, r["rank"], later)
    assert got[0]["calls"][1:] == [got[0]["calls"][1]] * 4  # the same script every time


def test_a_sharded_save_with_a_node_local_tier_takes_five_operations(tmp_path: Path) -> None:
    """With a node-local tier and a shard per rank (every rank a shard's leader): the ready
    round, each shard up to its leader (which writes it), the leaders up to the coordinator,
    the index down to every rank, and every node's commit outcome to every rank."""
    got = results(run_mpi(3, [SCENARIO, "rounds", str(tmp_path / "ck"), "self", "local-sharded"]))
    assert len(got) == 3 and all(r["ok"] for r in got)
    for r in got:
        later = r["calls"][1:]
        assert len(later) == 4, later
        assert all(len(calls) <= 5 for calls in later), (r["rank"], later)
    assert got[0]["calls"][1:] == [got[0]["calls"][1]] * 4
    assert got[0]["calls"][1] == [
        "allgather", "gather", "gather", "bcast", "allgather"
    ], got[0]["calls"][1]  # fmt: skip


@pytest.mark.parametrize("kind", ["self", "split"])
def test_a_sharded_manifest_costs_a_shard_leader_one_operation_more(
    tmp_path: Path, kind: str
) -> None:
    """With a sharded manifest, every rank's outcome goes up in two levels: to its shard's
    leader (one gather over the shard), which writes the shard, then from the leaders to the
    coordinator (one gather over the leaders); the other ranks send the coordinator nothing.
    So a leader makes four calls (ready, shard gather, leaders' gather, the outcome's
    broadcast) and every other rank three."""
    args = [SCENARIO, "rounds", str(tmp_path / "ck"), kind, "shared"]
    got = results(run_mpi(4, args, SCENARIO_SHARD_RANKS="2"))
    assert len(got) == 4 and all(r["ok"] for r in got)
    leaders = {0, 2}  # shards of two ranks: {0, 1} and {2, 3}
    for r in got:
        later = r["calls"][1:]
        assert len(later) == 4, later
        want = ["allgather", "gather", "gather", "bcast"] if r["rank"] in leaders else [
            "allgather", "gather", "bcast"]  # fmt: skip
        assert all(calls == want for calls in later), (kind, r["rank"], later)
