"""torch, reached lazily: the one way the library gets at it (a process group aside).

``import resilient`` never imports torch (``tests/unit/test_import.py``), and a state without
tensors never needs it. A tensor comes from a program that has imported torch already, so a
save asks :func:`loaded` (torch if this process has imported it, else ``None``: never an
import); what works on tensors it was handed, or restores a leaf saved from one, asks
:func:`load`.

The import contract in ``pyproject.toml`` lets this module and
:mod:`resilient.parallel.torchdist` (a torch.distributed process group) import torch, and no
other module: the rest comes here, so the contract sees every way to torch.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dtensor_type", "load", "loaded"]


def loaded() -> Any | None:
    """The torch module if this process has imported it, else ``None``; never imports it."""
    return sys.modules.get("torch")


def load() -> Any:
    """The torch module, imported now if it is not yet (``ImportError`` without torch)."""
    import torch

    return torch


def dtensor_type() -> Any | None:
    """``torch.distributed.tensor.DTensor`` if this process has imported that module (a
    program holding a DTensor has), else ``None``; never imports it."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else getattr(module, "DTensor", None)
