"""Keep pyproject.toml, pixi.toml, README.md and .ci/ in step with one another.

No MPI and no network: these tests only read the repository's own files.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomllib is new in 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]

README_DEMO = "bash .ci/dev demo"
README_TEST = "bash .ci/dev test"

# PyPI name -> conda-forge name, where they differ (after normalisation).
PYPI_TO_CONDA = {
    "matplotlib": "matplotlib-base",
    "xxhash": "python-xxhash",
    "mpich": "mpich",  # the PyPI MPICH wheel <-> conda-forge's mpich
    "torch": "pytorch",
}

TOOLS = ("pytest", "pytest-timeout", "hypothesis", "ruff", "mypy")
WORKFLOW_TOOLS = ("snakemake", "snakemake-executor-plugin-slurm", "parsl")


def norm(name: str) -> str:
    """Compare package names case-insensitively, with `-`, `_` and `.` all the same."""
    return re.sub(r"[-_.]+", "-", name).lower()


def conda_name(pypi_name: str) -> str:
    n = norm(pypi_name)
    return norm(PYPI_TO_CONDA.get(n, n))


def load_toml(name: str) -> dict[str, Any]:
    with (ROOT / name).open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)
    return data


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return load_toml("pyproject.toml")


@pytest.fixture(scope="module")
def pixi() -> dict[str, Any]:
    return load_toml("pixi.toml")


def pixi_default_deps(pixi: dict[str, Any]) -> dict[str, Any]:
    deps: dict[str, Any] = pixi.get("dependencies", {})
    return {norm(k): v for k, v in deps.items()}


def pixi_all_conda_names(pixi: dict[str, Any]) -> set[str]:
    """Conda package names in [dependencies] and in every [feature.X.dependencies]."""
    names = set(pixi_default_deps(pixi))
    for feature in pixi.get("feature", {}).values():
        names |= {norm(k) for k in feature.get("dependencies", {})}
    return names


def pixi_all_pypi_names(pixi: dict[str, Any]) -> set[str]:
    names = {norm(k) for k in pixi.get("pypi-dependencies", {})}
    for feature in pixi.get("feature", {}).values():
        names |= {norm(k) for k in feature.get("pypi-dependencies", {})}
    return names


def pixi_task_names(pixi: dict[str, Any]) -> set[str]:
    names = set(pixi.get("tasks", {}))
    for feature in pixi.get("feature", {}).values():
        names |= set(feature.get("tasks", {}))
    return names


def extra_requirements(pyproject: dict[str, Any], extra: str) -> list[Requirement]:
    """The requirements of one extra, without self-references such as `resilient-hpc[test]`."""
    own = canonicalize_name(pyproject["project"]["name"])
    reqs = [Requirement(r) for r in pyproject["project"]["optional-dependencies"][extra]]
    return [r for r in reqs if canonicalize_name(r.name) != own]


def readme_quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Quick start\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Quick start' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the README quick start has no code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def conda_spec_allows(spec: Any, version: str) -> bool:
    """Whether a (simple) conda version spec, e.g. '>=3.10', '3.11.*' or '>=3.10,<3.14',
    admits `version`. Table specs (`{ version = "..." }`) are read too."""
    if isinstance(spec, dict):
        spec = spec.get("version", "*")
    assert isinstance(spec, str), f"unexpected spec {spec!r}"
    spec = spec.replace(" ", "")
    if spec in ("", "*"):
        return True
    parts = []
    for part in spec.split(","):
        if not re.match(r"[<>=!~]", part):
            part = "==" + part  # conda's bare '3.11.*' means '==3.11.*'
        parts.append(part)
    return SpecifierSet(",".join(parts)).contains(version)


# --- (a) dependencies: pyproject <-> pixi ---------------------------------------------


def test_runtime_dependencies_have_conda_forge_counterparts(
    pyproject: dict[str, Any], pixi: dict[str, Any]
) -> None:
    runtime = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    assert {norm(r.name) for r in runtime} >= {"numpy", "h5py", "mpi4py", "xxhash"}
    default = pixi_default_deps(pixi)
    missing = [r.name for r in runtime if conda_name(r.name) not in default]
    assert not missing, f"runtime deps missing from pixi [dependencies]: {missing}"


@pytest.mark.parametrize(
    "extra", ["mpich", "test", "dev", "workflows", "report", "torch", "docs"]
)
def test_extras_have_pixi_counterparts(
    pyproject: dict[str, Any], pixi: dict[str, Any], extra: str
) -> None:
    reqs = extra_requirements(pyproject, extra)
    assert reqs, f"extra {extra!r} is empty"
    available = pixi_all_conda_names(pixi)
    missing = [r.name for r in reqs if conda_name(r.name) not in available]
    assert not missing, f"[{extra}] deps missing from pixi (deps or features): {missing}"


def test_dev_tools_and_workflow_tools_are_declared(
    pyproject: dict[str, Any], pixi: dict[str, Any]
) -> None:
    declared: set[str] = set()
    for extra in pyproject["project"]["optional-dependencies"]:
        declared |= {norm(r.name) for r in extra_requirements(pyproject, extra)}
    available = pixi_all_conda_names(pixi)
    for tool in (*TOOLS, *WORKFLOW_TOOLS):
        assert tool in declared, f"{tool} is not in any pyproject extra"
        assert tool in available, f"{tool} is not in pixi.toml"


def test_extras_chain_dev_to_test_to_mpich(pyproject: dict[str, Any]) -> None:
    extras = pyproject["project"]["optional-dependencies"]
    own = norm(pyproject["project"]["name"])

    def includes(extra: str) -> set[str]:
        found: set[str] = set()
        for r in map(Requirement, extras[extra]):
            if norm(r.name) == own:
                found |= r.extras
        return found

    assert "test" in includes("dev")
    assert "mpich" in includes("test")


def test_torch_is_an_extra_outside_the_default_install(
    pyproject: dict[str, Any], pixi: dict[str, Any]
) -> None:
    """PyTorch is several GB from PyPI: only `[torch]` (and the benchmarks' peers), its own pixi
    environment, and CI."""
    assert [norm(r.name) for r in extra_requirements(pyproject, "torch")] == ["torch"]
    for extra in ("test", "dev", "mpich", "workflows", "report"):
        reqs = pyproject["project"]["optional-dependencies"][extra]
        assert not any("torch" in r for r in reqs), f"[{extra}] pulls in torch"
    assert "pytorch" not in pixi_default_deps(pixi)
    for env in ("default", "openmpi"):
        assert "torch" not in pixi["environments"][env]["features"]
    assert "torch" in pixi["environments"]["torch"]["features"]
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("torch:") for m in markers)
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "export RESILIENT_TORCH=1" in run, "CI must run the torch tests"


def test_pixi_installs_the_project_editable(
    pyproject: dict[str, Any], pixi: dict[str, Any]
) -> None:
    assert "conda-forge" in pixi["workspace"]["channels"]
    assert pixi["workspace"]["channels"][0] == "conda-forge", "conda-forge must come first"
    spec = pixi["pypi-dependencies"][pyproject["project"]["name"]]
    assert spec == {"path": ".", "editable": True}
    assert "mpich" not in pixi_all_pypi_names(pixi), "MPI must come from conda-forge here"


def test_pixi_offers_mpich_and_openmpi_environments(pixi: dict[str, Any]) -> None:
    features = pixi["feature"]
    assert "mpich" in features["mpich"]["dependencies"]
    assert "openmpi" in features["openmpi"]["dependencies"]
    envs = pixi["environments"]
    for env, mpi in (("default", "mpich"), ("openmpi", "openmpi")):
        spec = envs[env]
        feats = spec["features"] if isinstance(spec, dict) else spec
        assert mpi in feats, f"pixi environment {env!r} lacks feature {mpi!r}"
        other = {"mpich", "openmpi"} - {mpi}
        assert not other & set(feats), f"pixi environment {env!r} mixes MPI implementations"


# --- (b) tasks and the README quick start ----------------------------------------------


def test_pixi_has_the_readme_tasks(pixi: dict[str, Any]) -> None:
    tasks = pixi_task_names(pixi)
    assert {"demo", "test", "lint", "typecheck", "test-mpi"} <= tasks


def test_pixi_test_task_runs_the_dev_script_without_venv(pixi: dict[str, Any]) -> None:
    test = pixi["tasks"]["test"]
    cmd = test if isinstance(test, str) else test["cmd"]
    assert cmd.split()[:3] == ["bash", ".ci/dev", "test"]
    assert "--no-venv" in cmd.split()


def test_readme_quick_start_is_exactly_two_commands() -> None:
    assert readme_quick_start_commands() == [README_DEMO, README_TEST]


# --- (c) CI calls the README test command ------------------------------------------------


def test_ci_run_calls_the_readme_test_command() -> None:
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    code = [line.split("#", 1)[0] for line in run.splitlines()]
    assert any(README_TEST in line for line in code), ".ci/run does not run the README test"
    assert run.startswith("#!") and "set -euo pipefail" in run


@pytest.mark.parametrize("script", ["dev", "run"])
def test_ci_scripts_are_executable_bash(script: str) -> None:
    path = ROOT / ".ci" / script
    assert path.read_text(encoding="utf-8").startswith("#!/usr/bin/env bash\n")
    assert path.stat().st_mode & 0o111, f".ci/{script} is not executable"


# --- (d) Python versions ----------------------------------------------------------------


def test_requires_python_admits_3_10(pyproject: dict[str, Any]) -> None:
    spec = SpecifierSet(pyproject["project"]["requires-python"])
    assert spec.contains("3.10.0"), f"requires-python {spec} excludes 3.10"
    assert not spec.contains("3.9.99"), "requires-python should stop at 3.10"


def test_pixi_python_admits_3_10(pixi: dict[str, Any]) -> None:
    python = pixi_default_deps(pixi)["python"]
    assert conda_spec_allows(python, "3.10.0")


def test_mypy_and_ruff_target_3_10(pyproject: dict[str, Any]) -> None:
    tool = pyproject["tool"]
    assert tool["mypy"]["python_version"] == "3.10"
    assert tool["mypy"]["strict"] is True
    assert tool["ruff"]["target-version"] == "py310"


def test_conda_spec_helper() -> None:
    assert conda_spec_allows(">=3.10", "3.10.0")
    assert conda_spec_allows("3.10.*", "3.10.4")
    assert conda_spec_allows({"version": ">=3.10,<3.14"}, "3.12.1")
    assert not conda_spec_allows("3.11.*", "3.10.0")
    assert not conda_spec_allows(">=3.11", "3.10.0")


# --- (e) typed package ------------------------------------------------------------------


def test_package_is_typed(pyproject: dict[str, Any]) -> None:
    assert (ROOT / "resilient" / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["resilient"]


# --- (f) the distribution's name ---------------------------------------------------------

DIST = "resilient-hpc"
"""`resilient` on PyPI is another vendor's package (IBM SOAR's REST API client)."""

TEXT_SUFFIXES = (".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".sh")
SKIP_DIRS = {".git", ".venv", ".pixi", "__pycache__", "build", "out", ".mypy_cache", ".ruff_cache"}


def repository_text_files() -> list[Path]:
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith(TEXT_SUFFIXES) or Path(top).name == ".ci":
                found.append(Path(top, name))
    return found


def test_the_distribution_is_resilient_hpc(pyproject: dict[str, Any], pixi: dict[str, Any]) -> None:
    assert pyproject["project"]["name"] == DIST
    assert pixi["workspace"]["name"] == DIST
    for extra in ("test", "dev", "bench"):
        reqs = map(Requirement, pyproject["project"]["optional-dependencies"][extra])
        assert not [r for r in reqs if norm(r.name) == "resilient"], extra


def test_every_install_line_names_resilient_hpc() -> None:
    """`pip install resilient`, `'resilient[report]'` or `resilient[torch]` would install (or
    name an extra of) the other vendor's package; the import package stays `resilient`."""
    wrong = re.compile(r"pip install ['\"]?resilient(?!-hpc)\b|(?<![\w-])resilient\[")
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in repository_text_files()
        if path != Path(__file__).resolve()  # the patterns above
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if wrong.search(line)
    ]
    assert not hits, "\n".join(hits)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install resilient-hpc" in readme


def test_only_the_resilient_package_is_shipped(pyproject: dict[str, Any]) -> None:
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(p == "resilient" or p.startswith("resilient.") for p in include)
    assert pyproject["project"]["scripts"]["resilient"] == "resilient.cli:main"


def test_the_installed_distribution_is_resilient_hpc() -> None:
    """The environment running the tests installed this checkout as `resilient-hpc`."""
    from importlib import metadata

    import resilient

    try:
        version = metadata.version(DIST)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{DIST} is not installed here (the package comes from PYTHONPATH)")
    assert version == resilient.__version__
