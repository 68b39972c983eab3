"""Sphinx configuration of the resilient documentation (``bash .ci/dev docs`` builds it).

Nothing is fetched at build or view time: no intersphinx, no remote scripts or fonts (the Furo
theme ships its assets). Warnings are errors (``-W -n`` in ``.ci/dev``); names from other
projects that autodoc cannot link are listed in ``nitpick_ignore_regex``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the checkout's resilient, apps and workflows
sys.path.insert(0, str(DOCS / "_ext"))  # local extensions

from resilient import __version__  # noqa: E402

project = "resilient"
author = "the resilient developers"
copyright = "2026, the resilient developers"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "internal_refs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "examples", "conftest.py", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# curly quotes only: "--walltime" and "..." stay as typed (a dash in an option is no en dash)
smartquotes_action = "q"

# autodoc: the public API from its docstrings; torch is never imported (an extra, several GB)
autodoc_mock_imports = ["torch"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True}  # a False value would switch an option on
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: autodoc documents the attributes once

nitpicky = True
# Types of other projects (no intersphinx inventories: nothing is fetched) and typing internals.
_OTHER_PROJECTS = (
    "numpy|np|h5py|mpi4py|MPI|torch|yaml|tenacity|parsl|snakemake|collections|typing|"
    "typing_extensions|os|sys|pathlib|logging|argparse|concurrent|threading|types|signal|enum|"
    "dataclasses"
)
_BARE_NAMES = (
    "Path|PathLike|Callable|Mapping|Sequence|Iterable|Iterator|Any|Self|ndarray|ArrayLike|"
    "DTypeLike|NDArray|Literal|TypeVar|ParamSpec|P|R|T|_T|int|float|str|bytes|bool|None|object|"
    "dict|list|tuple|set|frozenset|type|Exception|BaseException|OSError|ValueError|RuntimeError|"
    "TypeError"
)
nitpick_ignore_regex = [
    (r"py:.*", rf"({_OTHER_PROJECTS})(\..*)?"),
    (r"py:.*", rf"~?({_BARE_NAMES})"),
]

html_theme = "furo"
html_title = f"resilient {release}"
html_static_path = ["_static"]
html_show_sourcelink = False
html_theme_options = {"navigation_with_keys": True}
pygments_style = "sphinx"
pygments_dark_style = "monokai"

os.environ.setdefault("RESILIENT_DOCS_BUILD", "1")
