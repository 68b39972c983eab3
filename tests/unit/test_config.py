"""Checkpoint policies from YAML: every shipped config loads; mistakes name the key and file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from resilient.config import CheckpointConfig, load_checkpoint_config
from resilient.errors import ConfigError
from resilient.model.policies import (
    AnyOf,
    CheckpointInfo,
    EverySeconds,
    EverySteps,
    KeepAny,
    KeepBest,
    KeepLast,
    OnSignal,
    SaveContext,
    YoungDaly,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "checkpoint"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def ctx(step: int, **kw: Any) -> SaveContext:
    kw.setdefault("now", 0.0)
    kw.setdefault("last_saved_time", 0.0)
    return SaveContext(step=step, **kw)


def write(tmp_path: Path, text: str, name: str = "ck.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --------------------------------------------------------------------------- shipped files


def test_there_are_shipped_configs() -> None:
    names = {p.name for p in SHIPPED}
    assert {"default.yaml", "demo.yaml", "training.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_checkpoint_config(path)
    assert isinstance(cfg, CheckpointConfig)
    assert cfg.checkpoint_comm in ("self", "node", "world")
    assert cfg.save_when is not None and callable(cfg.save_when)
    assert cfg.keep is not None and callable(cfg.keep)
    # the policies work on real contexts and infos
    assert isinstance(cfg.save_when(ctx(1)), bool)
    kept = cfg.keep([CheckpointInfo(step=s, metrics={"loss": 1.0 / s}) for s in (1, 2, 3, 4)])
    assert kept and kept <= {1, 2, 3, 4}


def test_default_yaml_builds_the_expected_objects() -> None:
    cfg = load_checkpoint_config(CONFIG_DIR / "default.yaml")
    assert cfg == CheckpointConfig(
        checkpoint_comm="node",
        save_when=AnyOf((EverySteps(50), EverySeconds(1800.0), OnSignal())),
        keep=KeepLast(3),
        walltime_margin_s=120.0,
        gc_every=20,
    )
    p = cfg.save_when
    assert p is not None
    assert p(ctx(50)) is True
    assert p(ctx(49)) is False
    assert p(ctx(50, last_saved_step=50)) is False
    assert p(ctx(49, stop_requested=True)) is True  # on_signal
    assert p(ctx(49, time_left_s=119.0)) is False  # the deadline is the session's stop rule
    assert p(ctx(49, now=1800.0)) is True  # every_seconds
    assert p(ctx(49, now=1799.0)) is False


def test_training_yaml_builds_the_expected_objects() -> None:
    cfg = load_checkpoint_config(CONFIG_DIR / "training.yaml")
    assert cfg.checkpoint_comm == "self"
    assert cfg.save_when == AnyOf(
        (EverySteps(20), OnSignal(), YoungDaly(mtbf_s=86400.0, initial_interval_s=600.0))
    )
    p = cfg.save_when
    assert p(ctx(20)) is True
    assert p(ctx(19, now=599.0)) is False
    assert p(ctx(19, now=600.0)) is True  # young_daly's initial interval
    assert p(ctx(19, now=300.0, save_cost_s=0.5)) is True  # sqrt(2 * 0.5 * 86400) = 294 s
    assert cfg.keep == KeepAny((KeepLast(2), KeepBest("loss", n=2, mode="min")))
    infos = [CheckpointInfo(step=s, metrics={"loss": v}) for s, v in [(1, 0.1), (2, 0.5), (3, 0.2),
                                                                       (4, 0.9), (5, 0.8)]]  # fmt: skip
    assert cfg.keep(infos) == {4, 5, 1, 3}  # last two and best two
    assert (cfg.walltime_margin_s, cfg.gc_every) == (60.0, None)


def test_demo_yaml_builds_the_expected_objects() -> None:
    cfg = load_checkpoint_config(CONFIG_DIR / "demo.yaml")
    assert cfg.save_when == AnyOf((EverySteps(10), OnSignal()))
    assert cfg.keep == KeepLast(2)
    assert (cfg.checkpoint_comm, cfg.walltime_margin_s) == ("node", 2.0)


# --------------------------------------------------------------------------- from_dict


def test_from_dict_defaults() -> None:
    assert CheckpointConfig.from_dict({}) == CheckpointConfig()
    cfg = CheckpointConfig.from_dict({})
    assert cfg.save_when is None and cfg.keep is None
    assert (cfg.checkpoint_comm, cfg.walltime_margin_s) == ("self", 60.0)


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_checkpoint_config(write(tmp_path, "# nothing\n")) == CheckpointConfig()


def test_from_dict_single_policy_is_not_wrapped() -> None:
    cfg = CheckpointConfig.from_dict({"save_when": {"every_steps": 7}, "keep": {"last": 1}})
    assert cfg.save_when == EverySteps(7)
    assert cfg.keep == KeepLast(1)


@pytest.mark.parametrize("form", [True, False, {"margin_s": 5}])
def test_before_walltime_is_not_a_second_margin(form: object) -> None:
    """One knob for the deadline: walltime_margin_s (the session's stop rule)."""
    with pytest.raises(ConfigError, match=r"save_when\.before_walltime.*walltime_margin_s"):
        CheckpointConfig.from_dict({"save_when": {"before_walltime": form}})
    assert CheckpointConfig.from_dict({"save_when": {"on_signal": False}}).save_when is None


def test_from_dict_young_daly_options() -> None:
    cfg = CheckpointConfig.from_dict(
        {"save_when": {"young_daly": {"mtbf_s": 3600, "initial_interval_s": 30}}}
    )
    assert cfg.save_when == YoungDaly(mtbf_s=3600.0, initial_interval_s=30.0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("retires: 2\n", ["retires"]),  # unknown top-level key
        ("save_when:\n  every_step: 10\n", ["every_step", "save_when"]),  # nested typo
        ("keep:\n  latest: 3\n", ["latest", "keep"]),
        ("keep:\n  best: {metric: loss, order: min}\n", ["order", "keep.best"]),
        ("save_when:\n  young_daly: {mtbf: 3600}\n", ["mtbf", "young_daly"]),
        ('save_when:\n  every_steps: "10"\n', ["save_when.every_steps", "str"]),
        ("gc_every: 1.5\n", ["gc_every", "float"]),
        ("walltime_margin_s: true\n", ["walltime_margin_s", "bool"]),
        ("retries: 2\n", ["retries", "unknown key"]),  # removed: nothing read it
        ('save_when:\n  on_signal: "yes"\n', ["on_signal", "str"]),
        ("checkpoint_comm: 3\n", ["checkpoint_comm", "int"]),
        ("walltime_margin_s: soon\n", ["walltime_margin_s"]),
        ("gc_every: 2.5\n", ["gc_every"]),
        ("save_when:\n  every_seconds: [1]\n", ["every_seconds"]),
        ("save_when:\n  young_daly: {mtbf_s: day}\n", ["young_daly.mtbf_s"]),
        ("keep:\n  best: {metric: 3}\n", ["keep.best.metric"]),
        ("save_when: 10\n", ["save_when", "mapping"]),
        ("keep: [1, 2]\n", ["keep", "mapping"]),
        ("keep:\n  best: loss\n", ["keep.best"]),
        ("save_when:\n  young_daly: 86400\n", ["young_daly"]),
        ("save_when:\n  before_walltime: 120\n", ["before_walltime", "walltime_margin_s"]),
    ],
)
def test_bad_keys_and_types_name_the_key_and_the_file(
    tmp_path: Path, text: str, names: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc_info:
        load_checkpoint_config(path)
    msg = str(exc_info.value)
    assert str(path) in msg
    for name in names:
        assert name in msg


def test_wrong_type_in_young_daly_names_the_full_key(tmp_path: Path) -> None:
    path = write(tmp_path, 'save_when:\n  young_daly: {mtbf_s: "1d"}\n')
    with pytest.raises(ConfigError) as exc_info:
        load_checkpoint_config(path)
    assert "save_when.young_daly.mtbf_s" in str(exc_info.value)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("keep:\n  best: {metric: loss, mode: median}\n", ["mode", "median"]),
        ("save_when:\n  every_steps: 0\n", ["EverySteps", "0"]),
        ("keep:\n  last: 0\n", ["KeepLast"]),
        ("checkpoint_comm: galaxy\n", ["checkpoint_comm", "galaxy"]),
        ("walltime_margin_s: -1\n", ["walltime_margin_s"]),
        ("save_when:\n  young_daly: {mtbf_s: 0}\n", ["mtbf_s"]),
        ("save_when:\n  every_seconds: 0\n", ["EverySeconds"]),
    ],
)
def test_bad_values_are_config_errors(tmp_path: Path, text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as exc_info:
        load_checkpoint_config(write(tmp_path, text))
    for name in names:
        assert name in str(exc_info.value)


@pytest.mark.parametrize("text", ["- every_steps: 10\n- keep: 3\n", "42\n", "just a string\n"])
def test_non_mapping_top_level(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="mapping at the top level") as exc_info:
        load_checkpoint_config(path)
    assert str(path) in str(exc_info.value)


def test_from_dict_non_mapping_uses_where() -> None:
    with pytest.raises(ConfigError, match=r"my\.yaml: expected a mapping"):
        CheckpointConfig.from_dict([1, 2], where="my.yaml")


@pytest.mark.parametrize("text", ["save_when: [unclosed\n", "a: b: c\n", "keep:\n\t- 1\n"])
def test_invalid_yaml(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="not valid YAML") as exc_info:
        load_checkpoint_config(path)
    assert str(path) in str(exc_info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read") as exc_info:
        load_checkpoint_config(path)
    assert str(path) in str(exc_info.value)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_checkpoint_config(tmp_path)


def test_config_error_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_checkpoint_config(write(tmp_path, "retries: many\n"))


def test_async_and_local_tier_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    doc = {"async_save": True, "local_dir": "${SLURM_TMPDIR:-/dev/shm}", "flush_every": 4,
           "local_keep": 3}  # fmt: skip
    cfg = CheckpointConfig.from_dict(doc)
    assert (cfg.async_save, cfg.local_dir, cfg.flush_every, cfg.local_keep) == (
        True, "/dev/shm", 4, 3,
    )  # fmt: skip
    monkeypatch.setenv("SLURM_TMPDIR", "/scratch/job7")
    assert CheckpointConfig.from_dict(doc).local_dir == "/scratch/job7"
    opts = CheckpointConfig.from_dict(doc).session_options()
    assert opts["async_save"] is True and opts["local_dir"] == "/scratch/job7"
    assert CheckpointConfig.from_dict({}).session_options()["local_dir"] is None


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"async_save": "yes"}, "async_save"),
        ({"flush_every": 0}, "flush_every"),
        ({"local_keep": 0}, "local_keep"),
        ({"local_dir": "$RESILIENT_SURELY_UNSET_VAR/x"}, "not set"),
    ],
)
def test_async_and_local_tier_keys_are_checked(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig.from_dict(doc)


def test_static_copies_from_yaml(tmp_path: Path) -> None:
    cfg = load_checkpoint_config(write(tmp_path, "static_copies: 1\n"))
    assert cfg.static_copies == 1 and cfg.session_options()["static_copies"] == 1
    assert load_checkpoint_config(write(tmp_path, "checkpoint_comm: self\n")).static_copies == 2
    with pytest.raises(ConfigError, match="static_copies must be 1 or 2"):
        load_checkpoint_config(write(tmp_path, "static_copies: 3\n"))
