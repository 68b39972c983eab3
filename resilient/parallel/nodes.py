"""What a node is called, and where its node-local storage is.

Which ranks share a node is the communicator's answer (:meth:`resilient.parallel.comm.Comm.split_node`:
MPI's shared-memory split, torch's grouping by :func:`node_label`), never the host name alone:
several "nodes" of one host (Slurm's node aliases, MPICH's ``-hosts a,b -launcher fork``) are
separate nodes. This module only names them and expands their paths; it does no I/O.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

__all__ = ["expand_node_path", "node_label"]

# Launchers that export the name of the node a process runs on, in order of preference:
# Slurm's node name (an alias when several slurmd share a host), MPICH hydra's host name.
_NODE_NAME_VARS = ("SLURMD_NODENAME", "PMI_HOSTNAME")


def node_label(env: Mapping[str, str] | None = None) -> str:
    """The name of this process's node: ``$SLURMD_NODENAME`` or ``$PMI_HOSTNAME`` where the
    launcher exports one, else the host name."""
    env = os.environ if env is None else env
    for var in _NODE_NAME_VARS:
        value = env.get(var, "").strip()
        if value:
            return value
    return socket.gethostname()


_DEFAULTED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def expand_node_path(path: str | os.PathLike[str]) -> str:
    """``path`` with ``${VAR:-default}`` (the default when ``VAR`` is unset or empty), then
    ``$VAR`` and ``${VAR}`` (left as they are when unset) and ``~`` expanded from this
    process's environment. Run by each node's own ranks, ``/scratch/$SLURMD_NODENAME`` or
    ``${SLURM_TMPDIR:-/dev/shm}`` name that node's storage."""
    text = _DEFAULTED.sub(lambda m: os.environ.get(m.group(1)) or m.group(2), os.fspath(path))
    return os.path.expanduser(os.path.expandvars(text))
