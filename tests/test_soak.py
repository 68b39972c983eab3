"""The reliability soak's short form (issue 11.3): ``bench/soak.py`` with a few kills per layout.

Four kills per layout (two with synchronous saving, two with asynchronous), each SIGKILLing one
rank or the whole job of the 4-rank heat app under ``resilient run`` at a random moment or
inside a save; then no committed checkpoint may be lost, the newest valid step may never go
back, ``resilient verify --full`` must pass on it, and every campaign's output must be
byte-identical to an uninterrupted run. The long form (200 kills per layout) is run by hand:
``python bench/soak.py --trials 200`` (numbers in bench/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import REPO, clean_env

pytestmark = [pytest.mark.slow, pytest.mark.mpi, pytest.mark.timeout(900)]

FAILURES = (
    "lost",
    "regressions",
    "verify_failures",
    "invalid_dirs",
    "non_identical",
    "hangs",
    "unexpected_exits",
)


def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # short campaigns (60 steps, kills within 4 s of a launch) so that several complete
    cmd = [
        sys.executable, str(REPO / "bench" / "soak.py"), "--trials", "4", "--mode", "both",
        "--layouts", "self,node,world", "--steps", "60", "--max-delay", "4",
        "--save-share", "0.75", "--seed", "11", "--workdir", str(tmp_path / "work"),
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=840
    )
    assert out.exists(), proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows, total = doc["rows"], doc["total"]
    report = proc.stdout[-4000:]
    assert [(r["layout"], r["mode"]) for r in rows] == [
        (lay, mode) for lay in ("self", "node", "world") for mode in ("sync", "async")
    ]
    assert all(r["trials"] == 2 for r in rows), report
    for name in FAILURES:
        assert total[name] == 0, (name, report, [p for r in rows for p in r["problems"]])
    assert proc.returncode == 0, report
    # the kills happened, of both kinds, some inside a save, and every campaign was compared
    assert total["trials"] == 12 and total["rank_kills"] + total["job_kills"] == 12, report
    assert total["rank_kills"] >= 1 and total["job_kills"] >= 1, report
    assert total["kills_in_save"] >= 1, report
    assert all(r["campaigns"] >= 1 for r in rows), report
    assert total["launches"] > total["trials"], report  # the last campaign of each ran to its end


def test_short_node_loss_soak_keeps_every_protected_checkpoint(tmp_path: Path) -> None:
    """``--node-loss``: two MPI nodes with local tiers and partner copies; each kill loses one
    node (its ranks, the job with them, and its local directory)."""
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "soak.py"), "--node-loss", "--trials", "4",
        "--mode", "async", "--layouts", "node", "--steps", "90", "--max-delay", "5",
        "--seed", "7", "--workdir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=840
    )
    assert out.exists(), proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    total, report = doc["total"], proc.stdout[-4000:]
    for name in (*FAILURES, "lost_protected"):
        assert total[name] == 0, (name, report, [p for r in doc["rows"] for p in r["problems"]])
    assert proc.returncode == 0, report
    assert total["node_kills"] == 4 and total["campaigns"] >= 1, report
