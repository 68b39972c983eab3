"""Writer thread or writer process? How much the program's own thread slows while a save drains.

Usage (one process; the choice concerns what one rank does)::

    python bench/bench_mechanism.py --mib 256 --runs 5

For each mode the program's thread does a fixed amount of work while a save of ``--mib`` MiB
drains in the background, and the time of that work is compared with the same work on a quiet
process (``idle``). Two kinds of work: ``python`` (a pure-Python loop: needs the GIL all the time,
the worst case for a thread) and ``numpy`` (a 5-point stencil sweep on a 1024 x 1024 grid, the
heat app's step).

Modes:

* ``thread``: ``CheckpointManager.save(step, state, blocking=False)`` (the library's writer
  thread), then the work, then ``wait()``;
* ``process``: the same bytes copied into a ``multiprocessing.shared_memory`` block that a
  persistent spawned writer process (DCP's and NVRx's design) checksums, ``pwrite``s and fsyncs;
  the work; then waiting for the writer's reply.

Printed: medians of the work's time relative to ``idle`` (1.00 = no slowdown) and the time from
the start of the save until it is durable.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from resilient import CheckpointManager, KeepLast


def python_work(n: int = 12_000_000) -> int:
    total = 0
    for i in range(n):
        total += i & 7
    return total


def numpy_work(grid: np.ndarray, sweeps: int = 60) -> None:
    u = grid
    for _ in range(sweeps):
        u[1:-1, 1:-1] += 0.2 * (
            u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4 * u[1:-1, 1:-1]
        )


def writer_process(name: str, nbytes: int, requests: Any, replies: Any) -> None:
    """Persistent writer: for each request (a path), checksum + pwrite + fsync the shared block."""
    shm = shared_memory.SharedMemory(name=name)
    view = shm.buf[:nbytes]
    while True:
        path = requests.get()
        if path is None:
            break
        digest = xxhash.xxh3_64_hexdigest(view)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pos = 0
        while pos < nbytes:
            pos += os.pwrite(fd, view[pos : min(nbytes, pos + (8 << 20))], pos)
        os.fsync(fd)
        os.close(fd)
        replies.put(digest)
    del view
    shm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    nbytes = args.mib << 20
    state = {"x": np.random.default_rng(0).standard_normal(nbytes // 8)}
    grid = np.random.default_rng(1).standard_normal((1024, 1024))
    work = {"python": python_work, "numpy": lambda: numpy_work(grid)}

    base = Path(tempfile.mkdtemp(prefix="bench-mech-", dir=args.dir))
    mgr = CheckpointManager(base / "ck", keep=KeepLast(1))
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    staging = {"x": np.ndarray(state["x"].shape, dtype=state["x"].dtype, buffer=shm.buf)}
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=writer_process, args=(shm.name, nbytes, requests, replies))
    proc.start()
    step = 0

    def run(mode: str, kind: str) -> tuple[float, float]:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        if mode == "thread":
            mgr.save(step, state, blocking=False)
        elif mode == "process":
            np.copyto(staging["x"], state["x"])
            requests.put(str(base / f"proc_{step % 2}.bin"))
        w0 = time.perf_counter()
        work[kind]()
        w1 = time.perf_counter()
        if mode == "thread":
            mgr.wait()
        elif mode == "process":
            replies.get()
        return w1 - w0, time.perf_counter() - t0

    results: dict[str, dict[str, list[float]]] = {}
    try:
        for kind in work:
            for mode in ("idle", "thread", "process"):
                run(mode, kind)  # warm-up: buffers touched, writer started
            for _ in range(args.runs):
                for mode in ("idle", "thread", "process"):
                    w, d = run(mode, kind)
                    results.setdefault(f"{kind}/{mode}", {"work": [], "durable": []})
                    results[f"{kind}/{mode}"]["work"].append(w)
                    results[f"{kind}/{mode}"]["durable"].append(d)
                    time.sleep(0.2)
    finally:
        requests.put(None)
        proc.join(timeout=30)
        mgr.close()
        staging.clear()  # no view of the shared block may outlive it
        shm.close()
        shm.unlink()
        import shutil

        shutil.rmtree(base, ignore_errors=True)

    print(f"{args.mib} MiB saved while the program's thread works; medians of {args.runs} runs")
    print(f"{'work':8} {'mode':8} {'work s':>8} {'vs idle':>8} {'durable s':>10}")
    summary = {}
    for key, r in results.items():
        kind, mode = key.split("/")
        w = statistics.median(r["work"])
        idle = statistics.median(results[f"{kind}/idle"]["work"])
        d = statistics.median(r["durable"])
        summary[key] = {"work_s": w, "slowdown": w / idle, "durable_s": d}
        print(
            f"{kind:8} {mode:8} {w:8.3f} {w / idle:8.2f} {d if mode != 'idle' else float('nan'):10.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
