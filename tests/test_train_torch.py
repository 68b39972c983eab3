"""End-to-end: ``apps.train_torch`` (DDP or FSDP2 over gloo) killed and resumed ends bit-identical.

Each test runs the PyTorch trainer on 2 real processes, launched by ``torchrun`` or by
``mpiexec`` (the app reads its rank from the launcher's environment and never initialises MPI),
interrupts it (SIGKILL of every process, SIGTERM to torchrun, SIGUSR1 from ``resilient run
--walltime``), resumes it from its checkpoints and compares every dataset of the output with an
uninterrupted 2-process run's, byte for byte. DDP (the default ``--strategy``) in all of them
but one: ``--strategy fsdp2`` (sharded state, DTensors) under ``resilient run --walltime``. Also:
a corrupt newest checkpoint (one flipped byte in its data file) is quarantined and the run
resumes from the one before, still bit-identical; and the launcher environment is read as
documented.

Skipped without PyTorch (``pytest -m torch`` selects these tests).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'resilient-hpc[torch]')")

from apps.train_torch import Launch, find_launch, first_host
from resilient.errors import ConfigError
from resilient.io.checkpoints import list_checkpoints
from resilient.job.ledger import read_ledger
from tests.mpirun import REPO, clean_env, mpiexec
from tests.test_train_app import (
    HAVE_PROC,
    Run,
    kill_everything,
    latest_step,
    newer_than,
    rank_pids,
    read_out,
    stopped_steps,
    wait_for,
)

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

NRANKS = 2
STEPS = 60  # about two epochs (32 steps each)
SLOW = ["--step-delay", "0.05", "--checkpoint-every", "5"]
PIDFILE_ENV = "RESILIENT_TEST_PIDFILE_DIR"
EXIT_RESUME = 75
TORCHRUN = Path(sys.executable).parent / "torchrun"

_LAUNCHED: list[Run] = []


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port nobody listens on now (each launch gets its own: tests run side by side)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def app_args(work: Path) -> list[str]:
    return [
        "--steps", str(STEPS), "--checkpoint-dir", str(work / "ckpt"),
        "--out", str(work / "out.h5"),
    ]  # fmt: skip


def command(launcher: str, args: list[str]) -> list[str]:
    """``torchrun ...`` or ``mpiexec ...`` running ``python -m apps.train_torch ARGS``."""
    if launcher == "torchrun":
        if not TORCHRUN.exists():
            pytest.skip(f"no torchrun next to {sys.executable}")
        return [
            str(TORCHRUN), "--nproc-per-node", str(NRANKS), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "apps.train_torch", *args,
        ]  # fmt: skip
    return [mpiexec(), "-n", str(NRANKS), sys.executable, "-m", "apps.train_torch", *args]


def env(work: Path) -> dict[str, str]:
    return clean_env(
        **{PIDFILE_ENV: str(work / "pids"), "MASTER_PORT": str(free_port())},
        OMP_NUM_THREADS="1",
    )


def launch(work: Path, n: int, launcher: str, *extra: str) -> Run:
    """Start the slow trainer in its own session; output goes to ``work/log<n>.txt``."""
    log = work / f"log{n}.txt"
    (work / "pids").mkdir(exist_ok=True)
    for old in (work / "pids").iterdir():
        old.unlink()
    cmd = command(launcher, [*app_args(work), *SLOW, *extra])
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env(work), stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    _LAUNCHED.append(Run(proc, log))
    return _LAUNCHED[-1]


def finish(run: Run, code: int | None = 0) -> str:
    """Wait for ``run`` to exit with ``code`` (``None``: any nonzero); return its output."""
    try:
        rc = run.proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        kill_everything(run)
        pytest.fail(f"run did not finish\n{run.text()}")
    ok = rc != 0 if code is None else rc == code
    assert ok, f"exit code {rc}, expected {code}\n{run.text()}"
    return run.text()


def resumed(run: Run) -> Callable[[], bool | None]:
    """A probe: ``True`` once the run's log says it resumed."""
    return lambda: True if "resumed from step" in run.text() else None


