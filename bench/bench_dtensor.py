"""A sharded FSDP2 state (DTensors): ``resilient`` against PyTorch DCP, saved on 4 ranks and
restored on 4, 2 and 3 (issue 47's performance table).

Run (CPU, gloo; the script starts its ranks itself, one process each)::

    python bench/bench_dtensor.py [--gib 1.0] [--runs 3] [--saved 4] [--to 2,3]
                                  [--evict auto|drop_caches|fadvise] [--dir DIR] [--json PATH]
    python bench/bench_dtensor.py --quick      # tiny: 2 ranks save, 1 restores, one run,
                                               # no warm-up (tests/unit/test_bench_dtensor.py)

The state: an MLP of ``Linear(W, W)`` layers (``W`` = 2048; as many layers as ``--gib`` needs)
under ``fully_shard`` over a 1-D CPU mesh of the ranks, after one AdamW step;
what is saved is ``get_model_state_dict`` and ``get_optimizer_state_dict`` (sharded: DTensors
``Shard(0)``, uneven on 3 ranks; the optimizer's ``step`` counts plain tensors): float32
parameters, ``exp_avg`` and ``exp_avg_sq``, 12 bytes per parameter.

One run is three launches, each with every operation barrier-fenced and timed as the slowest
rank's (wall time of the collective):

1. ``--saved`` ranks (default 4): ``raw_write`` (each rank's local bytes, one new file, fsync:
   the limit of a save), ``resilient_save`` (``CheckpointManager(comm=dist.group.WORLD)
   .save``, a new checkpoint directory), ``dcp_save`` (``dcp.save``, its files fsynced by DCP,
   ``sync_files=True``, the default; the directory by the bench); then, on the same mesh,
   ``raw_read`` (each rank's file, cold, into a prefaulted buffer: the limit of a restore),
   ``resilient_restore`` (``restore(into=`` a template of this run's DTensors``)``) and
   ``dcp_load`` (``dcp.load`` in place);
2. and 3. each count in ``--to`` (default 2 and 3): a new FSDP2 model of that many ranks (one
   AdamW step, so that its optimizer state exists), the same three reads of the checkpoint the
   first launch wrote (``raw_read``: the number of bytes each rank's new shards need, read
   cold from the saved ranks' raw files, consecutively).

Before each timed operation the cyclic garbage collector makes a full pass (untimed: see
``Rank.fenced``). Before each read the page cache is dropped (``sync`` then ``/proc/sys/vm/drop_caches`` as
root; else, or with ``--evict fadvise``, ``POSIX_FADV_DONTNEED`` on every file the bench
wrote: said in the output). Before each restore the target's tensors are zeroed; after it,
each tensor's ``full_tensor()`` is hashed on rank 0 and must equal the saved state's (bit for
bit). Every launch first saves and restores a tiny FSDP2 state with both libraries (untimed:
imports, first calls, gloo connections). Runs alternate the order of ``resilient`` and DCP
(resilient first in odd runs). Per rank, around each restore, ``/proc/self/io``'s
``read_bytes`` (from the disk) and ``rchar`` (through read calls) against the bytes that
rank's shards need.

Output: per operation the median and the range over runs of the time (s), GB/s, speed against
the raw floor (raw time / time: 1.0 = the limit), resilient / DCP (time multiple: < 1 is
resilient faster) and the largest read_bytes and rchar multiples of the need over the ranks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchutil import files_under, fsync_path, library_revision, write_json

WIDTH = 2048
QUICK_WIDTH = 64
TIMEOUT_S = 1800.0
PIECE = 64 << 20


# =========================================================================== orchestrator


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=1.0, help="global state in GiB (default 1.0)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; medians are shown")
    p.add_argument("--saved", type=int, default=4, help="ranks that save (default 4)")
    p.add_argument("--to", default="2,3", help="rank counts that reshard (default 2,3)")
    p.add_argument("--evict", choices=("auto", "drop_caches", "fadvise"), default="auto",
                   help="how the page cache is dropped before reads (auto: drop_caches as root)")  # fmt: skip
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="tiny state, 2 ranks save and 1 restores, one run, fadvise")  # fmt: skip
    p.add_argument("--profile", type=Path, default=None,
                   help="write each rank's cProfile of each resilient operation to this folder")  # fmt: skip
    p.add_argument("--worker", choices=("save", "restore"), help=argparse.SUPPRESS)
    p.add_argument("--run", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-warm-up", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.runs, args.saved, args.to = 0.0, 1, 2, "1"
        args.width, args.layers, args.no_warm_up = QUICK_WIDTH, 3, True
        if args.evict == "auto":
            args.evict = "fadvise"
    try:
        args.to = [int(n) for n in str(args.to).split(",") if n]
    except ValueError:
        p.error(f"--to takes rank counts separated by commas, not {args.to!r}")
    if args.runs <= 0 or args.saved <= 0 or any(n <= 0 for n in args.to):
        p.error("--runs, --saved and --to must be positive")
    if not args.quick and args.gib <= 0:
        p.error("--gib must be positive")
    if args.evict == "auto":
        args.evict = "drop_caches" if os.geteuid() == 0 else "fadvise"
    if args.evict == "drop_caches" and os.geteuid() != 0:
        p.error("--evict drop_caches needs root")
    if not args.layers:
        args.layers = max(1, math.ceil(args.gib * (1 << 30) / (12 * (WIDTH * WIDTH + WIDTH))))
    return args


def launch(args: argparse.Namespace, role: str, ranks: int, where: Path, run: int) -> Any:
    """``ranks`` processes of this script as ``role``; rank 0's RESULT (a dict)."""
    store = where / f"store{ranks}"  # the rendezvous: a FileStore, no port to pick
    store.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    env.update(STORE=str(store), WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--dir", str(where),
           "--run", str(run), "--width", str(args.width), "--layers", str(args.layers),
           "--evict", args.evict, "--saved", str(args.saved)]  # fmt: skip
    if args.no_warm_up:
        cmd.append("--no-warm-up")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        cmd += ["--profile", str(args.profile.resolve())]
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    failed = [f"--- rank {r} exited {p.returncode}\n{err[-4000:]}"
              for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)) if p.returncode]  # fmt: skip
    if failed:
        raise SystemExit("bench_dtensor: a launch failed\n" + "\n".join(failed))
    (line,) = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The markdown table of the runs' medians and ranges."""
    lines = [
        "| operation | ranks | resilient s | DCP s | floor s | resilient GB/s | DCP GB/s "
        "| resilient speed vs floor | DCP speed vs floor | resilient / DCP (time) "
        "| read_bytes / need, worst rank (res, DCP) | read_bytes / need, all ranks "
        "| rchar / need, worst rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = [
        ("save", f"{args.saved}", "save"),
        ("restore", f"{args.saved} -> {args.saved}", "same"),
    ]
    cases += [("restore", f"{args.saved} -> {n}", f"to{n}") for n in args.to]
    for op, ranks, key in cases:
        res = [r[key]["resilient"] for r in runs]
        dcp = [r[key]["dcp"] for r in runs]
        raw = [r[key]["raw"] for r in runs]
        nbytes = runs[0][key]["bytes"]

        def col(xs: list[dict[str, Any]], f: Callable[[dict[str, Any]], float]) -> str:
            return spread([f(x) for x in xs])

        row = [
            op, ranks, col(res, lambda x: x["s"]), col(dcp, lambda x: x["s"]),
            col(raw, lambda x: x["s"]),
            spread([nbytes / x["s"] / 1e9 for x in res]),
            spread([nbytes / x["s"] / 1e9 for x in dcp]),
            spread([w["s"] / x["s"] for x, w in zip(res, raw, strict=True)]),
            spread([w["s"] / x["s"] for x, w in zip(dcp, raw, strict=True)]),
            spread([x["s"] / y["s"] for x, y in zip(res, dcp, strict=True)]),
        ]  # fmt: skip
        if op == "restore":
            for field in ("read_bytes", "read_bytes_all", "rchar"):
                row.append(f"{max(x[field] for x in res):.2f}, {max(x[field] for x in dcp):.2f}")
        else:
            row += ["", "", ""]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args)
    if importlib.util.find_spec("torch") is None:
        print(
            "bench_dtensor.py needs PyTorch (pip install 'resilient-hpc[torch]')", file=sys.stderr
        )
        return 2
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench_dtensor."))
    runs: list[dict[str, Any]] = []
    load = os.getloadavg()
    try:
        for run in range(1, args.runs + 1):
            where = base / f"run{run}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            t0 = time.perf_counter()
            result = launch(args, "save", args.saved, where, run)
            walls = [time.perf_counter() - t0]
            for n in args.to:
                t0 = time.perf_counter()
                result[f"to{n}"] = launch(args, "restore", n, where, run)["same"]
                walls.append(time.perf_counter() - t0)
            result["launch_s"] = walls
            runs.append(result)
            write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()},
                                   "runs": runs, "load": [load, os.getloadavg()]})  # fmt: skip
            print(f"run {run}: " + ", ".join(
                f"{k} res {v['resilient']['s']:.3f} dcp {v['dcp']['s']:.3f} raw {v['raw']['s']:.3f}"
                for k, v in result.items() if isinstance(v, dict))
                + f"; launches took {', '.join(f'{w:.0f}' for w in walls)} s", flush=True)  # fmt: skip
            shutil.rmtree(where, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    nbytes = runs[0]["save"]["bytes"]
    load_after = os.getloadavg()
    print(f"resilient {library_revision()}; FSDP2 MLP of {args.layers} x Linear({args.width}, "
          f"{args.width}), model + AdamW state {nbytes / (1 << 30):.3f} GiB over {args.saved} "
          f"ranks; medians (min-max) of {args.runs} interleaved run(s); page cache dropped by "
          f"{args.evict}; load average {load[0]:.1f} before, {load_after[0]:.1f} after; "
          "restored full_tensor() equal bit for bit")  # fmt: skip
    print("\n".join(table(runs, args)))
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()},
                           "runs": runs, "load": [load, load_after]})  # fmt: skip
    return 0


