"""Checkpoint save/restore throughput of ``resilient`` against the disk's limit, in one run.

Run::

    mpiexec -n 4 python bench/bench_save.py [--mib 256] [--runs 7] [--dir DIR] [--json PATH]
                                            [--profile]

Every rank holds one float64 buffer of ``--mib`` MiB, allocated and prefaulted once and reused
by every run. The modes measured are:

``raw``
    each rank writes its buffer to a new file of its own with ``os.pwrite`` + ``fsync`` +
    ``close``: the physical limit of this machine for this amount of data.
``self`` / ``node`` / ``world``
    ``CheckpointManager.save(step, {"x": buf})`` with that ``checkpoint_comm`` and
    ``keep=KeepLast(1)`` (so deleting the previous checkpoint is part of the cost, as in a
    real run): HDF5 skeleton, pwrite, fsync, xxh3 checksums, manifest, atomic commit.
``raw_read``
    each rank reads its latest raw file back into a second preallocated buffer (warm page cache).
``restore_self`` / ``restore_node`` / ``restore_world``
    ``CheckpointManager.restore()`` of that layout's newest checkpoint: choose + validate,
    read into new arrays, verify checksums. **Warm**: the files were just written and are in the
    page cache (evicting them needs ``posix_fadvise(DONTNEED)`` on files the library owns).

Why ratios: this VM is noisy (memory returned to the host costs ~0.45 GB/s to touch again,
run-to-run spread of 3-10x; see /work/shared/MACHINE.md gotchas 10 and 11). Absolute numbers
from different runs or different days are not comparable; the ratio of a layout to ``raw``
measured in the *same* run, with modes interleaved round-robin so that drift hits all of them
alike, is. Targets: ``self >= 0.9 x raw``, ``node`` and ``world >= 0.8 x self``.

Timing: each operation is timed on rank 0 between two sleeping barriers (``Ibarrier`` polled
with ``time.sleep(0.0005)``), never a plain ``Barrier``: on oversubscribed cores, spinning
ranks steal the CPU of the ranks doing I/O. One untimed warm-up run of every mode comes
first, then ``--runs`` rounds; each round runs every mode once, in an order shuffled per
round (seeded, the same on every rank): a fixed cyclic order would give each mode the same
predecessor every time, and on this VM the predecessor matters (memory it just freed is cheap
to reuse, memory freed seconds ago has gone back to the host). Reported: median, min, max,
GB/s (total bytes of all ranks / median), the ratio to the reference
(``ref_median / mode_median``) and the median of the per-round ratios ("paired", robust
against drift between rounds).

``--profile`` wraps functions of the library from the outside (no library code is changed:
module attributes are replaced by timing wrappers) and prints per-phase times, and adds two
diagnostic modes: ``raw_shared`` (all ranks pwrite into one shared file, the limit for the
``node``/``world`` layouts) and ``raw_read_fresh`` (read into a newly allocated array, as
``restore`` does).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from benchutil import library_revision
from mpi4py import MPI

import resilient
from resilient import CheckpointManager, KeepLast

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()

LAYOUTS = ("self", "node", "world")
WRITE_MODES = ("raw", "self", "node", "world")
READ_MODES = ("raw_read", "restore_self", "restore_node", "restore_world")
PROFILE_WRITE_MODES = ("raw_shared",)
PROFILE_READ_MODES = ("raw_read_fresh",)


# ---------------------------------------------------------------------------- timing helpers


def sleep_barrier(comm: Any = COMM) -> None:
    """A barrier whose waiting ranks sleep instead of spinning (MACHINE.md gotcha 10)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def timed(fn: Callable[[], object]) -> float:
    """Run ``fn`` on every rank; seconds between the sleeping barriers around it (rank 0)."""
    sleep_barrier()
    t0 = time.perf_counter()
    fn()
    sleep_barrier()
    return time.perf_counter() - t0


