"""Parsl integration: config loading, commands for users' own apps, the retry handler, real runs.

The end-to-end tests run a real DataFlowKernel (HighThroughputExecutor + LocalProvider, run
directory under tmp) with real MPI ranks and plain ``@bash_app``/``@python_app`` apps: the
campaign's heat DAG (prepare -> simulate -> analyse) whose simulation is cut short by a
simulated walltime on several tries and still ends bit-identical at no retry cost; a changed
parameter in a fixed checkpoint directory (exit 78, not retried) and the same change through
``checkpoint_dir`` (a fresh directory); and the python-app form (``run_resilient``).
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import itertools
import json
import logging
import math
import pickle
import shlex
import shutil
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
from resilient.io import storage
from resilient.job.ledger import read_ledger
from resilient.model import filenames
from resilient.workflow import checkpoint_dir
from tests.mpirun import REPO, clean_env, mpiexec

parsl = pytest.importorskip("parsl")

from parsl import File, bash_app, python_app  # noqa: E402
from parsl.app.errors import BashExitFailure  # noqa: E402
from parsl.config import Config  # noqa: E402
from parsl.executors import HighThroughputExecutor, MPIExecutor  # noqa: E402
from parsl.executors.high_throughput.errors import ManagerLost, WorkerLost  # noqa: E402
from parsl.launchers import SimpleLauncher  # noqa: E402
from parsl.providers import LocalProvider, SlurmProvider  # noqa: E402

from resilient.integrations.parsl import (  # noqa: E402
    ForeignRunRefused,
    NoProgressRefused,
    ResumableCommandError,
    exit_code_of,
    find_roots,
    load_config,
    resilient_command,
    resume_retry_handler,
    run_resilient,
)
from workflows import parsl_apps  # noqa: E402

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


# --------------------------------------------------------------------------- retry handler

LAUNCHED = datetime.datetime(2030, 1, 1, 12, 0, 0)


def save(root: Path, step: int) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(step, {"x": np.arange(3)})


def record(*args: Any, task_id: int = 7, **kwargs: Any) -> Any:  # a TaskRecord in the tests
    return {
        "id": task_id, "try_id": 0, "fail_count": 1, "fail_cost": 0, "args": list(args),
        "kwargs": kwargs, "time_invoked": LAUNCHED, "try_time_launched": LAUNCHED,
    }  # fmt: skip


def ledger_line(root: Path, *, end: datetime.datetime, progress: bool) -> None:
    with open(root / filenames.ATTEMPT_LEDGER, "a") as fh:
        fh.write(json.dumps({"attempt": 1, "start": end.timestamp() - 5, "end": end.timestamp(),
                             "progress": progress, "exit_code": 75}) + "\n")  # fmt: skip


@pytest.mark.parametrize(
    ("code", "cost"), [(75, 0.0), (93, math.inf), (74, math.inf), (78, math.inf), (1, 1.0), (139, 1.0)]
)  # fmt: skip
def test_handler_prices_exit_codes(code: int, cost: float, tmp_path: Path) -> None:
    handler = resume_retry_handler()
    if code in (78, 93):  # the run ended for good: Parsl retries no more, the app raises these
        typed = ForeignRunRefused if code == 78 else NoProgressRefused
        for failed in (BashExitFailure("sim", code), ResumableCommandError(code, ["x"])):
            with pytest.raises(typed) as caught:
                handler(failed, record())
            assert caught.value.exitcode == code and caught.value.__cause__ is failed
        refused = typed(["x"], reason="why")
        with pytest.raises(typed) as caught:
            handler(refused, record())  # run_resilient raised it already: as it is
        assert caught.value is refused
        return
    assert handler(BashExitFailure("sim", code), record()) == cost
    assert handler(ResumableCommandError(code, ["x"]), record()) == cost
    assert resume_retry_handler(walltime_cost=0.5, failure_cost=3)(
        BashExitFailure("sim", code), record()
    ) == {0.0: 0.5, 1.0: 3.0}.get(cost, cost)


def test_a_refusal_carries_the_ledgers_reason_and_pickles(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    storage.ensure_root(root)
    (root / filenames.ATTEMPT_LEDGER).write_bytes(  # the last valid line decides, not a torn one
        json.dumps(
            {"attempt": 2, "exit_code": 93, "reason": "crashed (exit 3); no progress"}
        ).encode()
        + b'\n{"attempt": 3, "exit_code": "93", "reason": "wrong"}\n\xff{"attempt": 4, "ex'
    )
    with pytest.raises(NoProgressRefused) as caught:
        resume_retry_handler()(BashExitFailure("sim", 93), record(str(root)))
    assert caught.value.reason == "crashed (exit 3); no progress"
    assert str(caught.value) == "no progress for too long (exit 93): crashed (exit 3); no progress"
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is NoProgressRefused and again.reason == caught.value.reason
    assert isinstance(again, ResumableCommandError) and again.exitcode == 93


def test_handler_other_failures_cost_one() -> None:
    assert resume_retry_handler()(ValueError("boom"), record()) == 1
    assert resume_retry_handler()(ManagerLost(b"m", "h"), record("no/such/root")) == 1


def test_lost_workers_are_priced_by_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Roots are found under any keyword name; each failure compares with the previous one."""
    caplog.set_level("INFO", logger="parsl.resilient")
    root = tmp_path / "ck"
    save(root, 10)  # from an earlier run: not progress of this try
    handler = resume_retry_handler()
    tr = record(3, "--nx", wherever=str(root), stdout="x.out")
    before = copy.deepcopy(tr)
    assert handler(ManagerLost(b"m", "h"), tr) == 1  # first failure, nothing in the ledger
    save(root, 20)
    assert handler(ManagerLost(b"m", "h"), tr) == 0  # 10 -> 20
    assert handler(WorkerLost(1, "h"), tr) == 1  # type: ignore[no-untyped-call]  # 20 -> 20
    assert handler(BashExitFailure("sim", 75), tr) == 0
    save(root, 30)
    assert handler(WorkerLost(1, "h"), tr) == 0  # type: ignore[no-untyped-call]
    assert tr == before  # the handler writes nothing into the task record
    other = record(kw=str(root), task_id=8)  # another task: its own history
    assert handler(ManagerLost(b"m", "h"), other) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "parsl.resilient"]
    assert len(lines) == 6
    assert lines[0].startswith("resilient: task 7 try 0 lost its worker (ManagerLost; ")
    assert "step 10 -> 20 (progress)" in lines[1] and lines[1].endswith(": costs 0 retries")
    assert lines[2].endswith(": costs 1 retry")
    assert "stopped early after a newer checkpoint (exit 75)" in lines[3]


def test_each_failed_try_is_one_line_with_the_app_and_its_cost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="parsl.resilient")
    handler = resume_retry_handler()
    dfk = type("Dfk", (), {"config": Config(retries=2)})()  # what the handler reads of the DFK
    for exc, spent in [
        (BashExitFailure("simulate", 75), 0), (BashExitFailure("simulate", 1), 0),
        (ResumableCommandError(93), 1), (ValueError("boom"), 1.5),
    ]:  # fmt: skip
        tr = record(task_id=1)
        tr.update(func_name="simulate", try_id=2, fail_cost=spent, dfk=dfk)
        if exit_code_of(exc) == 93:  # the run ended: the handler raises, Parsl retries no more
            with pytest.raises(NoProgressRefused):
                handler(exc, tr)
            continue
        handler(exc, tr)
    assert [r.getMessage() for r in caplog.records if r.name == "parsl.resilient"] == [
        "resilient: task 1 (simulate) try 2 stopped early after a newer checkpoint (exit 75): "
        "costs 0 retries (0 of 2 used)",
        "resilient: task 1 (simulate) try 2 failed (exit 1): costs 1 retry (1 of 2 used)",
        "resilient: task 1 (simulate) try 2 failed with exit 93 (no progress for too long): "
        "not retried",
        "resilient: task 1 (simulate) try 2 failed (ValueError): costs 1 retry (2.5 of 2 used)",
    ]
    other = logging.getLogger("elsewhere")
    with caplog.at_level("INFO", logger="elsewhere"):
        resume_retry_handler(logger=other)(BashExitFailure("simulate", 75), record())
    assert caplog.records[-1].name == "elsewhere"


def test_first_lost_try_reads_the_ledger(tmp_path: Path) -> None:
    """At a task's first failure: progress if an attempt with progress ended during this try."""
    root = tmp_path / "ck"
    save(root, 10)
    ledger_line(root, end=LAUNCHED - datetime.timedelta(minutes=5), progress=True)  # earlier
    assert resume_retry_handler()(ManagerLost(b"m", "h"), record(str(root))) == 1
    ledger_line(root, end=LAUNCHED + datetime.timedelta(minutes=5), progress=False)
    assert resume_retry_handler()(ManagerLost(b"m", "h"), record(str(root))) == 1
    ledger_line(root, end=LAUNCHED + datetime.timedelta(minutes=9), progress=True)
    assert resume_retry_handler()(ManagerLost(b"m", "h"), record(str(root))) == 0


