"""Goodput on a real Slurm: the repository's campaign under 1-minute jobs, each task stopped at
least 3 times, measured with ``resilient report`` and a stopwatch.

Per run, the campaign (one heat case and ``train``, ~``steps x step_delay`` seconds of compute
each; ``train_torch`` off) through both engines, on partition ``debug``:

* Snakemake: ``snakemake --profile configs/profiles/slurm -s workflows/Snakefile`` with requeue
  in place (``--slurm-requeue``, ``--config resilient_slurm_requeue=true``), 1-minute jobs
  (``runtime=1``) and a warning that fits them (``--signal=USR1@10 --open-mode=append``). Each
  walltime stop requeues the job under its ID: no Snakemake retry is expected.
* Parsl: ``workflows/pipeline.py --config`` a copy of ``configs/parsl/slurm.yaml`` (1-minute
  blocks) with its ``run_dir`` in the run's directory. A walltime stop is a lost manager or exit
  75, which the resume retry handler prices 0; no ``--requeue`` inside a pilot job.

By default both engines run at the same time (the partition is OverSubscribe=FORCE:4);
``--sequential`` runs one after the other. Each engine's process is timed from outside
(``time.monotonic``). Then ``resilient report --json`` on its checkpoint root, and per task:
attempts, stops, goodput (report: compute kept / wall), compute kept, compute lost, checkpoint
time, start-up and exit, time between attempts (sum and median gap), the report's wall time
against the engine's stopwatch, and the retries spent: Snakemake's ``Trying to restart`` lines
and Slurm's requeues (distinct ``slurm_restart_count`` on the ledger) for Snakemake, the retry
handler's ``costs X retries`` lines in ``runinfo/*/parsl.log`` for Parsl. Each number says the
file it came from. A task stopped fewer than 3 times is flagged (make ``--steps`` larger).

::

    python bench/bench_slurm_goodput.py                        # 1 run, both engines at once
    python bench/bench_slurm_goodput.py --runs 2 --keep /tmp/goodput --json goodput.json

Needs the local Slurm (tests/slurm/up.sh) or a site's, with the venv first on PATH (jobs
inherit the environment); about 8-10 minutes per run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from benchutil import library_revision, write_json

from resilient.job.ledger import read_ledger

REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 1800  # per engine and run: stopped (SIGINT, then scancel) after this
WARNING = "'--signal=USR1@10 --open-mode=append'"  # USR1 due 50 s in; arrives 20-50 s in
# Snakemake's "rule heat:" block, then its "jobid: N" line; "Trying to restart job N."
RULE_JOB = re.compile(r"^\s*(?:local)?rule (\w+):\n(?:\s+\w+:.*\n)*?\s+jobid: (\d+)", re.M)
RESTART = re.compile(r"Trying to restart job (\d+)")
SUBMITTED = re.compile(r"submitted with SLURM jobid (\d+)|Launched block \d+ with job ID (\d+)")
# the resume retry handler's INFO line (resilient/integrations/parsl/retry.py)
DECISION = re.compile(
    r"resilient: task (\d+) \((\w+)\) try (\d+) (.*?): (costs (\S+) retr|not retried)"
)
PARSL_APP = {"simulate": "heat", "train": "train"}  # Parsl's app name -> the campaign's rule


def job_env() -> dict[str, str]:
    """This environment, this interpreter's bin first on PATH (the jobs inherit it), minus the
    variables of an enclosing Slurm job or MPI launch."""
    drop = ("SLURM_", "PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPIR_", "RESILIENT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def write_yaml(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def campaign(args: argparse.Namespace) -> dict[str, Any]:
    """The campaign both engines run: one heat case and train, ``steps x step_delay`` each."""
    case = {"nx": 64, "ny": 64, "steps": args.steps, "alpha": 0.2}
    every, delay = args.checkpoint_every, args.step_delay
    return {
        "walltime": None,  # no simulated walltime: Slurm's limit applies
        "heat": {"ranks": args.ranks, "checkpoint_every": every, "step_delay": delay,
                 "cases": {"hot": case}},
        "train": {"ranks": args.ranks, "steps": args.steps, "checkpoint_every": every,
                  "step_delay": delay},
        "train_torch": {"enabled": False},
    }  # fmt: skip


def snakemake_cmd(d: Path, args: argparse.Namespace) -> list[str]:
    doc = {"results": "results", "checkpoint_root": "ckpt", "retries": args.retries,
           **campaign(args)}  # fmt: skip
    resources = []
    for rule in ("heat", "train"):  # a command-line entry replaces the profile's: repeat mpi
        resources += [f"{rule}:runtime=1", f"{rule}:mpi=srun", f"{rule}:slurm_partition=debug",
                      f"{rule}:slurm_extra={WARNING}"]  # fmt: skip
    return [
        sys.executable, "-m", "snakemake", "--profile", "configs/profiles/slurm",
        "-s", "workflows/Snakefile", "--directory", str(d / "work"),
        "--configfile", str(write_yaml(d / "campaign.yaml", doc)), "--replace-workflow-config",
        "--set-resources", *resources, "--slurm-requeue",
        "--config", "resilient_slurm_requeue=true",
        "--slurm-init-seconds-before-status-checks", "5", "--slurm-keep-successful-logs",
    ]  # fmt: skip


def parsl_cmd(d: Path, args: argparse.Namespace) -> list[str]:
    config = yaml.safe_load((REPO / "configs" / "parsl" / "slurm.yaml").read_text())
    config["run_dir"] = str(d / "runinfo")
    config["provider"]["partition"] = "debug"
    return [
        sys.executable, str(REPO / "workflows" / "pipeline.py"),
        "--config", str(write_yaml(d / "slurm.yaml", config)),
        "--campaign", str(write_yaml(d / "campaign.yaml", campaign(args))),
        "--results", str(d / "results"), "--checkpoint-root", str(d / "ckpt"),
    ]  # fmt: skip


@dataclass
class Outcome:
    """One engine's finished run: its directory (log, checkpoint root) and stopwatch."""

    name: str
    dir: Path
    seconds: float | None = None  # the stopwatch, once the process has exited
    returncode: int | None = None

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    @property
    def ckpt(self) -> Path:
        return self.dir / ("work/ckpt" if self.name == "snakemake" else "ckpt")

    def job_ids(self) -> list[str]:
        paths = [self.log, *self.dir.glob("runinfo/*/parsl.log")]
        texts = [p.read_text(errors="replace") for p in paths if p.exists()]
        return list(dict.fromkeys(a or b for t in texts for a, b in SUBMITTED.findall(t)))

    def save(self) -> None:
        """The stopwatch and exit status next to the log (``--report-only`` reads them)."""
        doc = {"seconds": self.seconds, "returncode": self.returncode}
        (self.dir / "stopwatch.json").write_text(json.dumps(doc) + "\n")

    @classmethod
    def load(cls, d: Path) -> Outcome:
        doc = json.loads((d / "stopwatch.json").read_text())
        return cls(d.name, d, doc["seconds"], doc["returncode"])


