"""Crash states: a crash at every file-system call of every operation, under ext4 and XFS.

Usage (from the repository root, with the project's environment)::

    python bench/bench_crash.py                          # every state of every operation
    python bench/bench_crash.py --sample 30 --seed 1     # 30 states per operation and model
    python bench/bench_crash.py --ops save-again prune --markdown matrix.md --json crash.json

Each operation of ``tests/crash/ops.py`` (a blocking save in three layouts, into a new root and
over a dropped checkpoint's files, an async save, a save of the same step again, a rotation, the
static data's first write, a quarantine, ``resilient prune``, the ledger's append, the node-local
tier's save with partner copies or XOR parity and its flush, and the rebuilds of a lost node) is
run on its ranks (simulated nodes where it has a tier) with every rank's file-system calls
recorded (``tests/crash/record.py``); every state a crash after each call could leave under the
rules of ext4 (``data=ordered``) and XFS is built (``tests/crash/states.py``, ALICE's method)
and checked as a user would see it after the restart (``tests/crash/check.py``: the commands,
a restore, the logs, the node-local copies, the next start).

Prints the matrix (operation x model: calls, i.e. crash points - 1; distinct states; states
checked; violations; seconds) and each violation's state; exit status 1 if any.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's resilient and tests/

from benchutil import library_revision, write_json  # noqa: E402

from tests.crash.matrix import Row, run  # noqa: E402
from tests.crash.ops import OPERATIONS  # noqa: E402


def markdown(rows: list[Row]) -> str:
    """The matrix as the docs' reliability page shows it: an operation a line, its crash
    points (calls + 1) and, per model, the distinct states checked and the violations."""
    models = list(dict.fromkeys(r.model for r in rows))
    head = " | ".join(f"{m} states | {m} violations" for m in models)
    lines = [f"| operation | crash points | {head} |", "|---|---:|" + "---:|" * 2 * len(models)]
    by_op: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_op.setdefault(r.op, {})[r.model] = r
    for op, per in by_op.items():
        cells = " | ".join(
            f"{per[m].tried}{'' if per[m].tried == per[m].states else f' of {per[m].states}'} | "
            f"{len(per[m].found)}"
            if m in per
            else "| "
            for m in models
        )
        points = max(r.calls for r in per.values()) + 1
        lines.append(f"| `{op}`: {OPERATIONS[op].what} | {points} | {cells} |")
    totals = " | ".join(
        f"{sum(r.tried for r in rows if r.model == m)} | "
        f"{sum(len(r.found) for r in rows if r.model == m)}"
        for m in models
    )
    points = sum(max(r.calls for r in per.values()) + 1 for per in by_op.values())
    lines.append(f"| **all** | {points} | {totals} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", choices=sorted(OPERATIONS), default=list(OPERATIONS))
    p.add_argument("--models", nargs="+", choices=("ext4", "xfs"), default=["ext4", "xfs"])
    p.add_argument("--sample", type=int, help="states per operation and model (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="processes checking states")
    p.add_argument("--markdown", type=Path, help="write the matrix here too")
    p.add_argument("--json", type=Path, help="write the rows and violations here")
    args = p.parse_args(argv)
    rows: list[Row] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-crash-") as tmp:
        for name in args.ops:
            got = run(name, Path(tmp), models=args.models, sample=args.sample, seed=args.seed,
                      workers=args.workers)  # fmt: skip
            for r in got:
                print(f"{r.op:18} {r.model:5} calls {r.calls:4} states {r.states:5} "
                      f"checked {r.tried:5} violations {len(r.found):3} {r.seconds:6.1f} s",
                      flush=True)  # fmt: skip
                for u in r.unrecorded:
                    print(f"    unrecorded: {u}")
                for f in r.found:
                    print(f"    {f.where}\n        " + "\n        ".join(f.problems))
            rows += got
    table = markdown(rows)
    print(f"\n{table}\n\n{time.monotonic() - t0:.0f} s in all")
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        write_json(str(args.json), {
            "revision": library_revision(),
            "sample": args.sample, "seed": args.seed,
            "rows": [{"op": r.op, "model": r.model, "calls": r.calls, "states": r.states,
                      "checked": r.tried, "seconds": round(r.seconds, 2),
                      "unrecorded": r.unrecorded,
                      "violations": [{"state": f.where, "problems": list(f.problems)}
                                     for f in r.found]} for r in rows],
        })  # fmt: skip
    return 1 if any(r.found for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