def assert_same_output(got: Path, reference: Path) -> None:
    got_data, got_attrs = read_out(got)
    ref_data, ref_attrs = read_out(reference)
    assert sorted(got_data) == sorted(ref_data) and ref_data
    for name, ref in ref_data.items():
        assert got_data[name] == ref, f"dataset {name} differs from the uninterrupted run"
    assert got_attrs["steps"] == ref_attrs["steps"] == STEPS
    assert repr(got_attrs["final_loss"]) == repr(ref_attrs["final_loss"])


def flip_byte_in_data(step_dir: Path) -> None:
    """Corrupt one byte inside a weight tensor of rank 0's data file (its checksum will fail)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    rank0 = manifest["ranks"][0]
    cols = rank0["datasets"]
    i = cols["names"].index("model/3.weight")
    entry = {"offset": cols["offsets"][i], "nbytes": 4 * math.prod(cols["shapes"][i])}
    path = step_dir / rank0["file"]
    with open(path, "r+b") as f:
        f.seek(entry["offset"] + entry["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory; a run a failed test left behind is killed with all its processes."""
    yield tmp_path
    while _LAUNCHED:
        run = _LAUNCHED.pop()
        if run.proc.poll() is None:
            kill_everything(run)


def uninterrupted(work: Path, launcher: str, *extra: str) -> Path:
    """An uninterrupted 2-process run's output (saving every 20 steps)."""
    proc = subprocess.run(
        command(launcher, [*app_args(work), *extra]), cwd=REPO, env=env(work),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"done: {STEPS} steps" in proc.stdout, proc.stdout + proc.stderr
    return work / "out.h5"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process DDP run's output (torchrun)."""
    return uninterrupted(tmp_path_factory.mktemp("reference"), "torchrun")


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process FSDP2 run's output (mpiexec)."""
    return uninterrupted(tmp_path_factory.mktemp("fsdp2"), "mpiexec", "--strategy", "fsdp2")


# --------------------------------------------------------------------------- launch environment


def test_launch_environment_of_each_launcher() -> None:
    one = find_launch({}, task="/ck/a")
    assert (one.rank, one.world_size, one.master_addr, one.source) == (
        0, 1, "127.0.0.1", "single process"
    )  # fmt: skip
    assert 20000 <= one.master_port < 40000
    assert find_launch({}, task="/ck/a") == one  # every rank derives the same port ...
    assert find_launch({}, task="/ck/b").master_port != one.master_port  # ... tasks differ
    in_job = find_launch({"SLURM_JOB_ID": "17"}, task="/ck/a")
    assert in_job.master_port != one.master_port
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    assert find_launch(torchrun) == Launch(
        rank=1, world_size=4, master_addr="h0", master_port=1234, source="torchrun"
    )
    hydra = find_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_PORT": "4000"})
    assert (hydra.rank, hydra.world_size, hydra.source) == (1, 2, "hydra")
    assert (hydra.master_addr, hydra.master_port) == ("127.0.0.1", 4000)
    ompi = find_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"})
    assert (ompi.rank, ompi.world_size, ompi.source) == (2, 3, "openmpi")
    srun = find_launch({
        "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "16",
        "SLURM_STEP_NODELIST": "cn[017-020,031],gpu1", "SLURM_JOB_ID": "123456",
    })  # fmt: skip
    assert (srun.rank, srun.world_size, srun.source) == (3, 8, "srun")
    assert srun.master_addr == "cn017"
    # a batch shell (no job step) is one process, whatever the allocation's size
    batch = find_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "7"})
    assert (batch.world_size, batch.source) == (1, "single process")
    assert first_host("node7") == "node7" and first_host("a[2,5-6]") == "a2"
    for bad in ({"RANK": "x", "WORLD_SIZE": "2"}, {"PMI_RANK": "2", "PMI_SIZE": "2"},
                {"MASTER_PORT": "http"}, {"MASTER_PORT": "70000"}):  # fmt: skip
        with pytest.raises(ConfigError):
            find_launch(bad)


# --------------------------------------------------------------------------- kill and resume


def test_uninterrupted_run_writes_the_model(reference: Path) -> None:
    data, attrs = read_out(reference)
    assert set(data) == {f"{layer}.{p}" for layer in (0, 3, 6) for p in ("weight", "bias")}
    assert attrs["steps"] == STEPS
    assert 0.0 < attrs["final_loss"] < 1.5


