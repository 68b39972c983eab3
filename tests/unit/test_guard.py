"""job.guard: a run that ended (93, 78) against an engine's retry or a new run (pure logic,
and the engine as a real process tree)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilient.job.exitcodes import EXIT_FOREIGN_RUN, EXIT_NO_PROGRESS
from resilient.job.guard import (
    Invocation,
    fingerprint,
    interrupted_from_outside,
    trailing_no_progress,
    verdict,
)

HERE = Invocation("f1", engine="snakemake pid 10 started at tick 5")


def attempt(code: int, **extra: Any) -> dict[str, Any]:
    return {"exit_code": code, "progress": False, "fingerprint": "f1",
            "engine": HERE.engine, "reason": f"exit {code}", **extra}  # fmt: skip


def test_signals_from_outside() -> None:
    assert interrupted_from_outside(-9, None) == "SIGKILL"  # a child of Python
    assert interrupted_from_outside(9, None) == "SIGKILL"  # MPICH's mpiexec
    assert interrupted_from_outside(137, None) == "SIGKILL"  # a shell, srun
    assert interrupted_from_outside(-15, None) == "SIGTERM"
    assert interrupted_from_outside(-1, None) == "SIGHUP"
    assert interrupted_from_outside(1, None) is None  # the commonest failure, not SIGHUP
    assert interrupted_from_outside(-9, "SIGKILL") is None  # ours: the walltime's kill
    assert interrupted_from_outside(3, None) is None and interrupted_from_outside(-11, None) is None


def test_the_count_skips_refusals_and_kills_and_starts_at_a_new_run() -> None:
    ledger = [attempt(1), attempt(EXIT_FOREIGN_RUN), attempt(9, interrupted="SIGKILL"), attempt(1)]
    assert trailing_no_progress(ledger) == 2
    assert trailing_no_progress([*ledger, attempt(1, new_run="fixed")]) == 1
    assert trailing_no_progress([*ledger, {"exit_code": 75, "progress": True}]) == 0


def test_a_retry_of_an_ended_run_is_refused_and_a_new_run_starts() -> None:
    ended = [attempt(1), attempt(EXIT_NO_PROGRESS)]
    refused = verdict(ended, HERE, max_no_progress=2)
    assert refused.refuse == EXIT_NO_PROGRESS and "2 consecutive attempts" in refused.reason
    # Snakemake's retry in a cluster job, Slurm's requeue: refused whatever the engine process
    for retry in ("Snakemake attempt 3", "requeue 1 of Slurm job 7"):
        now = Invocation("f1", engine="another", retry=retry)
        assert verdict(ended, now, max_no_progress=2).refuse == EXIT_NO_PROGRESS
    # a new snakemake, a new Parsl script, a command typed by hand
    for engine in ("snakemake pid 11 started at tick 9", None):
        new = verdict(ended, Invocation("f1", engine=engine), max_no_progress=2)
        assert new.refuse is None and new.new_run is not None
        assert new.new_run.startswith("started anew") and "exit 93" in new.new_run
    # a changed program, even for an engine's retry
    changed = verdict(ended, Invocation("f2", retry="Snakemake attempt 2"), max_no_progress=2)
    assert changed.refuse is None and changed.new_run is not None
    assert changed.new_run.startswith("the command or a program file changed")
    # the program refused the directory (78): its retry is refused too, at once
    foreign = verdict([attempt(0), attempt(EXIT_FOREIGN_RUN)], HERE, max_no_progress=2)
    assert foreign.refuse == EXIT_FOREIGN_RUN
    # nothing ended: start
    assert verdict([attempt(1)], HERE, max_no_progress=2) == verdict([], HERE, max_no_progress=2)


def test_slurm_says_which_job_retries() -> None:
    def of(**env: str) -> Invocation:
        return Invocation.here(["x"], env, pid=1)

    assert of(SLURM_JOB_ID="7", SLURM_RESTART_COUNT="0").retry is None
    assert of(SLURM_JOB_ID="7", SLURM_RESTART_COUNT="2").retry == "requeue 2 of Slurm job 7"
    first = of(SLURM_ARRAY_JOB_ID="5", SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_MIN="1")
    later = of(SLURM_ARRAY_JOB_ID="5", SLURM_ARRAY_TASK_ID="3", SLURM_ARRAY_TASK_MIN="1")
    assert first.retry is None and later.retry == "task 3 of job array 5"
    assert first.engine == later.engine == "slurm array job 5"


def test_the_fingerprint_follows_scripts_not_data(tmp_path: Path) -> None:
    script, data = tmp_path / "sim.py", tmp_path / "out.h5"
    script.write_text("print(1)\n")
    data.write_text("a")
    before = fingerprint(["python", str(script), "--out", str(data)])
    data.write_text("ab")  # an output a failed attempt rewrote
    assert fingerprint(["python", str(script), "--out", str(data)]) == before
    script.write_text("print(2)  # fixed\n")
    assert fingerprint(["python", str(script), "--out", str(data)]) != before
    assert fingerprint(["python", str(script), "--fixed"]) != fingerprint(["python", str(script)])


PROBE = """
import json, os, sys
from resilient.job.guard import Invocation
inv = Invocation.here(["x"], {})
print(json.dumps([inv.engine, inv.retry]))
"""


@pytest.mark.parametrize(("args", "retry"), [([], None), (["--attempt", "1"], None),
                                             (["--attempt", "3"], "Snakemake attempt 3")])  # fmt: skip
def test_a_snakemake_process_above_is_the_engine(
    tmp_path: Path, args: list[str], retry: str | None
) -> None:
    """A real process tree: a program named ``snakemake`` (as the main process, or a cluster
    job's with ``--attempt N``) starts a shell that starts the probe."""
    fake = tmp_path / "snakemake"
    fake.write_text(
        "import subprocess, sys\n"
        f"sys.exit(subprocess.run(['sh', '-c', {sys.executable!r} + ' -c \"$0\"', {PROBE!r}]).returncode)\n"
    )
    out = subprocess.run([sys.executable, str(fake), *args], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    engine, got = json.loads(out.stdout)
    assert got == retry
    if args:
        assert engine == "snakemake job"
    else:
        assert engine.startswith("snakemake pid ") and "started at tick" in engine
    alone = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           check=True, timeout=60)  # fmt: skip
    assert json.loads(alone.stdout) == [None, None]
