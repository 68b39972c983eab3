"""Plain sbatch templates on a real Slurm (tests/slurm/up.sh): real time limits, real signals.

Skipped where ``sbatch`` does not work (e.g. a laptop). Each scenario needs more than one
allocation of ``--time=2`` (Slurm kills at 120-150 s) or ``--time=1``, so the scenarios (the
PyTorch ones, srun tasks and ``srun torchrun``, where PyTorch is installed) are submitted
together (the partition is OverSubscribe=FORCE) and awaited one by one: in a serial run of the
suite, at its start with the Slurm campaigns (``sbatch_scenarios`` in tests/conftest.py), so
that they run on partition ``debug`` (node n1) while the unit tests do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import pytest

from resilient.job.ledger import read_ledger
from resilient.report import task_report
from tests.mpirun import REPO, clean_env, mpiexec
from tests.slurmutil import squeue_names

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

HEAT = "--nx 64 --ny 64 --steps 200 --checkpoint-every 10"
# 110 s of compute: more than one allocation of --time=2, whose USR1@30 comes 30-90 s in (Slurm
# may send it up to 60 s early: under --time=1 it once came 2 s in, before any checkpoint)
DELAY = "0.55"


def submit(script: str, *args: str, **env: str) -> str:
    full = clean_env(**env)
    full["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full.get('PATH', '')}"
    out = subprocess.run(
        ["sbatch", "--parsable", *args, str(REPO / "workflows" / "sbatch" / script)],
        cwd=REPO, env=full, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return out.stdout.strip().split(";")[0]


TORCH_ARGS = "--steps 150 --checkpoint-every 10"
DEMO_CONFIG = REPO / "configs" / "checkpoint" / "demo.yaml"  # walltime_margin_s: 2
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def scenarios(sbatch_scenarios: dict[str, Any]) -> dict[str, Any]:
    """The scenarios, submitted by the session fixture ``sbatch_scenarios`` (tests/conftest.py:
    with the Slurm campaigns at the start of a serial run, or now)."""
    return sbatch_scenarios


def start_scenarios(base: Path) -> dict[str, Any]:
    """Submit this module's scenarios (and compute the reference meanwhile); their
    directories under ``base``."""
    dirs: dict[str, Any] = {
        name: base / name
        for name in ("array", "self", "stuck", "requeue", "torch", "torchrun", "ref")
    }
    for d in dirs.values():
        d.mkdir()
    common = {"HEAT_ARGS": f"{HEAT} --step-delay {DELAY}"}
    # 105 s of steps: 2+ allocations of 2 minutes, whose warning comes 30-90 s in (under
    # 1-minute limits it came 0-30 s in, during PyTorch start-ups of 10-29 s beside the other
    # jobs: once 4 attempts in a row made no progress); up to 4 such attempts in a
    # row are allowed, 16 allocations in all; the tasks left after the run has finished exit 0
    # at once
    if HAS_TORCH:
        submit("train-torch.sbatch", "--array=1-16%1", "-o", str(dirs["torch"] / "job-%A_%a.log"),
               CKPT=str(dirs["torch"] / "ck"), OUT=str(dirs["torch"] / "out.h5"),
               MAX_NO_PROGRESS="4", TRAIN_ARGS=f"{TORCH_ARGS} --step-delay 0.7")  # fmt: skip
        # the same under `srun torchrun`, whose agent Slurm's --signal reaches too (the Sessions'
        # own stop 2 s before the deadline, not the app's 60 s, so that the signal comes first:
        # this tests the agent's handling of it); a signal
        # that comes during torchrun's start-up (Slurm sent it at once in one allocation) kills
        # the agent before it handles it: an attempt without progress, which may happen twice
        submit("train-torchrun.sbatch", "--array=1-16%1",
               "-o", str(dirs["torchrun"] / "job-%A_%a.log"), CKPT=str(dirs["torchrun"] / "ck"),
               OUT=str(dirs["torchrun"] / "out.h5"), MAX_NO_PROGRESS="4",
               TRAIN_ARGS=f"{TORCH_ARGS} --step-delay 0.7 --config {DEMO_CONFIG}")  # fmt: skip
    dirs["requeue_job"] = submit(
        "requeue.sbatch", "-o", str(dirs["requeue"] / "job.log"), "--job-name", "heat-requeue-test",
        CKPT=str(dirs["requeue"] / "ck"), OUT=str(dirs["requeue"] / "out.h5"), **common,
    )  # fmt: skip
    submit("array-chain.sbatch", "--array=1-6%1", "-o", str(dirs["array"] / "job-%A_%a.log"),
           CKPT=str(dirs["array"] / "ck"), OUT=str(dirs["array"] / "out.h5"), **common)  # fmt: skip
    submit("self-resubmit.sbatch", "-o", str(dirs["self"] / "job.log"), "--job-name", "heat-self-test",
           CKPT=str(dirs["self"] / "ck"), OUT=str(dirs["self"] / "out.h5"), **common)  # fmt: skip
    # a program that never makes progress: exit 93 at once, and no resubmission
    submit("self-resubmit.sbatch", "-o", str(dirs["stuck"] / "job.log"), "--job-name", "heat-stuck-test",
           CKPT=str(dirs["stuck"] / "ck"), OUT=str(dirs["stuck"] / "out.h5"), PROGRAM="false",
           MAX_NO_PROGRESS="1", HEAT_ARGS="")  # fmt: skip
    # the uninterrupted reference, meanwhile, outside Slurm
    subprocess.run(
        [mpiexec(), "-n", "4", sys.executable, "-m", "apps.heat", *HEAT.split(),
         "--checkpoint-dir", str(dirs["ref"] / "ck"), "--out", str(dirs["ref"] / "out.h5")],
        cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return dirs


def wait_for(path: Path, names: tuple[str, ...], timeout_s: float = 720) -> None:
    """Until ``path`` exists and no job of ``names`` is pending or running; an error at once
    (with the end of the jobs' logs) once the jobs have been gone for 20 s without it."""
    deadline = time.time() + timeout_s
    gone_since = None
    while time.time() < deadline:
        queued = squeue_names(names)
        if path.exists() and not queued:
            return
        if queued or path.exists():
            gone_since = None
        elif gone_since is None:
            gone_since = time.time()
        elif time.time() - gone_since > 20:
            logs = "".join(p.read_text()[-1500:] for p in sorted(path.parent.glob("*.log")))
            raise AssertionError(f"the jobs {names} ended without {path}:\n{logs[-6000:]}")
        time.sleep(3)
    raise AssertionError(f"timed out waiting for {path} (jobs still queued: {squeue_names(names)})")


def field(path: Path) -> bytes:
    with h5py.File(path) as f:
        return bytes(f["T"][()].tobytes())


def test_array_chain_resumes_each_task_and_matches(scenarios: dict[str, Any]) -> None:
    d = scenarios["array"]
    wait_for(d / "out.h5.done", ("heat-chain",))
    assert field(d / "out.h5") == field(scenarios["ref"] / "out.h5")
    ledger = read_ledger(d / "ck")
    assert ledger[-1]["exit_code"] == 0
    assert [r["exit_code"] for r in ledger].count(75) >= 1, ledger
    jobs = [r["slurm_job_id"] for r in ledger]
    assert all(jobs) and len(set(jobs)) == len(jobs), jobs  # one allocation per attempt
    resumed = [r for r in ledger if r["latest_before"] is not None]
    assert resumed, "no array task resumed from a checkpoint"
    report = task_report(d / "ck")
    assert report.finished and {a.slurm_job_id for a in report.attempts} == set(jobs)


def test_self_resubmitting_job_continues_after_75_and_stops_after_0(
    scenarios: dict[str, Any],
) -> None:
    d = scenarios["self"]
    wait_for(d / "out.h5", ("heat-self-test",))
    time.sleep(5)
    assert not squeue_names(("heat-self-test",)), "a job was submitted after the run finished"
    assert field(d / "out.h5") == field(scenarios["ref"] / "out.h5")
    ledger = read_ledger(d / "ck")
    codes = [r["exit_code"] for r in ledger]
    assert codes[-1] == 0 and 75 in codes, codes
    log = (d / "job.log").read_text()
    assert log.count("submitted job") == codes.count(75), log
    assert "USR1 at" in log, "the B: warning signal never reached the batch script"


def test_self_resubmitting_job_stops_after_93(scenarios: dict[str, Any]) -> None:
    d = scenarios["stuck"]
    deadline = time.time() + 300
    while squeue_names(("heat-stuck-test",)) and time.time() < deadline:
        time.sleep(2)
    ledger = read_ledger(d / "ck")
    assert [r["exit_code"] for r in ledger] == [93], ledger
    log = (d / "job.log").read_text()
    assert "submitted job" not in log and "resilient run exited 93" in log, log


def test_requeued_job_resumes_in_place_and_matches(scenarios: dict[str, Any]) -> None:
    """workflows/sbatch/requeue.sbatch: each walltime stop that made progress requeues the job
    under its ID (SLURM_RESTART_COUNT 0, 1, ...), which resumes; the output equals the
    uninterrupted run's."""
    d, job = scenarios["requeue"], scenarios["requeue_job"]
    wait_for(d / "out.h5", ("heat-requeue-test",))
    assert field(d / "out.h5") == field(scenarios["ref"] / "out.h5")
    ledger = read_ledger(d / "ck")
    codes = [r["exit_code"] for r in ledger]
    assert len(codes) >= 2 and codes[-1] == 0 and codes.count(75) == len(codes) - 1, codes
    assert {r["slurm_job_id"] for r in ledger} == {job}, ledger  # one job, requeued in place
    assert [r["slurm_restart_count"] for r in ledger] == list(range(len(ledger))), ledger
    log = (d / "job.log").read_text()
    starts = re.findall(r"^job (\d+) \(restart (\d+)\) on ", log, re.MULTILINE)
    assert starts == [(job, str(i)) for i in range(len(ledger))], log  # one log for all


@pytest.fixture(scope="module")
def torch_reference(scenarios: dict[str, Any]) -> Path:
    """An uninterrupted 2-process run of apps.train_torch (mpiexec, outside Slurm)."""
    ref: Path = scenarios["torch"] / "ref"
    subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "apps.train_torch", *TORCH_ARGS.split(),
         "--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5")],
        cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return ref / "out.h5"


