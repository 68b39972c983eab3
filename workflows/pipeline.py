"""The example campaign (configs/campaign.yaml) as a Parsl workflow, resumable under walltime limits.

    python workflows/pipeline.py [--config configs/parsl/local.yaml] [--campaign configs/campaign.yaml]
                                 [--walltime SECONDS] [--results DIR] [--checkpoint-root DIR]
                                 [--checkpoint-config configs/checkpoint/demo.yaml]

One heat task per case, one train task and, when the campaign's ``train_torch.enabled`` is
true (``auto``: PyTorch is installed), one PyTorch DDP task (``apps.train_torch``), each a bash
app running ``resilient run -- mpiexec -n N python -m apps.<app> ...``
(workflows/campaign_apps.py, on the generic apps of :mod:`resilient.integrations.parsl`). Each
task
has its own checkpoint directory, keyed exactly as in workflows/Snakefile
(``<checkpoint_root>/heat/<case>-<12 hex>``, ``<checkpoint_root>/train/train-<12 hex>``, the hex a
hash of what determines the result: app, grid, steps, alpha, rank count, checkpoint layout), so
a changed parameter starts fresh, a rerun or a retry resumes, and a campaign started under one
engine resumes under the other. The Parsl config's
``resume_retry_handler`` makes a try that was cut short after committing a newer checkpoint
free, and sets the task's ``resume_from`` for the next try.

``--walltime`` (else the campaign's ``walltime``) simulates a walltime per try locally
(``resilient run --walltime``); without one, the Slurm job's own end time applies.

Prints one line per task (status, tries), writes ``<results>/parsl-summary.json`` and exits 1
if any task failed. Relative paths on the command line are taken from the current directory;
the tasks run in the repository root, and Parsl's run_dir is relative to it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from resilient.config import load_yaml
from resilient.errors import ConfigError
from resilient.integrations.snakemake import checkpoint_dir  # engine-neutral keying
from resilient.run import read_ledger
from resilient.schema import Section

REPO = Path(__file__).resolve().parent.parent

_CAMPAIGN_KEYS = {"results", "checkpoint_root", "walltime", "heat", "train", "train_torch"}
_HEAT_KEYS = {"ranks", "checkpoint_every", "step_delay", "cases"}
_CASE_KEYS = {"nx", "ny", "steps", "alpha"}
_TRAIN_KEYS = {"ranks", "steps", "checkpoint_every", "step_delay"}
_TORCH_KEYS = _TRAIN_KEYS | {"enabled", "min_walltime"}


@dataclass
class Task:
    """One task of the campaign."""

    name: str
    app: str  # "heat" | "train" | "train_torch"
    params: dict[str, Any]  # what determines the result (hashed into the checkpoint dir)
    options: dict[str, Any]  # cadence, slow-down: not hashed
    out: Path
    min_walltime: float = 0.0  # a simulated walltime per try is at least this
    checkpoint_dir: Path = field(init=False)
    future: Any = None

    def place(self, checkpoint_root: Path, layout: str | None = None) -> None:
        """Key the checkpoint directory exactly as workflows/Snakefile does, so that a campaign
        started under one engine resumes under the other. The rank count is not in the key of
        heat and train (their checkpoints restore on any rank count), only of train_torch."""
        p = self.params
        if self.app == "heat":
            case = self.name.removeprefix("heat-")
            keyed = {"app": "apps.heat", "nx": p["nx"], "ny": p["ny"],
                     "steps": p["steps"], "alpha": p["alpha"], "layout": layout}  # fmt: skip
            self.checkpoint_dir = Path(
                checkpoint_dir(checkpoint_root, "heat", {"case": case}, keyed)
            )
        else:  # "train" and "train_torch": ckpt/<app>/<app>-<hash>
            keyed = {"app": f"apps.{self.app}", "steps": p["steps"], "layout": layout}
            if self.app == "train_torch":  # per-rank RNG streams: no elastic restore
                keyed = {"app": keyed["app"], "ranks": p["ranks"], **keyed}
            self.checkpoint_dir = Path(checkpoint_dir(checkpoint_root, self.app, {}, keyed))


def torch_task_enabled(value: Any) -> bool:
    """The campaign's ``train_torch.enabled``: ``auto`` (PyTorch is installed here), true, false.

    Raises:
        ValueError: any other value.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return importlib.util.find_spec("torch") is not None
    if text in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return text in ("true", "yes", "on", "1")
    raise ValueError(f"expected auto, true or false, got {value!r}")


