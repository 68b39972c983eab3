"""Where the time of a synchronous and an asynchronous save goes, per rank and per thread.

Run under MPI (4 ranks on 2 cores is this machine's standard case)::

    mpiexec -n 4 python bench/bench_async_timeline.py --mib 128 --rounds 7
    mpiexec -n 4 python bench/bench_async_timeline.py --mib 128 --rounds 7 --torch   # + gloo

Every rank holds one prefaulted float64 buffer. Each round saves it once with a blocking save
and once with ``save(blocking=False)`` + ``wait()`` (order shuffled per round, seeded, the same
on every rank; each manager keeps its newest checkpoint only, ``KeepLast(1)``), starting at a
sleeping barrier. The time of a save is the slowest rank's. With ``--torch``, PyTorch is
imported and a gloo process group of the same ranks is made first and kept (the setting of a
PyTorch user; nothing of the save goes through it).

The library's phases are timed by wrapping its functions (module attributes only, the code is
unchanged), each event recorded with the thread it ran on: the caller's copy into the staging
buffers (``copy``), the write (``write``, on the writer thread for an asynchronous save), the
checksums (``checksum``, on the digest helper or between runs of the write), the data's fsync
(``fsync``), the description of the rank's part (``describe``), the commit's collectives
(``finish``, with ``barrier``: a sleeping barrier's wait for the other ranks), the manifest
(``manifest``) and its publication (``publish``, rank 0). ``cpu`` is the process's CPU time
(user + system, all threads) during the save: a waiting caller that spun would show there.

Printed: per mode, the median and spread of the save times and the ratio async durable /
sync; then, for the round whose async/sync ratio is the median, each rank's timeline: per
phase and thread, the busy seconds and the first start and last end (ms from the call).
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import library_revision, write_json

from resilient import CheckpointManager, KeepLast

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size

Event = tuple[str, str, float, float]  # phase, thread, start, end (perf_counter)


class Recorder:
    """Events of this rank, with the thread each ran on."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                event = (phase, threading.current_thread().name, t0, time.perf_counter())
                with self._lock:
                    self.events.append(event)

        return inner

    def take(self) -> list[Event]:
        with self._lock:
            out, self.events = self.events, []
        return out


def instrument(rec: Recorder) -> None:
    """Wrap the library's phases (see the module docstring)."""
    from resilient.checkpoint import savepaths, saveset, saving
    from resilient.io import digests, fileio, staging, storage
    from resilient.io.commit import PendingDir
    from resilient.parallel import mpi

    def patch(owner: object, attr: str, phase: str) -> None:
        setattr(owner, attr, rec.wrap(phase, getattr(owner, attr)))

    patch(staging.StagingArea, "stage", "copy")
    patch(saveset.WriteJob, "write", "write")
    patch(fileio, "fsync_file", "fsync")
    patch(saveset.WriteJob, "describe", "describe")
    patch(digests, "digest_arrays", "checksum")  # the helper's and the write's tasks
    patch(saveset, "digest_arrays", "checksum")
    patch(saving.SavePipeline, "_finish", "finish")
    patch(mpi.MPIComm, "barrier", "barrier")
    patch(PendingDir, "prepare", "manifest")
    patch(PendingDir, "publish", "publish")
    patch(PendingDir, "create", "create dir")
    patch(saving, "plan_write", "plan")
    patch(savepaths.SharedRoot, "after_commit", "log+rotate")
    setattr(storage, "shutil", _Rmtree(rec))  # noqa: B010  (the rotation's unlinks)


