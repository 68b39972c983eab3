"""The workflow engines on a real Slurm (tests/slurm/up.sh): real 1-minute limits, real retries.

Skipped where ``sbatch`` does not work. Each scenario runs one heat task of ~100 s of compute
(200 steps, 0.5 s each) under 1-minute allocations, so it needs at least two; the scenarios are
started together, and together with tests/test_slurm_snakemake_mpi.py's (``slurm_scenarios`` in
tests/conftest.py; the partitions are OverSubscribe=FORCE), and each test awaits its own:

* Snakemake: ``snakemake --profile configs/profiles/slurm -s workflows/Snakefile`` (the
  README's command) with a small campaign, ``runtime=1`` and a warning signal that fits a
  1-minute job. Every attempt is its own Slurm job; Snakemake resubmits after each stop, and the
  jobs themselves never restart the program (the rules' ``retries(N)`` is 0 inside a job).
* Parsl: ``workflows/pipeline.py --config configs/parsl/slurm.yaml`` (HTEx + SlurmProvider,
  1-minute blocks; the heat DAG prepare -> simulate -> analyse), with ``retries: 0``: only
  tries that advanced the checkpoint are free, so finishing after several tries proves the
  resume-aware retry handler.
* Parsl MPIExecutor: a driver script calling the campaign's ``simulate`` app
  (workflows/parsl_apps.py) on ``configs/parsl/mpi.yaml`` (ranks started by ``srun`` via
  ``$PARSL_MPI_PREFIX``) with one node per block, as this cluster has one node.

Outputs are compared bit for bit with uninterrupted runs on the same rank count. Each test
prints its wall time and attempts (``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import pytest
import yaml

from resilient.job.ledger import read_ledger
from tests import slurmutil
from tests.mpirun import REPO, clean_env, mpiexec

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]

CASE = {"nx": 64, "ny": 64, "steps": 200, "alpha": 0.2}
DELAY = 0.5  # 100 s of compute: more than one 1-minute allocation (the app stops at ~50-58 s)
EVERY = 10
BUDGET_S = 900  # per scenario, from the start of the campaigns (tests/conftest.py)
STOP_WAIT_S = 120  # after SIGINT: Snakemake scancels its jobs, Parsl its blocks

# Snakemake's Slurm profile asks for --signal=USR1@60, a minute before the end of jobs of
# 10 * attempt minutes. This test gives the heat rule 1-minute jobs, so the warning must come
# later: USR1@10 is due 50 s in and arrives 20-50 s in (Slurm checks every 30 s). With @60 it
# would arrive 0-30 s in, and the task would take ~9 attempts instead of ~3.
SNAKEMAKE_ARGS = [
    # a command-line --set-resources replaces the profile's whole entry: repeat mpi=srun
    "--set-resources", "heat:runtime=1", "heat:mpi=srun", "train:mpi=srun",
    "heat:slurm_extra='--signal=USR1@10 --open-mode=append'",
    "--slurm-init-seconds-before-status-checks", "5",
]  # fmt: skip


def env() -> dict[str, str]:
    """The test's environment for the engines; jobs inherit it (--export=ALL)."""
    full = clean_env()
    full["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full.get('PATH', '')}"
    return full


@dataclass
class Scenario:
    """A workflow started in the background: its process, log, wall time and Slurm job ids."""

    name: str
    dir: Path
    log: Path
    proc: subprocess.Popen[bytes]
    deadline: float  # time.monotonic()
    start: float = field(default_factory=time.monotonic)
    end: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    overran: bool = False

    def __post_init__(self) -> None:
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:  # notes when the process ends, whoever waits for it
        self.proc.wait()
        self.end = time.monotonic()
        self.done.set()

    @property
    def elapsed(self) -> float:
        return (self.end or time.monotonic()) - self.start

    def job_ids(self) -> list[str]:
        """Slurm jobs this scenario submitted (from Snakemake's log / Parsl's run_dir)."""
        texts = [self.log.read_text(errors="replace")] if self.log.exists() else []
        texts += [p.read_text(errors="replace") for p in self.dir.glob("runinfo/*/parsl.log")]
        pattern = r"submitted with SLURM jobid (\d+)|Launched block \d+ with job ID (\d+)"
        ids = [a or b for t in texts for a, b in re.findall(pattern, t)]
        return list(dict.fromkeys(ids))

    def stop(self) -> None:
        """SIGINT (Snakemake then cancels its jobs, Parsl its blocks); SIGKILL if it hangs;
        then scancel whatever of our own jobs is still queued."""
        if not self.done.is_set():
            self.proc.send_signal(signal.SIGINT)
            if not self.done.wait(STOP_WAIT_S):
                self.proc.kill()
                self.done.wait(30)
        ids = self.job_ids()
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, timeout=60, check=False)

    def wait(self) -> None:
        """Until the process exits, or stop it (SIGINT) at the deadline and fail."""
        if not self.done.wait(max(1.0, self.deadline - time.monotonic())):
            self.overran = True
            self.stop()
        if self.overran:
            raise AssertionError(f"{self.name} overran its {BUDGET_S} s; stopped\n{self.tail()}")

    def tail(self, n: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def start(name: str, d: Path, cmd: list[str], t0: float) -> Scenario:
    log = d / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env(), stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=not_ahead_of_the_timing_tests,
        )  # fmt: skip
    return Scenario(name, d, log, proc, deadline=t0 + BUDGET_S)


