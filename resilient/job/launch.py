"""Which MPI launcher to start ranks with (examples, workflow apps, tests). No MPI imported."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["find_mpiexec", "mpi_of", "startup_hint"]

LAUNCHERS = frozenset({"mpiexec", "mpirun", "mpiexec.hydra", "prterun"})
"""The names of MPI launchers, as the first word of a command."""


def find_mpiexec(*, fallback: str | None = None) -> str:
    """The ``mpiexec`` next to this interpreter (the PyPI ``mpich`` wheel in a venv), else the
    one on ``PATH``, else ``fallback`` (e.g. ``"mpiexec"``, for a command run elsewhere).

    Raises:
        FileNotFoundError: there is none and no ``fallback`` (install ``resilient-hpc[mpich]`` or a
            site MPI).
    """
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or fallback
    if found is None:
        raise FileNotFoundError(
            "no mpiexec next to this Python or on PATH: pip install 'resilient-hpc[mpich]' "
            "or load the site's MPI"
        )
    return found


def mpi_of(launcher: str, *, timeout_s: float = 10.0) -> str | None:
    """Which MPI ``launcher`` belongs to: ``"Open MPI"``, ``"Intel MPI"`` or ``"MPICH"``, from
    its ``--version``; ``None`` when it does not run or says none of them."""
    try:
        out = subprocess.run(
            [launcher, "--version"], capture_output=True, text=True, timeout=timeout_s,
            check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout + out.stderr
    if "Open MPI" in text:
        return "Open MPI"
    if "Intel(R) MPI" in text:
        return "Intel MPI"
    return "MPICH" if "HYDRA" in text or "MPICH" in text else None


def startup_hint(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """A faster start that the command's MPI offers, or ``None``: Open MPI sets up its TCP
    transport at every start, about 1 s of a 1.2-s start of 2 ranks here, against 0.15 s with
    shared memory only (``bench/bench_startup.py``). Asks the launcher (a subprocess): call it
    only to say it."""
    if not command or Path(command[0]).name not in LAUNCHERS:
        return None
    if "OMPI_MCA_btl" in environ or "btl" in command or mpi_of(command[0]) != "Open MPI":
        return None
    return (
        "Open MPI sets up its TCP transport at every start, about 1 s here: on one node, "
        "OMPI_MCA_btl=self,sm starts without it"
    )
