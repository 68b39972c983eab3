"""Restoring the newest valid checkpoint, falling back past bad ones. Collective.

Call order of :meth:`Restorer.restore` (every step through
:class:`~resilient.collective.Collective`)::

    coordinator   next candidate from validate.iter_checkpoints (newest first; quarantines
                  checkpoints that fail quick validation; layout checked)
    every rank    read its piece and its static data, verify checksums, run the validate hook
    coordinator   accept, or quarantine it with every rank's reason and try the next older one
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient import layout, storage
from resilient.catalog import Catalog
from resilient.checkpointer import check_template, read_rank
from resilient.collective import Collective, describe_error
from resilient.errors import CheckpointNotFoundError, InvalidCheckpointError, LayoutMismatchError
from resilient.manifest import LayoutInfo, Manifest
from resilient.validate import iter_checkpoints, load_manifest

__all__ = ["Restorer", "StateValidator"]

log = logging.getLogger(__name__)

StateValidator = Callable[[Mapping[str, Any]], bool]


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A checkpoint the coordinator chose to try restoring, sent to every rank."""

    path: Path
    manifest: Manifest
    static: Manifest | None


class Restorer:
    """Restores checkpoints of ``root`` for the ranks of ``coll``.

    Args:
        root: the checkpoint root.
        coll: the ranks; the coordinator chooses and quarantines.
        catalog: told about quarantined checkpoints (so that rotation forgets them).
        layout: the layout of this run (another one on disk is a :class:`LayoutMismatchError`).
    """

    def __init__(
        self, root: Path, coll: Collective, catalog: Catalog, *, layout: LayoutInfo
    ) -> None:
        self.root = root
        self.coll = coll
        self.catalog = catalog
        self.layout = layout

    def restore(
        self,
        step: int | None = None,
        *,
        validate: StateValidator | None = None,
        into: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Collective over ``coll``: call on all ranks. See
        :meth:`resilient.manager.CheckpointManager.restore`; ``into`` maps leaf paths to the
        arrays to read into."""
        candidates = self._candidates(step) if self.coll.rank == 0 else iter(())
        while True:
            chosen = self.coll.broadcast("choosing a checkpoint", lambda: next(candidates))
            if into:
                self._check_template(chosen, into)
            state: dict[str, Any] = {}
            accepted = self.coll.all_reduce(
                f"restore of {chosen.path.name}",
                functools.partial(self._try_read, chosen, validate, state, into or {}),
                functools.partial(self._judge, chosen),
            )
            if accepted:
                return chosen.manifest.step, state
            if step is not None:
                raise CheckpointNotFoundError(
                    f"checkpoint of step {step} in {self.root} failed validation"
                )

    def read(
        self,
        path: Path,
        manifest: Manifest,
        *,
        validate: StateValidator | None = None,
        into: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any] | None, list[str]]:
        """Collective over ``coll``: every rank reads its piece of the checkpoint at ``path``
        (e.g. a node-local copy; its static data comes from :attr:`root`).

        Nothing is quarantined here.

        Returns:
            ``(state, [])`` for this rank, or ``(None, reasons)`` when a rank's piece failed.
        """
        chosen = self.coll.broadcast(
            f"loading the static data of {path}",
            lambda: _Candidate(path, manifest, self._static_manifest(manifest)),
        )
        if into:
            self._check_template(chosen, into)
        state: dict[str, Any] = {}
        reasons = self.coll.all_reduce(
            f"restore of {path}",
            functools.partial(self._try_read, chosen, validate, state, into or {}),
            lambda found: [f"rank {r}: {why}" for r, why in enumerate(found) if why is not None],
        )
        return (None, reasons) if reasons else (state, [])

    def _candidates(self, step: int | None) -> Iterator[_Candidate]:
        """Coordinator: valid checkpoints newest first (quarantining invalid ones on the way)."""
        current = self.layout
        for record in iter_checkpoints(self.root, step=step):
            if record.manifest is None:
                storage.quarantine(record.path, record.step, record.reason)
                self.catalog.quarantined(record.step)
                continue
            saved = record.manifest.layout
            if saved.nranks != current.nranks or saved.kind != current.kind:
                raise LayoutMismatchError(saved.describe(), current.describe())
            yield _Candidate(record.path, record.manifest, self._static_manifest(record.manifest))
        where = f"of step {step} " if step is not None else ""
        raise CheckpointNotFoundError(f"no valid checkpoint {where}in {self.root}")

    def _static_manifest(self, manifest: Manifest) -> Manifest | None:
        if manifest.static is None:
            return None
        path = self.root / layout.STATIC_DIR / layout.static_dir_name(manifest.static)
        return load_manifest(path, kind="static")

    def _check_template(self, chosen: _Candidate, into: Mapping[str, Any]) -> None:
        """Collective: every rank checks that its template fits (not the checkpoint's fault: a
        mismatch raises :class:`ConfigError` and quarantines nothing)."""
        rank, what = self.coll.rank, f"restore into the given arrays ({chosen.path.name})"

        def check() -> None:
            check_template(chosen.manifest.ranks[rank], into, what=what)
            if chosen.static is not None:
                check_template(chosen.static.ranks[rank], into, what=what)

        self.coll.check(what, check)

    def _try_read(
        self,
        chosen: _Candidate,
        validate: StateValidator | None,
        state: dict[str, Any],
        into: Mapping[str, Any],
    ) -> str | None:
        """Every rank: read this rank's piece into ``state``; what is wrong with it, or ``None``."""
        try:
            state.update(self._read(chosen, validate, into))
        except InvalidCheckpointError as exc:
            return exc.reason
        except _Rejected as exc:
            return str(exc)
        except Exception as exc:  # anything wrong with this piece rejects the checkpoint
            return describe_error(exc)
        return None

    def _judge(self, chosen: _Candidate, reasons: list[str | None]) -> bool:
        """Coordinator: accept the checkpoint, or quarantine it with every rank's reason."""
        bad = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
        if bad:
            self._quarantine(chosen, "; ".join(bad[:4]))
        return not bad

    def _read(
        self, chosen: _Candidate, validate: StateValidator | None, into: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Every rank: read and check this rank's piece; raise on anything wrong with it."""
        rank = self.coll.rank
        state = read_rank(chosen.path, chosen.manifest, rank, into=into)
        if chosen.static is not None:
            static_dir = self.root / layout.STATIC_DIR / str(chosen.manifest.static)
            state.update(read_rank(static_dir, chosen.static, rank, into=into))
        if validate is None:
            return state
        try:
            accepted = validate(state)
        except Exception as exc:
            raise _Rejected(f"validate hook raised {describe_error(exc)}") from None
        if not accepted:
            raise _Rejected(f"state rejected by the application's validate hook on rank {rank}")
        return state

    def _quarantine(self, chosen: _Candidate, why: str) -> None:
        try:
            storage.quarantine(chosen.path, chosen.manifest.step, why)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", chosen.path, exc)
        self.catalog.quarantined(chosen.manifest.step)


class _Rejected(Exception):
    """The application's validate hook rejected a restored state."""
