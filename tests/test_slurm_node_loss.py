"""A node lost under a running task, on the local multi-node Slurm (tests/slurm/up.sh), with the
engines resubmitting: Snakemake through its Slurm executor plugin and Parsl with a 2-node
``SlurmProvider`` block.

Each scenario runs ``apps.heat`` on 2 nodes (4 ranks) with the node-local tier on each Slurm
node (``--local-dir 'BASE/$SLURMD_NODENAME'``), partner copies and no flush to the shared root
(``--flush-every 1000``): after the loss, only the partner copy on the surviving node holds the
lost node's part of the newest local checkpoint. n3 is drained while they start, so every
scenario lands on n1 and n2; once each has protected 3 local checkpoints n2 is killed (its
``slurmd``, its job steps and ranks: :func:`tests.test_slurm_multinode._kill_node`) and its local
directory deleted, and n3 is returned to service. Slurm declares n2 down (``SlurmdTimeout``),
ends the job steps ("Node failure on n2") and requeues or fails the jobs:

* snakemake, requeue: a user's own Snakefile through the repository's Slurm profile as it is,
  with ``--ntasks-per-node=2`` in the rule's ``slurm_extra`` (the node-local checkpoints serve
  a job with the same ranks per node: Slurm could place the 4 ranks 1 + 3 on a busy node).
  sbatch leaves requeueing to the cluster (``JobRequeue=1``, Slurm's default), so Slurm
  requeues the job itself; the plugin sees it pending again, no Snakemake retry is spent, and
  the job (same ID, ``SLURM_RESTART_COUNT`` 1) runs on n1 and n3;
* snakemake, retry: the same with ``--slurm-no-requeue`` (a site with ``JobRequeue=0``): the job
  ends ``NODE_FAIL``, the plugin reports the failure and Snakemake's retry submits a new job,
  which Slurm places on n1 and n3 (n2 is down);
* parsl: a user's own ``@bash_app`` (``resilient_command`` with ``$PARSL_MPI_PREFIX``) on an
  ``MPIExecutor`` whose block is a 2-node ``SlurmProvider`` job, ``retries: 0``. The block's
  worker runs on n1; n2 ran only ranks. Slurm requeues the block (a batch job), which takes the
  worker with it (``ManagerLost``), or the app's command returns first; either way the try is
  charged 0, because the node-local step it protected is progress, and the task runs again in
  the requeued block on n1 and n3.

In every scenario the next attempt rebuilds n2's part on n3 from the partner copy on n1,
resumes from the newest protected step and ends bit-identical to an uninterrupted run; the
ledger records the lost node (``lost_nodes``, exit 75). ``pytest -s`` prints the timings.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resilient.io.checkpoints import protected_steps
from resilient.job.ledger import read_ledger
from tests import slurmutil
from tests.mpirun import REPO, clean_env, mpiexec
from tests.slurmutil import require_slurm, snakemake_job_logs
from tests.test_slurm_multinode import _kill_node, _node_state, _wait, multi_nodes
from tests.test_slurm_workflows import Scenario, start, write_yaml

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.timeout(900)]

CASE = {"nx": 64, "ny": 64, "steps": 240, "alpha": 0.2}
DELAY = 0.25  # 60 s of compute: the loss lands mid-run, wherever the jobs start
PROTECTED = 3  # local checkpoints protected by partner copies before n2 is lost
TIER = ["--checkpoint-every", "10", "--checkpoint-comm", "node", "--redundancy", "partner",
        "--flush-every", "1000", "--async-save"]  # fmt: skip

SNAKEFILE = """
from resilient.integrations.snakemake import checkpoint_dir, mpi_resources, resilient_run, retries

CASE = config["case"]
HEAT = "{PY} -m apps.heat " + " ".join(f"--{k}={v}" for k, v in CASE.items())
PY, LOCAL, TIER = config["python"], config["local"], config["tier"]

