"""The example campaign (configs/campaign.yaml) as a Parsl workflow, resumable under walltime limits.

    python workflows/pipeline.py [--config configs/parsl/local.yaml] [--campaign configs/campaign.yaml]
                                 [--walltime SECONDS] [--results DIR] [--checkpoint-root DIR]
                                 [--checkpoint-config configs/checkpoint/demo.yaml]

Plain Parsl apps (workflows/parsl_apps.py). Each heat case is a three-stage DAG: ``prepare``
writes the case's parameters (``<results>/heat/<case>.json``), ``simulate`` runs ``apps.heat``
on them through ``resilient run`` (``inputs=[that File]``, ``outputs=[<case>.h5]``), and
``analyse`` summarises the field (``<case>-summary.json``). ``train`` and, when the campaign's
``train_torch.enabled`` is true (``auto``: PyTorch is installed), ``train_torch`` are single
resumable apps. Each resumable task has its own checkpoint directory, keyed exactly as in
workflows/Snakefile by :func:`resilient.workflow.checkpoint_dir`
(``<checkpoint_root>/heat/<case>-<12 hex>``, ``<checkpoint_root>/train/train-<12 hex>``), so a
changed parameter starts fresh, a rerun or a retry resumes, and a campaign started under one
engine resumes under the other.

The Parsl config is a Python ``Config`` (:func:`local_config` by default; :func:`main` takes
one) or a YAML file (``--config``, :func:`resilient.integrations.parsl.load_config`). Its
``resume_retry_handler`` makes a try that was cut short after committing a newer checkpoint
free. On an ``MPIExecutor`` the ranks are started by ``$PARSL_MPI_PREFIX``, else by
``mpiexec -n N``.

``--walltime`` (else the campaign's ``walltime``) simulates a walltime per try locally
(``resilient run --walltime``); without one, the Slurm job's own end time applies.

Prints one line per task (status, tries), writes ``<results>/parsl-summary.json`` and exits 1
if any task failed. Relative paths on the command line are taken from the current directory;
the tasks run in the repository root, and a relative Parsl run_dir is relative to it.
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
from typing import TYPE_CHECKING, Any

import yaml

from resilient.config import load_yaml
from resilient.errors import ConfigError
from resilient.job.ledger import read_ledger
from resilient.model.schema import Section
from resilient.workflow import checkpoint_dir

if TYPE_CHECKING:
    from parsl.config import Config

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: workflows.parsl_apps and resilient from here
    sys.path.insert(0, str(REPO))

_CAMPAIGN_KEYS = {"results", "checkpoint_root", "walltime", "heat", "train", "train_torch"}
_HEAT_KEYS = {"ranks", "checkpoint_every", "step_delay", "cases"}
_CASE_KEYS = {"nx", "ny", "steps", "alpha"}
_TRAIN_KEYS = {"ranks", "steps", "checkpoint_every", "step_delay"}
_TORCH_KEYS = _TRAIN_KEYS | {"enabled", "min_walltime", "strategy"}
_TORCH_STRATEGIES = ("ddp", "fsdp2")  # apps.train_torch --strategy


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
    future: Any = None  # the resumable app's AppFuture
    analysis: Any = None  # heat: the analyse app's AppFuture

    def place(self, checkpoint_root: Path, layout: str | None = None) -> None:
        """Key the checkpoint directory exactly as workflows/Snakefile does, so that a campaign
        started under one engine resumes under the other. The rank count is not in the key of
        heat and train (their checkpoints restore on any rank count), only of train_torch, whose
        key has its strategy too."""
        p = self.params
        if self.app == "heat":
            case = self.name.removeprefix("heat-")
            keyed = {"app": "apps.heat", "nx": p["nx"], "ny": p["ny"],
                     "steps": p["steps"], "alpha": p["alpha"], "layout": layout}  # fmt: skip
            self.checkpoint_dir = Path(
                checkpoint_dir(checkpoint_root, "heat", keyed, wildcards={"case": case})
            )
        else:  # "train" and "train_torch": ckpt/<app>/<app>-<hash>
            keyed = {"app": f"apps.{self.app}", "steps": p["steps"], "layout": layout}
            if self.app == "train_torch":  # per-rank RNG streams: no elastic restore
                keyed = {**keyed, "ranks": p["ranks"], "strategy": p["strategy"]}
            self.checkpoint_dir = Path(checkpoint_dir(checkpoint_root, self.app, keyed))


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
                "strategy": torch_task.get("strategy", str, "ddp"),
            }
            if params["strategy"] not in _TORCH_STRATEGIES:
                raise torch_task.fail(
                    "strategy", f"expected ddp or fsdp2, got {params['strategy']!r}"
                )
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
        "--config", type=Path, help="Parsl config YAML (default: local_config(), built in Python)"
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


def local_config(run_dir: str | os.PathLike[str] = REPO / "runinfo") -> Config:
    """This machine: one HighThroughputExecutor block on the local host, two workers, retries 2
    (tries *without* progress tolerated after the first), resume_retry_handler."""
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.providers import LocalProvider

    from resilient.integrations.parsl import resume_retry_handler

    executor = HighThroughputExecutor(
        label="local",
        max_workers_per_node=2,
        cores_per_worker=1,
        provider=LocalProvider(init_blocks=1, min_blocks=0, max_blocks=1),
    )
    return Config(
        executors=[executor],
        retries=2,
        retry_handler=resume_retry_handler(),
        run_dir=os.fspath(run_dir),
        strategy_period=1,
    )


def uses_mpi_executor(config: Config) -> bool:
    """Whether the config's executors are MPIExecutors (ranks from ``$PARSL_MPI_PREFIX``)."""
    from parsl.executors import MPIExecutor

    return bool(config.executors) and all(isinstance(e, MPIExecutor) for e in config.executors)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tries:
    """How every try of the campaign's resumable apps runs (``resilient run`` and the apps)."""

    policy: Path  # the checkpoint policy YAML
    walltime_s: float | None  # simulated walltime per try, or None
    mpi: bool  # ranks from $PARSL_MPI_PREFIX (MPIExecutor), else mpiexec -n
    logs: Path  # <task>.out / <task>.err


