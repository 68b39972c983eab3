"""``resilient run`` end to end with real MPI ranks, real signals and real kills."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import pytest

from resilient.io.checkpoints import latest_valid, list_checkpoints
from resilient.job.ledger import read_ledger
from resilient.job.process import cmdline, descendants, parent
from resilient.model.filenames import parse_step_dir
from tests.mpirun import REPO, clean_env, mpiexec
from tests.unit.ckutil import flip_dataset_byte

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

STEPS = 120


def heat_cmd(
    ckpt: Path,
    out: Path,
    *,
    n: int = 4,
    delay: float = 0.01,
    program: str = "apps.heat",
    config: str | None = "configs/checkpoint/demo.yaml",
) -> list[str]:
    """``apps.heat`` on ``n`` ranks; ``config=None``: the app's own defaults (margin 10 s)."""
    script = ["-m", "apps.heat"] if program == "apps.heat" else [program]
    return [
        mpiexec(), "-n", str(n), sys.executable, *script, "--nx", "64", "--ny", "48",
        "--steps", str(STEPS), "--checkpoint-dir", str(ckpt), "--out", str(out),
        "--checkpoint-every", "10", "--step-delay", str(delay),
        *(["--config", str(REPO / config)] if config else []),
    ]  # fmt: skip


def resilient_run(args: list[str], cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = [sys.executable, "-m", "resilient.cli", "run", *args, "--", *cmd]
    return subprocess.run(
        full, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("ref")
    cmd = heat_cmd(d / "ck", d / "out.h5", delay=0.0)
    subprocess.run(cmd, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=120)
    with h5py.File(d / "out.h5") as f:
        return bytes(f["T"][()].tobytes())


def field(path: Path) -> bytes:
    with h5py.File(path) as f:
        assert int(f.attrs["steps"]) == STEPS
        return bytes(f["T"][()].tobytes())


def test_walltime_kills_resume_bit_identically(tmp_path: Path, reference: bytes) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    codes = []
    for _ in range(40):
        proc = resilient_run(
            [
                "--checkpoint-dir",
                str(ckpt),
                "--walltime",
                "4",
                "--signal",
                "USR1@1",
                "--kill-wait",
                "1",
            ],
            heat_cmd(ckpt, out, delay=0.06),
        )
        codes.append(proc.returncode)
        if proc.returncode == 0:
            break
        assert proc.returncode == 75, proc.stderr
    assert codes[-1] == 0 and codes.count(75) >= 3, codes
    assert field(out) == reference
    ledger = read_ledger(ckpt)
    assert [r["exit_code"] for r in ledger] == codes
    assert all(r["progress"] for r in ledger[:-1])
    assert all(r["latest_after"] > (r["latest_before"] or 0) for r in ledger[:-1])


def test_walltime_stops_on_4_ranks_resume_on_other_rank_counts(
    tmp_path: Path, reference: bytes
) -> None:
    """Each attempt gets another rank count (a requeued job on another allocation): every one
    resumes where the last stopped, and the result is the uninterrupted 4-rank run's."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    opts = ["--checkpoint-dir", str(ckpt), "--walltime", "4", "--signal", "USR1@1",
            "--kill-wait", "1"]  # fmt: skip
    codes = []
    for n in [4, 2, 3, 1, 6, 4, 2, 3, 1, 6]:
        proc = resilient_run(opts, heat_cmd(ckpt, out, n=n, delay=0.06))
        codes.append((n, proc.returncode))
        if proc.returncode == 0:
            break
        assert proc.returncode == 75, proc.stderr
    assert codes[-1][1] == 0 and len(codes) >= 3, codes
    assert field(out) == reference
    ledger = read_ledger(ckpt)
    assert all(r["latest_after"] > (r["latest_before"] or 0) for r in ledger[:-1]), ledger
    for before, after in itertools.pairwise(ledger):
        assert after["latest_before"] == before["latest_after"]


def _wait_until_started(ckpt: Path, since: float, timeout_s: float = 60) -> None:
    """Until the program launched at ``since`` has restored (its first progress record)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            for line in (ckpt / "progress.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("time", 0) >= since:
                        return
        time.sleep(0.05)
    raise AssertionError(f"the program did not start within {timeout_s} s")


def test_hard_kills_at_random_moments_still_bit_identical(tmp_path: Path, reference: bytes) -> None:
    """SIGKILL of every process (a node crash) and SIGTERM (preemption) at random moments."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    rng = random.Random(20261122)
    kinds = []
    for i in range(40):
        full = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt), "--kill-wait", "2",
                "--", *heat_cmd(ckpt, out, delay=0.05)]  # fmt: skip
        launched = time.time()
        proc = subprocess.Popen(full, cwd=REPO, env=clean_env(), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        if i < 6:
            time.sleep(rng.uniform(1.2, 2.0))
            if proc.poll() is not None:
                break
            if i % 2 == 0:  # crash: everything dies at once, the wrapper too
                tree = descendants(proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in tree:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                kinds.append("SIGKILL")
            else:  # preemption: SIGTERM to the wrapper, which forwards it, once the
                # program is up (a signal during Python's start-up kills it before its
                # handlers exist: exit 1, as for any program; under load that took > 2 s)
                _wait_until_started(ckpt, launched)
                time.sleep(rng.uniform(0.0, 0.5))
                proc.send_signal(signal.SIGTERM)
                kinds.append("SIGTERM")
        code = proc.wait(timeout=120)
        if i >= 6 and code == 0:
            break
    assert kinds.count("SIGKILL") >= 2 and kinds.count("SIGTERM") >= 2, kinds
    assert field(out) == reference
    terms = [r for r in read_ledger(ckpt) if r.get("signal") == "SIGTERM"]
    assert len(terms) == kinds.count("SIGTERM") and all(r["exit_code"] == 75 for r in terms), terms


def _ranks_of(pid: int) -> list[int]:
    """The ranks (``python -m apps.heat``) below ``pid``, once they run."""
    found = []
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"apps.heat" in argv and not any(b"mpiexec" in w for w in argv[:1]):
                found.append(child)
    return found


def test_quick_kills_from_outside_do_not_park_a_task(tmp_path: Path, reference: bytes) -> None:
    """Issue 33: two SIGKILLs of the ranks in a row before any checkpoint (a node that dies
    twice at a job's start, quick preemptions) ended a kill soak in 93, and every later run was
    refused. They are interrupted attempts, not attempts without progress."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    full = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
            "--max-no-progress", "2", "--", *heat_cmd(ckpt, out, n=2, delay=0.03)]  # fmt: skip
    for _ in range(2):
        proc = subprocess.Popen(full, cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while len(ranks := _ranks_of(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in ranks:  # during their imports: long before the first checkpoint
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode not in (0, 75, 93), err[-3000:]
    ledger = read_ledger(ckpt)
    assert [r["interrupted"] for r in ledger] == ["SIGKILL", "SIGKILL"], ledger
    assert not any(r["progress"] for r in ledger) and latest_valid(ckpt) is None
    assert all("killed from outside (SIGKILL" in r["reason"] for r in ledger), ledger
    # an engine's retry of the same run is not refused: it starts, and finishes
    done = resilient_run(["--checkpoint-dir", str(ckpt), "--max-no-progress", "2"],
                         heat_cmd(ckpt, out, n=2, delay=0.03))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert field(out) == reference


def after_first_checkpoint(
    cmd: list[str], ckpt: Path, act: Callable[[subprocess.Popen[str]], None],
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Start ``cmd`` (a ``resilient run``), ``act`` on it once ``ckpt`` has a committed step,
    wait for it: its exit code and its stderr."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env or clean_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while latest_valid(ckpt) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        act(proc)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return proc.returncode, err


def _processes_naming(text: str) -> list[int]:
    """The live processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


@pytest.mark.each_mpi
def test_a_killed_launcher_leaves_no_rank_behind_and_the_run_resumes(
    tmp_path: Path, reference: bytes
) -> None:
    """SIGKILL of the launcher alone (``mpiexec``), its ranks running: the attempt ends as one
    killed from outside, after progress (75), with none of its ranks left running to write
    into the checkpoint directory beside the next attempt; that attempt finishes the run."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
           "--", *heat_cmd(ckpt, out, n=2, delay=0.05)]  # fmt: skip

    def kill_the_launcher(proc: subprocess.Popen[str]) -> None:
        (launcher,) = [p for p in descendants(proc.pid) if parent(p) == proc.pid]
        assert cmdline(launcher)[1:3] == ["-n", "2"], cmdline(launcher)  # Open MPI: prterun
        os.kill(launcher, signal.SIGKILL)

    code, err = after_first_checkpoint(cmd, ckpt, kill_the_launcher)
    assert code == 75, err[-3000:]
    (rec,) = read_ledger(ckpt)
    assert rec["interrupted"] == "SIGKILL" and rec["progress"], rec
    deadline = time.monotonic() + 5
    while (left := _processes_naming(str(ckpt))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"ranks outlived their launcher: {[cmdline(p) for p in left]}"
    done = resilient_run(["--checkpoint-dir", str(ckpt)], heat_cmd(ckpt, out, n=2, delay=0.0))
    assert done.returncode == 0, done.stderr[-3000:]
    assert field(out) == reference


def test_kill_during_a_save_falls_back_and_matches(tmp_path: Path, reference: bytes) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = heat_cmd(ckpt, out, program="tests/mpi/faulty_heat.py")
    first = resilient_run(["--checkpoint-dir", str(ckpt)], cmd, FAULT="killsave@30:1")
    assert first.returncode != 0
    latest = latest_valid(ckpt)
    assert latest is not None and latest.step == 20, latest
    assert not [p for p in ckpt.iterdir() if p.name.startswith("step_00000030")]
    second = resilient_run(["--checkpoint-dir", str(ckpt)], cmd, FAULT="killsave@30:1")
    assert second.returncode == 0, second.stderr
    assert field(out) == reference


def test_warning_to_one_rank_stops_all_ranks_at_the_same_step(
    tmp_path: Path, reference: bytes
) -> None:
    ckpt, out, stoplog = tmp_path / "ck", tmp_path / "out.h5", tmp_path / "stops.txt"
    cmd = heat_cmd(ckpt, out, program="tests/mpi/faulty_heat.py")
    proc = resilient_run(
        ["--checkpoint-dir", str(ckpt)], cmd, FAULT="usr1@17:2", STOPLOG=str(stoplog)
    )
    assert proc.returncode == 75, proc.stderr
    stops = sorted(tuple(map(int, line.split())) for line in stoplog.read_text().splitlines())
    assert [r for r, _ in stops] == [0, 1, 2, 3]
    (step,) = {s for _, s in stops}
    latest = latest_valid(ckpt)
    assert latest is not None and latest.step == step
    assert step in (
        17,
        18,
    )  # the signal lands during step 17; the stop is agreed at that step's check
    done = resilient_run(["--checkpoint-dir", str(ckpt)], heat_cmd(ckpt, out))
    assert done.returncode == 0, done.stderr
    assert field(out) == reference


def test_no_progress_gives_93_and_progress_never_does(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    args = ["--checkpoint-dir", str(ckpt), "--max-no-progress", "3"]
    codes = [resilient_run(args, crash).returncode for _ in range(3)]
    # the next task of a Slurm job array that chains the run: an engine's retry
    chained = {"SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1"}
    retry = resilient_run(args, crash, **chained)
    assert [*codes, retry.returncode] == [3, 3, 93, 93]
    assert "not starting again for this retry (task 4 of job array 5)" in retry.stderr
    ledger = read_ledger(ckpt)  # the 4th invocation refused to start: no new attempt
    assert [r["progress"] for r in ledger] == [False] * 3
    assert "no progress in 3 consecutive attempts" in ledger[2]["reason"]


@pytest.mark.each_mpi
def test_requeue_restarts_in_place_after_each_walltime_stop(
    tmp_path: Path, reference: bytes
) -> None:
    """One ``resilient run --requeue``: every simulated walltime stop starts the program again
    with a new walltime; one exit code (0) for the engine, one ledger line per stop."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    args = ["--checkpoint-dir", str(ckpt), "--walltime", "2.5", "--signal", "USR1@0.5"]
    proc = resilient_run(
        [*args, "--kill-wait", "1", "--requeue"], heat_cmd(ckpt, out, n=2, delay=0.03)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert field(out) == reference
    ledger = read_ledger(ckpt)
    codes = [r["exit_code"] for r in ledger]
    assert len(codes) >= 3 and codes[:-1] == [75] * (len(codes) - 1) and codes[-1] == 0, codes
    for before, after in itertools.pairwise(ledger):
        assert after["latest_before"] == before["latest_after"] is not None, ledger
    assert proc.stderr.count("requeued after attempt") == len(codes) - 1


def _report(ckpt: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "report", str(ckpt), "--json"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    (doc,) = json.loads(out.stdout)
    assert isinstance(doc, dict)
    return doc


def test_the_report_agrees_with_a_stopwatch(tmp_path: Path, reference: bytes) -> None:
    """Issue 32: the goodput counted start-up, restores and the final checkpoint as kept (92 %
    for 45 % by stopwatch). The same 2-rank program, uninterrupted and under a 3-s walltime
    with requeues, each timed from outside: the report's wall time is the stopwatch's, each
    attempt's phases add up to its wall time, and the goodput is no more than the share of the
    wall time the uninterrupted run needed."""
    cmd = functools.partial(heat_cmd, n=2, delay=0.03)
    walls = {}
    for name, extra in (("ref", []), ("cut", ["--walltime", "3", "--signal", "USR1@0.5", "--requeue"])):
        ckpt, out = tmp_path / name / "ck", tmp_path / name / "out.h5"
        t0 = time.time()
        proc = resilient_run(["--checkpoint-dir", str(ckpt), "--kill-wait", "1", *extra], cmd(ckpt, out))
        walls[name] = time.time() - t0
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert field(out) == reference
    ref, cut = _report(tmp_path / "ref" / "ck"), _report(tmp_path / "cut" / "ck")
    assert len(ref["attempts"]) == 1 and len(cut["attempts"]) >= 2, cut["attempts"]
    for doc, wall in ((ref, walls["ref"]), (cut, walls["cut"])):
        # resilient run's own start (imports) and exit are outside the attempts
        assert 0.85 * wall - 0.5 <= doc["wall_s"] <= wall, (doc["wall_s"], wall)
        for a in doc["attempts"]:
            parts = sum(a["phases"].values())
            assert parts == pytest.approx(a["end"] - a["start"], rel=0.05), a
        assert sum(doc["phases"].values()) + doc["between_s"] == pytest.approx(doc["wall_s"], rel=0.05)
        assert all(v >= 0 for v in doc["phases"].values()), doc["phases"]
    assert 0 < cut["goodput"] <= walls["ref"] / walls["cut"] + 0.05, (cut["goodput"], walls)
    assert 0 < ref["goodput"] < 1
    # each restart paid its start-up again: the interrupted run's is several times the other's
    assert cut["phases"]["startup_s"] > 1.5 * ref["phases"]["startup_s"], (cut, ref)
    # what the uninterrupted run computed, the interrupted one kept (the same steps)
    kept = cut["phases"]["compute_kept_s"]
    assert kept == pytest.approx(ref["phases"]["compute_kept_s"], rel=0.5), (cut, ref)


def test_a_fallback_is_said_and_the_ledger_has_the_step_restored(
    tmp_path: Path, reference: bytes
) -> None:
    """Issue 32: after a fallback the program said nothing of the step it resumed from, and
    the ledger read "latest valid step 150 -> 400" for a step 150 that was quarantined."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    args = ["--checkpoint-dir", str(ckpt), "--walltime", "3", "--signal", "USR1@0.5", "--kill-wait", "1"]
    first = resilient_run(args, heat_cmd(ckpt, out, n=2, delay=0.03))
    assert first.returncode == 75, first.stderr[-3000:]
    newest, older = (r.step for r in list_checkpoints(ckpt)[::-1][:2])
    flip_dataset_byte(ckpt / f"step_{newest:08d}")  # same size: only the checksums see it
    second = resilient_run(["--checkpoint-dir", str(ckpt)], heat_cmd(ckpt, out, n=2, delay=0.0))
    assert second.returncode == 0, second.stderr[-3000:]
    assert field(out) == reference
    said = f"resumed from step {older} in {ckpt}: the newer checkpoint(s) of step {newest} failed"
    assert said in second.stderr, second.stderr[-3000:]
    assert f"resumed from step {older} (step {newest} failed validation: quarantined)" in second.stderr
    last = read_ledger(ckpt)[-1]
    assert last["latest_before"] == newest  # the quick check passed it ...
    assert last["restored_step"] == older and last["passed_over"] == [newest]  # ... not the program


def test_requeue_leaves_a_stop_signal_from_outside_to_the_engine(tmp_path: Path) -> None:
    """A SIGTERM sent to ``resilient run`` (a user, a real scheduler) is not the simulated
    walltime's: the program checkpoints, and the run ends with 75 instead of starting again."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
           "--walltime", "120", "--requeue", "--", *heat_cmd(ckpt, out, n=2, delay=0.05)]  # fmt: skip
    code, err = after_first_checkpoint(cmd, ckpt, lambda proc: proc.send_signal(signal.SIGTERM))
    assert code == 75, err[-3000:]
    (rec,) = read_ledger(ckpt)
    assert rec["exit_code"] == 75 and rec["progress"], rec
    assert "requeued" not in err


def test_in_a_flux_job_sigalrm_is_passed_on_saved_and_resumed(
    tmp_path: Path, reference: bytes
) -> None:
    """Flux's time limit: SIGALRM to the job's task (here ``resilient run``), SIGKILL 5 s later.
    In a Flux job (``$FLUX_JOB_ID``; a stand-in ``flux`` says 3600 s are left) the wrapper
    passes it on instead of dying of it, the ranks save the step (their saves are quick) and
    exit 75; resubmitted, the run resumes and matches the uninterrupted one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "flux").write_text("#!/bin/sh\necho 3600\n")
    (bin_dir / "flux").chmod(0o755)
    env = clean_env(FLUX_JOB_ID="f3Vq8Z1rN2", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt), "--",
           *heat_cmd(ckpt, out, n=2, delay=0.05)]  # fmt: skip
    code, err = after_first_checkpoint(
        cmd, ckpt, lambda proc: proc.send_signal(signal.SIGALRM), env=env
    )
    assert code == 75, err[-3000:]
    (rec,) = read_ledger(ckpt)
    assert (rec["exit_code"], rec["signal"]) == (75, "SIGALRM"), rec
    assert rec["program_stop"]["reason"] == "signal SIGALRM" and rec["progress"], rec
    assert "forwarding SIGALRM to the program" in err, err[-3000:]
    again = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )  # the engine's resubmission
    assert again.returncode == 0, again.stderr[-3000:]
    assert field(out) == reference


def test_requeue_needs_a_simulated_walltime(tmp_path: Path) -> None:
    proc = resilient_run(["--checkpoint-dir", str(tmp_path / "ck"), "--requeue"], ["true"])
    assert proc.returncode == 2 and "--requeue needs --walltime" in proc.stderr


def test_retries_inside_one_run_survive_two_random_crashes(
    tmp_path: Path, reference: bytes
) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = heat_cmd(ckpt, out, program="tests/mpi/faulty_heat.py")
    proc = resilient_run(
        ["--checkpoint-dir", str(ckpt), "--retries", "3", "--backoff", "0.1:0.5"],
        cmd,
        FAULT="randomcrash:1,2",
    )
    assert proc.returncode == 0, proc.stderr
    assert field(out) == reference
    ledger = read_ledger(ckpt)
    codes = [r["exit_code"] for r in ledger]
    assert len(codes) == 3 and codes[2] == 0, codes
    assert all(c not in (0, 74, 75, 93) for c in codes[:2]), (
        codes
    )  # mpiexec reports the crash its own way
    assert proc.stderr.count("retrying from the latest valid checkpoint") == 2


def test_enospc_is_not_retried(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = heat_cmd(ckpt, out, program="tests/mpi/faulty_heat.py")
    proc = resilient_run(
        ["--checkpoint-dir", str(ckpt), "--retries", "3", "--backoff", "0.1"],
        cmd,
        FAULT="enospc@20",
    )
    assert proc.returncode == 74, (proc.returncode, proc.stderr[-2000:])
    ledger = read_ledger(ckpt)
    assert len(ledger) == 1 and ledger[0]["exit_code"] == 74
    assert "No space left on device" in proc.stderr
    assert [r.step for r in list_checkpoints(ckpt) if r.status == "valid"] == [10]


def test_ledger_records_the_attempt(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    proc = resilient_run(
        ["--checkpoint-dir", str(ckpt)],
        [sys.executable, "-c", "import os; print(os.environ['RESILIENT_ATTEMPT'])"],
        SLURM_JOB_ID="4242",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "1"
    (rec,) = read_ledger(ckpt)
    assert rec["slurm_job_id"] == "4242" and rec["reason"] == "finished" and rec["host"]
    assert json.loads(json.dumps(rec)) == rec


@pytest.mark.parametrize("comm", ["self", "node"])
def test_async_saves_with_a_local_tier_resume_bit_identically(
    tmp_path: Path, reference: bytes, comm: str
) -> None:
    """Walltime stops with async saving and a node-local tier on /dev/shm; between attempts the
    local tier is lost (a job on another node) or one local copy is corrupted."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    local = Path(tempfile.mkdtemp(prefix="resilient-run-", dir="/dev/shm"))
    try:
        cmd = [
            *heat_cmd(ckpt, out, delay=0.1),
            "--async-save", "--local-dir", str(local), "--flush-every", "3",
            "--checkpoint-comm", comm,
        ]  # fmt: skip
        codes = []
        for attempt in range(40):
            proc = resilient_run(
                ["--checkpoint-dir", str(ckpt), "--walltime", "6", "--signal", "USR1@1",
                 "--kill-wait", "1"],
                cmd,
            )  # fmt: skip
            codes.append(proc.returncode)
            if proc.returncode == 0:
                break
            assert proc.returncode == 75, proc.stderr
            # the final checkpoint of every stopped attempt reached the shared root
            flushed = latest_valid(ckpt)
            assert flushed is not None
            newest_local = max(filter(None, (parse_step_dir(p.name) for p in local.glob("*/*"))))
            assert flushed.step == newest_local, (flushed.step, newest_local)
            if attempt % 3 == 0:  # the next job lands on another node: no local copies
                shutil.rmtree(local)
                local.mkdir()
            elif attempt % 3 == 1:  # a local copy went bad (same size: only checksums see it)
                for data in sorted(local.glob("*/step_*/*.h5"))[-1:]:
                    flip_dataset_byte(data.parent)
        assert codes[-1] == 0 and codes.count(75) >= 3, codes
        assert field(out) == reference
        flushes = [s for s in (json.loads(line) for line in (ckpt / "saves.jsonl").open())
                   if "flush_s" in s]  # fmt: skip
        assert len(flushes) >= 3
    finally:
        shutil.rmtree(local, ignore_errors=True)


MARGIN_WARNING = "stop margin 10.0 s would leave less than half of the"


def test_walltime_shorter_than_the_stop_margin_still_makes_progress(
    tmp_path: Path, reference: bytes
) -> None:
    """Issue 9: `--walltime 3s` with the app's default 10 s margin stopped every attempt at
    step 0 ("crashed (exit 1)", then 93). Now each attempt clamps the margin, checkpoints and
    exits 75, and the attempts finish the run. (5 s, not 3 s: room for a slow `mpiexec` start
    on a busy machine; any walltime below the margin is the case.)"""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    codes, warnings = [], []
    for _ in range(30):
        proc = resilient_run(
            ["--checkpoint-dir", str(ckpt), "--walltime", "5s"],
            heat_cmd(ckpt, out, delay=0.04, config=None),
        )
        codes.append(proc.returncode)
        warnings.append(proc.stderr.count(MARGIN_WARNING))
        if proc.returncode == 0:
            break
        assert proc.returncode == 75, proc.stderr
    assert codes[-1] == 0 and codes.count(75) >= 1, codes
    assert field(out) == reference
    ledger = read_ledger(ckpt)
    assert [r["exit_code"] for r in ledger] == codes
    assert all(r["progress"] for r in ledger[:-1])
    assert not [r for r in ledger if "crashed" in r["reason"]]
    assert all(n == 1 for n in warnings[:-1]), warnings  # one warning per run, not per rank
    for stop in (r["program_stop"] for r in ledger[:-1]):
        assert stop["saved"] is True and stop["margin_s"] == 10
        assert 0 < stop["margin_used_s"] < stop["time_left_at_start_s"] < 5


def test_stop_before_the_first_checkpoint_is_reported_not_as_a_crash(tmp_path: Path) -> None:
    """A start slower than the clamped margin (a 3 s restore in a 4 s walltime) still stops
    before any step: the ledger says so, and it counts towards --max-no-progress."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    cmd = heat_cmd(ckpt, out, program="tests/mpi/faulty_heat.py", config=None)
    args = ["--checkpoint-dir", str(ckpt), "--walltime", "4s", "--max-no-progress", "3"]
    first = resilient_run([*args, "--retries", "2", "--backoff", "0.1"], cmd, FAULT="slowrestore@3")
    assert first.returncode == 1, first.stderr
    assert len(read_ledger(ckpt)) == 1  # a stop is not relaunched like a crash
    codes = [resilient_run(args, cmd, FAULT="slowrestore@3").returncode for _ in range(2)]
    retry = resilient_run(args, cmd, FAULT="slowrestore@3", SLURM_ARRAY_JOB_ID="5",
                          SLURM_ARRAY_TASK_ID="4", SLURM_ARRAY_TASK_MIN="1")  # fmt: skip
    assert [*codes, retry.returncode] == [1, 93, 93]  # an engine's retry is refused
    ledger = read_ledger(ckpt)
    assert len(ledger) == 3
    want = (
        "stopped before its first checkpoint: walltime 4 s is shorter than the program's stop "
        "margin 10 s"
    )
    assert all(r["reason"].startswith(want) for r in ledger), [r["reason"] for r in ledger]
    assert not [r for r in ledger if "crashed" in r["reason"]]
    assert "no progress in 3 consecutive attempts" in ledger[2]["reason"]
    assert all(r["program_stop"]["saved"] is False for r in ledger)
    assert latest_valid(ckpt) is None


def test_a_directory_of_another_run_is_reported_and_not_retried(tmp_path: Path) -> None:
    """apps.heat's run_key holds alpha: the same directory with another alpha exits 78 on its
    first attempt, `resilient run` says why and neither retries nor requeues it, nothing in the
    directory changes; the original parameters then resume there as before."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    first = heat_cmd(ckpt, out, n=2, delay=0.03)
    args = ["--checkpoint-dir", str(ckpt), "--walltime", "2.5", "--signal", "USR1@0.5"]
    proc = resilient_run([*args, "--kill-wait", "1"], first)
    assert proc.returncode == 75, proc.stderr[-3000:]
    before = sorted(p.name for p in ckpt.iterdir() if p.name != "attempts.jsonl")
    other = [*first, "--alpha", "0.15"]  # the last --alpha wins
    proc = resilient_run([*args, "--kill-wait", "1", "--requeue", "--retries", "3"], other)
    assert proc.returncode == 78, (proc.returncode, proc.stderr[-3000:])
    assert "belongs to another run" in proc.stderr
    assert "alpha: 0.2 there, 0.15 now" in proc.stderr  # the program's own message
    assert "requeued after" not in proc.stderr and "program crashed" not in proc.stderr
    ledger = read_ledger(ckpt)
    assert [r["exit_code"] for r in ledger] == [75, 78]
    assert sorted(p.name for p in ckpt.iterdir() if p.name != "attempts.jsonl") == before
    # the refused attempt is no attempt without progress of this run: it resumes and finishes
    proc = resilient_run([*args, "--kill-wait", "1", "--requeue"], first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["exit_code"] for r in read_ledger(ckpt)][:2] == [75, 78]


def test_a_shape_change_is_reported_and_not_retried(tmp_path: Path) -> None:
    """A program without a run_key whose state's shape changes (a size parameter): exit 78
    with the leaf and both shapes, not a crash deep in numpy."""
    script = tmp_path / "grow.py"
    script.write_text(
        "import sys, numpy as np\n"
        "from resilient import Session\n"
        "with Session() as s:\n"
        "    step, state = s.restore_or({'u': np.zeros(int(sys.argv[1]))})\n"
        "    s.maybe_save(step + 1, state)\n"
    )
    ckpt = tmp_path / "ck"
    base = ["--checkpoint-dir", str(ckpt), "--retries", "2", "--backoff", "0.1"]
    assert resilient_run(base, [sys.executable, str(script), "500"]).returncode == 0
    proc = resilient_run(base, [sys.executable, str(script), "600"])
    assert proc.returncode == 78, (proc.returncode, proc.stderr[-3000:])
    assert "'u' with shape (500,)" in proc.stderr and "shape (600,)" in proc.stderr
    assert "belongs to another run" in proc.stderr
    assert [r["exit_code"] for r in read_ledger(ckpt)] == [0, 78]


def test_static_data_one_copy_damaged_finishes_both_damaged_exits_74_without_traceback(
    tmp_path: Path, reference: bytes
) -> None:
    """One damaged copy of the static data costs nothing (the attempt restores, repairs it
    and finishes bit-identically); both damaged: exit 74 (not retried) with a message naming
    the files and the fix, no traceback and no quarantined step."""
    ckpt, out = tmp_path / "ck", tmp_path / "out.h5"
    opts = ["--checkpoint-dir", str(ckpt), "--walltime", "4", "--signal", "USR1@1",
            "--kill-wait", "1"]  # fmt: skip
    proc = resilient_run(opts, heat_cmd(ckpt, out, n=2, delay=0.06))
    assert proc.returncode == 75, proc.stderr
    (h,) = [p.name for p in (ckpt / "static").iterdir() if len(p.name) == 32]
    manifest = ckpt / "static" / h / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-7])  # truncated
    said = ""
    while (proc := resilient_run(opts, heat_cmd(ckpt, out, n=2, delay=0.06))).returncode == 75:
        said += proc.stderr
    said += proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert said.count("repaired it from the other copy") == 1, said  # (the first attempt)
    assert field(out) == reference
    for name in (h, f"{h}.copy"):
        (ckpt / "static" / name / "COMMITTED").write_text("garbage")
    proc = resilient_run(["--checkpoint-dir", str(ckpt)], heat_cmd(ckpt, out, n=2, delay=0.0))
    assert proc.returncode == 74, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "COMMITTED marker is garbled" in proc.stderr and "backup" in proc.stderr
    assert not [p for p in ckpt.iterdir() if ".quarantined-" in p.name]