def test_a_lost_node_after_a_protected_local_step_costs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Slurm lost a node under the try (the ledger says so) after a node-local step that
    partner copies protected: that step is progress. Where the try's record is missing (its
    ``resilient run`` was killed with it), a newer step than the last earlier record left."""
    caplog.set_level("INFO", logger="parsl.resilient")
    root = tmp_path / "ck"
    save(root, 10)
    ledger_line(root, end=LAUNCHED - datetime.timedelta(minutes=5), progress=True)
    with open(root / filenames.ATTEMPT_LEDGER, "a") as fh:  # an earlier try left step 10
        fh.write(json.dumps({"attempt": 2, "exit_code": 75, "end": LAUNCHED.timestamp() - 60,
                             "latest_after": 10}) + "\n")  # fmt: skip
    assert resume_retry_handler()(ManagerLost(b"m", "h"), record(str(root))) == 1  # 10 -> 10
    with open(root / filenames.PROTECT_LOG, "a") as fh:
        fh.write(json.dumps({"time": LAUNCHED.timestamp() + 30, "step": 30}) + "\n")
    assert resume_retry_handler()(ManagerLost(b"m", "h"), record(str(root))) == 0  # 10 -> 30
    with open(root / filenames.ATTEMPT_LEDGER, "a") as fh:  # the try's own record
        fh.write(json.dumps({"attempt": 3, "exit_code": 75, "end": LAUNCHED.timestamp() + 60, "progress": True,
                             "latest_after": 30, "lost_nodes": ["n2"]}) + "\n")  # fmt: skip
    for exc in (ManagerLost(b"m", "h"), BashExitFailure("heat", 75)):
        assert resume_retry_handler()(exc, record(str(root))) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "parsl.resilient"]
    assert "Slurm lost node n2; " in lines[2] and "step none -> 30 (progress)" in lines[2]
    assert "stopped early after a newer checkpoint (Slurm lost node n2) (exit 75)" in lines[3]


def test_roots_in_files_and_nested_arguments(tmp_path: Path) -> None:
    roots = [tmp_path / n for n in ("a", "b", "c")]
    for r in roots:
        save(r, 1)
    (tmp_path / "plain").mkdir()
    args = [File(str(roots[0])), {"deep": [roots[1]]}]
    kwargs: dict[str, Any] = {
        "inputs": [File(str(roots[2])), File(str(tmp_path / "plain"))], "n": 4, "x": "\0"
    }  # fmt: skip
    assert find_roots(args, kwargs) == roots
    tr = record(*args, **kwargs)
    handler = resume_retry_handler()
    assert handler(ManagerLost(b"m", "h"), tr) == 1
    save(roots[2], 2)  # progress in a root passed as a File in inputs
    assert handler(ManagerLost(b"m", "h"), tr) == 0


def test_resumable_command_error_pickles() -> None:
    err = pickle.loads(pickle.dumps(ResumableCommandError(93, ["a", "b c"], "tail")))
    assert err.exitcode == 93 and err.command == ["a", "b c"] and err.output == "tail"
    assert "'b c'" in str(err) and "tail" in str(err)


# --------------------------------------------------------------------------- commands


def test_resilient_command_quotes_options_and_prefix(tmp_path: Path) -> None:
    ck = tmp_path / "a dir"
    argv = shlex.split(resilient_command(["prog", "x y", 3, File(str(tmp_path / "in put"))],
                                         checkpoint_dir=ck))  # fmt: skip
    assert argv[:4] == [sys.executable, "-m", "resilient.cli", "run"]
    assert argv[4:] == [
        "--checkpoint-dir",
        str(ck),
        "--",
        "prog",
        "x y",
        "3",
        str(tmp_path / "in put"),
    ]
    cmd = resilient_command(
        ["prog"], checkpoint_dir=str(ck), walltime_s=2.5, signal="USR1@30", max_no_progress=3,
        retries=1, requeue=True, python="/py",
    )  # fmt: skip
    assert shlex.split(cmd) == [
        "/py", "-m", "resilient.cli", "run", "--checkpoint-dir", str(ck), "--walltime", "2.5",
        "--signal", "USR1@30", "--max-no-progress", "3", "--retries", "1", "--requeue", "--", "prog",
    ]  # fmt: skip
    named = shlex.split(resilient_command(["prog"], checkpoint_dir=ck, task="simulate hot"))
    assert named[4:9] == ["--checkpoint-dir", str(ck), "--task", "simulate hot", "--"]
    cmd = resilient_command(["prog", "a b"], checkpoint_dir=ck, launcher_prefix="$PARSL_MPI_PREFIX")
    assert " -- $PARSL_MPI_PREFIX prog 'a b'" in cmd
    echo = subprocess.run(
        ["bash", "-c", "printf '%s\\n' " + cmd], env={"PARSL_MPI_PREFIX": "srun -n 4"},
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert echo[-6:] == ["--", "srun", "-n", "4", "prog", "a b"]


def test_run_resilient_returns_zero_or_raises(tmp_path: Path) -> None:
    assert run_resilient([sys.executable, "-c", "pass"], checkpoint_dir=tmp_path / "ok") == 0
    with pytest.raises(ResumableCommandError) as info:
        run_resilient([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"],
                      checkpoint_dir=tmp_path / "bad", env={"X": "1"})  # fmt: skip
    assert info.value.exitcode == 3 and "hi" in info.value.output
    log = tmp_path / "logs" / "run.log"
    with pytest.raises(ResumableCommandError) as info:
        run_resilient([sys.executable, "-c", "print('hello'); raise SystemExit(4)"],
                      checkpoint_dir=tmp_path / "bad2", log_path=log, cwd=tmp_path)  # fmt: skip
    assert info.value.exitcode == 4 and info.value.output == "" and "hello" in log.read_text()


@bash_app
def write_through_resilient(ckpt: str, outputs: Any = (), stderr: Any = None) -> str:
    from resilient.integrations.parsl import resilient_command

    return resilient_command(["sh", "-c", 'echo hi > "$1"', "sh", outputs[0]],
                             checkpoint_dir=ckpt, outputs=outputs)  # fmt: skip


@python_app
def write_through_run_resilient(ckpt: str, outputs: Any = ()) -> int:
    from resilient.integrations.parsl import run_resilient

    return run_resilient(["sh", "-c", 'echo hi > "$1"', "sh", outputs[0]],
                         checkpoint_dir=ckpt, outputs=outputs)  # fmt: skip


@bash_app
def write_plainly(outputs: Any = (), stderr: Any = None) -> str:
    return f"echo hi > {outputs[0]}"


def test_an_outputs_folder_is_made_for_the_program(tmp_path: Path) -> None:
    """Parsl does not create the folder of an app's `File` output; given the app's `outputs`,
    `resilient run` does, before the program starts (a real DataFlowKernel, threads)."""
    from parsl.executors import ThreadPoolExecutor

    words = shlex.split(resilient_command(["p"], checkpoint_dir="ck", outputs=[File("o/a"), "b"]))
    assert words[4:] == ["--checkpoint-dir", "ck", "--outputs", "o/a", "b", "--", "p"]
    dfk = parsl.load(Config(executors=[ThreadPoolExecutor(max_threads=2)],
                            run_dir=str(tmp_path / "runinfo")))  # fmt: skip
    try:
        plain = write_plainly(outputs=[File(str(tmp_path / "plain" / "sim.h5"))],
                              stderr=str(tmp_path / "plain.err"))  # fmt: skip
        with pytest.raises(BashExitFailure):  # Parsl alone: no folder, the program fails
            plain.result()
        bash = write_through_resilient(
            str(tmp_path / "ck1"), outputs=[File(str(tmp_path / "out" / "sim.h5"))],
            stderr=str(tmp_path / "bash.err"),
        )  # fmt: skip
        py = write_through_run_resilient(
            str(tmp_path / "ck2"), outputs=[File(str(tmp_path / "py" / "deep" / "sim.h5"))]
        )
        assert bash.result() == 0 and py.result() == 0
    finally:
        dfk.cleanup()
    assert (tmp_path / "out" / "sim.h5").read_text() == "hi\n"
    assert (tmp_path / "py" / "deep" / "sim.h5").read_text() == "hi\n"


# --------------------------------------------------------------------------- end to end

STEPS = 150
RANKS = 2
CASE = {"nx": 32, "ny": 32, "steps": STEPS, "alpha": 0.2}
TRIES: dict[str, Any] = {"walltime_s": 2.5, "signal": "USR1@0.5", "max_no_progress": 3}
# what the heat runs of the Parsl apps get: 9 s of compute (0.06 s a step) in tries of 5 s, so
# 3 or more tries however fast the start-up (0.8 s quiet), and progress in each however slow
# (2.4-3.3 s were seen beside the Slurm campaigns' start on 3 workers: in 2.5-s tries that left
# none, the try failed, in three runs of the suite)
SLOW_TRIES: dict[str, Any] = {**TRIES, "walltime_s": 5.0}
SLOW_STEP_DELAY = 0.06


# The workers unpickle the apps of workflows.parsl_apps and of this module by reference: they
# import them, so the repository must be on their path (as a user's own app module must be).
# pytest's sys.path does not reach them; a shell line in worker_init does, whatever the caller's
# environment holds (CI has no PYTHONPATH).
WORKER_PATH = f"export PYTHONPATH={shlex.quote(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}}"


def local_config(run_dir: Path, *, retries: int, label: str = "test") -> Config:
    """HTEx + LocalProvider (one block, two workers) and resume_retry_handler."""
    provider = LocalProvider(  # type: ignore[no-untyped-call]
        init_blocks=1, max_blocks=1, worker_init=WORKER_PATH
    )
    executor = HighThroughputExecutor(label=label, max_workers_per_node=2, provider=provider)
    return Config(
        executors=[executor], retries=retries, retry_handler=resume_retry_handler(),
        run_dir=str(run_dir), strategy_period=0.5,
    )  # fmt: skip


@pytest.fixture
def dfk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real DataFlowKernel with ``retries=1``."""
    d = tmp_path_factory.mktemp("parsl")
    dfk = parsl.load(local_config(d / "runinfo", retries=1))
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


