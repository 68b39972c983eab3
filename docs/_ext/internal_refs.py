"""Cross-references from docstrings to the library's internal paths, without weakening nitpicky.

Docstrings name objects where they are defined (``resilient.checkpoint.manager.CheckpointManager``,
:mod:`resilient.job.handoff`), and the API page documents them where users import them
(``resilient.CheckpointManager``). For each Python reference Sphinx cannot resolve, this
extension (a ``missing-reference`` handler):

(a) links it to the documented name of the same object (the object a documented name imports
    to, or a member of such an object: ``...manager.CheckpointManager.save`` links to
    ``resilient.CheckpointManager.save``);
(b) renders a reference to a real object that is not documented (it imports) as its code text,
    without a link;
(c) leaves any other reference alone: Sphinx warns, and the build (warnings as errors) fails.

A short name is looked up the way the docstring's own module sees it: in the module the
reference sits in, and in the modules that define the documented class or module around it.
"""

from __future__ import annotations

import importlib
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

_MISSING = object()
_DOCUMENTED: dict[int, dict[int, str]] = {}  # per Sphinx application: one build


def _import(dotted: str) -> Any:
    """The object a dotted name imports to (``a.b.C.d``), or ``_MISSING``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that fails for another reason is not a target
            return _MISSING
        for attr in parts[cut:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def _documented(app: Sphinx, env: BuildEnvironment) -> dict[int, str]:
    """``id(object) -> documented name`` for every documented module, class and function
    (made once per build, after every page is read)."""
    found: dict[int, str] | None = _DOCUMENTED.get(id(app))
    if found is not None:
        return found
    found = {}
    for name, entry in sorted(env.get_domain("py").objects.items()):
        if entry.objtype not in ("module", "class", "function", "exception", "decorator"):
            continue
        obj = _import(name)
        if obj is not _MISSING:
            found.setdefault(id(obj), name)
    _DOCUMENTED[id(app)] = found
    return found


def _described(node: pending_xref) -> str | None:
    """The full name of the object whose description holds ``node``: from the source autodoc
    gives a docstring's lines (``<file>:docstring of <full name>``), else from the enclosing
    signature (a type from an annotation has no source)."""
    source = str(node.source or "")
    if "docstring of " in source:
        return source.rpartition("docstring of ")[2].split(":")[0]
    parent = node.parent
    while parent is not None and not isinstance(parent, addnodes.desc):
        parent = parent.parent
    if parent is None:
        return None
    for sig in parent.findall(addnodes.desc_signature):
        module, fullname = sig.get("module"), sig.get("fullname")
        if module and fullname:
            return f"{module}.{fullname}"
    return None


def _candidates(target: str, node: pending_xref) -> list[str]:
    """The full names a (possibly short) target may mean, most specific first."""
    names = [target]
    contexts: list[str] = []
    module = node.get("py:module")
    cls = node.get("py:class")
    if module:
        if cls:
            contexts.append(f"{module}.{cls}")
            owner = _import(f"{module}.{cls}")
            defined_in = getattr(owner, "__module__", None)
            if isinstance(defined_in, str):
                contexts += [f"{defined_in}.{cls.split('.')[-1]}", defined_in]
        contexts.append(module)
    described = _described(node)
    if described:
        head = described
        while head:
            obj = _import(head)
            where = getattr(obj, "__module__", None) if obj is not _MISSING else None
            if isinstance(where, str):
                contexts += [head, where]
                break
            if obj is not _MISSING:  # a module
                contexts.append(head)
                break
            head = head.rpartition(".")[0]
    contexts.append("resilient")  # the public names, last
    names += [f"{ctx}.{target}" for ctx in contexts]
    return list(dict.fromkeys(names))


def _link(app: Sphinx, env: BuildEnvironment, obj: Any, dotted: str) -> str | None:
    """The documented name of ``obj`` (reached as ``dotted``), or of its owner plus member."""
    documented = _documented(app, env)
    objects = env.get_domain("py").objects
    if id(obj) in documented:
        return documented[id(obj)]
    head, _, member = dotted.rpartition(".")
    if head:
        owner = _import(head)
        if owner is not _MISSING and id(owner) in documented:
            name = f"{documented[id(owner)]}.{member}"
            if name in objects:
                return name
    return None


def resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.Element | None:
    if node.get("refdomain") != "py":
        return None
    target = str(node.get("reftarget", "")).lstrip(".~")
    if not target.startswith("resilient") and "." not in target and node.get("py:module") is None:
        return None
    for dotted in _candidates(target, node):
        obj = _import(dotted)
        if obj is _MISSING:
            continue
        name = _link(app, env, obj, dotted)
        if name is not None:  # (a)
            domain = env.get_domain("py")
            ref = domain.resolve_xref(env, node["refdoc"], app.builder, "obj", name, node, contnode)
            if ref is not None:
                return ref
        if dotted.startswith("resilient"):  # (b): real, not documented: code text
            return contnode
    return None  # (c): Sphinx warns


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", resolve)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
