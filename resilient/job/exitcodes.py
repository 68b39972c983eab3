"""The exit-code contract between programs, ``resilient run`` and workflow engines."""

from __future__ import annotations

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FOREIGN_RUN",
    "EXIT_NO_PROGRESS",
    "EXIT_OK",
    "EXIT_PERMANENT",
    "EXIT_RESUME",
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
