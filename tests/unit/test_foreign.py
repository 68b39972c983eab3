"""`import resilient` warns when another vendor's `resilient` shares the environment.

The other package is PyPI's `resilient` (IBM SOAR's REST API client, 51.x): it installs an import
package named `resilient` too. The tests install a stand-in for it (a wheel with its name,
version, summary and some of its module names) with real pip into a temporary virtual
environment beside this project's own files (a wheel made of `resilient/`, named
`resilient-hpc`), in both orders, and follow the fix the warning names. No network: both wheels
are built here, pip runs with `--no-index`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import resilient
from resilient import _foreign
from resilient._foreign import ForeignPackageWarning

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "resilient"

FOREIGN_SUMMARY = "Python client module for the IBM SOAR REST API"


# --- the detection itself ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "foreign"),
    [
        ("resilient-51.0.9.1.dist-info", True),
        ("resilient-51.0.9.1-py3.11.egg-info", True),
        ("Resilient-50.1.262.dist-info", True),
        ("resilient_hpc-0.1.0.dist-info", False),
        ("resilient-hpc-0.1.0-py3.11.egg-info", False),
        ("resilient.egg-info", False),  # a source tree's, version-less: not an install
        ("resilient_circuits-51.0.9.1.dist-info", False),
        ("resilient", False),
    ],
)
def test_which_metadata_is_the_other_distribution(entry: str, foreign: bool) -> None:
    assert _foreign._is_foreign(entry) is foreign


def test_none_of_the_other_packages_modules_is_ours() -> None:
    ours = {p.name for p in PACKAGE.rglob("*.py")}
    assert not ours & _foreign.FOREIGN_FILES


def test_this_environment_has_no_other_resilient() -> None:
    assert _foreign.find_foreign(str(PACKAGE)) == ()


def test_finds_metadata_beside_a_resilient_package_and_files_inside_ours(tmp_path: Path) -> None:
    site = tmp_path / "site"
    dist = fake_dist_info(site, "resilient", "51.0.9.1", FOREIGN_SUMMARY)
    (site / "resilient").mkdir()
    (site / "resilient" / "co3.py").write_text("")
    (site / "resilient" / "core.py").write_text("")
    lone = tmp_path / "lone"  # metadata with no `resilient` beside it: nothing it could break
    fake_dist_info(lone, "resilient", "51.0.9.1", FOREIGN_SUMMARY)

    found = _foreign.find_foreign(str(site / "resilient"), path=[str(lone), str(site)])
    assert found == (str(dist), str(site / "resilient" / "co3.py"))
    text = _foreign.message(found)
    assert f"resilient 51.0.9.1 ({FOREIGN_SUMMARY}) at {dist}" in text
    assert str(site / "resilient" / "co3.py") in text
    assert text.endswith("Fix: pip uninstall resilient resilient-hpc && pip install resilient-hpc")


def test_warns_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "resilient"
    package.mkdir()
    (package / "app_config.py").write_text("")
    monkeypatch.setattr(_foreign, "_checked", False)
    with pytest.warns(ForeignPackageWarning, match=r"app_config\.py.*Fix: pip uninstall"):
        assert _foreign.warn_if_foreign(str(package)) == (str(package / "app_config.py"),)
    assert _foreign.warn_if_foreign(str(package)) == ()
    assert issubclass(ForeignPackageWarning, UserWarning)  # shown by Python's default filters
    assert resilient.ForeignPackageWarning is ForeignPackageWarning


# --- real installs into a temporary virtual environment -----------------------------------


def fake_dist_info(site: Path, name: str, version: str, summary: str) -> Path:
    dist = site / f"{name}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n\nbody\n"
    )
    return dist


def build_wheel(
    out: Path,
    name: str,
    version: str,
    summary: str,
    files: dict[str, bytes],
    *,
    entry_points: str = "",
) -> Path:
    """A pure-Python wheel of ``files`` (archive path -> content), as pip installs it."""
    stem = f"{name.replace('-', '_')}-{version}"
    meta = f"{stem}.dist-info"
    contents = dict(files)
    contents[f"{meta}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n"
    ).encode()
    contents[f"{meta}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test_foreign\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if entry_points:
        contents[f"{meta}/entry_points.txt"] = entry_points.encode()
    record = []
    for path, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{meta}/RECORD,,")
    contents[f"{meta}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = out / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in contents.items():
            z.writestr(path, data)
    return wheel


def our_wheel(out: Path) -> Path:
    files = {
        f"resilient/{p.relative_to(PACKAGE).as_posix()}": p.read_bytes()
        for p in sorted(PACKAGE.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }
    return build_wheel(
        out,
        "resilient-hpc",
        resilient.__version__,
        "Checkpoint/restart for MPI programs",
        files,
        entry_points="[console_scripts]\nresilient = resilient.cli:main\n",
    )


def foreign_wheel(out: Path) -> Path:
    """A stand-in for PyPI's `resilient` 51.0.9.1: its name, version, summary and module names."""
    files = {
        "resilient/__init__.py": b"from .co3 import SimpleClient\n",
        "resilient/co3.py": b"class SimpleClient:\n    pass\n",
        "resilient/app_config.py": b"",
        "co3/__init__.py": b"",
    }
    return build_wheel(out, "resilient", "51.0.9.1", FOREIGN_SUMMARY, files)