def submit(task: Task, tries: Tries) -> None:
    """Submit one campaign task: the heat DAG (prepare -> simulate -> analyse) or a train app."""
    from parsl import File

    from workflows.parsl_apps import analyse, mpi_resources, prepare, simulate, train

    ranks = int(task.params["ranks"])
    common: dict[str, Any] = {
        "ranks": ranks,
        "policy": str(tries.policy),
        "walltime_s": None
        if tries.walltime_s is None
        else max(tries.walltime_s, task.min_walltime),
        "stdout": str(tries.logs / f"{task.name}.out"),
        "stderr": str(tries.logs / f"{task.name}.err"),
        **task.options,
    }
    if tries.mpi:
        common["parsl_resource_specification"] = mpi_resources(ranks)
    task.out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = str(task.checkpoint_dir)
    if task.app != "heat":
        steps = int(task.params["steps"])
        task.future = train(
            f"apps.{task.app}", ckpt, steps=steps, strategy=task.params.get("strategy"),
            outputs=[File(str(task.out))], **common,
        )  # fmt: skip
        return
    case = {k: task.params[k] for k in ("nx", "ny", "steps", "alpha")}
    prepared = prepare(case, outputs=[File(str(task.out.with_suffix(".json")))])
    task.future = simulate(
        ckpt, inputs=[prepared.outputs[0]], outputs=[File(str(task.out))], **common
    )
    summary = task.out.with_name(f"{task.out.stem}-summary.json")
    task.analysis = analyse(inputs=[task.future.outputs[0]], outputs=[File(str(summary))])


def _absolute(path: Path | None) -> Path | None:
    return None if path is None else path.resolve()


def _fmt_cost(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def _log_decisions() -> None:
    """Print the retry handler's decisions to stderr too (``retry: resilient: task ...``);
    they still reach ``parsl.log`` through Parsl's ``parsl`` logger."""
    decisions = logging.getLogger("parsl.resilient")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("retry: %(message)s"))
    decisions.addHandler(handler)
    decisions.setLevel(logging.INFO)


