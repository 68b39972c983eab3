"""The exit-code contract between programs, ``resilient run`` and workflow engines."""

from __future__ import annotations

__all__ = ["EXIT_NO_PROGRESS", "EXIT_OK", "EXIT_PERMANENT", "EXIT_RESUME"]

EXIT_OK = 0  # the program finished
EXIT_PERMANENT = 74  # EX_IOERR: a permanent storage error (disk full, no permission, read-only)
EXIT_RESUME = 75  # EX_TEMPFAIL: stopped early with progress saved: resume me
EXIT_NO_PROGRESS = 93  # no progress for N consecutive attempts: do not retry
