"""Several nodes on this machine: MPICH's ``-hosts nodeA:2,nodeB:2 -launcher fork`` starts one
MPI node per host name (``Split_type(COMM_TYPE_SHARED)`` and ``$PMI_HOSTNAME`` follow them), so
the node-local tier's multi-node logic runs with real ranks in seconds, without Slurm.

Each node's local storage is ``BASE/$PMI_HOSTNAME``, given unexpanded: each node's ranks
expand it, as ``/scratch/$SLURMD_NODENAME`` or ``$SLURM_TMPDIR`` on a cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.io.checkpoints import validate_checkpoint
from resilient.io.manifests import load_manifest
from tests.mpirun import REPO, clean_env, mpiexec, results

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

NODES = REPO / "tests" / "mpi" / "nodes.py"
HOSTS = "nodeA:2,nodeB:2"


def on_nodes(args: list[str], *, hosts: str = HOSTS, check: bool = True) -> list[dict[str, object]]:
    """``tests/mpi/nodes.py ARGS`` on the ranks of ``hosts``; the RESULT of every rank."""
    n = sum(int(h.split(":")[1]) for h in hosts.split(","))
    cmd = [mpiexec(), "-n", str(n), "-hosts", hosts, "-launcher", "fork", sys.executable,
           str(NODES), *args]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240
    )
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    got = results(proc)
    assert len(got) == n, proc.stdout + proc.stderr
    return got


def test_each_node_writes_and_commits_its_own_local_copy(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    got = on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3"])
    roots = {str(r["node"]): Path(str(r["local_root"])) for r in got}
    assert sorted(roots) == ["nodeA", "nodeB"]
    for node, local in roots.items():
        assert local.parent == base / node, local
        steps = sorted(p.name for p in local.glob("step_*"))
        assert steps == ["step_00000002", "step_00000003"], (node, steps)  # local_keep=2
        files = sorted(p.name for p in (local / "step_00000003").glob("*.h5"))
        assert files == ["node_00000.h5" if node == "nodeA" else "node_00001.h5"], (node, files)
    same = {(local / "step_00000003" / "manifest.json").read_bytes() for local in roots.values()}
    assert len(same) == 1  # one manifest, committed on every node
    assert load_manifest(roots["nodeA"] / "step_00000003").step == 3
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]  # flush_every=2


def test_restore_uses_every_nodes_local_copy_and_a_lost_node_falls_back(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3"])
    assert [r["step"] for r in on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME"])] == [3] * 4

    # nodeB's storage is gone (a replaced node): no step is on every node; the shared root's
    # newest one (the restore above flushed step 3 there) is used
    shutil.rmtree(base / "nodeB")
    assert [r["step"] for r in on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME"])] == [3] * 4


def test_a_node_that_lost_its_copies_resumes_from_the_shared_root(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3"])
    shutil.rmtree(base / "nodeA")  # before any restore: only step 2 reached the shared root
    assert [r["step"] for r in on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME"])] == [2] * 4


def test_a_local_dir_that_differs_within_a_node_is_refused_on_every_rank(tmp_path: Path) -> None:
    got = on_nodes(["refused", str(tmp_path / "s"), f"{tmp_path}/$PMI_RANK", "node"])
    assert {(r["error"], r["message"]) for r in got} == {(got[0]["error"], got[0]["message"])}
    assert "one directory per node" in str(got[0]["message"])


def test_a_file_spanning_nodes_is_refused_on_every_rank(tmp_path: Path) -> None:
    got = on_nodes(["refused", str(tmp_path / "s"), f"{tmp_path}/$PMI_HOSTNAME", "world"])
    assert len({r["message"] for r in got}) == 1
    assert "every checkpoint file on one node" in str(got[0]["message"])
    assert "nodeA" in str(got[0]["message"]) and "nodeB" in str(got[0]["message"])


# ---------------------------------------------------------------------- partner copies

RING = "nodeA:1,nodeB:2,nodeC:1"  # three nodes, one of them with two ranks: an odd ring


def _partner_save(tmp_path: Path, hosts: str, comm: str = "self") -> tuple[Path, Path]:
    root, base = tmp_path / "shared", tmp_path / "local"
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3", "partner", comm], hosts=hosts)
    return root, base


def _partner_restore(root: Path, base: Path, hosts: str, comm: str = "self") -> list[int]:
    got = on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME", "partner", comm], hosts=hosts)
    return [int(str(r["step"])) for r in got]


def _local(base: Path, node: str) -> Path:
    (found,) = (base / node).glob("shared-*")
    return found


def test_partner_copies_sit_on_the_next_node_and_are_recorded(tmp_path: Path) -> None:
    root, base = _partner_save(tmp_path, RING)
    # the ring in the order of the nodes' first ranks: A -> B -> C -> A
    for holder, origin in [("nodeB", "nodeA"), ("nodeC", "nodeB"), ("nodeA", "nodeC")]:
        copies = _local(base, holder) / "partner"
        assert sorted(p.name for p in copies.iterdir()) == [origin]
        steps = sorted(p.name for p in (copies / origin).glob("step_*"))
        assert steps == ["step_00000002", "step_00000003"]  # rotated like the originals
        copy, own = copies / origin / "step_00000003", _local(base, origin) / "step_00000003"
        assert load_manifest(copy).step == 3
        names = sorted(p.name for p in own.glob("*.h5"))
        assert names and names == sorted(p.name for p in copy.glob("*.h5"))
        for name in names:
            assert (copy / name).read_bytes() == (own / name).read_bytes()
    logged = [json.loads(line)["step"] for line in (root / "protected.jsonl").open()]
    assert logged == [1, 2, 3]
    listing = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "ls", str(root)], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert "local" in listing and "valid, protected" in listing, listing


def test_a_lost_node_is_rebuilt_from_its_partner_copy(tmp_path: Path) -> None:
    root, base = _partner_save(tmp_path, RING)
    shutil.rmtree(base / "nodeB")  # its newest steps (3) never reached the shared root
    assert _partner_restore(root, base, RING) == [3] * 4
    rebuilt = _local(base, "nodeB") / "step_00000003"
    assert sorted(p.name for p in rebuilt.glob("*.h5")) == ["rank_00001.h5", "rank_00002.h5"]
    # and protected again: nodeB holds nodeA's copy once more (lost with its disk)
    again = _local(base, "nodeB") / "partner" / "nodeA" / "step_00000003"
    assert load_manifest(again).step == 3


def test_a_replaced_node_and_other_placements_are_rebuilt(tmp_path: Path) -> None:
    root, base = _partner_save(tmp_path, RING)
    saved = tmp_path / "saved"
    shutil.copytree(tmp_path / "local", saved / "local")
    shutil.copytree(root, saved / "shared")
    shutil.rmtree(base / "nodeB")  # nodeB is gone; the requeued job got nodeD instead
    assert _partner_restore(root, base, "nodeA:1,nodeD:2,nodeC:1") == [3] * 4
    assert (_local(base, "nodeD") / "step_00000003" / "rank_00001.h5").is_file()

    for name in ("local", "shared"):  # back to the state of the save; then two nodes only
        shutil.rmtree(tmp_path / name)
        shutil.copytree(saved / name, tmp_path / name)
    assert _partner_restore(root, base, "nodeA:2,nodeC:2") == [3] * 4


def test_two_adjacent_nodes_lost_fall_back_to_the_shared_root(tmp_path: Path) -> None:
    root, base = _partner_save(tmp_path, RING)
    shutil.rmtree(base / "nodeB")
    shutil.rmtree(base / "nodeC")  # nodeB's only copy was on nodeC
    hosts = RING
    n = 4
    proc = subprocess.run(
        [mpiexec(), "-n", str(n), "-hosts", hosts, "-launcher", "fork", sys.executable,
         str(NODES), "restore", str(root), f"{base}/$PMI_HOSTNAME", "partner", "self"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["step"] for r in results(proc)] == [2] * 4  # step 2: flushed to the shared root
    why = [line for line in proc.stderr.splitlines() if "cannot be rebuilt" in line]
    assert len(why) == 1, proc.stderr
    assert "rank_00001.h5, rank_00002.h5 of node nodeB" in why[0] and "shared root" in why[0]


def test_a_corrupt_partner_copy_is_quarantined_and_an_older_step_used(tmp_path: Path) -> None:
    root, base = _partner_save(tmp_path, RING)
    shutil.rmtree(base / "nodeB")
    copy = _local(base, "nodeC") / "partner" / "nodeB" / "step_00000003" / "rank_00001.h5"
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert _partner_restore(root, base, RING) == [2] * 4
    held = sorted(p.name for p in copy.parent.parent.iterdir())
    assert held[0] == "step_00000002" and held[1].startswith("step_00000003.quarantined-"), held


def test_a_full_partner_disk_leaves_checkpoints_valid_but_unprotected(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    proc_args = ["partner_full", str(root), f"{base}/$PMI_HOSTNAME", "3"]
    n = 4
    proc = subprocess.run(
        [mpiexec(), "-n", str(n), "-hosts", HOSTS, "-launcher", "fork", sys.executable,
         str(NODES), *proc_args],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "not protected" in line]
    assert len(said) == 1 and "No space left on device" in said[0], proc.stderr  # once per run
    assert not (root / "protected.jsonl").exists()
    for node in ("nodeA", "nodeB"):  # every save committed on every node
        steps = sorted(p.name for p in _local(base, node).glob("step_*"))
        assert steps == ["step_00000002", "step_00000003"]
    leftovers = list((_local(base, "nodeB") / "partner").rglob(".step_*"))
    assert leftovers == [] and not list((_local(base, "nodeB") / "partner").rglob("step_*"))
    assert _partner_restore(root, base, HOSTS, "node") == [3] * 4  # still restorable


@pytest.mark.parametrize(
    ("redundancy", "hosts"), [("partner", HOSTS), ("xor", "nodeA:1,nodeB:2,nodeC:1,nodeD:1")]
)
def test_a_node_that_cannot_read_its_index_leaves_no_node_waiting(
    tmp_path: Path, redundancy: str, hosts: str
) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    n = sum(int(h.split(":")[1]) for h in hosts.split(","))
    proc = subprocess.run(
        [mpiexec(), "-n", str(n), "-hosts", hosts, "-launcher", "fork", sys.executable,
         str(NODES), "unreadable_index", str(root), f"{base}/$PMI_HOSTNAME", "3", redundancy],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "not protected" in line]
    assert len(said) == 1, proc.stderr  # the reason of the first node to say one
    assert "an unreadable manifest (test)" in said[0] or "sent no manifest" in said[0], said
    assert not (root / "protected.jsonl").exists()
    copies = "partner/nodeB" if redundancy == "partner" else "xor"
    for node in ("nodeA", "nodeB"):
        steps = sorted(p.name for p in _local(base, node).glob("step_*"))
        assert steps == ["step_00000002", "step_00000003"]
    assert not list(_local(base, "nodeA").glob(f"{copies}/step_*"))  # nothing committed


def test_partner_on_one_node_says_so_once(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    proc = subprocess.run(
        [mpiexec(), "-n", "2", "-hosts", "nodeA:2", "-launcher", "fork", sys.executable,
         str(NODES), "save", str(root), f"{base}/$PMI_HOSTNAME", "2", "partner", "self"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "no other node" in line]
    assert len(said) == 1, proc.stderr
    assert not (_local(base, "nodeA") / "partner").exists()


# ---------------------------------------------------------------------- a sharded local tier


def test_a_sharded_local_tier_saves_flushes_restores_and_rebuilds(tmp_path: Path) -> None:
    # 4 ranks in 3 shards of at most 2 ranks, none spanning two nodes: nodeA's rank 0,
    # nodeB's ranks 1 and 2, nodeC's rank 3; every restore checks every rank's state bit-exact
    root, base = tmp_path / "shared", tmp_path / "local"
    how = ["partner", "self", "2"]
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3", *how], hosts=RING)
    shards = {"nodeA": "manifest-00000.json", "nodeB": "manifest-00001.json",
              "nodeC": "manifest-00002.json"}  # fmt: skip
    for node, shard in shards.items():
        own = _local(base, node) / "step_00000003"
        assert sorted(p.name for p in own.glob("manifest-*.json")) == [shard], node
        assert load_manifest(own).sharded is not None  # the index, the same on every node
        validate_checkpoint(own, node_local=True, static_root=root)
    same = {(_local(base, n) / "step_00000003" / "manifest.json").read_bytes() for n in shards}
    assert len(same) == 1
    # a partner copy holds its origin's shard beside its files
    copy = _local(base, "nodeC") / "partner" / "nodeB" / "step_00000003"
    assert sorted(p.name for p in copy.glob("manifest-*.json")) == [shards["nodeB"]]
    # the flush of step 2 moved every node's shard to the shared root
    flushed = root / "step_00000002"
    assert sorted(p.name for p in flushed.glob("manifest-*.json")) == sorted(shards.values())
    validate_checkpoint(flushed, full=True)

    def restore(hosts: str = RING) -> list[int]:
        got = on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME", *how], hosts=hosts)
        return [int(str(r["step"])) for r in got]

    assert restore() == [3] * 4  # from the local tier (then flushed at close)
    validate_checkpoint(root / "step_00000003", full=True)
    shutil.rmtree(base / "nodeB")  # rebuilt from nodeC's partner copy, its shard with it
    assert restore() == [3] * 4
    rebuilt = _local(base, "nodeB") / "step_00000003"
    assert sorted(p.name for p in rebuilt.glob("manifest-*.json")) == [shards["nodeB"]]
    shutil.rmtree(base)  # every node's storage gone: the shared root's copy of step 3
    assert restore() == [3] * 4


def test_a_corrupt_local_shard_sends_the_restore_to_the_shared_root(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    how = ["none", "self", "1"]  # a shard per rank: nodeB holds manifest-00002 and -00003
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3", *how])
    shard = _local(base, "nodeB") / "step_00000003" / "manifest-00003.json"
    text = bytearray(shard.read_bytes())
    text[len(text) // 2] ^= 0x01  # same size: only the reading rank's checksum sees it
    shard.write_bytes(bytes(text))
    got = on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME", *how])
    assert [r["step"] for r in got] == [2] * 4  # step 3 never reached the shared root
    held = sorted(p.name for p in _local(base, "nodeB").glob("step_*"))
    assert held[0] == "step_00000002" and held[1].startswith("step_00000003.quarantined-"), held


# ---------------------------------------------------------------------- an elastic restart


def _elastic(root: Path, base: Path, hosts: str, *args: str) -> tuple[list[dict[str, object]], str]:
    """``tests/mpi/nodes.py elastic_* ROOT BASE/$PMI_HOSTNAME ARGS`` on ``hosts``: every rank's
    RESULT and the log (stderr)."""
    n = sum(int(h.split(":")[1]) for h in hosts.split(","))
    proc = subprocess.run(
        [mpiexec(), "-n", str(n), "-hosts", hosts, "-launcher", "fork", sys.executable,
         str(NODES), args[0], str(root), f"{base}/$PMI_HOSTNAME", *args[1:]],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    got = results(proc)
    assert len(got) == n, proc.stdout + proc.stderr
    return got, proc.stderr


def _staged_line(log: str) -> str:
    (line,) = [x for x in log.splitlines() if "for an elastic restore on node(s)" in x]
    return line


def test_a_restart_on_3_ranks_and_a_new_node_stages_partner_copies_over_the_wire(
    tmp_path: Path,
) -> None:
    """4 ranks on nodeA and nodeB with partner copies, never flushed, nodeB's disk lost; the
    restart runs 3 ranks on nodeA and nodeC: nodeA stages its own files and its copy of
    nodeB's, nodeC receives the files its rank reads from nodeA; the newest step, exact."""
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, HOSTS, "elastic_save", "3", "partner")
    assert not list(root.glob("step_*"))  # nothing reached the shared root
    shutil.rmtree(base / "nodeB")
    got, log = _elastic(root, base, "nodeA:2,nodeC:1", "elastic_restore", "partner")
    assert [r["step"] for r in got] == [3] * 3 and not any(r["staged_left"] for r in got)
    line = _staged_line(log)
    # nodeC's new rows (136..202) lie in saved ranks 2 and 3: nodeB's files, from nodeA's copy
    assert "staged local step 3 for an elastic restore on node(s) nodeA, nodeC" in line, log
    assert "(2 files, " in line and "bytes over the wire" in line, line
    # the next save (4, on 3 ranks) reached the shared root at close; nothing staged is left
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"]
    assert load_manifest(root / "step_00000004").layout.nranks == 3
    for node in ("nodeA", "nodeC"):
        assert not (_local(base, node) / "elastic").exists()