rule heat:
    output: "results/{case}.h5"
    params: ckpt=lambda wc: checkpoint_dir("ckpt", "heat", CASE, wildcards=wc)
    resources: **mpi_resources(nodes=2, tasks=4, launcher="srun --mpi=pmi2")
    retries: retries(config["retries"])
    shell: resilient_run(mpi=True) + HEAT + " --step-delay " + str(config["delay"]) + " " + TIER
        + " --local-dir '" + LOCAL + "/$SLURMD_NODENAME' --checkpoint-dir {params.ckpt:q}"
        + " --out {output:q}"
"""

PARSL_DRIVER = """
import json, sys
import parsl
from parsl import File, bash_app
from resilient.integrations.parsl import load_config

@bash_app
def heat(repo, ckpt, local, case, delay, tier, outputs=(), stdout=None, stderr=None,
         parsl_resource_specification=None):
    import sys
    from resilient.integrations.parsl import resilient_command
    program = [sys.executable, "-m", "apps.heat", *(f"--{k}={v}" for k, v in case.items()),
               "--step-delay", delay, *tier, "--local-dir", local + "/$SLURMD_NODENAME",
               "--checkpoint-dir", ckpt, "--out", outputs[0]]
    return "cd " + repo + " && " + resilient_command(
        program, checkpoint_dir=ckpt, outputs=outputs, launcher_prefix="$PARSL_MPI_PREFIX")