@pytest.mark.skipif(not HAVE_PROC, reason="finding the ranks to SIGKILL needs /proc")
def test_sigkill_of_everything_twice_under_mpiexec_is_bit_identical(
    work: Path, reference: Path
) -> None:
    """SIGKILL mpiexec and both ranks twice (once in each epoch); resume each time."""
    ckpt = work / "ckpt"
    previous: int | None = None
    for attempt, target in enumerate((15, 40)):
        run = launch(work, attempt, "mpiexec")
        if previous is not None:
            wait_for("the resume", resumed(run), run)
            assert f"resumed from step {previous}" in run.text()
        wait_for(f"a checkpoint after step {target}", newer_than(ckpt, target), run)
        time.sleep(0.07 * attempt)  # vary where the kill lands relative to a save
        kill_everything(run)
        now = latest_step(ckpt)
        assert now is not None and now < STEPS, "the run finished before it could be killed"
        previous = now
    text = finish(launch(work, 2, "mpiexec"), 0)
    assert f"resumed from step {previous}" in text, text
    assert_same_output(work / "out.h5", reference)


def test_sigterm_to_torchrun_then_resume_is_bit_identical(work: Path, reference: Path) -> None:
    """SIGTERM to torchrun (it forwards SIGTERM to its workers): both stop at one step, saved."""
    ckpt = work / "ckpt"
    run = launch(work, 0, "torchrun")
    wait_for("the ranks' pid files", lambda: rank_pids(work), run)
    wait_for("a checkpoint in the first epoch", newer_than(ckpt, 10), run)
    run.proc.send_signal(signal.SIGTERM)
    text = finish(run, None)  # torchrun reports its workers' exit 75 as a failure
    stopped = stopped_steps(text)
    assert set(stopped) == set(range(NRANKS)), text
    assert len(set(stopped.values())) == 1, f"ranks stopped at different steps: {stopped}"
    assert latest_step(ckpt) == stopped[0] and 0 < stopped[0] < STEPS
    assert "Received 15 death signal" in text, text  # torchrun's own message
    assert not (work / "out.h5").exists()
    text = finish(launch(work, 1, "torchrun"), 0)
    assert f"resumed from step {stopped[0]}" in text, text
    assert_same_output(work / "out.h5", reference)


def test_fsdp2_walltime_stops_via_resilient_run_are_bit_identical(
    work: Path, fsdp2_reference: Path
) -> None:
    """``--strategy fsdp2`` (each rank saves its shards of the model and of AdamW's state, as
    DTensors, restored in place) under ``resilient run --walltime`` with mpiexec: two attempts
    stopped by the warning signal (SIGUSR1, exit 75), then one that finishes, bit-identical to
    an uninterrupted FSDP2 run.

    The warning comes 12 s after each attempt's start, long before its walltime and kill: a
    start-up slower than that (torch's imports take 3-25 s on two busy cores) only delays the
    stop to the first step of the attempt (``Session.should_stop``), so each attempt makes
    progress. At 0.4 s a step the two stopped attempts cannot reach step 60 however fast torch
    starts; the third runs without a walltime and without the slow-down.
    """
    ckpt = work / "ckpt"
    policy = work / "policy.yaml"
    policy.write_text(
        "checkpoint_comm: node\nsave_when: {every_steps: 10, on_signal: true}\n"
        "keep: {last: 2}\nwalltime_margin_s: 0.2\n"
    )
    app = [*app_args(work), "--strategy", "fsdp2", "--config", str(policy)]
    stopped = ["--walltime", "200", "--signal", "USR1@188", "--kill-wait", "60"]
    codes, logs = [], []
    for attempt in range(3):
        last = attempt == 2
        cmd = [
            sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
            *([] if last else stopped), "--",
            *command("mpiexec", [*app, *([] if last else ["--step-delay", "0.4"])]),
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, cwd=REPO, env=env(work), capture_output=True, text=True, timeout=280
        )
        logs.append(proc.stdout + proc.stderr)
        (work / f"log{attempt}.txt").write_text(logs[-1])
        codes.append(proc.returncode)
        assert proc.returncode == (0 if last else EXIT_RESUME), (codes, logs[-1])
        if not last:
            assert "reason=signal SIGUSR1" in logs[-1], logs[-1]
            assert "SIGKILL" not in logs[-1], logs[-1]
    ledger = read_ledger(ckpt)
    assert [r["exit_code"] for r in ledger] == codes
    for before, after in itertools.pairwise(ledger):
        assert after["latest_before"] == before["latest_after"], ledger
    assert 0 < ledger[0]["latest_after"] < ledger[1]["latest_after"] < STEPS, ledger
    latest = [r for r in list_checkpoints(ckpt) if r.status == "valid"][-1]
    assert latest.manifest is not None and latest.manifest.layout.kind == "node"
    assert_same_output(work / "out.h5", fsdp2_reference)


