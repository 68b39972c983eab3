"""Checkpoint policies from YAML (``configs/checkpoint/*.yaml``) into the library's objects.

Example::

    checkpoint_comm: node          # self | node | world
    save_when:
      every_steps: 100
      every_seconds: 1800
      on_signal: true
      young_daly: {mtbf_s: 86400}
    keep:
      last: 3
      every_steps: 1000
      best: {metric: loss, n: 2, mode: min}
    walltime_margin_s: 120         # stop, final checkpoint, exit 75: this long before the deadline
    gc_every: 10
    async_save: true               # the program waits only for a memory copy
    local_dir: ${SLURM_TMPDIR:-/dev/shm}  # node-local tier, flushed to the shared root
    flush_every: 5                 # ... every 5 checkpoints, and always the last one
    local_keep: 2                  # local checkpoints kept per node
    redundancy: partner            # a copy of each node's local checkpoint on the next node
                                   # (xor: parity over sets of nodes, +14 % instead of +100 %)
    xor_set_size: 8                # with redundancy: xor, the most nodes in a set
    static_copies: 2               # copies of the static data's files (1: large meshes)

``walltime_margin_s`` is the one setting for the deadline: :class:`~resilient.job.session.Session`
stops (and writes its final checkpoint) once less than this margin plus the measured save cost
is left (the rule of :class:`~resilient.model.policies.BeforeWalltime`). Unknown keys and wrong types
raise :class:`~resilient.errors.ConfigError` naming the file and the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.checkpoint.redundancy import DEFAULT_SET_SIZE, REDUNDANCY_SCHEMES, check_set_size
from resilient.checkpoint.statics import check_static_copies
from resilient.errors import ConfigError
from resilient.model.policies import (
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
from resilient.model.schema import Section
from resilient.parallel.nodes import expand_node_path

__all__ = [
    "CheckpointConfig",
    "load_checkpoint_config",
    "load_yaml",
    "tier_options",
]

_NUMBER = (int, float)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    """Checkpoint settings of a program, usually loaded from YAML."""

    checkpoint_comm: str = "self"
    save_when: SavePolicy | None = None
    keep: KeepPolicy | None = None
    walltime_margin_s: float = 60.0
    gc_every: int | None = None
    async_save: bool = False
    local_dir: str | None = None
    flush_every: int = 1
    local_keep: int = 2
    redundancy: str | None = None
    xor_set_size: int = DEFAULT_SET_SIZE
    static_copies: int = 2

    def __post_init__(self) -> None:
        if self.checkpoint_comm not in ("self", "node", "world"):
            raise ConfigError(
                f"checkpoint_comm: 'self', 'node' or 'world', got {self.checkpoint_comm!r}"
            )
        if self.walltime_margin_s < 0:
            raise ConfigError("walltime_margin_s: must be >= 0")
        if self.gc_every is not None and self.gc_every < 1:
            raise ConfigError("gc_every: must be >= 1 (or absent)")
        if self.flush_every < 1 or self.local_keep < 1:
            raise ConfigError("flush_every and local_keep: must be >= 1")
        if self.redundancy is not None and self.redundancy not in REDUNDANCY_SCHEMES:
            raise ConfigError(
                f"redundancy: one of {', '.join(REDUNDANCY_SCHEMES)} (or absent), got "
                f"{self.redundancy!r}"
            )
        if self.redundancy is not None and self.local_dir is None:
            raise ConfigError(f"redundancy: {self.redundancy} needs local_dir (node-local storage)")
        check_set_size(self.xor_set_size)
        check_static_copies(self.static_copies)
        if self.local_dir is not None and "$" in self.local_dir:
            raise ConfigError(
                f"local_dir: {self.local_dir!r} names an environment variable that is not set"
            )

    def session_options(self) -> dict[str, Any]:
        """These settings as keyword arguments of :class:`~resilient.job.session.Session`."""
        return {
            "checkpoint_comm": self.checkpoint_comm, "save_when": self.save_when,
            "keep": self.keep, "margin_s": self.walltime_margin_s, "gc_every": self.gc_every,
            "async_save": self.async_save, "local_dir": self.local_dir,
            "flush_every": self.flush_every, "local_keep": self.local_keep,
            "redundancy": self.redundancy, "xor_set_size": self.xor_set_size,
            "static_copies": self.static_copies,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "config") -> CheckpointConfig:
        """Build from a parsed YAML/JSON mapping; strict about keys and types."""
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        top = Section(doc, where=where)
        top.only({
            "checkpoint_comm", "save_when", "keep", "walltime_margin_s", "gc_every",
            "async_save", "local_dir", "flush_every", "local_keep", "redundancy",
            "xor_set_size", "static_copies",
        })  # fmt: skip
        local_dir = top.get("local_dir", str, None)
        return cls(
            checkpoint_comm=top.get("checkpoint_comm", str, "self"),
            save_when=_save_policy(top.optional_section("save_when")),
            keep=_keep_policy(top.optional_section("keep")),
            walltime_margin_s=float(top.get("walltime_margin_s", _NUMBER, 60.0)),
            gc_every=top.get("gc_every", int, None),
            async_save=top.get("async_save", bool, False),
            local_dir=None if local_dir is None else expand_node_path(local_dir),
            flush_every=top.get("flush_every", int, 1),
            local_keep=top.get("local_keep", int, 2),
            redundancy=top.get("redundancy", str, None),
            xor_set_size=top.get("xor_set_size", int, DEFAULT_SET_SIZE),
            static_copies=top.get("static_copies", int, 2),
        )


def tier_options(args: Any) -> dict[str, Any]:
    """Overrides from a program's ``--async-save``, ``--local-dir``, ``--flush-every``,
    ``--redundancy`` and ``--xor-set-size`` flags (an ``argparse.Namespace``; absent or unset flags change nothing)."""
    changes: dict[str, Any] = {}
    if getattr(args, "async_save", False):
        changes["async_save"] = True
    if getattr(args, "local_dir", None):
        changes["local_dir"] = expand_node_path(args.local_dir)
    if getattr(args, "flush_every", None) is not None:
        changes["flush_every"] = args.flush_every
    redundancy = getattr(args, "redundancy", None)
    if redundancy is not None:
        changes["redundancy"] = None if redundancy == "none" else redundancy
    if getattr(args, "xor_set_size", None) is not None:
        changes["xor_set_size"] = args.xor_set_size
    return changes


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


def _save_policy(sec: Section | None) -> SavePolicy | None:
    if sec is None:
        return None
    if "before_walltime" in sec:
        raise sec.fail(
            "before_walltime",
            "not a save_when key: the deadline margin is the top-level walltime_margin_s "
            "(the session stops, saves and exits 75 that long before the deadline)",
        )
    sec.only({"every_steps", "every_seconds", "on_signal", "young_daly"})
    parts: list[SavePolicy] = []
    if "every_steps" in sec:
        parts.append(EverySteps(sec.require("every_steps", int)))
    if "every_seconds" in sec:
        parts.append(EverySeconds(float(sec.require("every_seconds", _NUMBER))))
    if sec.get("on_signal", bool, False):
        parts.append(OnSignal())
    yd = sec.optional_section("young_daly")
    if yd is not None:
        yd.only({"mtbf_s", "initial_interval_s"})
        parts.append(
            YoungDaly(
                mtbf_s=float(yd.get("mtbf_s", _NUMBER, 86400.0)),
                initial_interval_s=float(yd.get("initial_interval_s", _NUMBER, 600.0)),
            )
        )
    return _any_of(parts)  # type: ignore[no-any-return]


def _keep_policy(sec: Section | None) -> KeepPolicy | None:
    if sec is None:
        return None
    sec.only({"last", "every_steps", "best"})
    parts: list[KeepPolicy] = []
    if "last" in sec:
        parts.append(KeepLast(sec.require("last", int)))
    if "every_steps" in sec:
        parts.append(KeepEvery(steps=sec.require("every_steps", int)))
    best = sec.optional_section("best")
    if best is not None:
        best.only({"metric", "n", "mode"})
        parts.append(
            KeepBest(
                best.get("metric", str, "loss"),
                n=best.get("n", int, 1),
                mode=best.get("mode", str, "min"),
            )
        )
    return _any_of(parts)  # type: ignore[no-any-return]
