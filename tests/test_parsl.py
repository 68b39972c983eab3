"""Parsl integration: config loading, the resume-aware retry handler, and real Parsl runs.

The end-to-end tests run a real DataFlowKernel (HighThroughputExecutor + LocalProvider, run
directory under tmp) with real MPI ranks: a heat task cut short by a simulated walltime on
every try that still completes bit-identically at no retry cost, and tasks that never make
progress, which stop after a bounded number of tries with exit 93.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.errors import ConfigError
from resilient.run import read_ledger
from tests.mpirun import REPO, clean_env, mpiexec

parsl = pytest.importorskip("parsl")

from parsl.app.errors import BashExitFailure  # noqa: E402
from parsl.executors import HighThroughputExecutor, MPIExecutor  # noqa: E402
from parsl.executors.high_throughput.errors import ManagerLost, WorkerLost  # noqa: E402
from parsl.launchers import SimpleLauncher  # noqa: E402
from parsl.providers import LocalProvider, SlurmProvider  # noqa: E402

from resilient.integrations.parsl import (  # noqa: E402
    Launch,
    ResumableCommandError,
    RunOptions,
    load_config,
    resilient_command,
    resumable_apps,
    resumable_bash,
    resumable_mpi_bash,
    resume_retry_handler,
)
from workflows.campaign_apps import CampaignApps, heat_args  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]

CONFIGS = sorted((REPO / "configs" / "parsl").glob("*.yaml"))


# --------------------------------------------------------------------------- config loading


def test_every_config_loads() -> None:
    assert {p.name for p in CONFIGS} >= {"local.yaml", "slurm.yaml", "mpi.yaml"}
    for path in CONFIGS:
        cfg = load_config(path)
        assert isinstance(cfg, parsl.Config), path
        assert cfg.retry_handler is not None, path
        assert len(cfg.executors) == 1, path


def test_config_contents() -> None:
    local = load_config(REPO / "configs/parsl/local.yaml")
    (ex,) = local.executors
    assert isinstance(ex, HighThroughputExecutor) and not isinstance(ex, MPIExecutor)
    assert ex.max_workers_per_node == 2
    assert isinstance(ex.provider, LocalProvider)

    slurm = load_config(REPO / "configs/parsl/slurm.yaml")
    (ex,) = slurm.executors
    assert isinstance(ex, HighThroughputExecutor)
    assert isinstance(ex.provider, SlurmProvider)
    assert ex.provider.walltime == "00:01:00"
    assert ex.provider.exclusive is False
    assert ex.provider.partition == "debug"
    assert "activate" in ex.provider.worker_init

    mpi = load_config(REPO / "configs/parsl/mpi.yaml")
    (ex,) = mpi.executors
    assert isinstance(ex, MPIExecutor)
    assert ex.mpi_launcher == "srun"
    assert isinstance(ex.provider, SlurmProvider)
    assert isinstance(ex.provider.launcher, SimpleLauncher)


BASE = """
retries: 1
executor: {kind: htex, max_workers_per_node: 1}
provider: {kind: local}
"""


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("retires: 2\n" + BASE, "retires"),
        ("retries: '3'\nexecutor: {kind: htex}\nprovider: {kind: local}\n", "retries"),
        ("retries: true\nexecutor: {kind: htex}\nprovider: {kind: local}\n", "retries"),
        ("retry_handler: maybe\nexecutor: {kind: htex}\nprovider: {kind: local}\n", "retry_handler"),
        ("strategy: fast\nexecutor: {kind: htex}\nprovider: {kind: local}\n", "strategy"),
        ("executor: {kind: htex, bogus: 1}\nprovider: {kind: local}\n", "executor.bogus"),
        ("executor: {kind: htex, max_workers_per_node: two}\nprovider: {kind: local}\n",
         "executor.max_workers_per_node"),
        ("executor: {kind: htex, mpi_launcher: srun}\nprovider: {kind: local}\n", "executor.mpi_launcher"),
        ("executor: {kind: mpi, max_workers_per_node: 2}\nprovider: {kind: local, launcher: simple}\n",
         "executor.max_workers_per_node"),
        ("executor: {kind: dask}\nprovider: {kind: local}\n", "executor.kind"),
        ("executor: {kind: htex}\nprovider: {kind: local, partitionn: debug}\n", "provider.partitionn"),
        ("executor: {kind: htex}\nprovider: {kind: local, partition: debug}\n", "provider.partition"),
        ("executor: {kind: htex}\nprovider: {kind: slurm, walltime: 3600}\n", "provider.walltime"),
        ("executor: {kind: htex}\nprovider: {kind: slurm, exclusive: 'no'}\n", "provider.exclusive"),
        ("executor: {kind: htex}\nprovider: {kind: slurm, launcher: mpirun}\n", "provider.launcher"),
        ("executor: {kind: htex}\nprovider: {kind: slurm, max_blocks: 0}\n", "provider.max_blocks"),
        ("executor: {kind: mpi}\nprovider: {kind: slurm, launcher: srun}\n", "provider.launcher"),
        ("executor: {kind: mpi}\nprovider: {kind: slurm, cores_per_node: 8}\n", "provider.cores_per_node"),
        ("executor: {kind: htex}\n", "provider"),
        ("executor: [htex]\nprovider: {kind: local}\n", "executor"),
        ("- just\n- a list\n", "top level"),
    ],
)  # fmt: skip
def test_bad_config_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert key in message


def test_config_options(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "retries: 4\nretry_handler: none\nrun_dir: /tmp/x\nstrategy: none\nstrategy_period: 0.5\n"
        "executor: {kind: htex, label: a, drain_period: 600, cores_per_worker: 2}\n"
        "provider: {kind: slurm, walltime: '1-00:00:00', mem_per_node: 16, launcher: srun}\n"
    )
    cfg = load_config(path)
    assert cfg.retries == 4 and cfg.retry_handler is None
    assert cfg.run_dir == "/tmp/x" and cfg.strategy is None and cfg.strategy_period == 0.5
    (ex,) = cfg.executors
    assert isinstance(ex, HighThroughputExecutor)
    assert ex.label == "a" and ex.drain_period == 600 and ex.cores_per_worker == 2.0
    assert isinstance(ex.provider, SlurmProvider)
    assert ex.provider.walltime == "1-00:00:00" and ex.provider.mem_per_node == 16
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("executor: {kind: htex\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


# --------------------------------------------------------------------------- handler


def save(root: Path, step: int) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(step, {"x": np.arange(3)})


def record(root: Path | None, **kwargs: Any) -> Any:  # a TaskRecord (a TypedDict) in the tests
    kw: dict[str, Any] = dict(kwargs)
    if root is not None:
        kw.setdefault("checkpoint_dir", str(root))
    return {"id": 7, "try_id": 0, "fail_count": 1, "fail_cost": 0, "kwargs": kw}


def step_path(root: Path, step: int) -> str:
    return str(root / f"step_{step:08d}")


def test_handler_costs_by_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="resilient.integrations.parsl")
    root = tmp_path / "ck"
    handler = resume_retry_handler()
    tr = record(root, resume_from=None)

    # nothing on disk yet: no progress
    assert handler(BashExitFailure("heat", 75), tr) == 1
    assert tr["kwargs"]["resume_from"] is None

    save(root, 10)  # the try committed step 10, then was cut short (exit 75)
    assert handler(BashExitFailure("heat", 75), tr) == 0
    assert tr["kwargs"]["resume_from"] == step_path(root, 10)

    # a crash without a newer checkpoint costs 1, and resume_from stays
    assert handler(BashExitFailure("heat", 1), tr) == 1
    assert tr["kwargs"]["resume_from"] == step_path(root, 10)

    save(root, 20)  # a lost manager (walltime of the block) after progress is free
    assert handler(ManagerLost(b"abc", "node1"), tr) == 0
    assert tr["kwargs"]["resume_from"] == step_path(root, 20)
    assert handler(WorkerLost(3, "node1"), tr) == 1  # type: ignore[no-untyped-call]  # ... without progress it is not

    save(root, 30)  # a crash after progress is free too
    assert handler(BashExitFailure("heat", 139), tr) == 0

    save(root, 40)  # 93 and 74 stop at once, progress or not
    assert handler(BashExitFailure("heat", 93), tr) == math.inf
    assert handler(BashExitFailure("heat", 74), tr) == math.inf
    assert tr["kwargs"]["resume_from"] == step_path(root, 40)

    lines = [r.getMessage() for r in caplog.records if r.name == "resilient.integrations.parsl"]
    assert len(lines) == 8
    assert "cost 0" in lines[1] and "10" in lines[1] and "exit 75" in lines[1]
    assert "ManagerLost" in lines[3]


def test_handler_falls_back_to_an_older_valid_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    save(root, 10)
    save(root, 20)
    (root / "step_00000020" / "COMMITTED").unlink()  # the newest one is torn
    tr = record(root, resume_from=step_path(root, 10))
    assert resume_retry_handler()(ManagerLost(b"m", "h"), tr) == 1
    assert tr["kwargs"]["resume_from"] == step_path(root, 10)


def test_handler_options_and_missing_keywords(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    save(root, 5)
    handler = resume_retry_handler(
        checkpoint_kwarg="ckpt", resume_kwarg="restart", walltime_cost=0.25, failure_cost=2
    )
    tr = record(None, ckpt=str(root), restart=None)
    assert handler(ManagerLost(b"m", "h"), tr) == 0.25
    assert tr["kwargs"]["restart"] == step_path(root, 5)
    assert handler(ManagerLost(b"m", "h"), tr) == 2

    # no resume keyword: the handler remembers the step itself and injects nothing
    tr = record(root)
    handler = resume_retry_handler()
    assert handler(BashExitFailure("x", 75), tr) == 0
    assert handler(BashExitFailure("x", 75), tr) == 1
    assert "resume_from" not in tr["kwargs"]

    # no checkpoint dir at all: a plain failure, but 93 still stops
    assert handler(ValueError("boom"), record(None)) == 1
    assert handler(BashExitFailure("x", 93), record(None)) == math.inf


def test_resumable_command_error_pickles_and_is_classified(tmp_path: Path) -> None:
    err = pickle.loads(pickle.dumps(ResumableCommandError(93, ["a", "b c"], "tail")))
    assert err.exitcode == 93 and err.command == ["a", "b c"] and "b c" in str(err)
    root = tmp_path / "ck"
    save(root, 3)
    assert resume_retry_handler()(err, record(root, resume_from=None)) == math.inf
    tr = record(root, resume_from=None)
    assert resume_retry_handler()(ResumableCommandError(75), tr) == 0


# --------------------------------------------------------------------------- commands


def test_resilient_command_quotes_and_prefix(tmp_path: Path) -> None:
    ck = tmp_path / "a dir"
    cmd = resilient_command(
        ["prog", "x y"],
        checkpoint_dir=ck,
        run=RunOptions(walltime_s=2.5, max_no_progress=2, extra=("--kill-wait", "1")),
    )
    argv = shlex.split(cmd)
    assert argv[:4] == [sys.executable, "-m", "resilient.cli", "run"]
    assert argv[argv.index("--checkpoint-dir") + 1] == str(ck)
    assert argv[argv.index("--walltime") + 1] == "2.5"
    assert argv[argv.index("--max-no-progress") + 1] == "2"
    assert argv[argv.index("--") :] == ["--", "prog", "x y"]

    cmd = resilient_command(["prog"], checkpoint_dir=ck, launcher_prefix="$PARSL_MPI_PREFIX")
    assert " -- $PARSL_MPI_PREFIX prog" in cmd
    echo = subprocess.run(
        ["bash", "-c", "echo " + cmd], env={"PARSL_MPI_PREFIX": "srun -n 4"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "-- srun -n 4 prog" in echo


def test_app_commands() -> None:
    args = heat_args(nx=8, ny=8, steps=5, out="/o.h5", checkpoint_dir="/ck")
    common: dict[str, Any] = dict(
        module="apps.heat", args=args, checkpoint_dir="/ck", cwd="/repo dir"
    )
    cmd = resumable_bash(
        launch=Launch(launcher="mpiexec", ranks=3), resume_from="/ck/step_00000010", **common
    )
    assert cmd.startswith("cd '/repo dir' && export PYTHONPATH='/repo dir'")
    assert "resume_from=/ck/step_00000010" in cmd
    assert f"-- {mpiexec()} -n 3 {sys.executable} -m apps.heat --nx 8" in cmd
    cmd = resumable_mpi_bash(parsl_resource_specification={"num_ranks": 2}, **common)
    assert f"-- $PARSL_MPI_PREFIX {sys.executable} -m apps.heat --nx 8" in cmd
    assert "resume_from=none" in cmd
    srun = resumable_bash(
        command=["./sim", "-x"], launch=Launch(launcher="srun", ranks=64), checkpoint_dir="/ck"
    )
    assert shlex.split(srun.rsplit("exec ", 1)[1])[-6:] == ["--", "srun", "-n", "64", "./sim", "-x"]
    direct = resumable_bash(command=["./sim"], checkpoint_dir="/ck")
    assert direct.endswith("-- ./sim")
    with pytest.raises(ValueError, match="either command"):
        resumable_bash(command=["./sim"], module="apps.heat", checkpoint_dir="/ck")
    with pytest.raises(ValueError, match="ranks"):
        Launch(launcher="mpiexec")


# --------------------------------------------------------------------------- end to end

STEPS = 150
HEAT: dict[str, Any] = {"nx": 32, "ny": 32, "steps": STEPS, "ranks": 2, "checkpoint_every": 10}


@pytest.fixture
def dfk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real DataFlowKernel: HTEx + LocalProvider, retries 1, resume_retry_handler."""
    d = tmp_path_factory.mktemp("parsl")
    path = d / "local.yaml"
    path.write_text(
        f"retries: 1\nretry_handler: resume\nrun_dir: {d / 'runinfo'}\nstrategy_period: 0.5\n"
        "executor: {kind: htex, label: test, max_workers_per_node: 2}\n"
        "provider: {kind: local, init_blocks: 1, max_blocks: 1}\n"
    )
    dfk = parsl.load(load_config(path))
    try:
        yield dfk
    finally:
        dfk.cleanup()


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoint policy for 2.5-second tries: a small stop margin."""
    path = tmp_path_factory.mktemp("policy") / "fast.yaml"
    path.write_text(
        "checkpoint_comm: node\nsave_when: {every_steps: 10, on_signal: true}\n"
        "keep: {last: 2}\nwalltime_margin_s: 0.3\n"
    )
    return path


def heat_field(path: Path) -> bytes:
    with h5py.File(path) as f:
        assert int(f.attrs["steps"]) == STEPS
        return bytes(f["T"][()].tobytes())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, policy: Path) -> bytes:
    d = tmp_path_factory.mktemp("ref")
    cmd = [
        mpiexec(), "-n", "2", sys.executable, "-m", "apps.heat", "--nx", "32", "--ny", "32",
        "--steps", str(STEPS), "--checkpoint-every", "10", "--config", str(policy),
        "--checkpoint-dir", str(d / "ck"), "--out", str(d / "out.h5"),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=120)
    return heat_field(d / "out.h5")


def test_walltime_kills_resume_at_no_cost(
    dfk: Any, policy: Path, reference: bytes, tmp_path: Path
) -> None:
    apps = CampaignApps(cwd=REPO)
    ck, out = tmp_path / "ck", tmp_path / "out.h5"
    heat = apps.submit(
        "heat",
        **HEAT, step_delay=0.04, config=str(policy), checkpoint_dir=str(ck), out=str(out),
        walltime_s=2.5, max_no_progress=3, run_extra=["--signal", "USR1@0.5", "--kill-wait", "1"],
        stdout=str(tmp_path / "heat.out"), stderr=str(tmp_path / "heat.err"),
    )  # fmt: skip
    # tasks that never progress, run alongside: a python app and a bash app
    never = resumable_apps(cwd=REPO).python(
        [sys.executable, "-c", "import sys; sys.exit(1)"], str(tmp_path / "never"),
        run=RunOptions(max_no_progress=2), log_path=str(tmp_path / "never.log"),
    )  # fmt: skip
    broken = apps.submit(
        "heat",
        **HEAT, config=str(tmp_path / "no-such-policy.yaml"), checkpoint_dir=str(tmp_path / "broken"),
        out=str(tmp_path / "broken.h5"), max_no_progress=2,
        stdout=str(tmp_path / "broken.out"), stderr=str(tmp_path / "broken.err"),
    )  # fmt: skip

    try:
        assert heat.result(timeout=300) == 0
    except Exception:
        print((tmp_path / "heat.err").read_text()[-3000:])
        raise
    tr = heat.task_record
    ledger = read_ledger(ck)
    tries = tr["try_id"] + 1
    assert tries >= 4, ledger  # killed at least 3 times
    assert tr["fail_count"] == tries - 1 and tr["fail_cost"] == 0  # every kill was free
    assert [r["exit_code"] for r in ledger] == [75] * (tries - 1) + [0]
    assert all(r["progress"] for r in ledger[:-1])
    # the last attempt made progress, unless the one before stopped exactly at the last step
    assert ledger[-1]["progress"] or ledger[-1]["latest_before"] == STEPS, ledger[-1]
    assert heat_field(out) == reference  # bit-identical to the uninterrupted run

    # each retry was told where to resume from, and the step only went up
    seen = re.findall(r"resilient: resume_from=(\S+)", (tmp_path / "heat.out").read_text())
    assert seen[0] == "none" and len(seen) == tries
    steps = [int(Path(s).name.split("_")[1]) for s in seen[1:]]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert [Path(s).parent for s in seen[1:]] == [ck] * (tries - 1)
    assert tr["kwargs"]["resume_from"] == seen[-1]

    for fut, root, kind in ((never, tmp_path / "never", ResumableCommandError),
                            (broken, tmp_path / "broken", BashExitFailure)):  # fmt: skip
        exc = fut.exception(timeout=120)
        assert isinstance(exc, kind), repr(exc)
        assert exc.exitcode == 93
        ledger = read_ledger(root)
        assert [r["exit_code"] for r in ledger][-1] == 93 and len(ledger) == 2
        assert fut.task_record["try_id"] == 1 and fut.task_record["fail_cost"] == math.inf
    assert "resilient: resume_from=none" in (tmp_path / "never.log").read_text()


def test_mpi_executor_app(
    tmp_path: Path, policy: Path, reference: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MPIExecutor variant: ranks started by $PARSL_MPI_PREFIX (here mpiexec -n 2 -ppn 2
    -hosts <this host>; Parsl reads the node list from a PBS_NODEFILE we fake)."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(socket.gethostname() + "\n")
    for var in ("SLURM_NODELIST", "PBS_NODEFILE"):
        monkeypatch.delenv(var, raising=False)
    init = f"export PBS_NODEFILE={nodefile}; export PATH={Path(mpiexec()).parent}:$PATH"
    path = tmp_path / "mpi.yaml"
    path.write_text(
        f"retries: 1\nrun_dir: {tmp_path / 'runinfo'}\nstrategy_period: 0.5\n"
        "executor: {kind: mpi, label: mpitest, max_workers_per_block: 1, mpi_launcher: mpiexec}\n"
        f"provider: {{kind: local, launcher: simple, worker_init: '{init}'}}\n"
    )
    dfk = parsl.load(load_config(path))
    try:
        fut = CampaignApps(cwd=REPO).submit(
            "heat", mpi=True, **HEAT, config=str(policy), checkpoint_dir=str(tmp_path / "ck"),
            out=str(tmp_path / "out.h5"), stdout=str(tmp_path / "o.txt"), stderr=str(tmp_path / "e.txt"),
        )  # fmt: skip
        assert fut.result(timeout=120) == 0, (tmp_path / "e.txt").read_text()
        assert fut.task_record["resource_specification"]["num_ranks"] == 2
    finally:
        dfk.cleanup()
    with h5py.File(tmp_path / "out.h5") as f:
        assert int(f.attrs["ranks"]) == 2
    assert heat_field(tmp_path / "out.h5") == reference
    assert "-- $PARSL_MPI_PREFIX" in (tmp_path / "e.txt").read_text()


# --------------------------------------------------------------------------- the PyTorch task


def test_campaign_torch_task_follows_enabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train_torch.enabled``: auto (torch installed here), true, false; anything else names the key."""
    monkeypatch.syspath_prepend(str(REPO / "workflows"))
    from pipeline import load_campaign  # type: ignore[import-not-found]

    doc = (REPO / "configs" / "campaign.yaml").read_text()
    assert "train_torch:" in doc and "enabled: auto" in doc
    have_torch = importlib.util.find_spec("torch") is not None
    tasks, *_ = load_campaign(REPO / "configs" / "campaign.yaml", tmp_path, tmp_path)
    assert ("train_torch" in [t.name for t in tasks]) is have_torch
    for value, expected in (("true", True), ("false", False), ("auto", have_torch)):
        path = tmp_path / f"{value}.yaml"
        path.write_text(doc.replace("enabled: auto", f"enabled: {value}"))
        tasks, *_ = load_campaign(path, tmp_path, tmp_path, "node")
        names = {t.name: t for t in tasks}
        assert ("train_torch" in names) is expected, value
        if expected:
            t = names["train_torch"]
            assert t.checkpoint_dir.parent == tmp_path / "train_torch"
            assert t.min_walltime > 4 and t.params == {"steps": 400, "ranks": 2}
    path = tmp_path / "bad.yaml"
    path.write_text(doc.replace("enabled: auto", "enabled: sometimes"))
    with pytest.raises(ConfigError, match=r"train_torch\.enabled"):
        load_campaign(path, tmp_path, tmp_path)