class Venv:
    """A virtual environment without pip that this interpreter's pip installs into; the
    dependencies (numpy, xxhash, ...) come from this interpreter's site-packages, after its own
    (a `.pth` line: the directory only, not the editable install of this checkout in it)."""

    def __init__(self, path: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
        self.python = path / "bin" / "python"
        self.bin = path / "bin"
        purelib = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        deps = "\n".join(site.getsitepackages())
        (Path(purelib) / "zz_test_foreign_deps.pth").write_text(deps + "\n")

    def pip(self, *args: str) -> None:
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        cmd = [sys.executable, "-m", "pip", "--python", str(self.python), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def install(self, wheel: Path) -> None:
        self.pip("install", "--no-deps", "--no-index", "--no-compile", str(wheel))

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, cwd="/")
        assert proc.returncode == 0, proc.stderr
        return proc

    def import_resilient(self) -> str:
        """stderr of ``import resilient`` (resilient-hpc's own modules only, no numpy)."""
        return self.run(str(self.python), "-c", "import resilient, resilient.errors").stderr


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("wheels")
    return our_wheel(out), foreign_wheel(out)


@pytest.mark.slow
def test_ours_installed_over_the_other_warns_and_the_fix_works(
    tmp_path: Path, wheels: tuple[Path, Path]
) -> None:
    ours, foreign = wheels
    venv = Venv(tmp_path / "venv")
    venv.install(foreign)
    venv.install(ours)  # pip overwrites resilient/__init__.py; co3.py and its metadata stay

    err = venv.import_resilient()
    assert "ForeignPackageWarning: another package named 'resilient'" in err
    assert f"resilient 51.0.9.1 ({FOREIGN_SUMMARY})" in err
    assert "resilient/co3.py" in err
    assert "Fix: pip uninstall resilient resilient-hpc && pip install resilient-hpc" in err
    assert err.count("ForeignPackageWarning") == 1

    venv.pip("uninstall", "-y", "resilient", "resilient-hpc")  # the fix, as the warning says
    venv.install(ours)
    assert venv.import_resilient() == ""
    assert venv.run(str(venv.bin / "resilient"), "--version").stderr == ""


@pytest.mark.slow
def test_the_other_installed_over_ours_is_named_by_the_command(
    tmp_path: Path, wheels: tuple[Path, Path]
) -> None:
    ours, foreign = wheels
    venv = Venv(tmp_path / "venv")
    venv.install(ours)
    assert venv.import_resilient() == ""  # the control: ours alone is quiet
    venv.install(foreign)  # its resilient/__init__.py replaces ours: our import code is gone

    proc = venv.run(str(venv.bin / "resilient"), "--version")
    assert "ForeignPackageWarning: another package named 'resilient'" in proc.stderr
    assert "Fix: pip uninstall resilient resilient-hpc && pip install resilient-hpc" in proc.stderr