@pytest.mark.parametrize(
    "hosts", ["nodeA:2,nodeC:1", "nodeC:1,nodeA:2"], ids=["coordinator-on-nodeA", "on-nodeC"]
)
def test_a_restart_from_a_sharded_local_tier_gets_every_shard_from_the_nodes_holding_it(
    tmp_path: Path, hosts: str
) -> None:
    """The same restart with the manifests sharded by node (shards of 2 ranks: nodeA's
    manifest-00000, nodeB's manifest-00001): nodeB's shard survives only in nodeA's partner
    copy. The coordinator plans from every shard, also where it runs on the new node, which
    holds none (sent by nodeA); each node stages the shards of the files it reads."""
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, HOSTS, "elastic_save", "3", "partner", "2")
    step3 = _local(base, "nodeA") / "step_00000003"
    assert sorted(p.name for p in step3.glob("manifest-*.json")) == ["manifest-00000.json"]
    assert load_manifest(step3).sharded is not None
    shutil.rmtree(base / "nodeB")
    got, log = _elastic(root, base, hosts, "elastic_restore", "partner", "2")
    assert [r["step"] for r in got] == [3] * 3 and not any(r["staged_left"] for r in got), log
    line = _staged_line(log)
    assert "staged local step 3 for an elastic restore on node(s) " in line, log
    # nodeC's rows (136..202) lie in nodeB's files, rank_00002 and rank_00003, with their shard
    assert "(3 files, " in line, line
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"]
    assert load_manifest(root / "step_00000004").layout.nranks == 3


