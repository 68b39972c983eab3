"""The ``resilient`` command: inspect, verify and prune checkpoint roots.

It never initialises MPI and imports neither mpi4py nor h5py: it runs on login nodes, in batch
scripts, and inside MPI jobs, where a second ``MPI_Init`` would abort the process.

``ls`` and ``status`` also take a workflow's checkpoint tree (``ckpt/`` holding
``ckpt/sim/a-1a2b3c4d5e6f/``...): a directory that is not a root itself but has roots below it
(:func:`resilient.report.find_roots`). They list one line per task root: the task (its path
relative to the directory, ``sim/a-1a2b3c4d5e6f``; ``report`` names it the same way:
:func:`resilient.model.filenames.task_name`), its newest valid step, its attempts and the last
one's outcome from its ``attempts.jsonl`` ledger; ``status --json`` gives a list of objects.

Exit codes: 0 success; 1 no valid checkpoint / verification failed; 2 usage error or a
missing or foreign directory (neither a root nor roots below it); 3 the root is locked by a
running job (prune); 141 (128 + SIGPIPE, what a shell reports for a program a closed pipe
killed) when stdout is closed early (``resilient status --json | head -1``): it ends quietly,
without a traceback or an error line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from resilient._foreign import warn_if_foreign
from resilient._version import __version__
from resilient.checkpoint.catalog import Catalog
from resilient.checkpoint.statics import StaticStore
from resilient.checkpoint.tiers import known_local_roots
from resilient.errors import CheckpointLockedError, InvalidCheckpointError
from resilient.io import storage
from resilient.io.checkpoints import (
    CheckpointRecord,
    latest_valid,
    list_checkpoints,
    protected_steps,
    resolve_static,
    statics_of,
    validate_checkpoint,
)
from resilient.io.targets import DirectoryTarget, as_target
from resilient.job.ledger import read_ledger
from resilient.job.options import build_parser as run_parser
from resilient.model import filenames
from resilient.model.policies import KeepLast

__all__ = ["main"]

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_LOCKED = 3
EXIT_CLOSED_PIPE = 128 + 13  # SIGPIPE's number on Linux and the BSDs


class CliError(Exception):
    """A one-line error for the user, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message, code)
        self.message = message
        self.code = code


def _directory(path: str) -> Path:
    found = Path(path)
    if not found.exists():
        raise CliError(f"{found}: no such directory")
    if not found.is_dir():
        raise CliError(f"{found}: not a directory")
    return found


def _root(path: str) -> Path:
    root = _directory(path)
    if not storage.is_root(root):
        raise CliError(
            storage.marker_problem(root)
            or f"{root}: not a resilient checkpoint root (no {filenames.ROOT_MARKER})"
        )
    return root


def _task_roots(path: str) -> tuple[Path, list[Path]]:
    """``(path, [])`` for a checkpoint root; ``(path, roots)`` for a tree of task roots."""
    from resilient.report import find_roots

    base = _directory(path)
    if storage.is_root(base):
        return base, []
    problem = storage.marker_problem(base)  # a root whose every marker copy is damaged
    if problem:
        raise CliError(problem)
    roots = find_roots([base])
    if not roots:
        raise CliError(
            f"{base}: not a resilient checkpoint root (no {filenames.ROOT_MARKER}) and no "
            "checkpoint roots below it"
        )
    return base, roots


def _task_json(base: Path, root: Path, *, full: bool) -> dict[str, Any]:
    """One task root of a tree: its name, newest valid step and last attempt (``--json``)."""
    latest = latest_valid(root, full=full)
    ledger = read_ledger(root)
    last = ledger[-1] if ledger else None
    return {
        "task": filenames.task_name(root, base),
        "root": str(root),
        "latest_step": latest.step if latest else None,
        "latest_path": str(latest.path) if latest else None,
        "attempts": len(ledger),
        "last_attempt": None
        if last is None
        else {key: last.get(key) for key in ("attempt", "exit_code", "reason", "start", "end")},
    }


def _tree_table(tasks: Sequence[dict[str, Any]]) -> list[str]:
    """One line per task root: task, newest valid step, attempts, the last one's exit and why."""
    width = max(4, *(len(t["task"]) for t in tasks))
    lines = [f"{'task':{width}}  {'step':>10}  {'attempts':>8}  {'exit':>4}  last attempt"]
    for t in tasks:
        last = t["last_attempt"] or {}
        step = "-" if t["latest_step"] is None else str(t["latest_step"])
        code = "-" if last.get("exit_code") is None else str(last["exit_code"])
        lines.append(
            f"{t['task']:{width}}  {step:>10}  {t['attempts']:>8}  {code:>4}  "
            f"{last.get('reason') or '-'}"
        )
    return lines


def _tree_summary(base: Path, tasks: Sequence[dict[str, Any]]) -> str:
    """``3 task roots under ckpt: 1 finished, 1 unfinished, 1 without attempts``."""
    codes = [(t["last_attempt"] or {}).get("exit_code") for t in tasks]
    parts = [
        (sum(1 for c in codes if c == 0), "finished"),
        (sum(1 for c in codes if c not in (0, None)), "unfinished"),
        (sum(1 for c in codes if c is None), "without attempts"),
    ]
    counts = ", ".join(f"{n} {what}" for n, what in parts if n)
    return f"{len(tasks)} task root(s) under {base}: {counts}"


def _tiered(root: Path, *, full: bool) -> list[tuple[str, CheckpointRecord]]:
    """Checkpoints of the shared root and of its node-local tiers on this host, oldest first."""
    found = [("shared", r) for r in list_checkpoints(root, full=full)]
    for local in known_local_roots(root):
        records = list_checkpoints(local, full=full, static_root=root, node_local=True)
        found += [("local", r) for r in records]
    found.sort(key=lambda t: (t[1].step, t[0] == "local", t[1].status != "valid"))
    return found


