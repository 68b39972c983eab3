"""How a save and a restore flow through ``resilient``, module by module and package by package.

Run from a checkout's root (the copy of ``resilient`` that is imported is printed first)::

    env -u PYTHONPATH PYTHONPATH=. python bench/flow_trace.py [--flows save,restore,async]
        [--group both|modules|packages] [--mapping MAP.json] [--map MODULE=GROUP ...]
        [--hide MODULES] [--json OUT]

One process, the serial communicator (no MPI): ``CheckpointManager(root)`` and a state of three
small numpy arrays. Three flows are traced, each a public call of the manager:

``save``     ``mgr.save(1, state)``: one blocking save (the first: it plans the files).
``restore``  ``mgr.restore()``: the newest checkpoint, read back and compared.
``async``    ``mgr.save(2, state, blocking=False)`` then ``mgr.wait()``.

What is recorded. ``sys.setprofile`` and ``threading.setprofile`` (installed before the manager
is made, so every thread the library starts carries it) report each Python ``call`` and
``return``. After each one the tracer takes the *innermost resilient module* of that thread's
stack: the module (``__name__`` of the code's globals) of the innermost frame that belongs to
``resilient``. Frames that do not are transparent: the standard library, numpy, h5py, code made
with ``exec`` (a dataclass's generated ``__init__``/``__eq__``: it holds no logic of the module
that defines the class, and calling it is building a value, not handing control over) and a
module's import-time body (``<module>``: an import, not the flow). Each change of that module is
one *transition*, caused by one call or one return. Consecutive repeats vanish by construction,
so the recorded sequence is the *path*, e.g. ``manager > saving > saveset > saving``. When
a thread's stack holds no resilient frame (the script before and after the call, a pool thread
between tasks) the path has a break: a thread's tasks are *segments*, printed separated by
``|``. The main thread's flow is reported, then each other thread's.

The path is also grouped (``--group``): a module maps to a package. A module in a subpackage
(``resilient.checkpoint.saving``) belongs to its first component after ``resilient.``
(``checkpoint``). A flat module (``resilient.saving``, the layout of issue 24's start) belongs
to the package it was meant to move to (:data:`PACKAGES`), so an old revision's flow can be
read in the new packages' terms; ``--mapping`` (a JSON object) and ``--map`` override either,
keyed by the full or the short module name. Grouping merges the consecutive modules of one
package; the package path has its own transitions, and every count below is given for both.

``--hide`` makes modules or packages transparent too, to see the flow among the others only
(``--hide model,parallel``: the orchestration and the I/O without the pure core and the
communicator); the default hides nothing.

Counts, per module (or package) X and in total, for one flow:

entries
    How many separate times the flow enters X: X's runs in the path (the first one included).
    ``entries = first + re-entries by call + re-entries by return`` (+ 1 per segment start).
first
    Calls into X that enter it for the first time in the flow.
re-entries by call (``re:call``)
    Calls into an X the path has been in before. Split by the stack:
    *callback*: X is still on the stack below the new frame: control goes back into a module it
    has not finished with, through something handed down (a thunk, a lambda, a method of an
    object of X). Mostly a lower module calling up; it also counts a call down into a module
    that is lower on the stack (``storage.retry_io(thunk)``, the thunk in ``commit`` calling
    ``storage`` again). *revisit*: X is no longer on the stack; the flow returned out of it and
    calls into it afresh (a higher module calling down into X once more).
re-entries by return (``re:return``)
    Returns into X: control comes back to a module that had called down. Every one is a
    re-entry. Of these, *bounce*: X then leaves again by a call (it takes control back and
    calls down once more), as opposed to a return on the way up.
re-entries (``re:all``)
    By call plus by return: every entry but the first.
calls up (``up-call``)
    Calls into X from a module below X: X depends on the caller's module (imports it, directly
    or through others; imports read from the sources, those under ``TYPE_CHECKING`` left out)
    and not the other way round. A lower layer cannot name a higher one, so each is a call
    through something handed down: **the flow climbs back up by a call**. First entries count
    too (a pool thread's first call from ``background`` into ``saveset`` is one). At the
    package level the same calls, where they cross packages.

A segment's start (from outside the library) is an entry and nothing else. Nothing is sampled:
the counts are exact for this process, this state and this revision; another state (a static
part, a sharded manifest, MPI ranks) takes other paths. A resilient module imported during a
flow is reported (its import-time body is not counted).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np

_GROUPS: dict[str, tuple[str, ...]] = {
    "model": (
        *("filenames", "layout", "nodes", "blocks", "schema", "checksum", "tree", "h5format"),
        *("manifest", "arrays", "payload", "policies", "rotation"),
    ),
    "io": ("fileio", "hdf5", "storage", "staging", "background", "validate", "checkpoints",
           "commit", "runkey"),
    "parallel": ("comm", "mpi", "torchdist", "collective", "topology", "setcomms"),
    "checkpoint": (
        *("checkpointer", "saveset", "reading", "elastic", "elasticread", "statics", "catalog"),
        *("restorer", "partner", "tierstaging"),
        *("tiers", "savepaths", "tiermanager", "saving", "manager"),
    ),
    "job": ("session", "resumable", "slurm", "launch", "run", "exitcodes"),
    "top": (
        *("", "errors", "_version", "config", "cli", "demo", "report", "export"),
        *("workflow", "integrations"),
    ),
}
#: The package each module of the flat layout moved to (issue 24); "" is the package's
#: ``__init__``. A renamed module is here under both names (``hdf5`` became ``fileio``,
#: ``layout`` became ``filenames``, ``checkpointer`` ``saveset``, ``validate`` ``checkpoints``);
#: ``reading`` was split out of ``checkpointer`` (8beaa75).
PACKAGES: dict[str, str] = {module: group for group, names in _GROUPS.items() for module in names}

# --- tracing ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """One transition of a thread's innermost resilient module."""

    kind: str  # "call", "return", "enter" (from outside the library), "exit" (to outside)
    module: str  # short name ("saving", "checkpoint.saving"); "" for the package itself
    source: str  # the module before the transition ("" after an exit or at an entry)
    below: tuple[str, ...]  # for a call: the resilient modules on the stack under the new frame


