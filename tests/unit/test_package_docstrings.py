"""A package's docstring names every module it holds (``:mod:`.name```), so a newcomer finds
each room by reading it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

PACKAGES = [
    "resilient.checkpoint",
    "resilient.io",
    "resilient.model",
    "resilient.parallel",
    "resilient.job",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_the_package_docstring_names_every_module(name: str) -> None:
    package = importlib.import_module(name)
    doc = package.__doc__ or ""
    modules = [m.name for m in pkgutil.iter_modules(package.__path__)]
    assert modules
    missing = [m for m in modules if f":mod:`.{m}`" not in doc]
    assert not missing, f"{name}'s docstring does not name {missing}"