def assert_same_model(got: Path, want: Path) -> None:
    with h5py.File(got) as g, h5py.File(want) as w:
        assert sorted(g) == sorted(w) and int(g.attrs["steps"]) == 150
        for name in w:
            assert g[name][()].tobytes() == w[name][()].tobytes(), name


def finished_torch_chain(d: Path, job: str, reference: Path) -> list[dict[str, Any]]:
    """Wait for the array chain ``job`` writing into ``d``; its output equals ``reference`` and
    its ledger ends in 0 after at least one stop (75). Returns the ledger."""
    wait_for(d / "out.h5.done", (job,))
    assert_same_model(d / "out.h5", reference)
    ledger = read_ledger(d / "ck")
    codes = [r["exit_code"] for r in ledger]
    assert codes[-1] == 0 and codes.count(75) >= 1, ledger
    return ledger


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
def test_torch_array_chain_resumes_and_matches(
    scenarios: dict[str, Any], torch_reference: Path
) -> None:
    """workflows/sbatch/train-torch.sbatch: apps.train_torch on 2 srun tasks (no MPI), 1-minute
    allocations chained by an array; the output equals an uninterrupted 2-process run's."""
    ledger = finished_torch_chain(scenarios["torch"], "torch-chain", torch_reference)
    assert all(r["slurm_job_id"] for r in ledger)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
