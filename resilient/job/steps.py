"""Whether the program can reach every node of its Slurm job from where it starts.

A command that ``resilient run`` starts inside a job step runs on that step's nodes only: an
``srun`` there asking for more fails ("Only allocated 1 nodes asked for 2"), and ``mpiexec``
finds one node. That is how a multi-node Snakemake rule runs under the Slurm executor plugin
unless the rule sets the plugin's ``mpi`` resource: the job gets its nodes, but the plugin's
job step runs the rule's shell through ``srun -n1 --nodes=N``, which Slurm shrinks to one node
("can't run 1 processes on 2 nodes, setting nnodes to 1"). With ``mpi`` set the plugin runs
the shell in the batch step itself, where the rule's own ``srun`` reaches every node.

What Slurm 22.05.8 sets (measured on the local Slurm, a batch job of 2 nodes):

* the batch step: ``SLURM_JOB_NUM_NODES=2`` and ``SLURM_NNODES=2``; no ``SLURM_STEP_ID`` and
  no ``SLURM_STEP_NUM_NODES`` (nor ``SLURM_JOB_END_TIME``: that is Slurm >= 23.02);
* a step of the batch script (``srun -N 1 -n 1``): ``SLURM_STEP_ID=0``,
  ``SLURM_STEP_NUM_NODES=1`` and ``SLURM_NNODES=1`` (the step's), ``SLURM_JOB_NUM_NODES=2``
  (the job's, inherited from the batch step: the step does not set it);
* the executor plugin's step (it drops every ``SLURM_*`` variable but ``SLURM_JOB_ID`` and a
  few more, then ``srun -n1 --nodes=2``: "can't run 1 processes on 2 nodes, setting nnodes to
  1"): ``SLURM_STEP_ID``, ``SLURM_STEP_NUM_NODES=1``, ``SLURM_NNODES=1`` and no
  ``SLURM_JOB_NUM_NODES``; ``squeue -h -j $SLURM_JOB_ID -o %D`` says 2.

So: inside a step (``SLURM_STEP_ID`` set) compare ``SLURM_STEP_NUM_NODES`` (else
``SLURM_NNODES``) with the job's count, ``SLURM_JOB_NUM_NODES`` where it is set, else
``squeue``'s: one ``squeue`` call, only inside a step that lost the job's variables.

Pure logic but for :func:`squeue_nodes`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["NarrowStep", "narrow_step", "squeue_nodes"]


def squeue_nodes(job_id: str) -> int | None:
    """The job's node count (``squeue -h -j JOB -o %D``); ``None`` if squeue says nothing."""
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%D"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = proc.stdout.split()
    return int(words[0]) if proc.returncode == 0 and words and words[0].isdigit() else None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


@dataclass(frozen=True, slots=True)
class NarrowStep:
    """A job step with fewer nodes than its job."""

    job_id: str
    step_id: str
    step_nodes: int
    job_nodes: int

    def message(self, task: str | None, *, refuse: bool) -> str:
        """What is wrong and the fix, naming the Snakemake rule (the first word of ``task``)."""
        rule = (task or "").split()[0] if (task or "").split() else None
        nodes = f"{self.step_nodes} node{'s' if self.step_nodes != 1 else ''}"
        said = (
            f"this job step ({self.job_id}.{self.step_id}) has {nodes} of the job's "
            f"{self.job_nodes}: the program can reach only {nodes} from here (an srun asking "
            f"for {self.job_nodes} fails: 'Only allocated {self.step_nodes} nodes asked for "
            f"{self.job_nodes}')."
        )
        where = f"rule {rule!r}" if rule else "the rule"
        fix = (
            f" Under Snakemake's Slurm executor a multi-node rule runs in such a step unless "
            f'it sets the `mpi` resource: give {where} `mpi="srun"` with its `nodes` and '
            "`tasks` (resources: **mpi_resources(nodes=N, tasks=T) from "
            "resilient.integrations.snakemake), and start the program with `{resources.mpi} "
            "-N {resources.nodes} -n {resources.tasks}` (resilient_run(mpi=True) writes it)."
        )
        if refuse:
            return (
                f"{said}{fix} Not starting (exit 78: a configuration error; retries will not help)"
            )
        return f"{said} Starting anyway: the step may be meant to use fewer nodes.{fix}"


def narrow_step(
    environ: Mapping[str, str], *, job_nodes: Callable[[str], int | None] = squeue_nodes
) -> NarrowStep | None:
    """The job step we run in, if it has fewer nodes than the job; else ``None`` (the batch
    step, no Slurm, or the counts unknown)."""
    job, step = environ.get("SLURM_JOB_ID", "").strip(), environ.get("SLURM_STEP_ID", "").strip()
    if not job or not step:
        return None
    mine = _int(environ.get("SLURM_STEP_NUM_NODES")) or _int(environ.get("SLURM_NNODES"))
    if mine is None:
        return None
    total = _int(environ.get("SLURM_JOB_NUM_NODES")) or job_nodes(job)
    if total is None or mine >= total:
        return None
    return NarrowStep(job, step, mine, total)
