"""bench/bench_dtensor.py: its arguments are checked, and its quick mode (a tiny FSDP2 state,
saved by 2 gloo ranks, restored on 2 and on 1, by resilient and by DCP, each restore verified
bit for bit) runs and reports every operation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_dtensor.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600
    )


def test_bad_arguments_are_refused() -> None:
    done = run("--runs", "0")
    assert done.returncode == 2 and "must be positive" in done.stderr
    done = run("--to", "2,x")
    assert done.returncode == 2 and "--to takes rank counts" in done.stderr


@pytest.mark.torch
def test_quick_mode_measures_and_verifies(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="needs PyTorch")
    out = tmp_path / "out.json"
    done = run("--quick", "--dir", str(tmp_path / "work"), "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "restored full_tensor() equal bit for bit" in done.stdout
    (result,) = json.loads(out.read_text())["runs"]
    for key in ("save", "same", "to1"):
        assert {"raw", "resilient", "dcp"} <= set(result[key]) and result[key]["bytes"] > 0
    for key in ("same", "to1"):  # every restore read its bytes (and counted them)
        assert result[key]["resilient"]["rchar"] >= 1.0 and result[key]["dcp"]["rchar"] >= 1.0
    assert "| restore | 2 -> 1 |" in done.stdout
