"""A damaged line in the task root's logs, between two ``resilient run`` invocations: the run
goes on and finishes, and the CLI reads the root, each with one warning per damaged file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest

from resilient.job.ledger import read_ledger, sidecar_path
from resilient.model import filenames
from tests.mpirun import REPO, clean_env

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def heat(ckpt: Path, out: Path, *, delay: float) -> list[str]:
    """``apps.heat`` on one rank (no launcher): 120 steps, a checkpoint every 10."""
    return [
        sys.executable, "-m", "apps.heat", "--nx", "64", "--ny", "48", "--steps", "120",
        "--checkpoint-dir", str(ckpt), "--out", str(out), "--checkpoint-every", "10",
        "--step-delay", str(delay), "--config", str(REPO / "configs/checkpoint/demo.yaml"),
    ]  # fmt: skip


def resilient(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilient.cli", *map(str, args)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=200,
    )  # fmt: skip


def field(path: Path) -> bytes:
    with h5py.File(path) as f:
        return bytes(f["T"][()].tobytes())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("ref")
    subprocess.run(
        heat(d / "ck", d / "out.h5", delay=0.0), cwd=REPO, env=clean_env(), check=True,
        capture_output=True, timeout=120,
    )  # fmt: skip
    return field(d / "out.h5")


def garbage_in_the_ledger(ck: Path) -> list[str]:
    with open(ck / filenames.ATTEMPT_LEDGER, "ab") as fh:  # a full disk's or a torn write's
        fh.write(b'garbage\x00{"attempt": \n')
    return ["attempt ledger"]


def a_bad_byte_in_the_timeline(ck: Path) -> list[str]:
    path = ck / filenames.PROGRESS_LOG
    data = bytearray(path.read_bytes())
    data[len(data) // 2] = 0xFF  # one line no longer UTF-8 ...
    path.write_bytes(bytes(data) + b"\xfe")  # ... and a torn last line that is not either
    return ["timeline"]


def every_log_damaged(ck: Path) -> list[str]:
    garbage_in_the_ledger(ck)
    a_bad_byte_in_the_timeline(ck)
    with open(ck / filenames.SAVE_LOG, "ab") as fh:
        fh.write(b'{"step": "130", "time": 1e12}\n{"step": 13')  # a string step, a torn line
    with open(ck / filenames.STOP_LOG, "ab") as fh:
        fh.write(b'["time", 1]\n"a string"\n')
    with open(ck / filenames.PROTECT_LOG, "ab") as fh:
        fh.write(b'{"step": true, "time": 1e12}\n')
    with open(sidecar_path(ck), "ab") as fh:
        fh.write(b"\xc3\x28\n")
    return ["attempt ledger", "timeline", "save log", "stop log", "partner-copy log",
            "attempt record beside the checkpoint directory"]  # fmt: skip


@pytest.mark.parametrize("damage", [garbage_in_the_ledger, every_log_damaged])
def test_a_damaged_log_between_attempts_costs_nothing(
    damage: Callable[[Path], list[str]], tmp_path: Path, reference: bytes
) -> None:
    ck, out = tmp_path / "ck", tmp_path / "out.h5"
    walltime: list[str | Path] = ["--checkpoint-dir", ck, "--walltime", "4s", "--signal", "USR1@1"]
    first = resilient("run", *walltime, "--", *heat(ck, out, delay=0.04))
    assert first.returncode == 75, first.stderr[-3000:]  # stopped by its walltime, progress
    damaged = damage(ck)

    again = resilient("run", *walltime, "--requeue", "--", *heat(ck, out, delay=0.04))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert field(out) == reference
    ledger = read_ledger(ck)  # the attempts go on being numbered from the valid lines
    assert [r["attempt"] for r in ledger] == list(range(1, len(ledger) + 1))
    assert len(ledger) >= 2 and ledger[-1]["exit_code"] == 0
    for name in damaged:  # one warning per process: the wrapper's, each attempt's (the save log)
        said = again.stderr.count(f"the {name} ")
        expected = range(1, len(ledger)) if name == "save log" else range(1, 2)
        assert said in expected, (name, again.stderr[-3000:])

    report = resilient("report", ck)  # reads the ledger, the timeline and the save log
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
    read = {"attempt ledger", "timeline", "save log"}.intersection(damaged)
    assert report.stderr.count("damaged line") == len(read), report.stderr
    assert f"{len(ledger)} attempts" in report.stdout and "finished" in report.stdout
    more: list[list[str | Path]] = [["status", tmp_path], ["ls", ck]]
    if len(damaged) > 1:
        more += [["report", "--json", ck], ["ls", tmp_path], ["latest", ck], ["verify", ck]]
    for args in more:
        proc = resilient(*args)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
        for name in damaged:
            assert proc.stderr.count(f"the {name} ") <= 1, (args, proc.stderr)
