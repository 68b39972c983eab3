"""The README stays one screen, and its example is the tutorial's program, byte for byte.

No MPI: the program itself runs in tests/test_docs_tutorial.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PROGRAM = ROOT / "docs" / "examples" / "tutorial" / "heat1d.py"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_the_readme_example_is_the_tutorial_program() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) == 1, f"the README has {len(blocks)} Python blocks, not one"
    assert blocks[0] == PROGRAM.read_text(encoding="utf-8"), (
        "the README's example differs from docs/examples/tutorial/heat1d.py: copy the file "
        "into the README's ```python block"
    )


def test_the_readme_is_about_one_screen() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_the_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to no page"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
