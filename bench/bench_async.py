"""Async saves, the local tier, peers and restores of ``resilient``, against the machine's limits.

Run::

    mpiexec -n 4 python bench/bench_async.py [--mib 128] [--runs 5] [--json PATH] [--dir DIR]
                                             [--modes a,b,...] [--history-n 10000]
                                             [--drop-caches] [--no-heat]
    mpiexec -n 4 python bench/bench_async.py --side-by-side   # async until durable vs sync

Every rank holds one float64 buffer of ``--mib`` MiB, allocated and prefaulted once and reused
by every run. One untimed warm-up run of every mode (with content checks), then ``--runs``
rounds; each round runs every mode once, in a per-round shuffled order (seeded, the same on
every rank). Each mode is timed on every rank from a sleeping barrier (``Ibarrier`` polled with
``time.sleep``: MACHINE.md gotcha 10) to the end of the measured call; the figure of a run is
the maximum over ranks. Reported: medians, min, max, and ratios to the reference measured in the
same run (``raw`` for writes, ``cold_read`` for reads), plus the median of per-round ratios
("paired"). The modes (``--list`` prints them) and what each peer is (process layout) are in
bench/README.md, section "bench_async.py".

Modes that need something missing (the async or local-tier API of ``CheckpointManager``, torch,
jax/orbax) are skipped with a note; the others still run.

After the rounds: finding the newest valid checkpoint among ``--history-n`` committed ones
(rank 0 only, clones built by bench_history.build_root), and, when the library has async
saves, the heat app's step time with and without an async save in flight (in process), and,
when ``apps.heat`` has ``--async-save``, the app end to end (rank 0 launches
``mpiexec -n SIZE python -m apps.heat`` without checkpoints, with sync, async and local-tier
saves).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import mmap
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# ruff: noqa: E402  (the thread settings above must precede the imports of numpy, torch, jax)

# Before the imports of numpy/torch/jax: 4 ranks share 2 cores, keep each single-threaded.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import numpy as np
from benchutil import files_under, fsync_path, fsync_tree, library_revision
from mpi4py import MPI

import resilient
from resilient import CheckpointManager, KeepLast

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()

HAS_ASYNC = "blocking" in inspect.signature(CheckpointManager.save).parameters
HAS_LOCAL = "local_dir" in inspect.signature(CheckpointManager.__init__).parameters

# mode -> (group, metrics, what). Group "write" modes are compared with raw, "read" with cold_read.
MODES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "raw": ("write", ("write",), "per rank: os.pwrite of a new file + fsync (the limit)"),
    "raw_over": (
        "write",
        ("write",),
        "per rank: os.pwrite over the same bytes of an existing file + fsync (the limit of a "
        "save that writes over a dropped checkpoint's file)",
    ),
    "raw_over_direct": (
        "write",
        ("write",),
        "per rank: O_DIRECT os.pwrite from a page-aligned copy of the buffer over an existing "
        "file + fsync (the limit of a save that writes with O_DIRECT: no copy, one request)",
    ),
    "mover_over": (
        "write",
        ("write",),
        "per rank: resilient.io.fileio.write_file over an existing file (the save's byte mover "
        "alone: O_DIRECT through a reused 32 MiB bounce buffer, fsync)",
    ),
    "memcpy": (
        "write",
        ("copy",),
        "per rank: np.copyto into a prefaulted buffer (the limit of a staging copy)",
    ),
    "sync_self": (
        "write",
        ("save",),
        "CheckpointManager.save, checkpoint_comm='self' (a file per rank)",
    ),
    "sync_node": (
        "write",
        ("save",),
        "CheckpointManager.save, checkpoint_comm='node' (a file per node)",
    ),
    "sync_world": (
        "write",
        ("save",),
        "CheckpointManager.save, checkpoint_comm='world' (one file)",
    ),
    "async": (
        "write",
        ("blocked", "durable"),
        "save(blocking=False) (self): time until it returns; durable = + wait()",
    ),
    "async_nocopy": ("write", ("blocked", "durable"), "save(blocking=False, copy=False) (self)"),
    "local": (
        "write",
        ("blocked", "flush"),
        "local_dir=/dev/shm, flush_every=1: save(blocking=False); flush = + wait()",
    ),
    "np_save": ("write", ("durable",), "per rank: numpy.save to a new file + fsync"),
    "h5py": (
        "write",
        ("durable",),
        "per rank: h5py.File create_dataset(data=) + flush + close + fsync",
    ),
    "torch_save": ("write", ("durable",), "per rank: torch.save({'x': from_numpy(buf)}) + fsync"),
    "dcp_save": (
        "write",
        ("durable",),
        "torch.distributed.checkpoint.save, gloo, 4 ranks, one key per rank; + fsync of its files",
    ),
    "dcp_async": (
        "write",
        ("blocked", "durable"),
        "dcp.async_save: time until it returns; durable = + result() + fsync",
    ),
    "orbax_std": (
        "write",
        ("durable",),
        "orbax StandardCheckpointer, one independent jax process per rank, own dir; save + wait + fsync",
    ),
    "orbax_async": (
        "write",
        ("blocked", "durable"),
        "orbax AsyncCheckpointer(StandardCheckpointHandler), as orbax_std; blocked = save()",
    ),
    "cold_read": (
        "read",
        ("read",),
        "per rank: read the newest raw file into a prefaulted buffer, caches dropped",
    ),
    "cold_read_fresh": (
        "read",
        ("read",),
        "as cold_read, into a newly allocated array (as restore does; diagnostic)",
    ),
    "restore": (
        "read",
        ("restore",),
        "CheckpointManager.restore() of the newest sync_self checkpoint (full checksum verification), caches dropped",
    ),
    "restore_into": (
        "read",
        ("restore",),
        "as restore, into the prefaulted buffer of cold_read: restore(into={'x': buf}), caches dropped",
    ),
    "dcp_load": (
        "read",
        ("load",),
        "dcp.load into a preallocated tensor of the newest dcp_save checkpoint, caches dropped",
    ),
}
NEEDS = {
    "async": "async",
    "async_nocopy": "async",
    "local": "local",
    "torch_save": "torch",
    "dcp_save": "torch",
    "dcp_async": "torch",
    "dcp_load": "torch",
    "orbax_std": "orbax",
    "orbax_async": "orbax",
}
SYNC_PEERS = ("np_save", "h5py", "torch_save", "dcp_save", "orbax_std")
# --side-by-side: an async save until durable against a sync save of the same state, both
# writing over the files rotation dropped (KeepLast(1)), and the raw writes as the floors
SIDE_BY_SIDE = ("raw", "raw_over", "sync_self", "async")


# ---------------------------------------------------------------------------- helpers


def sleep_barrier(comm: Any = COMM) -> None:
    """A barrier whose waiting ranks sleep instead of spinning (MACHINE.md gotcha 10)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def pwrite_all(fd: int, buf: np.ndarray) -> None:
    view, pos = buf.data.cast("B"), 0
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def pread_all(fd: int, buf: np.ndarray) -> None:
    view, pos = buf.data.cast("B"), 0
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            raise EOFError(f"file ends at byte {pos}")
        view, pos = view[n:], pos + n


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of two float64 arrays (NaN patterns included)."""
    return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))


def fsync_share(path: Path) -> None:
    """Collective: fsync every file (and directory) under ``path``, split among the ranks.

    For peers that write no fsync of their own (DCP, and orbax to be safe): a barrier first, so
    that every rank's files exist, then each rank fsyncs its share, then a barrier again.
    """
    sleep_barrier()
    entries = [*files_under(path), *(p for p in path.rglob("*") if p.is_dir()), path]
    for i, p in enumerate(sorted(entries)):
        if i % SIZE == RANK:
            fsync_path(p)
    sleep_barrier()


def drop_cache(paths: Sequence[Path], drop_caches: bool) -> None:
    """Collective: evict ``paths`` (files or trees) from the page cache, rank 0 does it."""
    if RANK == 0:
        if drop_caches:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        else:
            for top in paths:
                for p in files_under(top):
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
    sleep_barrier()


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mpi_free_env() -> dict[str, str]:
    """The environment without the launcher's variables (MACHINE.md section 6)."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