def heat_argv(out: Path | str, ck: Path | str, **extra: Any) -> list[str]:
    args = [sys.executable, "-m", "apps.heat", "--nx", "32", "--ny", "32", "--steps", str(STEPS),
            "--checkpoint-every", "10", "--checkpoint-dir", str(ck), "--out", str(out)]  # fmt: skip
    return args + [str(a) for kv in extra.items() for a in (f"--{kv[0].replace('_', '-')}", kv[1])]


def heat_field(path: Path) -> bytes:
    with h5py.File(path) as f:
        assert int(f.attrs["steps"]) == STEPS
        return bytes(f["T"][()].tobytes())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, policy: Path) -> bytes:
    """The heat case's field from one uninterrupted run on 2 ranks."""
    d = tmp_path_factory.mktemp("ref")
    cmd = [mpiexec(), "-n", str(RANKS), *heat_argv(d / "out.h5", d / "ck", config=policy)]
    subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=120)
    return heat_field(d / "out.h5")


def tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"({path} missing)"


def test_heat_dag_resumes_through_walltime_stops_at_no_cost(
    dfk: Any, policy: Path, reference: bytes, tmp_path: Path
) -> None:
    """prepare -> simulate (stopped by its walltime several times) -> analyse, with retries=1:
    every stopped try advanced the checkpoint, so none cost anything."""
    ck = checkpoint_dir(tmp_path / "ckpt", "heat", CASE, wildcards={"case": "hot"})
    out, err = tmp_path / "hot.h5", tmp_path / "heat.err"
    prepared = parsl_apps.prepare(CASE, outputs=[File(str(tmp_path / "hot.json"))])
    sim = parsl_apps.simulate(
        ck, ranks=RANKS, checkpoint_every=10, step_delay=SLOW_STEP_DELAY, policy=str(policy),
        **SLOW_TRIES,
        inputs=[prepared.outputs[0]], outputs=[File(str(out))],
        stdout=str(tmp_path / "heat.out"), stderr=str(err),
    )  # fmt: skip
    summary = parsl_apps.analyse(
        inputs=[sim.outputs[0]], outputs=[File(str(tmp_path / "summary.json"))]
    )
    try:
        got = summary.result(timeout=400)
    except Exception:
        print(tail(err))
        raise
    assert sim.result() == 0 and prepared.result() == CASE
    assert json.loads((tmp_path / "hot.json").read_text()) == CASE
    assert got["steps"] == STEPS and got["ranks"] == RANKS and got["field"] == str(out)
    assert json.loads((tmp_path / "summary.json").read_text()) == got

    tr = sim.task_record
    tries = tr["try_id"] + 1
    ledger = read_ledger(Path(ck))
    assert tries >= 3, ledger  # stopped at least twice
    assert tr["fail_count"] == tries - 1 and tr["fail_cost"] == 0  # every stop was free
    assert [r["exit_code"] for r in ledger] == [75] * (tries - 1) + [0]
    assert all(r["progress"] for r in ledger[:-1])
    for before, after in itertools.pairwise(ledger):  # each resumed where the last stopped
        assert after["latest_before"] == before["latest_after"] is not None, ledger
    assert heat_field(out) == reference  # bit-identical to the uninterrupted run


