"""``resilient run --outputs`` creates the folders of the declared outputs before the program
starts, as Snakemake does for a job's outputs; Parsl does not, and a program writing
``out/sim.h5`` failed without ``out/``."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.job.exitcodes import EXIT_FOREIGN_RUN
from resilient.job.options import RunOptions
from resilient.job.run import run
from tests.mpirun import clean_env

WRITE = "echo hi > out/sub/sim.h5 && echo > other/y.txt"


def resilient_run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", "ckpt", *args]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=60)


def test_the_outputs_folders_are_made_before_the_program_starts(tmp_path: Path) -> None:
    proc = resilient_run(
        tmp_path, "--outputs", "out/sub/sim.h5", "other/y.txt", "--", "sh", "-c", WRITE
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "sub" / "sim.h5").read_text() == "hi\n"
    assert (tmp_path / "other" / "y.txt").is_file()


def test_without_outputs_the_program_meets_the_missing_folder(tmp_path: Path) -> None:
    proc = resilient_run(tmp_path, "--", "sh", "-c", WRITE)
    assert proc.returncode != 0
    assert not (tmp_path / "out").exists()


def test_a_refused_run_makes_no_folders(tmp_path: Path) -> None:
    ck = tmp_path / "res" / "ckpt"
    outputs = (tmp_path / "res", tmp_path / "out" / "x.h5")
    opts = RunOptions(command=("true",), checkpoint_dir=ck, outputs=outputs)
    assert run(opts) == EXIT_FOREIGN_RUN
    assert not (tmp_path / "out").exists()


def test_a_folder_that_cannot_be_made_is_left_to_the_program(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "x.h5"
    opts = RunOptions(command=("sh", "-c", f"echo > {out}"), outputs=(out,))
    with caplog.at_level(logging.WARNING, logger="resilient.job.run"):
        assert run(opts) != 0  # the program's own failure, passed through
    assert f"cannot create the folder of the output {out}" in caplog.text