def load_campaign(
    path: Path, results: Path | None, checkpoint_root: Path | None, layout: str | None = None
) -> tuple[list[Task], Path, Path, Any]:
    """(tasks, results dir, checkpoint root, campaign walltime) from ``configs/campaign.yaml``."""
    top = Section(load_yaml(path), where=str(path)).only(_CAMPAIGN_KEYS)
    results = results or REPO / str(top.get("results", str, "results"))
    ckroot = checkpoint_root or REPO / str(top.get("checkpoint_root", str, "ckpt"))
    tasks = []
    heat = top.optional_section("heat")
    if heat is not None:
        heat.only(_HEAT_KEYS)
        ranks = heat.require("ranks", int, minimum=1)
        options = {
            "checkpoint_every": heat.require("checkpoint_every", int, minimum=1),
            "step_delay": float(heat.get("step_delay", (int, float), 0.0)),
        }
        cases = heat.optional_section("cases") or Section({}, where=str(path), path="heat.cases")
        for case in cases:
            spec = cases.section(case).only(_CASE_KEYS)
            params = {
                "nx": spec.require("nx", int, minimum=1),
                "ny": spec.require("ny", int, minimum=1),
                "steps": spec.require("steps", int, minimum=0),
                "alpha": float(spec.require("alpha", (int, float))),
                "ranks": ranks,
            }
            out = results / "heat" / f"{case}.h5"
            tasks.append(Task(f"heat-{case}", "heat", params, options, out))
    train = top.optional_section("train")
    if train is not None:
        train.only(_TRAIN_KEYS)
        params = {
            "steps": train.require("steps", int, minimum=0),
            "ranks": train.require("ranks", int, minimum=1),
        }
        options = {
            "checkpoint_every": train.require("checkpoint_every", int, minimum=1),
            "step_delay": float(train.get("step_delay", (int, float), 0.0)),
        }
        tasks.append(Task("train", "train", params, options, results / "train" / "model.h5"))
    torch_task = top.optional_section("train_torch")
    if torch_task is not None:
        torch_task.only(_TORCH_KEYS)
        try:
            enabled = torch_task_enabled(torch_task.get("enabled", (str, bool), "auto"))
        except ValueError as exc:
            raise torch_task.fail("enabled", str(exc)) from None
        if enabled:
            params = {
                "steps": torch_task.require("steps", int, minimum=0),
                "ranks": torch_task.require("ranks", int, minimum=1),
            }
            options = {
                "checkpoint_every": torch_task.require("checkpoint_every", int, minimum=1),
                "step_delay": float(torch_task.get("step_delay", (int, float), 0.0)),
            }
            min_walltime = float(torch_task.get("min_walltime", (int, float), 0.0, minimum=0))
            out = results / "train_torch" / "model.h5"
            tasks.append(Task("train_torch", "train_torch", params, options, out, min_walltime))
    for task in tasks:
        task.place(ckroot, layout)
    return tasks, results, ckroot, top.doc.get("walltime")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--config", type=Path, default=REPO / "configs/parsl/local.yaml", help="Parsl config YAML"
    )
    p.add_argument(
        "--campaign", type=Path, default=REPO / "configs/campaign.yaml", help="campaign YAML"
    )
    p.add_argument(
        "--walltime",
        type=float,
        help="simulated walltime per try, seconds (overrides the campaign)",
    )
    p.add_argument("--results", type=Path, help="results directory (overrides the campaign)")
    p.add_argument("--checkpoint-root", type=Path, help="checkpoint root (overrides the campaign)")
    p.add_argument(
        "--checkpoint-config",
        type=Path,
        default=REPO / "configs/checkpoint/demo.yaml",
        help="checkpoint policy passed to the apps (default: the demo's, a 2 s stop margin that "
        "suits short simulated walltimes)",
    )
    return p.parse_args(argv)


def _absolute(path: Path | None) -> Path | None:
    return None if path is None else path.resolve()


