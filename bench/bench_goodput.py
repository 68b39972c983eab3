"""Does ``resilient report`` agree with a stopwatch? Goodput and wall time against timings from
outside, over several runs.

Per run, the same program twice, each timed from outside (``time.monotonic`` around the whole
``resilient run``): uninterrupted (the reference), and under a simulated walltime with
requeues (``--walltime W --signal USR1@L --requeue``: every attempt is stopped, checkpoints,
exits 75 and starts again). Then ``resilient report --json`` on each checkpoint root.

Printed per run: the stopwatch times, the stopwatch's bound on goodput (reference time /
interrupted time: an uninterrupted run of the same steps needs at least the compute kept), the
report's wall time against the stopwatch's, its goodput, and the interrupted run's phases. The
report is right when its wall time is the stopwatch's less ``resilient run``'s own start and
exit (a few tenths of a second) and its goodput is at most the bound (it leaves out the
reference's own start-up, so it sits below the bound by about that share).

::

    python bench/bench_goodput.py --runs 5                     # apps.heat, 2 ranks, 200 steps
    python bench/bench_goodput.py --ranks 4 --walltime 5 --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def heat(ckpt: Path, out: Path, args: argparse.Namespace) -> list[str]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    return [
        mpiexec, "-n", str(args.ranks), sys.executable, "-m", "apps.heat", "--nx", "64",
        "--ny", "48", "--steps", str(args.steps), "--checkpoint-dir", str(ckpt), "--out",
        str(out), "--checkpoint-every", "10", "--step-delay", str(args.step_delay),
        "--config", str(REPO / "configs/checkpoint/demo.yaml"),
    ]  # fmt: skip


def timed_run(ckpt: Path, out: Path, extra: list[str], args: argparse.Namespace) -> float:
    """Seconds of one whole ``resilient run`` (it must finish)."""
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckpt),
           "--kill-wait", "1", *extra, "--", *heat(ckpt, out, args)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took


def report(ckpt: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "report", str(ckpt), "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    (doc,) = json.loads(out.stdout)
    assert isinstance(doc, dict)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument("--walltime", type=float, default=3.0)
    p.add_argument("--lead", type=float, default=0.5, help="USR1 this long before the walltime")
    args = p.parse_args()
    cut = ["--walltime", str(args.walltime), "--signal", f"USR1@{args.lead}", "--requeue"]
    print(
        f"apps.heat, {args.ranks} ranks, {args.steps} steps, step delay {args.step_delay} s; "
        f"interrupted: {' '.join(cut)}\n"
    )
    print("| run | reference s | interrupted s | bound | report wall s | goodput | attempts "
          "| start-up s | kept s | lost s | checkpoints s | exit s | between s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gaps, margins = [], []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-goodput-", dir=REPO) as tmp:
            d = Path(tmp)
            ref_s = timed_run(d / "ref", d / "ref.h5", [], args)
            cut_s = timed_run(d / "cut", d / "cut.h5", cut, args)
            doc = report(d / "cut")
        bound = ref_s / cut_s
        ph = doc["phases"]
        gaps.append(cut_s - doc["wall_s"])
        margins.append(bound - doc["goodput"])
        print(
            f"| {i + 1} | {ref_s:.2f} | {cut_s:.2f} | {100 * bound:.0f}% | {doc['wall_s']:.2f} "
            f"| {100 * doc['goodput']:.0f}% | {len(doc['attempts'])} | {ph['startup_s']:.2f} "
            f"| {ph['compute_kept_s']:.2f} | {ph['compute_lost_s']:.2f} "
            f"| {ph['checkpoint_s']:.2f} | {ph['exit_s']:.2f} | {doc['between_s']:.2f} |"
        )
    print(
        f"\nstopwatch - report wall: median {statistics.median(gaps):.2f} s "
        f"({min(gaps):.2f}-{max(gaps):.2f}); bound - goodput: median "
        f"{100 * statistics.median(margins):.0f} points "
        f"({100 * min(margins):.0f}-{100 * max(margins):.0f}); never negative: "
        f"{all(m >= 0 for m in margins)}"
    )


if __name__ == "__main__":
    main()
