"""CUDA training state: ``resilient`` against the copy engine's and the disk's floors and its peers.

Run (one process, one GPU; torch with CUDA)::

    python bench/bench_gpu.py [--gib 4] [--tensors 64] [--runs 3] [--dir DIR] [--json PATH]
                              [--no-dcp]

The state: ``--tensors`` CUDA tensors on ``cuda:0`` of ``--gib`` GiB in all, half float32, half
bfloat16. Every row is the median of ``--runs`` rounds; every save is fsynced; before every
read the files are evicted from the page cache (``/proc/sys/vm/drop_caches`` as root, else
``POSIX_FADV_DONTNEED`` per file: weaker, said in the output). Rows (issue 36's table):

* floors: ``d2h_pinned`` (a device-to-host copy into pinned buffers allocated once, the least a
  save must block for), ``cpu`` (``tensor.cpu()`` of every tensor), ``raw_write`` (the bytes
  written to one file + fsync), ``raw_read_h2d`` (a cold read of that file into pinned memory +
  the host-to-device copy: a restore's floor);
* ``resilient``: ``async_blocked`` / ``async_durable`` (``save(blocking=False)`` until it returns
  / until ``wait()`` returns), its first save (the pinned arena allocated) apart, ``sync_save``,
  ``restore_into`` (``restore(into=`` the CUDA state``)``), ``restore`` (new tensors);
* peers: ``torch_save`` / ``torch_load`` (``map_location="cuda:0"``), ``dcp_save``,
  ``dcp_async_blocked`` / ``dcp_async_durable``, ``dcp_load`` (into the CUDA state).

Without a CUDA device it exits at once, saying so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchutil import files_under, fsync_tree, write_json


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=4.0, help="state size in GiB (default 4)")
    p.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    p.add_argument("--runs", type=int, default=3, help="rounds per row; the median is shown")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    args = p.parse_args(argv)
    if args.gib <= 0 or args.tensors <= 0 or args.runs <= 0:
        p.error("--gib, --tensors and --runs must be positive")
    return args


def cuda_missing() -> str | None:
    """Why this benchmark cannot run here, or ``None``."""
    try:
        import torch
    except ImportError:
        return "bench_gpu.py needs PyTorch (pip install 'resilient-hpc[torch]')"
    if not torch.cuda.is_available():
        return "bench_gpu.py needs a CUDA device: torch.cuda.is_available() is false here"
    return None


def evict(root: Path) -> str:
    """Drop ``root``'s files from the page cache; how."""
    os.sync()
    if os.geteuid() == 0:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    for p in files_under(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def timed(fn: Callable[[], Any]) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Bench:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        import torch

        self.args, self.base, self.torch = args, base, torch
        per = int(args.gib * (1 << 30)) // args.tensors // 4 * 4
        self.state = {
            f"t{i:03d}": torch.randn(per // 4, device="cuda:0").to(
                torch.float32 if i % 2 == 0 else torch.bfloat16
            )
            for i in range(args.tensors)
        }
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.pinned = {
            k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in self.state.items()
        }
        self.rows: dict[str, list[float]] = {}
        self.evicted = ""

    def add(self, name: str, seconds: float) -> None:
        self.rows.setdefault(name, []).append(seconds)

    def fresh(self, name: str) -> Path:
        path = self.base / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def floors(self) -> None:
        torch = self.torch

        def d2h() -> None:
            for k, t in self.state.items():
                self.pinned[k].copy_(t, non_blocking=True)

        self.add("d2h_pinned", timed(d2h))
        self.add("cpu", timed(lambda: [t.cpu() for t in self.state.values()]))
        raw = self.fresh("raw") / "raw.bin"

        def write() -> None:
            with open(raw, "wb") as f:
                for h in self.pinned.values():
                    f.write(h.view(torch.uint8).numpy())
                f.flush()
                os.fsync(f.fileno())

        self.add("raw_write", timed(write))
        self.evicted = evict(raw.parent)

        def read_h2d() -> None:
            with open(raw, "rb", buffering=0) as f:
                for k, h in self.pinned.items():
                    f.readinto(h.view(torch.uint8).numpy())
                    self.state[k].copy_(h, non_blocking=True)

        self.add("raw_read_h2d", timed(read_h2d))

    def library(self, first: bool) -> None:
        from resilient import CheckpointManager

        root = self.fresh("resilient")
        with CheckpointManager(root) as m:
            blocked = timed(lambda: m.save(1, self.state, blocking=False))
            durable = blocked + timed(m.wait)
            if first:
                self.add("first_async_blocked", blocked)
                self.add("first_async_durable", durable)
                blocked = timed(lambda: m.save(2, self.state, blocking=False))
                durable = blocked + timed(m.wait)
            self.add("async_blocked", blocked)
            self.add("async_durable", durable)
            self.add("sync_save", timed(lambda: m.save(3, self.state)))
            evict(root)
            self.add("restore_into", timed(lambda: m.restore(into=self.state)))
            evict(root)
            self.add("restore", timed(m.restore))

    def peers(self) -> None:
        torch = self.torch
        path = self.fresh("torch") / "state.pt"

        def save() -> None:
            torch.save(self.state, path)
            fsync_tree(path.parent)

        self.add("torch_save", timed(save))
        evict(path.parent)
        self.add("torch_load", timed(lambda: torch.load(path, map_location="cuda:0")))
        if self.args.no_dcp:
            return
        import torch.distributed.checkpoint as dcp

        where = self.fresh("dcp")

        def dcp_save() -> None:
            dcp.save(self.state, checkpoint_id=where)
            fsync_tree(where)

        self.add("dcp_save", timed(dcp_save))
        evict(where)
        self.add("dcp_load", timed(lambda: dcp.load(self.state, checkpoint_id=where)))
        where = self.fresh("dcp_async")
        t0 = time.perf_counter()
        future = dcp.async_save(self.state, checkpoint_id=where)
        self.add("dcp_async_blocked", time.perf_counter() - t0)
        future.result()
        fsync_tree(where)
        self.add("dcp_async_durable", time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    why = cuda_missing()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench_gpu."))
    bench = Bench(args, base)
    try:
        for i in range(args.runs):
            bench.floors()
            bench.library(first=i == 0)
            bench.peers()
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    gib = bench.nbytes / (1 << 30)
    print(f"{args.tensors} CUDA tensors, {gib:.2f} GiB, medians of {args.runs}; "
          f"page cache evicted by {bench.evicted}")  # fmt: skip
    print("| what | s | x d2h_pinned |\n|---|---|---|")
    floor = statistics.median(bench.rows["d2h_pinned"])
    medians = {k: statistics.median(v) for k, v in bench.rows.items()}
    for name, s in medians.items():
        print(f"| {name} | {s:.3f} | {s / floor:.1f} |")
    write_json(args.json, {"nbytes": bench.nbytes, "runs": bench.rows, "medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
