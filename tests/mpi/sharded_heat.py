"""``apps.heat`` whose checkpoints have a sharded manifest (schema 3: an index ``manifest.json``
and its shards ``manifest-00000.json``...), for the fuzz tests: every manager of the program
writes shards of one rank (whole file groups) whatever its rank count, as a set of more than
``DEFAULT_SHARD_RANKS`` ranks would. Same arguments as ``apps.heat``."""

from __future__ import annotations

import functools
import sys

from apps import heat  # first: it installs the stop-signal handlers before the slow imports
from resilient.checkpoint.manager import CheckpointManager
from resilient.job import session

session.CheckpointManager = functools.partial(  # type: ignore[attr-defined,assignment]
    CheckpointManager, manifest_shard_ranks=1
)

if __name__ == "__main__":
    sys.exit(heat.main())
