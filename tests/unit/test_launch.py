"""Which MPI a launcher is, and the faster start it offers (resilient.job.launch), with
stand-in launchers that print what each MPI's ``mpiexec --version`` prints."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from resilient.job.launch import mpi_of, startup_hint

VERSIONS = {
    "Open MPI": "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/",
    "Intel MPI": "Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626",
    "MPICH": "HYDRA build details:\n    Version:                                 5.0.2",
}


def launcher(tmp_path: Path, says: str, name: str = "mpiexec") -> str:
    tool = tmp_path / name
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{says}\nEOF\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return str(tool)


@pytest.mark.parametrize("family", sorted(VERSIONS))
def test_the_mpi_is_told_by_its_launchers_version(tmp_path: Path, family: str) -> None:
    assert mpi_of(launcher(tmp_path, VERSIONS[family])) == family


def test_no_mpi_for_something_else_or_nothing(tmp_path: Path) -> None:
    assert mpi_of(launcher(tmp_path, "srun 22.05.8")) is None
    assert mpi_of(str(tmp_path / "missing")) is None


def test_only_open_mpi_without_a_transport_chosen_gets_the_hint(tmp_path: Path) -> None:
    ompi = launcher(tmp_path, VERSIONS["Open MPI"])
    hint = startup_hint([ompi, "-n", "2", "python", "app.py"], {})
    assert hint is not None and "OMPI_MCA_btl=self,sm" in hint and "one node" in hint
    assert startup_hint([ompi, "-n", "2", "python", "app.py"], {"OMPI_MCA_btl": "self,sm,tcp"}) is None
    assert startup_hint([ompi, "--mca", "btl", "self,sm", "-n", "2", "python"], {}) is None
    (tmp_path / "mpich").mkdir()
    mpich = launcher(tmp_path / "mpich", VERSIONS["MPICH"])
    assert startup_hint([mpich, "-n", "2", "python", "app.py"], {}) is None
    assert startup_hint(["python", "app.py"], {}) is None
    assert startup_hint([], {}) is None
