"""The node-local tier on the multi-node local Slurm (tests/slurm/up.sh: nodes n1..n3 of this
host, partition ``multi``): ranks started by ``srun -N 2 --mpi=pmi2``, node-local storage
``BASE/$SLURMD_NODENAME`` expanded by each node's ranks, as a user writes it.

Skipped where Slurm or its ``multi`` partition (two nodes or more) is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest

from tests.mpirun import REPO, clean_env, mpi_family, mpiexec, results

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.timeout(600)]

NODES = REPO / "tests" / "mpi" / "nodes.py"


def multi_nodes() -> list[str]:
    """The nodes of partition ``multi`` that take jobs; skip the test with fewer than 2. A node
    still completing an earlier test's job (its epilog) is waited for, up to 2 minutes."""
    if not shutil.which("sinfo"):
        pytest.skip("no Slurm here (start one with `bash tests/slurm/up.sh` as root)")
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "multi", "-o", "%N %T"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        states = [line.split() for line in out.stdout.splitlines() if len(line.split()) == 2]
        if not any(state.startswith("completing") for _, state in states):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    up = sorted({node for node, state in states if state in ("idle", "mixed", "allocated")})
    if len(up) < 2:
        pytest.skip(f"partition multi has fewer than 2 usable nodes ({out.stdout.strip()!r})")
    return up


