"""The task's declared outputs, which an engine deletes: never the checkpoint directory.

A workflow engine deletes a task's declared outputs before every retry and after a failure
(Snakemake does), so a checkpoint directory among them would make every attempt start again
from step 0. :func:`not_this_runs` says why a checkpoint directory is the engine's rather than
this run's (exit 78, before the first attempt): it is, or lies in, a declared output
(``--outputs``), or it vanished since the last unfinished attempt (its sidecar,
:func:`resilient.job.ledger.sidecar_path`, remembers it). :func:`make_output_folders` creates
the outputs' folders as Snakemake does (Parsl does not), and :func:`set_aside` renames the
outputs of another run out of the way after the program refused its directory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from resilient.io import logs, storage
from resilient.job.exitcodes import EXIT_FOREIGN_RUN
from resilient.job.ledger import sidecar_path
from resilient.job.options import RunOptions

__all__ = ["make_output_folders", "not_this_runs", "set_aside"]

log = logging.getLogger("resilient.job.run")  # the lines of ``resilient run``


def _containing_output(checkpoint_dir: Path, outputs: Sequence[Path]) -> Path | None:
    """The first output that is ``checkpoint_dir`` or a directory above it, else ``None``."""
    ck = Path(os.path.realpath(checkpoint_dir))
    for out in outputs:
        resolved = Path(os.path.realpath(out))
        if ck == resolved or resolved in ck.parents:
            return out
    return None


_KEEP_OUT_OF_OUTPUTS = (
    "Keep checkpoints out of a task's outputs: the engine deletes a task's declared outputs "
    "before every retry and after a failure (Snakemake does), so each attempt would start "
    "again from step 0. In Snakemake make the directory a param, "
    '`params: ckpt=lambda wc: checkpoint_dir("ckpt", "<rule>", ..., wildcards=wc)`, and '
    "pass it with `--checkpoint-dir {params.ckpt:q}` (resilient_run() does)"
)


def not_this_runs(opts: RunOptions, ckdir: Path) -> str | None:
    """Why ``ckdir`` belongs to the engine rather than this run (exit 78), else ``None``."""
    task = f"task {opts.task!r}" if opts.task else "the task"
    out = _containing_output(ckdir, opts.outputs)
    if out is not None:
        where = "is" if Path(os.path.realpath(out)) == Path(os.path.realpath(ckdir)) else "lies in"
        return (
            f"the checkpoint directory {ckdir} {where} the declared output {out} of {task}. "
            f"{_KEEP_OUT_OF_OUTPUTS}. Not starting (exit {EXIT_FOREIGN_RUN})"
        )
    damaged = storage.marker_problem(ckdir)
    if damaged is not None:
        return f"{damaged}. Not starting (exit {EXIT_FOREIGN_RUN})"
    records = logs.read_log(sidecar_path(ckdir), logs.SIDECAR)
    last = records[-1] if records else None
    if last is None or last["exit_code"] == 0:
        return None
    if storage.is_root(ckdir):  # still the same root (a reset ledger is fine: the 93 advice)
        return None
    return (
        f"the checkpoint directory {ckdir} of {task} was deleted after attempt {last['attempt']} "
        f"(exit {last.get('exit_code')}), with its checkpoints and its logs: most likely it "
        f"is (or lies in) a declared output of the task. {_KEEP_OUT_OF_OUTPUTS}. Not starting "
        f"again from step 0 (exit {EXIT_FOREIGN_RUN}). If you deleted it yourself to start "
        f"over, delete {sidecar_path(ckdir)} too"
    )


def make_output_folders(outputs: Sequence[Path]) -> None:
    """Create the folders the declared outputs go into, as Snakemake does for a job's outputs
    (Parsl does not: a program writing ``out/sim.h5`` would fail without ``out/``). A folder
    that cannot be made is logged and left to the program to report."""
    for out in outputs:
        try:
            Path(os.path.abspath(out)).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cannot create the folder of the output %s: %s", out, exc)


def set_aside(outputs: Sequence[Path], ckdir: Path) -> None:
    """After the program refused a directory of another run (78): the declared outputs on disk
    are that other run's results, not this one's. Rename each out of the way (never delete),
    unless it holds the checkpoint directory."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for out in outputs:
        if not out.exists() or _containing_output(ckdir, [out]) is not None:
            continue
        aside = out.with_name(f"{out.name}.other-run-{stamp}")
        try:
            os.rename(out, aside)
        except OSError as exc:
            log.warning("could not set %s aside: %s", out, exc)
            continue
        log.warning(
            "set %s aside as %s: written by another run (the checkpoint directory's parameters "
            "differ), it is not this run's result", out, aside.name,
        )  # fmt: skip
