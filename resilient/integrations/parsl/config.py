"""Parsl configs from YAML (``configs/parsl/*.yaml``): :func:`load_config`, :func:`build_config`.

Config schema (every key optional unless marked; unknown keys, keys of another ``kind`` and
wrong types raise :class:`~resilient.errors.ConfigError` naming the file and the key)::

    retries: 3                  # int >= 0: tries *without progress* tolerated after the first
    retry_handler: resume       # resume (resume_retry_handler()) | none (Parsl: every failure costs 1)
    run_dir: runinfo            # Parsl's run directory, relative to the working directory
    strategy: simple            # simple | htex_auto_scale | none
    strategy_period: 5          # seconds between scaling decisions (number > 0)
    executor:                   # required
      kind: htex                # required: htex (HighThroughputExecutor) | mpi (MPIExecutor)
      label: local              # default: the kind
      drain_period: null        # seconds after a block starts when its workers stop taking tasks
      heartbeat_threshold: 120  # seconds without heartbeat before ManagerLost / WorkerLost
      heartbeat_period: 30
      # kind htex only:
      max_workers_per_node: 2   # concurrent tasks per node (each task runs its own mpiexec)
      cores_per_worker: 1.0
      # kind mpi only:
      max_workers_per_block: 1  # concurrent MPI tasks per block
      mpi_launcher: srun        # srun | mpiexec | aprun: what $PARSL_MPI_PREFIX expands to
    provider:                   # required
      kind: local               # required: local (LocalProvider) | slurm (SlurmProvider)
      nodes_per_block: 1
      init_blocks: 1
      min_blocks: 0
      max_blocks: 1
      worker_init: ""           # shell lines run before the workers start
      launcher: single_node     # single_node | srun | simple (kind mpi needs simple, the default there)
      # kind slurm only:
      partition: debug
      account: null
      qos: null
      constraint: null
      cores_per_node: null      # int; not with executor kind mpi (Parsl#3006)
      mem_per_node: null        # int, GB
      walltime: "00:10:00"      # a string: quote it (YAML reads 1:00:00 as a number)
      exclusive: true
      scheduler_options: ""     # raw "#SBATCH ..." lines

The config uses :func:`~resilient.integrations.parsl.retry.resume_retry_handler` unless
``retry_handler: none``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import parsl

from resilient.config import load_yaml
from resilient.integrations.parsl.retry import resume_retry_handler
from resilient.model.schema import MISSING, Section

__all__ = ["build_config", "load_config"]

_TOP = {
    "retries",
    "retry_handler",
    "run_dir",
    "strategy",
    "strategy_period",
    "executor",
    "provider",
}
_EXECUTOR_COMMON = {"kind", "label", "drain_period", "heartbeat_threshold", "heartbeat_period"}
_EXECUTOR_ONLY = {
    "htex": {"max_workers_per_node", "cores_per_worker"},
    "mpi": {"max_workers_per_block", "mpi_launcher"},
}
_PROVIDER_COMMON = {
    "kind", "nodes_per_block", "init_blocks", "min_blocks", "max_blocks", "worker_init", "launcher",
}  # fmt: skip
_PROVIDER_ONLY = {
    "local": set[str](),
    "slurm": {
        "partition", "account", "qos", "constraint", "cores_per_node", "mem_per_node",
        "walltime", "exclusive", "scheduler_options",
    },
}  # fmt: skip
_LAUNCHERS = ("single_node", "srun", "simple")
_MPI_LAUNCHERS = ("srun", "mpiexec", "aprun")
_STRATEGIES = ("simple", "htex_auto_scale", "none")
_WALLTIME_RE = re.compile(r"^(?:\d+-)?\d+(?::\d{1,2}){0,2}$")


def _launcher(name: str) -> Any:
    from parsl.launchers import SimpleLauncher, SingleNodeLauncher, SrunLauncher

    if name == "simple":
        return SimpleLauncher()
    if name == "srun":
        return SrunLauncher()
    return SingleNodeLauncher()


def _provider(sec: Section, executor_kind: str) -> Any:
    from parsl.providers import LocalProvider, SlurmProvider

    kind = str(sec.choice("kind", tuple(_PROVIDER_ONLY), MISSING))
    sec.only(_PROVIDER_COMMON | _PROVIDER_ONLY[kind], other=_PROVIDER_ONLY, kind=kind)
    default_launcher = "simple" if executor_kind == "mpi" else "single_node"
    launcher = sec.choice("launcher", _LAUNCHERS, default_launcher)
    if executor_kind == "mpi" and launcher != "simple":
        raise sec.fail("launcher", f"executor kind 'mpi' needs launcher 'simple', got {launcher!r}")
    common: dict[str, Any] = {
        "nodes_per_block": sec.get("nodes_per_block", int, 1, minimum=1),
        "init_blocks": sec.get("init_blocks", int, 1, minimum=0),
        "min_blocks": sec.get("min_blocks", int, 0, minimum=0),
        "max_blocks": sec.get("max_blocks", int, 1, minimum=1),
        "worker_init": sec.get("worker_init", str, ""),
        "launcher": _launcher(str(launcher)),
    }
    if common["min_blocks"] > common["max_blocks"]:
        raise sec.fail("min_blocks", "larger than max_blocks")
    if kind == "local":
        return LocalProvider(**common)  # type: ignore[no-untyped-call]
    walltime = sec.get("walltime", str, "00:10:00")
    if not _WALLTIME_RE.match(walltime):
        raise sec.fail("walltime", f'a Slurm time such as "01:00:00", got {walltime!r}')
    cores = sec.get("cores_per_node", int, None, minimum=1)
    if cores is not None and executor_kind == "mpi":
        raise sec.fail("cores_per_node", "do not set it with executor kind 'mpi' (Parsl#3006)")
    return SlurmProvider(
        partition=sec.get("partition", str, None),
        account=sec.get("account", str, None),
        qos=sec.get("qos", str, None),
        constraint=sec.get("constraint", str, None),
        cores_per_node=cores,
        mem_per_node=sec.get("mem_per_node", int, None, minimum=1),
        walltime=walltime,
        exclusive=sec.get("exclusive", bool, True),
        scheduler_options=sec.get("scheduler_options", str, ""),
        **common,
    )


def _executor(sec: Section, provider_sec: Section) -> Any:
    from parsl.executors import HighThroughputExecutor, MPIExecutor

    kind = str(sec.choice("kind", tuple(_EXECUTOR_ONLY), MISSING))
    sec.only(_EXECUTOR_COMMON | _EXECUTOR_ONLY[kind], other=_EXECUTOR_ONLY, kind=kind)
    common: dict[str, Any] = {
        "label": sec.get("label", str, kind),
        "provider": _provider(provider_sec, kind),
        "drain_period": sec.get("drain_period", int, None, minimum=1),
        "heartbeat_threshold": sec.get("heartbeat_threshold", int, 120, minimum=1),
        "heartbeat_period": sec.get("heartbeat_period", int, 30, minimum=1),
    }
    if kind == "mpi":
        return MPIExecutor(
            max_workers_per_block=sec.get("max_workers_per_block", int, 1, minimum=1),
            mpi_launcher=str(sec.choice("mpi_launcher", _MPI_LAUNCHERS, "mpiexec")),
            **common,
        )
    workers = sec.get("max_workers_per_node", int, None, minimum=1)
    return HighThroughputExecutor(
        max_workers_per_node=workers,
        cores_per_worker=float(sec.get("cores_per_worker", (int, float), 1.0, minimum=1e-9)),
        **common,
    )


def build_config(doc: Any, *, where: str = "config") -> parsl.Config:
    """A ``parsl.Config`` from a parsed YAML mapping (schema in the module docstring).

    Constructs only: no block is submitted and no Slurm is needed until ``parsl.load``.

    Raises:
        ConfigError: unknown keys, keys of another kind, wrong types or values.
    """
    top = Section(doc, where=where)
    top.only(_TOP)
    retries = top.get("retries", int, 0, minimum=0)
    handler_name = top.choice("retry_handler", ("resume", "none"), "resume")
    run_dir = top.get("run_dir", str, "runinfo")
    if "strategy" in top and top.doc["strategy"] is None:
        strategy: str | None = None
    else:
        strategy = top.choice("strategy", _STRATEGIES, "simple")
        strategy = None if strategy == "none" else strategy
    period = float(top.get("strategy_period", (int, float), 5.0, minimum=0))
    if period <= 0:
        raise top.fail("strategy_period", "must be > 0")
    executor = _executor(top.section("executor"), top.section("provider"))
    return parsl.Config(
        executors=[executor],
        retries=retries,
        retry_handler=resume_retry_handler() if handler_name == "resume" else None,
        run_dir=run_dir,
        strategy=strategy,
        strategy_period=period,
    )


def load_config(path: str | os.PathLike[str]) -> parsl.Config:
    """Read a ``configs/parsl/*.yaml`` file into a ``parsl.Config`` (not loaded).

    Raises:
        ConfigError: unreadable file, bad YAML, unknown keys, wrong types or values; the
            message names the file and the key.
    """
    p = Path(path)
    doc = load_yaml(p)
    return build_config(doc if doc is not None else {}, where=str(p))