# user-style apps of the tests: their checkpoint parameter is not called checkpoint_dir


@bash_app
def heat_bash(
    ckpt: str, alpha: float, *, walltime_s: float | None = None, signal: str | None = None,
    outputs: Any = (), stdout: Any = None, stderr: Any = None,
) -> str:  # fmt: skip
    from resilient.integrations.parsl import resilient_command
    from tests.mpirun import REPO, mpiexec

    argv = [mpiexec(), "-n", 2, *heat_argv(outputs[0], ckpt, alpha=alpha, step_delay=0.04)]
    command = resilient_command(
        argv, checkpoint_dir=ckpt, outputs=outputs, walltime_s=walltime_s, signal=signal
    )
    return f"cd {REPO} && {command}"


@python_app
def heat_python(ckpt: str, policy: str, log: str, outputs: Any = ()) -> int:
    from resilient.integrations.parsl import run_resilient
    from tests.mpirun import REPO, mpiexec
    from tests.test_parsl import SLOW_STEP_DELAY, SLOW_TRIES

    argv = [mpiexec(), "-n", 2,
            *heat_argv(outputs[0], ckpt, config=policy, step_delay=SLOW_STEP_DELAY)]  # fmt: skip
    return run_resilient(argv, checkpoint_dir=ckpt, cwd=REPO, log_path=log, **SLOW_TRIES)


STOPS_TWICE = """
import os, sys
import numpy as np
from resilient import CheckpointManager
attempt = int(os.environ["RESILIENT_ATTEMPT"])
with CheckpointManager(os.environ["RESILIENT_CHECKPOINT_DIR"]) as m:
    m.save(attempt, {"x": np.arange(4.0) * attempt})
sys.exit(75 if attempt < 3 else 0)
"""


@bash_app
def stops_twice(ckpt: str, task: str, stdout: Any = None, stderr: Any = None) -> str:
    from resilient.integrations.parsl import resilient_command

    return resilient_command([sys.executable, "-c", STOPS_TWICE], checkpoint_dir=ckpt, task=task)


