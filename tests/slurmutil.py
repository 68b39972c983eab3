"""Helpers for tests that need the local Slurm of tests/slurm/up.sh."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def slurm_available() -> tuple[bool, str]:
    """Whether sbatch can run jobs here, and why not."""
    if not shutil.which("sbatch"):
        return False, "sbatch not found (start a local Slurm with `bash tests/slurm/up.sh` as root)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"sinfo failed: {exc}"
    states = set(out.stdout.split())
    if out.returncode != 0 or not states & {"idle", "mixed", "allocated"}:
        return False, f"no usable Slurm node (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    return True, ""


def require_slurm() -> None:
    """Skip the calling test (with the reason) unless a Slurm cluster accepts jobs."""
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)


def squeue_names(names: tuple[str, ...]) -> list[str]:
    """Ids of pending/running jobs whose name is one of ``names``."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "PENDING,RUNNING,CONFIGURING,COMPLETING,REQUEUED", "-o", "%i %j"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return [line.split()[0] for line in out.stdout.splitlines() if line.split()[-1] in names]


def field_bytes(path: Path, steps: int) -> bytes:
    """The heat field of an ``apps.heat`` output, after checking it ran ``steps`` steps."""
    import h5py

    with h5py.File(path) as f:
        assert int(f.attrs["steps"]) == steps
        return bytes(f["T"][()].tobytes())


def snakemake_job_logs(work: Path) -> str:
    """Every Slurm job log the executor plugin kept under ``work`` (--slurm-keep-successful-logs)."""
    logs = sorted((work / ".snakemake" / "slurm_logs").rglob("*.log"))
    return "".join(p.read_text() for p in logs)
