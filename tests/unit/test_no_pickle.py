"""Nothing read from disk is ever unpickled (docs/explanation/guarantees.md).

The library's only unpickling is an in-memory round trip of its own exception
(``resilient.parallel.collective._picklable``); no module loads a pickle, ``numpy.load`` or
``torch.load`` (both unpickle), or a ``shelve``/``marshal``/``dill`` store.
"""

from __future__ import annotations

import ast
from pathlib import Path

import resilient

PACKAGE = Path(resilient.__file__).parent
UNPICKLING_CALLS = {"load", "loads", "Unpickler"}
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "shelve", "marshal", "cloudpickle"}
ALLOWED = {("parallel/collective.py", "_picklable")}  # pickle.loads(pickle.dumps(exc)) in memory


def _unpickling_calls(path: Path) -> list[tuple[str, int]]:
    """(function name, line) of every call that unpickles, or loads numpy/torch files."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else ""
            if node.func.attr in UNPICKLING_CALLS and name in UNPICKLING_MODULES:
                found.append((function, node.lineno))
            if node.func.attr == "load" and name in {"np", "numpy", "torch"}:
                found.append((function, node.lineno))
        if isinstance(node, ast.ImportFrom) and node.module in UNPICKLING_MODULES:
            found.append((function, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_no_module_unpickles_what_it_reads() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line} in {function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for function, line in _unpickling_calls(path)
        if (path.relative_to(PACKAGE).as_posix(), function) not in ALLOWED
    ]
    assert offenders == []


def test_the_check_sees_an_unpickling_call(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle\nimport numpy as np\n"
        "def f(b):\n    return pickle.loads(b)\n"
        "def g(p):\n    return np.load(p, allow_pickle=True)\n"
    )
    assert _unpickling_calls(sample) == [("f", 4), ("g", 6)]


def test_the_allowed_round_trip_is_still_in_memory() -> None:
    source = (PACKAGE / "parallel" / "collective.py").read_text()
    assert "pickle.loads(pickle.dumps(exc))" in source
