"""Checkpoint policies from YAML (``configs/checkpoint/*.yaml``) into the library's objects.

Example::

    checkpoint_comm: node          # self | node | world
    save_when:
      every_steps: 100
      every_seconds: 1800
      before_walltime: {margin_s: 120}
      on_signal: true
      young_daly: {mtbf_s: 86400}
    keep:
      last: 3
      every_steps: 1000
      best: {metric: loss, n: 2, mode: min}
    walltime_margin_s: 120
    retries: 2
    gc_every: 10

Unknown keys and wrong types raise :class:`~resilient.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.errors import ConfigError
from resilient.policies import (
    BeforeWalltime,
    EverySeconds,
    EverySteps,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPolicy,
    OnSignal,
    SavePolicy,
    YoungDaly,
)

__all__ = ["CheckpointConfig", "load_checkpoint_config", "load_yaml"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    """Checkpoint settings of a program, usually loaded from YAML."""

    checkpoint_comm: str = "self"
    save_when: SavePolicy | None = None
    keep: KeepPolicy | None = None
    walltime_margin_s: float = 60.0
    retries: int = 0
    gc_every: int | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_comm not in ("self", "node", "world"):
            raise ConfigError(
                f"checkpoint_comm: 'self', 'node' or 'world', got {self.checkpoint_comm!r}"
            )
        if self.walltime_margin_s < 0:
            raise ConfigError("walltime_margin_s: must be >= 0")
        if self.retries < 0:
            raise ConfigError("retries: must be >= 0")
        if self.gc_every is not None and self.gc_every < 1:
            raise ConfigError("gc_every: must be >= 1 (or absent)")

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, where: str = "config") -> CheckpointConfig:
        """Build from a parsed YAML/JSON mapping; strict about keys and types."""
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        _only(
            doc,
            {"checkpoint_comm", "save_when", "keep", "walltime_margin_s", "retries", "gc_every"},
            where,
        )
        return cls(
            checkpoint_comm=_typed(doc, "checkpoint_comm", str, where, "self"),
            save_when=_save_policy(doc.get("save_when"), f"{where}.save_when"),
            keep=_keep_policy(doc.get("keep"), f"{where}.keep"),
            walltime_margin_s=float(_typed(doc, "walltime_margin_s", (int, float), where, 60.0)),
            retries=_typed(doc, "retries", int, where, 0),
            gc_every=_typed(doc, "gc_every", int, where, None),
        )


def load_checkpoint_config(path: str | os.PathLike[str]) -> CheckpointConfig:
    """Read a checkpoint-policy YAML file.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown keys or wrong types.
    """
    p = Path(path)
    doc = load_yaml(p)
    try:
        return CheckpointConfig.from_dict(doc or {}, where=str(p))
    except ConfigError as exc:
        message = str(exc)
        if not message.startswith(str(p)):
            raise ConfigError(f"{p}: {message}") from None
        raise


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file safely (no Python objects); unreadable or invalid -> :class:`ConfigError`."""
    import yaml

    p = Path(path)
    try:
        return yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None


def _any_of(parts: list[Any]) -> Any:
    """``parts[0] | parts[1] | ...``, or ``None`` for no parts."""
    if not parts:
        return None
    policy = parts[0]
    for part in parts[1:]:
        policy = policy | part
    return policy


def _only(doc: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _typed(
    doc: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str, default: Any
) -> Any:
    if key not in doc or doc[key] is None:
        return default
    value = doc[key]
    if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ConfigError(f"{where}.{key}: expected {names}, got {type(value).__name__} {value!r}")
    return value


def _save_policy(doc: Any, where: str) -> SavePolicy | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    _only(
        doc, {"every_steps", "every_seconds", "before_walltime", "on_signal", "young_daly"}, where
    )
    parts: list[SavePolicy] = []
    if "every_steps" in doc:
        parts.append(EverySteps(_typed(doc, "every_steps", int, where, None)))
    if "every_seconds" in doc:
        parts.append(EverySeconds(float(_typed(doc, "every_seconds", (int, float), where, None))))
    bw = doc.get("before_walltime")
    if bw is not None and bw is not False:
        if bw is True:
            bw = {}
        if not isinstance(bw, Mapping):
            raise ConfigError(f"{where}.before_walltime: expected true or a mapping with margin_s")
        _only(bw, {"margin_s"}, f"{where}.before_walltime")
        parts.append(
            BeforeWalltime(
                margin_s=float(
                    _typed(bw, "margin_s", (int, float), f"{where}.before_walltime", 60.0)
                )
            )
        )
    if _typed(doc, "on_signal", bool, where, False):
        parts.append(OnSignal())
    yd = doc.get("young_daly")
    if yd is not None:
        if not isinstance(yd, Mapping):
            raise ConfigError(f"{where}.young_daly: expected a mapping with mtbf_s")
        _only(yd, {"mtbf_s", "initial_interval_s"}, f"{where}.young_daly")
        parts.append(
            YoungDaly(
                mtbf_s=float(_typed(yd, "mtbf_s", (int, float), f"{where}.young_daly", 86400.0)),
                initial_interval_s=float(
                    _typed(yd, "initial_interval_s", (int, float), f"{where}.young_daly", 600.0)
                ),
            )
        )
    return _any_of(parts)  # type: ignore[no-any-return]


def _keep_policy(doc: Any, where: str) -> KeepPolicy | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    _only(doc, {"last", "every_steps", "best"}, where)
    parts: list[KeepPolicy] = []
    if "last" in doc:
        parts.append(KeepLast(_typed(doc, "last", int, where, None)))
    if "every_steps" in doc:
        parts.append(KeepEvery(steps=_typed(doc, "every_steps", int, where, None)))
    best = doc.get("best")
    if best is not None:
        if not isinstance(best, Mapping):
            raise ConfigError(f"{where}.best: expected a mapping with metric, n, mode")
        _only(best, {"metric", "n", "mode"}, f"{where}.best")
        parts.append(
            KeepBest(
                _typed(best, "metric", str, f"{where}.best", "loss"),
                n=_typed(best, "n", int, f"{where}.best", 1),
                mode=_typed(best, "mode", str, f"{where}.best", "min"),
            )
        )
    return _any_of(parts)  # type: ignore[no-any-return]
