"""Every file a page includes is a file the tests run, so that a page cannot drift from it.

The pages show programs, Snakefiles, profiles, Parsl scripts and sbatch scripts with
``literalinclude`` of the real files; this checks that each one exists and that a test (or a
Python block of a page, which Sybil runs) names it: its path, its module, or its directory of examples.
The library's own sources shown by the design page are the code itself and need no test here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INCLUDE = re.compile(r"^```\{literalinclude\}\s+(\S+)", re.MULTILINE)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
CODE_ITSELF = ("resilient/", "pyproject.toml")


def pages() -> list[Path]:
    return [p for p in DOCS.rglob("*.md") if "_build" not in p.parts]


def included() -> dict[Path, list[str]]:
    found: dict[Path, list[str]] = {}
    for page in pages():
        for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            found.setdefault(path, []).append(str(page.relative_to(ROOT)))
    return found


def test_the_pages_include_files() -> None:
    assert len(included()) >= 10


def test_every_included_file_exists_and_is_run_by_a_test() -> None:
    texts = [p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py")]
    texts += ["\n".join(PYTHON_BLOCK.findall(p.read_text(encoding="utf-8"))) for p in pages()]
    corpus = "\n".join(texts)
    untested = []
    for path, where in sorted(included().items()):
        assert path.is_file(), f"{where} include(s) {path}, which does not exist"
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(CODE_ITSELF):
            continue
        parent = path.parent.relative_to(ROOT)
        names = {rel, rel.removesuffix(".py").replace("/", ".")}  # a file, or a module (-m)
        if len(parent.parts) >= 2:
            names.add(parent.as_posix())  # a directory of examples: docs/examples/tutorial
        # a path may be spelled in parts in a test: REPO / "docs" / "examples" / "tutorial"
        parts = '" / "'.join(parent.parts) if len(parent.parts) >= 2 else rel
        if not any(name in corpus for name in names) and parts not in corpus:
            untested.append(f"{rel} (included by {', '.join(where)})")
    assert not untested, "included but named by no test:\n" + "\n".join(untested)