def test_free_stops_say_so_in_parsl_log(tmp_path: Path) -> None:
    """A real DataFlowKernel (threads): each try stopped after a newer checkpoint is one line
    in parsl.log, after Parsl's own, naming the app and saying it cost nothing; the app's
    stderr has `resilient run`'s lines under the task's name."""
    from parsl.executors import ThreadPoolExecutor

    config = Config(
        executors=[ThreadPoolExecutor(max_threads=1)], retries=1,
        retry_handler=resume_retry_handler(), run_dir=str(tmp_path / "runinfo"),
    )  # fmt: skip
    ck, err = tmp_path / "ckpt" / "stops" / "a-0123456789ab", tmp_path / "stops.err"
    with parsl.load(config):
        assert stops_twice(str(ck), "stops a", stderr=str(err)).result(timeout=120) == 0
    (log,) = (tmp_path / "runinfo").glob("*/parsl.log")
    lines = [line.split(": ", 1)[1] for line in log.read_text().splitlines() if "INFO: " in line]
    for t in (0, 1):
        theirs = lines.index(f"Task 0 try {t} failed with exception of type BashExitFailure")
        ours_at = lines.index(
            f"resilient: task 0 (stops_twice) try {t} stopped early after a newer checkpoint "
            "(exit 75): costs 0 retries (0 of 1 used)"
        )
        assert theirs < ours_at  # right after it, unless another thread logged in between
    ours = [line for line in err.read_text().splitlines() if line.startswith("resilient run")]
    assert [line.split(";")[0] for line in ours] == [
        "resilient run [stops a]: attempt 1: stopped early (checkpointed and exited 75)",
        "resilient run [stops a]: attempt 2: stopped early (checkpointed and exited 75)",
        "resilient run [stops a]: attempt 3: finished",
    ]


CRASHES_UNTIL_FIXED = """
import os, sys
from pathlib import Path
if not Path(os.environ["FIXED"]).exists():
    sys.exit(3)
import numpy as np
from resilient import CheckpointManager
with CheckpointManager(os.environ["RESILIENT_CHECKPOINT_DIR"]) as m:
    m.save(1, {"x": np.zeros(2)})
"""


@bash_app
def crashes_until_fixed(ckpt: str, fixed: str, stdout: Any = None, stderr: Any = None) -> str:
    from resilient.integrations.parsl import resilient_command

    program = [sys.executable, "-c", CRASHES_UNTIL_FIXED]
    return f"FIXED={fixed} " + resilient_command(program, checkpoint_dir=ckpt, max_no_progress=2)


def test_no_progress_raises_its_own_error_and_a_new_task_starts_again(tmp_path: Path) -> None:
    """Issue 33: a task that cannot progress ends in 93 with a NoProgressRefused the script can
    catch, after two tries; once the cause is fixed, a new task of the same app and checkpoint
    directory starts the program again (not refused), and finishes."""
    from parsl.executors import ThreadPoolExecutor

    config = Config(
        executors=[ThreadPoolExecutor(max_threads=1)], retries=5,
        retry_handler=resume_retry_handler(), run_dir=str(tmp_path / "runinfo"),
    )  # fmt: skip
    ck, fixed, err = tmp_path / "ck", tmp_path / "fixed", tmp_path / "err"
    with parsl.load(config):
        stuck = crashes_until_fixed(str(ck), str(fixed), stderr=str(err))
        exc = stuck.exception(timeout=120)
        assert isinstance(exc, NoProgressRefused), repr(exc)
        assert "crashed (exit 3); no progress in 2 consecutive attempts" in exc.reason
        assert stuck.task_record["try_id"] == 1  # two tries, then no more of the five retries
        fixed.touch()
        again = crashes_until_fixed(str(ck), str(fixed), stderr=str(err))
        assert again.result(timeout=120) == 0, err.read_text()[-3000:]
    ledger = read_ledger(ck)
    assert [r["exit_code"] for r in ledger] == [3, 93, 0], ledger
    assert ledger[-1]["new_run"].startswith("started anew")
    assert "a new run of this task: started anew" in err.read_text()


def test_changed_parameter_in_a_fixed_directory_stops_with_78(
    dfk: Any, tmp_path: Path, reference: bytes
) -> None:
    """The same fixed directory with another --alpha: exit 78, one try, no retry, and the
    script gets a ForeignRunRefused naming the parameter; the output the other run left is set
    aside. The same change through checkpoint_dir gets a directory of its own and finishes."""
    fixed, out = str(tmp_path / "ck"), tmp_path / "out.h5"
    first = heat_bash(fixed, 0.2, outputs=[File(str(out))], stderr=str(tmp_path / "a.err"))
    assert first.result(timeout=300) == 0, tail(tmp_path / "a.err")

    err = tmp_path / "b.err"
    changed = heat_bash(fixed, 0.1, outputs=[File(str(out))], stderr=str(err))
    exc = changed.exception(timeout=300)
    assert isinstance(exc, ForeignRunRefused) and exc.exitcode == 78, repr(exc)
    assert "alpha: 0.2 there, 0.1 now" in exc.reason, exc.reason
    assert isinstance(exc.__cause__, BashExitFailure) and exc.__cause__.exitcode == 78
    tr = changed.task_record
    assert tr["try_id"] == 0 and tr["fail_cost"] > dfk.config.retries  # not retried
    assert "belongs to another run" in err.read_text()
    # alpha 0.2's result is not left where alpha 0.1's would be
    (aside,) = tmp_path.glob("out.h5.other-run-*")
    assert not out.exists() and heat_field(aside) == reference
    assert f"set {out} aside as {aside.name}" in err.read_text()

    keyed = checkpoint_dir(tmp_path / "ckpt", "heat", {"alpha": 0.1})
    assert keyed != checkpoint_dir(tmp_path / "ckpt", "heat", {"alpha": 0.2})
    fresh = heat_bash(
        keyed, 0.1, outputs=[File(str(tmp_path / "c.h5"))], stderr=str(tmp_path / "c.err")
    )
    assert fresh.result(timeout=300) == 0, tail(tmp_path / "c.err")
    assert [r["exit_code"] for r in read_ledger(Path(keyed))] == [0]