def not_ahead_of_the_timing_tests() -> None:
    """In the engine's process before it starts: ``nice`` 0 where the test's process runs
    ahead of others (the timing modules' -5 on the worker that starts the campaigns:
    tests/scheduling.py), so that the campaigns' engines and their local processes do not
    take the CPU from the short walltimes they run beside (their Slurm jobs run at slurmd's)."""
    if os.getpriority(os.PRIO_PROCESS, 0) < 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def write_yaml(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_snakemake(d: Path, t0: float) -> Scenario:
    campaign = {
        "results": "results",
        "checkpoint_root": "ckpt",
        "walltime": None,  # no simulated walltime: Slurm's limit applies
        "retries": 8,
        "heat": {"ranks": 4, "checkpoint_every": EVERY, "step_delay": DELAY, "cases": {"hot": CASE}},
        "train": {"ranks": 2, "steps": 20, "checkpoint_every": 10, "step_delay": 0.0},  # tiny
        "train_torch": {"enabled": False},  # explicit: jobs merge the default configfile back in
    }  # fmt: skip
    cmd = [
        sys.executable, "-m", "snakemake", "--profile", "configs/profiles/slurm",
        "-s", "workflows/Snakefile", "--directory", str(d / "work"),
        "--configfile", str(write_yaml(d / "campaign.yaml", campaign)), "--replace-workflow-config",
        *SNAKEMAKE_ARGS,
    ]  # fmt: skip
    return start("snakemake", d, cmd, t0)


def start_parsl(d: Path, t0: float) -> Scenario:
    # configs/parsl/slurm.yaml as it is, but with retries: 0 (a task fails as soon as one of
    # its tries costs anything: only tries that advanced the checkpoint are retried) and
    # Parsl's run_dir here
    doc = yaml.safe_load((REPO / "configs" / "parsl" / "slurm.yaml").read_text())
    doc.update(retries=0, run_dir=str(d / "runinfo"))
    campaign = {
        "walltime": None,
        "heat": {"ranks": 2, "checkpoint_every": EVERY, "step_delay": DELAY, "cases": {"hot": CASE}},
    }  # fmt: skip
    cmd = [
        sys.executable, str(REPO / "workflows" / "pipeline.py"),
        "--config", str(write_yaml(d / "slurm.yaml", doc)),
        "--campaign", str(write_yaml(d / "campaign.yaml", campaign)),
        "--results", str(d / "results"), "--checkpoint-root", str(d / "ckpt"),
    ]  # fmt: skip
    return start("parsl", d, cmd, t0)


MPI_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[4])
import parsl
from parsl import File
from resilient.integrations.parsl import load_config
from workflows.parsl_apps import mpi_resources, simulate
config, d, case = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with open(d + "/case.json", "w") as fh:
    json.dump(case, fh)
dfk = parsl.load(load_config(config))
try:
    fut = simulate(
        d + "/ck", ranks=2, checkpoint_every=10, parsl_resource_specification=mpi_resources(2),
        inputs=[File(d + "/case.json")], outputs=[File(d + "/out.h5")],
        stdout=d + "/heat.out", stderr=d + "/heat.err")
    print("RESULT", fut.result(timeout=600), json.dumps(fut.task_record["resource_specification"]))
finally:
    dfk.cleanup()
