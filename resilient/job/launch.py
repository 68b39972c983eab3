"""Which MPI launcher to start ranks with (examples, workflow apps, tests). No MPI imported."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["find_mpiexec"]


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
