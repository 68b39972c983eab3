"""Export of a sharded checkpoint, under ``mpiexec -n 2``; driven by tests/test_elastic.py.

Usage: python tests/mpi/sharded_export.py ROOT

Both ranks save a Block leaf and static data with a shard per rank; rank 0 exports the global
arrays (every shard loaded), then changes a shard and exports again (refused, naming it).
Rank 0 prints ``RESULT <json>``; any failure raises (mpiexec then exits non-zero).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

import resilient
from resilient import Block
from resilient.errors import InvalidCheckpointError
from resilient.export import export
from resilient.model import filenames

world = MPI.COMM_WORLD
root = Path(sys.argv[1])
n, rank = world.size, world.rank
u = np.arange(40.0).reshape(8, 5)
k = np.arange(16, dtype=np.int32)
rows, cols = 8 // n, 16 // n
with resilient.CheckpointManager(root, comm=world, manifest_shard_ranks=1) as m:
    m.save(
        3,
        {"u": Block(u[rank * rows : (rank + 1) * rows].copy(), u.shape, (rank * rows, 0))},
        static={"k": Block(k[rank * cols : (rank + 1) * cols].copy(), k.shape, (rank * cols,))},
    )
world.Barrier()
if rank == 0:
    out = root.parent / "global.h5"
    done = export(root, out, copy=True)
    with h5py.File(out) as f:
        same = np.array_equal(f["u"][()], u) and np.array_equal(f["k"][()], k)
    step_dir = root / filenames.step_dir_name(3)
    shard = step_dir / filenames.shard_name(1)
    shard.write_bytes(shard.read_bytes().replace(b'"step":3', b'"step":4'))
    try:
        export(root, root.parent / "again.h5", step=3)
        refused = ""
    except InvalidCheckpointError as exc:
        refused = exc.reason
    shards = sorted(p.name for p in step_dir.iterdir() if p.name.startswith("manifest-"))
    doc = {"rank": rank, "datasets": list(done.datasets), "same": same, "refused": refused, "shards": shards}
    print("RESULT " + json.dumps(doc), flush=True)
