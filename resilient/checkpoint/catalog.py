"""What the coordinator knows of a root's checkpoints, so that rotation does not re-read history.

Built once per process (the directory listing plus the save log, ``saves.jsonl``: a checkpoint
is validated only when the log does not know it), then kept up to date by the manager as it
commits, quarantines and deletes. A save therefore costs the same on a root holding ten or ten
thousand checkpoints. The root's lock guarantees that no other job changes it meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from resilient.checkpoint.statics import StaticStore
from resilient.errors import InvalidCheckpointError
from resilient.io import logs
from resilient.io.checkpoints import validate_set
from resilient.io.storage import Trash
from resilient.io.targets import SetKey, Target
from resilient.model import filenames
from resilient.model.manifest import Manifest
from resilient.model.policies import CheckpointInfo, KeepPolicyLike
from resilient.model.rotation import RotationPlan, plan_rotation

__all__ = ["Catalog"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Entry:
    info: CheckpointInfo
    static: str | None


class Catalog:
    """The valid checkpoints of a root and the static data they use (coordinator only).

    Args:
        target: the checkpoint root's target.
        statics: the root's static store, whose reference counts this catalog maintains.
    """

    def __init__(self, target: Target, statics: StaticStore) -> None:
        self.target = target
        self.statics = statics
        self._valid: dict[int, _Entry] | None = None  # oldest first (insertion order)

    def _entries(self) -> dict[int, _Entry]:
        if self._valid is None:
            self._valid = self._load()
        return self._valid

    def _load(self) -> dict[int, _Entry]:
        """One scan: the directory listing, the save log, and validation of the rest only.

        A checkpoint this library committed is in the save log with what rotation needs
        (step, time, metrics, static reference), so it is not re-read; a checkpoint the log
        does not know (an older library, a log line lost in a crash) is validated once. Static
        references of quarantined and invalid checkpoints come from their manifests.
        """
        names = self.target.names()
        logged = _logged_entries(self.target)
        found: dict[int, _Entry] = {}
        for name in names:
            step = filenames.parse_step_dir(name)
            if step is None:
                if filenames.parse_quarantined(name) is not None:
                    self._ref_from_manifest(name, quarantined=True)
                continue
            entry = logged.get(step)
            if entry is None:
                try:
                    entry = _entry(validate_set(self.target, step, statics=self.statics.target))
                except InvalidCheckpointError:
                    self._ref_from_manifest(step, quarantined=False)
                    continue
            found[step] = entry
            self.statics.ref(entry.static)
        self._drop_damaged_newest(found, trusted=set(found) - set(logged))
        return dict(sorted(found.items()))

    def _drop_damaged_newest(self, found: dict[int, _Entry], *, trusted: set[int]) -> None:
        """Check the logged checkpoints newest first until one validates; drop those that fail.

        The save log says what was committed, not what is intact now: a checkpoint damaged
        since (a marker or a data file lost, its static data broken) would otherwise count as
        the newest valid one, which rotation always keeps, and ``KeepLast(1)`` would delete
        the real newest valid checkpoint beneath it. Usually this validates one checkpoint.
        """
        for step in sorted(found, reverse=True):
            if step in trusted:
                return  # validated just now
            try:
                validate_set(self.target, step, statics=self.statics.target)
            except InvalidCheckpointError as exc:
                log.warning("checkpoint of step %d is logged but invalid: %s", step, exc.reason)
                self.statics.unref(found.pop(step).static)
                self._ref_from_manifest(step, quarantined=False)
            else:
                return

    def _ref_from_manifest(self, key: SetKey, *, quarantined: bool) -> None:
        try:  # invalid or quarantined: its static data must survive it
            self.statics.ref(self.target.manifest(key).static)
        except InvalidCheckpointError:
            if quarantined:
                self.statics.pin()  # cannot tell what it uses: keep all static data

    def infos(self) -> list[CheckpointInfo]:
        """The valid checkpoints, oldest first."""
        return [e.info for e in self._entries().values()]

    def add(self, manifest: Manifest) -> None:
        """Record a checkpoint just committed (replacing a re-saved step)."""
        entries = self._entries()
        old = entries.pop(manifest.step, None)
        if old is not None:
            self.statics.unref(old.static)
        newest = next(reversed(entries), -1)
        entries[manifest.step] = _entry(manifest)
        self.statics.ref(manifest.static)
        if manifest.step < newest:  # an older step saved again (after a fallback): re-sort
            self._valid = dict(sorted(entries.items()))

    def quarantined(self, step: int) -> None:
        """Record that ``step`` was quarantined (its static data stays referenced)."""
        if self._valid is not None:
            self._valid.pop(step, None)

    def plan(self, keep: KeepPolicyLike | None) -> RotationPlan:
        """Which valid checkpoints ``keep`` deletes (never the newest)."""
        return plan_rotation(self.infos(), keep)

    def apply(self, plan: RotationPlan) -> Trashed:
        """Trash the checkpoints ``plan`` deletes and the static data no longer used.

        Renames are synchronous (a deleted checkpoint stops counting at once); the caller
        deletes the returned trash, e.g. on a background thread, or reuses a trashed
        checkpoint's files for the next save (:meth:`resilient.io.targets.Target.reuse`).
        """
        entries = self._entries()
        trash = []
        for step in sorted(plan.delete):
            try:
                trash.append(self.target.trash(step, durable=False))  # a rotation
            except FileNotFoundError:
                log.warning("checkpoint of step %d vanished before rotation deleted it", step)
            else:
                log.info("rotation deleted checkpoint of step %d", step)
            entry = entries.pop(step, None)
            if entry is not None:
                self.statics.unref(entry.static)
        return Trashed(tuple(trash), tuple(self.statics.collect()))


@dataclass(frozen=True, slots=True)
class Trashed:
    """What a rotation took out of the listing: checkpoints (oldest first) and static data."""

    checkpoints: tuple[Trash, ...]
    statics: tuple[Trash, ...]

    @property
    def all(self) -> list[Trash]:
        """All of it."""
        return [*self.checkpoints, *self.statics]


def save_record(manifest: Manifest) -> dict[str, Any]:
    """The fields of the save log (``saves.jsonl``) a catalog reads back (see :meth:`Catalog._load`)."""
    return {
        "step": manifest.step,
        "manifest_time": manifest.time,
        "metrics": dict(manifest.metrics),
        "static": manifest.static,
    }


def _logged_entries(target: Target) -> dict[int, _Entry]:
    """step -> entry from the save log's complete records (the last one of a step wins)."""
    out: dict[int, _Entry] = {}
    for rec in target.read_log(filenames.SAVE_LOG, logs.SAVES):
        step, when, metrics, static = (
            rec["step"], rec.get("manifest_time"), rec.get("metrics"), rec.get("static", "")
        )  # fmt: skip
        if (
            when is not None
            and metrics is not None
            and (static is None or filenames.is_static_dir(static))
        ):
            out[step] = _Entry(CheckpointInfo(step=step, time=float(when), metrics=metrics), static)
    return out


def _entry(manifest: Manifest) -> _Entry:
    info = CheckpointInfo(step=manifest.step, time=manifest.time, metrics=manifest.metrics)
    return _Entry(info, manifest.static)
