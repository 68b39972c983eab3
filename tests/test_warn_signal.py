"""The warning signal never kills a user's program (issue 33, point 1): real processes, real signals.

A README-style program (tests/mpi/readme_program.py: slow imports, a ``Session``, its output
written after the block, no signal handling of its own) under ``resilient run --walltime W
--signal USR1@L`` on 1 and 2 ranks (MPICH's ``mpiexec``), the warning timed to land (a) during
its imports and (b) while it writes its output; and under ``srun`` on the local Slurm, where
Slurm signals the ranks directly (skipped without Slurm).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from resilient.job.ledger import read_ledger
from tests.mpirun import REPO, clean_env, mpiexec
from tests.slurmutil import require_slurm

PROGRAM = REPO / "tests" / "mpi" / "readme_program.py"


def run_program(
    tmp: Path, ranks: int, steps: int, args: list[str], **env: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]], dict[str, Any]]:
    """``resilient run ARGS -- mpiexec -n RANKS python readme_program.py``: the process, the
    ledger and the output."""
    ckpt, out = tmp / "ck", tmp / "out.json"
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(PROGRAM), str(out), str(steps)]
    full = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt), *args]
    proc = subprocess.run(
        [*full, "--", *cmd], cwd=REPO, env=clean_env(**env), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    output = json.loads(out.read_text()) if out.exists() else {}
    return proc, read_ledger(ckpt), output


def assert_never_killed(
    proc: subprocess.CompletedProcess[str], ledger: list[dict[str, Any]]
) -> None:
    text = proc.stdout + proc.stderr
    assert "BAD TERMINATION" not in text, text
    assert "signal 10" not in text and "User defined signal" not in text, text
    for rec in ledger:
        assert rec["exit_status"] not in (-10, 10, 138), rec
        assert "SIGUSR1" not in rec["reason"] or rec["reason"].startswith("stopped early"), rec


def probes(text: str) -> list[dict[str, float]]:
    """Rank 0's ``probe`` lines: when the imports ended, the block ended, the output was written."""
    found = re.findall(r"probe imports-done=([\d.]+) block-end=([\d.]+) written=([\d.]+)", text)
    return [dict(zip(("imports", "block", "written"), map(float, f), strict=True)) for f in found]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_warning_during_the_imports_is_kept_and_checkpointed(tmp_path: Path, ranks: int) -> None:
    """--walltime 4 --signal USR1@3: the warning comes 1 s in, during the 1.5 s of imports. The
    session takes it when it starts, saves one step and exits 75; --requeue repeats that until
    the last step, after which the program finishes (0) and writes its output."""
    steps = 3
    proc, ledger, output = run_program(
        tmp_path, ranks, steps, ["--walltime", "4", "--signal", "USR1@3", "--requeue"],
        PROG_WRITE_S="0.2",
    )  # fmt: skip
    assert_never_killed(proc, ledger)
    assert proc.returncode == 0, proc.stderr
    codes = [rec["exit_code"] for rec in ledger]
    assert codes == [75] * (steps - 1) + [0], ledger
    assert [rec["latest_after"] for rec in ledger] == [1, 2, 3]
    assert all(rec["signal"] == "SIGUSR1" for rec in ledger)  # warned, never killed
    # each warning landed during the imports: sent 1 s after the start, the imports sleep 1.5 s
    for rec in ledger[:-1]:
        assert rec["end"] - (rec["start"] + 1.0) > 0.5, rec  # it lived on after the warning
        assert rec["program_stop"]["reason"] == "signal SIGUSR1", rec
    (probe,) = probes(proc.stderr)  # the finishing attempt's
    assert probe["imports"] - ledger[-1]["start"] > 1.5
    assert output == {"step": steps, "x": [float(steps)] * 3, "ranks": ranks}


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_warning_while_the_output_is_written_does_not_kill(tmp_path: Path, ranks: int) -> None:
    """--walltime 12 --signal USR1@8: the warning comes 4 s in; the loop (10 steps) has ended by
    then and the output takes 4 s to write. The program finishes: exit 0, its output whole."""
    steps = 10
    proc, ledger, output = run_program(
        tmp_path, ranks, steps, ["--walltime", "12", "--signal", "USR1@8"],
        PROG_WRITE_S="4",
    )  # fmt: skip
    assert_never_killed(proc, ledger)
    assert proc.returncode == 0, proc.stderr
    assert len(ledger) == 1, ledger
    rec = ledger[0]
    assert (rec["exit_code"], rec["reason"], rec["signal"]) == (0, "finished", "SIGUSR1")
    assert rec["latest_after"] == steps
    (probe,) = probes(proc.stderr)
    warned = rec["start"] + 4.0
    assert probe["block"] < warned < probe["written"], (probe, warned)  # it landed after the block
    assert output == {"step": steps, "x": [float(steps)] * 3, "ranks": ranks}