class Recorder:
    """The transitions of every thread while one flow runs."""

    def __init__(self) -> None:
        self.steps: dict[str, list[Step]] = {}
        self._current: dict[int, str | None] = {}
        self._names: dict[int, str] = {}

    def record(self, frame: FrameType, event: str) -> None:
        start = frame if event == "call" else frame.f_back
        inner = start
        module: str | None = None
        while inner is not None:
            module = _module_of(inner.f_code, inner.f_globals)
            if module is not None:
                break
            inner = inner.f_back
        ident = threading.get_ident()
        before = self._current.get(ident)
        if module == before:
            return
        self._current[ident] = module
        name = self._names.get(ident)
        if name is None:
            name = self._names[ident] = threading.current_thread().name
        steps = self.steps.setdefault(name, [])
        if module is None:
            steps.append(Step("exit", "", before or "", ()))
        elif before is None:
            steps.append(Step("enter", module, "", ()))
        elif event == "return":
            steps.append(Step("return", module, before, ()))
        else:
            below: list[str] = []
            outer = inner.f_back if inner is not None else None
            while outer is not None:
                found = _module_of(outer.f_code, outer.f_globals)
                if found is not None and found not in below:
                    below.append(found)
                outer = outer.f_back
            steps.append(Step("call", module, before, tuple(below)))


_CODE: dict[CodeType, str | None] = {}
_hidden: frozenset[str] = frozenset()  # --hide: modules and packages whose frames are transparent
_package: Callable[[str], str] = str  # a module's package, for --hide
_active: Recorder | None = None