config, d = sys.argv[1], sys.argv[2]
case, delay, tier = json.loads(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
dfk = parsl.load(load_config(config))
try:
    fut = heat(sys.argv[6], d + "/ck", d + "/local", case, delay, tier, outputs=[File(d + "/out.h5")],
               stdout=d + "/heat.out", stderr=d + "/heat.err",
               parsl_resource_specification={"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4})
    print("RESULT", fut.result(timeout=600))
finally:
    dfk.cleanup()
"""

PARSL_CONFIG = {
    "retries": 0,  # only tries that made progress may be retried: they cost 0
    "retry_handler": "resume",
    "strategy": "simple",
    "executor": {"kind": "mpi", "label": "mpi", "max_workers_per_block": 1,
                 "mpi_launcher": "srun", "heartbeat_threshold": 20, "heartbeat_period": 5},
    "provider": {"kind": "slurm", "partition": "multi", "nodes_per_block": 2, "init_blocks": 1,
                 "min_blocks": 0, "max_blocks": 1, "walltime": "00:10:00", "exclusive": False,
                 "scheduler_options": "#SBATCH --ntasks-per-node=2", "launcher": "simple"},
}  # fmt: skip


def start_snakemake(name: str, d: Path, t0: float, extra: list[str]) -> Scenario:
    (d / "Snakefile").write_text(SNAKEFILE)
    config = {"case": CASE, "python": sys.executable, "local": str(d / "local"), "retries": 2,
              "delay": DELAY, "tier": " ".join(TIER)}  # fmt: skip
    cmd = [
        sys.executable, "-m", "snakemake", "--profile", str(REPO / "configs/profiles/slurm"),
        "-s", str(d / "Snakefile"), "--directory", str(d), "results/hot.h5",
        "--configfile", str(write_yaml(d / "config.yaml", config)),
        "--set-resources", "heat:slurm_partition=multi", "heat:runtime=10",
        "heat:slurm_extra='--ntasks-per-node=2 --open-mode=append'",
        "--slurm-init-seconds-before-status-checks", "5", "--slurm-keep-successful-logs", *extra,
    ]  # fmt: skip
    return start(name, d, cmd, t0)


def start_parsl(d: Path, t0: float) -> Scenario:
    doc = {**PARSL_CONFIG, "run_dir": str(d / "runinfo")}
    doc["provider"] = {**PARSL_CONFIG["provider"],  # type: ignore[dict-item]
                       "worker_init": f"export PATH={Path(sys.executable).parent}:$PATH"}  # fmt: skip
    (d / "driver.py").write_text(PARSL_DRIVER)
    cmd = [sys.executable, str(d / "driver.py"), str(write_yaml(d / "parsl.yaml", doc)), str(d),
           json.dumps(CASE), str(DELAY), json.dumps(TIER), str(REPO)]  # fmt: skip
    return start("parsl", d, cmd, t0)


def checkpoint_root(d: Path) -> Path:
    found = [*d.glob("ckpt/heat/hot-*"), *d.glob("ck")]
    return found[0] if found else d / "missing"


def _drain(node: str, on: bool) -> None:
    subprocess.run(
        ["scontrol", "update", f"nodename={node}", f"state={'drain' if on else 'undrain'}",
         *(["reason=test_slurm_node_loss"] if on else [])],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def lost(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_slurm()
    if len(multi_nodes()) < 3:
        pytest.skip("needs 3 nodes in partition multi")
    spool = Path(os.environ.get("RESILIENT_SLURM_DIR", "/tmp/resilient-slurm")) / "state"
    if not (spool / "slurmd.n2.pid").is_file():
        pytest.skip(f"no pid file of n2's slurmd in {spool}")
    base = tmp_path_factory.mktemp("slurm-node-loss")
    dirs = {n: base / n for n in ("requeue", "retry", "parsl", "ref")}
    for p in dirs.values():
        p.mkdir()
    _drain("n3", True)  # every scenario starts on n1 and n2
    runs: dict[str, Scenario] = {}
    try:
        t0 = time.monotonic()
        runs["requeue"] = start_snakemake("requeue", dirs["requeue"], t0, [])
        runs["retry"] = start_snakemake("retry", dirs["retry"], t0, ["--slurm-no-requeue"])
        runs["parsl"] = start_parsl(dirs["parsl"], t0)
        ref = dirs["ref"]  # meanwhile, the uninterrupted reference outside Slurm
        cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "apps.heat"]
        cmd += [f"--{k}={v}" for k, v in CASE.items()]
        cmd += ["--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5")]
        subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300)

        def protected() -> dict[str, set[int]]:
            return {n: protected_steps(checkpoint_root(dirs[n])) for n in runs}

        def ready() -> bool:
            for name, run in runs.items():
                assert run.proc.poll() is None, f"{name} ended before the loss\n{run.tail()}"
            return all(len(s) >= PROTECTED for s in protected().values())

        _wait(ready, f"{PROTECTED} protected local checkpoints in every scenario", 300)
        _kill_node("n2", spool)
        killed = time.monotonic()
        for d in dirs.values():
            shutil.rmtree(d / "local" / "n2", ignore_errors=True)
        _drain("n3", False)
        _wait(lambda: "down" in _node_state("n2"), "n2 to be marked down", 120)
        down = time.monotonic() - killed
        time.sleep(2)  # the surviving ranks cannot complete another step: nothing new after this
        newest = {n: max(s) for n, s in protected().items()}
        yield {"runs": runs, "ref": field_bytes(ref / "out.h5"), "newest": newest, "down": down}
    finally:
        for run in runs.values():
            run.stop()
        _drain("n3", False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["/usr/sbin/slurmd", "-N", "n2"], timeout=60, check=False)
        _wait(lambda: _node_state("n2") in ("idle", "mixed", "allocated"), "n2 back", 120)


def field_bytes(path: Path) -> bytes:
    return slurmutil.field_bytes(path, int(CASE["steps"]))


def assert_resumed_after_the_loss(ledger: list[dict[str, Any]], newest: int, log: str) -> None:
    """The first attempt lost n2 after progress (75); the next rebuilt n2's part on n3 from
    the partner copies and resumed from a step not older than the newest protected one (one
    newer when n2 died after its partner copies were in place but before rank 0 recorded
    them: the restore finds them complete on disk); it finished."""
    assert len(ledger) == 2, ledger
    first, second = ledger
    assert first["lost_nodes"] == ["n2"] and first["exit_code"] == 75, first
    assert first["progress"] and first["latest_after"] == newest, first
    assert "Slurm lost node n2 (" in first["reason"], first
    assert second["latest_before"] == newest and second["exit_code"] == 0, second
    resumed = second["restored_step"]
    assert resumed in (newest, newest + 10), (newest, second)
    assert f"rebuilt local step {resumed} on node(s) n3 from partner copies" in log, log[-4000:]



def snakemake_resumed(lost: dict[str, Any], name: str) -> tuple[Scenario, list[dict[str, Any]]]:
    """The scenario, once Snakemake finished it, and its ledger, checked as above."""
    run: Scenario = lost["runs"][name]
    run.wait()
    assert run.proc.returncode == 0, f"snakemake exited {run.proc.returncode}\n{run.tail()}"
    ledger = read_ledger(checkpoint_root(run.dir))
    assert_resumed_after_the_loss(ledger, lost["newest"][name], snakemake_job_logs(run.dir))
    return run, ledger


def test_snakemake_a_lost_node_is_requeued_by_slurm(lost: dict[str, Any]) -> None:
    run, ledger = snakemake_resumed(lost, "requeue")
    (job,) = {r["slurm_job_id"] for r in ledger}  # requeued by Slurm: one job
    assert [r["slurm_restart_count"] for r in ledger] == [0, 1], ledger
    text = run.log.read_text()
    assert "Trying to restart" not in text, text[-4000:]  # no Snakemake retry spent
    assert re.findall(r"submitted with SLURM jobid (\d+)", text) == [job], text[-4000:]
    assert field_bytes(run.dir / "results" / "hot.h5") == lost["ref"]
    gap = ledger[1]["start"] - ledger[0]["end"]
    print(f"\nrequeue: {run.elapsed:.0f} s; n2 down {lost['down']:.0f} s after the kill; "
          f"requeued job {job} restarted {gap:.1f} s after the first attempt ended; resumed "
          f"from step {ledger[1]['restored_step']}")  # fmt: skip


def test_snakemake_a_lost_node_is_retried_by_snakemake(lost: dict[str, Any]) -> None:
    run, ledger = snakemake_resumed(lost, "retry")
    jobs = [r["slurm_job_id"] for r in ledger]
    assert len(set(jobs)) == 2, jobs  # a new job, submitted by Snakemake's retry
    text = run.log.read_text()
    assert "NODE_FAIL" in text and "Trying to restart" in text, text[-4000:]
    assert field_bytes(run.dir / "results" / "hot.h5") == lost["ref"]
    gap = ledger[1]["start"] - ledger[0]["end"]
    print(f"\nretry: {run.elapsed:.0f} s; Snakemake's new job started {gap:.1f} s after the "
          f"first attempt ended; resumed from step {ledger[1]['restored_step']}")  # fmt: skip


def test_parsl_a_lost_node_that_ran_only_ranks_costs_no_retry(lost: dict[str, Any]) -> None:
    run: Scenario = lost["runs"]["parsl"]
    run.wait()
    assert run.proc.returncode == 0, f"the driver exited {run.proc.returncode}\n{run.tail()}"
    assert "RESULT 0" in run.log.read_text(), run.tail()
    err = (run.dir / "heat.err").read_text()
    ledger = read_ledger(run.dir / "ck")
    assert_resumed_after_the_loss(ledger, lost["newest"]["parsl"], err)
    (parsl_log,) = run.dir.glob("runinfo/*/parsl.log")
    priced = [line for line in parsl_log.read_text().splitlines() if "resilient: task" in line]
    assert len(priced) == 1, priced  # one failed try, retried with retries: 0
    assert "costs 0 retries" in priced[0] and "Slurm lost node n2" in priced[0], priced
    assert field_bytes(run.dir / "out.h5") == lost["ref"]
    how = priced[0].split("try 0 ", 1)[-1]
    print(f"\nparsl: {run.elapsed:.0f} s; the try {how}")
