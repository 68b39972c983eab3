"""A user's own multi-node MPI rule through Snakemake's Slurm executor plugin, on the local
multi-node Slurm (tests/slurm/up.sh, partition ``multi``): resubmitted after walltime stops,
requeued in place, and the two mistakes a user makes.

The user's Snakefile (:data:`SNAKEFILE`: docs/examples/snakemake/multinode/Snakefile, which
docs/howto/snakemake.md includes, written to a temporary directory) has the multi-node rule:
``resources: **mpi_resources(nodes=2, tasks=4)`` and ``resilient_run(mpi=True)`` around
``apps.heat`` with its node-local tier on each Slurm node (``--local-dir
'BASE/$SLURMD_NODENAME'``), node-level checkpoints and partner copies. The heat task needs
~100 s of compute (200 steps, 0.5 s each) and each job has 1 minute (the warning signal
``USR1@10`` arrives 20-50 s in: Slurm checks every 30 s), so it takes 3 or more allocations. The
scenarios start together, and together with tests/test_slurm_workflows.py's (``slurm_scenarios``
in tests/conftest.py; the partition is OverSubscribe=FORCE), and each test awaits its own:

* resubmit: the repository's Slurm profile as it is: every walltime stop fails the job and
  Snakemake resubmits (a new job ID per allocation);
* requeue: ``slurm-requeue`` (sbatch --requeue) and ``resilient_slurm_requeue=true``, with the
  rule's ``retries: 0``: every walltime stop requeues the job in place (one job ID,
  ``SLURM_RESTART_COUNT`` 0, 1, 2, ...), and Snakemake spends no retry;
* no mpi: the same rule written without the plugin's ``mpi`` resource: its shell runs in a
  one-node job step, ``resilient run`` exits 78 naming the rule and the fix (not 93);
* no requeue: ``resilient run --requeue`` in a job submitted with ``--no-requeue``: one
  warning, exit 75.

Outputs are compared bit for bit with an uninterrupted run on 4 ranks. ``pytest -s`` prints
each scenario's wall time, allocations and the cost of a requeue (stop to restart).
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient.job.ledger import read_ledger
from tests import slurmutil
from tests.mpirun import REPO, clean_env, mpiexec
from tests.slurmutil import snakemake_job_logs
from tests.test_slurm_workflows import Scenario, start

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.timeout(1200)]

CASE = {"nx": 64, "ny": 64, "steps": 200, "alpha": 0.2}
# 100 s of compute: at least 3 one-minute allocations. One allocation computes at most ~47 s
# (94 steps: the warning is due 50 s in, the start-up takes 3 s or more; 51-86 seen), so
# two never finish 200 steps; 240 steps took 4 allocations (258 s of the suite's campaign)
DELAY = 0.5

# the user's Snakefile, as docs/howto/snakemake.md includes it
SNAKEFILE = (REPO / "docs" / "examples" / "snakemake" / "multinode" / "Snakefile").read_text()

# as tests/test_slurm_workflows.py: 1-minute jobs, a warning that fits them; partition multi
SLURM_ARGS = ["--slurm-init-seconds-before-status-checks", "5", "--slurm-keep-successful-logs"]


def set_resources(rule: str) -> list[str]:
    return ["--set-resources", f"{rule}:runtime=1", f"{rule}:slurm_partition=multi",
            f"{rule}:slurm_extra='--signal=USR1@10 --open-mode=append'"]  # fmt: skip


def start_snakemake(
    name: str, d: Path, t0: float, rule: str, *, retries: int, extra: list[str]
) -> Scenario:
    """The user's Snakefile through the repository's Slurm profile (the README's command),
    with 1-minute jobs in partition multi."""
    (d / "Snakefile").write_text(SNAKEFILE)
    config = {"case": CASE, "python": sys.executable, "local": str(d / "local"),
              "retries": retries, "step_delay": DELAY}  # fmt: skip
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    target = {"heat": "results/hot.h5", "heat_nompi": "nompi/hot.h5"}[rule]
    cmd = [
        sys.executable, "-m", "snakemake", "--profile", str(REPO / "configs/profiles/slurm"),
        "-s", str(d / "Snakefile"), "--directory", str(d), target,
        "--configfile", str(d / "config.yaml"), *set_resources(rule), *SLURM_ARGS, *extra,
    ]  # fmt: skip
    return start(name, d, cmd, t0)


BATCH = """#!/bin/bash
{py} -m resilient.cli run --requeue --checkpoint-dir {ck} -- \\
    srun --mpi=pmi2 -n 2 {py} -m apps.heat {heat} --checkpoint-every 10 --step-delay {delay} \\
    --checkpoint-dir {ck} --out {out}
"""


def start_no_requeue(d: Path, t0: float) -> Scenario:
    """``resilient run --requeue`` in a job that may not be requeued (``--no-requeue``)."""
    heat = " ".join(f"--{k}={v}" for k, v in CASE.items())
    script = d / "job.sh"
    script.write_text(BATCH.format(py=shlex.quote(sys.executable), ck=d / "ck", heat=heat,
                                   delay=DELAY, out=d / "out.h5"))  # fmt: skip
    cmd = ["sbatch", "--wait", "--no-requeue", "-p", "debug", "-n", "2", "--time=1",
           "--signal=USR1@10", "-o", str(d / "job-%j.log"), "--chdir", str(REPO), str(script)]  # fmt: skip
    return start("no-requeue", d, cmd, t0)


def start_scenarios(base: Path, t0: float) -> dict[str, Scenario]:
    """This module's scenarios, started in the background (by ``slurm_scenarios`` in
    tests/conftest.py, beside the other Slurm campaign's)."""
    dirs = {n: base / n for n in ("resubmit", "requeue", "nompi", "norequeue")}
    for p in dirs.values():
        p.mkdir(parents=True)
    return {
        "resubmit": start_snakemake("resubmit", dirs["resubmit"], t0, "heat", retries=8,
                                    extra=[]),
        "requeue": start_snakemake("requeue", dirs["requeue"], t0, "heat", retries=0,
                                   extra=["--slurm-requeue", "--config",
                                          "resilient_slurm_requeue=true"]),
        "nompi": start_snakemake("nompi", dirs["nompi"], t0, "heat_nompi", retries=1, extra=[]),
        "norequeue": start_no_requeue(dirs["norequeue"], t0),
    }  # fmt: skip


@pytest.fixture(scope="module")
def scenarios(
    slurm_scenarios: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    runs = slurm_scenarios["snakemake_mpi"]
    if runs is None:
        pytest.skip(slurm_scenarios["snakemake_mpi_skipped"])
    # the uninterrupted reference, meanwhile, outside Slurm
    ref = tmp_path_factory.mktemp("slurm-snakemake-mpi-ref")
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "apps.heat"]
    cmd += [f"--{k}={v}" for k, v in CASE.items()]
    cmd += ["--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5")]
    subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300)
    return {"runs": runs, "ref": field_bytes(ref / "out.h5")}


