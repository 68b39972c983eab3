"""The checkpoint core under real MPI ranks (mpiexec -n 1..4, oversubscribed on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

SCENARIO = "tests/mpi/scenario.py"
KINDS = ["self", "node", "world", "split"]
EACH_MPI = pytest.mark.each_mpi  # run again under Open MPI (.ci/other-mpi)


@pytest.mark.parametrize("n", [1, 3])
def test_scatter_gives_each_rank_its_own_value(tmp_path: Path, n: int) -> None:
    """Collective.scatter (a restore's parts of the manifest): rank r gets value r; a failing
    coordinator, or a result of the wrong length, raises the same error on every rank."""
    got = results(run_mpi(n, [SCENARIO, "scatter", str(tmp_path / "ck"), "world"]))
    assert [r["got"] for r in got] == [f"for {r}" for r in range(n)]
    assert len({json_key(r["errors"]) for r in got}) == 1
    assert len(got[0]["errors"]) == 2 and "no" in got[0]["errors"][0][1]


def json_key(value: object) -> str:
    import json

    return json.dumps(value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, pytest.param(3, marks=EACH_MPI), 4])
def test_round_trip_is_bit_identical(tmp_path: Path, n: int, kind: str) -> None:
    proc = run_mpi(n, [SCENARIO, "roundtrip", str(tmp_path / "ck"), kind])
    got = results(proc)
    assert [r["rank"] for r in got] == list(range(n))
    assert all(r["ok"] for r in got)


@pytest.mark.parametrize("kind", ["self", "node", "split"])
@pytest.mark.parametrize(
    ("where", "expect"),
    [
        pytest.param("write@1", 1, marks=EACH_MPI),  # one rank killed half-way through writing
        ("write@all", 1),  # every rank killed while writing
        ("manifest@0", 1),  # coordinator killed before the manifest
        ("rename@0", 1),  # manifest and marker written, killed before the rename
        ("after-rename@0", 2),  # killed right after the rename: step 2 is committed
    ],
)
def test_kill_during_save_restores_last_committed(
    tmp_path: Path, kind: str, where: str, expect: int
) -> None:
    root = tmp_path / "ck"
    killed = run_mpi(4, [SCENARIO, "kill", str(root), kind, where], check=False)
    assert killed.returncode != 0, killed.stdout
    assert "survived" not in killed.stdout
    proc = run_mpi(4, [SCENARIO, "restore", str(root), kind, str(expect)])
    got = results(proc)
    assert [r.get("step") for r in got] == [expect] * 4, got
    assert not [p for p in root.iterdir() if p.name.startswith(".step_")], "tmp dir not cleaned"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3])
def test_a_restart_saves_again_and_restores(tmp_path: Path, n: int, kind: str) -> None:
    """Restore, save twice (the restored skeleton reused, rotation writing over dropped files),
    twice over, then restore the newest: no rank left behind in a round of its file's group."""
    got = results(run_mpi(n, [SCENARIO, "resave", str(tmp_path / "ck"), kind], timeout=120))
    assert [r["step"] for r in got] == [5] * n


@pytest.mark.parametrize("n", [1, 3])
def test_a_reply_kept_by_the_coordinator_reaches_no_other_rank(tmp_path: Path, n: int) -> None:
    """A save's manifest stays on rank 0 (announce(everywhere=False)); errors
    still reach every rank alike."""
    got = results(run_mpi(n, [SCENARIO, "reply", str(tmp_path / "ck"), "world"]))
    total = n * (n + 1) // 2
    assert [r["got"] for r in got] == [total] + [None] * (n - 1)
    assert [r["everywhere"] for r in got] == [total] * n
    assert len({tuple(r["error"]) for r in got}) == 1 and "no" in got[0]["error"][1]


@pytest.mark.parametrize("kind", ["self", "world", "split"])
@pytest.mark.parametrize("how", ["enospc", "badvalue", "badstep"])
def test_one_rank_failing_raises_everywhere(tmp_path: Path, kind: str, how: str) -> None:
    proc = run_mpi(3, [SCENARIO, "fail", str(tmp_path / "ck"), kind, how])
    got = results(proc)
    assert len(got) == 3
    assert len({(r["error"], r["message"]) for r in got}) == 1
    if how == "enospc":
        assert "No space left on device" in got[0]["message"]
        assert "rank(s) [2]" in got[0]["message"]
    if how == "badstep":  # every rank sees the steps of all (the save's first round)
        assert got[0]["error"] == "ConfigError", got[0]
        assert "ranks disagree on the step: [2, 3]" in got[0]["message"], got[0]


def test_restore_with_other_rank_count_or_layout_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    run_mpi(2, [SCENARIO, "save", str(root), "self", "1,2"])
    other_n = results(run_mpi(3, [SCENARIO, "restore", str(root), "self", "2"]))
    assert {r.get("error") for r in other_n} == {"LayoutMismatchError"}
    assert "self (2 ranks, 2 files)" in other_n[0]["message"]
    assert "self (3 ranks, 3 files)" in other_n[0]["message"]
    other_kind = results(run_mpi(2, [SCENARIO, "restore", str(root), "world", "2"]))
    assert {r.get("error") for r in other_kind} == {"LayoutMismatchError"}
    assert "world (2 ranks, 1 files)" in other_kind[0]["message"]
    same = results(run_mpi(2, [SCENARIO, "restore", str(root), "self", "2"]))
    assert [r.get("step") for r in same] == [2, 2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [pytest.param(3, marks=EACH_MPI), 4])
def test_async_round_trip_is_bit_identical(tmp_path: Path, n: int, kind: str) -> None:
    proc = run_mpi(n, [SCENARIO, "roundtrip", str(tmp_path / "ck"), kind], SCENARIO_ASYNC="1")
    assert [r["ok"] for r in results(proc)] == [True] * n


@pytest.mark.parametrize("kind", ["self", "split"])
@pytest.mark.parametrize("where", ["write@1", "write@all", "manifest@0"])
def test_kill_during_async_write_leaves_the_previous_checkpoint(
    tmp_path: Path, kind: str, where: str
) -> None:
    """SIGKILL of one rank or of all while the background write (or its commit) runs."""
    root = tmp_path / "ck"
    killed = run_mpi(4, [SCENARIO, "kill", str(root), kind, where], check=False, SCENARIO_ASYNC="1")
    assert killed.returncode != 0, killed.stdout
    assert "survived" not in killed.stdout
    proc = run_mpi(4, [SCENARIO, "restore", str(root), kind, "1"])
    assert [r.get("step") for r in results(proc)] == [1] * 4
    assert not [p for p in root.iterdir() if p.name.startswith(".step_")], "tmp dir not cleaned"


@pytest.mark.parametrize("kind", ["self", "world", "split"])
def test_background_write_error_on_one_rank_raises_everywhere(tmp_path: Path, kind: str) -> None:
    proc = run_mpi(3, [SCENARIO, "fail", str(tmp_path / "ck"), kind, "enospc"], SCENARIO_ASYNC="1")
    got = results(proc)
    assert len(got) == 3
    assert len({(r["error"], r["message"]) for r in got}) == 1
    assert got[0]["error"] == "CollectiveError"
    assert "No space left on device" in got[0]["message"]
    assert "rank(s) [2]" in got[0]["message"]


# --------------------------------------------------------------------------- sharded manifests
# SCENARIO_SHARD_RANKS=1: every file group its own shard (self: a shard per rank; split: per
# pair of ranks), so that 3-4 ranks write and read what 16,384 would (bench/bench_scale.py)


@pytest.mark.parametrize("kind", ["self", "split"])
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_sharded_manifest_round_trip_is_bit_identical(tmp_path: Path, kind: str, mode: str) -> None:
    """Saves with static data and rotation, then restores: each rank receives and reads only
    its own shard (check_part), and every array comes back bit-identical."""
    proc = run_mpi(
        4, [SCENARIO, "roundtrip", str(tmp_path / "ck"), kind], SCENARIO_SHARD_RANKS="1",
        SCENARIO_ASYNC="1" if mode == "async" else "0",
    )  # fmt: skip
    assert [r["ok"] for r in results(proc)] == [True] * 4


@pytest.mark.parametrize("kind", ["self", "split"])
def test_sharded_manifest_restart_saves_again(tmp_path: Path, kind: str) -> None:
    """A restart reuses the restored skeletons, read from the leaders' shards."""
    proc = run_mpi(4, [SCENARIO, "resave", str(tmp_path / "ck"), kind], SCENARIO_SHARD_RANKS="1")
    assert [r["step"] for r in results(proc)] == [5] * 4


@pytest.mark.parametrize("where", ["write@1", "manifest@0", "rename@0"])
def test_kill_during_a_sharded_save_restores_last_committed(tmp_path: Path, where: str) -> None:
    root = tmp_path / "ck"
    killed = run_mpi(4, [SCENARIO, "kill", str(root), "self", where], check=False,
                     SCENARIO_SHARD_RANKS="1")  # fmt: skip
    assert killed.returncode != 0 and "survived" not in killed.stdout, killed.stdout
    proc = run_mpi(4, [SCENARIO, "restore", str(root), "self", "1"], SCENARIO_SHARD_RANKS="1")
    assert [r.get("step") for r in results(proc)] == [1] * 4


@pytest.mark.parametrize("how", ["enospc", "badvalue"])
def test_one_rank_failing_a_sharded_save_raises_everywhere(tmp_path: Path, how: str) -> None:
    """An error in one shard's round is every rank's error, in every shard."""
    proc = run_mpi(3, [SCENARIO, "fail", str(tmp_path / "ck"), "self", how],
                   SCENARIO_SHARD_RANKS="1")  # fmt: skip
    got = results(proc)
    assert len(got) == 3 and len({(r["error"], r["message"]) for r in got}) == 1


def test_shards_of_several_ranks_hand_out_each_rank_its_part_through_the_leaders(
    tmp_path: Path,
) -> None:
    """Shards of two ranks: each shard's leader reads its shard once and hands each of its
    ranks its part with its entries (check_part), and every array comes back bit-identical."""
    proc = run_mpi(4, [SCENARIO, "roundtrip", str(tmp_path / "ck"), "self"],
                   SCENARIO_SHARD_RANKS="2")  # fmt: skip
    assert [r["ok"] for r in results(proc)] == [True] * 4


def test_a_changed_shard_of_several_ranks_fails_each_of_them_and_restore_falls_back(
    tmp_path: Path,
) -> None:
    """The leader that cannot read its shard tells each of its ranks why: each one's read
    fails with it, the candidate is quarantined and the restore falls back."""
    args = [SCENARIO, "shards", str(tmp_path / "ck"), "self", "changed"]
    got = results(run_mpi(4, args, SCENARIO_SHARD_RANKS="2"))
    assert [r["step"] for r in got] == [1] * 4
    why = "manifest shard manifest-00001.json does not match its checksum in the index"
    assert f"rank 2: {why}; rank 3: {why}" in got[0]["quarantined"], got[0]


@pytest.mark.parametrize(
    ("how", "quick", "full"),
    [
        ("missing", "manifest-00001.json is missing", "manifest-00001.json is missing"),
        ("changed", "valid", "manifest-00001.json does not match its checksum in the index"),
        ("extra", "manifest-00007.json is not in the index", "is not in the index"),
        ("index", "does not match its checksum in COMMITTED", "in COMMITTED"),
        # a data file cut short: the coordinator of a sharded restore does not look at the
        # data files, its shard's leader does (and tells its rank)
        ("data", "data file rank_00001.h5 has 10 bytes, manifest says", "has 10 bytes"),
        # static data in two copies: one cut short costs nothing (read from the other and
        # repaired); both: no step is restored and none is quarantined
        ("static", "valid", "valid"),
        ("static-both", "cannot be read", "data file rank_00001.h5 has 10 bytes"),
    ],
)
def test_a_missing_changed_or_extra_shard_is_rejected_and_restore_falls_back(
    tmp_path: Path, how: str, quick: str, full: str
) -> None:
    got = results(
        run_mpi(
            3, [SCENARIO, "shards", str(tmp_path / "ck"), "self", how], SCENARIO_SHARD_RANKS="1"
        )
    )
    if how == "static-both":  # (both steps share their static data)
        said = [r["error"] for r in got]  # the same error on every rank, with the fix
        assert len(set(said)) == 1 and "static data" in said[0] and "backup" in said[0], got
    else:
        assert [r["step"] for r in got] == [2 if how == "static" else 1] * 3
    assert quick in got[0]["quick"] and full in got[0]["full"]
    expect = {"changed": "rank 1: manifest shard " + full, "data": "rank 1: " + quick,
              "static": "(none)", "static-both": "(none)"}.get(how, full)  # fmt: skip
    assert expect in got[0]["quarantined"], got[0]