"""


def start_mpi(d: Path, t0: float) -> Scenario:
    # configs/parsl/mpi.yaml with one node per block (it asks for 2: PartitionNodeLimit here)
    doc = yaml.safe_load((REPO / "configs" / "parsl" / "mpi.yaml").read_text())
    doc["provider"]["nodes_per_block"] = 1
    doc.update(run_dir=str(d / "runinfo"))
    config = write_yaml(d / "mpi.yaml", doc)
    (d / "driver.py").write_text(MPI_DRIVER)
    cmd = [sys.executable, str(d / "driver.py"), str(config), str(d), json.dumps(CASE), str(REPO)]
    return start("mpi", d, cmd, t0)


def start_scenarios(base: Path, t0: float) -> dict[str, Scenario]:
    """This module's workflows, started in the background (by ``slurm_scenarios`` in
    tests/conftest.py, beside the other Slurm campaign's)."""
    dirs = {n: base / n for n in ("snakemake", "parsl", "mpi")}
    for p in dirs.values():
        p.mkdir(parents=True)
    return {
        "snakemake": start_snakemake(dirs["snakemake"], t0),
        "parsl": start_parsl(dirs["parsl"], t0),
        "mpi": start_mpi(dirs["mpi"], t0),
    }


@pytest.fixture(scope="module")
def scenarios(
    slurm_scenarios: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    runs = slurm_scenarios["workflows"]
    # the uninterrupted references, meanwhile, outside Slurm, on the same rank counts
    refs = {}
    for ranks in (4, 2):
        r = tmp_path_factory.mktemp(f"slurm-workflows-ref-n{ranks}")
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "apps.heat"]
        cmd += [f"--{k}={v}" for k, v in CASE.items()]
        cmd += ["--checkpoint-dir", str(r / "ck"), "--out", str(r / "out.h5")]
        subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300)
        refs[ranks] = field_bytes(r / "out.h5")
    return {"runs": runs, "ref": refs}


def field_bytes(path: Path) -> bytes:
    return slurmutil.field_bytes(path, int(CASE["steps"]))


def stop_reasons(text: str) -> dict[str, int]:
    """How the heat app's attempts stopped: counts of 'signal SIGUSR1', 'deadline', ..."""
    found = re.findall(r"stopping at step \d+: (signal \w+|deadline)", text)
    return dict(collections.Counter(found))