def test_torchrun_under_resilient_run_walltime_exits_75_and_resumes(
    work: Path, reference: Path
) -> None:
    """``resilient run --walltime -- torchrun ...`` (as docs/howto/pytorch.md says): the warning
    signal reaches torchrun's workers (``resilient run`` signals the whole process tree), both
    checkpoint one step and exit 75, torchrun exits 1, and ``resilient run`` reports 75 since a
    newer checkpoint exists; the run then resumes bit-identically.

    The warning comes 15 s after the start (a start-up slower than that only delays the stop to
    the first step); the walltime and the kill-wait are long, so that torch's exit (7-11 s on two
    overloaded cores) is never cut short by a kill.
    """
    ckpt = work / "ckpt"
    cmd = [
        sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
        "--walltime", "200", "--signal", "USR1@185", "--kill-wait", "60", "--",
        *command("torchrun", [*app_args(work), "--step-delay", "0.5", "--checkpoint-every", "5"]),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env(work), capture_output=True, text=True, timeout=280)
    text = proc.stdout + proc.stderr
    (work / "log0.txt").write_text(text)
    assert proc.returncode == EXIT_RESUME, text
    stopped = stopped_steps(text)
    assert set(stopped) == set(range(NRANKS)), text
    assert len(set(stopped.values())) == 1, f"ranks stopped at different steps: {stopped}"
    assert all("reason=signal SIGUSR1" in line for line in text.splitlines() if "STOPPED" in line)
    assert "failed (exitcode: 75)" in text, text  # torchrun's own report of its workers
    assert "exited 1 after SIGUSR1 after a newer checkpoint" in text, text
    assert "SIGKILL" not in text, text
    assert [r["exit_code"] for r in read_ledger(ckpt)] == [EXIT_RESUME]
    assert latest_step(ckpt) == stopped[0] and 0 < stopped[0] < STEPS
    text = finish(launch(work, 1, "torchrun"), 0)
    assert f"resumed from step {stopped[0]}" in text, text
    assert_same_output(work / "out.h5", reference)


def test_corrupt_newest_checkpoint_falls_back_and_stays_bit_identical(
    work: Path, reference: Path
) -> None:
    """A flipped byte in the newest checkpoint's data: quarantined, the older one is used."""
    ckpt = work / "ckpt"
    run = launch(work, 0, "mpiexec")
    wait_for("the ranks' pid files", lambda: rank_pids(work), run)
    wait_for("a checkpoint after step 20", newer_than(ckpt, 20), run)
    run.proc.send_signal(signal.SIGTERM)  # hydra forwards it to both ranks
    text = finish(run, EXIT_RESUME)
    newest = stopped_steps(text)[0]
    valid = [r.step for r in list_checkpoints(ckpt) if r.status == "valid"]
    assert valid[-1] == newest and len(valid) >= 2, valid
    older = valid[-2]
    flip_byte_in_data(ckpt / f"step_{newest:08d}")

    text = finish(launch(work, 1, "mpiexec"), 0)
    assert f"resumed from step {older}" in text, text
    assert "quarantin" in text.lower() or "checksum" in text.lower(), text
    assert any(p.name.startswith(f"step_{newest:08d}.quarantined-") for p in ckpt.iterdir())
    assert_same_output(work / "out.h5", reference)