def srun(
    nodes: str, n: int, args: list[str], *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``srun -p multi -w NODES -n N --mpi=pmi2 python ARGS`` from the repository root.

    Under Open MPI and Intel MPI (.ci/other-mpi) ``salloc`` with the same options runs their
    ``mpiexec``, which starts a daemon on each node through Slurm and places the ranks as srun
    does (Open MPI: ``--bind-to none``, and TCP between nodes, which .ci/other-mpi's
    ``OMPI_MCA_btl=self,sm`` leaves out). Slurm's ``--mpi=pmix`` does not start Open MPI 5's
    ranks here (docs/howto/site.md)."""
    where = ["-p", "multi", "-w", nodes, "-N", str(nodes.count(",") + 1), "-n", str(n),
             "--time=5"]  # fmt: skip
    if mpi_family() == "Open MPI":
        cmd = ["salloc", "-Q", *where, mpiexec(), "--bind-to", "none", "--mca", "btl",
               "self,sm,tcp", "-n", str(n), sys.executable, *args]  # fmt: skip
    elif mpi_family() == "Intel MPI":  # its hydra starts a proxy per node through Slurm
        cmd = ["salloc", "-Q", *where, mpiexec(), "-n", str(n), sys.executable, *args]
    else:
        cmd = ["srun", *where, "--mpi=pmi2", sys.executable, *args]
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


# ---------------------------------------------------------------------- partner copies


def _local_root(base: Path, node: str) -> Path:
    (found,) = (base / node).iterdir()  # <name of the shared root>-<hash of its path>
    return found


def _reset(tmp_path: Path, saved: Path) -> None:
    for name in ("local", "shared"):
        shutil.rmtree(tmp_path / name, ignore_errors=True)
        shutil.copytree(saved / name, tmp_path / name)


@pytest.mark.each_mpi
def test_partner_copies_rebuild_lost_nodes_on_slurm(tmp_path: Path) -> None:
    """On n1..n3: copies on the right nodes; a wiped node rebuilt; a requeue onto fewer nodes;
    two adjacent nodes lost (the shared root, said once); a corrupt copy (quarantined, the next
    option)."""
    if len(multi_nodes()) < 3:
        pytest.skip("needs 3 nodes in partition multi")
    root, base = tmp_path / "shared", tmp_path / "local"
    local = f"{base}/$SLURMD_NODENAME"
    how = ["partner", "self"]

    def restore(nodes: str) -> subprocess.CompletedProcess[str]:
        return srun(nodes, 4, [str(NODES), "restore", str(root), local, *how])

    srun("n1,n2,n3", 4, [str(NODES), "save", str(root), local, "3", *how])
    ring = {"n2": "n1", "n3": "n2", "n1": "n3"}  # holder: origin (nodes by their first rank)
    for holder, origin in ring.items():
        copy = _local_root(base, holder) / "partner" / origin / "step_00000003"
        own = _local_root(base, origin) / "step_00000003"
        names = sorted(p.name for p in own.glob("*.h5"))
        assert names and names == sorted(p.name for p in copy.glob("*.h5")), (holder, origin)
        assert all((copy / n).read_bytes() == (own / n).read_bytes() for n in names)
    saved = tmp_path / "saved"
    shutil.copytree(base, saved / "local")
    shutil.copytree(root, saved / "shared")

    shutil.rmtree(base / "n2")  # n2's disk is gone: rebuilt from n3's copy, newest step
    proc = restore("n1,n2,n3")
    assert [r["step"] for r in results(proc)] == [3] * 4
    assert "rebuilt local step 3 on node(s) n2" in proc.stderr, proc.stderr

    _reset(tmp_path, saved)  # requeued onto two of the three nodes (ranks placed 2 + 2)
    assert [r["step"] for r in results(restore("n1,n3"))] == [3] * 4

    _reset(tmp_path, saved)  # n2 and n3 lost: n2's files are nowhere; step 2 is in the root
    shutil.rmtree(base / "n2")
    shutil.rmtree(base / "n3")
    proc = restore("n1,n2,n3")
    assert [r["step"] for r in results(proc)] == [2] * 4
    said = [line for line in proc.stderr.splitlines() if "cannot be rebuilt" in line]
    assert len(said) == 1 and "of node n2" in said[0] and "shared root" in said[0], proc.stderr

    _reset(tmp_path, saved)  # n2 lost and its copy on n3 corrupt: quarantined, step 2
    shutil.rmtree(base / "n2")
    (bad,) = (_local_root(base, "n3") / "partner" / "n2" / "step_00000003").glob("*.h5")
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    assert [r["step"] for r in results(restore("n1,n2,n3"))] == [2] * 4
    assert any(p.name.startswith("step_00000003.quarantined-") for p in bad.parent.parent.iterdir())


HEAT = ["-m", "apps.heat", "--nx", "96", "--ny", "64", "--steps", "400", "--checkpoint-every",
        "10", "--checkpoint-comm", "node", "--async-save", "--redundancy", "partner",
        "--flush-every", "1000"]  # fmt: skip


def _reference(tmp_path: Path) -> bytes:
    ref = tmp_path / "ref.h5"
    done = subprocess.run(
        [mpiexec(), "-n", "4", sys.executable, *HEAT[:8], "--checkpoint-dir",
         str(tmp_path / "refck"), "--out", str(ref)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with h5py.File(ref) as f:
        return bytes(f["T"][()].tobytes())


def _heat_job(
    tmp_path: Path, nodes: str | None, ranks: int = 4, *, redundancy: str = "partner"
) -> str:
    """Submit the heat run (4 ranks, 2 per node, slowed down; or ``ranks`` on 2 nodes, the
    first one's 2 ranks and the rest on the second; ``xor``: 4 ranks on 3 nodes, 2 + 1 + 1)
    as a batch job; its id. Not requeued by Slurm when a node fails (the default for batch
    jobs): the test resubmits."""
    where = ["-w", nodes] if nodes else []
    count = 3 if redundancy == "xor" else 2
    per_node = ["--ntasks-per-node=2"] if ranks == 4 and count == 2 else ["-n", str(ranks)]
    heat = [redundancy if a == "partner" else a for a in HEAT]
    args = [*heat, "--step-delay", "0.05", "--local-dir", f"{tmp_path}/local/$SLURMD_NODENAME",
            "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out.h5")]  # fmt: skip
    wrap = " ".join(["srun", "--mpi=pmi2", sys.executable, *(f"'{a}'" for a in args)])
    out = subprocess.run(
        ["sbatch", "--parsable", "--no-requeue", "-p", "multi", *where, "-N", str(count), *per_node,
         "--time=10", "-o", str(tmp_path / "job-%j.log"), "--chdir", str(REPO), "--wrap", wrap],
        env=clean_env(), capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return out.strip().split(";")[0]


def _protected(root: Path) -> int:
    try:
        return len((root / "protected.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _job_state(job: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "?")


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _finish(tmp_path: Path, job: str) -> str:
    _wait(lambda: _job_state(job) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
          f"job {job}", 300)  # fmt: skip
    return (tmp_path / f"job-{job}.log").read_text()


def test_a_killed_job_with_a_wiped_node_resumes_from_the_newest_local_step(
    tmp_path: Path,
) -> None:
    """SIGKILL of the whole job (nothing flushed: flush_every 1000), one node's local directory
    wiped, the same nodes again: the newest protected step is rebuilt, the output is exact."""
    multi_nodes()
    want = _reference(tmp_path)
    job = _heat_job(tmp_path, "n1,n2")
    _wait(lambda: _protected(tmp_path / "ck") >= 3, "three protected checkpoints")
    _kill_where(f"SLURM_JOB_ID={job}")  # scancel would send SIGTERM first: a graceful stop
    _finish(tmp_path, job)
    assert not list((tmp_path / "ck").glob("step_*"))  # nothing reached the shared root
    n1 = _local_root(tmp_path / "local", "n1")  # what n1 has of its own and of n2's
    both = {p.name for p in n1.glob("step_*")} & {p.name for p in n1.glob("partner/n2/step_*")}
    newest = max(int(name[5:]) for name in both)
    shutil.rmtree(tmp_path / "local" / "n2")
    job = _heat_job(tmp_path, "n1,n2")
    log = _finish(tmp_path, job)
    assert _job_state(job) == "COMPLETED", log
    assert f"rebuilt local step {newest} on node(s) n2" in log, log
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["T"][()].tobytes() == want


def test_xor_parity_rebuilds_a_killed_and_wiped_node_and_the_output_is_exact(
    tmp_path: Path,
) -> None:
    """Issue 50: a 4-rank heat job on n1..n3 (2 + 1 + 1 ranks) keeps XOR parity, nothing
    flushed; n2's ranks are SIGKILLed (then the rest of the job), n2's local directory is
    wiped; the next job on the same nodes rebuilds n2's files of the newest protected step
    from n1's and n3's parity, resumes there, and writes the uninterrupted run's output."""
    if len(multi_nodes()) < 3:
        pytest.skip("needs 3 nodes in partition multi")
    want = _reference(tmp_path)
    job = _heat_job(tmp_path, "n1,n2,n3", redundancy="xor")
    _wait(lambda: _protected(tmp_path / "ck") >= 3, "three protected checkpoints")
    _kill_where(f"SLURM_JOB_ID={job}", also="SLURMD_NODENAME=n2")
    time.sleep(1)
    _kill_where(f"SLURM_JOB_ID={job}")
    _finish(tmp_path, job)
    assert not list((tmp_path / "ck").glob("step_*"))  # nothing reached the shared root
    roots = {n: _local_root(tmp_path / "local", n) for n in ("n1", "n2", "n3")}
    parity = [{p.name for p in roots[n].glob("xor/step_*")} for n in ("n1", "n2", "n3")]
    own = [{p.name for p in roots[n].glob("step_*")} for n in ("n1", "n2", "n3")]
    protected = set.intersection(*parity, *own)
    newest = max(int(name[5:]) for name in protected)
    sizes = {n: sum(f.stat().st_size for f in (roots[n] / f"step_{newest:08d}").glob("*.h5"))
             for n in roots}  # fmt: skip
    chunk = (roots["n1"] / "xor" / f"step_{newest:08d}" / "parity.xor").stat().st_size
    assert chunk == -(-max(sizes.values()) // 2 // 4096) * 4096, (chunk, sizes)  # B / (n - 1)
    shutil.rmtree(tmp_path / "local" / "n2")
    job = _heat_job(tmp_path, "n1,n2,n3", redundancy="xor")
    log = _finish(tmp_path, job)
    assert _job_state(job) == "COMPLETED", log
    assert f"rebuilt local step {newest} on node(s) n2 from XOR parity" in log, log
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["T"][()].tobytes() == want


def test_a_killed_job_resumes_on_3_ranks_of_other_nodes_from_local_and_partner_copies(
    tmp_path: Path,
) -> None:
    """Issue 38: a 2-node, 4-rank heat job (node-local tier, partner copies, nothing flushed)
    is killed; n2's local directory is deleted; the restart runs 3 ranks on n1 and n3. n1
    stages its own file and its partner copy of n2's; n3 receives n2's file from n1 over the
    wire (it cannot read n1's directory: each node has its own local root). The newest
    protected local step is resumed, the output is bit-identical to an uninterrupted run."""
    nodes = multi_nodes()
    if "n3" not in nodes:
        subprocess.run(["scontrol", "update", "nodename=n3", "state=resume"], check=False,
                       capture_output=True, timeout=30)  # fmt: skip
        if "n3" not in multi_nodes():
            pytest.skip("needs n3 in partition multi")
    t0 = time.monotonic()
    want = _reference(tmp_path)
    t1 = time.monotonic()
    job = _heat_job(tmp_path, "n1,n2")
    _wait(lambda: _protected(tmp_path / "ck") >= 3, "three protected checkpoints")
    _kill_where(f"SLURM_JOB_ID={job}")  # scancel would send SIGTERM first: a graceful stop
    _finish(tmp_path, job)
    t2 = time.monotonic()
    assert not list((tmp_path / "ck").glob("step_*"))  # nothing reached the shared root
    n1 = _local_root(tmp_path / "local", "n1")  # what n1 has of its own and of n2's
    both = {p.name for p in n1.glob("step_*")} & {p.name for p in n1.glob("partner/n2/step_*")}
    newest = max(int(name[5:]) for name in both)
    shutil.rmtree(tmp_path / "local" / "n2")
    job = _heat_job(tmp_path, "n1,n3", ranks=3)
    log = _finish(tmp_path, job)
    t3 = time.monotonic()
    assert _job_state(job) == "COMPLETED", log
    staged = [line for line in log.splitlines() if "for an elastic restore on node(s)" in line]
    assert len(staged) == 1, log
    assert f"staged local step {newest} for an elastic restore on node(s) n1, n3" in staged[0]
    assert "(1 files, " in staged[0], staged[0]  # n2's file, to n3 (n1 copies its own copy)
    assert f"resumed from step {newest}" in log, log
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["T"][()].tobytes() == want
    assert not (_local_root(tmp_path / "local", "n3") / "elastic").exists()
    print(
        f"\nreference run {t1 - t0:.1f} s; 4-rank job until killed {t2 - t1:.1f} s; 3-rank "
        f"restart from local step {newest} to the end {t3 - t2:.1f} s\n{staged[0]}"
    )


def _kill_where(env: str, spool_dir: str | None = None, *, also: str | None = None) -> None:
    """SIGKILL every process whose environment holds ``env`` (and ``also``, if given; or, with
    ``spool_dir``, that has a file open in it: a node's slurmstepd)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if also is not None and also.encode() not in environ:
            continue
        if env.encode() in environ or (spool_dir and any(spool_dir in f for f in fds)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def _kill_node(node: str, spool: Path) -> None:
    """What a node's loss looks like to Slurm: its slurmd, its job steps and ranks die."""
    os.kill(int((spool / f"slurmd.{node}.pid").read_text()), signal.SIGKILL)
    _kill_where(f"SLURMD_NODENAME={node}", f"/d.{node}/")


def _node_state(node: str) -> str:
    out = subprocess.run(
        ["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


def test_a_lost_node_goes_down_and_the_job_resumes_on_the_remaining_nodes(
    tmp_path: Path,
) -> None:
    """n2's slurmd is killed during the job, with its ranks and its disk: Slurm marks it DOWN,
    the job fails; the resubmission lands on n1 and n3 and resumes from n1's own copy and n1's
    partner copy of n2, rebuilt onto n3; the output is exact."""
    if len(multi_nodes()) < 3:
        pytest.skip("needs 3 nodes in partition multi")
    spool = Path(os.environ.get("RESILIENT_SLURM_DIR", "/tmp/resilient-slurm")) / "state"
    if not (spool / "slurmd.n2.pid").is_file():
        pytest.skip(f"no pid file of n2's slurmd in {spool}")
    want = _reference(tmp_path)
    job = _heat_job(tmp_path, "n1,n2")
    try:
        _wait(lambda: _protected(tmp_path / "ck") >= 3, "three protected checkpoints")
        _kill_node("n2", spool)
        shutil.rmtree(tmp_path / "local" / "n2")
        _wait(lambda: "down" in _node_state("n2"), "n2 to be marked down", 120)
        first = _finish(tmp_path, job)
        assert _job_state(job) in ("FAILED", "NODE_FAIL", "CANCELLED"), first
        job = _heat_job(tmp_path, None)  # wherever Slurm puts it: n1 and n3
        log = _finish(tmp_path, job)
        assert _job_state(job) == "COMPLETED", log
        assert "on node(s) n3 from partner copies" in log, log
        with h5py.File(tmp_path / "out.h5") as f:
            assert f["T"][()].tobytes() == want
    finally:
        subprocess.run(["/usr/sbin/slurmd", "-N", "n2"], timeout=60, check=False)
        _wait(lambda: _node_state("n2") in ("idle", "mixed"), "n2 back in service", 120)
