"""End-to-end: ``apps.train`` killed and resumed ends bit-identical to an uninterrupted run.

Each test runs the example trainer on 2 real MPI ranks (``mpiexec`` from the mpich wheel),
interrupts it (SIGKILL of every process, SIGUSR1 to one rank, SIGTERM to ``mpiexec``), resumes
it from its checkpoints and compares every dataset of the output with a reference run's, byte
for byte. Also: ``--config`` YAML sets the checkpoint policy without changing the results.

The SIGKILL test finds hydra's proxy and the ranks through ``/proc`` (each is in a session of
its own, so killing mpiexec's process group alone leaves them to die later); the SIGUSR1 test
finds the rank pids through the app's ``$RESILIENT_TEST_PIDFILE_DIR`` hook.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import h5py
import numpy as np
import pytest

from resilient.io.checkpoints import latest_valid, list_checkpoints
from tests.mpirun import REPO, clean_env, mpiexec, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

NRANKS = 2
STEPS = 60
SLOW = ["--step-delay", "0.05", "--checkpoint-every", "5"]
PIDFILE_ENV = "RESILIENT_TEST_PIDFILE_DIR"
EXIT_RESUME = 75
HAVE_PROC = Path("/proc/self/stat").exists()

T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


@dataclass
class Run:
    """One launch of the trainer: its process (session leader: mpiexec) and its log file."""

    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


_LAUNCHED: list[Run] = []  # runs of the current test, killed at its teardown if still going


def train_args(work: Path) -> list[str]:
    return [
        "-m", "apps.train", "--steps", str(STEPS),
        "--checkpoint-dir", str(work / "ckpt"), "--out", str(work / "out.h5"),
    ]  # fmt: skip


def launch(work: Path, n: int) -> Run:
    """Start the slow trainer in its own session; output goes to ``work/log<n>.txt``."""
    log = work / f"log{n}.txt"
    env = clean_env(**{PIDFILE_ENV: str(work / "pids")})
    cmd = [mpiexec(), "-n", str(NRANKS), sys.executable, *train_args(work), *SLOW]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    _LAUNCHED.append(Run(proc, log))
    return _LAUNCHED[-1]


def wait_for(what: str, probe: Callable[[], T | None], run: Run, timeout: float = 60) -> T:
    """Poll ``probe`` until it returns something; fail if the run exits or time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = probe()
        if value is not None:
            return value
        if run.proc.poll() is not None:
            pytest.fail(f"run exited {run.proc.returncode} while waiting for {what}\n{run.text()}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}\n{run.text()}")


def latest_step(root: Path) -> int | None:
    rec = latest_valid(root)
    return None if rec is None else rec.step


def newer_than(root: Path, step: int) -> Callable[[], int | None]:
    """A probe: the latest valid step under ``root`` once it is beyond ``step``."""

    def probe() -> int | None:
        latest = latest_step(root)
        return latest if latest is not None and latest > step else None

    return probe


def wait_for_output(run: Run, text: str) -> None:
    wait_for(repr(text), lambda: True if text in run.text() else None, run)


def proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of a live process from ``/proc``, or ``None`` if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (fields[0], int(fields[1])) if fields[0] not in ("Z", "X") else None


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (hydra's proxy and the ranks, each in its own session)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if HAVE_PROC else ():
        if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_everything(run: Run) -> None:
    """SIGKILL mpiexec's process group and every rank at once; wait until all are gone."""
    tree = descendants(run.proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.proc.wait(timeout=30)
    end = time.monotonic() + 30
    while any(proc_stat(pid) is not None for pid in tree):
        assert time.monotonic() < end, f"processes {tree} survived SIGKILL"
        time.sleep(0.02)


def rank_pids(work: Path) -> dict[int, int] | None:
    """The ranks' pids from the app's test hook, once every rank has written its file."""
    pids = {}
    for r in range(NRANKS):
        path = work / "pids" / f"rank{r}.pid"
        if not path.exists():
            return None
        pids[r] = int(path.read_text())
    return pids


def finish(run: Run, code: int = 0) -> str:
    """Wait for ``run`` to exit with ``code``; return its output."""
    try:
        rc = run.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        pytest.fail(f"run did not finish\n{run.text()}")
    assert rc == code, f"exit code {rc}, expected {code}\n{run.text()}"
    return run.text()


def stopped_steps(text: str) -> dict[int, int]:
    """``rank -> step`` from the app's ``STOPPED rank=R step=S`` lines."""
    return {int(r): int(s) for r, s in re.findall(r"STOPPED rank=(\d+) step=(\d+)", text)}


def read_out(path: Path) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Every dataset's raw bytes (with dtype and shape) and the attributes of an output file."""
    with h5py.File(path, "r") as f:
        data = {
            name: f"{ds.dtype.str}{ds.shape}".encode() + ds[()].tobytes()
            for name, ds in f.items()
            if isinstance(ds, h5py.Dataset)
        }
        attrs = {k: v.item() if hasattr(v, "item") else v for k, v in f.attrs.items()}
    return data, attrs


def assert_same_output(got: Path, reference: Path) -> None:
    got_data, got_attrs = read_out(got)
    ref_data, ref_attrs = read_out(reference)
    assert sorted(got_data) == sorted(ref_data) and ref_data
    for name, ref in ref_data.items():
        assert got_data[name] == ref, f"dataset {name} differs from the uninterrupted run"
    assert got_attrs["steps"] == ref_attrs["steps"] == STEPS
    assert repr(got_attrs["final_loss"]) == repr(ref_attrs["final_loss"])


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory; a run a failed test left behind is killed with all its ranks."""
    yield tmp_path
    while _LAUNCHED:
        run = _LAUNCHED.pop()
        if run.proc.poll() is None:
            kill_everything(run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """(1) An uninterrupted 2-rank run's output."""
    work = tmp_path_factory.mktemp("reference")
    proc = run_mpi(NRANKS, train_args(work), timeout=120)
    assert f"done: {STEPS} steps" in proc.stdout, proc.stdout + proc.stderr
    return work / "out.h5"


# --------------------------------------------------------------------------- tests


def test_uninterrupted_run_writes_the_model(reference: Path) -> None:
    data, attrs = read_out(reference)
    assert set(data) == {"w1", "b1", "w2", "b2"}
    assert attrs["steps"] == STEPS
    assert 0.0 < attrs["final_loss"] < 1.0


@pytest.mark.skipif(not HAVE_PROC, reason="finding the ranks to SIGKILL needs /proc")
def test_three_sigkills_then_completion_is_bit_identical(work: Path, reference: Path) -> None:
    """(2) Kill every process with SIGKILL three times at varying phases; resume each time."""
    ckpt = work / "ckpt"
    previous: int | None = None
    # kills land near steps 15, 30, 45: resumes in several epochs (16 steps each), at varying
    # phases relative to the saves (every 5 steps)
    for attempt, extra_delay in enumerate((0.0, 0.07, 0.16)):
        run = launch(work, attempt)
        if previous is not None:
            wait_for_output(run, f"resumed from step {previous}")
        start = previous if previous is not None else -1
        target = max(start, 15 * (attempt + 1) - 5)
        wait_for(f"a checkpoint after step {target}", newer_than(ckpt, target), run)
        time.sleep(extra_delay)  # vary where the kill lands relative to a save
        kill_everything(run)
        now = latest_step(ckpt)
        assert now is not None and now > start, f"no progress across attempt {attempt}"
        assert now < STEPS, "the run finished before it could be killed: slow it down"
        previous = now
    run = launch(work, 3)
    text = finish(run, 0)
    assert f"resumed from step {previous}" in text, text
    assert_same_output(work / "out.h5", reference)


@pytest.mark.parametrize("target", [0, 1], ids=["rank0", "rank1"])
def test_sigusr1_to_one_rank_stops_all_at_one_step(
    work: Path, reference: Path, target: int
) -> None:
    """(3) SIGUSR1 to one rank only: every rank stops at the same step, saved; resume matches."""
    ckpt = work / "ckpt"
    run = launch(work, 0)
    pids = wait_for("the ranks' pid files", lambda: rank_pids(work), run)
    wait_for("a checkpoint in the second epoch", newer_than(ckpt, 16), run)
    os.kill(pids[target], signal.SIGUSR1)
    text = finish(run, EXIT_RESUME)
    stopped = stopped_steps(text)
    assert set(stopped) == set(range(NRANKS)), text
    assert len(set(stopped.values())) == 1, f"ranks stopped at different steps: {stopped}"
    step = stopped[0]
    assert 0 < step < STEPS
    assert latest_step(ckpt) == step
    assert f"STOPPED rank={target} step={step} reason=signal SIGUSR1" in text
    assert not (work / "out.h5").exists()
    text = finish(launch(work, 1), 0)
    assert f"resumed from step {step}" in text, text
    assert_same_output(work / "out.h5", reference)


def test_sigterm_to_mpiexec_then_resume_is_bit_identical(work: Path, reference: Path) -> None:
    """(4) SIGTERM to mpiexec (forwarded to every rank by hydra): exit 75, then resume."""
    ckpt = work / "ckpt"
    run = launch(work, 0)
    wait_for("the ranks' pid files", lambda: rank_pids(work), run)
    wait_for("a checkpoint in the third epoch", newer_than(ckpt, 32), run)
    run.proc.send_signal(signal.SIGTERM)
    text = finish(run, EXIT_RESUME)
    stopped = stopped_steps(text)
    assert len(stopped) == NRANKS and len(set(stopped.values())) == 1, text
    assert latest_step(ckpt) == stopped[0]
    text = finish(launch(work, 1), 0)
    assert f"resumed from step {stopped[0]}" in text, text
    assert_same_output(work / "out.h5", reference)


def test_config_file_sets_the_checkpoint_policy(work: Path, reference: Path) -> None:
    """(5) ``--config``: layout, cadence and rotation come from the YAML; results do not change."""
    config = work / "ckpt.yaml"
    config.write_text(
        "checkpoint_comm: world\nsave_when: {every_steps: 7}\nkeep: {last: 2}\n"
        "walltime_margin_s: 5\n"
    )
    run_mpi(NRANKS, [*train_args(work), "--config", str(config)], timeout=120)
    steps = [r.step for r in list_checkpoints(work / "ckpt") if r.status == "valid"]
    assert steps == [56, STEPS]  # the last two: every 7th step, then the final one
    latest = latest_valid(work / "ckpt")
    assert latest is not None and latest.manifest is not None
    assert latest.manifest.layout.kind == "world"
    assert_same_output(work / "out.h5", reference)


def test_bad_config_file_is_a_usage_error(work: Path) -> None:
    """(6) An invalid ``--config`` exits 2 on every rank with the offending key named."""
    config = work / "bad.yaml"
    config.write_text("checkpoint_comm: world\nsave_every: 7\n")
    proc = run_mpi(NRANKS, [*train_args(work), "--config", str(config)], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown key 'save_every'" in proc.stderr
    assert not (work / "ckpt").exists()


@pytest.mark.parametrize("n", [1, 3])
def test_a_2_rank_checkpoint_resumes_on_n_ranks_within_tolerance(
    work: Path, reference: Path, n: int
) -> None:
    """(6) Saved on 2 ranks at step 30, resumed on ``n``: the same global batches follow, so the
    model matches the uninterrupted 2-rank run's to rtol 1e-9 (the gradient sums are added in
    another order: measured differences are about 1e-14 relative), not bit for bit."""
    args = train_args(work)
    half = [*args[: args.index("--steps") + 1], "30", *args[args.index("--steps") + 2 :]]
    run_mpi(NRANKS, half, timeout=120)
    proc = run_mpi(n, train_args(work), timeout=120)
    assert "resumed from step 30" in proc.stderr, proc.stderr
    _, got_attrs = read_out(work / "out.h5")
    _, want_attrs = read_out(reference)
    assert got_attrs["steps"] == STEPS
    with h5py.File(work / "out.h5") as got, h5py.File(reference) as want:
        assert set(got) == set(want) == {"w1", "b1", "w2", "b2"}
        for name in want:
            np.testing.assert_allclose(
                got[name][()], want[name][()], rtol=1e-9, atol=1e-12, err_msg=name
            )
    assert abs(got_attrs["final_loss"] - want_attrs["final_loss"]) <= 1e-9