def test_python_app_resumes_after_walltime_stops(
    dfk: Any, policy: Path, reference: bytes, tmp_path: Path
) -> None:
    """run_resilient inside a @python_app: ResumableCommandError(75) is free, the next try resumes."""
    ck, out, log = tmp_path / "ck", tmp_path / "out.h5", tmp_path / "heat.log"
    fut = heat_python(str(ck), str(policy), str(log), outputs=[File(str(out))])
    assert fut.result(timeout=400) == 0, tail(log)
    tr = fut.task_record
    codes = [r["exit_code"] for r in read_ledger(ck)]
    assert tr["try_id"] >= 1 and tr["fail_cost"] == 0, codes
    assert codes == [75] * tr["try_id"] + [0]
    assert heat_field(out) == reference


def test_mpi_executor_app(
    tmp_path: Path, policy: Path, reference: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The campaign's simulate app on an MPIExecutor: ranks started by $PARSL_MPI_PREFIX (here
    mpiexec -n 2 -ppn 2 -hosts <this host>; Parsl reads the node list from a PBS_NODEFILE we
    fake)."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(socket.gethostname() + "\n")
    for var in ("SLURM_NODELIST", "PBS_NODEFILE"):
        monkeypatch.delenv(var, raising=False)
    init = (
        f"export PBS_NODEFILE={nodefile}; export PATH={Path(mpiexec()).parent}:$PATH; "
        + WORKER_PATH
    )
    executor = MPIExecutor(
        label="mpitest", max_workers_per_block=1, mpi_launcher="mpiexec",
        provider=LocalProvider(  # type: ignore[no-untyped-call]
            launcher=SimpleLauncher(), worker_init=init
        ),
    )  # fmt: skip
    config = Config(executors=[executor], retries=1, retry_handler=resume_retry_handler(),
                    run_dir=str(tmp_path / "runinfo"), strategy_period=0.5)  # fmt: skip
    case = tmp_path / "case.json"
    case.write_text(json.dumps(CASE))
    err = tmp_path / "e.txt"
    with parsl.load(config):
        fut = parsl_apps.simulate(
            str(tmp_path / "ck"), ranks=RANKS, checkpoint_every=10, policy=str(policy),
            parsl_resource_specification=parsl_apps.mpi_resources(RANKS),
            inputs=[File(str(case))], outputs=[File(str(tmp_path / "out.h5"))], stderr=str(err),
        )  # fmt: skip
        assert fut.result(timeout=120) == 0, tail(err)
        assert fut.task_record["resource_specification"]["num_ranks"] == RANKS
    with h5py.File(tmp_path / "out.h5") as f:
        assert int(f.attrs["ranks"]) == RANKS
    assert heat_field(tmp_path / "out.h5") == reference
    assert "-- $PARSL_MPI_PREFIX" in err.read_text()


# --------------------------------------------------------------------------- the campaign


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
            assert t.min_walltime > 4
            assert t.params == {"steps": 400, "ranks": 2, "strategy": "ddp"}
    path = tmp_path / "bad.yaml"
    path.write_text(doc.replace("enabled: auto", "enabled: sometimes"))
    with pytest.raises(ConfigError, match=r"train_torch\.enabled"):
        load_campaign(path, tmp_path, tmp_path)


@pytest.mark.torch
@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_torch_program_resumes_at_no_cost(dfk: Any, policy: Path, tmp_path: Path) -> None:
    """The campaign's train app with ``apps.train_torch --strategy fsdp2`` (sharded state:
    DTensors): 2 processes under mpiexec, a 30-s simulated walltime per try (torch's start-up
    included: 10-29 s under load, which left a 14-s try no step); free retries; bit-identical
    output. The 200 steps of 0.15 s outlast one try however fast torch starts."""
    ref = tmp_path / "ref"
    cmd = [
        mpiexec(), "-n", "2", sys.executable, "-m", "apps.train_torch", "--steps", "200",
        "--strategy", "fsdp2", "--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5"),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=180)

    ck, out = tmp_path / "ck", tmp_path / "out.h5"
    fut = parsl_apps.train(
        "apps.train_torch", str(ck), ranks=2, steps=200, strategy="fsdp2", checkpoint_every=10,
        step_delay=0.15, policy=str(policy), walltime_s=30, signal="USR1@1",
        outputs=[File(str(out))], stdout=str(tmp_path / "t.out"), stderr=str(tmp_path / "t.err"),
    )  # fmt: skip
    try:
        assert fut.result(timeout=400) == 0
    except Exception:
        print(tail(tmp_path / "t.err"))
        raise
    codes = [r["exit_code"] for r in read_ledger(ck)]
    assert codes[-1] == 0 and codes.count(75) >= 1, codes
    assert fut.task_record["fail_cost"] == 0
    with h5py.File(out) as got, h5py.File(ref / "out.h5") as want:
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name][()].tobytes() == want[name][()].tobytes(), name
        assert int(got.attrs["steps"]) == 200


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
    torch_a = placed("train_torch", "train_torch", ranks=2, steps=9, strategy="ddp")
    assert torch_a != placed("train_torch", "train_torch", ranks=3, steps=9, strategy="ddp")
    assert torch_a != placed("train_torch", "train_torch", ranks=2, steps=9, strategy="fsdp2")


