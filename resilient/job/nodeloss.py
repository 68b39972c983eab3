"""Whether an attempt ended because Slurm lost one of the job's nodes: what Slurm says.

A multi-node program whose node dies (its ``slurmd`` stops answering, the machine fails) does
not end on its own: its ranks on the other nodes wait for their peers until ``slurmctld``
declares the node down (``SlurmdTimeout``), tells ``srun`` ("Node failure on n2") and ends the
job step, and then the job itself (``NODE_FAIL``, or ``REQUEUE`` for a batch job that Slurm may
requeue, its default). To ``resilient run`` that is a launcher that exited after a kill, and
without more it would be charged as a crash.

After an attempt that failed inside a Slurm job, :func:`lost_nodes` asks Slurm for the state of
the job's nodes (``scontrol show node``): a node that is ``DOWN``, ``FAIL`` or not responding
(``*``) is a lost node. The job's nodes come from ``SLURM_JOB_NODELIST`` (taken at the start:
Slurm drops a failed node from the job's ``NodeList``), else from ``scontrol show job``. Nothing
is guessed: where ``scontrol`` fails or every node is fine, no node is lost.

Pure logic but for :func:`job_nodelist` and :func:`lost_nodes`, which run ``scontrol``.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["LostNode", "is_lost", "job_nodelist", "lost_nodes", "parse_nodes"]

Scontrol = Callable[[Sequence[str]], tuple[int, str]]
"""Runs ``scontrol ARGS``: (exit status, its output)."""

_TIMEOUT_S = 10.0  # the job may be ending: Slurm's KillWait (30 s by default) is all there is

# base states and flags of a node that no longer runs the job's processes
_LOST = ("DOWN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN")


def _scontrol(args: Sequence[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout


@dataclass(frozen=True, slots=True)
class LostNode:
    """A node of the job that Slurm no longer counts on."""

    name: str
    state: str
    """``State=`` of ``scontrol show node``: ``DOWN*``, ``IDLE*``, ``ALLOCATED+FAIL``, ..."""
    reason: str = ""
    """``Reason=``, without Slurm's ``[user@time]`` suffix: ``Not responding``, ..."""

    def describe(self) -> str:
        """``n2 (DOWN*: Not responding)``."""
        return f"{self.name} ({self.state}{': ' + self.reason if self.reason else ''})"


def is_lost(state: str) -> bool:
    """Whether a node in ``State=STATE`` is lost: down, failed or not responding."""
    upper = state.upper()
    return upper.endswith("*") or any(word in upper for word in _LOST)


def parse_nodes(text: str) -> list[LostNode]:
    """The lost nodes among ``scontrol -o show node`` lines (one node a line)."""
    found = []
    for line in text.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        state = re.search(r"(?:^|\s)State=(\S+)", line)
        if name is None or state is None or not is_lost(state.group(1)):
            continue
        reason = re.search(r"(?:^|\s)Reason=(.*?)(?:\s+\[[^\]]*\])?(?:\s+\w+=|$)", line)
        found.append(LostNode(name.group(1), state.group(1), reason.group(1) if reason else ""))
    return found


def job_nodelist(
    env: Mapping[str, str], *, known: str | None = None, scontrol: Scontrol = _scontrol
) -> str:
    """The node list of the Slurm job of ``env`` (``n[1-2]``): ``SLURM_JOB_NODELIST``, else
    ``known`` (what ``scontrol show job`` already said), else ``scontrol show job``; empty
    outside Slurm or where it fails. Taken at the start: Slurm drops a failed node from it."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip() or (known or "")
    job = env.get("SLURM_JOB_ID", "").strip()
    if not nodelist and job and known is None:
        status, text = scontrol(["show", "job", "-o", job])
        m = re.search(r"(?:^|\s)NodeList=(\S+)", text) if status == 0 else None
        nodelist = m.group(1) if m else ""
    return "" if nodelist == "(null)" else nodelist


def lost_nodes(nodelist: str, *, scontrol: Scontrol = _scontrol) -> list[LostNode]:
    """Which nodes of ``nodelist`` Slurm says are down, failed or not responding, now."""
    if not nodelist:
        return []
    status, text = scontrol(["show", "hostnames", nodelist])
    nodes = text.split() if status == 0 else []
    if not nodes:
        return []
    status, text = scontrol(["-o", "show", "node", ",".join(nodes)])
    if status != 0:
        return []
    return [node for node in parse_nodes(text) if node.name in set(nodes)]
