"""The import-linter contracts in pyproject.toml name every package and every module; the pure
model (resilient.model) starts no thread and reads no environment variable."""

from __future__ import annotations

import ast
import pkgutil
import re
from pathlib import Path

import pytest

import resilient

tomllib = pytest.importorskip("tomllib")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _contracts() -> list[dict[str, object]]:
    doc = tomllib.loads(PYPROJECT.read_text())
    contracts: list[dict[str, object]] = doc["tool"]["importlinter"]["contracts"]
    return contracts


def _listed(contract: dict[str, object]) -> set[str]:
    layers = contract["layers"]
    assert isinstance(layers, list)
    return {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}


def _top_level() -> set[str]:
    return {f"resilient.{m.name}" for m in pkgutil.iter_modules(resilient.__path__)}


def _modules() -> set[str]:
    """Every module of the library that is not a package (a package's own file is empty)."""
    found = pkgutil.walk_packages(resilient.__path__, "resilient.")
    return {m.name for m in found if not m.ispkg}


def _packages_with_layers() -> set[str]:
    found = pkgutil.walk_packages(resilient.__path__, "resilient.")
    return {m.name for m in found if m.ispkg and not m.name.startswith("resilient.integrations")}


def test_every_top_level_module_and_package_has_a_layer() -> None:
    (layers,) = [c for c in _contracts() if c["type"] == "layers" and "containers" not in c]
    assert _listed(layers) == _top_level()


def test_every_module_of_every_package_has_a_layer_inside_it() -> None:
    inside: dict[str, set[str]] = {}
    for c in _contracts():
        containers = c.get("containers")
        if c["type"] == "layers" and isinstance(containers, list):
            (container,) = containers
            inside[str(container)] = _listed(c)
    assert set(inside) == _packages_with_layers()
    for package, names in inside.items():
        mine = {m.rsplit(".", 1)[1] for m in _modules() if m.rsplit(".", 1)[0] == package}
        assert names == mine, package


def _covers(sources: object, module: str) -> bool:
    assert isinstance(sources, list)
    return any(module == s or module.startswith(f"{s}.") for s in sources)


def _rule(forbidden: list[str]) -> dict[str, object]:
    (rule,) = [c for c in _contracts() if c.get("forbidden_modules") == forbidden]
    return rule


def test_the_mpi4py_rule_covers_every_module_but_mpi() -> None:
    rule = _rule(["mpi4py"])
    for module in _modules():
        assert _covers(rule["source_modules"], module) == (module != "resilient.parallel.mpi"), (
            module
        )


def test_the_engine_rule_covers_every_module_but_the_integrations() -> None:
    rule = _rule(["snakemake", "parsl"])
    for module in _modules():
        expected = not module.startswith("resilient.integrations.")
        assert _covers(rule["source_modules"], module) == expected, module


def test_the_torch_rule_covers_every_module_but_torchdist_and_torchlazy() -> None:
    rule = _rule(["torch"])
    allowed = {"resilient.parallel.torchdist", "resilient.model.torchlazy"}
    for module in _modules():
        assert _covers(rule["source_modules"], module) == (module not in allowed), module


def test_only_torchlazy_reaches_torch_through_sys_modules() -> None:
    """What the contract cannot see: ``sys.modules["torch"]`` (or ``"torch" in sys.modules``)."""
    root = Path(resilient.__file__).parent
    reach = re.compile(r"sys\.modules\b.*torch|torch.*\bsys\.modules")
    found = {
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line)
    }
    assert {where.partition(":")[0] for where in found} == {"model/torchlazy.py"}, found


_THREADS = ("threading", "_thread", "concurrent", "multiprocessing")
_ENVIRON = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")


def _impurities(source: str) -> list[str]:
    """The thread modules a module's source imports (lazily too) and the environment reads
    (``os.environ``, ``os.getenv``...) it makes, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.module == "os":
                names += [f"os.{a.name}" for a in node.names if a.name in _ENVIRON]
        elif isinstance(node, ast.Attribute) and node.attr in _ENVIRON:
            names = [f"?.{node.attr}"]
        else:
            continue
        found += [
            f"{node.lineno}: {n}"
            for n in names
            if n.split(".")[0] in _THREADS or n.rsplit(".", 1)[-1] in _ENVIRON
        ]
    return found


def test_the_model_starts_no_thread_and_reads_no_environment() -> None:
    model = Path(resilient.__file__).parent / "model"
    found = {p.name: _impurities(p.read_text()) for p in sorted(model.glob("*.py"))}
    assert {name: why for name, why in found.items() if why} == {}


def test_the_purity_check_sees_threads_and_environment_reads() -> None:
    source = """
import threading
from concurrent.futures import ThreadPoolExecutor
from os import getenv
import os
def f():
    import multiprocessing
    return os.environ.get("X")
"""
    assert _impurities(source) == [
        "2: threading", "3: concurrent.futures", "4: os.getenv", "7: multiprocessing",
        "8: ?.environ",
    ]  # fmt: skip


FILE_EFFECTS = re.compile(
    r"os\.(open|rename|replace|fsync|pwrite|write|link|listdir)|\bopen\(|\.rename\(|\.unlink\("
    r"|\.mkdir\(|shutil\."
)


def test_the_checkpoint_data_path_moves_no_bytes_itself() -> None:
    """``model``, ``parallel`` and ``checkpoint`` open, rename, write, fsync and list no file:
    :mod:`resilient.io` does (its storage targets, fileio, wire)."""
    package = Path(resilient.__file__).parent
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for name in ("model", "parallel", "checkpoint")
        for path in sorted((package / name).glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FILE_EFFECTS.search(line)
    ]
    assert found == []
