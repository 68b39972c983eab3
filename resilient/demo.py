"""The README's first command: the example campaign under simulated walltime stops, end to end.

0. Measures each program's start-up (one step of it under ``resilient run``, whose ledger
   records the launch to the first step: MPI, the imports, the restore, under whatever load
   the machine has now); a task whose start-up would
   leave too little of the simulated walltime (less than :data:`STARTUPS` start-ups plus the
   stop margin) gets a longer walltime, and its steps are slowed down so that it still spans
   :data:`STOPS` walltimes: every task is stopped at least twice, and none fails for load.
1. Runs ``workflows/Snakefile`` (three MPI tasks: two 4-rank heat cases and a 2-rank training)
   with the local profile: every attempt gets a short simulated walltime from ``resilient run``
   (warning signal, SIGTERM, SIGKILL), so each task is stopped several times; each stop
   checkpoints, exits 75 and is requeued in place (``resilient run --requeue``: no Snakemake
   retry is spent on it), and the task resumes from its newest *valid* checkpoint.
2. Runs the same three programs uninterrupted, as the reference.
3. Prints the run report (attempts, stops and kills, reasons, checkpoints, steps recomputed,
   goodput),
   writes a plot of progress against wall-clock time, and checks every final output bit for bit
   against the reference.

Everything lands in one folder (``out/demo-<time>/`` by default), named at the end. No Slurm
needed. The same campaign runs under Parsl with ``python workflows/pipeline.py --walltime 4``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.job.launch import find_mpiexec
from resilient.job.ledger import read_ledger
from resilient.report import find_roots, format_table, plot, task_report

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


PROFILE_TASKS = 4
"""MPI ranks the local profile runs at a time (its ``resources: tasks``)."""

MPI_TASKS = ("heat", "train", "train_torch")
"""The campaign's sections that have a rank count (``configs/campaign.yaml``)."""


STOP_MARGIN_S = 2.0
"""The apps' stop margin before the deadline in the demo (``configs/checkpoint/demo.yaml``)."""

STARTUPS = 3
"""A task's simulated walltime is at least this many of its measured start-ups plus the stop
margin: one start-up to start, the rest for compute (and for a start-up slower than measured:
the load changes)."""

STOPS = 3
"""A task whose walltime was raised for its start-up is slowed down to span this many
walltimes' compute, so that it is still stopped at least twice."""


@dataclass(frozen=True, slots=True)
class Timing:
    """One kind of task's start-up, measured, and the walltime and step delay it gets."""

    startup_s: float
    walltime_s: float
    step_delay: float
    raised: bool = False  # the walltime is longer than the campaign's for this start-up


def load_campaign() -> dict[str, Any]:
    import yaml

    campaign: dict[str, Any] = yaml.safe_load((REPO / "configs/campaign.yaml").read_text())
    return campaign


def torch_task(campaign: Mapping[str, Any]) -> bool:
    """Whether the campaign runs ``train_torch`` (as the Snakefile decides: enabled, or auto
    where torch is installed)."""
    section = campaign.get("train_torch") or {}
    value = str(section.get("enabled", "auto")).strip().lower() if section else "false"
    if value == "auto":
        return importlib.util.find_spec("torch") is not None
    return value in ("1", "true", "yes", "on")


def task_ranks(campaign: Mapping[str, Any], ranks: int | None) -> dict[str, int]:
    """The MPI tasks' kinds that run, and their rank counts."""
    kinds = {k: ranks or int(campaign[k]["ranks"]) for k in ("heat", "train")}
    if torch_task(campaign):
        kinds["train_torch"] = ranks or int(campaign["train_torch"]["ranks"])
    return kinds


def program_argv(campaign: Mapping[str, Any], kind: str, case: str | None = None) -> list[str]:
    """``-m apps.KIND ...``: the campaign's arguments of one kind of task (a heat ``case``;
    default the first), before ``--config``, ``--checkpoint-dir`` and ``--out``."""
    section = campaign[kind]
    every, delay = str(section["checkpoint_every"]), str(section.get("step_delay", 0.0))
    if kind == "heat":
        c = section["cases"][case or next(iter(section["cases"]))]
        return ["-m", "apps.heat", "--nx", str(c["nx"]), "--ny", str(c["ny"]), "--steps",
                str(c["steps"]), "--alpha", str(c["alpha"]), "--checkpoint-every", every,
                "--step-delay", delay]  # fmt: skip
    strategy = ["--strategy", str(section["strategy"])] if "strategy" in section else []
    return ["-m", f"apps.{kind}", "--steps", str(section["steps"]), *strategy,
            "--checkpoint-every", every, "--step-delay", delay]  # fmt: skip