BATCH = """#!/bin/bash
{python} -m resilient.cli run --checkpoint-dir {ckpt} -- \\
    srun --mpi=pmi2 -n 2 {python} {program} {out} 5
echo "resilient run exit $?"
"""


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_under_srun_a_warning_from_slurm_during_the_imports_is_kept(tmp_path: Path) -> None:
    """sbatch --time=2 --signal=USR1@100: the warning is due 20 s in, and Slurm signals the
    ranks (not the batch script) at its next 30-s check, 20-50 s in, while they are still
    importing (60 s). (A warning due at once, ``--time=1 --signal=USR1@60``, may come at a check
    before srun has started the step; Slurm signals only the steps there are, and one run's
    ranks never saw it.) srun starts its tasks with an empty
    signal mask, so the mask ``resilient run`` sets does not reach them; its
    ``$RESILIENT_WARN_SIGNALS`` does, and ``import resilient`` (first, before the slow imports)
    records the signal. The session takes it, saves one step and exits 75."""
    require_slurm()
    ckpt, out = tmp_path / "ck", tmp_path / "out.json"
    script = tmp_path / "job.sh"
    script.write_text(BATCH.format(python=sys.executable, ckpt=ckpt, program=PROGRAM, out=out))
    log = tmp_path / "job.out"
    env = clean_env(
        PROG_IMPORT_FIRST="1", PROG_IMPORT_S="60", PROG_UNTIL_WARNED="1", PROG_WRITE_S="0.2"
    )
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    job = subprocess.run(
        ["sbatch", "--parsable", "--time=2", "--signal=USR1@100", "-n", "2", "-p", "debug",
         "-J", "warn-signal-srun", "-o", str(log), "-D", str(tmp_path), str(script)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline:
        state = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if state in ("", "COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"):
            break
        time.sleep(2)
    text = log.read_text() if log.exists() else ""
    assert "resilient run exit 75" in text, text
    assert "BAD TERMINATION" not in text and "signal 10" not in text, text
    (rec,) = read_ledger(ckpt)
    assert (rec["exit_status"], rec["exit_code"], rec["signal"]) == (75, 75, None), rec
    assert rec["program_stop"]["reason"] == "signal SIGUSR1", rec
    assert rec["latest_after"] == 1 and not out.exists()


USER_SNAKEFILE = f"""
from resilient.integrations.snakemake import resilient_run, retries

rule readme:
    output: "out.json"
    params: ckpt="ckpt/readme"
    retries: retries(0)
    shell: resilient_run() + "mpiexec -n 2 {sys.executable} {PROGRAM} {{output}} 3"
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_snakemake_a_warning_during_the_imports_is_kept(tmp_path: Path) -> None:
    """The same program as a user's Snakemake rule (local profile, a 4-s walltime with the
    warning 3 s before it: during the imports): requeued in place, never killed."""
    (tmp_path / "Snakefile").write_text(USER_SNAKEFILE)
    env = clean_env(PROG_WRITE_S="0.2")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--profile", str(REPO / "configs/profiles/local"),
         "--config", "resilient_walltime=4", "resilient_signal=USR1@3", "--", "out.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    ledger = read_ledger(tmp_path / "ckpt" / "readme")
    assert_never_killed(proc, ledger)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [rec["exit_code"] for rec in ledger] == [75, 75, 0], ledger
    assert all(rec["signal"] == "SIGUSR1" for rec in ledger)
    assert json.loads((tmp_path / "out.json").read_text())["step"] == 3


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_parsl_a_warning_during_the_imports_is_kept(tmp_path: Path) -> None:
    """The same program from a Parsl bash app (threads): requeued in place, never killed."""
    import parsl
    from parsl import bash_app
    from parsl.config import Config
    from parsl.executors import ThreadPoolExecutor

    from resilient.integrations.parsl import resume_retry_handler

    @bash_app
    def readme(ckpt: str, out: str, stdout: Any = None, stderr: Any = None) -> str:
        from resilient.integrations.parsl import resilient_command
        from tests.mpirun import mpiexec

        argv = [mpiexec(), "-n", 2, sys.executable, PROGRAM, out, 3]
        return "PROG_WRITE_S=0.2 " + resilient_command(
            argv, checkpoint_dir=ckpt, walltime_s=4, signal="USR1@3", requeue=True
        )

    config = Config(executors=[ThreadPoolExecutor(max_threads=1)], retries=0,
                    retry_handler=resume_retry_handler(), run_dir=str(tmp_path / "runinfo"))  # fmt: skip
    err = tmp_path / "readme.err"
    with parsl.load(config):
        future = readme(str(tmp_path / "ck"), str(tmp_path / "out.json"), stderr=str(err))
        assert future.result(timeout=240) == 0, err.read_text()[-4000:]
    ledger = read_ledger(tmp_path / "ck")
    text = err.read_text()
    assert "BAD TERMINATION" not in text and "User defined signal" not in text, text
    assert [rec["exit_code"] for rec in ledger] == [75, 75, 0], ledger
    assert json.loads((tmp_path / "out.json").read_text())["step"] == 3