def test_a_corrupt_partner_shard_in_an_elastic_restart_falls_back_to_an_older_step(
    tmp_path: Path,
) -> None:
    """nodeB's shard of step 3 survives only in nodeA's partner copy, corrupt (its size kept):
    nodeA says it cannot send it, step 3 cannot be planned, step 2 is staged."""
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, HOSTS, "elastic_save", "3", "partner", "2")
    shutil.rmtree(base / "nodeB")
    shard = _local(base, "nodeA") / "partner" / "nodeB" / "step_00000003" / "manifest-00001.json"
    text = bytearray(shard.read_bytes())
    text[len(text) // 2] ^= 0x01
    shard.write_bytes(bytes(text))
    got, log = _elastic(root, base, "nodeC:1,nodeA:2", "elastic_restore", "partner", "2")
    assert [r["step"] for r in got] == [2] * 3, log
    assert "manifest shard manifest-00001.json of local step 3 cannot be sent" in log, log
    assert "does not match its checksum" in log, log
    assert "no node of this job holds a readable copy of its manifest shards " in log, log
    assert "staged local step 2 for an elastic restore on node(s) nodeC, nodeA" in log, log


def test_a_restart_on_fewer_ranks_of_the_same_node_uses_its_local_steps(tmp_path: Path) -> None:
    """The issue's finding: 4 ranks on one node, never flushed, restarted on 3 ranks: the
    newest local step (no partner, nothing over the wire), not the (empty) shared root."""
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, "nodeA:4", "elastic_save", "3", "none")
    got, log = _elastic(root, base, "nodeA:3", "elastic_restore", "none")
    assert [r["step"] for r in got] == [3] * 3
    assert "staged local step 3 for an elastic restore on node(s) nodeA" in log, log
    assert "(0 files, 0 bytes over the wire)" in _staged_line(log)


