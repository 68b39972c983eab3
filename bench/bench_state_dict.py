"""Many arrays and real PyTorch state dicts: ``resilient`` against the disk and against peers.

Run (one process; torch and the DCP rows need ``pip install 'resilient-hpc[bench]'``)::

    python bench/bench_state_dict.py [--runs 7] [--cases many4k,many64k,model] [--json PATH]
                                     [--dir DIR] [--model-width 512] [--model-layers 6]

Cases:

* ``many4k``: 4,000 float64 arrays of 4 KiB (16 MiB); ``many64k``: 1,000 of 64 KiB (62 MiB).
  The cost of these is per array, not per byte (issue 10's targets: save >= 0.5x and >= 0.8x
  the raw write, the first save of the structure included; restore within 1.5x of a raw read).
* ``model``: a real state dict, ``{"model": ..., "optim": ...}`` of a transformer encoder
  (``--model-layers`` layers of width ``--model-width``) after one AdamW step: hundreds of
  tensors of every size, int keys in the optimizer state, 0-d ``step`` tensors.

Modes of every case (timed from the call to the data being durable, fsync included):

* ``raw``: the same bytes, concatenated, in one file: one ``write`` + ``fsync`` (the limit);
* ``raw_paced``: the same, written 2 MiB at a time, each piece's writeback started at once
  (``sync_file_range``), then ``fsync``: the I/O pattern ``resilient`` uses, on raw bytes. It
  is faster than ``raw`` here (the disk works while the next piece is copied), so a save can
  beat ``raw``; the ratios stay against ``raw``, the limit the issue names, and this row shows
  how far the same pattern alone goes;
* ``first``: ``CheckpointManager.save`` of a structure it has never seen (a fresh root, and
  every key renamed: nothing of the structure is cached in the process);
* ``save``: a later save of the same structure (the skeleton reused); no rotation in the timed
  saves (older checkpoints are removed between modes, as ``raw`` removes its file untimed);
* ``async``: ``save(blocking=False)``: ``blocked`` is the time the call held the program,
  ``durable`` the time until ``wait()`` returned;
* ``torch_save`` (``model``): ``torch.save`` to a file + ``fsync``;
* ``dcp_save``, ``dcp_async`` (``model``): ``torch.distributed.checkpoint.save`` /
  ``async_save`` in a one-process gloo group, then ``fsync`` of its files;
* reads, with the files in the page cache (warm): ``raw_read`` (the same bytes into a reused
  buffer: the limit of reading into existing memory), ``raw_read_new`` (the same bytes into a
  newly allocated buffer, dropped after the timer: the limit of reading into new memory),
  ``restore`` (new arrays/tensors), ``restore_into`` (into the existing state:
  ``restore(into=...)``), ``torch_load``, ``dcp_load`` (into the existing state). Each
  read's files are read once, untimed, just before it: ``resilient`` writes arrays of 1 MiB or
  more with ``O_DIRECT``, which leaves them out of the page cache, so a restore right after a
  save would otherwise read from the disk while ``torch.load`` reads from memory.

The peers' rows (``torch_*``, ``dcp_*``) run for ``model`` when torch is installed, and with
``--peers`` for the ``many*`` cases too, saving and loading the same arrays as CPU tensors
(``torch.from_numpy``: the same memory). They are off there by default: torch and DCP in the
same process slow the other rows down (memory churn, DCP's threads), and the ``many*`` targets
are measured without them.

Each round runs every mode once in a shuffled order (seeded); one untimed warm-up round checks
the contents. Reported: medians (min, max) and ratios to ``raw`` (writes) and ``raw_read``
(reads) of the same run; the reads into new memory (``restore``, ``torch_load``) also against
``raw_read_new``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# ruff: noqa: E402  (single-threaded numerics before numpy/torch are imported)
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np
from benchutil import fsync_tree, library_revision, start_writeback, write_json

from resilient import CheckpointManager

WRITES = ("raw", "raw_paced", "first", "save", "async", "torch_save", "dcp_save", "dcp_async")
PACE = 2 << 20
READS = ("raw_read", "raw_read_new", "restore", "restore_into", "torch_load", "dcp_load")
PEERS = ("torch_save", "dcp_save", "dcp_async", "torch_load", "dcp_load")
NEW_MEMORY = ("restore", "torch_load")  # reads that return new arrays: also against raw_read_new


def leaves(state: Any) -> list[Any]:
    """Every array/tensor leaf of a nested state, in order."""
    if isinstance(state, dict):
        return [x for v in state.values() for x in leaves(v)]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in leaves(v)]
    return [state] if hasattr(state, "shape") else []


def as_bytes(leaf: Any) -> bytes:
    if hasattr(leaf, "detach"):  # torch
        import torch

        t = leaf.detach().contiguous().reshape(-1)
        return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""
    return bytes(np.ascontiguousarray(leaf).view(np.uint8))


def as_tensors(state: Any) -> Any:
    """``state`` with its numpy leaves as CPU tensors sharing their memory (for the peers)."""
    import torch

    if isinstance(state, dict):
        return {k: as_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [as_tensors(v) for v in state]
    return torch.from_numpy(state) if isinstance(state, np.ndarray) else state


def renamed(state: Any, suffix: str) -> Any:
    """``state`` with ``suffix`` appended to every string key (the same leaves)."""
    if isinstance(state, dict):
        return {
            k + suffix if isinstance(k, str) else k: renamed(v, suffix) for k, v in state.items()
        }
    if isinstance(state, list):
        return [renamed(v, suffix) for v in state]
    return state


def same(a: Any, b: Any) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        as_bytes(x) == as_bytes(y) for x, y in zip(la, lb, strict=True)
    )


def many_state(count: int, kib: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"model": {f"layer{i}.weight": rng.random(kib * 128) for i in range(count)}}


def model_state(width: int, layers: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, width),
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(width, 1000),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 1000, (4, 16))
    model(x).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


class Case:
    """One state, its reference buffers and its targets on disk."""

    def __init__(self, base: Path, name: str, state: dict[str, Any], modes: Sequence[str]) -> None:
        self.base, self.name, self.state, self.modes = base, name, state, list(modes)
        # what the peers save and load: the state, its numpy leaves as tensors of the same memory
        self.peer_state = as_tensors(state) if any(m in PEERS for m in modes) else state
        self.flat = np.concatenate([np.frombuffer(as_bytes(x), np.uint8) for x in leaves(state)])
        self.readbuf = np.empty_like(self.flat)
        self.raw_path = base / f"{name}.raw"
        # no rotation in the timed saves: like ``raw``, which removes its previous file before
        # its timer starts, older checkpoints are removed between modes (see ``prune``)
        self.mgr = CheckpointManager(base / f"{name}.mgr")
        self.amgr = CheckpointManager(base / f"{name}.async")
        self.step = 0
        self.fresh = 0
        self.dcp_dir = base / f"{name}.dcp"
        self.torch_path = base / f"{name}.pt"

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)

    def close(self) -> None:
        self.mgr.close()
        self.amgr.close()

    def run(self, mode: str, check: bool) -> dict[str, float]:
        fn: Callable[[bool], dict[str, float]] = getattr(self, f"m_{mode}")
        self.prune()
        if mode in READS:
            self.warm(mode)
        return fn(check)

    def warm(self, mode: str) -> None:
        """Read the files that ``mode`` reads once, so that it finds them in the page cache."""
        newest = sorted((self.base / f"{self.name}.mgr").glob("step_*"))[-1:]
        paths = {
            "raw_read": [self.raw_path],
            "raw_read_new": [self.raw_path],
            "restore": newest,
            "restore_into": newest,
            "torch_load": [self.torch_path],
            "dcp_load": [self.dcp_dir],
        }[mode]
        for path in paths:
            for f in (
                [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            ):
                with open(f, "rb") as src:
                    while src.readinto(self.readbuf):
                        pass

    def m_raw(self, check: bool) -> dict[str, float]:
        return self.raw_write(paced=False)

    def m_raw_paced(self, check: bool) -> dict[str, float]:
        return self.raw_write(paced=True)

    def raw_write(self, *, paced: bool) -> dict[str, float]:
        """The same bytes in one new file, then fsync: in one write, or ``paced`` (PACE bytes at
        a time, each piece's writeback started at once)."""
        self.raw_path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        fd = os.open(self.raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, pos = memoryview(self.flat), 0
            while pos < len(view):
                n = os.pwrite(fd, view[pos : pos + PACE] if paced else view[pos:], pos)
                if paced:
                    start_writeback(fd, pos, n)
                pos += n
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"durable": time.perf_counter() - t0}

    def m_first(self, check: bool) -> dict[str, float]:
        self.fresh += 1
        root = self.base / f"{self.name}.first{self.fresh}"
        mgr = CheckpointManager(root)
        # every key renamed: a structure this process has never seen (nothing of it cached)
        state = renamed(self.state, f".{self.fresh}")
        t0 = time.perf_counter()
        mgr.save(0, state)
        t = time.perf_counter() - t0
        mgr.close()
        shutil.rmtree(root)
        return {"durable": t}

    def prune(self) -> None:
        """Remove every checkpoint but the newest of both managers (outside any timer)."""
        for root in (self.base / f"{self.name}.mgr", self.base / f"{self.name}.async"):
            steps = sorted(root.glob("step_*"))
            for old in steps[:-1]:
                shutil.rmtree(old)

    def m_save(self, check: bool) -> dict[str, float]:
        self.step += 1
        t0 = time.perf_counter()
        self.mgr.save(self.step, self.state)
        return {"durable": time.perf_counter() - t0}

    def m_async(self, check: bool) -> dict[str, float]:
        self.step += 1
        t0 = time.perf_counter()
        self.amgr.save(self.step, self.state, blocking=False)
        t1 = time.perf_counter()
        self.amgr.wait()
        return {"blocked": t1 - t0, "durable": time.perf_counter() - t0}

    def m_torch_save(self, check: bool) -> dict[str, float]:
        import torch

        self.torch_path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        torch.save(self.peer_state, self.torch_path)
        fsync_tree(self.torch_path)
        return {"durable": time.perf_counter() - t0}

    def m_dcp_save(self, check: bool) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(self.dcp_dir, ignore_errors=True)
        t0 = time.perf_counter()
        dcp.save(self.peer_state, checkpoint_id=str(self.dcp_dir))
        fsync_tree(self.dcp_dir)
        return {"durable": time.perf_counter() - t0}

    def m_dcp_async(self, check: bool) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        target = self.base / f"{self.name}.dcpa"
        shutil.rmtree(target, ignore_errors=True)
        t0 = time.perf_counter()
        fut = dcp.async_save(self.peer_state, checkpoint_id=str(target))
        t1 = time.perf_counter()
        fut.result()
        fsync_tree(target)
        return {"blocked": t1 - t0, "durable": time.perf_counter() - t0}

    def m_raw_read(self, check: bool) -> dict[str, float]:
        return self.raw_read(lambda: self.readbuf, check)

    def m_raw_read_new(self, check: bool) -> dict[str, float]:
        return self.raw_read(lambda: np.empty_like(self.flat), check)

    def raw_read(self, buffer: Callable[[], np.ndarray], check: bool) -> dict[str, float]:
        """The raw file read with ``preadv`` into ``buffer()`` (got inside the timer)."""
        t0 = time.perf_counter()
        buf = buffer()
        fd = os.open(self.raw_path, os.O_RDONLY)
        try:
            view, pos = memoryview(buf), 0
            while pos < len(view):
                pos += os.preadv(fd, [view[pos:]], pos)
        finally:
            os.close(fd)
        t = time.perf_counter() - t0
        if check and not np.array_equal(buf, self.flat):
            raise AssertionError("raw read differs")
        return {"read": t}

    def m_restore(self, check: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        _, got = self.mgr.restore()
        t = time.perf_counter() - t0
        if check and not same(got, self.state):
            raise AssertionError(f"{self.name}: restore differs")
        return {"read": t}

    def m_restore_into(self, check: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        _, got = self.mgr.restore(into=self.state)
        t = time.perf_counter() - t0
        if check and not same(got, self.state):
            raise AssertionError(f"{self.name}: restore into differs")
        return {"read": t}

    def m_torch_load(self, check: bool) -> dict[str, float]:
        import torch

        t0 = time.perf_counter()
        got = torch.load(self.torch_path, weights_only=True)
        t = time.perf_counter() - t0
        if check and not same(got, self.state):
            raise AssertionError("torch.load differs")
        return {"read": t}

    def m_dcp_load(self, check: bool) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.load(self.peer_state, checkpoint_id=str(self.dcp_dir))  # in place, like restore_into
        return {"read": time.perf_counter() - t0}


def init_torch_group(base: Path) -> None:
    """A one-process gloo group (DCP's async_save wants one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(str(base / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def bench_case(case: Case, runs: int, seed: int) -> dict[str, Any]:
    order = [m for m in WRITES + READS if m in case.modes]
    for mode in order:  # warm-up with content checks; writes first so that reads find files
        case.run(mode, check=True)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in order}
    rng = random.Random(seed)
    for _ in range(runs):
        writes = [m for m in order if m in WRITES]
        reads = [m for m in order if m in READS]
        rng.shuffle(writes)
        rng.shuffle(reads)
        for mode in writes + reads:
            for key, value in case.run(mode, check=False).items():
                times[mode].setdefault(key, []).append(value)
    return {m: {k: summary(v) for k, v in t.items()} for m, t in times.items()}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_case(name: str, count: int, nbytes: int, res: dict[str, Any]) -> None:
    print(f"\n== {name}: {count} arrays, {nbytes / 2**20:.1f} MiB (medians; ratio = limit / mode)")
    raw = res["raw"]["durable"]["median"]
    rread = res.get("raw_read", {}).get("read", {}).get("median")
    rnew = res.get("raw_read_new", {}).get("read", {}).get("median")
    for mode, vals in res.items():
        for key, s in vals.items():
            ref = rread if key == "read" else raw
            ratio = f"{ref / s['median']:.2f}x" if ref else "-"
            slow = f"{s['median'] / ref:.2f}x the limit" if ref else ""
            if mode in NEW_MEMORY and rnew:
                slow += f", {s['median'] / rnew:.2f}x raw_read_new"
            print(
                f"  {mode:13s} {key:8s} {s['median'] * 1e3:9.1f} ms"
                f"  ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})  speed {ratio:>6s}  {slow}"
            )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--cases", default="many4k,many64k,model", help="comma-separated cases")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--model-width", type=int, default=512)
    p.add_argument("--model-layers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--peers",
        action="store_true",
        help="the peers' rows for the many* cases too (torch and DCP in the same process make\n"
        "the other rows of those cases slower: measure the targets without them)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="bench-sd-", dir=args.dir))
    results: dict[str, Any] = {"library": library_revision(), "runs": args.runs, "cases": {}}
    print(f"resilient {results['library']}, {args.runs} rounds, in {base}")
    try:
        for name in args.cases.split(","):
            torch_here = importlib.util.find_spec("torch") is not None
            modes: Sequence[str] = WRITES + READS
            if not torch_here or (name != "model" and not args.peers):
                modes = [m for m in modes if m not in PEERS]
            else:  # torch only in a process that runs the peers
                init_torch_group(base)
            if name == "model":
                if not torch_here:
                    print("\n== model: skipped (torch is not installed)")
                    continue
                state = model_state(args.model_width, args.model_layers)
            else:
                count, kib = {"many4k": (4000, 4), "many64k": (1000, 64)}[name]
                state = many_state(count, kib)
            case = Case(base, name, state, modes)
            try:
                res = bench_case(case, args.runs, args.seed)
            finally:
                case.close()
            count = len(leaves(state))
            results["cases"][name] = {"arrays": count, "bytes": case.nbytes, "modes": res}
            print_case(name, count, case.nbytes, res)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