def test_snakemake_resubmits_after_the_time_limit_and_resumes(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["snakemake"]
    run.wait()
    assert run.proc.returncode == 0, f"snakemake exited {run.proc.returncode}\n{run.tail()}"
    work = run.dir / "work"
    (ck,) = (work / "ckpt" / "heat").glob("hot-*")
    ledger = read_ledger(ck)
    codes = [r["exit_code"] for r in ledger]
    jobs = [r["slurm_job_id"] for r in ledger]
    assert len(ledger) >= 2 and codes[-1] == 0, ledger
    assert codes[:-1] == [75] * (len(codes) - 1), codes  # each stop saved progress
    assert all(jobs) and len(set(jobs)) == len(jobs), jobs  # a new Slurm job per attempt
    assert ledger[0]["latest_before"] is None
    for before, after in itertools.pairwise(ledger):  # each resumed where the last stopped
        assert after["latest_before"] is not None, ledger
        assert after["latest_before"] == before["latest_after"], ledger

    assert field_bytes(work / "results" / "heat" / "hot.h5") == scenarios["ref"][4]
    summary = json.loads((work / "results" / "summary.json").read_text())["tasks"]
    assert summary["heat/hot"]["steps"] == CASE["steps"]
    assert Path(summary["heat/hot"]["checkpoint_dir"]) == Path("ckpt/heat") / ck.name

    report = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "report", str(ck), "--json"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    (task,) = json.loads(report.stdout)
    assert [a["slurm_job_id"] for a in task["attempts"]] == jobs
    assert task["finished"] is True and task["stops"] + task["kills"] == len(jobs) - 1

    # Snakemake saw each stopped job fail (FAILED: exit 75; TIMEOUT: killed at the limit)
    text = run.log.read_text()
    states = collections.Counter(re.findall(r"SLURM status is: '(\w+)'", text))
    assert sum(states.values()) == len(jobs) - 1, (states, text[-4000:])
    assert set(states) <= {"FAILED", "TIMEOUT"}, states
    logs = "".join(p.read_text() for p in (work / ".snakemake" / "slurm_logs").rglob("*.log"))
    # the rules' retries(N) is 0 inside a job (--mode remote): only the submitting Snakemake
    # retried (a new job per attempt), never the job itself in its nearly expired allocation
    assert "Trying to restart" in text, text[-4000:]
    assert logs and "Trying to restart" not in logs, logs[-4000:]
    print(
        f"\nsnakemake: {run.elapsed:.0f} s, heat attempts {len(jobs)} (Slurm jobs {jobs}), "
        f"job states {dict(states)}, stops {stop_reasons(logs)}, "
        f"steps per attempt {[(r['latest_before'], r['latest_after']) for r in ledger]}"
    )


def test_parsl_block_walltime_retries_cost_nothing_and_resume(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["parsl"]
    run.wait()
    assert run.proc.returncode == 0, f"pipeline exited {run.proc.returncode}\n{run.tail()}"
    summary = json.loads((run.dir / "results" / "parsl-summary.json").read_text())
    (task,) = summary["tasks"]
    tries = task["tries"]
    assert task["status"] == "exec_done" and task["error"] is None, task
    # with retries: 0, finishing after 2+ tries means every walltime stop was free
    assert tries >= 2 and task["fail_count"] == tries - 1 and task["fail_cost"] == 0, task

    ck = Path(task["checkpoint_dir"])
    ledger = read_ledger(ck)
    assert ledger[-1]["exit_code"] == 0 and ledger[0]["latest_before"] is None, ledger
    assert all(r["progress"] for r in ledger), ledger
    jobs = [r["slurm_job_id"] for r in ledger]
    assert all(jobs) and len(set(jobs)) == len(jobs), jobs  # every try on a new block
    blocks = run.job_ids()
    assert set(jobs) <= set(blocks), (jobs, blocks)

    for before, after in itertools.pairwise(ledger):  # each resumed where the last stopped
        assert after["latest_before"] == before["latest_after"] is not None, ledger

    # the handler's decisions: each failed try was a walltime stop (exit 75, or the block's
    # end: ManagerLost) after progress, at cost 0
    text = run.log.read_text()
    decisions = re.findall(
        r"^retry: resilient: task \d+ \(\w+\) try \d+ (.*): costs (\S+) retr", text, re.M
    )
    assert len(decisions) == tries - 1, text[-4000:]
    assert all(cost == "0" for _, cost in decisions), decisions
    kinds = collections.Counter(
        m.group(1) for why, _ in decisions if (m := re.search(r"\((exit \d+|\w+Lost)\b", why))
    )
    assert sum(kinds.values()) == len(decisions), decisions
    assert set(kinds) <= {"exit 75", "ManagerLost", "WorkerLost"}, decisions
    assert all("(exit 75)" in why or "(progress)" in why for why, _ in decisions), decisions
    assert summary["tasks"][0]["analysis"]["steps"] == CASE["steps"], summary

    assert field_bytes(run.dir / "results" / "heat" / "hot.h5") == scenarios["ref"][2]
    states = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", ",".join(blocks), "-o", "%i=%T"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout.split()  # fmt: skip
    err = (run.dir / "results" / "logs" / "heat-hot.err").read_text()
    print(
        f"\nparsl: {run.elapsed:.0f} s, heat tries {tries} (blocks {states}), failures {dict(kinds)}, "
        f"ledger exits {[r['exit_code'] for r in ledger]}, stops {stop_reasons(err)}, "
        f"steps per try {[(r['latest_before'], r['latest_after']) for r in ledger]}"
    )


def test_parsl_mpi_executor_starts_ranks_with_srun(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["mpi"]
    run.wait()
    err = run.dir / "heat.err"
    assert run.proc.returncode == 0, f"{run.tail()}\n{err.read_text() if err.exists() else ''}"
    (line,) = [ln for ln in run.log.read_text().splitlines() if ln.startswith("RESULT ")]
    code, spec = line.split(" ", 2)[1:]
    assert code == "0" and json.loads(spec)["num_ranks"] == 2
    assert "-- $PARSL_MPI_PREFIX" in err.read_text()
    with h5py.File(run.dir / "out.h5") as f:
        assert int(f.attrs["ranks"]) == 2
    assert field_bytes(run.dir / "out.h5") == scenarios["ref"][2]
    assert [r["exit_code"] for r in read_ledger(run.dir / "ck")] == [0]
    print(f"\nparsl mpi: {run.elapsed:.0f} s, blocks {run.job_ids()}")