@dataclass
class Engine:
    """One engine's process, timed from outside."""

    out: Outcome
    proc: subprocess.Popen[bytes]
    start: float = field(default_factory=time.monotonic)

    def poll(self) -> bool:
        if self.out.seconds is None and self.proc.poll() is not None:
            self.out.seconds = time.monotonic() - self.start
            self.out.returncode = self.proc.returncode
            self.out.save()
        return self.out.seconds is not None

    def stop(self) -> None:
        """SIGINT (Snakemake cancels its jobs, Parsl its blocks), SIGKILL if it hangs, then
        scancel what is left of its own jobs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if ids := self.out.job_ids():
            subprocess.run(["scancel", *ids], capture_output=True, timeout=60, check=False)


def launch(name: str, d: Path, cmd: list[str]) -> Engine:
    with open(d / f"{name}.log", "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    print(f"  started {name} in {d}: {' '.join(cmd)}", flush=True)
    return Engine(Outcome(name, d), proc)


def await_all(engines: Sequence[Engine]) -> None:
    """Until every engine's process exits; one that overruns BUDGET_S is stopped."""
    while not all(e.poll() for e in engines):
        for e in engines:
            if not e.poll() and time.monotonic() - e.start > BUDGET_S:
                print(f"  {e.out.name} overran {BUDGET_S} s: stopping it", flush=True)
                e.stop()
                e.poll()
        time.sleep(2)
    for e in engines:
        print(f"  {e.out.name} exited {e.out.returncode} after {e.out.seconds:.0f} s", flush=True)