# =========================================================================== ranks


class Rank:
    """One rank's side: its FSDP2 state, the operations, their timing."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.torch, self.dist = args, torch, dist
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{os.environ['STORE']}",
            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        )  # fmt: skip
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.where: Path = args.dir

    # ---- the state
    def build(self, width: int, layers: int) -> tuple[Any, Any]:
        """An MLP under FSDP2 over all ranks after one AdamW step (the same global weights on
        any rank count: the seed decides them before sharding)."""
        torch = self.torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (self.size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(self.size * 2, width, generator=gen)
        mine = x[self.rank * 2 : self.rank * 2 + 2]
        model(mine).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return model, optim

    def states(self, model: Any, optim: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state as resilient saves it and as DCP saves it (the same tensors)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from resilient import Replicated

        msd = get_model_state_dict(model)
        osd = get_optimizer_state_dict(model, optim)
        return {"model": msd, "optim": Replicated(osd)}, {"model": msd, "optim": osd}

    def locals_of(self, state: Any) -> list[Any]:
        """This rank's local tensors of a state (a DTensor's local shard), in a fixed order."""
        from torch.distributed.tensor import DTensor

        out: list[Any] = []

        def walk(v: Any) -> None:
            if isinstance(v, dict):
                for k in sorted(v, key=str):
                    walk(v[k])
            elif isinstance(v, DTensor):
                out.append(v.to_local())
            elif isinstance(v, self.torch.Tensor):
                out.append(v)

        walk(state)
        return out

    def named(self, state: Any, prefix: str = "") -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for k in sorted(state, key=str):
            v, name = state[k], f"{prefix}/{k}"
            if isinstance(v, dict):
                out += self.named(v, name)
            elif isinstance(v, self.torch.Tensor):
                out.append((name, v))
        return out

    def digests(self, state: Any) -> dict[str, str]:
        """xxh3 of each tensor's global bytes (``full_tensor()``), on rank 0 ({} elsewhere)."""
        import xxhash
        from torch.distributed.tensor import DTensor

        out: dict[str, str] = {}
        for name, v in self.named(state):
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if self.rank == 0:
                out[name] = f"{full.dtype}:{tuple(full.shape)}:" + xxhash.xxh3_64_hexdigest(
                    full.detach().contiguous().reshape(-1).view(self.torch.uint8).numpy()
                )
            del full
        return out

    def verify(self, state: Any, what: str) -> None:
        """Every restored tensor equals the saved one bit for bit (collective: all raise)."""
        got = self.digests(state)
        bad = 0
        if self.rank == 0:
            want = json.loads((self.where / "digests.json").read_text())
            bad = sum(got.get(k) != v for k, v in want.items()) + len(set(got) - set(want))
        flag = self.torch.tensor([bad])
        self.dist.broadcast(flag, 0)
        if int(flag):
            raise SystemExit(f"{what}: {int(flag)} tensors differ from the saved state")

    # ---- timing
    def fenced(self, fn: Callable[[], Any], name: str = "") -> tuple[float, dict[str, int]]:
        """Wall time of ``fn`` on all ranks, barrier-fenced, the slowest rank's; and this
        rank's /proc/self/io deltas. With ``--profile`` and a ``name``, under cProfile.

        Before it, untimed, a full pass of Python's cyclic collector, so that no operation pays
        for the objects the ones before it left: a full pass over a PyTorch process's objects
        takes 0.1-0.35 s here, and without this it fell to whichever library ran first after
        the collector's threshold (4 -> 2: resilient 1.45 s with one, DCP 0.94 s without; the
        next run DCP 1.59 s with one, resilient 1.00 s without)."""
        import gc

        gc.collect()
        profile = None
        if self.args.profile and name:
            import cProfile

            profile = cProfile.Profile()
        self.dist.barrier()
        io0 = proc_io()
        t0 = time.perf_counter()
        if profile is not None:
            profile.runcall(fn)
        else:
            fn()
        dt = time.perf_counter() - t0
        if profile is not None:
            profile.dump_stats(self.args.profile / f"{name}-{self.size}-rank{self.rank}.pstats")
        io1 = proc_io()
        self.dist.barrier()
        worst = self.torch.tensor([dt], dtype=self.torch.float64)
        self.dist.all_reduce(worst, op=self.dist.ReduceOp.MAX)
        return float(worst), {k: io1[k] - io0[k] for k in io0}

    def evict(self) -> None:
        """Drop the bench's files from the page cache (collective)."""
        self.dist.barrier()
        os.sync()
        if self.args.evict == "drop_caches":
            if self.rank == 0:
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
        else:
            for p in files_under(self.where):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        self.dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, value)
        return out

    # ---- operations
    def raw_write(self, tensors: list[Any]) -> None:
        path = self.where / "raw" / f"rank{self.rank}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            for t in tensors:
                view = memoryview(
                    t.detach().contiguous().reshape(-1).view(self.torch.uint8).numpy()
                )
                while view:
                    n = os.pwrite(fd, view, pos)
                    pos, view = pos + n, view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(path.parent)

    def raw_read(self, buf: Any, ranges: list[tuple[Path, int, int]]) -> None:
        """Read ``ranges`` (file, offset, length) one after the other into ``buf``."""
        view, at = memoryview(buf), 0
        for path, offset, length in ranges:
            fd = os.open(path, os.O_RDONLY)
            try:
                end = at + length
                while at < end:
                    n = os.preadv(fd, [view[at : min(end, at + PIECE)]], offset)
                    if n <= 0:
                        raise OSError(f"{path}: short read at {offset}")
                    at, offset = at + n, offset + n
            finally:
                os.close(fd)

    def resilient_save(self, root: Path, state: Any) -> Callable[[], None]:
        from resilient import CheckpointManager

        mgr = CheckpointManager(root, comm=self.dist.group.WORLD)

        def save() -> None:
            mgr.save(1, state)

        self._closing = mgr
        return save

    def resilient_restore(self, root: Path, template: Any) -> Callable[[], None]:
        from resilient import CheckpointManager

        mgr = CheckpointManager(root, comm=self.dist.group.WORLD)

        def restore() -> None:
            step, _ = mgr.restore(into=template)
            assert step == 1

        self._closing = mgr
        return restore

    def dcp_save(self, root: Path, state: Any) -> Callable[[], None]:
        import torch.distributed.checkpoint as dcp

        def save() -> None:
            dcp.save(state, checkpoint_id=str(root))
            if self.rank == 0:
                fsync_path(root)

        return save

    def dcp_load(self, root: Path, state: Any) -> Callable[[], None]:
        import torch.distributed.checkpoint as dcp

        def load() -> None:
            dcp.load(state, checkpoint_id=str(root))

        return load

    def close(self) -> None:
        mgr = getattr(self, "_closing", None)
        if mgr is not None:
            mgr.close()
            self._closing = None

    def zero(self, tensors: list[Any]) -> None:
        with self.torch.no_grad():
            for t in tensors:
                t.zero_()

    def warm_up(self) -> None:
        """Both libraries save and restore a tiny FSDP2 state (untimed)."""
        model, optim = self.build(32, 2)
        ours, theirs = self.states(model, optim)
        tiny = self.where / f"warm{self.size}"
        self.dist.barrier()
        for fn in (
            self.resilient_save(tiny / "resilient", ours),
            self.dcp_save(tiny / "dcp", theirs),
        ):
            fn()
            self.close()
        for fn in (
            self.resilient_restore(tiny / "resilient", ours),
            self.dcp_load(tiny / "dcp", theirs),
        ):
            fn()
            self.close()
        self.dist.barrier()
        if self.rank == 0:
            shutil.rmtree(tiny, ignore_errors=True)

    def restores(
        self, ours: Any, theirs: Any, ranges: list[tuple[Path, int, int]], need: int
    ) -> dict[str, Any]:
        """raw_read, resilient_restore, dcp_load (in the run's order), each cold, each
        restore verified; times and read multiples (the worst rank's)."""
        tensors = self.locals_of(theirs)
        held = [bytearray(sum(n for _, _, n in ranges))]  # prefaulted (zeroed) by Python
        out: dict[str, Any] = {}
        self.evict()
        s, io = self.fenced(lambda: self.raw_read(held[0], ranges))
        out["raw"] = {"s": s}
        held.clear()
        order = ["resilient", "dcp"] if self.args.run % 2 else ["dcp", "resilient"]
        for lib in order:
            self.zero(tensors)
            self.evict()
            if lib == "resilient":
                fn = self.resilient_restore(self.where / "resilient", ours)
            else:
                fn = self.dcp_load(self.where / "dcp", theirs)
            s, io = self.fenced(fn, f"{lib}_restore" if lib == "resilient" else "")
            self.close()
            ios = self.gather(io)
            needs = self.gather(need)
            out[lib] = {
                "s": s,
                "read_bytes": max(x["read_bytes"] / n for x, n in zip(ios, needs, strict=True)),
                "rchar": max(x["rchar"] / n for x, n in zip(ios, needs, strict=True)),
                "read_bytes_all": sum(x["read_bytes"] for x in ios) / sum(needs),
                "per_rank": ios,
            }
            self.verify(theirs, f"{lib} restore on {self.size} ranks")
        out["bytes"] = sum(self.gather(need))
        out["need_per_rank"] = self.gather(need)
        return out


