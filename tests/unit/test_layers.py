"""The import-linter layers contract in pyproject.toml names every module of the package."""

from __future__ import annotations

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


def _top_level_modules() -> set[str]:
    return {f"resilient.{m.name}" for m in pkgutil.iter_modules(resilient.__path__)}


def test_every_module_has_a_layer() -> None:
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    assert isinstance(layers["layers"], list)
    listed = {name for layer in layers["layers"] for name in re.split(r"[|:]", layer)}
    assert {n.strip() for n in listed} == _top_level_modules()


def test_the_mpi4py_rule_covers_every_module_but_mpi() -> None:
    (rule,) = [c for c in _contracts() if c.get("forbidden_modules") == ["mpi4py"]]
    assert isinstance(rule["source_modules"], list)
    assert set(rule["source_modules"]) == _top_level_modules() - {"resilient.mpi"}


def test_the_engine_rule_covers_every_module_but_the_integrations() -> None:
    (rule,) = [c for c in _contracts() if c.get("forbidden_modules") == ["snakemake", "parsl"]]
    assert isinstance(rule["source_modules"], list)
    assert set(rule["source_modules"]) == _top_level_modules() - {"resilient.integrations"}


def test_the_torch_rule_covers_every_module_but_torchdist() -> None:
    (rule,) = [c for c in _contracts() if c.get("forbidden_modules") == ["torch"]]
    assert isinstance(rule["source_modules"], list)
    assert set(rule["source_modules"]) == _top_level_modules() - {"resilient.torchdist"}