def _record_json(
    r: CheckpointRecord, tier: str = "shared", protected: set[int] | None = None
) -> dict[str, Any]:
    m = r.manifest
    return {
        "step": r.step,
        "tier": tier,
        "status": r.status,
        "protected": r.step in protected if tier == "local" and protected is not None else None,
        "path": str(r.path),
        "bytes": m.nbytes if m else None,
        "layout": m.layout.kind if m else None,
        "nranks": m.layout.nranks if m else None,
        "time": m.time if m else None,
        "metrics": dict(m.metrics) if m else {},
        "reason": r.reason,
    }


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def cmd_ls(args: argparse.Namespace) -> int:
    root, tree = _task_roots(args.root)
    if tree:
        print("\n".join(_tree_table([_task_json(root, r, full=args.full) for r in tree])))
        return EXIT_OK
    records = _tiered(root, full=args.full)
    protected = protected_steps(root)
    if not records:
        print(f"no checkpoints in {args.root}")
        return EXIT_OK
    print(
        f"{'step':>10}  {'tier':6}  {'time':19}  {'size':>10}  {'ranks':>5}  {'layout':6}  status"
    )
    for tier, r in records:
        m = r.manifest
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.time)) if m else "-"
        status = r.status + (f" ({r.reason})" if r.reason else "")
        if tier == "local" and r.status == "valid" and r.step in protected:
            status += ", protected"  # its partner copies or XOR parities are committed
        ranks = str(m.layout.nranks) if m else "-"
        kind = m.layout.kind if m else "-"
        size = _human_bytes(m.nbytes if m else None)
        print(f"{r.step:>10}  {tier:6}  {when:19}  {size:>10}  {ranks:>5}  {kind:6}  {status}")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    root, tree = _task_roots(args.root)
    if tree:
        tasks = [_task_json(root, r, full=args.full) for r in tree]
        if args.json:
            print(json.dumps(tasks, indent=1))
        else:
            print("\n".join([*_tree_table(tasks), _tree_summary(root, tasks)]))
        return EXIT_OK
    tiered = _tiered(root, full=args.full)
    records = [r for tier, r in tiered if tier == "shared"]
    valid = [r for r in records if r.status == "valid"]
    latest = valid[-1] if valid else None
    local_valid = [r for tier, r in tiered if tier == "local" and r.status == "valid"]
    protected = protected_steps(root)
    doc = {
        "root": str(root),
        "latest_step": latest.step if latest else None,
        "latest_path": str(latest.path) if latest else None,
        "latest_local_step": local_valid[-1].step if local_valid else None,
        "local_roots": [str(p) for p in known_local_roots(root)],
        "latest_local_protected": bool(local_valid) and local_valid[-1].step in protected,
        "checkpoints": [_record_json(r, tier, protected) for tier, r in tiered],
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"latest valid step: {doc['latest_step']} ({doc['latest_path']})")
        counts: dict[str, int] = {}
        for tier, r in tiered:
            key = f"{r.status} ({tier})"
            counts[key] = counts.get(key, 0) + 1
        print("checkpoints: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        local_roots = [str(p) for p in known_local_roots(root)]
        if local_roots:
            print(f"local tier on this host: {', '.join(local_roots)}; "
                  f"latest valid local step: {doc['latest_local_step']}"
                  + (" (protected)" if doc["latest_local_protected"] else ""))  # fmt: skip
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    root = _root(args.root)
    latest = latest_valid(root, full=args.full)
    if latest is None:
        print(f"no valid checkpoint in {root}", file=sys.stderr)
        return EXIT_NOT_FOUND
    print(latest.step if args.step else latest.path)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    root = _root(args.root)
    if args.step is not None:
        path = root / filenames.step_dir_name(args.step)
        try:
            manifest = validate_checkpoint(path, full=args.full)
        except InvalidCheckpointError as exc:
            print(f"step {args.step}: INVALID: {exc.reason}")
            return EXIT_NOT_FOUND
        print(f"step {args.step}: valid ({'full' if args.full else 'quick'} check)")
        _print_static_copies(root, [manifest.static], full=args.full)
        return EXIT_OK
    records = [r for r in list_checkpoints(root, full=args.full) if r.status != "quarantined"]
    bad = 0
    for r in records:
        print(f"step {r.step}: {'valid' if r.status == 'valid' else 'INVALID: ' + r.reason}")
        bad += r.status != "valid"
    if not records:
        print(f"no checkpoints in {root}")
        return EXIT_NOT_FOUND
    _print_static_copies(root, [r.manifest.static for r in records if r.manifest], full=args.full)
    return EXIT_NOT_FOUND if bad else EXIT_OK


def _print_static_copies(root: Path, contents: list[str | None], *, full: bool) -> None:
    """One line per damaged copy of the static data of ``contents`` whose other copy is intact
    (those steps are valid; the next restore repairs it)."""
    for content in sorted({c for c in contents if c is not None}):
        try:
            damaged = resolve_static(statics_of(as_target(root)), content, full=full).damaged
        except InvalidCheckpointError:
            continue  # (its steps said INVALID already)
        for name, why in damaged:
            print(
                f"static data {content}: its copy {name}/ failed ({why}); the other is "
                "intact: the next restore repairs it"
            )


def cmd_prune(args: argparse.Namespace) -> int:
    root = _root(args.root)
    if args.keep_last < 1:
        raise CliError("--keep-last must be >= 1")
    lock = storage.RootLock(root)
    if not args.dry_run:
        try:
            lock.acquire()
        except CheckpointLockedError as exc:
            raise CliError(str(exc), EXIT_LOCKED) from None
    try:
        # the same rotation as the manager's: the keep policy, then unreferenced static data
        catalog = Catalog(DirectoryTarget(root), StaticStore(DirectoryTarget(root)))
        plan = catalog.plan(KeepLast(args.keep_last))
        if not args.dry_run:
            deleter = storage.BackgroundDeleter()
            deleter.delete(catalog.apply(plan).all)
            deleter.wait()
        for step in sorted(plan.delete):
            path = root / filenames.step_dir_name(step)
            print(f"{'would delete' if args.dry_run else 'deleted'} step {step} ({path})")
        print(f"kept {len(plan.keep)} checkpoint(s)")
    finally:
        lock.release()
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from resilient.report import find_roots, format_table, plot, task_report

    for r in args.roots:
        if not Path(r).is_dir():
            raise CliError(f"{r}: no such directory")
    named = {r: filenames.task_name(r, base) for base in args.roots for r in find_roots([base])}
    if not named:
        raise CliError(f"no checkpoint roots under {' '.join(args.roots)}", EXIT_NOT_FOUND)
    reports = [task_report(r, name=name) for r, name in sorted(named.items())]
    if args.json:
        print(json.dumps([t.to_dict() for t in reports], indent=1))
    else:
        print(format_table(reports))
    if args.plot:
        try:
            plot(reports, args.plot)
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install 'resilient-hpc[report]'") from None
        if not args.json:
            print(f"plot: {args.plot}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from resilient.errors import CheckpointNotFoundError
    from resilient.export import export

    root = _root(args.root)
    if len(args.where) == 1:
        step, out = None, args.where[0]
    elif len(args.where) == 2 and args.where[0].isdigit():
        step, out = int(args.where[0]), args.where[1]
    else:
        raise CliError("usage: resilient export ROOT [STEP] OUT.h5 [--copy]")
    try:
        result = export(root, Path(out), step=step, copy=args.copy)
    except CheckpointNotFoundError as exc:
        raise CliError(str(exc), EXIT_NOT_FOUND) from None
    except InvalidCheckpointError as exc:
        raise CliError(f"step {step}: INVALID: {exc.reason}", EXIT_NOT_FOUND) from None
    for note in result.skipped:
        print(f"resilient export: skipped {note}", file=sys.stderr)
    how = "copied, checksums verified" if args.copy else "virtual datasets over the checkpoint"
    print(f"step {result.step}: {len(result.datasets)} dataset(s) to {out} ({how})")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from resilient.job.options import options_from_args
    from resilient.job.run import run_command_line

    try:
        opts = options_from_args(args)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return run_command_line(opts)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``resilient`` command."""
    parser = argparse.ArgumentParser(
        prog="resilient",
        description="Inspect, verify and prune resilient checkpoint roots; run programs resumably.",
        epilog="exit codes of ls, status, latest, verify, prune, report and export: 0 ok, 1 no "
        "valid checkpoint / invalid, 2 usage or foreign directory, 3 locked, 141 stdout closed "
        "early (| head); those of run: resilient run --help",
    )
    parser.add_argument("--version", action="version", version=f"resilient {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "ls",
        help="table of checkpoints: step, time, size, ranks, layout, status; of a directory "
        "of task roots: one line per task (newest valid step, last attempt)",
    )
    p.add_argument("root", help="a checkpoint root, or a directory with task roots below it")
    p.add_argument("--full", action="store_true", help="verify every checksum (reads all data)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "status",
        help="summary (of a root, or of each task root below a directory); --json for scripts "
        "and workflow engines",
    )
    p.add_argument("root", help="a checkpoint root, or a directory with task roots below it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--full", action="store_true", help="verify every checksum (reads all data)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("latest", help="print the newest valid checkpoint's path (exit 1 if none)")
    p.add_argument("root")
    p.add_argument("--step", action="store_true", help="print its step instead of its path")
    p.add_argument("--full", action="store_true", help="verify every checksum (reads all data)")
    p.set_defaults(func=cmd_latest)

    p = sub.add_parser("verify", help="validate one or all checkpoints (exit 1 if any is invalid)")
    p.add_argument("root")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--full", action="store_true", help="verify every checksum (reads all data)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("prune", help="delete all but the newest N valid checkpoints")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, required=True, metavar="N")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser(
        "report",
        help="per task: attempts, stops and kills, checkpoints, recomputation, goodput, "
        "whether it finished",
    )
    p.add_argument("roots", nargs="+", help="checkpoint roots, or directories holding several")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="also write progress against wall-clock time")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "export", help="write a checkpoint's Block leaves as global arrays to one HDF5 file"
    )
    p.add_argument("root")
    p.add_argument("where", nargs="+", metavar="[STEP] OUT.h5")
    p.add_argument(
        "--copy", action="store_true",
        help="copy the data (verified) instead of virtual datasets over the checkpoint's files",
    )  # fmt: skip
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("run", help="run CMD resumably (walltime, signals, retries, exit 0/75/93)")
    run_parser(p)
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``resilient`` console script."""
    warn_if_foreign()  # also where another vendor's resilient/__init__.py replaced ours
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    except CliError as exc:
        print(f"resilient: {exc.message}", file=sys.stderr)
        return exc.code
    except OSError as exc:
        print(f"resilient: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


def _closed_pipe() -> int:
    """The reader went away (``| head``): end quietly, as a program killed by SIGPIPE does.

    Python ignores SIGPIPE, so a write into a closed pipe raises instead; stdout goes to
    ``/dev/null`` so that the flush at exit does not raise again (the Python documentation's
    recipe, ``signal`` module, "Note on SIGPIPE").
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
