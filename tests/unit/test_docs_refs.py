"""docs/_ext/internal_refs: a reference to an internal path links to the documented public
name of the same object, a real but undocumented object is code text, and a name that does
not exist still warns (so the site's build, warnings as errors, fails on it)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

pytest.importorskip("sphinx")

from sphinx.application import Sphinx

EXT = Path(__file__).resolve().parents[2] / "docs" / "_ext"

PAGE = """\
API
===

.. autoclass:: resilient.CheckpointManager
   :no-members:
   :members: save

Linked: :class:`resilient.checkpoint.manager.CheckpointManager`,
:meth:`resilient.checkpoint.manager.CheckpointManager.save`.
Code text: :mod:`resilient.job.handoff`, :func:`resilient.io.storage.quarantine`.
Missing: :class:`resilient.checkpoint.manager.CheckpointManagr`,
:func:`resilient.io.storage.no_such_function`.
"""


def _build(tmp_path: Path) -> tuple[str, str]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(EXT)!r})\n"
        "extensions = ['sphinx.ext.autodoc', 'internal_refs']\n"
        "nitpicky = True\nautodoc_typehints = 'none'\n"
    )
    (src / "index.rst").write_text(PAGE)
    warnings = io.StringIO()
    app = Sphinx(
        str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"), "html",
        status=None, warning=warnings, freshenv=True,
    )  # fmt: skip
    app.build()
    return (tmp_path / "out" / "index.html").read_text(encoding="utf-8"), warnings.getvalue()


def test_internal_references_link_render_or_warn(tmp_path: Path) -> None:
    html, warnings = _build(tmp_path)
    # (a) the documented public name of the same object (and of its member)
    assert 'href="#resilient.CheckpointManager"' in html
    assert 'href="#resilient.CheckpointManager.save"' in html
    # (b) real, undocumented: code text without a link, and no warning
    for name in ("resilient.job.handoff", "resilient.io.storage.quarantine"):
        assert f'<span class="pre">{name}' in html
        assert name not in warnings
    assert "resilient.job.handoff</span></code></a>" not in html
    # (c) not there: a warning each
    assert "resilient.checkpoint.manager.CheckpointManagr" in warnings
    assert "resilient.io.storage.no_such_function" in warnings
    assert warnings.count("reference target not found") == 2, warnings