# ---------------------------------------------------------------------------- peers


class Peers:
    """Imports of the optional peers, agreed on by every rank (a mode runs on all or none)."""

    def __init__(self, want: set[str]) -> None:
        self.notes: dict[str, str] = {}
        self.torch: Any = None
        self.dcp: Any = None
        self.ocp: Any = None
        self.jnp: Any = None
        ok = {"async": HAS_ASYNC, "local": HAS_LOCAL}
        if not HAS_ASYNC:
            self.notes["async"] = (
                "CheckpointManager.save has no blocking= argument in this revision"
            )
        if not HAS_LOCAL:
            self.notes["local"] = "CheckpointManager has no local_dir= argument in this revision"
        ok["torch"] = self._try("torch", self._import_torch) if want & _needing("torch") else False
        ok["orbax"] = self._try("orbax", self._import_orbax) if want & _needing("orbax") else False
        flags = allreduce_list([float(ok[k]) for k in sorted(ok)], MPI.MIN)
        self.ok = {k: bool(v) for k, v in zip(sorted(ok), flags, strict=True)}

    def _try(self, name: str, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except Exception as exc:  # an optional peer: report and skip
            self.notes[name] = f"{type(exc).__name__}: {exc}"
            return False

    def _import_torch(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        torch.set_num_threads(1)
        port = COMM.bcast(free_port() if RANK == 0 else None, root=0)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=RANK, world_size=SIZE)
        self.torch, self.dcp = torch, dcp
        self.notes["torch"] = f"torch {torch.__version__}, gloo process group of {SIZE} ranks"

    def _import_orbax(self) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)  # else jnp.asarray stores float64 as float32
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        self.ocp, self.jnp = ocp, jnp
        version = getattr(ocp, "__version__", "?")
        self.notes["orbax"] = (
            f"orbax-checkpoint {version}, jax {jax.__version__} ({jax.default_backend()}): one "
            f"independent jax process per rank (jax.distributed not initialised, "
            f"process_count={jax.process_count()}), each saving its own directory"
        )


def _needing(what: str) -> set[str]:
    return {m for m, need in NEEDS.items() if need == what}


def allreduce_list(values: Sequence[float], op: Any) -> list[float]:
    """Element-wise ``op`` (``MPI.MAX`` / ``MPI.MIN``) over ranks of a list of numbers."""
    send = np.asarray(values, dtype=np.float64)
    recv = np.empty_like(send)
    COMM.Allreduce(send, recv, op=op)
    return [float(v) for v in recv]


# ---------------------------------------------------------------------------- the benchmark


