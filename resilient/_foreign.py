"""Another vendor's ``resilient`` in this environment: find it cheaply, say so loudly.

This project is the distribution ``resilient-hpc``; its import package is ``resilient``. The
distribution named ``resilient`` on PyPI is another vendor's (IBM SOAR's REST API client) and
installs an import package named ``resilient`` too, so the two overwrite each other's files:
whichever was installed last owns ``resilient/__init__.py``, and uninstalling either one deletes
files the other needs. The fix is to remove both and install ours again (:data:`FIX`).

:func:`warn_if_foreign` runs when ``resilient`` is imported, so it must cost next to nothing (no
:mod:`importlib.metadata`, which alone takes longer to import than this package): it lists the
package's own directory, and each directory on ``sys.path`` that holds a ``resilient``
package, once, and looks for

* files of the other package inside ours (``co3.py``, ``app_config.py``, ...), and
* the other distribution's metadata, ``resilient-<version>.dist-info`` (or ``.egg-info``), next
  to any ``resilient`` that Python could import. Ours is ``resilient_hpc-<version>.dist-info``.
  A regular install of this project from before the rename is a distribution named
  ``resilient`` too: the same fix applies; the message gives the version and summary it found.

A warning, not an ImportError: when this code runs, our ``__init__`` and modules are the ones
being imported, and checkpoints are written and read correctly; what is broken is the other
package and the next ``pip uninstall``. Refusing to import would stop a running campaign (every
requeued job) over a problem that does not touch its results. The warning is a
:class:`ForeignPackageWarning`, a ``UserWarning``: Python shows it by default,
once per process, and only an explicit filter hides it.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

__all__ = [
    "FIX",
    "FOREIGN_FILES",
    "ForeignPackageWarning",
    "find_foreign",
    "message",
    "warn_if_foreign",
]


class ForeignPackageWarning(UserWarning):
    """Another vendor's distribution named ``resilient`` (PyPI's, IBM SOAR's REST API client)
    is installed beside this one (``resilient-hpc``); both install the import package
    ``resilient``. Given by ``import resilient``, with the fix; ``resilient.ForeignPackageWarning``.
    """


FIX = "pip uninstall resilient resilient-hpc && pip install resilient-hpc"
"""Both distributions share the import package: remove both, then install ours again."""

FOREIGN_FILES = frozenset(
    {
        "co3.py",
        "co3base.py",
        "co3argparse.py",
        "co3sslutil.py",
        "app_config.py",
        "resilient_rest_mock.py",
    }
)
"""Modules that the other ``resilient`` (51.x) installs into the import package and we never
ship (``tests/unit/test_foreign.py`` checks the latter)."""

_DIST_NAME = "resilient"
_SUFFIXES = (".dist-info", ".egg-info")


def message(found: Sequence[str]) -> str:
    """The warning's text for :func:`find_foreign`'s paths: what was found, why it matters,
    the fix."""
    shown = ", ".join(_describe(p) for p in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return (
        "another package named 'resilient' is installed in this environment: "
        f"{shown}{more}. It shares the import package 'resilient' with this project "
        "(resilient-hpc), so the two overwrite each other's files and uninstalling either "
        f"one breaks the other. Fix: {FIX}"
    )


def _describe(path: str) -> str:
    """``path``, with the distribution's version and summary when it is metadata."""
    if not _is_foreign(os.path.basename(path)):
        return path
    fields = _metadata_fields(path)
    name = fields.get("Name", _DIST_NAME)
    version = fields.get("Version", "?")
    summary = fields.get("Summary")
    return f"{name} {version}" + (f" ({summary})" if summary else "") + f" at {path}"


def _metadata_fields(path: str) -> dict[str, str]:
    """Name, Version and Summary from a dist-info's METADATA or an egg-info's PKG-INFO."""
    fields: dict[str, str] = {}
    for name in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(path, name), encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        break  # the headers end at the first blank line
                    key, sep, value = line.partition(":")
                    if sep and key in ("Name", "Version", "Summary") and key not in fields:
                        fields[key] = value.strip()
        except OSError:
            continue
        break
    return fields


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _is_foreign(entry: str) -> bool:
    """``resilient-51.0.9.1.dist-info`` and ``resilient-51.0.9.1-py3.11.egg-info``, not
    ``resilient_hpc-0.1.0.dist-info`` nor a source tree's version-less ``resilient.egg-info``."""
    if not entry.endswith(_SUFFIXES):
        return False
    head, sep, rest = entry.partition("-")
    return bool(sep) and head.lower() == _DIST_NAME and rest[:1].isdigit()


def find_foreign(package_dir: str, path: Sequence[str] | None = None) -> tuple[str, ...]:
    """The other ``resilient``'s metadata on ``path`` and its files in ``package_dir``.

    Args:
        package_dir: the directory of the ``resilient`` package being imported.
        path: the directories to look for distribution metadata in (besides the one that
            holds ``package_dir``), where they hold a ``resilient`` package; default
            ``sys.path``.

    Returns:
        Full paths, metadata directories first; empty when nothing was found.
    """
    found: list[str] = []
    seen: set[str] = set()
    for entry in [os.path.dirname(package_dir), *(sys.path if path is None else path)]:
        where = os.path.abspath(entry or os.curdir)
        # metadata lies beside the package it installed: list only where a `resilient` is
        if where not in seen and os.path.isdir(os.path.join(where, "resilient")):
            seen.add(where)
            found += sorted(os.path.join(where, e) for e in _listdir(where) if _is_foreign(e))
    found += sorted(
        os.path.join(package_dir, e) for e in _listdir(package_dir) if e in FOREIGN_FILES
    )
    return tuple(found)


_checked = False


def warn_if_foreign(package_dir: str | None = None) -> tuple[str, ...]:
    """Warn (:class:`ForeignPackageWarning`) once per process if
    :func:`find_foreign` finds the other ``resilient``; later calls do nothing.

    Args:
        package_dir: default the directory of this ``resilient`` package.

    Returns:
        What :func:`find_foreign` found (empty on later calls).
    """
    global _checked
    if _checked:
        return ()
    _checked = True
    found = find_foreign(package_dir or os.path.dirname(os.path.abspath(__file__)))
    if found:
        warnings.warn(message(found), ForeignPackageWarning, stacklevel=2)
    return found