@pytest.mark.torch
@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_torch_program_resumes_at_no_cost(dfk: Any, policy: Path, tmp_path: Path) -> None:
    """``CampaignApps.submit("train_torch", ...)``: 2 processes under mpiexec, a 14-s simulated
    walltime per try (torch's start-up included); free retries; bit-identical output. The
    100 steps of 0.15 s outlast one try however fast torch starts."""
    ref = tmp_path / "ref"
    cmd = [
        mpiexec(), "-n", "2", sys.executable, "-m", "apps.train_torch", "--steps", "100",
        "--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5"),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=180)

    ck, out = tmp_path / "ck", tmp_path / "out.h5"
    fut = CampaignApps(cwd=REPO).submit(
        "train_torch", ranks=2, steps=100, checkpoint_every=10, step_delay=0.15,
        config=str(policy), checkpoint_dir=str(ck), out=str(out), walltime_s=14,
        run_extra=["--signal", "USR1@1", "--kill-wait", "3"],
        stdout=str(tmp_path / "t.out"), stderr=str(tmp_path / "t.err"),
    )  # fmt: skip
    try:
        assert fut.result(timeout=400) == 0
    except Exception:
        print((tmp_path / "t.err").read_text()[-3000:])
        raise
    codes = [r["exit_code"] for r in read_ledger(ck)]
    assert codes[-1] == 0 and codes.count(75) >= 1, codes
    assert fut.task_record["fail_cost"] == 0
    with h5py.File(out) as got, h5py.File(ref / "out.h5") as want:
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name][()].tobytes() == want[name][()].tobytes(), name
        assert int(got.attrs["steps"]) == 100