class PhaseTimer:
    """Accumulates inclusive seconds per named phase on this rank (``--profile``)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def add(self, name: str, seconds: float) -> None:
        self.acc[name] += seconds

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t0

        return inner

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


class _TimedModule:
    """Stand-in for a module (``os``, ``shutil``) inside one library module: times some calls."""

    def __init__(self, module: Any, timer: PhaseTimer, prefix: str, names: Sequence[str]) -> None:
        self._module = module
        self._timer = timer
        self._prefix = prefix
        self._names = frozenset(names)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if name in self._names:
            return self._timer.wrap(f"{self._prefix}{name}", attr)
        return attr


# Phases reported by --profile, in print order, with what they cover (all inclusive times).
PHASES: dict[str, str] = {
    "save": "CheckpointManager.save, whole call",
    "restore": "CheckpointManager.restore, whole call",
    "try_read": "Restorer._try_read: this rank's piece read, verified, judged",
    "read_rank": "reading.read_rank: allocate, read, verify",
    "h5.preadv": "os.preadv in fileio.read_new/read_many (page faults of new arrays included)",
    "ready": "SavePipeline.ready (temporary directory, local plan, the save's first allgather)",
    "save_set": "SavePipeline.start (plan, write, fsync, gather, commit, for a blocking save)",
    "digest": "xxh3 of the rank's arrays (saveset.digest_arrays, checksum.digest_arrays)",
    "skeleton": "fileio.build_skeleton: HDF5 metadata made by h5format (leader, during its write)",
    "h5.pwrite": "os.pwrite in fileio (O_DIRECT writes of large arrays)",
    "h5.pwritev": "os.pwritev in fileio.write_file (small arrays: copy into the page cache)",
    "h5.fsync": "os.fsync in the fileio module (skeleton + data to disk)",
    "commit": "PendingDir.prepare: manifest + COMMITTED written (rank 0)",
    "publish": "PendingDir.publish: their fsync, rename, fsync of the parent (rank 0)",
    "rotate": "SharedRoot.after_commit: save log + rotation (rank 0)",
    "catalog.apply": "rotate: Catalog.apply (trash the deleted checkpoints, collect static data)",
    "move_to_trash": "rotate: storage.move_to_trash (rename + fsync dir)",
    "st.rmtree": "shutil.rmtree in storage (unlink the old files: frees blocks + page cache)",
    "st.fsync": "os.fsync in storage (manifest, marker, directories)",
    "barrier": "sleeping barriers inside the library (waiting for other ranks)",
}


def install_profiler(timer: PhaseTimer) -> None:
    """Replace library functions by timing wrappers (module attributes only, code unchanged)."""
    import resilient.checkpoint.manager as man
    import resilient.checkpoint.saveset as ckpt
    import resilient.io.fileio as h5mod
    import resilient.io.storage as storage
    import resilient.model.checksum as checksum
    import resilient.parallel.mpi as rmpi
    from resilient.checkpoint import restorer
    from resilient.checkpoint.catalog import Catalog
    from resilient.checkpoint.restorer import Restorer
    from resilient.checkpoint.savepaths import SharedRoot
    from resilient.checkpoint.saving import SavePipeline
    from resilient.io.commit import PendingDir

    def patch(owner: object, attr: str, phase: str) -> None:
        setattr(owner, attr, timer.wrap(phase, getattr(owner, attr)))

    patch(man.CheckpointManager, "save", "save")
    patch(man.CheckpointManager, "restore", "restore")
    patch(SharedRoot, "after_commit", "rotate")
    patch(Restorer, "_try_read", "try_read")
    patch(SavePipeline, "ready", "ready")
    patch(SavePipeline, "start", "save_set")
    patch(restorer, "read_rank", "read_rank")
    patch(ckpt, "digest_arrays", "digest")
    patch(checksum, "digest_arrays", "digest")
    patch(PendingDir, "prepare", "commit")
    patch(PendingDir, "publish", "publish")
    patch(h5mod, "build_skeleton", "skeleton")
    patch(rmpi.MPIComm, "barrier", "barrier")
    patch(Catalog, "apply", "catalog.apply")
    patch(storage, "move_to_trash", "move_to_trash")
    # module attributes of another type: setattr keeps mypy quiet
    h5_os = _TimedModule(os, timer, "h5.", ("pwrite", "pwritev", "fsync", "preadv"))
    setattr(h5mod, "os", h5_os)  # noqa: B010
    setattr(storage, "os", _TimedModule(os, timer, "st.", ("fsync",)))  # noqa: B010
    setattr(storage, "shutil", _TimedModule(shutil, timer, "st.", ("rmtree",)))  # noqa: B010


# ---------------------------------------------------------------------------- raw I/O


def pwrite_all(fd: int, buf: np.ndarray, offset: int = 0) -> None:
    view = buf.data.cast("B")
    pos = offset
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def pread_all(fd: int, buf: np.ndarray, offset: int = 0) -> None:
    view = buf.data.cast("B")
    pos = offset
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            raise EOFError(f"file ends at byte {pos}")
        view, pos = view[n:], pos + n


def raw_write(path: Path, buf: np.ndarray) -> None:
    """The physical limit: new file, pwrite everything, fsync, close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pwrite_all(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_all(fd, buf)
    finally:
        os.close(fd)


def raw_shared_write(path: Path, buf: np.ndarray) -> None:
    """All ranks into one file: rank 0 creates it (sparse), then each writes its slice + fsync."""
    if RANK == 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, buf.nbytes * SIZE)
        os.close(fd)
    sleep_barrier()
    fd = os.open(path, os.O_WRONLY)
    try:
        pwrite_all(fd, buf, RANK * buf.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- the benchmark


class Bench:
    """State shared by the modes: buffers, managers, file names and step counters."""

    def __init__(self, base: Path, mib: int, profile: bool) -> None:
        n = mib * (1 << 20) // 8
        self.base = base
        self.profile = profile
        self.buf = np.empty(n, dtype=np.float64)
        self.buf.fill(RANK + 0.25)  # prefault: every page touched once, reused by every run
        self.readbuf = np.empty(n, dtype=np.float64)
        self.readbuf.fill(0.0)
        self.raw_dir = base / "raw"
        if RANK == 0:
            self.raw_dir.mkdir()
        sleep_barrier()
        self.mgrs = {
            kind: CheckpointManager(base / kind, comm=COMM, checkpoint_comm=kind, keep=KeepLast(1))
            for kind in LAYOUTS
        }
        self.step = dict.fromkeys(LAYOUTS, 0)
        self.raw_runs = 0
        self.raw_first = 0.0
        self.shared_runs = 0

    def raw_path(self, run: int) -> Path:
        return self.raw_dir / f"r{RANK:05d}_{run:04d}.bin"

    def shared_path(self, run: int) -> Path:
        return self.raw_dir / f"shared_{run:04d}.bin"

    def close(self) -> None:
        for mgr in self.mgrs.values():
            mgr.close()

    def run(self, mode: str, *, check: bool = False) -> float:
        """One timed run of ``mode``; untimed bookkeeping (deleting old raw files) after it."""
        if mode == "raw":
            self.raw_runs += 1
            path = self.raw_path(self.raw_runs)
            self.raw_first = float(self.buf[0])
            seconds = timed(lambda: raw_write(path, self.buf))
            if self.raw_runs > 1:
                self.raw_path(self.raw_runs - 1).unlink()
            return seconds
        if mode == "raw_shared":
            self.shared_runs += 1
            path = self.shared_path(self.shared_runs)
            seconds = timed(lambda: raw_shared_write(path, self.buf))
            sleep_barrier()
            if RANK == 0 and self.shared_runs > 1:
                self.shared_path(self.shared_runs - 1).unlink()
            return seconds
        if mode in LAYOUTS:
            self.step[mode] += 1
            step = self.step[mode]
            self.buf[0] = step  # each checkpoint differs (same page, already touched)
            mgr = self.mgrs[mode]
            return timed(lambda: mgr.save(step, {"x": self.buf}))
        if mode == "raw_read":
            path = self.raw_path(self.raw_runs)
            seconds = timed(lambda: raw_read(path, self.readbuf))
            if check and not same_data(self.readbuf, self.buf, self.raw_first):
                raise AssertionError(f"rank {RANK}: raw file content differs")
            return seconds
        if mode == "raw_read_fresh":
            path = self.raw_path(self.raw_runs)
            holder: list[np.ndarray] = []

            def fresh() -> None:
                arr = np.empty_like(self.buf)
                raw_read(path, arr)
                holder.append(arr)

            seconds = timed(fresh)
            holder.clear()
            return seconds
        if mode.startswith("restore_"):
            kind = mode.removeprefix("restore_")
            got: list[tuple[int, dict[str, Any]]] = []
            seconds = timed(lambda: got.append(self.mgrs[kind].restore()))
            step, state = got[0]
            if step != self.step[kind]:
                raise AssertionError(f"{mode}: restored step {step}, expected {self.step[kind]}")
            if check and not same_data(state["x"], self.buf, float(step)):
                raise AssertionError(f"rank {RANK}: {mode} content differs")
            got.clear()
            del state
            return seconds
        raise ValueError(f"unknown mode {mode!r}")


def same_data(got: np.ndarray, buf: np.ndarray, first: float) -> bool:
    """``got`` equals ``buf`` except that element 0 (the step marker) must be ``first``."""
    return bool(got[0] == first) and np.array_equal(got[1:], buf[1:])


def summarize(
    times: dict[str, list[float]], total_bytes: int, modes: Sequence[str], ref: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Medians, spread, GB/s and ratios (``ref_median / mode_median``) per mode."""
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        ts = times[mode]
        med = statistics.median(ts)
        row: dict[str, Any] = {
            "times_s": ts,
            "median_s": med,
            "min_s": min(ts),
            "max_s": max(ts),
            "gb_per_s": total_bytes / med / 1e9,
        }
        for label, other in ref.items():
            if other == mode or other not in times:
                continue
            row[f"ratio_{label}"] = statistics.median(times[other]) / med
            row[f"paired_ratio_{label}"] = statistics.median(
                a / b for a, b in zip(times[other], ts, strict=True)
            )
        out[mode] = row
    return out


def fmt_ratio(row: dict[str, Any], label: str) -> str:
    if f"ratio_{label}" not in row:
        return "-"
    return f"{row[f'ratio_{label}']:.2f} ({row[f'paired_ratio_{label}']:.2f})"


def print_table(title: str, rows: dict[str, dict[str, Any]], ref_name: str, self_name: str) -> None:
    print(f"\n{title}\n")
    print(
        f"| mode | median s | min s | max s | GB/s | ratio to {ref_name} (paired) "
        f"| ratio to {self_name} (paired) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in rows.items():
        print(
            f"| {mode} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} "
            f"| {r['gb_per_s']:.2f} | {fmt_ratio(r, 'raw')} | {fmt_ratio(r, 'self')} |"
        )


def check_targets(writes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    targets = [("self", "raw", 0.9), ("node", "self", 0.8), ("world", "self", 0.8)]
    out = []
    for mode, ref, need in targets:
        ratio = writes[mode][f"ratio_{ref}"]
        paired = writes[mode][f"paired_ratio_{ref}"]
        out.append(
            {
                "mode": mode,
                "ref": ref,
                "target": need,
                "ratio": ratio,
                "paired_ratio": paired,
                "met": ratio >= need,
            }
        )
    return out


def print_profile(prof: dict[str, list[list[dict[str, float]]]]) -> None:
    """Per mode and phase: median over timed runs of rank 0's time and of the max over ranks."""
    print("\nPer-phase times (--profile; inclusive, seconds; median over the timed runs)\n")
    print("| mode | phase | rank 0 | max over ranks | what |")
    print("|---|---|---:|---:|---|")
    for mode, runs in prof.items():
        for phase, what in PHASES.items():
            r0 = [per_rank[0].get(phase, 0.0) for per_rank in runs]
            mx = [max(pr.get(phase, 0.0) for pr in per_rank) for per_rank in runs]
            if max(mx, default=0.0) == 0.0:
                continue
            print(
                f"| {mode} | {phase} | {statistics.median(r0):.4f} "
                f"| {statistics.median(mx):.4f} | {what} |"
            )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--mib", type=int, default=256, help="MiB of float64 per rank (default 256)")
    p.add_argument("--runs", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument(
        "--dir",
        default=None,
        help="parent of the fresh temporary directory (default: the system temp dir, /tmp)",
    )
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--seed", type=int, default=1, help="seed of the per-round mode order")
    p.add_argument("--profile", action="store_true", help="per-phase timings + diagnostic modes")
    args = p.parse_args(argv)
    if args.mib < 1 or args.runs < 1:
        p.error("--mib and --runs must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    timer = PhaseTimer()
    if args.profile:
        install_profiler(timer)
    base: Path | None = None
    if RANK == 0:
        base = Path(tempfile.mkdtemp(prefix="resilient-bench-", dir=args.dir))
    revision = library_revision() if RANK == 0 else ""
    base = COMM.bcast(base, root=0)
    assert base is not None
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        bench = Bench(base, args.mib, args.profile)
        write_modes = list(WRITE_MODES) + (list(PROFILE_WRITE_MODES) if args.profile else [])
        read_modes = list(READ_MODES) + (list(PROFILE_READ_MODES) if args.profile else [])
        modes = write_modes + read_modes
        for mode in modes:  # warm-up, untimed, with content checks
            bench.run(mode, check=True)
        timer.take()
        rng = random.Random(args.seed)  # same sequence on every rank: no communication needed
        times: dict[str, list[float]] = {m: [] for m in modes}
        prof: dict[str, list[list[dict[str, float]]]] = {m: [] for m in modes}
        for rnd in range(args.runs):
            order = rng.sample(modes, len(modes))
            for mode in order:
                seconds = bench.run(mode)
                times[mode].append(seconds)
                if args.profile:
                    sleep_barrier()
                    phases = COMM.gather(timer.take(), root=0)
                    if RANK == 0:
                        assert phases is not None
                        prof[mode].append(phases)
            if RANK == 0:
                line = " ".join(f"{m}={times[m][-1]:.3f}" for m in order)
                print(f"round {rnd + 1}/{args.runs}: {line}", file=sys.stderr, flush=True)
        bench.close()
    except BaseException:  # no collective on the error path: any failing rank cleans up
        shutil.rmtree(base, ignore_errors=True)
        raise
    sleep_barrier()
    if RANK == 0:
        shutil.rmtree(base, ignore_errors=True)

    if RANK != 0:
        return 0
    total = SIZE * args.mib * (1 << 20)
    writes = summarize(times, total, write_modes, {"raw": "raw", "self": "self"})
    reads = summarize(times, total, read_modes, {"raw": "raw_read", "self": "restore_self"})
    targets = check_targets(writes)
    load_after = os.getloadavg()
    mpi_library = " ".join(MPI.Get_library_version().split()[:3])

    print(
        f"\n# bench_save: {SIZE} ranks x {args.mib} MiB float64 = {total / 2**30:.2f} GiB, "
        f"{args.runs} rounds after 1 warm-up, {started:%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"host {platform.node()}, {os.cpu_count()} CPUs, dir {base.parent}, "
        f"resilient {resilient.__version__} ({revision}), mpi {mpi_library}; "
        f"loadavg before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    )
    print_table(
        "Saves (ratio = raw median / mode median; self column: self / mode):", writes, "raw", "self"
    )
    print_table(
        "Restores, WARM page cache (ratios against raw_read and restore_self):",
        reads,
        "raw_read",
        "restore_self",
    )
    print("\nTargets (ratio of medians; paired = median of per-round ratios):")
    for t in targets:
        print(
            f"- {t['mode']} >= {t['target']} x {t['ref']}: {t['ratio']:.2f} "
            f"(paired {t['paired_ratio']:.2f}) -> {'met' if t['met'] else 'NOT met'}"
        )
    if args.profile:
        print_profile(prof)
    if args.json:
        doc = {
            "date_utc": started.isoformat(timespec="seconds"),
            "ranks": SIZE,
            "mib_per_rank": args.mib,
            "total_bytes": total,
            "runs": args.runs,
            "seed": args.seed,
            "dir": str(base.parent),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "resilient_version": resilient.__version__,
            "resilient_revision": revision,
            "mpi_library": mpi_library,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "restore_cache": "warm",
            "writes": writes,
            "reads": reads,
            "targets": targets,
            "profile": prof if args.profile else None,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        COMM.Abort(1)