def _module_of(code: CodeType, globals_: Mapping[str, Any]) -> str | None:
    """The short resilient module of a frame's code, or None for a transparent frame."""
    try:
        return _CODE[code]
    except KeyError:
        pass
    name = globals_.get("__name__")
    short: str | None = None
    if (
        isinstance(name, str)
        and (name == "resilient" or name.startswith("resilient."))
        and not code.co_filename.startswith("<")
        and code.co_name != "<module>"
    ):
        short = name[len("resilient.") :] if name != "resilient" else ""
        if short in _hidden or _package(short) in _hidden:
            short = None
    _CODE[code] = short
    return short


def _hook(frame: FrameType, event: str, arg: object) -> None:
    recorder = _active
    if recorder is not None and (event == "call" or event == "return"):
        recorder.record(frame, event)


@contextmanager
def recording() -> Iterator[Recorder]:
    """Record the transitions of every thread for the duration of the block."""
    global _active
    recorder = Recorder()
    _active = recorder
    try:
        yield recorder
    finally:
        _active = None


# --- analysis -------------------------------------------------------------------------------


@dataclasses.dataclass
class Counts:
    """The counts of one module or package in one flow (see the module docstring)."""

    entries: int = 0
    first_calls: int = 0
    callbacks: int = 0
    revisits: int = 0
    returns: int = 0
    bounces: int = 0
    up_calls: int = 0

    @property
    def by_call(self) -> int:
        return self.callbacks + self.revisits

    @property
    def reentries(self) -> int:
        return self.by_call + self.returns

    def add(self, other: Counts) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


@dataclasses.dataclass
class Level:
    """One thread's flow at one level (modules or packages): its path and counts."""

    segments: list[list[str]]
    counts: dict[str, Counts]
    up_edges: dict[str, int] = dataclasses.field(default_factory=dict)  # "caller > called": n

    def path(self) -> str:
        return " | ".join(" > ".join(labels) for labels in self.segments)

    def total(self) -> Counts:
        total = Counts()
        for counts in self.counts.values():
            total.add(counts)
        return total

    def as_json(self) -> dict[str, Any]:
        def row(c: Counts) -> dict[str, int]:
            return {**dataclasses.asdict(c), "by_call": c.by_call, "reentries": c.reentries}

        return {
            "path": self.path(),
            "counts": {label: row(c) for label, c in self.counts.items()},
            "total": row(self.total()),
            "up_edges": self.up_edges,
        }


@dataclasses.dataclass(frozen=True)
class Move:
    """One transition of a path at one level."""

    kind: str  # "enter", "call" or "return"
    label: str  # the module or package entered
    below: frozenset[str]  # for a call: the labels on the stack under the new frame
    up: bool  # for a call: the module called depends on the caller's (it is above it)
    source: str = ""  # for a call: the caller's label


def analyse(
    steps: Sequence[Step], label: Callable[[str], str], above: Callable[[str, str], bool]
) -> Level:
    """The path and counts of ``steps`` with each module named by ``label``.

    ``above(a, b)`` says whether module ``a`` is in a higher layer than module ``b``.
    """
    moves: list[list[Move]] = []  # per segment
    for step in steps:
        if step.kind == "exit":
            continue
        name = label(step.module)
        below = frozenset(label(m) for m in step.below)
        up = step.kind == "call" and above(step.module, step.source)
        if step.kind == "enter":
            moves.append([Move(step.kind, name, below, up)])
        elif moves and moves[-1][-1].label != name:
            moves[-1].append(Move(step.kind, name, below, up, label(step.source)))
    counts: dict[str, Counts] = {}
    up_edges: dict[str, int] = {}
    seen: set[str] = set()
    for segment in moves:
        for i, move in enumerate(segment):
            kind, name, below = move.kind, move.label, move.below
            c = counts.setdefault(name, Counts())
            c.entries += 1
            c.up_calls += move.up
            if move.up:
                edge = f"{move.source} > {name}"
                up_edges[edge] = up_edges.get(edge, 0) + 1
            if kind == "call":
                if name not in seen:
                    c.first_calls += 1
                elif name in below:
                    c.callbacks += 1
                else:
                    c.revisits += 1
            elif kind == "return":
                c.returns += 1
                if i + 1 < len(segment) and segment[i + 1].kind == "call":
                    c.bounces += 1
            seen.add(name)
    return Level([[move.label for move in segment] for segment in moves], counts, up_edges)