class _Rmtree:
    """``shutil`` inside :mod:`resilient.io.storage`, its ``rmtree`` recorded as ``delete``."""

    def __init__(self, rec: Recorder) -> None:
        self.rmtree = rec.wrap("delete", shutil.rmtree)

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sleeping_barrier() -> None:
    req = COMM.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def make_gloo_group() -> None:
    """A gloo process group of the MPI ranks, kept for the rest of the run."""
    import torch.distributed as dist

    port = COMM.bcast(29500 + random.Random().randrange(2000) if RANK == 0 else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=RANK, world_size=SIZE)
    import torch

    t = torch.ones(4)
    dist.all_reduce(t)
    assert float(t[0]) == SIZE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=128, help="MiB of float64 per rank (default 128)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds after a warm-up")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the checkpoints")
    p.add_argument("--torch", action="store_true", help="import torch, make a gloo group first")
    p.add_argument(
        "--keep-all", action="store_true", help="keep every checkpoint (default: KeepLast(1))"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    if args.torch:
        make_gloo_group()
    base = Path(
        COMM.bcast(tempfile.mkdtemp(prefix="timeline-", dir=args.dir) if RANK == 0 else None)
    )
    n = (args.mib << 20) // 8
    region = mmap.mmap(-1, n * 8, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(region, np.float64)
    buf[:] = np.random.default_rng(RANK).random(n)
    rec = Recorder()
    instrument(rec)
    managers = {
        mode: CheckpointManager(
            base / mode,
            comm=COMM,
            checkpoint_comm="self",
            keep=None if args.keep_all else KeepLast(1),
        )
        for mode in ("sync", "async")
    }
    steps = dict.fromkeys(managers, 0)

    def one(mode: str) -> dict[str, Any]:
        steps[mode] += 1
        mgr = managers[mode]
        rec.take()
        sleeping_barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        if mode == "sync":
            mgr.save(steps[mode], {"x": buf})
            blocked = time.perf_counter() - t0
        else:
            mgr.save(steps[mode], {"x": buf}, blocking=False)
            blocked = time.perf_counter() - t0
            mgr.wait()
        took, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        events = [(ph, th, s - t0, e - t0) for ph, th, s, e in rec.take()]
        sleeping_barrier()
        return {"time": took, "blocked": blocked, "cpu": cpu, "events": events}

    order = list(managers)
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    for r in range(args.rounds + 1):
        random.Random(args.seed + r).shuffle(order)
        mine = {mode: one(mode) for mode in order}
        everyone = COMM.gather(mine, root=0)
        if r and RANK == 0:
            assert everyone is not None
            rounds.append({mode: [everyone[k][mode] for k in range(SIZE)] for mode in managers})
    for mgr in managers.values():
        mgr.close()
    if RANK == 0:
        report(rounds, args)
        shutil.rmtree(base, ignore_errors=True)


def report(rounds: list[dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> None:
    def slowest(rnd: dict[str, list[dict[str, Any]]], mode: str, key: str = "time") -> float:
        return max(r[key] for r in rnd[mode])

    sync = [slowest(r, "sync") for r in rounds]
    durable = [slowest(r, "async") for r in rounds]
    blocked = [slowest(r, "async", "blocked") for r in rounds]
    ratios = [a / s for a, s in zip(durable, sync, strict=True)]
    print(
        f"# bench_async_timeline: {SIZE} ranks x {args.mib} MiB, {len(rounds)} rounds, "
        f"{'torch + gloo group in process' if args.torch else 'no torch'}, "
        f"resilient {library_revision()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        f"sync save       median {statistics.median(sync):.3f} s  [{min(sync):.3f}-{max(sync):.3f}]"
    )
    print(
        f"async durable   median {statistics.median(durable):.3f} s  "
        f"[{min(durable):.3f}-{max(durable):.3f}]; blocked median {statistics.median(blocked):.3f} s"
    )
    print(
        f"async durable / sync: ratio of medians {statistics.median(durable) / statistics.median(sync):.2f}, "
        f"per round median {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
    )
    pick = sorted(range(len(rounds)), key=ratios.__getitem__)[len(rounds) // 2]
    print(f"\nTimeline of round {pick + 1} (async/sync {ratios[pick]:.2f}); ms from the call")
    for mode in ("sync", "async"):
        for rank, r in enumerate(rounds[pick][mode]):
            print(f"\n{mode}, rank {rank}: {r['time'] * 1e3:.1f} ms, cpu {r['cpu'] * 1e3:.1f} ms")
            print("| phase | thread | busy ms | first start | last end | calls |")
            print("|---|---|---:|---:|---:|---:|")
            groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for phase, thread, s, e in r["events"]:
                groups.setdefault((phase, thread.split("_")[0]), []).append((s, e))
            for (phase, thread), spans in sorted(
                groups.items(), key=lambda kv: min(s for s, _ in kv[1])
            ):
                busy = sum(e - s for s, e in spans)
                first, last = min(s for s, _ in spans), max(e for _, e in spans)
                print(
                    f"| {phase} | {thread} | {busy * 1e3:.1f} | {first * 1e3:.1f} | "
                    f"{last * 1e3:.1f} | {len(spans)} |"
                )
    write_json(
        args.json,
        {"mib": args.mib, "ranks": SIZE, "torch": args.torch, "sync": sync,
         "async_durable": durable, "async_blocked": blocked, "ratios": ratios,
         "median_round": rounds[pick]},
    )  # fmt: skip


if __name__ == "__main__":
    main()
