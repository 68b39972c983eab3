"""`python -m resilient.demo --ranks N`: every MPI task of the campaign, and its reference run,
on N ranks instead of the campaign's (4 per heat case, 2 for train)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from resilient import demo

REPO = Path(__file__).resolve().parents[1]


def dry_run(out: Path, ranks: int | None) -> str:
    """The campaign's shell commands as Snakemake would run them (``-n -p``)."""
    cmd = [*demo.campaign_command(out, 6.0, ranks), "-n", "-p"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def mpiexec_ranks(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"/mpiexec -n (\d+) ", text)]


def test_ranks_option() -> None:
    parser = demo.build_parser()
    assert parser.parse_args([]).ranks is None
    assert parser.parse_args(["--ranks", "2"]).ranks == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--ranks", bad])


def test_the_campaigns_own_rank_counts_by_default(tmp_path: Path) -> None:
    found = mpiexec_ranks(dry_run(tmp_path, None))  # and 2 for train_torch where torch is
    assert sorted(found)[-3:] == [2, 4, 4] and set(found) == {2, 4}, found


@pytest.mark.parametrize("ranks", [1, 6])
def test_every_task_gets_the_rank_count(tmp_path: Path, ranks: int) -> None:
    """The campaign's other settings stay (merged key by key: the checkpoint directories,
    hashed from the parameters, are the default run's, but for train_torch's); more ranks than the profile's budget
    of 4 raise the budget."""
    text = dry_run(tmp_path, ranks)
    found = mpiexec_ranks(text)
    assert len(found) >= 3 and set(found) == {ranks}, found
    assert re.findall(r"resources: .*\btasks=(\d+)", text) == [str(ranks)] * len(found)
    # apps.train_torch keys its directory with the rank count (its state is per rank), the
    # others restore on any rank count: the same directories as a default run
    keyed = re.compile(r"--checkpoint-dir (ckpt/(?!train_torch/)\S+)")
    default = set(keyed.findall(dry_run(tmp_path / "d", None)))
    assert len(default) >= 3 and set(keyed.findall(text)) == default
    assert ("--resources" in demo.campaign_command(tmp_path, 6.0, ranks)) == (ranks > 4)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo_on_two_ranks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "resilient.demo", "--ranks", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "DEMO OK" in proc.stdout
    log = (tmp_path / "snakemake.log").read_text()
    assert set(mpiexec_ranks(log)) == {2}