def field_bytes(path: Path) -> bytes:
    return slurmutil.field_bytes(path, int(CASE["steps"]))


def heat_ledger(work: Path, rule: str = "heat") -> list[dict[str, Any]]:
    (ck,) = (work / "ckpt" / rule).glob("hot-*")
    return read_ledger(ck)



def assert_resumed_in_turn(ledger: list[dict[str, Any]]) -> None:
    """Three or more allocations, each stopped after progress and resumed where it stopped."""
    codes = [r["exit_code"] for r in ledger]
    assert len(ledger) >= 3 and codes == [75] * (len(codes) - 1) + [0], ledger
    assert ledger[0]["latest_before"] is None
    for before, after in itertools.pairwise(ledger):
        assert after["latest_before"] == before["latest_after"] is not None, ledger
    stops = [str(r["program_stop"]["reason"]) for r in ledger[:-1]]
    # rank 0 records Slurm's warning as its own, or as another rank's when that rank got it
    # first (Slurm signals the ranks one by one)
    said = ("signal SIGUSR1", "deadline", "stop requested on another rank")
    assert all(s.startswith(said) for s in stops), stops


def assert_node_local_tier(work: Path) -> None:
    """Each of the job's nodes kept its own checkpoints and its partner's copies."""
    nodes = sorted(p.name for p in (work / "local").iterdir())
    assert len(nodes) >= 2 and set(nodes) <= {"n1", "n2", "n3"}, nodes
    partners = [p for node in nodes for p in (work / "local" / node).glob("*/partner/*")]
    assert partners, nodes