# --------------------------------------------------------------------------- other rank counts


def test_the_campaign_key_has_no_rank_count_for_elastic_apps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """heat and train checkpoint Blocks and Replicated values: another ``ranks`` is the same
    checkpoint directory (so it resumes); train_torch's per-rank state is keyed by ``ranks``."""
    monkeypatch.syspath_prepend(str(REPO / "workflows"))
    from pipeline import Task

    def placed(app: str, name: str, **params: Any) -> Path:
        task = Task(name=name, app=app, params=params, options={}, out=tmp_path / "o.h5")
        task.place(tmp_path / "ckpt", "node")
        where: Path = task.checkpoint_dir
        return where

    heat = {"nx": 64, "ny": 32, "steps": 100, "alpha": 0.2}
    assert placed("heat", "heat-hot", ranks=4, **heat) == placed(
        "heat", "heat-hot", ranks=2, **heat
    )
    assert placed("train", "train", ranks=2, steps=9) == placed("train", "train", ranks=5, steps=9)
    torch_a = placed("train_torch", "train_torch", ranks=2, steps=9)
    assert torch_a != placed("train_torch", "train_torch", ranks=3, steps=9)


def test_an_app_invoked_again_with_other_ranks_resumes(
    tmp_path: Path, policy: Path, reference: bytes
) -> None:
    """A heat app stopped by its walltime on 2 ranks, then invoked again on 3 ranks: the second
    invocation resumes from the first one's checkpoint and ends bit-identical."""
    path = tmp_path / "local.yaml"
    path.write_text(
        f"retries: 0\nretry_handler: none\nrun_dir: {tmp_path / 'runinfo'}\nstrategy_period: 0.5\n"
        "executor: {kind: htex, label: ranks, max_workers_per_node: 1}\n"
        "provider: {kind: local, init_blocks: 1, max_blocks: 1}\n"
    )
    dfk = parsl.load(load_config(path))
    ck, out = tmp_path / "ck", tmp_path / "out.h5"
    common = {**HEAT, "config": str(policy), "checkpoint_dir": str(ck), "out": str(out),
              "stderr": str(tmp_path / "heat.err")}  # fmt: skip
    try:
        apps = CampaignApps(cwd=REPO)
        first = apps.submit(
            "heat", **{**common, "ranks": 2}, step_delay=0.04, walltime_s=2.5,
            run_extra=["--signal", "USR1@0.5", "--kill-wait", "1"],
        )  # fmt: skip
        exc = first.exception(timeout=300)
        assert isinstance(exc, BashExitFailure) and exc.exitcode == 75, repr(exc)
        second = apps.submit("heat", **{**common, "ranks": 3})
        assert second.result(timeout=300) == 0, (tmp_path / "heat.err").read_text()[-3000:]
    finally:
        dfk.cleanup()
    ledger = read_ledger(ck)
    assert [r["exit_code"] for r in ledger] == [75, 0]
    assert ledger[1]["latest_before"] == ledger[0]["latest_after"] is not None
    with h5py.File(out) as f:
        assert int(f.attrs["ranks"]) == 3
    assert heat_field(out) == reference