class Bench:
    """Buffers, managers, output directories and run counters shared by the modes."""

    def __init__(self, base: Path, args: argparse.Namespace, peers: Peers, modes: list[str]):
        n = args.mib * (1 << 20) // 8
        self.base = base
        self.args = args
        self.peers = peers
        self.buf = np.empty(n, dtype=np.float64)
        # random, so that no peer gains by compressing (Orbax/tensorstore compresses by default);
        # filling also prefaults: every page touched once, reused by every run
        self.buf.view(np.uint8)[:] = np.frombuffer(
            np.random.default_rng(1234 + RANK).bytes(self.buf.nbytes), dtype=np.uint8
        )  # random bits (some are NaN patterns: compare with same_bits)
        self.buf[0] = 0.0  # element 0 is the step marker
        self.readbuf = np.empty(n, dtype=np.float64)
        self.readbuf.fill(0.0)
        self.memdst = np.empty(n, dtype=np.float64)
        self.memdst.fill(0.0)
        self.runs: dict[str, int] = dict.fromkeys(MODES, 0)
        self.latest: dict[str, Path] = {}
        self.disk_bytes: dict[str, int] = {}
        self.inodes: dict[str, set[int]] = {}  # rank 0: data files' inodes of a manager's saves
        self.files: dict[str, int] = {}  # rank 0: data files of a manager's checkpoint
        self.mgrs: dict[str, Any] = {}
        self.aligned: mmap.mmap | None = None  # raw_over_direct's page-aligned copy of buf
        self.bounce: Any = None  # mover_over's bounce buffer, reused by its runs
        self.shm: Path | None = None
        if RANK == 0:
            for m in modes:
                (base / m).mkdir()
        sleep_barrier()
        for kind in ("self", "node", "world"):
            restores = "restore" in modes or "restore_into" in modes
            if f"sync_{kind}" in modes or (kind == "self" and restores):
                self.mgrs[f"sync_{kind}"] = CheckpointManager(
                    base / f"mgr_{kind}", comm=COMM, checkpoint_comm=kind, keep=KeepLast(1)
                )
        for mode in ("async", "async_nocopy"):
            if mode in modes:
                self.mgrs[mode] = CheckpointManager(
                    base / f"mgr_{mode}", comm=COMM, checkpoint_comm="self", keep=KeepLast(1)
                )
        if "local" in modes:
            shm = COMM.bcast(
                tempfile.mkdtemp(prefix="resilient-bench-local-", dir="/dev/shm") if RANK == 0 else None,
                root=0,
            )  # fmt: skip
            self.shm = Path(shm)
            self.mgrs["local"] = CheckpointManager(
                base / "mgr_local", comm=COMM, checkpoint_comm="self", keep=KeepLast(1),
                local_dir=self.shm, flush_every=1,
            )  # fmt: skip
        self.tensor = self.readtensor = None
        if peers.torch is not None:
            self.tensor = peers.torch.from_numpy(self.buf)  # shares the buffer: no copy
            self.readtensor = peers.torch.from_numpy(self.readbuf)
        self.jarr = None
        if peers.jnp is not None:
            self.jarr = peers.jnp.asarray(self.buf)  # a jax array made once (outside timing)
            self.jarr.block_until_ready()
            assert self.jarr.dtype == np.float64, self.jarr.dtype

    def close(self) -> None:
        for mgr in self.mgrs.values():
            mgr.close()
        if self.bounce is not None:
            self.bounce.close()
        if RANK == 0 and self.shm is not None:
            shutil.rmtree(self.shm, ignore_errors=True)

    # --- one run ------------------------------------------------------------------

    def new_target(self, mode: str, suffix: str, shared: bool = False) -> Path:
        """A fresh output path of ``mode``: per rank, or one directory for all (``shared``)."""
        self.runs[mode] += 1
        run = self.runs[mode]
        name = f"run{run:04d}{suffix}" if shared else f"r{RANK:05d}_{run:04d}{suffix}"
        return self.base / mode / name

    def retire(self, mode: str, path: Path, shared: bool = False) -> None:
        """Untimed: remove the previous output of ``mode``, remember ``path`` as the newest."""
        if RANK == 0:  # bytes on disk of rank 0's output (all ranks' for a shared directory)
            self.disk_bytes[mode] = sum(p.stat().st_size for p in files_under(path))
        old = self.latest.get(mode)
        self.latest[mode] = path
        if old is not None and (RANK == 0 or not shared):
            remove(old)
        sleep_barrier()

    def run(self, mode: str, *, check: bool = False) -> dict[str, float]:
        """One run of ``mode``; local seconds per metric (the caller takes the max over ranks)."""
        fn = getattr(self, "m_" + mode)
        result: dict[str, float] = fn(check)
        return result

    def m_raw(self, check: bool) -> dict[str, float]:
        path = self.new_target("raw", ".bin")
        self.raw_first = float(self.buf[0])
        sleep_barrier()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, self.buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        t = time.perf_counter() - t0
        self.retire("raw", path)
        return {"write": t}

    def m_raw_over(self, check: bool) -> dict[str, float]:
        path = self.base / "raw_over" / f"r{RANK:05d}.bin"
        sleep_barrier()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # the previous run's file, if any
        try:
            pwrite_all(fd, self.buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        t = time.perf_counter() - t0
        sleep_barrier()
        return {"write": t}

    def m_raw_over_direct(self, check: bool) -> dict[str, float]:
        path = self.base / "raw_over_direct" / f"r{RANK:05d}.bin"
        if self.aligned is None:  # the buffer's bytes on whole pages, as O_DIRECT needs
            self.aligned = mmap.mmap(-1, self.buf.nbytes)
            memoryview(self.aligned)[:] = self.buf.data.cast("B")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # the previous run's file, if any
        os.close(fd)
        sleep_barrier()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        try:
            pwrite_all(fd, np.frombuffer(self.aligned, np.uint8))
            os.fsync(fd)
        finally:
            os.close(fd)
        t = time.perf_counter() - t0
        sleep_barrier()
        return {"write": t}

    def m_mover_over(self, check: bool) -> dict[str, float]:
        from resilient.io import fileio

        path = self.base / "mover_over" / f"r{RANK:05d}.bin"
        if self.bounce is None:
            self.bounce = fileio.Bounce()
        sleep_barrier()
        t0 = time.perf_counter()
        fileio.write_file(path, [0], [self.buf], bounce=self.bounce)
        t = time.perf_counter() - t0
        sleep_barrier()
        return {"write": t}

    def m_memcpy(self, check: bool) -> dict[str, float]:
        sleep_barrier()
        t0 = time.perf_counter()
        np.copyto(self.memdst, self.buf)
        t = time.perf_counter() - t0
        if check and not same_bits(self.memdst, self.buf):
            raise AssertionError("memcpy differs")
        return {"copy": t}

    def _next_step(self, mode: str) -> int:
        self.runs[mode] += 1
        step = self.runs[mode]
        self.buf[0] = step  # each checkpoint differs (same page, already touched)
        return step

    def _sync(self, mode: str) -> dict[str, float]:
        step = self._next_step(mode)
        mgr = self.mgrs[mode]
        sleep_barrier()
        t0 = time.perf_counter()
        where = mgr.save(step, {"x": self.buf})
        t = time.perf_counter() - t0
        self._note_inodes(mode, where)
        sleep_barrier()
        return {"save": t}

    def _note_inodes(self, mode: str, checkpoint: Path) -> None:
        """Untimed, rank 0: the inodes of the committed checkpoint's data files (with
        ``KeepLast(1)`` saves that write over the dropped checkpoint's files cycle through
        two sets: two inodes per file)."""
        if RANK == 0:
            inodes = [p.stat().st_ino for p in checkpoint.glob("*.h5")]
            self.inodes.setdefault(mode, set()).update(inodes)
            self.files[mode] = len(inodes)

    def m_sync_self(self, check: bool) -> dict[str, float]:
        return self._sync("sync_self")

    def m_sync_node(self, check: bool) -> dict[str, float]:
        return self._sync("sync_node")

    def m_sync_world(self, check: bool) -> dict[str, float]:
        return self._sync("sync_world")

    def _async(self, mode: str, names: tuple[str, str], **kwargs: Any) -> dict[str, float]:
        step = self._next_step(mode)
        mgr = self.mgrs[mode]
        sleep_barrier()
        t0 = time.perf_counter()
        where = mgr.save(step, {"x": self.buf}, blocking=False, **kwargs)
        t1 = time.perf_counter()
        mgr.wait()
        t2 = time.perf_counter()
        if mode != "local":
            self._note_inodes(mode, where)
        sleep_barrier()
        return {names[0]: t1 - t0, names[1]: t2 - t0}

    def m_async(self, check: bool) -> dict[str, float]:
        return self._async("async", ("blocked", "durable"))

    def m_async_nocopy(self, check: bool) -> dict[str, float]:
        return self._async("async_nocopy", ("blocked", "durable"), copy=False)

    def m_local(self, check: bool) -> dict[str, float]:
        return self._async("local", ("blocked", "flush"))

    def _per_rank_file(
        self, mode: str, suffix: str, write: Callable[[Any], None]
    ) -> dict[str, float]:
        path = self.new_target(mode, suffix)
        sleep_barrier()
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        t = time.perf_counter() - t0
        self.retire(mode, path)
        return {"durable": t}

    def m_np_save(self, check: bool) -> dict[str, float]:
        return self._per_rank_file("np_save", ".npy", lambda fh: np.save(fh, self.buf))

    def m_torch_save(self, check: bool) -> dict[str, float]:
        torch = self.peers.torch
        return self._per_rank_file(
            "torch_save", ".pt", lambda fh: torch.save({"x": self.tensor}, fh)
        )

    def m_h5py(self, check: bool) -> dict[str, float]:
        import h5py

        path = self.new_target("h5py", ".h5")
        sleep_barrier()
        t0 = time.perf_counter()
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=self.buf)
            f.flush()
        fsync_path(path)
        t = time.perf_counter() - t0
        self.retire("h5py", path)
        return {"durable": t}

    def _dcp_state(self, tensor: Any) -> dict[str, Any]:
        return {f"x{RANK}": tensor}  # distinct keys: DCP deduplicates equal keys across ranks

    def m_dcp_save(self, check: bool) -> dict[str, float]:
        path = self.new_target("dcp_save", "", shared=True)
        sleep_barrier()
        t0 = time.perf_counter()
        self.peers.dcp.save(self._dcp_state(self.tensor), checkpoint_id=str(path))
        fsync_share(path)
        t = time.perf_counter() - t0
        self.retire("dcp_save", path, shared=True)
        return {"durable": t}

    def m_dcp_async(self, check: bool) -> dict[str, float]:
        path = self.new_target("dcp_async", "", shared=True)
        sleep_barrier()
        t0 = time.perf_counter()
        fut = self.peers.dcp.async_save(self._dcp_state(self.tensor), checkpoint_id=str(path))
        t1 = time.perf_counter()
        fut.result()
        fsync_share(path)
        t2 = time.perf_counter() - t0
        self.retire("dcp_async", path, shared=True)
        return {"blocked": t1 - t0, "durable": t2}

    def _orbax(
        self, mode: str, make: Callable[[], Any], save: Callable[[Any, Path], None]
    ) -> dict[str, float]:
        path = self.new_target(mode, "")
        ckpt = self.__dict__.setdefault(f"_ckpt_{mode}", make())
        sleep_barrier()
        t0 = time.perf_counter()
        save(ckpt, path)
        t1 = time.perf_counter()
        ckpt.wait_until_finished()
        fsync_tree(path)
        t2 = time.perf_counter()
        self.retire(mode, path)
        return {"blocked": t1 - t0, "durable": t2 - t0}

    def m_orbax_std(self, check: bool) -> dict[str, float]:
        ocp = self.peers.ocp
        r = self._orbax(
            "orbax_std",
            ocp.StandardCheckpointer,
            lambda c, p: c.save(p.absolute(), {"x": self.jarr}),
        )
        return {"durable": r["durable"]}

    def m_orbax_async(self, check: bool) -> dict[str, float]:
        ocp = self.peers.ocp
        return self._orbax(
            "orbax_async",
            lambda: ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler()),
            lambda c, p: c.save(p.absolute(), args=ocp.args.StandardSave({"x": self.jarr})),
        )

    # --- reads (cold) --------------------------------------------------------------

    def m_cold_read(self, check: bool) -> dict[str, float]:
        path = self.latest["raw"]
        drop_cache([self.base / "raw"], self.args.drop_caches)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            pread_all(fd, self.readbuf)
        finally:
            os.close(fd)
        t = time.perf_counter() - t0
        if check and not (
            self.readbuf[0] == self.raw_first and same_bits(self.readbuf[1:], self.buf[1:])
        ):
            raise AssertionError(f"rank {RANK}: raw file content differs")
        sleep_barrier()
        return {"read": t}

    def m_cold_read_fresh(self, check: bool) -> dict[str, float]:
        path = self.latest["raw"]
        drop_cache([self.base / "raw"], self.args.drop_caches)
        t0 = time.perf_counter()
        arr = np.empty_like(self.buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            pread_all(fd, arr)
        finally:
            os.close(fd)
        t = time.perf_counter() - t0
        del arr
        sleep_barrier()
        return {"read": t}

    def m_restore(self, check: bool) -> dict[str, float]:
        mgr = self.mgrs["sync_self"]
        drop_cache([self.base / "mgr_self"], self.args.drop_caches)
        t0 = time.perf_counter()
        step, state = mgr.restore()
        t = time.perf_counter() - t0
        if step != self.runs["sync_self"]:
            raise AssertionError(f"restored step {step}, expected {self.runs['sync_self']}")
        if check and not same_bits(state["x"][1:], self.buf[1:]):
            raise AssertionError(f"rank {RANK}: restored content differs")
        del state
        sleep_barrier()
        return {"restore": t}

    def m_restore_into(self, check: bool) -> dict[str, float]:
        mgr = self.mgrs["sync_self"]
        self.readbuf.fill(-1.0) if check else None  # (the pages stay faulted in)
        drop_cache([self.base / "mgr_self"], self.args.drop_caches)
        t0 = time.perf_counter()
        step, state = mgr.restore(into={"x": self.readbuf})
        t = time.perf_counter() - t0
        if step != self.runs["sync_self"]:
            raise AssertionError(f"restored step {step}, expected {self.runs['sync_self']}")
        if check and not (
            state["x"] is self.readbuf
            and self.readbuf[0] == step
            and same_bits(self.readbuf[1:], self.buf[1:])
        ):
            raise AssertionError(f"rank {RANK}: content restored into the buffer differs")
        del state
        sleep_barrier()
        return {"restore": t}

    def m_dcp_load(self, check: bool) -> dict[str, float]:
        path = self.latest["dcp_save"]
        self.readbuf.fill(-1.0) if check else None
        drop_cache([path], self.args.drop_caches)
        t0 = time.perf_counter()
        self.peers.dcp.load(self._dcp_state(self.readtensor), checkpoint_id=str(path))
        t = time.perf_counter() - t0
        if check and not same_bits(self.readbuf[1:], self.buf[1:]):
            raise AssertionError(f"rank {RANK}: DCP load content differs")
        sleep_barrier()
        return {"load": t}


# ---------------------------------------------------------------------------- latest among N


def history_bench(root: Path, n: int, runs: int) -> dict[str, Any]:
    """Rank 0 only: latest valid among ``n`` committed checkpoints (library and CLI), in ms."""
    from bench_history import build_root

    from resilient.io.checkpoints import latest_valid
    from resilient.model import filenames as names

    t = time.perf_counter()
    build_root(root, n)
    built_s = time.perf_counter() - t
    exe = Path(sys.executable).with_name("resilient")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "resilient.cli"]
    env = mpi_free_env()

    def ms(fn: Callable[[], object], k: int) -> float:
        fn()  # warm-up
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return 1000 * statistics.median(out)

    def run_cli() -> int:
        p = subprocess.run(
            [*cli, "latest", str(root)], env=env, capture_output=True, text=True, check=False
        )
        if p.returncode != 0:
            raise RuntimeError(f"resilient latest failed ({p.returncode}): {p.stderr.strip()}")
        out = p.stdout.strip()  # the checkpoint's path, .../step_NNNNNNNN
        return int(Path(out).name.removeprefix("step_")) if out else -1

    def measure(label: str) -> dict[str, Any]:
        rec = latest_valid(root)
        with CheckpointManager(root) as m:
            step = m.latest_step()
            lib_mgr = ms(m.latest_step, runs)
        return {
            "case": label,
            "latest_valid_step": None if rec is None else rec.step,
            "latest_step": step,
            "cli_step": run_cli(),
            "latest_valid_ms": ms(lambda: latest_valid(root), runs),
            "latest_step_ms": lib_mgr,
            "cli_ms": ms(run_cli, max(3, runs // 2)),
        }

    rows = [measure("all valid")]
    # the newest 5 corrupt: 3 garbled manifests, 2 truncated data files (a truncated *copy*:
    # the clones hard-link one data file, truncating it in place would hit all of them)
    steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))[-5:]
    undo: list[Callable[[], None]] = []
    try:
        for i, step in enumerate(reversed(steps)):
            d = root / names.step_dir_name(step)
            if i % 2 == 0:
                f = d / names.MANIFEST
                text = f.read_bytes()
                f.write_bytes(text.replace(b'"step"', b'"step" ', 1))
                undo.append(lambda f=f, text=text: f.write_bytes(text))
            else:
                data = next(p for p in d.iterdir() if names.is_data_file_name(p.name))
                keep = d / (data.name + ".orig")
                os.rename(data, keep)
                with open(keep, "rb") as src, open(data, "wb") as dst:
                    dst.write(src.read(max(0, keep.stat().st_size - 100)))
                undo.append(lambda data=data, keep=keep: os.replace(keep, data))
        bad = measure("newest 5 corrupt")
    finally:
        for fn in undo:
            fn()
    rows.append(bad)
    expect = steps[0] - 1
    for key in ("latest_valid_step", "latest_step", "cli_step"):
        if bad[key] != expect:
            raise AssertionError(
                f"with the newest 5 corrupt, {key} = {bad[key]}, expected {expect}"
            )
    return {"n": n, "runs": runs, "build_s": built_s, "cli": " ".join(cli), "rows": rows}


# ---------------------------------------------------------------------------- heat step time


def heat_bench(base: Path, heat_mib: int, cycles: int, baseline_steps: int) -> dict[str, Any]:
    """Step time of apps.heat's loop with and without an async save of its state in flight.

    The field per rank is about ``heat_mib`` MiB. Per cycle: ``baseline_steps`` steps with
    nothing in flight, then ``save(blocking=False)`` of ``{"u": u}`` and steps until ``poll()``
    (collective) says it is committed; then a blocking save of the same state for comparison.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from apps.heat import Domain, advance, initial_state

    cells = heat_mib * (1 << 20) // 8 * SIZE
    nx = ny = int(cells**0.5)
    dom = Domain(COMM, nx, ny)
    state0, static = initial_state(dom)
    u, kappa = state0["u"], static["kappa"]
    root = base / "heat"
    base_steps: list[float] = []
    flight_steps: list[float] = []
    blocked: list[float] = []
    overlapped: list[int] = []
    sync_save: list[float] = []

    def step_timed(u: np.ndarray) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        u = advance(dom, u, kappa, 0.2)
        return u, COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    with CheckpointManager(root, comm=COMM, checkpoint_comm="self", keep=KeepLast(1)) as mgr:
        step = 0
        for cycle in range(cycles + 1):  # cycle 0 is a warm-up
            for _ in range(baseline_steps):
                u, t = step_timed(u)
                step += 1
                if cycle:
                    base_steps.append(t)
            sleep_barrier()
            t0 = time.perf_counter()
            mgr.save(step, {"u": u}, blocking=False)
            tb = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            k = 0
            while True:
                u, t = step_timed(u)
                step += 1
                if cycle:
                    flight_steps.append(t)
                k += 1
                if mgr.poll():
                    break
            if cycle:
                blocked.append(tb)
                overlapped.append(k)
            sleep_barrier()
            t0 = time.perf_counter()
            mgr.save(step, {"u": u})
            ts = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if cycle:
                sync_save.append(ts)
    base_med = statistics.median(base_steps)
    flight_med = statistics.median(flight_steps)
    return {
        "grid": [nx, ny],
        "mib_per_rank": u.nbytes / 2**20,
        "cycles": cycles,
        "baseline_step_s": base_med,
        "in_flight_step_s": flight_med,
        "slowdown": flight_med / base_med,
        "steps_overlapped_median": statistics.median(overlapped),
        "save_blocked_s": statistics.median(blocked),
        "sync_save_s": statistics.median(sync_save),
    }


def app_heat_bench(base: Path, heat_mib: int, runs: int, steps: int, every: int) -> dict[str, Any]:
    """Rank 0 only: ``mpiexec -n SIZE python -m apps.heat`` end to end, per checkpoint setting.

    Settings, interleaved in a shuffled order per round: ``none`` (no checkpoint during the
    run: ``--checkpoint-every`` above ``--steps``; the final checkpoint at the end remains),
    ``sync``, ``async`` (``--async-save``) and ``local`` (``--async-save --local-dir
    /dev/shm/...``), each saving every ``every`` steps. The launched job gets an environment
    without this job's launcher variables (MACHINE.md section 6).
    """
    repo = Path(__file__).resolve().parents[1]
    mpiexec = Path(sys.executable).with_name("mpiexec")
    launcher = str(mpiexec) if mpiexec.exists() else (shutil.which("mpiexec") or "mpiexec")
    n = int((heat_mib * (1 << 20) // 8 * SIZE) ** 0.5)
    env = mpi_free_env()
    shm = Path(tempfile.mkdtemp(prefix="resilient-bench-heat-", dir="/dev/shm"))
    settings: dict[str, list[str]] = {
        "none": ["--checkpoint-every", str(10 * steps)],
        "sync": ["--checkpoint-every", str(every)],
        "async": ["--checkpoint-every", str(every), "--async-save"],
        "local": ["--checkpoint-every", str(every), "--async-save", "--local-dir", str(shm)],
    }
    times: dict[str, list[float]] = {k: [] for k in settings}
    rng = random.Random(7)
    try:
        for rnd in range(runs + 1):  # round 0 is a warm-up
            for name in rng.sample(list(settings), len(settings)):
                work = base / f"app_{name}"
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
                shm.mkdir()
                cmd = [launcher, "-n", str(SIZE), sys.executable, "-m", "apps.heat",
                       "--nx", str(n), "--ny", str(n), "--steps", str(steps),
                       "--checkpoint-comm", "self", "--checkpoint-dir", str(work / "ckpt"),
                       "--out", str(work / "out.h5"), *settings[name]]  # fmt: skip
                t0 = time.perf_counter()
                p = subprocess.run(
                    cmd, cwd=repo, env=env, capture_output=True, text=True, check=False
                )
                t = time.perf_counter() - t0
                if p.returncode != 0:
                    raise RuntimeError(
                        f"apps.heat {name} failed ({p.returncode}): {p.stderr[-2000:]}"
                    )
                if rnd:
                    times[name].append(t)
                shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    saves = steps // every
    none = statistics.median(times["none"])
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {
            "times_s": ts,
            "median_s": med,
            "extra_s": med - none,
            "extra_per_save_s": (med - none) / saves if name != "none" else 0.0,
            "paired_extra_s": statistics.median(
                a - b for a, b in zip(ts, times["none"], strict=True)
            ),
        }
    return {"grid": [n, n], "mib_per_rank": heat_mib, "steps": steps, "every": every,
            "saves": saves, "runs": runs, "rows": rows}  # fmt: skip


def heat_help() -> str:
    """``python -m apps.heat --help`` (to know whether it has ``--async-save``)."""
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "apps.heat", "--help"], cwd=repo, env=mpi_free_env(),
                       capture_output=True, text=True, check=False)  # fmt: skip
    return p.stdout


def idle_barrier() -> None:
    """A barrier for ranks that wait a long time (coarse sleeps: they take no CPU from rank 0)."""
    req = COMM.Ibarrier()
    while not req.Test():
        time.sleep(0.02)


# ---------------------------------------------------------------------------- summary


def summarize(times: dict[str, list[float]], ref: str) -> dict[str, dict[str, Any]]:
    """Per "mode.metric": medians, spread and ratios ``ref_median / median`` (and paired)."""
    out: dict[str, dict[str, Any]] = {}
    for key, ts in times.items():
        med = statistics.median(ts)
        row: dict[str, Any] = {"times_s": ts, "median_s": med, "min_s": min(ts), "max_s": max(ts)}
        if ref in times and key != ref:
            row["ratio"] = statistics.median(times[ref]) / med
            row["paired_ratio"] = statistics.median(
                a / b for a, b in zip(times[ref], ts, strict=True)
            )
        out[key] = row
    return out


def time_ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float]:
    """``median(a) / median(b)`` and the median of per-round ``a / b`` (time multiples)."""
    med = statistics.median(times[a]) / statistics.median(times[b])
    paired = statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
    return med, paired


# (a, b): the time multiples a / b of the side-by-side summary
SIDE_BY_SIDE_RATIOS = (
    ("async.durable", "sync_self.save"),
    ("sync_self.save", "raw.write"),
    ("async.durable", "raw.write"),
    ("sync_self.save", "raw_over.write"),
    ("async.durable", "raw_over.write"),
)


def side_by_side(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The time multiples ``a / b`` of :data:`SIDE_BY_SIDE_RATIOS` measured in this run: ratio
    of the medians, and the median, min and max of the per-round ratios."""
    out = []
    for a, b in SIDE_BY_SIDE_RATIOS:
        if a in times and b in times:
            per_round = [x / y for x, y in zip(times[a], times[b], strict=True)]
            med, paired = time_ratio(times, a, b)
            out.append({"a": a, "b": b, "ratio": med, "paired": paired,
                        "paired_min": min(per_round), "paired_max": max(per_round)})  # fmt: skip
    return out