def report(root: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "report", str(root), "--json"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    docs = json.loads(out.stdout)
    assert isinstance(docs, list)
    return docs


def snakemake_retries(e: Outcome) -> dict[str, int]:
    """Per rule: the submitting Snakemake's ``Trying to restart job N`` lines (its log)."""
    text = e.log.read_text(errors="replace") if e.log.exists() else ""
    rule_of = {job: rule for rule, job in RULE_JOB.findall(text)}
    counts: dict[str, int] = {}
    for job in RESTART.findall(text):
        rule = rule_of.get(job, f"job {job}")
        counts[rule] = counts.get(rule, 0) + 1
    return counts


def parsl_decisions(e: Outcome) -> dict[str, list[tuple[str, float]]]:
    """Per rule: the retry handler's decisions in runinfo/*/parsl.log, (why, cost) each; a try
    that was not retried costs inf."""
    found: dict[str, list[tuple[str, float]]] = {}
    seen = set()
    for path in sorted(e.dir.glob("runinfo/*/parsl.log")):
        for task, app, attempt, why, _, cost in DECISION.findall(path.read_text(errors="replace")):
            if (task, attempt) in seen:
                continue
            seen.add((task, attempt))
            rule = PARSL_APP.get(app, app)
            found.setdefault(rule, []).append((why, float(cost) if cost else float("inf")))
    return found


def task_rows(e: Outcome, min_stops: int) -> list[dict[str, Any]]:
    """One row per task of an engine's run: the report, the ledger, the retries."""
    rows = []
    restarts = snakemake_retries(e) if e.name == "snakemake" else {}
    decisions = parsl_decisions(e) if e.name == "parsl" else {}
    for doc in report(e.ckpt):
        root = Path(doc["root"])
        rule = root.parent.name  # ckpt/heat/hot-<hash>, ckpt/train/train-<hash>
        ledger = read_ledger(root)
        atts = doc["attempts"]
        gaps = [b["start"] - a["end"] for a, b in itertools.pairwise(atts)]
        stop_to_restart = [
            b["start"] - a["program_stop"]["time"]
            for a, b in itertools.pairwise(ledger)
            if isinstance(a.get("program_stop"), dict) and "time" in a["program_stop"]
        ]
        stops = sum(1 for r in ledger if r.get("exit_code") != 0)
        ph = doc["phases"] or {}
        row: dict[str, Any] = {
            "engine": e.name, "task": f"{rule}/{root.name.rsplit('-', 1)[0]}", "root": str(root),
            "attempts": len(atts), "stops": stops, "kills_report": doc["kills"],
            "finished": doc["finished"], "goodput": doc["goodput"],
            "kept_s": ph.get("compute_kept_s"), "lost_s": ph.get("compute_lost_s"),
            "checkpoint_s": ph.get("checkpoint_s"), "startup_s": ph.get("startup_s"),
            "exit_s": ph.get("exit_s"), "between_s": doc["between_s"], "gaps_s": gaps,
            "stop_to_restart_s": stop_to_restart,
            "report_wall_s": doc["wall_s"], "stopwatch_s": e.seconds,
            "exit_codes": [r.get("exit_code") for r in ledger],
            "slurm_jobs": list(dict.fromkeys(r.get("slurm_job_id") for r in ledger)),
            "stop_reasons": [str((r.get("program_stop") or {}).get("reason", "")) for r in ledger],
        }  # fmt: skip
        if e.name == "snakemake":
            counts = {r.get("slurm_restart_count") for r in ledger}
            row["snakemake_retries"] = restarts.get(rule, 0)
            row["slurm_requeues"] = len(counts) - 1
            row["restart_counts"] = sorted(c for c in counts if isinstance(c, int))
        else:
            mine = decisions.get(rule, [])
            row["parsl_failed_tries"] = len(mine)
            row["parsl_retry_cost"] = sum(c for _, c in mine)
            row["parsl_why"] = [why for why, _ in mine]
        row["flag"] = (
            ""
            if stops >= min_stops and doc["finished"]
            else (f"ONLY {stops} STOPS" if doc["finished"] else "NOT FINISHED")
        )
        rows.append(row)
    return rows


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_rows(run: int, rows: list[dict[str, Any]]) -> None:
    print(
        "\n| run | engine | task | attempts | stops | goodput | kept s | lost s | checkpoints s "
        "| start-up s | exit s | between s (sum) | gap s (median) | report wall s | stopwatch s "
        "| retries spent |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if r["engine"] == "snakemake":
            spent = f"Snakemake {r['snakemake_retries']}, Slurm requeues {r['slurm_requeues']}"
        else:
            spent = f"{r['parsl_failed_tries']} failed tries costing {r['parsl_retry_cost']:g}"
        gap = statistics.median(r["gaps_s"]) if r["gaps_s"] else None
        gp = fmt(100 * r["goodput"], ".0f") + "%" if r["goodput"] is not None else "-"
        print(
            f"| {run} | {r['engine']} | {r['task']} | {r['attempts']} | {r['stops']} | {gp} "
            f"| {fmt(r['kept_s'])} | {fmt(r['lost_s'])} | {fmt(r['checkpoint_s'])} "
            f"| {fmt(r['startup_s'])} | {fmt(r['exit_s'])} | {fmt(r['between_s'])} | {fmt(gap)} "
            f"| {fmt(r['report_wall_s'])} | {fmt(r['stopwatch_s'])} | {spent} |"
            + (f" **{r['flag']}**" if r["flag"] else "")
        )
    for r in rows:
        print(f"  {r['engine']} {r['task']}: exits {r['exit_codes']}, Slurm jobs {r['slurm_jobs']}"
              + (f", SLURM_RESTART_COUNT {r['restart_counts']}" if "restart_counts" in r else "")
              + (f", handler: {r['parsl_why']}" if "parsl_why" in r else "")
              + f", gaps {[round(g, 1) for g in r['gaps_s']]} s, program stop to next start "
              + f"{[round(g, 1) for g in r['stop_to_restart_s']]} s")  # fmt: skip
        if r["flag"]:
            print(f"  WARNING: {r['engine']} {r['task']}: {r['flag']} (wanted >= 3 stops, "
                  "finished): make --steps larger", flush=True)  # fmt: skip


SOURCES = """
Where each number comes from:
  attempts, goodput, kept/lost/checkpoints/start-up/exit, between, report wall:
      `resilient report --json CKPT_ROOT` (attempts.jsonl, saves.jsonl, progress.jsonl);
      gap = next attempt's start - this attempt's end (the report's attempts)
  stops, exits, Slurm jobs, SLURM_RESTART_COUNT: the task's ledger, CKPT/attempts.jsonl
  stopwatch: time.monotonic() around the engine's process (the whole campaign, both tasks)
  Snakemake retries: 'Trying to restart job N' in the submitting Snakemake's log (RUN/snakemake/
      snakemake.log), attributed to a rule by its 'rule R: ... jobid: N' block;
  Slurm requeues: distinct slurm_restart_count on the ledger, less one
  Parsl: the resume retry handler's 'resilient: task N (app) try K ...: costs X retries' lines
      in RUN/parsl/runinfo/*/parsl.log (one per failed try; app simulate = heat)"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--keep", type=Path, help="keep each run's directory under DIR (run-N)")
    p.add_argument("--engines", default="snakemake,parsl", help="comma-separated (default both)")
    p.add_argument("--sequential", action="store_true", help="one engine after the other")
    p.add_argument("--steps", type=int, default=360, help="per task (default 360)")
    p.add_argument("--step-delay", type=float, default=0.5, help="seconds per step (0.5)")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--ranks", type=int, default=2, help="per task (default 2)")
    p.add_argument("--retries", type=int, default=3, help="Snakemake's per-rule budget (3)")
    p.add_argument("--min-stops", type=int, default=3, help="flag a task stopped fewer times")
    p.add_argument("--json", help="write every row here")
    p.add_argument(
        "--report-only",
        type=Path,
        metavar="DIR",
        help="measure nothing: the tables of the runs kept in DIR (--keep)",
    )
    args = p.parse_args()
    every: list[dict[str, Any]] = []
    if args.report_only:
        for i, run in enumerate(sorted(args.report_only.glob("run-*")), 1):
            done = [
                Outcome.load(d) for d in sorted(run.iterdir()) if (d / "stopwatch.json").exists()
            ]
            rows = [dict(r, run=i) for o in done for r in task_rows(o, args.min_stops)]
            print_rows(i, rows)
            every += rows
        summarise(every)
        write_json(args.json, every)
        return
    names = [n for n in args.engines.split(",") if n]
    builders = {"snakemake": snakemake_cmd, "parsl": parsl_cmd}
    print(
        f"library {library_revision()}; campaign: heat (64x64) and train, {args.ranks} ranks, "
        f"{args.steps} steps x {args.step_delay} s = {args.steps * args.step_delay:.0f} s of "
        f"compute each, checkpoint every {args.checkpoint_every} steps; 1-minute jobs/blocks on "
        f"partition debug; engines {names} {'one after the other' if args.sequential else 'at the same time'}",
        flush=True,
    )
    for i in range(1, args.runs + 1):
        if args.keep:
            base = args.keep / f"run-{i}"
            base.mkdir(parents=True, exist_ok=False)
            tmp = None
        else:
            tmp = tempfile.TemporaryDirectory(prefix="bench-slurm-goodput-")
            base = Path(tmp.name)
        print(f"\nrun {i}: {base}", flush=True)
        engines: list[Engine] = []
        try:
            for n in names:
                d = base / n
                d.mkdir(parents=True)
                engines.append(launch(n, d, builders[n](d, args)))
                if args.sequential:
                    await_all(engines[-1:])
            await_all(engines)
            rows = [r for e in engines for r in task_rows(e.out, args.min_stops)]
        finally:
            for e in engines:
                e.stop()
        for e in engines:
            if e.out.returncode != 0:
                print(f"  {e.out.name} FAILED ({e.out.returncode}); its log ends:\n"
                      + e.out.log.read_text(errors="replace")[-3000:])  # fmt: skip
        for r in rows:
            r["run"] = i
        print_rows(i, rows)
        every += rows
        if tmp is not None:
            tmp.cleanup()
    summarise(every)
    write_json(args.json, every)


def summarise(every: list[dict[str, Any]]) -> None:
    """Where the numbers come from; with several runs, each task's spread."""
    print(SOURCES)
    if len({r["run"] for r in every}) < 2:
        return
    print("\nspread over runs:")
    for engine, task in dict.fromkeys((r["engine"], r["task"]) for r in every):
        mine = [r for r in every if (r["engine"], r["task"]) == (engine, task)]
        gps = [100 * r["goodput"] for r in mine if r["goodput"] is not None] or [float("nan")]
        stops = [r["stops"] for r in mine]
        gaps = [g for r in mine for g in r["gaps_s"]] or [float("nan")]
        print(f"  {engine} {task}: goodput {min(gps):.0f}-{max(gps):.0f}%, stops "
              f"{min(stops)}-{max(stops)}, gap between attempts {min(gaps):.1f}-"
              f"{max(gaps):.1f} s (median {statistics.median(gaps):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
