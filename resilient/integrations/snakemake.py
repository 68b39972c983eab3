"""Snakemake helpers: a resumable rule in five lines.

::

    from resilient.integrations.snakemake import checkpoint_dir, resilient_run, retries

    rule sim:
        output: "results/{case}.h5"
        params: ckpt=lambda wc: checkpoint_dir("ckpt", "sim", CASES[wc.case], wildcards=wc)
        retries: retries(10)
        shell: resilient_run() + "mpiexec -n 4 python sim.py --case {wildcards.case} --out {output}"

* :func:`checkpoint_dir` (from :mod:`resilient.workflow`) names the task's checkpoint directory
  after the rule, its wildcards and a hash of its parameters: a retry resumes, a changed
  parameter starts fresh in a directory of its own. It is a ``param``, never an ``output``:
  Snakemake deletes a job's declared outputs before every retry and after a failure.
* :func:`retries` is the rule's retry budget for the Snakemake that submits the jobs, and 0
  inside a cluster job (``--mode remote``: the executor plugin re-runs the rule there, and a
  ``retries:`` would restart the program at once in the same, nearly expired allocation).
* :func:`resilient_run` is the shell prefix ``<this python> -m resilient.cli run [walltime]
  --checkpoint-dir {params.ckpt:q} --task 'RULE WILDCARDS' --outputs {output:q} --``
  (``resilient run [sim case=a]: attempt 1: ...`` on every line it logs). The
  program takes its checkpoint directory from ``$RESILIENT_CHECKPOINT_DIR`` (which ``resilient
  run`` sets, and :class:`~resilient.job.session.Session` reads when given no directory) or from
  ``{params.ckpt}``.

**An MPI rule of several nodes** needs the Slurm executor plugin's ``mpi`` resource: without
it the plugin runs the rule's shell in a one-task job step that Slurm shrinks to one node, and
the program's own ``srun -N 2`` fails ("Only allocated 1 nodes asked for 2"). With it the
shell runs in the batch step and the launcher reaches every node::

    rule sim:
        output: "results/{case}.h5"
        params: ckpt=lambda wc: checkpoint_dir("ckpt", "sim", CASES[wc.case], wildcards=wc)
        resources: **mpi_resources(nodes=2, tasks=4)
        retries: retries(10)
        shell: resilient_run(mpi=True) + "python sim.py --case {wildcards.case} --out {output}"

:func:`mpi_resources` gives ``nodes``, ``tasks`` and ``mpi`` (the launcher, ``srun`` where
there is one) together, and ``resilient_run(mpi=True)`` ends the prefix with the launcher and
its counts, as ``{resources.mpi} -N {resources.nodes} -n {resources.tasks}`` for ``srun`` and
``{resources.mpi} -n {resources.tasks}`` for ``mpiexec`` (a profile's ``set-resources`` may
switch the launcher: the words are chosen when the job runs, :class:`MpiLaunch`). A rule
written without ``mpi`` is caught when it runs, not when the Snakefile is parsed (a profile's
``set-resources`` is not applied yet then): ``resilient run`` sees a job step with fewer nodes
than its job and exits 78, naming the rule and this fix (:mod:`resilient.job.steps`).

**A simulated walltime from the profile.** A local profile plays Slurm's end of a job by keeping
its walltime in its workflow config; :func:`resilient_run` reads it from the running workflow's
config when the Snakefile is parsed, so no Snakefile wires it. The profile names a config file
(``configfile: workflow-config.yaml``, relative to the profile's directory)::

    resilient_walltime: 6          # per attempt: a bare number is seconds, not Slurm's
                                   # minutes (also 90s, 5m, 1h30m, 01:00:00: the forms of
                                   # resilient run --walltime); absent, null or 0: none (on
                                   # Slurm the deadline comes from the job)
    resilient_requeue: true        # requeue a walltime stop in place (default true)
    resilient_signal: USR1@1       # warning signal and its lead (default USR1@10% of it)
    resilient_kill_wait: 1         # SIGTERM to SIGKILL, seconds (default 5 s)

Snakemake merges a command-line ``--config`` over config files key by key, so
``--config resilient_walltime=5`` keeps the file's other keys. A profile's ``config:`` entry
would not do: a command-line ``--config`` replaces it whole.

**Requeue in place on Slurm.** ``resilient_slurm_requeue: true`` in the workflow config (say
``--config resilient_slurm_requeue=true``) adds ``--requeue`` where there is no simulated
walltime: in a Slurm batch job a stop at the job's time limit after progress requeues the job
under its ID (:mod:`resilient.job.requeue`) instead of failing it, so it costs no Snakemake
retry. The jobs must be requeueable: the executor plugin's ``slurm-requeue: true`` (``sbatch
--requeue``), with ``--open-mode=append`` in ``slurm_extra`` to keep one log per job. The
plugin reads a REQUEUED or PENDING job as still running.

**Checkpoints declared as an output** are refused, naming the rule, the directory and the fix.
:func:`resilient_run` passes the job's concrete outputs (``--outputs {output:q}``, with
the rule and its wildcards as ``--task``) and ``resilient run`` exits 78 before the first attempt if the checkpoint
directory is one of them or lies inside one. That check is done on the job's paths after
wildcard expansion, by plain path comparison. The alternative, a DAG-time check of the
checkpoint path against every rule's output patterns (``rule.is_producer``), would guess:
wildcards match ``/`` by default, so a broad pattern of an unrelated rule (``directory("{x}")``)
matches every path and its ancestors, and it would rely on Snakemake internals besides. For a
prefix written by hand, ``resilient run`` itself notices on the second attempt that the
directory was deleted since an unfinished attempt (:mod:`resilient.job.run`) and exits 78 too.

**Settings are names, not text.** The text of a rule's shell command is one of Snakemake's
rerun triggers ("code"): a finished job whose command text changed runs again. So what belongs
to this run rather than to the task (the interpreter, the simulated walltime) is not written
into the command: :func:`resilient_run` puts it into the Snakefile's namespace
(``workflow.globals``) under a name (``_resilient_run``, ``_resilient_python``) and the
command refers to it (``{_resilient_run} --checkpoint-dir ...``); switching profiles or
walltimes reruns nothing. Without a running workflow (a test, a fake) the text is inlined.

No snakemake import at module level: the running workflow is looked up lazily
(``snakemake.workflow.workflow``, set by Snakemake when it parses a Snakefile), and every
helper also takes it as ``workflow=``.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from resilient.job.launch import find_mpiexec
from resilient.job.options import RunOptions, parse_duration, parse_signal_spec
from resilient.workflow import checkpoint_dir, cleanup, latest_checkpoint, stale_siblings

__all__ = [
    "CONFIG_KEYS",
    "MpiLaunch",
    "SimulatedWalltime",
    "TaskLabel",
    "checkpoint_dir",
    "cleanup",
    "cleanup_command",
    "latest_checkpoint",
    "mpi_resources",
    "resilient_run",
    "retries",
    "simulated_walltime",
    "slurm_requeue",
    "stale_siblings",
]

CONFIG_KEYS = (
    "resilient_walltime",
    "resilient_requeue",
    "resilient_signal",
    "resilient_kill_wait",
    "resilient_slurm_requeue",
)
"""The workflow-config keys :func:`resilient_run` reads (a profile's ``config:``)."""

_UNSET = ("", "null", "none", "~", "false", "no", "off", "0")


def _current_workflow() -> Any:
    """The Workflow Snakemake is running in this process, else ``None``."""
    try:
        import snakemake.workflow as snakemake_workflow
    except ImportError:
        return None
    return getattr(snakemake_workflow, "workflow", None)


def _is_unset(value: Any) -> bool:
    return value is None or value is False or str(value).strip().lower() in _UNSET


def _flag(key: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"config {key}: expected true or false, got {value!r}")


def _shell_literal(text: str) -> str:
    """``text`` quoted for the shell and with its braces escaped for Snakemake's formatting."""
    return shlex.quote(text).replace("{", "{{").replace("}", "}}")


def _python() -> str:
    """This interpreter (Snakemake's), quoted: the venv's, whatever PATH says."""
    return shlex.quote(sys.executable)


def _by_name(workflow: Any, name: str, value: str) -> str:
    """``{name}``, with ``value`` put into the Snakefile's namespace under ``name``; without
    one (no running workflow) ``value`` itself, braces escaped for Snakemake's formatting."""
    namespace = getattr(workflow, "globals", None) if workflow is not None else None
    if isinstance(namespace, MutableMapping):
        namespace[name] = value
        return "{" + name + "}"
    return value.replace("{", "{{").replace("}", "}}")


class TaskLabel:
    """Formats as its format spec, shell-quoted: the rule and its wildcards as one word.

    :func:`resilient_run` writes ``--task {_resilient_task:{rule} {wildcards}:u}``. Snakemake
    fills the nested fields into the spec first, ``{wildcards}`` as ``case=a,n=1`` (its
    names and values, sorted by name; Snakemake 9), then formats this object with that spec;
    the ``:u`` keeps Snakemake from quoting or stripping it, and :meth:`__format__` quotes it
    for the shell. The rendering of ``{wildcards}`` itself cannot go into the command: Snakemake
    ignores ``:q`` on it (9.27.1: ``{wildcards:q}`` renders ``case=x'y;$(id)`` as is, which the
    shell would run), and the quoted conversions (``{wildcards!r:q}``) drop the names.
    Another rendering of ``{wildcards}`` (the values alone) still yields a safe word.
    """

    __slots__ = ()

    def __format__(self, spec: str) -> str:
        text = spec[: -len(":u")] if spec.endswith(":u") else spec.removesuffix(":")
        return shlex.quote(" ".join(text.split()) or "task")


_TASK = "{_resilient_task:{rule} {wildcards}:u}"
"""The ``--task`` word of :func:`resilient_run` where a workflow is running (see
:class:`TaskLabel`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatedWalltime:
    """A walltime that ``resilient run`` plays locally (USR1, SIGTERM, SIGKILL per attempt)."""

    walltime_s: float
    """Seconds per attempt."""
    requeue: bool = True
    """Start the program again in place after a walltime stop (no Snakemake retry spent)."""
    signal: str | None = None
    """Warning signal and its lead, ``SIG@SECONDS``; ``None``: ``resilient run``'s default."""
    kill_wait_s: float | None = None
    """SIGTERM to SIGKILL; ``None``: ``resilient run``'s default."""

    def __post_init__(self) -> None:
        if not self.walltime_s > 0:
            raise ValueError(f"walltime_s must be > 0, got {self.walltime_s}")
        if self.signal is not None:
            parse_signal_spec(self.signal)
        if self.kill_wait_s is not None and self.kill_wait_s < 0:
            raise ValueError(f"kill_wait_s must be >= 0, got {self.kill_wait_s}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SimulatedWalltime | None:
        """From a workflow config's ``resilient_*`` keys; ``None`` without a walltime.

        Values given with ``--config`` arrive as strings: ``6``, ``90s``, ``5m``, ``true``.

        Raises:
            ValueError: a value is malformed (the message names the key).
        """
        raw = config.get("resilient_walltime")
        if _is_unset(raw):
            return None
        try:
            walltime = parse_duration(str(raw))
            requeue = _flag("resilient_requeue", config.get("resilient_requeue", True))
            sig = config.get("resilient_signal")
            wait = config.get("resilient_kill_wait")
            return cls(
                walltime_s=walltime,
                requeue=requeue,
                signal=None if _is_unset(sig) else str(sig),
                kill_wait_s=None if wait is None else parse_duration(str(wait)),
            )
        except ValueError as exc:
            raise ValueError(f"config resilient_*: {exc}") from None

    def options(self, *, min_walltime_s: float | None = None) -> list[str]:
        """``resilient run``'s options for this walltime (at least ``min_walltime_s``)."""
        given: dict[str, Any] = {}
        if self.signal is not None:
            given["warn_signal"], given["warn_before_s"] = parse_signal_spec(self.signal)
        if self.kill_wait_s is not None:
            given["kill_wait_s"] = self.kill_wait_s
        walltime = max(self.walltime_s, min_walltime_s or 0.0)
        opts = RunOptions(command=(), walltime_s=walltime, requeue=self.requeue, **given)
        return opts.option_words()


def simulated_walltime(workflow: Any = None) -> SimulatedWalltime | None:
    """The running workflow's simulated walltime (its config's ``resilient_*`` keys), if any."""
    wf = workflow if workflow is not None else _current_workflow()
    config = getattr(wf, "config", None) if wf is not None else None
    return SimulatedWalltime.from_config(config) if isinstance(config, Mapping) else None


def slurm_requeue(workflow: Any = None) -> bool:
    """Whether the running workflow's config asks for Slurm's requeue in place
    (``resilient_slurm_requeue``, default false).

    Raises:
        ValueError: the value is not a boolean.
    """
    wf = workflow if workflow is not None else _current_workflow()
    config = getattr(wf, "config", None) if wf is not None else None
    if not isinstance(config, Mapping) or _is_unset(config.get("resilient_slurm_requeue")):
        return False
    return _flag("resilient_slurm_requeue", config["resilient_slurm_requeue"])


def retries(n: int, workflow: Any = None) -> int:
    """A rule's ``retries:``: ``n`` where Snakemake submits the jobs, 0 inside a cluster job.

    Inside a job of a cluster executor (``workflow.remote_exec``: Snakemake re-runs the rule
    there with ``--mode remote``) a rule's retries would restart the program at once in the
    same, nearly expired allocation; the submitting Snakemake's retries resubmit it instead.
    ``workflow`` defaults to the one Snakemake is running.
    """
    if n < 0:
        raise ValueError(f"retries must be >= 0, got {n}")
    wf = workflow if workflow is not None else _current_workflow()
    return 0 if wf is not None and bool(getattr(wf, "remote_exec", False)) else n


def _placeholder(text: str) -> str:
    """A Snakemake placeholder gets ``:q`` (``{params.ckpt}`` -> ``{params.ckpt:q}``); a
    plain path is quoted."""
    if text.startswith("{") and text.endswith("}") and text.count("{") == 1:
        return text if ":" in text else text[:-1] + ":q}"
    if "{" in text:
        return text  # a template of the user's (e.g. "ckpt/{wildcards.case}"): as given
    return _shell_literal(text)


def mpi_resources(*, tasks: int, nodes: int = 1, launcher: str | None = None) -> dict[str, Any]:
    """A rule's ``resources:`` for an MPI program of ``tasks`` ranks on ``nodes`` nodes:
    ``resources: **mpi_resources(nodes=2, tasks=4)``.

    It gives ``nodes``, ``tasks`` and ``mpi``, the launcher: the Slurm executor plugin asks
    Slurm for the nodes and tasks, and, seeing ``mpi``, runs the rule's shell in the batch step,
    where the launcher reaches every node (without it: a one-node job step). Pair it with
    ``resilient_run(mpi=True)``, which starts the program with that launcher and those counts.

    Args:
        tasks: MPI ranks (the plugin wants more than 1 for an MPI job).
        nodes: nodes of the job.
        launcher: the ``mpi`` resource; default ``srun`` where ``srun`` is on ``PATH`` (a
            Slurm cluster: add ``--mpi=pmi2`` for MPICH where the site's ``MpiDefault`` is
            none), else the ``mpiexec`` of this environment. A profile's ``set-resources``
            may override it.

    Raises:
        ValueError: fewer than one task or node, or fewer tasks than nodes.
    """
    if nodes < 1 or tasks < 1 or tasks < nodes:
        raise ValueError(f"need 1 <= nodes <= tasks, got nodes={nodes}, tasks={tasks}")
    if launcher is None:
        launcher = "srun" if shutil.which("srun") else find_mpiexec(fallback="mpiexec")
    return {"nodes": nodes, "tasks": tasks, "mpi": launcher}


class MpiLaunch:
    """Formats as the launcher words for its spec ``LAUNCHER|NODES|TASKS``.

    ``resilient_run(mpi=True)`` writes ``{_resilient_mpi:{resources.mpi}|{resources.nodes}|
    {resources.tasks}:u}``: Snakemake fills the job's resources into the spec when the job
    runs (after a profile's ``set-resources``), then formats this object with it. ``srun``
    gets the node count too (``srun --mpi=pmi2 -N 2 -n 4``: in the batch step it would
    otherwise choose the nodes itself), any other launcher only the ranks (``mpiexec -n 4``:
    ``-N`` means something else to Open MPI's ``mpirun``). The launcher is the rule's own
    shell text, left unquoted.
    """

    __slots__ = ()

    def __format__(self, spec: str) -> str:
        text = spec[: -len(":u")] if spec.endswith(":u") else spec.removesuffix(":")
        parts = [p.strip() for p in text.rsplit("|", 2)]
        if len(parts) != 3 or not parts[0] or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(
                f"resilient_run(mpi=True): want the rule's resources mpi (a launcher), nodes and "
                f"tasks (numbers), got {text!r}: use resources: **mpi_resources(nodes=N, tasks=T)"
            )
        launcher, nodes, tasks = parts
        if Path(launcher.split()[0]).name == "srun":
            return f"{launcher} -N {nodes} -n {tasks}"
        return f"{launcher} -n {tasks}"


_MPI = "{_resilient_mpi:{resources.mpi}|{resources.nodes}|{resources.tasks}:u}"
"""The launcher words of ``resilient_run(mpi=True)`` where a workflow is running."""


def resilient_run(
    checkpoint_dir: str = "{params.ckpt}",
    *,
    mpi: bool = False,
    min_walltime: float | None = None,
    min_kill_wait: float | None = None,
    workflow: Any = None,
) -> str:
    """The shell prefix that runs a rule's command through ``resilient run``.

    ``{_resilient_run} --checkpoint-dir {params.ckpt:q} --task {_resilient_task:{rule}
    {wildcards}:u} --outputs {output:q} --`` (append the command), where ``_resilient_run`` is
    ``<this python> -m resilient.cli run`` plus the walltime options of the workflow's config
    (:class:`SimulatedWalltime`: a local profile's ``resilient_walltime``); without one there
    are none, and on Slurm the job's own end time applies. The ``--task`` word is the rule and
    its wildcards, shell-quoted (``'sim case=a'``, :class:`TaskLabel`): ``resilient run`` puts
    it on every line it logs.

    With the workflow config's ``resilient_slurm_requeue: true`` and no simulated walltime
    it adds ``--requeue``: on Slurm a stop at the job's time limit requeues the job in place.

    Args:
        checkpoint_dir: a placeholder (``{params.ckpt}``, quoted for the shell here) or a
            plain path. Never ``{output}``: ``resilient run`` refuses a checkpoint directory
            that is, or lies in, one of the job's outputs.
        mpi: end with the rule's MPI launcher and its counts (:func:`mpi_resources`,
            :class:`MpiLaunch`), so that only the program follows; without a running
            workflow ``{resources.mpi} -n {resources.tasks}``.
        min_walltime: seconds; a simulated walltime is at least this (a slow-starting program).
        min_kill_wait: seconds; a simulated walltime's SIGTERM-to-SIGKILL wait is at least this.
        workflow: the Snakemake workflow; default the one being parsed.

    Raises:
        ValueError: a ``resilient_*`` config value is malformed.
    """
    wf = workflow if workflow is not None else _current_workflow()
    wall = simulated_walltime(wf)
    command = [_python(), "-m", "resilient.cli", "run"]
    name = "_resilient_run"
    if wall is not None:
        if min_kill_wait is not None:
            wall = replace(wall, kill_wait_s=max(wall.kill_wait_s or 5.0, min_kill_wait))
        command += [shlex.quote(o) for o in wall.options(min_walltime_s=min_walltime)]
    elif slurm_requeue(wf):
        command.append("--requeue")
    for tag, value in (("w", min_walltime), ("k", min_kill_wait)):
        if value is not None:  # another name per variant, the same whatever the profile
            name += f"_{tag}{value:g}".replace(".", "_").replace("-", "_")
    parts = [
        _by_name(wf, name, " ".join(command)),
        "--checkpoint-dir", _placeholder(checkpoint_dir),
        "--task", _task_word(wf), "--outputs", "{output:q}",
    ]  # fmt: skip
    launch = [_mpi_words(wf)] if mpi else []
    return " ".join([*parts, "--", *launch, ""])


def _mpi_words(workflow: Any) -> str:
    """The launcher words of ``resilient_run(mpi=True)`` (:class:`MpiLaunch`, put into the
    Snakefile's namespace as ``_resilient_mpi``); without a running workflow the plain form."""
    namespace = getattr(workflow, "globals", None) if workflow is not None else None
    if isinstance(namespace, MutableMapping):
        namespace["_resilient_mpi"] = MpiLaunch()
        return _MPI
    return "{resources.mpi} -n {resources.tasks}"


def _task_word(workflow: Any) -> str:
    """``--task``'s word: the rule and its wildcards (:class:`TaskLabel`, put into the
    Snakefile's namespace as ``_resilient_task``); without a running workflow ``{rule}``."""
    namespace = getattr(workflow, "globals", None) if workflow is not None else None
    if isinstance(namespace, MutableMapping):
        namespace["_resilient_task"] = TaskLabel()
        return _TASK
    return "{rule}"


def cleanup_command(
    checkpoint_dir: str = "{params.ckpt}", outputs: str = "{output}", *, workflow: Any = None
) -> str:
    """``<this python> -m resilient.workflow cleanup {params.ckpt:q} {output:q}``: after a
    finished job (``&& ...``), delete its checkpoint data and keep the logs. It never fails
    the job (see :func:`resilient.workflow.main`)."""
    wf = workflow if workflow is not None else _current_workflow()
    return " ".join(
        [_by_name(wf, "_resilient_python", _python()), "-m", "resilient.workflow", "cleanup",
         _placeholder(checkpoint_dir), _placeholder(outputs)]
    )  # fmt: skip
