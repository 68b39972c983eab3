"""The exit-code contract between programs, ``resilient run`` and workflow engines.

The codes, and the named rules over them that ``resilient run`` (:mod:`resilient.job.outcome`,
:mod:`resilient.job.requeue`), :mod:`resilient.job.guard` and the Parsl retry handler share:

* :func:`passed_through`: the program's own verdicts, passed on as they are (0, 74, 78);
* :func:`is_final` (:data:`FINAL`, with what each means): retrying cannot help (93, 74, 78);
* :func:`ends_run`: the run ended for good: an engine's retry is refused at once (93, 78);
* :func:`is_over`: finished, or final: neither relaunched nor requeued (0, 93, 74, 78);
* :func:`of_the_contract`: one of the contract's own codes, not the program's failure
  (0, 75, 93, 74, 78): a crash that ``--retries`` relaunches has none of them.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ENDS_RUN",
    "EXIT_CONFIG",
    "EXIT_FOREIGN_RUN",
    "EXIT_NO_PROGRESS",
    "EXIT_OK",
    "EXIT_PERMANENT",
    "EXIT_RESUME",
    "FINAL",
    "PASSED_THROUGH",
    "ends_run",
    "is_final",
    "is_over",
    "of_the_contract",
    "passed_through",
]

EXIT_OK = 0  # the program finished
EXIT_PERMANENT = 74  # EX_IOERR: a permanent storage error (disk full, no permission, read-only)
EXIT_RESUME = 75  # EX_TEMPFAIL: stopped early with progress saved: resume me
# EX_CONFIG: a mistake in the workflow, not in the program: do not retry, fix it. Either the
# checkpoint directory is not this run's (EXIT_FOREIGN_RUN): it belongs to another run (another
# run_key), or to the workflow engine (it is a declared output, or was deleted between
# attempts); or the job's layout cannot run the command (a multi-node Snakemake rule started in
# a one-node job step: resilient.job.steps).
EXIT_CONFIG = 78
EXIT_FOREIGN_RUN = EXIT_CONFIG
EXIT_NO_PROGRESS = 93  # no progress for N consecutive attempts: do not retry

PASSED_THROUGH = frozenset({EXIT_OK, EXIT_PERMANENT, EXIT_FOREIGN_RUN})
"""The program's exit statuses that ``resilient run`` passes on as they are: the program said
how it ended (finished, a permanent storage error, another run's directory)."""

FINAL: Mapping[int, str] = {
    EXIT_NO_PROGRESS: "no progress for too long",
    EXIT_PERMANENT: "permanent storage error",
    EXIT_FOREIGN_RUN: "the checkpoint directory belongs to another run",
}
"""The codes after which retrying cannot help, and what each means."""

ENDS_RUN = frozenset({EXIT_NO_PROGRESS, EXIT_FOREIGN_RUN})
"""The codes that end a run for good: an engine's retry of it is refused at once, without
starting the program (:mod:`resilient.job.guard`); a new run starts again."""


def passed_through(status: int) -> bool:
    """Whether the program's exit ``status`` is its own verdict, passed on as it is."""
    return status in PASSED_THROUGH


def is_final(code: int) -> bool:
    """Whether retrying after exit ``code`` cannot help (93, 74, 78)."""
    return code in FINAL


def ends_run(code: int) -> bool:
    """Whether exit ``code`` ended the run for good (93, 78): an engine's retry is refused."""
    return code in ENDS_RUN


def is_over(code: int) -> bool:
    """Whether the run is over after exit ``code``: finished, or final (never relaunched or
    requeued)."""
    return code == EXIT_OK or is_final(code)


def of_the_contract(code: int) -> bool:
    """Whether ``code`` is one of the contract's own codes (0, 75, 93, 74, 78) rather than the
    program's own failure."""
    return code == EXIT_RESUME or is_over(code)
