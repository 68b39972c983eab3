"""Partner copies against XOR parity on the same data: bytes each node stores, the time until a
checkpoint is protected, the encode against an in-memory XOR, and the rebuild of a lost node.

Usage (from the repository root, with the project's environment)::

    python bench/bench_redundancy.py --nodes 3 4 8 --mib 32 --runs 5 [--dir /dev/shm]

For each node count N the script starts itself under ``mpiexec -n N -hosts nodeA:1,...
-launcher fork`` (one rank per simulated node of this machine). Every rank holds one float64
buffer of ``--mib`` MiB (rank r: ``--mib * (1 + r / (4 N))``: uneven, as real nodes are). Each
round runs, in a shuffled order, after ``--gap`` seconds of "compute":

| mode | what |
|---|---|
| `raw` | each rank: a new file in its node's directory, `pwrite`, `fsync` (the physical limit) |
| `local` | `save(blocking=False)` to the node-local tier, no redundancy, then `wait()` |
| `partner` | the same with `redundancy="partner"`: `wait()` also waits for the copy |
| `xor` | the same with `redundancy="xor"` (one set of N): `wait()` also waits for the parity |

Printed per N (medians over ``--runs`` rounds after one warm-up round; min and max too):

* ``done``: from the start of ``save()`` to the end of ``wait()`` (``partner``/``xor``: the
  checkpoint protected); ratios ``xor / partner`` (target <= 1.5 here) and each over ``raw``;
* ``stored``: bytes per node in its tier for the newest step (own files, partner copies,
  parity and its record), against the target for XOR: the set's data plus ``N x max(B_j) /
  (N - 1)`` plus a header per node;
* ``encode``: the node's bytes over ``xor done - local done`` (the parity's own time), against
  ``numpy.bitwise_xor`` of the same bytes in memory (the encode's upper bound: every byte is
  also read from the tier, sent and received once);
* ``rebuild``: a restore after node B's tier is wiped, minus a restore of the intact tier
  (medians of ``--rebuild-runs``): what rebuilding one node's files costs.

On this machine all "nodes" share two cores, one disk and the loopback: partner copies and
XOR traffic compete with the local writes of every other node (on a cluster each node has its
own disk and link). ``--dir /dev/shm`` puts the tier in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("raw", "local", "partner", "xor")


def drive(args: argparse.Namespace) -> int:
    """Run the measurement under mpiexec for each node count; print and keep the results."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    docs = []
    for n in args.nodes:
        hosts = ",".join(f"node{chr(65 + i)}:1" for i in range(n))
        out = args.dir / f"bench-redundancy-{os.getpid()}-{n}.json"
        cmd = [mpiexec, "-n", str(n), "-hosts", hosts, "-launcher", "fork", sys.executable,
               __file__, "--worker", "--mib", str(args.mib), "--runs", str(args.runs),
               "--gap", str(args.gap), "--rebuild-runs", str(args.rebuild_runs),
               "--dir", str(args.dir), "--seed", str(args.seed), "--out", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO)
        docs.append(json.loads(out.read_text()))
        out.unlink()
    if args.json:
        args.json.write_text(json.dumps(docs, indent=1))
    return 0


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    from mpi4py import MPI

    from resilient import CheckpointManager
    from resilient.parallel.nodes import node_label

    comm = MPI.COMM_WORLD
    rank, size, node = comm.rank, comm.size, node_label()

    def quiet_barrier() -> None:
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    base = Path(
        comm.bcast(str(args.dir / f"bench-redundancy-{os.getpid()}") if rank == 0 else None)
    )
    local = f"{base}/local/$PMI_HOSTNAME"
    mib = args.mib * (1 + rank / (4 * size))
    buf = np.random.default_rng(rank).standard_normal(int(mib * (1 << 20) // 8))

    def manager(mode: str) -> Any:
        return CheckpointManager(
            base / f"shared-{mode}", comm=comm, checkpoint_comm="self", local_dir=local,
            flush_every=10**6, redundancy=None if mode == "local" else mode,
        )  # fmt: skip

    managers = {mode: manager(mode) for mode in ("local", "partner", "xor")}
    raw_dir = base / "raw" / node
    raw_dir.mkdir(parents=True, exist_ok=True)
    order = random.Random(args.seed)
    done: dict[str, list[float]] = {m: [] for m in MODES}
    step = 0
    for round_ in range(args.runs + 1):  # round 0 warms up
        modes = comm.bcast(order.sample(MODES, len(MODES)))
        for mode in modes:
            step += 1
            buf[0] = step
            time.sleep(args.gap)
            quiet_barrier()
            t0 = time.perf_counter()
            if mode == "raw":
                _raw_write(raw_dir / f"rank{rank}.bin", buf)
            else:
                managers[mode].save(step, {"x": buf}, blocking=False)
                managers[mode].wait()
            quiet_barrier()
            if round_ > 0:
                done[mode].append(time.perf_counter() - t0)
    stored = {m: _stored(managers[m]) for m in ("local", "partner", "xor")}
    data = comm.allgather(buf.nbytes)
    # the encode's upper bound: XOR of this rank's bytes in memory (warm, median of 5)
    other = np.random.default_rng(99).standard_normal(buf.size)
    a = buf.view(np.uint64).copy()
    mem = []
    for _ in range(6):
        t0 = time.perf_counter()
        np.bitwise_xor(a, other.view(np.uint64), out=a)
        mem.append(time.perf_counter() - t0)
    engines = _engines(comm, buf, quiet_barrier, args.runs)
    for m in managers.values():
        m.close()
    rebuild = {
        m: _rebuild(m, manager, comm, quiet_barrier, args.rebuild_runs) for m in ("partner", "xor")
    }
    if rank == 0:
        doc = {"nodes": size, "mib": args.mib, "data": data, "runs": args.runs, "done": done,
               "stored": stored, "mem_xor_s": statistics.median(mem[1:]), "rebuild": rebuild,
               "engines": engines,
               "dir": str(args.dir)}  # fmt: skip
        _report(doc)
        args.out.write_text(json.dumps(doc))
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _engines(comm: Any, buf: Any, barrier: Any, runs: int) -> dict[str, list[float]]:
    """The parity of this rank's bytes (in memory, no file) computed by the library's ring over
    its MPI channel, and by MPI's own ``Ireduce_scatter_block`` with ``BXOR`` (polled with
    sleeps, as the channel is): seconds per encode, every rank done."""
    import numpy as np
    from mpi4py import MPI

    from resilient.io.xorwire import DataStream, encode
    from resilient.model.xorcode import chunk_size
    from resilient.parallel.mpi import MPIComm

    n, rank = comm.size, comm.rank
    data = memoryview(buf).cast("B")
    chunk = chunk_size(comm.allgather(len(data)))
    channel = MPIComm(comm).channel()

    class Memory:
        def read(self, view: memoryview, pos: int) -> None:
            view[:] = data[pos : pos + len(view)]

        def readv(self, buffers: list[Any], pos: int) -> int:
            raise NotImplementedError

        def close(self) -> None:
            pass

    class Sink:
        def write(self, view: memoryview, pos: int) -> None:
            pass

        def resize(self, size: int) -> None:
            pass

        def close(self, *, sync: bool) -> None:
            pass

    send = np.zeros(n * chunk // 8, dtype=np.uint64)  # MPI's layout: block k for rank k
    got = np.empty(chunk // 8, dtype=np.uint64)
    raw = send.view(np.uint8)
    for k in range(n):
        if k != rank:
            start = (k if k < rank else k - 1) * chunk
            piece = data[start : start + chunk]
            raw[k * chunk : k * chunk + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
    out: dict[str, list[float]] = {"ring": [], "mpi_bxor": []}
    for i in range(runs + 1):
        barrier()
        t0 = time.perf_counter()
        stream = DataStream([("x", len(data), Memory)])
        encode(channel, (rank - 1) % n, (rank + 1) % n, rank, n, chunk, stream, Sink())
        barrier()
        ring = time.perf_counter() - t0
        barrier()
        t0 = time.perf_counter()
        req = comm.Ireduce_scatter_block([send, MPI.UINT64_T], [got, MPI.UINT64_T], op=MPI.BXOR)
        while not req.Test():
            time.sleep(0.0005)
        barrier()
        if i:
            out["ring"].append(ring)
            out["mpi_bxor"].append(time.perf_counter() - t0)
    return out


def _raw_write(path: Path, buf: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(buf).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _stored(m: Any) -> list[dict[str, int]] | None:
    """Per node (on rank 0): bytes of the newest step in its tier: its data files, partner
    copies of data files, XOR parity, and the rest (manifests, markers, records)."""
    from mpi4py import MPI

    tier = m._path.tier
    mine: dict[str, int] | None = None
    if tier.is_node_leader:
        root: Path = tier.root
        newest = max(p.name for p in root.glob("step_*"))
        dirs = [root / newest, *(p / newest for p in root.glob("partner/*")), root / "xor" / newest]
        files = [f for d in dirs if d.is_dir() for f in d.iterdir() if f.is_file()]
        kinds = {"data": 0, "copies": 0, "parity": 0, "header": 0}
        for f in files:
            kind = ("copies" if "partner" in f.parts else "data") if f.suffix == ".h5" else (
                "parity" if f.name == "parity.xor" else "header")  # fmt: skip
            kinds[kind] += f.stat().st_size
        mine = kinds
    got = MPI.COMM_WORLD.gather(mine)
    return [g for g in got if g is not None] if got is not None else None


def _rebuild(mode: str, manager: Any, comm: Any, barrier: Any, runs: int) -> dict[str, list[float]]:
    """Restore times with node B's tier wiped, and with it intact."""
    out: dict[str, list[float]] = {"wiped": [], "intact": []}
    for i in range(2 * runs):
        kind = "wiped" if i % 2 == 0 else "intact"
        m = manager(mode)
        root = m._path.tier.root
        m.close()
        if kind == "wiped" and comm.rank == 1:
            shutil.rmtree(root)
        barrier()
        t0 = time.perf_counter()
        m = manager(mode)
        m.restore()
        barrier()
        out[kind].append(time.perf_counter() - t0)
        m.wait()
        m.close()
    return out


def _report(doc: dict[str, Any]) -> None:
    n, done = doc["nodes"], doc["done"]
    med = {m: statistics.median(v) for m, v in done.items()}
    mib = 1 << 20
    print(f"\n{n} nodes, one rank each, {doc['mib']:g} MiB base per rank (uneven), "
          f"{doc['runs']} rounds, tier under {doc['dir']}")  # fmt: skip
    print(f"{'mode':8} {'done med':>9} {'min':>7} {'max':>7}  {'/ raw':>6}")
    for m in MODES:
        v = done[m]
        print(f"{m:8} {med[m]:9.3f} {min(v):7.3f} {max(v):7.3f}  {med[m] / med['raw']:6.2f}")
    print(f"protected, xor / partner: {med['xor'] / med['partner']:.2f} (target <= 1.5)")
    data = doc["data"]
    for m in ("partner", "xor"):
        per = doc["stored"][m]
        total = sum(sum(p.values()) for p in per)
        files = sum(p["data"] for p in per)
        print(f"stored with {m:7}: {total / mib:8.1f} MiB for {files / mib:.1f} MiB of data files "
              f"({total / files:.3f}x); per node "
              + ", ".join(f"{sum(p.values()) / mib:.1f}" for p in per)
              + f"; headers {sum(p['header'] for p in per) / 1024:.0f} KiB in all")  # fmt: skip
    per = doc["stored"]["xor"]
    own = [p["data"] for p in per]
    target = sum(own) + n * max(own) / (n - 1)
    got = sum(p["data"] + p["parity"] for p in per)
    print(f"xor target: data files + N x max(B)/(N-1) = {target / mib:.2f} MiB (+ headers "
          f"{sum(p['header'] for p in per) / 1024:.0f} KiB): {'met' if got <= target + n * 4096 else 'MISSED'}"
          f" ({got / mib:.2f} MiB; the parity is rounded up to whole pages)")  # fmt: skip
    encode = med["xor"] - med["local"]
    node_bytes = statistics.median(data)
    print(f"encode: {node_bytes / mib / max(encode, 1e-9):.0f} MiB/s per node "
          f"(xor done - local done = {encode:.3f} s); numpy XOR in memory "
          f"{node_bytes / mib / doc['mem_xor_s']:.0f} MiB/s (upper bound)")  # fmt: skip
    ring, bxor = (statistics.median(doc["engines"][k]) for k in ("ring", "mpi_bxor"))
    print(
        f"encode engines, in memory: the ring over the channel {ring:.3f} s, MPI "
        f"Ireduce_scatter_block(BXOR) {bxor:.3f} s ({bxor / ring:.2f}x the ring's time)"
    )
    for m in ("partner", "xor"):
        r = doc["rebuild"][m]
        w, i = statistics.median(r["wiped"]), statistics.median(r["intact"])
        print(f"rebuild {m:7}: restore after wiping node B {w:.3f} s, intact {i:.3f} s: "
              f"{w - i:.3f} s to rebuild {data[1] / mib:.1f} MiB")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[3, 4, 8])
    p.add_argument("--mib", type=float, default=32.0, help="MiB per rank (before unevenness)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--gap", type=float, default=1.0, help="seconds of 'compute' before a save")
    p.add_argument("--rebuild-runs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the nodes' tiers go")
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument("--json", type=Path, help="keep every measurement here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    return worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    sys.exit(main())
