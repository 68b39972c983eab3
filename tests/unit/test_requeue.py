"""Requeue in place on Slurm and the narrow-step check, with a fake ``scontrol``/``squeue``."""

from __future__ import annotations

import logging
import os
import shlex
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from resilient.job import requeue
from resilient.job.exitcodes import EXIT_CONFIG, EXIT_RESUME
from resilient.job.ledger import read_ledger
from resilient.job.options import RunOptions, build_parser, options_from_args
from resilient.job.requeue import SlurmJob, decide, window_s
from resilient.job.run import run
from resilient.job.steps import NarrowStep, narrow_step
from tests.unit.ckutil import job_free_env

REPO = Path(__file__).resolve().parents[2]

SHOW_JOB = (
    "JobId=42 JobName=heat UserId=root(0) Priority=1 Requeue={requeue} Restarts={restarts} "
    "BatchFlag={batch} Reboot=0 ExitCode=0:0 RunTime=00:00:31 TimeLimit=00:01:00 NumNodes=2"
)


def fake_scontrol(
    *, restarts: int = 0, config: str = ""
) -> tuple[requeue.Scontrol, list[list[str]]]:
    calls: list[list[str]] = []

    def scontrol(args: Sequence[str]) -> tuple[int, str]:
        calls.append(list(args))
        if args[:2] == ["show", "job"]:
            return 0, SHOW_JOB.format(requeue=1, batch=1, restarts=restarts)
        if args[:2] == ["show", "config"]:
            return 0, config
        return 0, ""

    return scontrol, calls


# --------------------------------------------------------------------------- scontrol facts


def test_the_job_facts_come_from_scontrol() -> None:
    scontrol, calls = fake_scontrol(restarts=2, config="KillWait = 30 sec\nMaxBatchRequeue = 5\n")
    job = SlurmJob.query("42", scontrol=scontrol)
    assert job == SlurmJob("42", requeueable=True, batch=True, restarts=2, max_batch_requeue=5)
    assert calls == [["show", "job", "-o", "42"], ["show", "config"]]
    ok, line = job.readiness()
    assert ok and "restarts so far 2" in line and "MaxBatchRequeue=5 counts only" in line
    assert "cred_expire" in line
    # Slurm 22.05 shows no MaxBatchRequeue (a fixed 5 there)
    old = SlurmJob.query("42", scontrol=fake_scontrol()[0])
    assert old.max_batch_requeue is None and "MaxBatchRequeue" not in old.readiness()[1]


@pytest.mark.parametrize(
    ("job", "said"),
    [
        (SlurmJob("42", requeueable=False, batch=True, restarts=0), "Requeue=0"),
        (SlurmJob("42", requeueable=True, batch=False, restarts=0), "not a batch job"),
        (SlurmJob("42", error="scontrol: command not found"), "cannot tell"),
    ],
)
def test_a_job_that_cannot_be_requeued_is_said_at_the_start(job: SlurmJob, said: str) -> None:
    ok, line = job.readiness()
    assert not ok and said in line and "exit 75" in line


def test_scontrol_failing_leaves_the_facts_unknown() -> None:
    job = SlurmJob.query("42", scontrol=lambda args: (1, "slurm_load_jobs error: Invalid job id"))
    assert job.requeueable is None and "Invalid job id" in job.error


# --------------------------------------------------------------------------- decide

NOW = 1_000_000.0


def stop(reason: str, left: float) -> dict[str, Any]:
    return {"time": NOW - left, "reason": reason, "saved": True}


@pytest.mark.parametrize(
    ("kwargs", "want", "why"),
    [
        ({"stop": stop("signal SIGUSR1", 30)}, True, "time limit (signal SIGUSR1, 30 s"),
        ({"stop": stop("deadline in 58 s", 58)}, True, "deadline in 58 s"),
        ({"stop": stop("deadline in 58 s", 5000)}, True, "deadline"),  # the program's own
        ({"stop": stop("stop requested on another rank", 20)}, True, "another rank"),
        ({"stop": stop("signal SIGUSR1", 3000)}, False, "more than 900 s"),
        ({"stop": stop("signal SIGUSR1", 3000), "window": window_s(3600)}, True, "SIGUSR1"),
        ({"stop": stop("signal SIGTERM", 10)}, False, "preemption or scancel"),
        ({"stop": stop("signal SIGUSR1", 10), "outside": ["SIGTERM"]}, False, "from outside"),
        ({"stop": stop("signal SIGUSR1", 10), "outside": ["SIGUSR1"]}, True, "SIGUSR1"),
        ({"stop": stop("signal SIGUSR1", 10), "interrupted": "SIGKILL"}, False, "SIGKILL"),
        ({"stop": None}, False, "no stop record"),
        ({"stop": stop("signal SIGUSR1", 10), "deadline": None}, False, "unknown time"),
        ({"stop": stop("signal SIGUSR1", 10), "exit_code": 93}, False, "exit 93"),
        ({"stop": stop("signal SIGUSR1", 10), "exit_code": 78}, False, "exit 78"),
        ({"stop": stop("signal SIGUSR1", 10), "exit_code": 0}, False, "exit 0"),
        ({"stop": stop("signal SIGUSR1", 10), "exit_code": 1}, False, "exit 1"),
    ],
)
def test_only_a_stop_at_the_time_limit_after_progress_is_requeued(
    kwargs: dict[str, Any], want: bool, why: str
) -> None:
    args: dict[str, Any] = {"exit_code": 75, "deadline": NOW, "window": window_s(None)}
    args.update(kwargs)
    decided = decide(**args)
    assert decided.requeue is want and why in decided.why, decided


def test_the_window_is_the_jobs_signal_lead_plus_slurms_early_delivery() -> None:
    assert window_s(None) == requeue.DEFAULT_WINDOW_S
    assert window_s(60) == 150


# --------------------------------------------------------------------------- the narrow step


def test_a_step_narrower_than_its_job() -> None:
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "1"}
    assert narrow_step(step, job_nodes=lambda job: 2) == NarrowStep("7", "0", 1, 2)
    assert narrow_step(step, job_nodes=lambda job: 1) is None
    assert narrow_step(step, job_nodes=lambda job: None) is None  # squeue said nothing
    full = {**step, "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "2"}  # a step of a batch script
    assert narrow_step(full, job_nodes=lambda job: None) == NarrowStep("7", "0", 1, 2)
    batch = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2"}
    assert narrow_step(batch, job_nodes=lambda job: 2) is None  # the batch step: no step id
    assert narrow_step({}, job_nodes=lambda job: 2) is None
    msg = NarrowStep("7", "0", 1, 2).message("heat case=a", refuse=True)
    assert "rule 'heat'" in msg and "`mpi=" in msg and "exit 78" in msg
    assert "{resources.mpi} -N {resources.nodes} -n {resources.tasks}" in msg
    assert "Starting anyway" in NarrowStep("7", "0", 1, 2).message(None, refuse=False)


# --------------------------------------------------------------------------- resilient run


clean_env = job_free_env


def tool(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def slurm_tools(tmp_path: Path, *, requeue: int = 1, refuse: bool = False) -> Path:
    """A fake ``scontrol`` (its calls logged; ``requeue`` ends the caller with SIGTERM, as Slurm
    ends a requeued job's processes) and ``squeue``, on a PATH of their own."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "scontrol.calls"
    show = SHOW_JOB.format(requeue=requeue, batch=1, restarts=0)
    answer = (
        'echo "Requested operation is presently disabled for job $2" >&2; exit 1'
        if refuse
        else "kill -TERM $PPID"
    )
    tool(bindir, "scontrol", f"""\
        echo "$*" >> {calls}
        case "$1 $2" in
          "show job") echo '{show}' ;;
          "show config") echo 'KillWait = 5 sec' ;;
          "requeue "*) {answer} ;;
        esac
        """)  # fmt: skip
    tool(bindir, "squeue", "echo 2\n")
    return bindir


# a Session program stopped by a warning signal (as Slurm's --signal would send it)
STOPPED_BY = """
import os, signal
import numpy as np
from resilient.job.session import Session
with Session(margin_s=1) as s:
    step, state = s.restore_or({{"x": np.zeros(4)}})
    os.kill(os.getpid(), signal.{sig})
    while not s.should_stop():
        step += 1
        s.maybe_save(step, state)