def test_srun_torchrun_under_slurms_signal_stops_with_75_and_matches(
    scenarios: dict[str, Any], torch_reference: Path
) -> None:
    """workflows/sbatch/train-torchrun.sbatch: ``srun torchrun --nproc-per-node 2
    --signals-to-handle ...,SIGUSR1`` under ``--signal=USR1@30`` (to every process of the step):
    the agent waits for its workers, which stop, checkpoint and exit 75; the agent exits 1,
    and ``resilient run`` reports 75 from the Sessions' stop record; the chain ends with the
    output of an uninterrupted run."""
    d = scenarios["torchrun"]
    ledger = finished_torch_chain(d, "torchrun-chain", torch_reference)
    stops = [r for r in ledger if r["exit_code"] == 75]
    # the agent exits 1 (or dies of a signal that comes after it has stopped handling them);
    # a signal as the workers finish makes an attempt that finished its loop end 75 too
    said = [re.search(r"exited (1|138) after its Session('s stop \(signal SIGUSR1\)| finished)",
                      r["reason"]) for r in stops]  # fmt: skip
    assert all(said), stops
    logs = "".join(p.read_text() for p in sorted(d.glob("job-*.log")))
    assert "Received 10 death signal" in logs, logs  # the agent handled SIGUSR1 ...
    assert "closing signal SIGUSR1" in logs, logs  # ... and passed it on to its workers
    assert "STOPPED rank=1" in logs and "reason=signal SIGUSR1" in logs, logs
