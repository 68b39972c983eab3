"""No private name crosses a module boundary in the library or ``bench/``: no ``from x import _y``
of another module, no ``module._y`` on an imported ``resilient`` module. What another module
needs is public, with a docstring (tests may reach in; they are not scanned)."""

from __future__ import annotations

import ast
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import resilient

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("resilient", "bench")

# (file, the private name it uses): each one is a debt with its reason
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> set[str]:
    found = pkgutil.walk_packages(resilient.__path__, "resilient.")
    return {"resilient", *(m.name for m in found)}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, own: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = own.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _dotted(node: ast.expr) -> list[str] | None:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else [*inner, node.attr]
    return None


def private_uses(path: Path, modules: set[str]) -> Iterator[str]:
    """The private names of other modules that ``path`` imports or reads, dotted."""
    own = _own_module(path)
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # a local name -> the resilient module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] != "resilient":
                    continue
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound["resilient"] = "resilient"
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, own, path.name == "__init__.py")
            for alias in node.names:
                if source != own and _private(alias.name):
                    yield f"{source}.{alias.name}"
                if f"{source}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value)
            if dotted is None or dotted[0] not in bound:
                continue
            module = ".".join([bound[dotted[0]], *dotted[1:]])
            if module in modules and module != own:
                yield f"{module}.{node.attr}"


def _scanned() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO / top).rglob("*.py"))


def test_no_private_name_crosses_a_module() -> None:
    modules = _modules()
    found = {
        (str(path.relative_to(REPO)), use)
        for path in _scanned()
        for use in private_uses(path, modules)
    }
    assert found - ALLOWED == set(), sorted(found - ALLOWED)
    assert ALLOWED - found == set(), "allowed but no longer used: drop it from ALLOWED"


def test_the_scan_sees_both_ways_in(tmp_path: Path) -> None:
    probe = REPO / "bench" / "_probe_private_imports.py"
    text = (
        "from resilient.io import storage\n"
        "import resilient.job.run as run\n"
        "from resilient.checkpoint.restorer import _parts, Restorer\n"
        "storage._rewrite_markers\n"
        "run._descendants\n"
        "resilient_name._private\n"
    )
    probe.write_text(text)
    try:
        uses = sorted(private_uses(probe, _modules()))
    finally:
        probe.unlink()
    assert uses == [
        "resilient.checkpoint.restorer._parts",
        "resilient.io.storage._rewrite_markers",
        "resilient.job.run._descendants",
    ]