def test_a_corrupt_partner_copy_in_an_elastic_restart_falls_back_to_an_older_step(
    tmp_path: Path,
) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, HOSTS, "elastic_save", "3", "partner")
    shutil.rmtree(base / "nodeB")
    copy = _local(base, "nodeA") / "partner" / "nodeB" / "step_00000003" / "rank_00003.h5"
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    got, log = _elastic(root, base, "nodeA:2,nodeC:1", "elastic_restore", "partner")
    assert [r["step"] for r in got] == [2] * 3, log
    assert f"partner copy {copy.parent} is corrupt, quarantined" in log, log
    assert "could not stage local step 3" in log, log
    assert "staged local step 2 for an elastic restore on node(s) nodeA, nodeC" in log, log


def test_without_partner_copies_the_nodes_send_each_other_their_own_files(
    tmp_path: Path,
) -> None:
    """No redundancy, the same two nodes, 3 ranks instead of 4: nodeA's new rows reach into
    saved rank 2's block, a file of nodeB's own copy, sent over a channel opened for it."""
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, HOSTS, "elastic_save", "3", "none")
    got, log = _elastic(root, base, "nodeA:2,nodeB:1", "elastic_restore", "none")
    assert [r["step"] for r in got] == [3] * 3
    line = _staged_line(log)
    assert "staged local step 3 for an elastic restore on node(s) nodeA, nodeB" in line, log
    assert "(1 files, " in line, line  # rank_00002.h5, from nodeB to nodeA