def measure_startups(
    campaign: Mapping[str, Any], kinds: Mapping[str, int], where: Path
) -> dict[str, float]:
    """Each kind's start-up in seconds: one step of its program under ``resilient run`` (in
    ``where``), whose ledger records the launch to the first step (``startup_s``: MPI, the
    imports, torch.distributed's rendezvous, the restore). As the campaign runs them: side by
    side as many as the local profile's 4 ranks at a time allow."""
    groups: list[list[str]] = []
    for kind in kinds:
        fits = [g for g in groups if sum(kinds[k] for k in g) + kinds[kind] <= PROFILE_TASKS]
        if fits:
            fits[0].append(kind)
        else:
            groups.append([kind])
    took: dict[str, float] = {}
    policy = str(REPO / "configs/checkpoint/demo.yaml")
    for group in groups:
        t0 = time.monotonic()
        started = {}
        for k in group:
            argv = program_argv(campaign, k)
            argv[argv.index("--steps") + 1] = "1"
            ckpt = where / k
            cmd = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
                   "--task", f"{k} start-up", "--", find_mpiexec(), "-n", str(kinds[k]),
                   sys.executable, *argv, "--config", policy, "--checkpoint-dir", str(ckpt),
                   "--out", str(where / f"{k}.h5")]  # fmt: skip
            started[k] = subprocess.Popen(
                cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        for k, proc in started.items():
            proc.wait()
            ledger = read_ledger(where / k)
            startup = ledger[-1].get("startup_s") if ledger else None
            took[k] = float(startup) if isinstance(startup, (int, float)) else (
                time.monotonic() - t0  # no record: the whole run, by stopwatch
            )  # fmt: skip
    return took


def plan(
    campaign: Mapping[str, Any], walltime: float, startups: Mapping[str, float]
) -> dict[str, Timing]:
    """Each kind's walltime: the campaign's (``walltime``, at least the kind's
    ``min_walltime``), raised to :data:`STARTUPS` start-ups plus the stop margin where its
    measured start-up needs it; a raised one's step delay then spans :data:`STOPS`
    walltimes' compute (``steps`` steps)."""
    out: dict[str, Timing] = {}
    for kind, startup in startups.items():
        section = campaign[kind]
        delay = float(section.get("step_delay", 0.0))
        base = max(walltime, float(section.get("min_walltime", 0.0) or 0.0))
        need = round(STARTUPS * startup + STOP_MARGIN_S, 1)
        if need <= base:
            out[kind] = Timing(startup, base, delay)
            continue
        compute = need - startup - STOP_MARGIN_S  # per attempt, if it starts as measured
        steps = int(section["steps"]) if kind != "heat" else min(
            int(c["steps"]) for c in section["cases"].values()
        )  # fmt: skip
        slow = round(max(delay, STOPS * compute / steps), 3)
        out[kind] = Timing(startup, need, slow, raised=True)
    return out


def campaign_command(
    out: Path,
    walltime: float,
    ranks: int | None = None,
    timings: Mapping[str, Timing] | None = None,
) -> list[str]:
    """Snakemake over the campaign with the local profile; ``ranks``: every MPI task's rank
    count instead of the campaign's (Snakemake merges ``--config heat={ranks: N}`` into the
    campaign's ``heat`` section, key by key); ``timings``: the raised walltimes and step delays
    (:func:`plan`)."""
    cmd = [
        sys.executable, "-m", "snakemake", "--profile", str(REPO / "configs/profiles/local"),
        "-s", str(REPO / "workflows/Snakefile"), "--directory", str(out),
        # merged over the profile's config file (its signal, kill wait, checkpoint policy)
        "--config", f"resilient_walltime={walltime:g}",
    ]  # fmt: skip
    for task in MPI_TASKS:
        keys = {"ranks": f"{ranks}"} if ranks is not None else {}
        timing = (timings or {}).get(task)
        if timing is not None and timing.raised:
            keys |= {"min_walltime": f"{timing.walltime_s:g}", "step_delay": f"{timing.step_delay:g}"}
        if keys:
            cmd.append(f"{task}={{{', '.join(f'{k}: {v}' for k, v in keys.items())}}}")
    if ranks is not None and ranks > PROFILE_TASKS:  # one task's ranks would not fit the budget
        cmd += ["--resources", f"tasks={ranks}"]
    return cmd


def run_campaign(
    out: Path,
    walltime: float,
    ranks: int | None = None,
    timings: Mapping[str, Timing] | None = None,
) -> int:
    """Snakemake with the local profile, its progress lines echoed as they come."""
    cmd = campaign_command(out, walltime, ranks, timings)
    say("$ " + " ".join(cmd[2:]))
    log = (out / "snakemake.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        text = line.strip()
        attempt = text.startswith("resilient run [") and "]: attempt " in text
        if (
            attempt
            or text.startswith("Finished job")
            or (text.startswith("rule ") and text.endswith(":"))
        ):
            say("  " + text)
    log.close()
    return proc.wait()


def task_steps() -> dict[str, int]:
    """Steps each task of the campaign runs to, by task name (``heat/hot``, ``train``)."""
    import yaml

    campaign = yaml.safe_load((REPO / "configs/campaign.yaml").read_text())
    steps = {f"heat/{case}": int(c["steps"]) for case, c in campaign["heat"]["cases"].items()}
    steps["train"] = int(campaign["train"]["steps"])
    if campaign.get("train_torch"):
        steps["train_torch"] = int(campaign["train_torch"]["steps"])
    return steps


def explain_failure(out: Path) -> list[str]:
    """One line per task that did not finish: its attempts, the step it reached, the last
    attempt's reason and exit code (from the checkpoint roots' ledgers)."""
    steps = task_steps()
    lines, seen = [], set()
    for root in find_roots([out / "ckpt"]):
        rule, key = root.parent.name, root.name.rsplit("-", 1)[0]
        name = rule if key == rule else f"{rule}/{key}"
        seen.add(name)
        t = task_report(root, name=name)
        if t.finished:
            continue
        reached = max((a.latest_after for a in t.attempts if a.latest_after is not None),
                      default=None)  # fmt: skip
        of = f" of {steps[name]}" if name in steps else ""
        last = t.attempts[-1] if t.attempts else None
        why = f"; last: {last.reason} (exit {last.exit_code})" if last else ""
        lines.append(
            f"{name}: not finished after {len(t.attempts)} attempts ({t.stops} stops, "
            f"{t.kills} kills), newest valid checkpoint at step {reached}{of}{why}"
        )
    for name in sorted(set(steps) - seen):
        if name != "train_torch":
            lines.append(f"{name}: never started (see the errors in snakemake.log)")
    return lines


def run_reference(
    out: Path, ranks: int | None = None, timings: Mapping[str, Timing] | None = None
) -> dict[str, tuple[Path, float]]:
    """The campaign's programs, uninterrupted (no walltime; the same checkpoint policy, step
    delay and rank counts: ``ranks``, else the campaign's; ``timings``: the step delays the
    campaign ran with), side by side as in the campaign: each task's output and its wall
    time by stopwatch."""
    campaign = load_campaign()
    for kind, timing in (timings or {}).items():
        campaign[kind] = {**campaign[kind], "step_delay": timing.step_delay}
    ref = out / "reference"
    runs: dict[str, tuple[int, list[str], Path]] = {}
    for case in campaign["heat"]["cases"]:
        argv = program_argv(campaign, "heat", case)
        n = ranks or int(campaign["heat"]["ranks"])
        runs[f"heat/{case}"] = n, argv, ref / "heat" / f"{case}.h5"
    argv = program_argv(campaign, "train")
    runs["train"] = ranks or int(campaign["train"]["ranks"]), argv, ref / "train" / "model.h5"
    if "train_torch" in json.loads((out / "results" / "summary.json").read_text())["tasks"]:
        # the campaign ran the PyTorch task (train_torch.enabled, torch installed)
        argv = program_argv(campaign, "train_torch")
        n = ranks or int(campaign["train_torch"]["ranks"])
        runs["train_torch"] = n, argv, ref / "train_torch" / "model.h5"
    return _side_by_side(runs, str(REPO / "configs/checkpoint/demo.yaml"), ref / "ckpt")


def _side_by_side(
    runs: dict[str, tuple[int, list[str], Path]], policy: str, ckpt_root: Path
) -> dict[str, tuple[Path, float]]:
    """Start every program at once; each one's output and wall time by stopwatch."""
    started: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    for name, (n, argv, dest) in runs.items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        ckpt = ckpt_root / name.replace("/", "-")
        cmd = [find_mpiexec(), "-n", str(n), sys.executable, *argv, "--config", policy,
               "--checkpoint-dir", str(ckpt), "--out", str(dest)]  # fmt: skip
        started[name] = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    took: dict[str, float] = {}
    while len(took) < len(started):
        for name, proc in started.items():
            if name not in took and proc.poll() is not None:
                took[name] = time.monotonic() - t0
                if proc.returncode != 0:
                    raise subprocess.CalledProcessError(proc.returncode, proc.args)
        time.sleep(0.02)
    return {name: (runs[name][2], took[name]) for name in runs}


def dataset_bytes(path: Path) -> dict[str, bytes]:
    import h5py
    import numpy as np

    out: dict[str, bytes] = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda n, obj: (
                out.__setitem__(n, np.ascontiguousarray(obj[()]).tobytes())
                if isinstance(obj, h5py.Dataset)
                else None
            )
        )
    return out


def _ranks(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="output folder (default out/demo-TIME)")
    p.add_argument("--walltime", type=float, default=6.0, help="simulated walltime per attempt, s")
    p.add_argument(
        "--ranks",
        type=_ranks,
        default=None,
        metavar="N",
        help="MPI ranks of every task, in the campaign and its reference run (default the "
        "campaign's: 4 per heat case, 2 for train)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (REPO / "workflows" / "Snakefile").exists():
        raise SystemExit(
            "run the demo from a clone of the repository (workflows/Snakefile not found)"
        )
    out = (args.out or REPO / "out" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    campaign = load_campaign()
    startups = measure_startups(campaign, task_ranks(campaign, args.ranks), out / "startup")
    timings = plan(campaign, args.walltime, startups)
    say("start-up measured (launch to the first step, one step of each program): " + ", ".join(
        f"{kind} {timing.startup_s:.1f} s" for kind, timing in timings.items()
    ))  # fmt: skip
    for kind, timing in timings.items():
        if timing.raised:
            say(
                f"    {kind}: walltime {timing.walltime_s:g} s ({STARTUPS} start-ups and the "
                f"stop margin), a step every {timing.step_delay:g} s or slower: still stopped "
                "at least twice"
            )
    say(f"1/3 the campaign under Snakemake, each attempt cut short after {args.walltime:g} s")
    code = run_campaign(out, args.walltime, args.ranks, timings)
    if code != 0:
        say(f"snakemake failed (exit {code}); see {out / 'snakemake.log'}")
        for line in explain_failure(out):
            say("    " + line)
        say("FAILED")
        return 1
    say(f"    campaign done in {time.time() - t0:.0f} s")

    say("2/3 the same programs uninterrupted (the reference)")
    t1 = time.time()
    refs = run_reference(out, args.ranks, timings)
    say(f"    reference done in {time.time() - t1:.0f} s")

    say("3/3 report, plot and checks")
    summary = json.loads((out / "results" / "summary.json").read_text())["tasks"]
    roots = {task: out / info["checkpoint_dir"] for task, info in summary.items()}
    reports = [task_report(roots[task], name=task) for task in sorted(roots)]
    print()
    print(format_table(reports))
    print()
    (out / "report.txt").write_text(format_table(reports) + "\n")
    (out / "report.json").write_text(json.dumps([t.to_dict() for t in reports], indent=1))
    plot(reports, out / "progress.png")
    all_same = True
    for t in reports:
        ref_out, ref_s = refs[t.name]
        same = dataset_bytes(out / summary[t.name]["output"]) == dataset_bytes(ref_out)
        all_same &= same
        say(
            f"    {t.name:10} {t.stops} stops, {t.kills} kills; output bit-identical to the "
            f"uninterrupted run: {same}"
        )
        gp = f"{100 * t.goodput:.0f}%" if t.goodput is not None else "-"
        say(
            f"    {'':10} {t.wall_s:.1f} s from its first start to its end ({ref_s:.1f} s "
            f"uninterrupted: at most {100 * ref_s / t.wall_s:.0f}%); goodput {gp} (compute "
            f"kept {t.phases.compute_kept_s:.1f} s)"
        )
    stopped_twice = all(t.stops + t.kills >= 2 and t.finished for t in reports)
    stopped_twice &= len(reports) == len(refs)
    say(f"every task stopped (or killed) at least twice and finished: {stopped_twice}")
    say(f"report: {out / 'report.txt'}   plot: {out / 'progress.png'}")
    say(f"all files: {out}   (total {time.time() - t0:.0f} s)")
    if not (all_same and stopped_twice):
        say("FAILED")
        return 1
    say("DEMO OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