"""


def slurm_run(
    tmp_path: Path, sig: str = "SIGUSR1", *, left_s: float = 30.0, **tools: Any
) -> tuple[int, list[dict[str, Any]], list[str]]:
    bindir = slurm_tools(tmp_path, **tools)
    env = clean_env(SLURM_JOB_ID="42", SLURM_JOB_END_TIME=str(int(time.time() + left_s)))
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    ck = tmp_path / "ck"
    prog = (sys.executable, "-c", STOPPED_BY.format(sig=sig))
    old = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]  # scontrol is looked up on this process's PATH
    try:
        code = run(RunOptions(command=prog, checkpoint_dir=ck, requeue=True), environ=env)
    finally:
        os.environ["PATH"] = old
    calls = tmp_path / "scontrol.calls"
    return code, read_ledger(ck), calls.read_text().splitlines() if calls.exists() else []


def test_a_time_limit_stop_requeues_the_job_in_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="resilient.job.run"):
        code, ledger, calls = slurm_run(tmp_path)
    assert code == EXIT_RESUME
    assert calls == ["show job -o 42", "show config", "requeue 42"]
    (rec,) = ledger
    assert rec["slurm_job_id"] == "42" and rec["slurm_restart_count"] == 0  # from scontrol
    assert rec["progress"] and rec["program_stop"]["reason"] == "signal SIGUSR1"
    said = caplog.text
    assert "requeued Slurm job 42 in place (restart 1)" in said
    assert "a time-limit stop after progress requeues Slurm job 42" in said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_refused_requeue_exits_75_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="resilient.job.run"):
        code, ledger, calls = slurm_run(tmp_path, refuse=True)
    assert code == EXIT_RESUME and calls[-1] == "requeue 42"
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Slurm refused to requeue job 42" in warned and "presently disabled" in warned
    assert ledger[-1]["exit_code"] == EXIT_RESUME  # the stop is kept


def test_a_job_submitted_with_no_requeue_is_warned_once_and_exits_75(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="resilient.job.run"):
        code, _, calls = slurm_run(tmp_path, requeue=0)
    assert code == EXIT_RESUME and "requeue 42" not in calls
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Requeue=0" in warned and "--no-requeue" in warned


@pytest.mark.parametrize(
    ("sig", "left_s", "why"),
    [("SIGTERM", 30.0, "preemption or scancel"), ("SIGUSR1", 3600.0, "more than 900 s")],
)
def test_no_requeue_on_scancel_or_far_from_the_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, sig: str, left_s: float, why: str
) -> None:
    with caplog.at_level(logging.INFO, logger="resilient.job.run"):
        code, _, calls = slurm_run(tmp_path, sig, left_s=left_s)
    assert code == EXIT_RESUME and "requeue 42" not in calls
    assert "not requeuing Slurm job 42: " in caplog.text and why in caplog.text


def test_requeue_needs_a_walltime_or_a_slurm_job() -> None:
    args = build_parser().parse_args(["--requeue", "--", "true"])
    with pytest.raises(ValueError, match=r"--requeue needs --walltime .* or a Slurm batch job"):
        options_from_args(args, environ={})
    assert options_from_args(args, environ={"SLURM_JOB_ID": "1"}).requeue
    with pytest.raises(ValueError, match="Slurm batch job"):
        run(RunOptions(command=("true",), requeue=True), environ={})


def test_a_multinode_rule_in_a_one_node_step_is_refused_under_snakemake(tmp_path: Path) -> None:
    """The executor plugin's wrong form: the rule's shell in a one-node step of a 2-node job,
    under the job's Snakemake (``--attempt 1``): exit 78 naming the rule and the fix, without
    starting the program; outside Snakemake a warning, and the program runs."""
    bindir = slurm_tools(tmp_path)
    env = clean_env(SLURM_JOB_ID="42", SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="1")
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    ran = tmp_path / "ran"
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--task", "heat case=a",
           "--checkpoint-dir", str(tmp_path / "ck"), "--", "touch", str(ran)]  # fmt: skip
    # the job's Snakemake stays the ancestor (no exec): what guard.Invocation looks for
    tool(bindir, "snakemake", " ".join(shlex.quote(w) for w in cmd) + "\n")
    refused = subprocess.run(
        [str(bindir / "snakemake"), "--attempt", "1"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert refused.returncode == EXIT_CONFIG, refused.stderr
    assert not ran.exists() and not (tmp_path / "ck").exists()
    assert "rule 'heat'" in refused.stderr and "has 1 node of the job's 2" in refused.stderr
    assert "{resources.mpi} -N {resources.nodes}" in refused.stderr

    by_hand = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    assert by_hand.returncode == 0 and ran.exists(), by_hand.stderr
    assert "Starting anyway" in by_hand.stderr