# ---------------------------------------------------------------------- XOR parity


def test_xor_parity_rebuilds_each_wiped_node_bit_for_bit_at_every_set_size(tmp_path: Path) -> None:
    """Issue 50: one launch on 8 nodes (nodeA with 2 ranks: uneven data) runs on its first 3,
    4, ... 8 nodes (one set each), then on all 8 in sets of 4: steps 1..3 saved to the local
    tier only, then each node's tier wiped in turn (one per set at a time) and restored: every
    wiped node's files of step 3 come back bit for bit from its set's parity. Two nodes of one
    set lost are named, and the restore takes the shared root."""
    hosts = "nodeA:2," + ",".join(f"node{c}:1" for c in "BCDEFGH")
    runs = ["3/xor", "4/xor/nodeA+nodeB", "5/xor", "6/xor", "7/xor", "8/xor",
            "8/xor:4/nodeA+nodeE/nodeA+nodeB"]  # fmt: skip
    one_at_a_time = {i: [[f"node{c}"] for c in "ABCDEFGH"[: 3 + i]] for i in range(6)}
    expected = {**one_at_a_time, 6: [["nodeA", "nodeE"], ["nodeB", "nodeF"], ["nodeC", "nodeG"],
                                     ["nodeD", "nodeH"], ["nodeA", "nodeE"]]}  # fmt: skip
    expected[1] = expected[1] + [["nodeA", "nodeB"]]
    expected[6] = expected[6] + [["nodeA", "nodeB"]]
    lost_together = {(1, 4), (6, 5)}  # two nodes of one set: not rebuilt
    root, base = tmp_path / "shared", tmp_path / "local"
    got = on_nodes(["xor_sizes", str(root), f"{base}/$PMI_HOSTNAME", *runs], hosts=hosts)
    for i, run in enumerate(runs):
        nodes = int(run.split("/")[0])
        inside = [r for r in got if "ABCDEFGH".index(str(r["node"])[-1]) < nodes]
        mine = [r["runs"][i] for r in inside]  # type: ignore[index]
        said = json.loads((root / f"run{i}" / "said.json").read_text())
        assert [wiped for wiped, _ in said] == expected[i], run
        for k, (wiped, lines) in enumerate(said):
            assert {m["steps"][k] for m in mine} == {3}, (run, wiped)
            same = {
                str(r["node"]): m["same"][k] for r, m in zip(inside, mine, strict=True) if m["acts"]
            }
            assert len(same) == nodes
            if (i, k) in lost_together:
                assert lines == [
                    f"local checkpoint step 3 cannot be rebuilt: nodes {', '.join(wiped)} of one "
                    "XOR set were all lost (a set survives the loss of one node); using the "
                    "shared root"
                ], (run, lines)
                assert not any(same[w] for w in wiped)
            else:
                assert lines == [
                    f"rebuilt local step 3 on node(s) {', '.join(wiped)} from XOR parity"
                ], (run, wiped, lines)
                assert all(same.values()), (run, wiped, same)


