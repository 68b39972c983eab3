"""When to save and what to keep: small composable policy objects. Pure.

Save policies answer ``policy(ctx) -> bool`` for a :class:`SaveContext`; keep policies answer
``policy(infos) -> frozenset[int]`` (the steps to keep) for a list of :class:`CheckpointInfo`.
Both compose with ``|`` (either one) and save policies with ``&`` (both)::

    save_when = EverySteps(500) | EverySeconds(1800)
    keep = KeepLast(3) | KeepEvery(steps=10_000) | KeepBest("loss", n=2, mode="min")

Plain callables with the same signature are accepted wherever a policy is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from resilient.errors import ConfigError

__all__ = [
    "AllOf",
    "BeforeWalltime",
    "OnSignal",
    "YoungDaly",
    "AnyOf",
    "CheckpointInfo",
    "EverySeconds",
    "EverySteps",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPolicy",
    "KeepPolicyLike",
    "SaveContext",
    "SavePolicy",
    "SavePolicyLike",
    "SHORT_RUN_MARGIN_SHARE",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveContext:
    """What a save policy may look at. Built by the manager on the coordinating rank.

    Attributes:
        step: the step about to be (or not) saved.
        now: monotonic clock reading, seconds.
        last_saved_step: step of the last checkpoint this run committed or restored, if any.
        last_saved_time: ``now`` of that save (or of the manager's start), seconds.
        time_left_s: seconds until this job's deadline, if known.
        stop_requested: a stop signal (walltime warning, preemption) has been received.
        save_cost_s: running estimate of how long one save takes, if measured.
    """

    step: int
    now: float
    last_saved_step: int | None = None
    last_saved_time: float | None = None
    time_left_s: float | None = None
    stop_requested: bool = False
    save_cost_s: float | None = None


SavePolicyLike = Callable[[SaveContext], bool]


class SavePolicy:
    """Base class of save policies: ``policy(ctx) -> bool``; compose with ``|`` and ``&``."""

    def __call__(self, ctx: SaveContext) -> bool:
        raise NotImplementedError

    def __or__(self, other: SavePolicyLike) -> SavePolicy:
        return AnyOf(tuple(_flatten(AnyOf, self)) + tuple(_flatten(AnyOf, other)))

    def __ror__(self, other: SavePolicyLike) -> SavePolicy:
        return AnyOf(tuple(_flatten(AnyOf, other)) + tuple(_flatten(AnyOf, self)))

    def __and__(self, other: SavePolicyLike) -> SavePolicy:
        return AllOf(tuple(_flatten(AllOf, self)) + tuple(_flatten(AllOf, other)))

    def __rand__(self, other: SavePolicyLike) -> SavePolicy:
        return AllOf(tuple(_flatten(AllOf, other)) + tuple(_flatten(AllOf, self)))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _flatten(kind: type, policy: Any) -> tuple[Any, ...]:
    if isinstance(policy, kind):
        return tuple(getattr(policy, "policies"))  # noqa: B009 - kind is one of the composites
    if not callable(policy):
        raise ConfigError(f"not a policy: {policy!r}")
    return (policy,)


@dataclass(frozen=True, slots=True)
class AnyOf(SavePolicy):
    """Save when any of ``policies`` says so (``a | b``)."""

    policies: tuple[SavePolicyLike, ...]

    def __call__(self, ctx: SaveContext) -> bool:
        return any(p(ctx) for p in self.policies)


@dataclass(frozen=True, slots=True)
class AllOf(SavePolicy):
    """Save when all of ``policies`` say so (``a & b``)."""

    policies: tuple[SavePolicyLike, ...]

    def __call__(self, ctx: SaveContext) -> bool:
        return all(p(ctx) for p in self.policies)


@dataclass(frozen=True, slots=True)
class EverySteps(SavePolicy):
    """Save at every step that is a multiple of ``n`` (deterministic across restarts)."""

    n: int

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ConfigError(f"EverySteps(n): n must be a positive integer, got {self.n!r}")

    def __call__(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0 and ctx.step != ctx.last_saved_step


@dataclass(frozen=True, slots=True)
class EverySeconds(SavePolicy):
    """Save when at least ``seconds`` have passed since the last save (or the start)."""

    seconds: float

    def __post_init__(self) -> None:
        if not _is_number(self.seconds) or not self.seconds > 0:
            raise ConfigError(f"EverySeconds(seconds): must be > 0, got {self.seconds!r}")

    def __call__(self, ctx: SaveContext) -> bool:
        if ctx.step == ctx.last_saved_step:
            return False
        return ctx.last_saved_time is None or ctx.now - ctx.last_saved_time >= self.seconds


# --------------------------------------------------------------------------- keep


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """A committed checkpoint as keep policies see it.

    Attributes:
        step: its step.
        time: when it was committed (Unix seconds).
        metrics: the metrics saved with it.
    """

    step: int
    time: float = 0.0
    metrics: Mapping[str, Any] = field(default_factory=dict)


KeepPolicyLike = Callable[[Sequence[CheckpointInfo]], frozenset[int]]


class KeepPolicy:
    """Base class of keep policies: ``policy(infos) -> steps to keep``; compose with ``|``."""

    def __call__(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        raise NotImplementedError

    def __or__(self, other: KeepPolicyLike) -> KeepPolicy:
        return KeepAny(tuple(_flatten(KeepAny, self)) + tuple(_flatten(KeepAny, other)))

    def __ror__(self, other: KeepPolicyLike) -> KeepPolicy:
        return KeepAny(tuple(_flatten(KeepAny, other)) + tuple(_flatten(KeepAny, self)))


@dataclass(frozen=True, slots=True)
class KeepAny(KeepPolicy):
    """Keep what any of ``policies`` keeps (``a | b``)."""

    policies: tuple[KeepPolicyLike, ...]

    def __call__(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p(infos)
        return frozenset(kept)


@dataclass(frozen=True, slots=True)
class KeepAll(KeepPolicy):
    """Keep everything (the default)."""

    def __call__(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos)


@dataclass(frozen=True, slots=True)
class KeepLast(KeepPolicy):
    """Keep the ``n`` newest checkpoints."""

    n: int

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ConfigError(f"KeepLast(n): n must be a positive integer, got {self.n!r}")

    def __call__(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(sorted(i.step for i in infos)[-self.n :])


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepEvery(KeepPolicy):
    """Keep every checkpoint whose step is a multiple of ``steps`` (long-term milestones)."""

    steps: int

    def __post_init__(self) -> None:
        if not _is_int(self.steps) or self.steps < 1:
            raise ConfigError(f"KeepEvery(steps=): must be a positive integer, got {self.steps!r}")

    def __call__(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos if i.step % self.steps == 0)


@dataclass(frozen=True, slots=True)
class KeepBest(KeepPolicy):
    """Keep the ``n`` checkpoints with the best value of metric ``metric``.

    Checkpoints without a finite value of that metric are not kept by this policy.
    """

    metric: str
    n: int = 1
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ConfigError(f"KeepBest(n=): must be a positive integer, got {self.n!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode=): 'min' or 'max', got {self.mode!r}")

    def __call__(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        scored = []
        for i in infos:
            v = i.metrics.get(self.metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                scored.append((v if self.mode == "min" else -v, -i.step, i.step))
        scored.sort()
        return frozenset(s[2] for s in scored[: self.n])


# --------------------------------------------------------------------------- walltime


@dataclass(frozen=True, slots=True)
class OnSignal(SavePolicy):
    """Save when a stop signal (walltime warning, preemption) has been received."""

    def __call__(self, ctx: SaveContext) -> bool:
        return ctx.stop_requested and ctx.step != ctx.last_saved_step


SHORT_RUN_MARGIN_SHARE = 0.5
"""Share of the time left at the start that a stop margin may take at most.

A margin longer than the time left would stop the run before its first step, and one just
shorter leaves a start slowed by a busy node no time for a step either. Nothing is
measured yet at the start, so nothing says how to split the time between steps and the final
save plus the exit; half bounds both: the loop gets at least half the time to make progress,
and the final checkpoint and the exit get the other half. That half also ends ahead of the
warning signal of ``resilient run --walltime`` (10 % of the walltime, at least 1 s, before it).
A smaller share runs the loop so close to the deadline that the final save may be killed (and a
killed save keeps nothing, as if the run had not stopped at all); a larger one leaves so little
time that startup costs can again eat it before the first step.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class BeforeWalltime(SavePolicy):
    """Save once the time left falls below ``margin_s`` plus this job's measured save cost."""

    margin_s: float

    def __post_init__(self) -> None:
        if not _is_number(self.margin_s) or self.margin_s < 0:
            raise ConfigError(f"BeforeWalltime(margin_s=): must be >= 0, got {self.margin_s!r}")

    def __call__(self, ctx: SaveContext) -> bool:
        if ctx.time_left_s is None or ctx.step == ctx.last_saved_step:
            return False
        return ctx.time_left_s <= self.margin_s + (ctx.save_cost_s or 0.0)

    def fit_to(self, time_left_s: float | None) -> BeforeWalltime:
        """This rule for a run that starts with ``time_left_s`` before its deadline.

        Itself when the margin leaves the loop at least the rest of the time left beyond
        :data:`SHORT_RUN_MARGIN_SHARE` of it (or no deadline is known); otherwise the run could
        stop at its first check, before any step (or after a start so slow that no step fits
        before the margin), and save nothing: the same rule with the margin clamped to
        :data:`SHORT_RUN_MARGIN_SHARE` of the time left (0 once the deadline has passed).
        """
        if time_left_s is None or not self.margin_s > SHORT_RUN_MARGIN_SHARE * time_left_s:
            return self
        return replace(self, margin_s=max(0.0, SHORT_RUN_MARGIN_SHARE * time_left_s))


@dataclass(frozen=True, slots=True, kw_only=True)
class YoungDaly(SavePolicy):
    """Save every sqrt(2 x save cost x MTBF) seconds (Young/Daly optimum), from the measured cost.

    Until a save has been measured, ``initial_interval_s`` is used.
    """

    mtbf_s: float
    initial_interval_s: float = 600.0

    def __post_init__(self) -> None:
        if not _is_number(self.mtbf_s) or not self.mtbf_s > 0:
            raise ConfigError(f"YoungDaly(mtbf_s=): must be > 0, got {self.mtbf_s!r}")
        if not _is_number(self.initial_interval_s) or not self.initial_interval_s > 0:
            raise ConfigError(
                f"YoungDaly(initial_interval_s=): must be > 0, got {self.initial_interval_s!r}"
            )

    def interval_s(self, save_cost_s: float | None) -> float:
        """The save interval for a given save cost."""
        if save_cost_s is None:
            return self.initial_interval_s
        return math.sqrt(2.0 * max(save_cost_s, 1e-6) * self.mtbf_s)

    def __call__(self, ctx: SaveContext) -> bool:
        if ctx.step == ctx.last_saved_step:
            return False
        if ctx.last_saved_time is None:
            return True
        return ctx.now - ctx.last_saved_time >= self.interval_s(ctx.save_cost_s)
