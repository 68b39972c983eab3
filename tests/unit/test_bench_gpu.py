"""bench/bench_gpu.py where it cannot measure: its arguments are checked, and without CUDA it
says so and exits 2 (the measurements themselves need a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_gpu.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120
    )


def test_bad_arguments_are_refused() -> None:
    done = run("--runs", "0")
    assert done.returncode == 2 and "must be positive" in done.stderr


@pytest.mark.torch
def test_without_cuda_it_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the benchmark would run")
    done = run("--runs", "1", "--gib", "0.01")
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr and not done.stdout
