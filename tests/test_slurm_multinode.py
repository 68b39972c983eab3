"""The node-local tier on the multi-node local Slurm (tests/slurm/up.sh: nodes n1..n3 of this
host, partition ``multi``): ranks started by ``srun -N 2 --mpi=pmi2``, node-local storage
``BASE/$SLURMD_NODENAME`` expanded by each node's ranks, as a user writes it.

Skipped where Slurm or its ``multi`` partition (two nodes or more) is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from tests.mpirun import REPO, clean_env, mpiexec, results

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.timeout(600)]

NODES = REPO / "tests" / "mpi" / "nodes.py"


def multi_nodes() -> list[str]:
    """The nodes of partition ``multi`` that take jobs; skip the test with fewer than 2."""
    if not shutil.which("sinfo"):
        pytest.skip("no Slurm here (start one with `bash tests/slurm/up.sh` as root)")
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", "multi", "-o", "%N %T"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    up = sorted(
        {line.split()[0] for line in out.stdout.splitlines()
         if line.split()[-1] in ("idle", "mixed", "allocated")}
    )  # fmt: skip
    if len(up) < 2:
        pytest.skip(f"partition multi has fewer than 2 usable nodes ({out.stdout.strip()!r})")
    return up


def srun(
    nodes: str, n: int, args: list[str], *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``srun -p multi -w NODES -n N --mpi=pmi2 python ARGS`` from the repository root."""
    cmd = ["srun", "-p", "multi", "-w", nodes, "-N", str(nodes.count(",") + 1), "-n", str(n),
           "--mpi=pmi2", "--time=5", sys.executable, *args]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300, check=False
    )
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_node_copies_restore_and_a_new_node_set_uses_the_shared_root(tmp_path: Path) -> None:
    nodes = multi_nodes()
    if len(nodes) < 3:
        pytest.skip("needs 3 nodes in partition multi")
    root, base = tmp_path / "shared", tmp_path / "local"
    local = f"{base}/$SLURMD_NODENAME"
    got = results(srun("n1,n2", 4, [str(NODES), "save", str(root), local, "3"]))
    assert {str(r["node"]) for r in got} == {"n1", "n2"}
    for node in ("n1", "n2"):  # each node committed its own copy, in its own directory
        (own,) = (base / node).iterdir()
        assert sorted(p.name for p in own.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert not (base / "n3").exists()

    # the same nodes: every node has step 3 locally
    assert [
        r["step"] for r in results(srun("n1,n2", 4, [str(NODES), "restore", str(root), local]))
    ] == [3] * 4
    # requeued onto n2 and n3: n3 has nothing, so no step is on every node: the shared root
    # (step 3, flushed by the restore above at its close)
    got = results(srun("n2,n3", 4, [str(NODES), "restore", str(root), local]))
    assert [r["step"] for r in got] == [3] * 4 and {str(r["node"]) for r in got} == {"n2", "n3"}


def test_heat_with_a_per_node_local_dir_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """The command of issue 21 that failed at its first save: ``apps.heat --checkpoint-comm node
    --local-dir 'BASE/$SLURMD_NODENAME'`` on 2 nodes."""
    multi_nodes()
    args = [
        "-m",
        "apps.heat",
        "--nx",
        "64",
        "--ny",
        "48",
        "--steps",
        "60",
        "--checkpoint-every",
        "10",
    ]
    ref = tmp_path / "ref.h5"
    done = subprocess.run(
        [mpiexec(), "-n", "4", sys.executable, *args, "--checkpoint-dir", str(tmp_path / "refck"),
         "--out", str(ref)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out.h5"
    srun("n1,n2", 4, [*args, "--checkpoint-comm", "node", "--local-dir", f"{tmp_path}/local/$SLURMD_NODENAME",
                      "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(out)])  # fmt: skip
    with h5py.File(ref) as a, h5py.File(out) as b:
        assert a["T"][()].tobytes() == b["T"][()].tobytes()
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["n1", "n2"]