def main(argv: list[str] | None = None, *, config: Config | None = None) -> int:
    """Run the campaign under ``config`` (else ``--config`` YAML, else :func:`local_config`)."""
    args = parse_args(argv)
    campaign_path, policy = args.campaign.resolve(), args.checkpoint_config.resolve()
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

    config_path = None if args.config is None else args.config.resolve()
    os.chdir(REPO)  # the tasks run here; a relative Parsl run_dir lands here too
    # workers import workflows.parsl_apps: put the repository on their PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    import parsl

    from resilient.integrations.parsl import load_config

    if config is None:
        try:
            config = local_config() if config_path is None else load_config(config_path)
        except ConfigError as exc:
            print(f"pipeline: {exc}", file=sys.stderr)
            return 2
    _log_decisions()
    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tries = Tries(policy=policy, walltime_s=walltime, mpi=uses_mpi_executor(config), logs=logs)
    start = time.time()
    print(
        f"parsl config {config_path or 'local_config()'}, campaign {campaign_path}, "
        f"walltime {walltime} s per try"
    )
    print(
        f"checkpoints under {ckroot}, results in {results}, Parsl run_dir {Path(config.run_dir).resolve()}"
    )
    dfk = parsl.load(config)
    try:
        for t in tasks:
            submit(t, tries)
            print(f"submitted {t.name}: {t.checkpoint_dir}")
        futures = [f for t in tasks for f in (t.future, t.analysis) if f is not None]
        wait(futures)  # failures are reported below, from the task records
    finally:
        rows = [summarise(t, since=start) for t in tasks]
        dfk.cleanup()
    return report(
        rows, results, since=start, config=config_path, campaign=campaign_path, walltime=walltime
    )


def report(
    rows: list[dict[str, Any]],
    results: Path,
    *,
    since: float,
    config: Path | None,
    campaign: Path,
    walltime: float | None,
) -> int:
    """Print the table, write ``<results>/parsl-summary.json``; 0 if every task finished."""
    ok = all(r["status"] in ("exec_done", "memo_done") and r["error"] is None for r in rows)
    print()
    print(f"{'task':<12} {'status':<10} {'tries':>5} {'retry cost':>10}  ledger exits   output")
    for r in rows:
        print(
            f"{r['task']:<12} {r['status']:<10} {r['tries']:>5} {r['fail_cost']!s:>10}  "
            f"{','.join(map(str, r['ledger_exits'])):<14} {r['out'] if r['error'] is None else r['error']}"
        )
    summary = {
        "ok": ok,
        "elapsed_s": round(time.time() - since, 1),
        "config": str(config) if config is not None else "local_config()",
        "campaign": str(campaign),
        "walltime_s": walltime,
        "tasks": rows,
    }
    path = results / "parsl-summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\n{'all tasks done' if ok else 'some tasks FAILED'} in {summary['elapsed_s']} s; wrote {path}"
    )
    return 0 if ok else 1


def _error(fut: Any) -> str | None:
    if fut is None or not fut.done():
        return None if fut is None else "not done"
    exc = fut.exception()
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def summarise(t: Task, *, since: float) -> dict[str, Any]:
    """One task's status, tries and this run's ledger lines (attempts started after ``since``);
    for heat, also the analysis (its summary, or its error)."""
    fut = t.future
    rec = fut.task_record if fut is not None else {}
    status = rec.get("status")
    row: dict[str, Any] = {
        "task": t.name,
        "app": t.app,
        "params": t.params,
        "checkpoint_dir": str(t.checkpoint_dir),
        "out": str(t.out),
        "status": status.name if status is not None else "not submitted",
        "tries": rec.get("try_id", -1) + 1,
        "fail_count": rec.get("fail_count", 0),
        "fail_cost": _fmt_cost(float(rec.get("fail_cost", 0))),
        "ledger_exits": [
            r.get("exit_code")
            for r in read_ledger(t.checkpoint_dir)
            if float(r.get("start", 0)) >= since
        ],
        "error": _error(fut),
    }
    if t.analysis is not None:
        error = _error(t.analysis)
        row["analysis"] = {"error": error} if error else t.analysis.result()
        row["error"] = row["error"] or (f"analysis: {error}" if error else None)
    return row


if __name__ == "__main__":
    sys.exit(main())
