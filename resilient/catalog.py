"""What the coordinator knows of a root's checkpoints, so that rotation does not re-read history.

Built once per process from one scan (:func:`resilient.validate.iter_checkpoints`: every
checkpoint validated once), then kept up to date by the manager as it commits, quarantines and
deletes. A save therefore costs the same on a root holding ten or ten thousand checkpoints.
The root's lock guarantees that no other job changes it meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from resilient import layout, storage
from resilient.errors import InvalidCheckpointError
from resilient.manifest import Manifest
from resilient.policies import CheckpointInfo, KeepPolicyLike
from resilient.rotation import RotationPlan, plan_rotation
from resilient.statics import StaticStore
from resilient.validate import iter_checkpoints, load_manifest

__all__ = ["Catalog"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Entry:
    info: CheckpointInfo
    static: str | None


class Catalog:
    """The valid checkpoints of a root and the static data they use (coordinator only).

    Args:
        root: the checkpoint root.
        statics: the root's static store, whose reference counts this catalog maintains.
    """

    def __init__(self, root: Path, statics: StaticStore) -> None:
        self.root = root
        self.statics = statics
        self._valid: dict[int, _Entry] | None = None  # oldest first (insertion order)

    def _entries(self) -> dict[int, _Entry]:
        if self._valid is None:
            found: dict[int, _Entry] = {}
            for rec in iter_checkpoints(self.root, quarantined=True):  # newest first
                if rec.status == "valid" and rec.manifest is not None:
                    found[rec.step] = _entry(rec.manifest)
                    self.statics.ref(rec.manifest.static)
                    continue
                try:  # invalid or quarantined: its static data must survive it
                    self.statics.ref(load_manifest(rec.path).static)
                except InvalidCheckpointError:
                    if rec.status == "quarantined":
                        self.statics.pin()  # cannot tell what it uses: keep all static data
            self._valid = dict(reversed(found.items()))
        return self._valid

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

    def apply(self, plan: RotationPlan) -> list[Path]:
        """Trash the checkpoints ``plan`` deletes and the static data no longer used.

        Renames are synchronous (a deleted checkpoint stops counting at once); the caller
        deletes the returned trash, e.g. on a background thread.
        """
        entries = self._entries()
        trash = []
        for step in sorted(plan.delete):
            path = self.root / layout.step_dir_name(step)
            try:
                trash.append(storage.move_to_trash(path))
            except FileNotFoundError:
                log.warning("checkpoint of step %d vanished before rotation deleted it", step)
            else:
                log.info("rotation deleted checkpoint of step %d", step)
            entry = entries.pop(step, None)
            if entry is not None:
                self.statics.unref(entry.static)
        return trash + self.statics.collect()


def _entry(manifest: Manifest) -> _Entry:
    info = CheckpointInfo(step=manifest.step, time=manifest.time, metrics=manifest.metrics)
    return _Entry(info, manifest.static)
