"""The tutorial (docs/tutorial.md), run as a reader runs it: its commands, its files.

The program and the Snakefile are docs/examples/tutorial/{heat1d.py,Snakefile}, copied into a
temporary directory; every command below appears verbatim in the tutorial, so the page cannot
drift from what is tested. The program is stopped by the simulated walltime at least once
under ``resilient run`` and under Snakemake, and each result is bit-identical to the
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import REPO, clean_env

TUTORIAL = REPO / "docs" / "tutorial.md"
EXAMPLE = REPO / "docs" / "examples" / "tutorial"

UNINTERRUPTED = "mpiexec -n 2 python heat1d.py --work 0 --checkpoint-dir ckpt/first --out first.npy"
UNDER_RUN = (
    "resilient run --checkpoint-dir ckpt/run --walltime 8s --requeue -- "
    "mpiexec -n 2 python heat1d.py --out heat.npy"
)
LS = "resilient ls ckpt"
REPORT = "resilient report ckpt/run"
OTHER_RUN = "mpiexec -n 2 python heat1d.py --checkpoint-dir ckpt/run --cells 60 --out other.npy"
SNAKEMAKE = "snakemake --cores 2 --config resilient_walltime=8s"


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One of the tutorial's commands in ``cwd``, with this interpreter's tools first on PATH."""
    bindir = str(Path(sys.executable).parent)
    env = clean_env(PATH=os.pathsep.join([bindir, os.environ.get("PATH", "")]))
    argv = shlex.split(cmd)
    modules = {"resilient": "resilient.cli", "snakemake": "snakemake"}  # console scripts
    if argv[0] in modules:
        argv = [sys.executable, "-m", modules[argv[0]], *argv[1:]]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    with (cwd / "commands.log").open("a") as log:
        log.write(f"$ {cmd}\n{proc.stdout}{proc.stderr}[exit {proc.returncode}]\n")
    return proc


def attempts(ledger: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def test_the_tutorial_names_these_commands() -> None:
    text = TUTORIAL.read_text(encoding="utf-8")
    for cmd in (UNINTERRUPTED, UNDER_RUN, LS, REPORT, OTHER_RUN, SNAKEMAKE):
        assert cmd in text, f"docs/tutorial.md no longer shows: {cmd}"
    for name in ("heat1d.py", "Snakefile"):
        assert f"examples/tutorial/{name}" in text, f"the tutorial does not include {name}"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for cmd in (UNDER_RUN, LS, REPORT):
        assert cmd in readme, f"README.md no longer shows the tutorial's: {cmd}"


@pytest.mark.mpi
@pytest.mark.slow
def test_the_tutorial_resumes_bit_for_bit(tmp_path: Path) -> None:
    for name in ("heat1d.py", "Snakefile"):
        shutil.copy(EXAMPLE / name, tmp_path / name)

    first = run(UNINTERRUPTED, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "finished at step 400" in first.stdout
    reference = (tmp_path / "first.npy").read_bytes()

    # under resilient run: stopped by the walltime at least once, requeued, finished
    resumed = run(UNDER_RUN, tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ledger = attempts(tmp_path / "ckpt" / "run" / "attempts.jsonl")
    assert len(ledger) >= 2 and ledger[0]["exit_code"] == 75, ledger
    assert ledger[-1]["exit_code"] == 0
    assert (tmp_path / "heat.npy").read_bytes() == reference

    listing = run(LS, tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[0] for line in listing.stdout.splitlines()[1:]] == ["first", "run"]
    assert "finished" in listing.stdout
    report = run(REPORT, tmp_path)
    assert report.returncode == 0 and f"{len(ledger)} attempts" in report.stdout

    # the same directory with another parameter: refused, exit 78, nothing touched
    other = run(OTHER_RUN, tmp_path)
    assert other.returncode == 78, other.stdout + other.stderr
    assert "belongs to another run (cells: 50 there, 60 now)" in other.stderr
    assert not (tmp_path / "other.npy").exists()

    # under Snakemake with a simulated walltime: both tasks stopped and requeued, both finish
    workflow = run(SNAKEMAKE, tmp_path)
    assert workflow.returncode == 0, (workflow.stdout + workflow.stderr)[-6000:]
    assert (tmp_path / "results" / "heat-50.npy").read_bytes() == reference
    assert (tmp_path / "results" / "heat-80.npy").is_file()
    roots = sorted((tmp_path / "ckpt" / "heat").glob("[0-9]*-*"))
    assert [r.name.split("-")[0] for r in roots] == ["50", "80"]
    for root in roots:
        codes = [a["exit_code"] for a in attempts(root / "attempts.jsonl")]
        assert codes[0] == 75 and codes[-1] == 0, (root, codes)
