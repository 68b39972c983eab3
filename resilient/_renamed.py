"""Keywords the public API renamed: the old name still works for a while, and says so.

:func:`renamed_keyword` wraps a function (or a class's ``__init__``) so that a call with the old
keyword is the call with the new one, after one :class:`DeprecationWarning` that names the new
keyword; a call with both is a :class:`TypeError`. The signature (and so the API reference)
shows the new name only. The renames:

* the checkpoint directory (the term of the docs' concepts page) is ``checkpoint_dir``
  everywhere: ``root`` (``CheckpointManager``, ``resilient.export.export``,
  ``resilient.report.task_report``) and ``ckpt_dir`` (``Session``, ``resumable``, the helpers
  of ``resilient.workflow``) are its deprecated aliases.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["renamed_keyword"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Decorator: ``fn(..., old=value)`` is ``fn(..., new=value)``, with a ``DeprecationWarning``.

    The warning (one per call) names the new keyword and points at the caller's line; giving
    both keywords raises ``TypeError``, as a repeated keyword would.
    """

    def decorate(fn: F) -> F:
        name = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(
                        f"{name}() got both {new!r} and {old!r}, its deprecated alias: "
                        f"give {new!r} only"
                    )
                warnings.warn(
                    f"keyword {old!r} of {name}() is deprecated; use {new!r} (the same value)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate
