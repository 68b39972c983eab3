"""Several nodes on this machine: MPICH's ``-hosts nodeA:2,nodeB:2 -launcher fork`` starts one
MPI node per host name (``Split_type(COMM_TYPE_SHARED)`` and ``$PMI_HOSTNAME`` follow them), so
the node-local tier's multi-node logic runs with real ranks in seconds, without Slurm.

Each node's local storage is ``BASE/$PMI_HOSTNAME``, given unexpanded: each node's ranks
expand it, as ``/scratch/$SLURMD_NODENAME`` or ``$SLURM_TMPDIR`` on a cluster.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.validate import load_manifest
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