def test_an_app_invoked_again_with_other_ranks_resumes(
    dfk: Any, tmp_path: Path, policy: Path, reference: bytes
) -> None:
    """A heat run stopped by its walltime on 2 ranks (exit 75), then the campaign's simulate app
    on 3 ranks in the same directory: it resumes from that checkpoint and ends bit-identical."""
    ck, out = tmp_path / "ck", tmp_path / "out.h5"
    argv = [mpiexec(), "-n", "2", *heat_argv(out, ck, config=policy, step_delay=SLOW_STEP_DELAY)]
    command = shlex.split(resilient_command(argv, checkpoint_dir=ck, **SLOW_TRIES))
    stopped = subprocess.run(
        command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert stopped.returncode == 75, stopped.stderr[-3000:]

    case, err = tmp_path / "case.json", tmp_path / "heat.err"
    case.write_text(json.dumps(CASE))
    fut = parsl_apps.simulate(
        str(ck), ranks=3, checkpoint_every=10, policy=str(policy),
        inputs=[File(str(case))], outputs=[File(str(out))], stderr=str(err),
    )  # fmt: skip
    assert fut.result(timeout=300) == 0, tail(err)
    ledger = read_ledger(ck)
    assert [r["exit_code"] for r in ledger] == [75, 0]
    assert ledger[1]["latest_before"] == ledger[0]["latest_after"] is not None
    with h5py.File(out) as f:
        assert int(f.attrs["ranks"]) == 3
    assert heat_field(out) == reference


# --------------------------------------------------------------------------- a user's own script

# The user's own MPI program and Parsl script, as docs/howto/parsl.md includes them: a script
# (its apps go to the worker by value, so the imports the apps need are inside them), the user's
# own MPI program, a Python Config.
USER_EXAMPLE = REPO / "docs" / "examples" / "parsl"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_users_own_script_in_a_temporary_directory(tmp_path: Path) -> None:
    """The documented pattern from a script in a temp dir, with the user's own program: walltime
    stops cost nothing (retries=1, several tries) and the output is bit-identical to an
    uninterrupted run; a fixed directory reused with another parameter fails once with 78.

    The keyed run and the fixed directory's first run are independent: each in a directory of
    its own, at once (the program sleeps most of each step; each try is 10 s)."""
    keyed, fixed = tmp_path / "keyed", tmp_path / "fixed"
    for where in (keyed, fixed):
        where.mkdir()
        for name in ("sim.py", "flow.py"):
            shutil.copy(USER_EXAMPLE / name, where / name)
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # Parsl's interchange
    started: list[subprocess.Popen[str]] = []

    def start(where: Path, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "flow.py", *args], cwd=where, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        started.append(proc)
        return proc

    def finish(proc: subprocess.Popen[str]) -> str:
        stdout, stderr = proc.communicate(timeout=400)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
        return stdout

    try:
        first, other = start(keyed, "0.1", mpiexec()), start(fixed, "0.2", mpiexec(), "ckpt/fixed")
        out = finish(first)
        assert "RESULT" in out, out
        tries, cost = out.split("TRIES", 1)[1].split()[0], out.split("COST", 1)[1].split()[0]
        assert int(tries) >= 3 and float(cost) == 0.0, out
        ref = tmp_path / "ref"
        ref.mkdir()
        subprocess.run(
            [mpiexec(), "-n", "2", sys.executable, str(keyed / "sim.py"), "0.1", "400",
             str(ref / "out.txt"), str(keyed / "init.txt"), "0"],
            cwd=ref, env=clean_env(RESILIENT_CHECKPOINT_DIR=str(ref / "ck")), check=True,
            capture_output=True, timeout=120,
        )  # fmt: skip
        assert (keyed / "out-0.1.txt").read_bytes() == (ref / "out.txt").read_bytes()
        # a fixed directory: the first alpha finishes there, the second is refused at once
        assert "RESULT" in finish(other)
        out = finish(start(fixed, "0.3", mpiexec(), "ckpt/fixed"))
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "FAILED" in out and "TRIES 1 " in out and "SIM ForeignRunRefused" in out, out
    assert "belongs to another run" in (fixed / "sim.err").read_text()