def test_a_multinode_rule_resubmitted_after_walltime_stops(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["resubmit"]
    run.wait()
    assert run.proc.returncode == 0, f"snakemake exited {run.proc.returncode}\n{run.tail()}"
    ledger = heat_ledger(run.dir)
    assert_resumed_in_turn(ledger)
    jobs = [r["slurm_job_id"] for r in ledger]
    assert all(jobs) and len(set(jobs)) == len(jobs), jobs  # a new Slurm job per allocation
    assert field_bytes(run.dir / "results" / "hot.h5") == scenarios["ref"]
    assert_node_local_tier(run.dir)
    logs = snakemake_job_logs(run.dir)
    assert "Only allocated" not in logs and "setting nnodes to 1" not in logs, logs[-3000:]
    assert "Trying to restart" in run.log.read_text()
    print(f"\nresubmit: {run.elapsed:.0f} s, allocations {len(jobs)} (jobs {jobs}), "
          f"steps {[(r['latest_before'], r['latest_after']) for r in ledger]}")  # fmt: skip


def test_a_multinode_rule_requeued_in_place_spends_no_retry(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["requeue"]
    run.wait()
    assert run.proc.returncode == 0, f"snakemake exited {run.proc.returncode}\n{run.tail()}"
    ledger = heat_ledger(run.dir)
    assert_resumed_in_turn(ledger)
    (job,) = {r["slurm_job_id"] for r in ledger}  # one job, requeued in place
    assert [r["slurm_restart_count"] for r in ledger] == list(range(len(ledger))), ledger
    assert field_bytes(run.dir / "results" / "hot.h5") == scenarios["ref"]
    assert_node_local_tier(run.dir)
    text = run.log.read_text()
    assert "Trying to restart" not in text and "SLURM status is" not in text, text[-4000:]
    assert re.findall(r"submitted with SLURM jobid (\d+)", text) == [job], text[-4000:]
    logs = snakemake_job_logs(run.dir)  # --open-mode=append: one log for every allocation
    requeued = re.findall(r"requeued Slurm job (\d+) in place \(restart (\d+)\)", logs)
    assert requeued == [(job, str(i + 1)) for i in range(len(ledger) - 1)], logs[-4000:]
    # what a requeue costs: the program's stop to the next attempt's start
    costs = [after["start"] - before["program_stop"]["time"]
             for before, after in itertools.pairwise(ledger)]  # fmt: skip
    print(f"\nrequeue: {run.elapsed:.0f} s, allocations {len(ledger)} of Slurm job {job}, "
          f"stop to restart {[round(c, 1) for c in costs]} s, "
          f"steps {[(r['latest_before'], r['latest_after']) for r in ledger]}")  # fmt: skip


def test_a_multinode_rule_without_mpi_is_refused_with_the_fix(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["nompi"]
    run.wait()
    assert run.proc.returncode != 0, run.tail()
    logs = snakemake_job_logs(run.dir)
    said = [line for line in logs.splitlines() if "has 1 node of the job's 2" in line]
    jobs = re.findall(r"submitted with SLURM jobid (\d+)", run.log.read_text())
    assert len(jobs) == 2, run.tail()  # the job and Snakemake's one retry
    # each refused; a run once kept only one of the two logs (the plugin's, not ours to fix)
    kept = list((run.dir / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert 1 <= len(said) == len(kept), logs[-4000:]
    assert all("rule 'heat_nompi'" in s and "`mpi=" in s and "exit 78" in s for s in said), said
    assert "{resources.mpi} -N {resources.nodes} -n {resources.tasks}" in said[0]
    assert "exit 93" not in logs and "no progress" not in logs, logs[-4000:]
    assert not list((run.dir / "ckpt").rglob("attempts.jsonl"))  # the program never started
    print(f"\nno mpi: {run.elapsed:.0f} s, refused: {said[0][:200]}...")


def test_requeue_refused_by_slurm_warns_once_and_exits_75(scenarios: dict[str, Any]) -> None:
    run: Scenario = scenarios["runs"]["norequeue"]
    run.wait()
    (log,) = run.dir.glob("job-*.log")
    text = log.read_text()
    assert run.proc.returncode == 75, f"sbatch --wait exited {run.proc.returncode}\n{text}"
    warned = [line for line in text.splitlines() if "cannot be requeued (Requeue=0" in line]
    assert len(warned) == 1, text
    assert "requeued Slurm job" not in text and "Slurm refused" not in text, text
    (rec,) = read_ledger(run.dir / "ck")
    assert rec["exit_code"] == 75 and rec["progress"], rec  # the stop is kept: resume it
    assert "cannot be requeued (see the start): exit 75" in text, text
    print(f"\nno requeue: {run.elapsed:.0f} s, {warned[0][:160]}")
