"""Parsl integration: commands for your own apps, a resume-aware retry handler, YAML configs.

Three modules, each usable alone:

* :mod:`~resilient.integrations.parsl.commands` -- :func:`resilient_command` (what a
  ``@bash_app`` returns: ``resilient run ... -- PROGRAM``) and :func:`run_resilient` (the same
  inside a ``@python_app``; failures raise :class:`ResumableCommandError`);
* :mod:`~resilient.integrations.parsl.retry` -- :func:`resume_retry_handler`, a
  ``Config(retry_handler=...)`` that charges nothing for a try that committed a newer
  checkpoint and stops at once on exits 93, 74 and 78;
* :mod:`~resilient.integrations.parsl.config` -- :func:`load_config`, an optional strict loader
  for ``configs/parsl/*.yaml`` (schema in its docstring).

The core of ``resilient`` never imports this package.
"""

from __future__ import annotations

from resilient.integrations.parsl.commands import (
    ForeignRunRefused,
    NoProgressRefused,
    ResumableCommandError,
    resilient_argv,
    resilient_command,
    run_resilient,
)
from resilient.integrations.parsl.config import build_config, load_config
from resilient.integrations.parsl.retry import exit_code_of, find_roots, resume_retry_handler

__all__ = [
    "ForeignRunRefused",
    "NoProgressRefused",
    "ResumableCommandError",
    "build_config",
    "exit_code_of",
    "find_roots",
    "load_config",
    "resilient_argv",
    "resilient_command",
    "resume_retry_handler",
    "run_resilient",
]