def proc_io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {k: int(fields[k]) for k in ("read_bytes", "rchar")}


def nbytes(tensors: list[Any]) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors)


def worker(args: argparse.Namespace) -> int:
    rank = Rank(args)
    if not args.no_warm_up:
        rank.warm_up()
    model, optim = rank.build(args.width, args.layers)
    ours, theirs = rank.states(model, optim)
    tensors = rank.locals_of(theirs)
    need = nbytes(tensors)
    result: dict[str, Any] = {}
    if args.worker == "save":
        (args.dir / "raw").mkdir(exist_ok=True)
        digests = rank.digests(theirs)
        if rank.rank == 0:
            (args.dir / "digests.json").write_text(json.dumps(digests))
        sizes = rank.gather(need)
        if rank.rank == 0:
            (args.dir / "raw_sizes.json").write_text(json.dumps(sizes))
        save: dict[str, Any] = {"bytes": sum(sizes)}
        save["raw"] = {"s": rank.fenced(lambda: rank.raw_write(tensors))[0]}
        order = ["resilient", "dcp"] if args.run % 2 else ["dcp", "resilient"]
        for lib in order:
            if lib == "resilient":
                fn = rank.resilient_save(args.dir / "resilient", ours)
            else:
                fn = rank.dcp_save(args.dir / "dcp", theirs)
            save[lib] = {"s": rank.fenced(fn, "resilient_save" if lib == "resilient" else "")[0]}
            rank.close()
        result["save"] = save
        ranges = [(args.dir / "raw" / f"rank{rank.rank}.bin", 0, need)]
    else:
        sizes = json.loads((args.dir / "raw_sizes.json").read_text())
        needs = rank.gather(need)
        ranges = consecutive(args.dir / "raw", sizes, sum(needs[: rank.rank]), need)
    result["same"] = rank.restores(ours, theirs, ranges, need)
    if rank.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    rank.dist.barrier()
    rank.dist.destroy_process_group()
    return 0


def consecutive(
    raw: Path, sizes: list[int], start: int, length: int
) -> list[tuple[Path, int, int]]:
    """Bytes ``[start, start + length)`` of the saved ranks' raw files laid end to end (as
    many as there are, if fewer), as (file, offset, length) ranges."""
    out: list[tuple[Path, int, int]] = []
    pos = 0
    for r, n in enumerate(sizes):
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            out.append((raw / f"rank{r}.bin", lo - pos, hi - lo))
        pos += n
    return out


if __name__ == "__main__":
    sys.exit(main())
