"""``@resumable``: re-run an in-process function from its latest valid checkpoint after an error.

::

    @resilient.resumable("ckpt/train", retries=3, save_when=EverySteps(100))
    def train(ckpt, n_steps):
        step, state = ckpt.step, ckpt.state or init()
        while step < n_steps:
            state = update(state); step += 1
            ckpt.maybe_save(step, state, metrics={"loss": loss(state)})
        return state

    train(10_000)   # called as usual: the first argument is supplied by the decorator

For one process (no MPI). Retries use tenacity (exponential backoff, a log line per retry);
permanent storage errors (disk full, permission denied, read-only) are not retried.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

from resilient._renamed import renamed_keyword
from resilient.checkpoint.manager import CheckpointManager
from resilient.checkpoint.restorer import StateValidator
from resilient.errors import CheckpointNotFoundError
from resilient.io.storage import is_permanent_storage_error
from resilient.model.policies import KeepPolicyLike, SavePolicyLike

__all__ = ["Resume", "resumable"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class Resume:
    """What a ``@resumable`` function gets: where to start and how to save.

    Attributes:
        step: the step restored (``0`` on a fresh start).
        state: the restored state, or ``None`` on a fresh start.
        attempt: 1 for the first call, 2 for the first retry, ...
        manager: the underlying :class:`CheckpointManager`.
    """

    step: int
    state: dict[str, Any] | None
    attempt: int
    manager: CheckpointManager
    saves: list[int] = field(default_factory=list)

    def maybe_save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Save if the manager's ``save_when`` policy says so; return whether it saved."""
        if not self.manager.should_save(step):
            return False
        self.save(step, state, metrics=metrics)
        return True

    def save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> None:
        """Save a checkpoint of ``step`` now."""
        self.manager.save(step, state, metrics=metrics)
        self.saves.append(step)


@renamed_keyword("ckpt_dir", "checkpoint_dir")
def resumable(
    checkpoint_dir: str | os.PathLike[str],
    *,
    retries: int = 3,
    backoff_s: float = 1.0,
    backoff_max_s: float = 60.0,
    save_when: SavePolicyLike | None = None,
    keep: KeepPolicyLike | None = None,
    validate: StateValidator | None = None,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    sleep: Callable[[float], None] | None = None,
) -> Callable[[Callable[Concatenate[Resume, P], R]], Callable[P, R]]:
    """Decorate ``fn(resume, *args, **kwargs)`` so that it resumes after exceptions.

    The decorated function is called without the :class:`Resume` (``train(10_000)``); each
    call binds its arguments to ``fn``'s signature after the ``Resume`` before the first
    attempt, so a mismatch is a ``TypeError`` at once, never retried. Exceptions ``fn`` raises
    itself (a ``TypeError`` too) are retried as ``retry_on`` says.

    Args:
        checkpoint_dir: the checkpoint directory of this function (``ckpt_dir`` is its deprecated
            alias).
        retries: how many times to re-call after an exception (``retries + 1`` calls at most).
        backoff_s, backoff_max_s: exponential backoff between calls.
        save_when, keep: policies of the checkpoint manager.
        validate: ``callable(state) -> bool`` run on each restore (a rejected checkpoint is
            quarantined and the next older one tried).
        retry_on: exception types that trigger a retry.
        sleep: injectable sleep (tests).
    """
    import time

    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    def should_retry(exc: BaseException) -> bool:
        return isinstance(exc, retry_on) and not is_permanent_storage_error(exc)

    def before_sleep(rs: Any) -> None:
        exc = rs.outcome.exception() if rs.outcome else None
        log.warning(
            "%s failed (call %d of %d): %s; resuming from the latest valid checkpoint",
            checkpoint_dir,
            rs.attempt_number,
            retries + 1,
            exc,
        )

    def decorate(fn: Callable[Concatenate[Resume, P], R]) -> Callable[P, R]:
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a callable without a signature: nothing to check
            signature = None

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if signature is not None:
                _check_arguments(fn, signature, args, kwargs)
            calls = 0

            def call() -> R:
                nonlocal calls
                calls += 1
                with CheckpointManager(checkpoint_dir, save_when=save_when, keep=keep) as mgr:
                    try:
                        step, state = mgr.restore(validate=validate)
                        resume = Resume(step=step, state=state, attempt=calls, manager=mgr)
                    except CheckpointNotFoundError:
                        resume = Resume(step=0, state=None, attempt=calls, manager=mgr)
                    return fn(resume, *args, **kwargs)

            retrying = Retrying(
                stop=stop_after_attempt(retries + 1),
                wait=wait_exponential(multiplier=backoff_s, max=backoff_max_s),
                retry=retry_if_exception(should_retry),
                before_sleep=before_sleep,
                sleep=sleep or time.sleep,
                reraise=True,
            )
            return retrying(call)

        return wrapper

    return decorate


def _check_arguments(
    fn: Callable[..., Any],
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Bind a call's arguments after the :class:`Resume` once, before any attempt: a mismatch
    is a programming error, raised at once and never retried.

    Raises:
        TypeError: ``fn`` cannot take a ``Resume`` followed by these arguments.
    """
    try:
        signature.bind(_RESUME_PLACEHOLDER, *args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__name__", "fn")
        raise TypeError(
            f"@resumable {name}{signature}: {exc}. A @resumable function receives a Resume as "
            f"its first argument, then the arguments it is called with: define it as "
            f"def {name}(resume, ...) and call it without the Resume"
        ) from None


_RESUME_PLACEHOLDER = object()  # stands for the Resume when the arguments are bound up front