def _imported(tree: ast.AST, package: list[str], modules: set[str]) -> Iterator[str]:
    """The resilient modules a module's code imports (anywhere but under ``TYPE_CHECKING``)."""
    nodes: list[ast.AST] = [tree]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
            continue
        nodes.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("resilient."):
                    yield alias.name[len("resilient.") :]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], node.module or ""])
            elif node.module == "resilient" or (node.module or "").startswith("resilient."):
                base = (node.module or "")[len("resilient.") :]
            else:
                continue
            base = base.strip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}".strip(".")
                yield name if name in modules else base


def layers(root: Path) -> Callable[[str, str], bool]:
    """``above(a, b)``: module ``a`` depends on ``b`` (imports it, directly or through others)
    and ``b`` does not depend on ``a``. Read from the sources under ``root`` (the package)."""
    files = {
        ".".join(path.relative_to(root).with_suffix("").parts)
        .removesuffix("__init__")
        .strip("."): path
        for path in root.rglob("*.py")
    }
    direct: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        tree = ast.parse(path.read_text(), str(path))
        direct[module] = set(_imported(tree, package, set(files))) - {module}
    closure: dict[str, set[str]] = {}

    def deps(module: str) -> set[str]:
        if module not in closure:
            closure[module] = set()  # a cycle stops here
            found = set(direct.get(module, ()))
            for other in direct.get(module, ()):
                found |= deps(other)
            closure[module] = found
        return closure[module]

    def above(a: str, b: str) -> bool:
        return b in deps(a) and a not in deps(b)

    return above


def package_of(
    module: str, overrides: Mapping[str, str] | None = None, default: Mapping[str, str] = PACKAGES
) -> str:
    """The package of a short module name: an override, the flat layout's map, or the subpackage."""
    overrides = overrides or {}
    first = module.split(".")[0]
    for key in (module, first):
        if key in overrides:
            return overrides[key]
    if "." not in module and module in default:
        return default[module]
    if "." in module:
        return first
    return default.get(first, first)


# --- report -------------------------------------------------------------------------------

COLUMNS = (
    ("entries", "entries"),
    ("first_calls", "first"),
    ("by_call", "re:call"),
    ("callbacks", "callback"),
    ("revisits", "revisit"),
    ("returns", "re:return"),
    ("bounces", "bounce"),
    ("up_calls", "up-call"),
    ("reentries", "re:all"),
)


def table(level: Level) -> list[str]:
    width = max([len(name) for name in level.counts] + [len("TOTAL")])
    head = f"    {'':<{width}}" + "".join(f"{title:>10}" for _, title in COLUMNS)
    lines = [head]
    rows = sorted(level.counts.items(), key=lambda item: -item[1].entries)
    for name, c in [*rows, ("TOTAL", level.total())]:
        cells = "".join(f"{getattr(c, attr):>10}" for attr, _ in COLUMNS)
        lines.append(f"    {name or '(resilient)':<{width}}{cells}")
    return lines


def report(
    title: str,
    recorder: Recorder,
    levels: Mapping[str, Callable[[str], str]],
    above: Callable[[str, str], bool],
    out: dict[str, Any],
) -> None:
    print(f"\n=== flow: {title}")
    main = threading.main_thread().name
    threads = [main, *sorted(name for name in recorder.steps if name != main)]
    out[title] = {}
    for thread in threads:
        steps = recorder.steps.get(thread, [])
        if not steps:
            continue
        print(f"--- thread {thread}" + (" (main)" if thread == main else ""))
        out[title][thread] = {}
        for level_name, label in levels.items():
            level = analyse(steps, label, above)
            out[title][thread][level_name] = level.as_json()
            total = level.total()
            print(f"  {level_name} path ({sum(map(len, level.segments))} runs):")
            print(f"    {level.path()}")
            print(
                f"  {level_name}: re-entries by call {total.by_call} (callbacks {total.callbacks},"
                f" revisits {total.revisits}), by return {total.returns}"
                f" (bounces {total.bounces}), all {total.reentries}; calls up {total.up_calls}"
            )
            print("\n".join(table(level)))
            if level.up_edges:
                edges = sorted(level.up_edges.items(), key=lambda item: (-item[1], item[0]))
                print("  calls up: " + ", ".join(f"{edge} x{n}" for edge, n in edges))


# --- the flows ------------------------------------------------------------------------------


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(24)
    return {
        "u": rng.random(1000),
        "v": rng.random((20, 30)).astype(np.float32),
        "k": np.arange(64, dtype=np.int64),
    }


def check(state: Mapping[str, Any], restored: Mapping[str, Any]) -> None:
    for key, value in state.items():
        if not np.array_equal(np.asarray(restored[key]), value):
            raise SystemExit(f"restore: {key!r} differs from what was saved")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--flows", default="save,restore,async", help="save,restore,async")
    parser.add_argument("--group", choices=("both", "modules", "packages"), default="both")
    parser.add_argument("--mapping", type=Path, help="JSON object: module -> package")
    parser.add_argument("--map", action="append", default=[], metavar="MODULE=PACKAGE")
    parser.add_argument(
        "--hide",
        default="",
        help="modules or packages (comma-separated) whose frames count as outside code",
    )
    parser.add_argument("--dir", type=Path, help="where to make the checkpoint directory")
    parser.add_argument("--json", type=Path, help="write paths and counts to this file")
    args = parser.parse_args(argv)

    overrides: dict[str, str] = {}
    if args.mapping is not None:
        overrides.update(json.loads(args.mapping.read_text()))
    for item in args.map:
        module, _, package = item.partition("=")
        overrides[module.removeprefix("resilient.")] = package
    levels: dict[str, Callable[[str], str]] = {}
    if args.group in ("both", "modules"):
        levels["modules"] = lambda module: module
    if args.group in ("both", "packages"):
        levels["packages"] = lambda module: package_of(module, overrides)
    global _hidden, _package
    _hidden = frozenset(name.strip() for name in args.hide.split(",") if name.strip())
    _package = functools.partial(package_of, overrides=overrides)
    flows = [flow.strip() for flow in args.flows.split(",") if flow.strip()]

    import resilient

    print(f"resilient: {resilient.__file__} (version {resilient.__version__})")
    print(f"python: {sys.version.split()[0]}; flows: {', '.join(flows)}")
    above = layers(Path(resilient.__file__).parent)
    if _hidden:
        print(f"hidden (transparent): {', '.join(sorted(_hidden))}")
    # the library's modules are imported before tracing: an import is not part of a flow
    from resilient import CheckpointManager

    threading.setprofile(_hook)
    sys.setprofile(_hook)
    root = Path(tempfile.mkdtemp(prefix="flow-trace-", dir=args.dir))
    out: dict[str, Any] = {"resilient": resilient.__file__, "flows": {}}
    try:
        state = make_state()
        mgr = CheckpointManager(root / "ckpt")
        try:
            known = set(sys.modules)
            for flow in flows:
                if flow == "save":
                    with recording() as recorder:
                        mgr.save(1, state)
                    title = "save: mgr.save(1, state)"
                elif flow == "restore":
                    with recording() as recorder:
                        _, restored = mgr.restore()
                    check(state, restored)
                    title = "restore: mgr.restore()"
                elif flow == "async":
                    with recording() as recorder:
                        mgr.save(2, state, blocking=False)
                        mgr.wait()
                    title = "async: mgr.save(2, state, blocking=False); mgr.wait()"
                else:
                    raise SystemExit(f"unknown flow {flow!r}")
                report(title, recorder, levels, above, out["flows"])
                imported = sorted(
                    m for m in sys.modules if m.startswith("resilient") and m not in known
                )
                if imported:
                    print(f"  imported during the flow: {', '.join(imported)}")
                known = set(sys.modules)
        finally:
            mgr.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        shutil.rmtree(root, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