def _fmt_cost(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config_path, campaign_path = args.config.resolve(), args.campaign.resolve()
    policy = args.checkpoint_config.resolve()
    try:
        layout = (yaml.safe_load(policy.read_text()) or {}).get("checkpoint_comm")
        tasks, results, ckroot, campaign_walltime = load_campaign(
            campaign_path, _absolute(args.results), _absolute(args.checkpoint_root), layout
        )
    except ConfigError as exc:
        print(f"pipeline: {exc}", file=sys.stderr)
        return 2
    walltime = args.walltime if args.walltime is not None else campaign_walltime
    if walltime is not None and (
        isinstance(walltime, bool) or not isinstance(walltime, (int, float))
    ):
        print(
            f"pipeline: {campaign_path}: walltime: expected seconds or null, got {walltime!r}",
            file=sys.stderr,
        )
        return 2

    os.chdir(REPO)  # the tasks run here; a relative Parsl run_dir lands here too
    import parsl
    from campaign_apps import CampaignApps  # next to this script

    from resilient.integrations.parsl import load_config

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"pipeline: {exc}", file=sys.stderr)
        return 2

    decisions = logging.getLogger("resilient.integrations.parsl")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("retry: %(message)s"))
    decisions.addHandler(handler)
    decisions.setLevel(logging.INFO)
    decisions.propagate = False

    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.time()
    print(f"parsl config {config_path}, campaign {campaign_path}, walltime {walltime} s per try")
    print(
        f"checkpoints under {ckroot}, results in {results}, Parsl run_dir {Path(config.run_dir).resolve()}"
    )
    dfk = parsl.load(config)
    try:
        apps = CampaignApps(cwd=REPO)
        for t in tasks:
            t.out.parent.mkdir(parents=True, exist_ok=True)
            common = {
                "checkpoint_dir": str(t.checkpoint_dir),
                "out": str(t.out),
                "config": str(policy),
                "walltime_s": None if walltime is None else max(walltime, t.min_walltime),
                "stdout": str(logs / f"{t.name}.out"),
                "stderr": str(logs / f"{t.name}.err"),
                **t.options,
            }
            t.future = apps.submit(t.app, **t.params, **common)
            print(f"submitted {t.name}: {t.checkpoint_dir}")
        wait([t.future for t in tasks])  # failures are reported below, from the task records
    finally:
        rows = [summarise(t, since=start) for t in tasks]
        dfk.cleanup()

    ok = all(r["status"] in ("exec_done", "memo_done") for r in rows)
    print()
    print(f"{'task':<12} {'status':<10} {'tries':>5} {'retry cost':>10}  ledger exits   output")
    for r in rows:
        print(
            f"{r['task']:<12} {r['status']:<10} {r['tries']:>5} {r['fail_cost']!s:>10}  "
            f"{','.join(map(str, r['ledger_exits'])):<14} {r['out'] if r['error'] is None else r['error']}"
        )
    summary = {
        "ok": ok,
        "elapsed_s": round(time.time() - start, 1),
        "config": str(config_path),
        "campaign": str(campaign_path),
        "walltime_s": walltime,
        "tasks": rows,
    }
    path = results / "parsl-summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\n{'all tasks done' if ok else 'some tasks FAILED'} in {summary['elapsed_s']} s; wrote {path}"
    )
    return 0 if ok else 1


def summarise(t: Task, *, since: float) -> dict[str, Any]:
    """One task's status, tries and this run's ledger lines (attempts started after ``since``)."""
    fut = t.future
    rec = fut.task_record if fut is not None else {}
    error = None
    if fut is not None and fut.done():
        exc = fut.exception()
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
    status = rec.get("status")
    return {
        "task": t.name,
        "app": t.app,
        "params": t.params,
        "checkpoint_dir": str(t.checkpoint_dir),
        "out": str(t.out),
        "status": status.name if status is not None else "not submitted",
        "tries": rec.get("try_id", -1) + 1,
        "fail_count": rec.get("fail_count", 0),
        "fail_cost": _fmt_cost(float(rec.get("fail_cost", 0))),
        "resume_from": rec.get("kwargs", {}).get("resume_from"),
        "ledger_exits": [
            r.get("exit_code")
            for r in read_ledger(t.checkpoint_dir)
            if float(r.get("start", 0)) >= since
        ],
        "error": error,
    }


if __name__ == "__main__":
    sys.exit(main())