def print_side_by_side(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print("\nSide by side (time multiples a / b: ratio of medians; per-round median [min-max])\n")
    for r in rows:
        print(f"- {r['a']} / {r['b']}: {r['ratio']:.2f}; per round {r['paired']:.2f} "
              f"[{r['paired_min']:.2f}-{r['paired_max']:.2f}]")  # fmt: skip


def check_targets(
    times: dict[str, list[float]], history: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The brief's targets; each as a time multiple ``a / b`` with a bound (<=) unless noted."""
    out: list[dict[str, Any]] = []

    def add(name: str, a: str, b: str, bound: float, faster: bool = False) -> None:
        if a not in times or b not in times:
            out.append(
                {
                    "target": name,
                    "status": "n/a",
                    "why": f"{a if a not in times else b} not measured",
                }
            )
            return
        med, paired = time_ratio(times, a, b)
        if faster:  # "a >= bound x b" in speed = time(b) / time(a) >= bound
            value, pvalue = 1 / med, 1 / paired
            ok = value >= bound
        else:
            value, pvalue = med, paired
            ok = value <= bound
        out.append({"target": name, "value": value, "paired": pvalue, "bound": bound,
                    "status": "PASS" if ok else "MISS"})  # fmt: skip

    add("async blocked <= 1.5 x memcpy", "async.blocked", "memcpy.copy", 1.5)
    add("async blocked <= 0.5 x DCP async_save blocked", "async.blocked", "dcp_async.blocked", 0.5)
    add(
        "copy=False blocked <= 1.0 x Orbax async blocked",
        "async_nocopy.blocked",
        "orbax_async.blocked",
        1.0,
    )
    add("async durable <= 1.1 x sync save (self)", "async.durable", "sync_self.save", 1.1)
    peers = [f"{p}.durable" for p in SYNC_PEERS if f"{p}.durable" in times]
    if peers:
        best = min(peers, key=lambda k: statistics.median(times[k]))
        add(
            f"sync self speed >= 1.0 x best peer ({best.split('.')[0]})",
            "sync_self.save",
            best,
            1.0,
            faster=True,
        )
    add("sync self speed >= 0.95 x raw", "sync_self.save", "raw.write", 0.95, faster=True)
    add(  # with KeepLast(1) the save writes over the dropped checkpoint's file: this is its limit
        "sync self speed >= 0.95 x raw over an existing file",
        "sync_self.save",
        "raw_over.write",
        0.95,
        faster=True,
    )
    add("local-tier blocked <= 2 x memcpy", "local.blocked", "memcpy.copy", 2.0)
    add("restore speed >= 0.85 x cold read", "restore.restore", "cold_read.read", 0.85, faster=True)
    add(
        "restore into speed >= 0.85 x cold read",
        "restore_into.restore",
        "cold_read.read",
        0.85,
        faster=True,
    )
    if history:
        for row in history["rows"]:
            for key, bound, what in (("latest_valid_ms", 50, "validate.latest_valid"),
                                     ("latest_step_ms", 50, "latest_step()"),
                                     ("cli_ms", 300, "resilient latest (CLI)")):  # fmt: skip
                v = row[key]
                out.append({"target": f"{what}, N={history['n']}, {row['case']}: < {bound} ms",
                            "value": v, "bound": bound, "unit": "ms",
                            "status": "PASS" if v < bound else "MISS"})  # fmt: skip
    return out


def print_table(
    title: str, rows: dict[str, dict[str, Any]], total: int, ref: str, what: dict[str, str]
) -> None:
    print(f"\n{title}\n")
    print(f"| mode.metric | median s | min s | max s | GB/s | speed vs {ref} (paired) | what |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for key, r in rows.items():
        ratio = f"{r['ratio']:.2f} ({r['paired_ratio']:.2f})" if "ratio" in r else "-"
        print(f"| {key} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} "
              f"| {total / r['median_s'] / 1e9:.2f} | {ratio} | {what.get(key.split('.')[0], '')} |")  # fmt: skip


def print_targets(targets: list[dict[str, Any]]) -> None:
    print(
        "\nTargets (time multiples a/b unless 'speed'; ratio of medians, paired = median of per-round ratios):\n"
    )
    for t in targets:
        if t["status"] == "n/a":
            print(f"- {t['target']}: n/a ({t['why']})")
        elif t.get("unit") == "ms":
            print(f"- {t['target']}: {t['value']:.1f} ms -> {t['status']}")
        else:
            print(f"- {t['target']}: {t['value']:.2f} (paired {t['paired']:.2f}) -> {t['status']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--mib", type=int, default=128, help="MiB of float64 per rank (default 128)")
    p.add_argument("--runs", type=int, default=5, help="timed rounds after the warm-up (default 5)")
    p.add_argument(
        "--dir", default=None, help="parent of the fresh temporary directory (default /tmp)"
    )
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--seed", type=int, default=1, help="seed of the per-round mode order")
    p.add_argument(
        "--modes", default=None, help="comma-separated subset of the modes (default all)"
    )
    p.add_argument("--list", action="store_true", help="print the modes and exit")
    p.add_argument("--side-by-side", action="store_true",
                   help=f"only the modes {','.join(SIDE_BY_SIDE)} (unless --modes), nothing after "
                        "the rounds (--no-heat --history-n 0 --heat-app-runs 0): the async save "
                        "until durable against the sync save, in one run")  # fmt: skip
    p.add_argument("--drop-caches", action="store_true",
                   help="cold reads via 'echo 3 > /proc/sys/vm/drop_caches' (root) instead of "
                        "posix_fadvise(DONTNEED) on the files read")  # fmt: skip
    p.add_argument(
        "--history-n", type=int, default=10_000, help="checkpoints for 'latest' (0: skip)"
    )
    p.add_argument("--history-root", default=None, help="keep/reuse the N-checkpoint root here")
    p.add_argument("--history-runs", type=int, default=15, help="repetitions per 'latest' figure")
    p.add_argument("--no-heat", action="store_true", help="skip the heat-app step-time measurement")
    p.add_argument("--heat-mib", type=int, default=64, help="heat field MiB per rank (default 64)")
    p.add_argument("--heat-cycles", type=int, default=5, help="save cycles in the heat measurement")
    p.add_argument("--heat-app-runs", type=int, default=3,
                   help="rounds of the end-to-end apps.heat runs (0: skip)")  # fmt: skip
    p.add_argument("--heat-app-steps", type=int, default=40, help="steps of each apps.heat run")
    p.add_argument("--heat-app-every", type=int, default=5, help="apps.heat --checkpoint-every")
    args = p.parse_args(argv)
    if args.side_by_side:
        args.modes = args.modes or ",".join(SIDE_BY_SIDE)
        args.no_heat, args.history_n, args.heat_app_runs = True, 0, 0
    if args.mib < 1 or args.runs < 1:
        p.error("--mib and --runs must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        if RANK == 0:
            for m, (group, metrics, what) in MODES.items():
                print(f"{m:13s} {group:5s} {','.join(metrics):16s} {what}")
        return 0
    wanted = list(MODES) if args.modes is None else [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in wanted if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes: {unknown}")
    # reads need what they read
    for read, src in (
        ("cold_read", "raw"),
        ("cold_read_fresh", "raw"),
        ("restore", "sync_self"),
        ("restore_into", "sync_self"),
        ("dcp_load", "dcp_save"),
    ):
        if read in wanted and src not in wanted:
            wanted.append(src)
    peers = Peers(set(wanted))
    skipped = {
        m: peers.notes.get(NEEDS[m], "") for m in wanted if m in NEEDS and not peers.ok[NEEDS[m]]
    }
    modes = [m for m in wanted if m not in skipped]

    base: Path | None = None
    if RANK == 0:
        base = Path(tempfile.mkdtemp(prefix="resilient-bench-async-", dir=args.dir))
    revision = library_revision() if RANK == 0 else ""
    base = COMM.bcast(base, root=0)
    assert base is not None
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    history: dict[str, Any] | None = None
    heat: dict[str, Any] | None = None
    heat_note = ""
    bench: Bench | None = None
    try:
        bench = Bench(base, args, peers, modes)
        # warm-up, untimed, with content checks; writes first: a read needs its source's output
        for mode in sorted(modes, key=lambda m: MODES[m][0] == "read"):
            bench.run(mode, check=True)
        rng = random.Random(args.seed)  # same sequence on every rank: no communication needed
        times: dict[str, list[float]] = {}
        for rnd in range(args.runs):
            order = rng.sample(modes, len(modes))
            for mode in order:
                local = bench.run(mode)
                keys = sorted(local)
                worst = allreduce_list([local[k] for k in keys], MPI.MAX)
                for k, v in zip(keys, worst, strict=True):
                    times.setdefault(f"{mode}.{k}", []).append(v)
            if RANK == 0:
                line = " ".join(f"{m}={times[f'{m}.{MODES[m][1][0]}'][-1]:.3f}" for m in order)
                print(f"round {rnd + 1}/{args.runs}: {line}", file=sys.stderr, flush=True)
        disk = dict(bench.disk_bytes)
        inodes = {m: len(found) / max(bench.files[m], 1) for m, found in bench.inodes.items()}
        saves = {m: bench.runs[m] for m in inodes}
        bench.close()
        bench = None
        if args.history_n > 0:
            if RANK == 0:
                hroot = Path(args.history_root) if args.history_root else base / "history"
                history = history_bench(hroot, args.history_n, args.history_runs)
            sleep_barrier()
        app_ok = COMM.bcast(
            RANK == 0 and args.heat_app_runs > 0 and "--async-save" in heat_help(), root=0
        )
        if args.no_heat:
            heat_note = "skipped (--no-heat)"
        elif not HAS_ASYNC:
            heat_note = "not measured: the library has no async save (save(blocking=False)) yet"
        else:
            heat = heat_bench(base, args.heat_mib, args.heat_cycles, baseline_steps=5)
            if RANK == 0 and app_ok:
                heat["app"] = app_heat_bench(
                    base,
                    args.heat_mib,
                    args.heat_app_runs,
                    args.heat_app_steps,
                    args.heat_app_every,
                )
            idle_barrier()
    except BaseException:  # no collective on the error path: any failing rank cleans up
        if RANK == 0:
            shutil.rmtree(base, ignore_errors=True)
        raise
    sleep_barrier()
    if RANK == 0:
        shutil.rmtree(base, ignore_errors=True)
    if RANK != 0:
        return 0

    total = SIZE * args.mib * (1 << 20)
    order = list(times)
    key_order = [f"{m}.{k}" for m in MODES for k in MODES[m][1] if f"{m}.{k}" in times]
    assert sorted(order) == sorted(key_order)
    wtimes = {k: times[k] for k in key_order if MODES[k.split(".")[0]][0] == "write"}
    rtimes = {k: times[k] for k in key_order if MODES[k.split(".")[0]][0] == "read"}
    writes = summarize(wtimes, "raw.write")
    reads = summarize(rtimes, "cold_read.read")
    targets = check_targets(times, history)
    load_after = os.getloadavg()
    mpi_library = " ".join(MPI.Get_library_version().split()[:3])
    what = {m: v[2] for m, v in MODES.items()}

    print(f"\n# bench_async: {SIZE} ranks x {args.mib} MiB float64 = {total / 2**30:.2f} GiB, "
          f"{args.runs} rounds after 1 warm-up, {started:%Y-%m-%d %H:%M} UTC")  # fmt: skip
    print(f"host {platform.node()}, {os.cpu_count()} CPUs, dir {base.parent}, "
          f"resilient {resilient.__version__} ({revision}), mpi {mpi_library}; "
          f"loadavg before {load_before[0]:.2f}, after {load_after[0]:.2f}; cold reads via "
          f"{'drop_caches' if args.drop_caches else 'posix_fadvise(DONTNEED)'}")  # fmt: skip
    for name, note in peers.notes.items():
        print(f"- {name}: {note}")
    for m, why in skipped.items():
        print(f"- skipped {m}: {why}")
    print_table("Writes (time = max over ranks; speed = raw median / median; blocked = time until "
                "the call returns)", writes, total, "raw", what)  # fmt: skip
    print_table("Reads, cold page cache", reads, total, "cold_read", what)
    nbytes = args.mib * (1 << 20)
    print(f"\nBytes on disk of one output (rank 0's; DCP: all ranks') / one rank's buffer ({nbytes}): "
          + ", ".join(f"{m} {b / nbytes:.3f}" for m, b in disk.items()))  # fmt: skip
    if history:
        print(f"\nNewest valid among N = {history['n']} committed checkpoints "
              f"(rank 0, median of {history['runs']}, ms; root built in {history['build_s']:.1f} s)\n")  # fmt: skip
        print(
            "| case | newest valid | validate.latest_valid | CheckpointManager.latest_step | `resilient latest` |"
        )
        print("|---|---:|---:|---:|---:|")
        for r in history["rows"]:
            print(f"| {r['case']} | {r['latest_valid_step']} | {r['latest_valid_ms']:.1f} "
                  f"| {r['latest_step_ms']:.1f} | {r['cli_ms']:.0f} |")  # fmt: skip
    if heat:
        print(f"\nHeat loop (apps.heat.advance, grid {heat['grid'][0]}x{heat['grid'][1]}, "
              f"{heat['mib_per_rank']:.0f} MiB per rank, {heat['cycles']} save cycles): step "
              f"{heat['baseline_step_s'] * 1000:.1f} ms without a save in flight, "
              f"{heat['in_flight_step_s'] * 1000:.1f} ms with one (x{heat['slowdown']:.2f}), "
              f"{heat['steps_overlapped_median']} steps per save; save(blocking=False) blocks "
              f"{heat['save_blocked_s'] * 1000:.1f} ms, a blocking save takes "
              f"{heat['sync_save_s'] * 1000:.1f} ms")  # fmt: skip
        app = heat.get("app")
        if app:
            print(f"\napps.heat end to end (mpiexec -n {SIZE}, grid {app['grid'][0]}x{app['grid'][1]}, "
                  f"{app['steps']} steps, a save every {app['every']} = {app['saves']} saves + the final "
                  f"one, median of {app['runs']} runs, s)\n")  # fmt: skip
            print("| setting | wall s | min | max | extra vs none s (paired) | extra per save s |")
            print("|---|---:|---:|---:|---:|---:|")
            for name, r in app["rows"].items():
                print(f"| {name} | {r['median_s']:.2f} | {min(r['times_s']):.2f} | {max(r['times_s']):.2f} "
                      f"| {r['extra_s']:.2f} ({r['paired_extra_s']:.2f}) | {r['extra_per_save_s']:.3f} |")  # fmt: skip
    else:
        print(f"\nHeat loop: {heat_note}")
    side = side_by_side(times)
    print_side_by_side(side)
    if inodes:
        print("\nInodes per data file over a manager's saves (2: each save wrote over the files "
              "rotation dropped; one per save: new files): "
              + ", ".join(f"{m} {n:g} over {saves[m]} saves" for m, n in inodes.items()))  # fmt: skip
    print_targets(targets)
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
            "cold_reads": "drop_caches" if args.drop_caches else "posix_fadvise(DONTNEED)",
            "peers": peers.notes,
            "skipped": skipped,
            "modes": {
                m: {"group": g, "metrics": list(k), "what": w} for m, (g, k, w) in MODES.items()
            },
            "writes": writes,
            "reads": reads,
            "disk_bytes_rank0": disk,
            "history": history,
            "heat": heat if heat else heat_note,
            "targets": targets,
            "side_by_side": side,
            "data_file_inodes": inodes,
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
