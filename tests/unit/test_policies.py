"""Save policies, keep policies, their composition, and rotation planning."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient import CheckpointManager
from resilient.errors import CollectiveError, ConfigError
from resilient.model.policies import (
    AllOf,
    AnyOf,
    CheckpointInfo,
    EverySeconds,
    EverySteps,
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPolicy,
    KeepPolicyLike,
    SaveContext,
)
from resilient.model.rotation import RotationPlan, plan_rotation


def ctx(step: int, **kw: object) -> SaveContext:
    kw.setdefault("now", 0.0)
    return SaveContext(step=step, **kw)  # type: ignore[arg-type]


def infos(*steps: int) -> list[CheckpointInfo]:
    return [CheckpointInfo(step=s) for s in steps]


def with_metric(values: dict[int, object], name: str = "loss") -> list[CheckpointInfo]:
    return [CheckpointInfo(step=s, metrics={name: v}) for s, v in values.items()]


# --------------------------------------------------------------------------- save policies


def test_every_steps_fires_on_multiples_only() -> None:
    p = EverySteps(5)
    fired = [s for s in range(0, 23) if p(ctx(s))]
    assert fired == [0, 5, 10, 15, 20]


def test_every_steps_does_not_refire_on_the_step_just_saved() -> None:
    p = EverySteps(5)
    assert p(ctx(10, last_saved_step=5)) is True
    assert p(ctx(10, last_saved_step=10)) is False


def test_every_seconds_uses_time_since_last_save() -> None:
    p = EverySeconds(60)
    assert p(ctx(1, now=100.0, last_saved_time=None)) is True
    assert p(ctx(1, now=100.0, last_saved_time=50.0)) is False
    assert p(ctx(1, now=110.0, last_saved_time=50.0)) is True  # exactly 60 s
    assert p(ctx(1, now=109.999, last_saved_time=50.0)) is False
    # never twice for the same step, however long ago the save was
    assert p(ctx(7, now=1e9, last_saved_time=0.0, last_saved_step=7)) is False


def test_every_seconds_accepts_float_seconds() -> None:
    p = EverySeconds(0.5)
    assert p(ctx(1, now=10.5, last_saved_time=10.0)) is True
    assert p(ctx(1, now=10.4, last_saved_time=10.0)) is False


@pytest.mark.parametrize("n", [0, -1, 1.5, "5", None, 2.0])
def test_every_steps_rejects_bad_n(n: object) -> None:
    with pytest.raises(ConfigError, match=r"EverySteps\(n\)"):
        EverySteps(n)  # type: ignore[arg-type]


@pytest.mark.parametrize("s", [0, -3, -0.5, math.nan, "60", None])
def test_every_seconds_rejects_bad_seconds(s: object) -> None:
    with pytest.raises(ConfigError, match=r"EverySeconds\(seconds\)"):
        EverySeconds(s)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        EverySteps(0)


def test_or_composes_into_any_of() -> None:
    a, b = EverySteps(3), EverySteps(5)
    p = a | b
    assert isinstance(p, AnyOf)
    assert p.policies == (a, b)
    assert [s for s in range(1, 16) if p(ctx(s))] == [3, 5, 6, 9, 10, 12, 15]


def test_and_composes_into_all_of() -> None:
    a, b = EverySteps(3), EverySteps(5)
    p = a & b
    assert isinstance(p, AllOf)
    assert p.policies == (a, b)
    assert [s for s in range(1, 31) if p(ctx(s))] == [15, 30]


def test_or_flattens_on_both_sides() -> None:
    a, b, c, d = EverySteps(2), EverySteps(3), EverySteps(5), EverySeconds(10)
    left = (a | b) | c
    assert isinstance(left, AnyOf) and left.policies == (a, b, c)
    right = a | (b | c)
    assert isinstance(right, AnyOf) and right.policies == (a, b, c)
    both = (a | b) | (c | d)
    assert isinstance(both, AnyOf) and both.policies == (a, b, c, d)


def test_and_flattens() -> None:
    a, b, c = EverySteps(2), EverySteps(3), EverySteps(5)
    p = (a & b) & c
    assert isinstance(p, AllOf) and p.policies == (a, b, c)
    assert [s for s in range(1, 61) if p(ctx(s))] == [30, 60]


def test_mixed_or_and_do_not_flatten_into_each_other() -> None:
    a, b, c = EverySteps(2), EverySteps(3), EverySteps(5)
    p = (a | b) & c
    assert isinstance(p, AllOf)
    assert len(p.policies) == 2
    assert p.policies[1] is c
    inner = p.policies[0]
    assert isinstance(inner, AnyOf) and inner.policies == (a, b)
    assert [s for s in range(1, 21) if p(ctx(s))] == [10, 15, 20]


def test_plain_callables_compose_with_or_on_either_side() -> None:
    def stop(c: SaveContext) -> bool:
        return c.stop_requested

    every = EverySteps(100)
    right = every | stop
    assert isinstance(right, AnyOf) and right.policies == (every, stop)
    left = stop | every
    assert isinstance(left, AnyOf) and left.policies == (stop, every)
    for p in (left, right):
        assert p(ctx(7, stop_requested=True)) is True
        assert p(ctx(7)) is False
        assert p(ctx(200)) is True


def test_plain_callable_composes_with_and_on_the_right() -> None:
    def low_on_time(c: SaveContext) -> bool:
        return c.time_left_s is not None and c.time_left_s < 60

    every = EverySteps(10)
    p = every & low_on_time
    assert isinstance(p, AllOf) and p.policies == (every, low_on_time)
    assert p(ctx(20, time_left_s=30)) is True
    assert p(ctx(20, time_left_s=3000)) is False
    assert p(ctx(21, time_left_s=30)) is False


def test_plain_callable_composes_with_and_on_the_left() -> None:
    """`callable & policy` must work like `callable | policy` does (needs __rand__)."""

    def low_on_time(c: SaveContext) -> bool:
        return c.time_left_s is not None and c.time_left_s < 60

    every = EverySteps(10)
    p = low_on_time & every
    assert isinstance(p, AllOf) and p.policies == (low_on_time, every)
    assert p(ctx(20, time_left_s=30)) is True
    assert p(ctx(21, time_left_s=30)) is False


@pytest.mark.parametrize("other", [5, "x", None, 1.5])
def test_composing_with_a_non_callable_is_a_config_error(other: object) -> None:
    with pytest.raises(ConfigError, match="not a policy"):
        EverySteps(2) | other  # type: ignore[operator]
    with pytest.raises(ConfigError, match="not a policy"):
        EverySteps(2) & other  # type: ignore[operator]
    with pytest.raises(ConfigError, match="not a policy"):
        KeepLast(2) | other  # type: ignore[operator]


# --------------------------------------------------------------------------- keep policies


def test_keep_last() -> None:
    assert KeepLast(2)(infos(5, 1, 9, 3)) == frozenset({5, 9})
    assert KeepLast(10)(infos(5, 1)) == frozenset({1, 5})
    assert KeepLast(1)(infos()) == frozenset()


def test_keep_every() -> None:
    assert KeepEvery(steps=100)(infos(0, 50, 100, 150, 200, 250)) == frozenset({0, 100, 200})
    assert KeepEvery(steps=100)(infos(1, 99)) == frozenset()


def test_keep_every_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        KeepEvery(100)  # type: ignore[call-arg]


def test_keep_all() -> None:
    assert KeepAll()(infos(1, 2, 3)) == frozenset({1, 2, 3})


def test_keep_best_min_and_max() -> None:
    data = with_metric({1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.7})
    assert KeepBest("loss", n=2, mode="min")(data) == frozenset({2, 4})
    assert KeepBest("loss", n=2, mode="max")(data) == frozenset({3, 5})
    assert KeepBest("loss")(data) == frozenset({2})  # defaults: n=1, mode="min"


def test_keep_best_accepts_ints_and_prefers_newer_on_ties() -> None:
    data = with_metric({1: 3, 2: 1, 3: 1, 4: 2})
    assert KeepBest("loss", n=1)(data) == frozenset({3})
    assert KeepBest("loss", n=2)(data) == frozenset({2, 3})


def test_keep_best_ignores_missing_and_non_finite_metrics() -> None:
    data = [
        CheckpointInfo(step=1, metrics={"loss": math.nan}),
        CheckpointInfo(step=2, metrics={"loss": -math.inf}),
        CheckpointInfo(step=3, metrics={"loss": math.inf}),
        CheckpointInfo(step=4, metrics={}),
        CheckpointInfo(step=5, metrics={"other": 0.0}),
        CheckpointInfo(step=6, metrics={"loss": True}),
        CheckpointInfo(step=7, metrics={"loss": "0.1"}),
        CheckpointInfo(step=8, metrics={"loss": None}),
        CheckpointInfo(step=9, metrics={"loss": 5.0}),
        CheckpointInfo(step=10, metrics={"loss": 4.0}),
    ]
    assert KeepBest("loss", n=3, mode="min")(data) == frozenset({9, 10})
    assert KeepBest("loss", n=3, mode="max")(data) == frozenset({9, 10})
    assert KeepBest("loss", n=1, mode="max")(data) == frozenset({9})
    assert KeepBest("missing", n=3)(data) == frozenset()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, r"KeepBest\(n=\)"),
        ({"n": -1}, r"KeepBest\(n=\)"),
        ({"n": 1.0}, r"KeepBest\(n=\)"),
        ({"mode": "avg"}, r"KeepBest\(mode=\)"),
        ({"mode": "MIN"}, r"KeepBest\(mode=\)"),
    ],
)
def test_keep_best_rejects_bad_args(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KeepBest("loss", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -2, 2.5, "3", None])
def test_keep_last_rejects_bad_n(n: object) -> None:
    with pytest.raises(ConfigError, match=r"KeepLast\(n\)"):
        KeepLast(n)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [0, -100, 10.0, "10"])
def test_keep_every_rejects_bad_steps(steps: object) -> None:
    with pytest.raises(ConfigError, match=r"KeepEvery\(steps=\)"):
        KeepEvery(steps=steps)  # type: ignore[arg-type]


def test_keep_any_is_the_union() -> None:
    data = [
        CheckpointInfo(step=s, metrics={"loss": float(v)})
        for s, v in zip(range(100, 1100, 100), [9, 1, 8, 7, 6, 5, 4, 3, 2, 8], strict=True)
    ]
    p = KeepLast(2) | KeepEvery(steps=500) | KeepBest("loss", n=1)
    assert isinstance(p, KeepAny)
    assert len(p.policies) == 3  # flattened
    assert p(data) == frozenset({200, 500, 900, 1000})


def test_keep_any_with_plain_callables_on_either_side() -> None:
    def odd(xs: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in xs if i.step % 2)

    last = KeepLast(1)
    right = last | odd
    left = odd | last
    assert isinstance(right, KeepAny) and right.policies == (last, odd)
    assert isinstance(left, KeepAny) and left.policies == (odd, last)
    assert right(infos(1, 2, 3, 4)) == left(infos(1, 2, 3, 4)) == frozenset({1, 3, 4})


def test_keep_any_flattens_nested_unions() -> None:
    a, b, c = KeepLast(1), KeepEvery(steps=10), KeepBest("loss")
    p = (a | b) | c
    assert isinstance(p, KeepAny) and p.policies == (a, b, c)
    q = a | (b | c)
    assert isinstance(q, KeepAny) and q.policies == (a, b, c)


# --------------------------------------------------------------------------- rotation


def test_plan_rotation_keep_none_deletes_nothing() -> None:
    plan = plan_rotation(infos(1, 2, 3), None)
    assert plan == RotationPlan(keep=frozenset({1, 2, 3}), delete=frozenset())


def test_plan_rotation_empty() -> None:
    assert plan_rotation([], KeepLast(1)) == RotationPlan(frozenset(), frozenset())
    assert plan_rotation([], None) == RotationPlan(frozenset(), frozenset())


def test_plan_rotation_never_deletes_the_newest() -> None:
    def keep_nothing(xs: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset()

    plan = plan_rotation(infos(3, 1, 7, 5), keep_nothing)
    assert plan.keep == frozenset({7})
    assert plan.delete == frozenset({1, 3, 5})


def test_plan_rotation_newest_survives_keep_best_that_prefers_old() -> None:
    data = with_metric({1: 0.1, 2: 0.5, 3: 0.9})
    plan = plan_rotation(data, KeepBest("loss", n=1))
    assert plan.keep == frozenset({1, 3})
    assert plan.delete == frozenset({2})


def test_plan_rotation_ignores_kept_steps_that_are_not_valid() -> None:
    def keep_strangers(xs: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset({2, 99, -1})

    plan = plan_rotation(infos(1, 2, 3), keep_strangers)
    assert plan.keep == frozenset({2, 3})
    assert plan.delete == frozenset({1})


def test_plan_rotation_keep_last_and_every() -> None:
    steps = list(range(100, 1600, 100))
    plan = plan_rotation(infos(*steps), KeepLast(3) | KeepEvery(steps=500))
    assert plan.keep == frozenset({500, 1000, 1300, 1400, 1500})
    assert plan.delete == frozenset(steps) - plan.keep


@settings(max_examples=200, deadline=None)
@given(
    steps=st.sets(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=40),
    last=st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
    every=st.one_of(st.none(), st.integers(min_value=1, max_value=500)),
)
def test_plan_rotation_partitions_the_steps(
    steps: set[int], last: int | None, every: int | None
) -> None:
    parts: list[KeepPolicy] = []
    if last is not None:
        parts.append(KeepLast(last))
    if every is not None:
        parts.append(KeepEvery(steps=every))

    def keep_nothing(xs: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset()

    policy: KeepPolicyLike = keep_nothing
    if parts:
        combined = parts[0]
        for p in parts[1:]:
            combined = combined | p
        policy = combined

    plan = plan_rotation([CheckpointInfo(step=s) for s in sorted(steps)], policy)
    assert plan.keep | plan.delete == frozenset(steps)
    assert not plan.keep & plan.delete
    assert max(steps) in plan.keep
    expected = {max(steps)}
    if last is not None:
        expected |= set(sorted(steps)[-last:])
    if every is not None:
        expected |= {s for s in steps if s % every == 0}
    assert plan.keep == frozenset(expected)


# --------------------------------------------------------------------------- manager wiring


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def test_manager_rotates_with_keep_last(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root, keep=KeepLast(2)) as m:
        for s in range(1, 6):
            m.save(s, {"x": np.full(4, s, dtype=np.int32)})
            assert _steps_on_disk(root) == list(range(max(1, s - 1), s + 1))
    assert not [p.name for p in root.iterdir() if p.name.startswith(".trash-")]


def test_manager_rotates_with_keep_best_on_metrics(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.8}
    with CheckpointManager(root, keep=KeepBest("loss", n=1)) as m:
        for s, loss in losses.items():
            m.save(s, {"x": np.zeros(2)}, metrics={"loss": loss})
    assert _steps_on_disk(root) == [2, 4]


def _static_dirs(root: Path) -> list[str]:
    names = [p.name for p in (root / "static").iterdir() if not p.name.startswith(".")]
    assert sorted(n for n in names if n.endswith(".copy")) == sorted(
        f"{n}.copy" for n in names if not n.endswith(".copy")
    )  # every content in two copies
    return sorted(n for n in names if not n.endswith(".copy"))


def test_manager_rotation_deletes_unreferenced_static_data(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(root, keep=KeepLast(1)) as m:
        m.save(1, {"x": np.zeros(2)}, static={"grid": np.arange(3)})
        first = _static_dirs(root)
        assert len(first) == 1
        m.save(2, {"x": np.ones(2)}, static={"grid": np.arange(3)})  # same content: shared
        assert _static_dirs(root) == first
        m.save(3, {"x": np.ones(2)}, static={"grid": np.arange(4)})  # new content
        now = _static_dirs(root)  # the old one is renamed to .trash-* at once, unlinked later
    assert len(now) == 1 and now != first
    assert _steps_on_disk(root) == [3]


def test_manager_should_save_with_injected_clock(tmp_path: Path) -> None:
    t = [1000.0]
    with CheckpointManager(
        tmp_path / "ck", save_when=EverySeconds(60) | EverySteps(50), clock=lambda: t[0]
    ) as m:
        assert m.should_save(1) is False  # the start counts as the last save
        t[0] = 1059.0
        assert m.should_save(2) is False
        assert m.should_save(50) is True
        t[0] = 1060.0
        assert m.should_save(3) is True
        m.save(3, {"x": np.zeros(1)})
        assert m.should_save(3) is False  # never the step just saved
        assert m.should_save(4) is False  # the save reset the timer
        ctx_ = m.save_context(4, time_left_s=12.0, stop_requested=True)
        assert ctx_.last_saved_step == 3
        assert ctx_.time_left_s == 12.0 and ctx_.stop_requested is True


def test_a_failing_save_when_raises_on_every_rank(tmp_path: Path) -> None:
    """Rank 0's policy error is announced: a resilient error as it is, any other one named."""

    def broken(_: object) -> bool:
        raise ZeroDivisionError("policy bug")

    def refusing(_: object) -> bool:
        raise ConfigError("no saving now")

    failing = pytest.raises(CollectiveError, match=r"save decision at step 7.*policy bug")
    with CheckpointManager(tmp_path / "ck", save_when=broken) as m, failing:
        m.should_save(7)
    refused = pytest.raises(ConfigError, match="no saving now")
    with CheckpointManager(tmp_path / "ck", save_when=refusing) as m, refused:
        m.should_save(8)


def test_manager_without_save_when_never_saves_by_policy(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ck") as m:
        assert m.should_save(0) is False
        assert m.should_save(1000, stop_requested=True) is False
