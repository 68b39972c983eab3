"""Cost of a save, ``latest_step()`` and ``resilient latest`` against the number of checkpoints kept.

Run::

    python bench/bench_history.py [--n 10000] [--runs 15] [--root DIR] [--quick]

A long run keeps many checkpoints (``KeepEvery(steps=...)``, ``KeepBest``, or ``keep=None``).
This measures, in one process with a tiny state (so that only the bookkeeping shows), on an
empty root and on a root holding ``--n`` committed checkpoints:

``save``
    median cost of ``CheckpointManager.save`` on an already open manager, after one warm-up save
    (the first save of a process with a keep policy learns the history once: reported apart as
    ``first save``), with ``keep=None`` and with ``keep=KeepEvery(steps=1)`` (a policy that keeps
    the whole history, so rotation really runs over all of it).
``latest_step()``
    the library's newest valid checkpoint, in process; also after corrupting the newest 5
    (their manifest no longer matches the checksum in ``COMMITTED``, so they are skipped).
``resilient latest`` / ``resilient ls``
    the command line as a subprocess (Python start-up included).

Targets (issue 8): a save at N = 10,000 costs <= 1.2x a save on an empty root,
``resilient latest`` < 300 ms and ``latest_step()`` < 50 ms at N = 10,000, also with the
newest 5 corrupt.

Building the root: a real checkpoint is saved through the public API, then cloned into ``--n``
step directories (hard links to its data file; a manifest rewritten for the new step, a
``COMMITTED`` marker holding its checksum and a line in the save log, through the library's own
format functions: the root looks as if the library had written it), and a sample of the clones
is validated. ``--root`` keeps the built root for later
runs (it is reused when it already holds ``--n`` checkpoints).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchutil import library_revision

from resilient import CheckpointManager, KeepEvery
from resilient.checkpoint.catalog import save_record
from resilient.io.checkpoints import validate_checkpoint
from resilient.io.manifests import marker_text
from resilient.model import filenames as names
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json, parse_manifest

STATE = {"u": np.arange(64, dtype=np.float64), "it": 0}


def build_root(root: Path, n: int) -> None:
    """A root with steps 1..n committed (clones of one real checkpoint)."""
    existing = sum(1 for p in root.glob("step_*")) if root.is_dir() else 0
    if existing == n:
        return
    if root.exists():
        shutil.rmtree(root)
    with CheckpointManager(root) as m:
        m.save(1, STATE)
    template = root / names.step_dir_name(1)
    manifest = parse_manifest((template / names.MANIFEST).read_bytes())
    data = [p for p in template.iterdir() if names.is_data_file_name(p.name)]
    log = []
    for step in range(2, n + 1):
        d = root / names.step_dir_name(step)
        d.mkdir()
        for f in data:
            os.link(f, d / f.name)
        clone = dataclasses.replace(manifest, step=step)
        text = manifest_json(clone).encode()
        (d / names.MANIFEST).write_bytes(text)
        (d / names.COMMITTED).write_text(marker_text(step, digest_bytes(text)))
        log.append(json.dumps(save_record(clone)) + "\n")  # as the library logs a commit
    with open(root / names.SAVE_LOG, "a") as fh:
        fh.writelines(log)
    for step in (2, n // 2 or 1, n):
        validate_checkpoint(root / names.step_dir_name(step))


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def save_costs(root: Path, keep: KeepEvery | None, runs: int) -> tuple[float, float, float]:
    """(open, first save, median save) in ms; the saves are removed again afterwards."""
    t = time.perf_counter()
    m = CheckpointManager(root, keep=keep)
    opened = 1000 * (time.perf_counter() - t)
    start = 10**8  # far above the history, so the saves are the newest
    t = time.perf_counter()
    m.save(start, STATE)
    first = 1000 * (time.perf_counter() - t)
    steps = iter(range(start + 1, start + 1 + runs))
    per_save = median_ms(lambda: m.save(next(steps), STATE), runs)
    m.close()
    for step in range(start, start + 1 + runs):
        shutil.rmtree(root / names.step_dir_name(step), ignore_errors=True)
    return opened, first, per_save


def cli_ms(args: list[str], runs: int) -> float:
    cmd = [sys.executable, "-m", "resilient.cli", *args]
    subprocess.run(cmd, check=False, capture_output=True)  # warm-up (imports, page cache)
    return median_ms(lambda: subprocess.run(cmd, check=False, capture_output=True), runs)


def latest_ms(root: Path, runs: int) -> tuple[float, int | None]:
    with CheckpointManager(root) as m:
        m.latest_step()
        return median_ms(m.latest_step, runs), m.latest_step()


def corrupt_newest(root: Path, k: int) -> list[tuple[Path, bytes]]:
    saved = []
    for p in sorted(root.glob("step_*"))[-k:]:
        f = p / names.MANIFEST
        text = f.read_bytes()
        saved.append((f, text))
        f.write_bytes(text.replace(b'"step"', b'"step" ', 1))  # checksum no longer matches
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="checkpoints in the big root")
    ap.add_argument("--runs", type=int, default=15, help="timed repetitions per figure")
    ap.add_argument("--root", type=Path, help="keep the big root here (reused if complete)")
    ap.add_argument("--quick", action="store_true", help="--n 500 --runs 5 (a smoke run)")
    args = ap.parse_args(argv)
    n, runs = (500, 5) if args.quick else (args.n, args.runs)
    work = Path(tempfile.mkdtemp(prefix="bench-history-", dir=Path(__file__).resolve().parent))
    big = args.root or work / "big"
    try:
        t = time.perf_counter()
        build_root(big, n)
        print(f"bench_history: resilient {library_revision()}, root with {n} checkpoints "
              f"built in {time.perf_counter() - t:.1f} s ({big})")  # fmt: skip
        rows = []
        for label, keep in (("keep=None", None), ("keep=KeepEvery(1)", KeepEvery(steps=1))):
            empty = work / f"empty-{len(rows)}"
            e_open, e_first, e_save = save_costs(empty, keep, runs)
            b_open, b_first, b_save = save_costs(big, keep, runs)
            rows.append((label, e_open, b_open, e_first, b_first, e_save, b_save))
        latest, step = latest_ms(big, runs)
        cli_latest = cli_ms(["latest", str(big)], max(3, runs // 3))
        cli_ls = cli_ms(["ls", str(big)], 3)
        saved = corrupt_newest(big, 5)
        try:
            latest_bad, step_bad = latest_ms(big, runs)
            cli_latest_bad = cli_ms(["latest", str(big)], max(3, runs // 3))
        finally:
            for f, text in saved:
                f.write_bytes(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nsave of a tiny state, one process, median of {runs} (ms)")
    print("| keep | open empty | open N | first save empty | first save N | save empty | save N "
          "| ratio (target <= 1.2) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, e_open, b_open, e_first, b_first, e_save, b_save in rows:
        print(f"| {label} | {e_open:.1f} | {b_open:.1f} | {e_first:.1f} | {b_first:.1f} | "
              f"{e_save:.1f} | {b_save:.1f} | {b_save / e_save:.2f} |")  # fmt: skip
    print(f"\nfinding the newest valid checkpoint among N = {n} (ms)")
    print("| what | newest valid | time | target |")
    print("|---|---|---|---|")
    print(f"| latest_step() | {step} | {latest:.1f} | < 50 |")
    print(f"| latest_step(), newest 5 corrupt | {step_bad} | {latest_bad:.1f} | < 50 |")
    print(f"| resilient latest (subprocess) | | {cli_latest:.0f} | < 300 |")
    print(f"| resilient latest, newest 5 corrupt | | {cli_latest_bad:.0f} | < 300 |")
    print(f"| resilient ls (subprocess, validates all N) | | {cli_ls:.0f} | - |")
    assert step_bad == (step or 0) - 5, (step, step_bad)
    return 0


if __name__ == "__main__":
    sys.exit(main())