XOR_NODES = "nodeA:1,nodeB:2,nodeC:1,nodeD:1"  # one set of four nodes, one with two ranks


def test_a_corrupt_xor_parity_is_quarantined_and_an_older_step_used(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3", "xor", "self"], hosts=XOR_NODES)
    parity = _local(base, "nodeC") / "xor" / "step_00000003" / "parity.xor"
    assert parity.stat().st_size % 4096 == 0
    data = bytearray(parity.read_bytes())
    data[7] ^= 0xFF
    parity.write_bytes(bytes(data))
    shutil.rmtree(base / "nodeB")  # its step 3 must come from the parity: nodeC's is corrupt
    n = 5
    proc = subprocess.run(
        [mpiexec(), "-n", str(n), "-hosts", XOR_NODES, "-launcher", "fork", sys.executable,
         str(NODES), "restore", str(root), f"{base}/$PMI_HOSTNAME", "xor", "self"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # step 3 cannot be rebuilt; step 2 (also flushed to the shared root) is, from the parity
    assert [r["step"] for r in results(proc)] == [2] * n
    quarantined = [line for line in proc.stderr.splitlines() if "is corrupt, quarantined" in line]
    assert len(quarantined) == 1 and "nodeC" in quarantined[0], proc.stderr
    assert "could not rebuild local step 3" in proc.stderr
    assert "rebuilt local step 2 on node(s) nodeB from XOR parity" in proc.stderr
    held = sorted(p.name for p in parity.parent.parent.iterdir())
    assert held[0] == "step_00000002" and held[1].startswith("step_00000003.quarantined-"), held


def test_a_replaced_node_is_rebuilt_from_xor_parity(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    on_nodes(["save", str(root), f"{base}/$PMI_HOSTNAME", "3", "xor", "self"], hosts=XOR_NODES)
    shutil.rmtree(base / "nodeB")  # nodeB is gone; the requeued job got nodeE in its place
    hosts = XOR_NODES.replace("nodeB", "nodeE")
    proc = subprocess.run(
        [mpiexec(), "-n", "5", "-hosts", hosts, "-launcher", "fork", sys.executable,
         str(NODES), "restore", str(root), f"{base}/$PMI_HOSTNAME", "xor", "self"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["step"] for r in results(proc)] == [3] * 5
    assert "rebuilt local step 3 on node(s) nodeE from XOR parity" in proc.stderr, proc.stderr
    rebuilt = _local(base, "nodeE") / "step_00000003"
    assert sorted(p.name for p in rebuilt.glob("*.h5")) == ["rank_00001.h5", "rank_00002.h5"]


def test_a_full_disk_leaves_xor_checkpoints_valid_but_unprotected(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    args = ["full_disk", str(root), f"{base}/$PMI_HOSTNAME", "3", "xor", "self"]
    proc = subprocess.run(
        [mpiexec(), "-n", "5", "-hosts", XOR_NODES, "-launcher", "fork", sys.executable,
         str(NODES), *args],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "not protected" in line]
    assert len(said) == 1 and "No space left on device" in said[0], proc.stderr
    assert not (root / "protected.jsonl").exists()
    for node in ("nodeA", "nodeB", "nodeC", "nodeD"):  # no parity anywhere: one member failed
        steps = sorted(p.name for p in _local(base, node).glob("step_*"))
        assert steps == ["step_00000002", "step_00000003"]
        assert not list((_local(base, node) / "xor").glob("*step_*")), node
    got = on_nodes(["restore", str(root), f"{base}/$PMI_HOSTNAME", "xor", "self"], hosts=XOR_NODES)
    assert [r["step"] for r in got] == [3] * 5


def test_xor_on_two_nodes_keeps_partner_copies_and_says_so(tmp_path: Path) -> None:
    root, base = tmp_path / "shared", tmp_path / "local"
    proc = subprocess.run(
        [mpiexec(), "-n", "4", "-hosts", HOSTS, "-launcher", "fork", sys.executable,
         str(NODES), "save", str(root), f"{base}/$PMI_HOSTNAME", "2", "xor", "self"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "redundancy='xor' needs 3 nodes" in line]
    assert len(said) == 1 and "nodeA, nodeB" in said[0] and "partner" in said[0], proc.stderr
    assert (_local(base, "nodeB") / "partner" / "nodeA" / "step_00000002").is_dir()
    assert not (_local(base, "nodeB") / "xor").exists()


def test_an_elastic_restart_rebuilds_a_lost_node_of_an_xor_set_onto_a_survivor(
    tmp_path: Path,
) -> None:
    """4 ranks on nodeA (2), nodeB and nodeC with XOR parity, never flushed; nodeB's disk lost;
    the restart runs 3 ranks on nodeA and nodeC only (2 nodes: partner copies from now on):
    nodeB's files of step 3 are rebuilt from the set's parity onto a survivor, then staged
    like a partner copy; every rank's new block is the newest step's, exact."""
    root, base = tmp_path / "shared", tmp_path / "local"
    _elastic(root, base, "nodeA:2,nodeB:1,nodeC:1", "elastic_save", "3", "xor")
    shutil.rmtree(base / "nodeB")
    got, log = _elastic(root, base, "nodeA:2,nodeC:1", "elastic_restore", "xor")
    assert [r["step"] for r in got] == [3] * 3 and not any(r["staged_left"] for r in got)
    (rebuilt,) = [x for x in log.splitlines() if "for an elastic restore" in x and "XOR" in x]
    assert "rebuilt node nodeB's files of local step 3 on node node" in rebuilt, log
    assert "staged local step 3 for an elastic restore on node(s) nodeA, nodeC" in _staged_line(log)
