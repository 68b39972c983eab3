"""Run a script under ``mpiexec -n N`` for the tests (real ranks, oversubscribed, with a timeout)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from resilient.job.launch import find_mpiexec, mpi_of

REPO = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """The ``mpiexec`` the library's apps use (next to this interpreter, else on PATH)."""
    return find_mpiexec()


#: Open MPI's settings, kept: running as root, and MCA parameters of Open MPI and of its
#: launcher PRRTE (oversubscription on 2 cores: ``PRTE_MCA_rmaps_default_mapping_policy``)
OMPI_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_", "PRTE_MCA_")


@functools.cache
def mpi_family() -> str:
    """Which MPI :func:`mpiexec` belongs to: ``"Open MPI"``, ``"Intel MPI"`` or ``"MPICH"``."""
    return mpi_of(mpiexec()) or "MPICH"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus any inherited launcher (PMI/Hydra/Open MPI/Slurm step) variables;
    Open MPI's settings (:data:`OMPI_SETTINGS`) stay."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(OMPI_SETTINGS)
        or not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPIR_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_mpi(
    n: int, args: list[str], *, timeout: float = 120, check: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` on ``n`` ranks; on ``check``, fail with the output if it fails."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *args]
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def results(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """The ``RESULT {json}`` lines a scenario printed, sorted by rank."""
    # ranks share one stdout: lines of two ranks may run together, so decode at each marker
    decoder = json.JSONDecoder()
    text, out, pos = proc.stdout, [], 0
    while (pos := text.find("RESULT {", pos)) >= 0:
        obj, end = decoder.raw_decode(text, pos + len("RESULT "))
        out.append(obj)
        pos = end
    return sorted(out, key=lambda d: d["rank"])
