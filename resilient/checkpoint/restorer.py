"""Restoring the newest valid checkpoint, falling back past bad ones. Collective.

Call order of :meth:`Restorer.restore` (every step through
:class:`~resilient.parallel.collective.Collective`)::

    coordinator   next candidate from checkpoints.iter_checkpoints (newest first; quarantines
                  checkpoints that fail quick validation; layout checked: another rank count
                  or layout needs a checkpoint that can be restored elastically, every entry
                  of a sharded manifest loaded for it: manifests.load_entries)
    scatter       each rank receives its part of the candidate's manifest (Manifest.part: its
                  own entry, its group's for a file group's leader, their files, the header;
                  the layout's groups only when they differ from this run's): what a rank
                  receives grows with its own datasets, not with the rank count. With
                  manifest shards in two levels: each shard's leader receives its shard's
                  part, reads the saved shard once (checked against the index) and deals
                  each rank its part with its entries as read (each rank parses its own)
    every rank    elastic or not: another layout, or a rank whose new blocks differ from its
                  saved ones (one small allreduce)
    broadcast     only for an elastic restore: the whole manifest (other ranks' entries)
    every rank    load its own entries (of a sharded manifest: its own shard only, through
                  manifests.load_entries, unless its shard's leader did; a lookup never reads a
                  file), read its piece and its
                  static data (or, elastically, its new blocks and the replicated values:
                  resilient.checkpoint.elasticread), verify checksums, run the validate hook
    coordinator   accept, or quarantine it with every rank's reason and try the next older one
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from resilient.checkpoint.catalog import Catalog
from resilient.checkpoint.elasticread import (
    ElasticPlan,
    ReadStats,
    another_layout,
    needs_elastic,
    read_elastic,
)
from resilient.checkpoint.reading import check_template, read_rank
from resilient.errors import (
    CheckpointNotFoundError,
    ConfigError,
    InvalidCheckpointError,
    StaticDataError,
)
from resilient.io.checkpoints import check_file_sizes, iter_checkpoints, statics_of
from resilient.io.devicecopy import DeviceStaging
from resilient.io.manifests import load_entries, read_shards
from resilient.io.repair import repair_static
from resilient.io.targets import SetRef, Target, set_files
from resilient.model.blocks import BlockSpec
from resilient.model.dtensors import needs_target
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, ManifestError, columns_of
from resilient.model.shards import ShardDoc
from resilient.model.tree import Memo, leaf_metas
from resilient.parallel.collective import Collective, describe_error
from resilient.parallel.setcomms import SetComms, deal_through_leaders

__all__ = [
    "Candidate",
    "Restorer",
    "StateValidator",
    "as_received",
    "rank_parts",
    "shard_parts",
]

log = logging.getLogger(__name__)

StateValidator = Callable[[Mapping[str, Any]], bool]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A checkpoint the coordinator chose to try restoring; each rank receives its part
    (:func:`rank_parts`), the whole one only for an elastic restore."""

    at: SetRef  # where it is (the shared root's step, a node-local copy, a staged copy)
    manifest: Manifest
    static: Manifest | None
    elastic: bool = False  # another layout: only an elastic restore can read it
    # handed out by its shard's leader (Restorer._spread): the saved shards holding this rank's
    # entries (of its manifest, of its static data's), read and checked, these entries only
    # (the rank parses them); or why they could not be read
    docs: Mapping[str, ShardDoc] | None = None
    static_docs: Mapping[str, ShardDoc] | None = None
    unloadable: str | None = None
    # the intact copies of its static data (of the root's static data target), the one to
    # read first (:func:`repair_static`)
    static_dirs: tuple[str, ...] = ()


def _needed(saved: Layout, current: Layout) -> list[tuple[int, ...]]:
    """The ranks whose entries each rank of ``current`` needs for a plain restore: its own, and
    a file group's leader its group's too (to reuse the file's skeleton at its next save, see
    :func:`~resilient.checkpoint.saveset.seed_cache`); nothing for another layout (elastic: the whole
    manifest follows)."""
    if saved.nranks != current.nranks or saved.kind != current.kind:
        return [()] * current.nranks
    needed: list[tuple[int, ...]] = [(r,) for r in range(current.nranks)]
    if saved.groups == current.groups:
        for group in saved.groups:
            needed[group[0]] = group
    return needed


def _stripped(saved: Layout, current: Layout) -> Layout | None:
    """``saved`` without its groups when it is ``current`` (every rank knows those): a part
    then carries nothing that grows with the rank count. ``None``: send it as it is."""
    return Layout(saved.kind, saved.nranks, ()) if saved == current else None


def _static_parts(
    static: Manifest | None, current: Layout, ranks: Sequence[Sequence[int]] | None = None
) -> list[Manifest | None]:
    """The part of a static data set's manifest each rank of ``current`` receives: its own
    entry (where the set has one); ``ranks``: the part of each set of ranks instead (each
    rank's entry, where the set has one)."""
    sets = [(r,) for r in range(current.nranks)] if ranks is None else ranks
    if static is None:
        return [None] * len(sets)
    n = len(static.ranks)
    needed = [tuple(r for r in rs if r < n) for rs in sets]
    return list(static.parts(needed, layout=_stripped(static.layout, current)))


def rank_parts(
    whole: Candidate, current: Layout, ranks: Sequence[int] | None = None
) -> list[Candidate]:
    """The part of ``whole`` (a candidate, or a part holding what they need) each rank of
    ``current`` receives (see :func:`_needed`); ``ranks``: those ranks' only, in order."""
    m = whole.manifest
    needed = _needed(m.layout, current)
    wanted = range(current.nranks) if ranks is None else ranks
    manifests = m.parts([needed[r] for r in wanted], layout=_stripped(m.layout, current))
    statics = _static_parts(whole.static, current, [(r,) for r in wanted])
    return [
        dataclasses.replace(whole, manifest=part, static=static)
        for part, static in zip(manifests, statics, strict=True)
    ]


def _docs_of(part: Manifest | None, docs: Mapping[str, ShardDoc]) -> Mapping[str, ShardDoc] | None:
    """Of the shards ``docs``, the entries of the files ``part`` lists, in the shards it
    names (``None``: nothing to hand on)."""
    sharded = None if part is None else part.sharded
    if part is None or sharded is None or not docs:
        return None
    wanted = [r for ranks in columns_of(part.files).ranks for r in ranks]
    return {s.name: docs[s.name].subset(wanted) for s in sharded.shards if s.name in docs}


def shard_parts(
    whole: Candidate, current: Layout, shards: Sequence[Sequence[int]]
) -> list[Candidate]:
    """Coordinator: the part of ``whole`` each manifest shard's leader of ``current`` receives
    (``shards``: every shard's ranks): what its ranks need, together (:func:`rank_parts` of it,
    made on the leader, gives each its own)."""
    m = whole.manifest
    needed = _needed(m.layout, current)
    sets = [sorted({r for member in members for r in needed[member]}) for members in shards]
    manifests = m.parts(sets, layout=_stripped(m.layout, current))
    statics = _static_parts(whole.static, current, shards)
    return [
        dataclasses.replace(whole, manifest=part, static=static)
        for part, static in zip(manifests, statics, strict=True)
    ]


def as_received(manifest: Manifest, current: Layout) -> Manifest:
    """A part as received, its layout's groups put back (see :func:`_stripped`)."""
    lay = manifest.layout
    if manifest.is_part and not lay.groups:
        if (lay.kind, lay.nranks) != (current.kind, current.nranks):
            raise ValueError(f"a part of a manifest of another layout ({lay.kind}, {lay.nranks})")
        return dataclasses.replace(manifest, layout=current)
    return manifest


def _holds(manifest: Manifest, rank: int) -> bool:
    """Whether ``manifest`` holds ``rank``'s entry (a sharded one: loaded, see
    :meth:`Restorer._load`)."""
    sharded = manifest.sharded
    return sharded is None or sharded.loaded(rank)


def _needs_elastic(chosen: Candidate, rank: int, blocks: Mapping[str, BlockSpec]) -> bool:
    """Whether ``rank``, with ``blocks`` as its new blocks, must read ``chosen`` elastically
    (``chosen`` holds that rank's entries, loaded by :meth:`Restorer._load`).

    An entry whose shard could not be loaded says no here: the rank's read then fails on it,
    and the checkpoint is quarantined as for any other corruption."""
    static = chosen.static
    if not blocks or not _holds(chosen.manifest, rank):
        return False
    if needs_elastic(chosen.manifest.ranks[rank], blocks):
        return True
    return static is not None and _holds(static, rank) and needs_elastic(static.ranks[rank], blocks)


@dataclass(frozen=True, slots=True)
class _Elastic:
    """The elastic plans of a candidate (its state's and its static data's)."""

    state: ElasticPlan
    static: ElasticPlan | None


class Restorer:
    """Restores checkpoints of ``target`` for the ranks of ``coll``.

    Args:
        target: the checkpoint root's target.
        coll: the ranks; the coordinator chooses and quarantines.
        catalog: told about quarantined checkpoints (so that rotation forgets them).
        layout: the layout of this run (another one on disk is a :class:`LayoutMismatchError`).
        memo: the owner's :class:`~resilient.model.tree.Memo` for parsing manifests and rebuilding
            states (``None``: this restorer's own).
        digester: the owner's checksum thread for the reads (``None``: one per read).
        devices: the owner's device staging, whose arena restores of CUDA tensors go through
            (into the caller's, or new ones on the saved device; ``None``: each is filled from
            new host memory).
        shards: this run's set communicators, when they have manifest shards
            (:attr:`SetComms.shard`): a candidate's parts are then handed out in two levels,
            each shard's leader receiving its shard's part, reading the saved shard once and
            dealing each of its ranks its own part (``None``: rank 0 sends every rank its part).
    """

    def __init__(
        self,
        target: Target,
        coll: Collective,
        catalog: Catalog,
        *,
        layout: Layout,
        memo: Memo | None = None,
        digester: Executor | None = None,
        devices: DeviceStaging | None = None,
        shards: SetComms | None = None,
    ) -> None:
        assert shards is None or shards.shard is not None
        self.shards = shards
        self.target = target
        self.statics = statics_of(target)
        self.devices = devices
        self.memo = Memo() if memo is None else memo
        self.digester = digester
        self.coll = coll
        self.catalog = catalog
        self.layout = layout
        self.last_read: ReadStats | None = None  # of this rank's last elastic read
        # the devices that tensors read since the owner last cleared it were saved on and that
        # do not exist here (those came back on the CPU): the owner says so once per restore
        self.absent_devices: set[str] = set()
        # the checkpoint the last restore or read returned: (where it is, its manifest)
        self.last_restored: tuple[SetRef, Manifest] | None = None
        # coordinator: the steps the last restore quarantined on its way to the one it returned
        self.passed_over: list[int] = []
        # coordinator: what the last restore found of static data that no copy of could be read
        self._lost: StaticDataError | None = None

    def restore(
        self,
        step: int | None = None,
        *,
        validate: StateValidator | None = None,
        into: Mapping[str, Any] | None = None,
        blocks: Mapping[str, BlockSpec] | None = None,
        refused: Exception | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Collective over ``coll``: call on all ranks. See
        :meth:`resilient.checkpoint.manager.CheckpointManager.restore`; ``into`` maps leaf paths to the
        arrays to read into, ``blocks`` leaf paths to this rank's new blocks; ``refused``, what
        was wrong with this rank's arguments (raised on every rank in the first round)."""
        self.passed_over = []
        candidates = self._candidates(step) if self.coll.rank == 0 else iter(())
        mine: dict[str, BlockSpec] | Exception = refused or dict(blocks or {})
        while True:  # one round: every rank's blocks up, its part of a candidate down
            gathered = self.coll.gather(mine)
            whole: Candidate | None = None  # the coordinator's candidate, whole
            parts: list[tuple[Candidate, bool]] | Exception | None = None
            if gathered is not None:
                try:
                    asked = gathered.values()
                    whole, elastic = self._asks_elastic(next(candidates), asked)
                    parts = [(part, elastic) for part in self._first_parts(whole)]
                except Exception as exc:
                    parts = exc
            part, elastic = self._hand_out(
                "checking the restore's arguments and choosing a checkpoint", parts
            )
            plan, chosen = self._plan(self._receive(part), elastic, whole)
            chosen, state, why = self._try_read(chosen, validate, into or {}, plan, blocks or {})
            reads = self.coll.gather(why)
            verdict: bool | Exception | None = None
            if reads is not None:
                try:
                    verdict = self._judge(chosen, reads.values())
                except Exception as exc:
                    verdict = exc
            if self.coll.announce(f"restore of {chosen.at.name}", verdict):
                if self.coll.rank == 0 and reads is not None:
                    self._repair_after_read(chosen, reads.values())
                self.last_restored = (chosen.at, chosen.manifest)
                return chosen.manifest.step, state
            if step is not None:
                raise CheckpointNotFoundError(
                    f"checkpoint of step {step} in {self.target} failed validation"
                )

    def read(
        self,
        at: SetRef,
        manifest: Manifest,
        *,
        validate: StateValidator | None = None,
        into: Mapping[str, Any] | None = None,
        blocks: Mapping[str, BlockSpec] | None = None,
    ) -> tuple[dict[str, Any] | None, list[str]]:
        """Collective over ``coll``: every rank reads its piece of the checkpoint ``at`` (this
        rank's: e.g. a node-local copy; its static data comes from :attr:`target`), saved with
        this run's layout.

        Nothing is quarantined here.

        Returns:
            ``(state, [])`` for this rank, ``(None, reasons)`` when a rank's piece failed, or
            ``(None, [])`` when some rank's ``blocks`` differ from its saved ones (an elastic
            restore, which reads other ranks' files: use the shared root).
        """

        def parts() -> list[tuple[Manifest | None, tuple[str, ...]]]:
            static, dirs = self._static_source(manifest)
            return [(p, dirs) for p in _static_parts(static, self.layout)]

        static, dirs = self.coll.scatter(f"loading the static data of {at}", parts)
        if static is not None:
            static = as_received(static, self.layout)
        # this rank's copy: a node-local one
        chosen = Candidate(at, manifest, static, static_dirs=dirs)
        # a shard that cannot be loaded: this rank's read below fails on it, saying why
        with contextlib.suppress(InvalidCheckpointError, ManifestError):
            chosen = self._load(chosen, (self.coll.rank,))
        if self._needs_elastic(chosen, blocks or {}):
            return None, []
        chosen, state, why = self._try_read(chosen, validate, into or {}, None, {})
        reasons = self._failed_reads(f"restore of {at}", why, chosen)
        if reasons:
            return None, reasons
        self.last_restored = (at, chosen.manifest)
        return state, []

    def read_elastic(
        self,
        at: SetRef,
        manifest: Manifest,
        *,
        validate: StateValidator | None = None,
        into: Mapping[str, Any] | None = None,
        blocks: Mapping[str, BlockSpec] | None = None,
    ) -> tuple[dict[str, Any] | None, list[str]]:
        """Collective over ``coll``: every rank reads its new blocks of the checkpoint whose
        whole manifest (every entry; the same on every rank) is ``manifest``, from ``at``:
        this rank's own copy of it (a node's staged copy of a node-local checkpoint,
        :mod:`resilient.checkpoint.tierstaging`, holding the files its ranks read; static data
        from :attr:`target`). Every stripe read is verified; nothing is quarantined here.

        Returns:
            ``(state, [])`` for this rank, or ``(None, reasons)`` when a rank's read failed.

        Raises:
            LayoutMismatchError: the static data cannot be restored elastically (every rank).
            ConfigError: ``blocks`` or ``into`` do not fit (every rank).
        """

        def whole_static() -> tuple[Manifest | None, tuple[str, ...]]:
            static, dirs = self._static_source(manifest)
            try:
                if static is not None:
                    files = set_files(self.statics, dirs[0])
                    static = load_entries(files, static, None, memo=self.memo)
            except InvalidCheckpointError as exc:
                raise StaticDataError(exc.path, exc.reason) from None
            except ManifestError as exc:
                where = self.statics.where(dirs[0])
                raise StaticDataError(where, f"bad manifest: {exc}") from None
            return static, dirs

        static, dirs = self.coll.broadcast(f"loading the static data of {at.name}", whole_static)
        chosen = Candidate(at, manifest, static, elastic=True, static_dirs=dirs)
        plan = self._elastic_plans(chosen)
        chosen, state, why = self._try_read(chosen, validate, into or {}, plan, blocks or {})
        reasons = self._failed_reads(f"elastic restore of {at}", why, chosen)
        if reasons:
            return None, reasons
        self.last_restored = (at, chosen.manifest)
        return state, []

    def _failed_reads(
        self, what: str, why: str | Exception | _StaticNote | None, chosen: Candidate
    ) -> list[str]:
        """Collective: every rank's read failure (``why``; ``None``: it read its piece) as
        ``rank R: why`` lines, on every rank (empty: every rank read its piece); an exception
        a rank passes (e.g. a ``ConfigError``) is raised on every rank. A copy of the static
        data that failed a rank's read (which read the other) is repaired."""
        gathered = self.coll.gather(why)
        found: list[str] | Exception | None = None
        if gathered is not None:
            try:
                values = list(gathered.values())
                lost = _lost_in(values)
                if lost is not None:
                    raise lost
                found = [
                    f"rank {r}: {w}"
                    for r, w in enumerate(values)
                    if w is not None and not isinstance(w, _StaticNote)
                ]
                if not found:
                    self._repair_after_read(chosen, values)
            except Exception as exc:
                found = exc
        reasons: list[str] = self.coll.announce(what, found)
        return reasons

    def _first_parts(self, whole: Candidate) -> list[Candidate]:
        """Coordinator: the parts of ``whole`` it sends: one per rank, or with shards one per
        shard (:meth:`_hand_out`)."""
        if self.shards is None:
            return rank_parts(whole, self.layout)
        return shard_parts(whole, self.layout, self.shards.shards)

    def _hand_out(
        self, what: str, parts: list[tuple[Candidate, bool]] | Exception | None
    ) -> tuple[Candidate, bool]:
        """Collective: each rank's part of the coordinator's candidate (and whether it is read
        elastically), or the coordinator's error on every rank: dealt to every rank (one
        scatter), or with shards through their leaders (:func:`deal_through_leaders`), each
        leader loading its ranks' entries (its shard read once: :meth:`_spread`)."""
        if self.shards is None:
            got: tuple[Candidate, bool] = self.coll.deal(what, parts)
            return got
        return deal_through_leaders(self.shards, what, parts, self._spread)

    def _spread(self, given: tuple[Candidate, bool]) -> list[tuple[Candidate, bool]]:
        """Shard leader: its shard's part of a candidate (``given``) as each of its ranks
        receives it, with the saved shards holding its entries read once, here (checked
        against the index: :func:`~resilient.io.manifests.read_shards`), each rank's entries
        handed on unparsed (each rank parses its own, in parallel: :meth:`_load`). A shard
        that cannot be read gives each rank the reason instead, which its read reports (the
        candidate then fails on every rank, and the restore falls back)."""
        assert self.shards is not None
        part, elastic = given
        members = self.shards.shard_members
        try:
            part = self._receive(part)
            docs: dict[str, ShardDoc] = {}
            static_docs: dict[str, ShardDoc] = {}
            if not elastic:  # (an elastic restore sends the whole manifest, loaded, to all)
                try:
                    self._check_sizes(part)  # (which the coordinator did not: _candidates)
                    docs = read_shards(part.at.files, part.manifest, members)
                    static = part.static
                    if static is not None:
                        mine = [r for r in members if r < len(static.ranks)]
                        static_docs = _first_copy(
                            self.statics, part.static_dirs,
                            lambda d: read_shards(set_files(self.statics, d), static, mine),
                        )[0]  # fmt: skip
                except StaticDataError:
                    pass  # each rank's read tries every copy and says what failed
                except InvalidCheckpointError as exc:
                    part = dataclasses.replace(part, unloadable=exc.reason)
                except ManifestError as exc:
                    part = dataclasses.replace(part, unloadable=f"bad manifest: {exc}")
            return [
                (dataclasses.replace(p, docs=_docs_of(p.manifest, docs),
                                     static_docs=_docs_of(p.static, static_docs)), elastic)
                for p in rank_parts(part, self.layout, members)
            ]  # fmt: skip
        except Exception as exc:  # (e.g. EIO): never raise here, or its shard alone would
            failed = dataclasses.replace(part, unloadable=describe_error(exc))
            return [(failed, elastic)] * len(members)

    def _check_sizes(self, candidate: Candidate) -> None:
        """Quick validation of the data files of ``candidate`` (a part: its files only) and
        of its static data's (:func:`~resilient.io.checkpoints.check_file_sizes`). Not collective.

        Raises:
            InvalidCheckpointError: a file is missing or of another size.
        """
        check_file_sizes(candidate.at.target, candidate.at.key, candidate.manifest)
        static = candidate.static
        if static is not None:
            _first_copy(
                self.statics, candidate.static_dirs,
                lambda d: check_file_sizes(self.statics, d, static),
            )  # fmt: skip

    def _load(self, chosen: Candidate, ranks: Sequence[int] | None) -> Candidate:
        """``chosen`` with the entries of ``ranks`` (``None``: all it indexes) loaded, of its
        manifest and its static data's (:func:`~resilient.io.manifests.load_entries`: the shards
        of a sharded manifest holding them, unless its shard's leader handed them on; their
        file groups' entries). Not collective.

        Raises:
            InvalidCheckpointError, ManifestError: a shard that is missing, changed or malformed.
        """
        manifest = load_entries(
            chosen.at.files, chosen.manifest, ranks, memo=self.memo, read=chosen.docs
        )
        static = chosen.static
        if static is not None:
            n = len(static.ranks)
            wanted = None if ranks is None else [r for r in ranks if r < n]
            static = _first_copy(
                self.statics,
                chosen.static_dirs,
                lambda d: load_entries(
                    set_files(self.statics, d),
                    static,
                    wanted,
                    memo=self.memo,
                    read=chosen.static_docs,
                ),
            )[0]
        return dataclasses.replace(chosen, manifest=manifest, static=static)

    def _asks_elastic(self, whole: Candidate, asked: Iterable[Any]) -> tuple[Candidate, bool]:
        """Coordinator: whether some rank's new blocks (``asked``, every rank's) differ from its
        saved ones, or the layout does; and ``whole`` with the entries this looked at loaded
        (all of them for an elastic restore, which sends the whole manifest to every rank).

        A shard that cannot be loaded says no here: the reads of its ranks then fail on it."""
        asked = list(asked)
        wanted = [r for r, blocks in enumerate(asked) if blocks]
        if whole.elastic or not wanted:
            return whole, whole.elastic
        try:
            whole = self._load(whole, wanted)
        except (InvalidCheckpointError, ManifestError):
            return whole, False
        if not any(_needs_elastic(whole, r, b) for r, b in enumerate(asked)):
            return whole, False
        return self._load(whole, None), True

    def _receive(self, part: Candidate) -> Candidate:
        """This rank's part of a candidate, its layout put back."""
        static = None if part.static is None else as_received(part.static, self.layout)
        return dataclasses.replace(
            part, manifest=as_received(part.manifest, self.layout), static=static
        )

    def _needs_elastic(self, chosen: Candidate, blocks: Mapping[str, BlockSpec]) -> bool:
        """Collective: whether the candidate must be read elastically (another layout, or a
        rank whose new blocks differ from its saved ones)."""
        if chosen.elastic:
            return True
        try:
            mine: bool | Exception = _needs_elastic(chosen, self.coll.rank, blocks)
        except Exception as exc:
            mine = exc
        gathered = self.coll.gather(mine)
        answer: bool | Exception | None = None
        if gathered is not None:
            try:
                answer = any(gathered.values())
            except Exception as exc:
                answer = exc
        return bool(self.coll.announce("deciding on an elastic restore", answer))

    def _plan(
        self, chosen: Candidate, elastic: bool, whole: Candidate | None
    ) -> tuple[_Elastic | None, Candidate]:
        """Collective: the candidate's elastic plans (if it is read ``elastic``-ally), or
        ``None`` for a plain read; and the candidate to read (for an elastic restore, which
        reads other ranks' entries, the whole one, ``whole`` on the coordinator, sent to all).

        Raises:
            LayoutMismatchError: per-rank data that is not declared (naming it), on every rank.
        """
        if not elastic:
            return None, chosen
        chosen = self.coll.announce(
            f"sending the whole manifest of {chosen.at.name} for an elastic restore", whole
        )
        return self._elastic_plans(chosen), chosen

    def _elastic_plans(self, chosen: Candidate) -> _Elastic:
        """Collective (every rank plans from the whole manifest it holds): the elastic plans of
        ``chosen``, or the same :class:`LayoutMismatchError` on every rank."""
        current = self.layout.describe()

        def plan() -> _Elastic:
            static = chosen.static
            return _Elastic(
                ElasticPlan.of(chosen.manifest, current=current),
                None if static is None else ElasticPlan.of(static, current=current),
            )

        return self.coll.check(f"planning an elastic restore of {chosen.at.name}", plan)

    def _candidates(self, step: int | None) -> Iterator[Candidate]:
        """Coordinator: valid checkpoints newest first (quarantining invalid ones on the way).

        With shards, the data files are not looked at here (100,000 files at 100,000 ranks):
        each shard's leader checks those of its shard (:meth:`_spread`), and the coordinator
        those of a candidate of another layout (an elastic restore, whose parts hold none)."""
        current = self.layout
        sized = self.shards is None
        lost: StaticDataError | None = None
        self._lost = None
        sources: dict[str | None, tuple[Manifest | None, tuple[str, ...]]] = {}
        for record in iter_checkpoints(self.target, step=step, memo=self.memo, data_files=sized):
            if record.shared:  # its own files passed; the static data it shares did not
                log.warning(
                    "checkpoint of step %d not restored (not quarantined): %s",
                    record.step, record.reason,
                )  # fmt: skip
                lost = lost or StaticDataError(str(record.path), record.reason)
                continue
            if record.manifest is None:
                self.target.quarantine(record.step, record.reason)
                self.catalog.quarantined(record.step)
                self.passed_over.append(record.step)
                continue
            saved = record.manifest.layout
            try:  # (each content checked and repaired once per restore)
                content = record.manifest.static
                if content not in sources:
                    sources[content] = self._static_source(record.manifest)
                static, dirs = sources[content]
            except StaticDataError as exc:
                log.warning(
                    "checkpoint of step %d not restored (not quarantined): its static data %s",
                    record.step, exc,
                )  # fmt: skip
                lost = lost or exc
                continue
            elastic = another_layout(saved, current)
            at = SetRef(self.target, record.step)
            candidate = Candidate(at, record.manifest, static, elastic, static_dirs=dirs)
            if elastic:  # restorable elastically, or a LayoutMismatchError naming the keys
                try:
                    if not sized:
                        self._check_sizes(candidate)
                    candidate = self._load(candidate, None)  # (every entry: the whole is sent)
                    ElasticPlan.of(candidate.manifest, current=current.describe())
                    if candidate.static is not None:
                        ElasticPlan.of(candidate.static, current=current.describe())
                except (InvalidCheckpointError, ManifestError) as exc:  # a shard
                    why = exc.reason if isinstance(exc, InvalidCheckpointError) else str(exc)
                    self.target.quarantine(record.step, why)
                    self.catalog.quarantined(record.step)
                    self.passed_over.append(record.step)
                    continue
            yield candidate
        lost = lost or self._lost
        if lost is not None:  # intact checkpoints whose static data is lost: say what to do
            raise lost
        where = f"of step {step} " if step is not None else ""
        raise CheckpointNotFoundError(f"no valid checkpoint {where}in {self.target}")

    def _static_source(self, manifest: Manifest) -> tuple[Manifest | None, tuple[str, ...]]:
        """Coordinator: the manifest of ``manifest``'s static data (its index, for a sharded
        one) and its intact copies, the one to read first (a damaged copy repaired from the
        other: :func:`~resilient.io.repair.repair_static`); ``(None, ())``: it has none.

        Raises:
            StaticDataError: no intact copy (what a repair could not make whole).
        """
        if manifest.static is None:
            return None, ()
        source = repair_static(self.statics, manifest.static)
        if not source.dirs:
            reasons = "; ".join(f"{name}/: {why}" for name, why in source.damaged)
            raise StaticDataError(
                self.statics.where(manifest.static),
                f"its only copy of the data files needs the other copy's manifest, which could "
                f"not be put back ({reasons}): make the directory writable and restore again",
            )
        return self.statics.manifest(source.dirs[0], kind="static"), source.dirs

    def _repair_after_read(self, chosen: Candidate, reads: Iterable[object]) -> None:
        """Coordinator: a copy of the static data failed some rank's read (the rank read the
        other): check both copies fully and repair the damaged one (one warning)."""
        notes = [w for w in reads if isinstance(w, _StaticNote)]
        if not notes or chosen.manifest.static is None:
            return
        log.info("static data %s: %s", chosen.manifest.static, notes[0].reasons[0])
        try:
            repair_static(self.statics, chosen.manifest.static, full=True)
        except (StaticDataError, OSError) as exc:
            log.warning("static data %s could not be repaired: %s", chosen.manifest.static, exc)

    def _check_template(self, chosen: Candidate, into: Mapping[str, Any]) -> None:
        """This rank: check that its template fits, before reading (not the checkpoint's fault:
        a mismatch raises :class:`ConfigError`, which :meth:`_try_read` lets through, so that
        the read's round raises it on every rank and quarantines nothing)."""
        rank, what = self.coll.rank, f"restore into the given arrays ({chosen.at.name})"
        check_template(chosen.manifest.ranks[rank], into, what=what)
        if chosen.static is not None:
            check_template(chosen.static.ranks[rank], into, what=what)

    def _try_read(
        self,
        chosen: Candidate,
        validate: StateValidator | None,
        into: Mapping[str, Any],
        plan: _Elastic | None,
        blocks: Mapping[str, BlockSpec],
    ) -> tuple[Candidate, dict[str, Any], str | ConfigError | _StaticNote | None]:
        """Every rank: load this rank's entries (a plain read: :meth:`_load`) and read its
        piece; the candidate as loaded, the state read (empty if it was not) and what is wrong
        with it (``None``: nothing), or the caller's :class:`ConfigError` (``blocks`` or
        ``into`` do not fit: not the checkpoint's fault, nothing is quarantined), for the
        read's round."""
        if chosen.unloadable is not None and plan is None:
            return chosen, {}, chosen.unloadable
        try:
            if plan is None:
                chosen = self._load(chosen, (self.coll.rank,))
                if into:
                    self._check_template(chosen, into)
            state, note = self._read(chosen, validate, into, plan, blocks)
            return chosen, state, note
        except StaticDataError as exc:  # (not the checkpoint's fault: no quarantine)
            return chosen, {}, _StaticNote((), lost=(exc.path, exc.reason))
        except ConfigError as exc:
            return chosen, {}, exc
        except InvalidCheckpointError as exc:
            return chosen, {}, exc.reason
        except ManifestError as exc:  # its shard of a sharded manifest
            return chosen, {}, f"bad manifest: {exc}"
        except _Rejected as exc:
            return chosen, {}, str(exc)
        except Exception as exc:  # anything wrong with this piece rejects the checkpoint
            return chosen, {}, describe_error(exc)

    def _judge(self, chosen: Candidate, reasons: list[str | _StaticNote | None]) -> bool:
        """Coordinator: accept the checkpoint, or quarantine it with every rank's reason (a
        rank that read its static data from the second copy read its piece)."""
        lost = _lost_in(reasons)
        if lost is not None:  # its own files may be intact: try an older one, keep this one
            log.warning(
                "checkpoint of step %d not restored (not quarantined): %s",
                chosen.manifest.step, lost,
            )  # fmt: skip
            self._lost = self._lost or lost
            return False
        bad = [
            f"rank {r}: {why}"
            for r, why in enumerate(reasons)
            if why is not None and not isinstance(why, _StaticNote)
        ]
        if bad:
            self._quarantine(chosen, "; ".join(bad[:4]))
        return not bad

    def _read(
        self,
        chosen: Candidate,
        validate: StateValidator | None,
        into: Mapping[str, Any],
        plan: _Elastic | None,
        blocks: Mapping[str, BlockSpec],
    ) -> tuple[dict[str, Any], _StaticNote | None]:
        """Every rank: read and check this rank's piece; raise on anything wrong with it (a
        :class:`StaticDataError` when only its static data is: no copy of it could be read);
        and what failed of a copy of the static data before the other was read."""
        rank = self.coll.rank
        note: _StaticNote | None = None
        _check_dtensors(chosen, plan, rank, into, blocks)
        if plan is not None:
            stats = ReadStats()
            self.last_read = stats
            elastic = functools.partial(
                read_elastic, blocks=blocks, into=into, stats=stats, absent=self.absent_devices
            )
            state = elastic(chosen.at.opener, str(chosen.at), plan.state)
            if plan.static is not None:
                static_plan = plan.static
                got, note = _first_copy(
                    self.statics, chosen.static_dirs,
                    lambda d: elastic(
                        functools.partial(self.statics.open_reader, d), self.statics.where(d),
                        static_plan,
                    ),
                )  # fmt: skip
                state.update(got)
        else:
            read = functools.partial(
                read_rank, rank=rank, into=into, memo=self.memo, digester=self.digester,
                device=self.devices, absent=self.absent_devices,
            )  # fmt: skip
            state = read(chosen.at.opener, str(chosen.at), chosen.manifest)
            static = chosen.static
            if static is not None:
                got, note = _first_copy(
                    self.statics, chosen.static_dirs,
                    lambda d: read(
                        functools.partial(self.statics.open_reader, d), self.statics.where(d),
                        static,
                    ),
                )  # fmt: skip
                state.update(got)
        if validate is None:
            return state, note
        try:
            accepted = validate(state)
        except Exception as exc:
            raise _Rejected(f"validate hook raised {describe_error(exc)}") from None
        if not accepted:
            raise _Rejected(f"state rejected by the application's validate hook on rank {rank}")
        return state, note

    def _quarantine(self, chosen: Candidate, why: str) -> None:
        try:
            chosen.at.target.quarantine(chosen.manifest.step, why)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", chosen.at, exc)
        self.catalog.quarantined(chosen.manifest.step)
        self.passed_over.append(chosen.manifest.step)


def _check_dtensors(
    chosen: Candidate,
    plan: _Elastic | None,
    rank: int,
    into: Mapping[str, Any],
    blocks: Mapping[str, BlockSpec],
) -> None:
    """Check that every DTensor leaf this rank reads has a target (see
    :func:`~resilient.model.dtensors.needs_target`).

    Raises:
        ConfigError: naming the first one without (the caller's fault: nothing is quarantined).
    """
    where = f"restore of {chosen.at.name}"
    if plan is not None:
        for elastic in (plan.state, plan.static):
            if elastic is not None:
                needs_target(elastic.metas, into, blocks, where=where)
        return
    for manifest in (chosen.manifest, chosen.static):
        if manifest is None or not _holds(manifest, rank):
            continue  # (an entry that could not be loaded: the read says why)
        tree = manifest.ranks[rank].tree
        if tree is not None:
            needs_target(leaf_metas(tree), into, blocks, where=where)


class _Rejected(Exception):
    """The application's validate hook rejected a restored state."""


@dataclass(frozen=True, slots=True)
class _StaticNote:
    """A rank read its static data from a later copy: why each earlier one failed."""

    reasons: tuple[str, ...]
    lost: tuple[str, str] | None = None  # no copy could be read: (where, why)


def _lost_in(reads: Iterable[object]) -> StaticDataError | None:
    """Coordinator: the :class:`StaticDataError` of the first rank that could read no copy of
    its static data (nothing is quarantined for it), if any."""
    for rank, why in enumerate(reads):
        if isinstance(why, _StaticNote) and why.lost is not None:
            return StaticDataError(why.lost[0], f"(rank {rank}) {why.lost[1]}")
    return None


_T = TypeVar("_T")


def _first_copy(
    statics: Target, dirs: Sequence[str], read: Callable[[str], _T]
) -> tuple[_T, _StaticNote | None]:
    """``read`` of the first copy of static data (``dirs``, of ``statics``) it succeeds on, and
    why the copies before it failed (``None``: none did). Local.

    Raises:
        StaticDataError: it failed on every copy (naming each failure).
        ConfigError: the caller's arguments do not fit (not the copy's fault).
    """
    failed: list[str] = []
    for d in dirs:
        try:
            return read(d), _StaticNote(tuple(failed)) if failed else None
        except ConfigError:
            raise
        except InvalidCheckpointError as exc:
            failed.append(f"{d}/: {exc.reason}")
        except Exception as exc:
            failed.append(f"{d}/: {describe_error(exc)}")
    where = statics.where(dirs[0].removesuffix(".copy")) if dirs else "static data"
    single = (
        ": its data files have one copy only (saved with static_copies=1, the default 2 keeps "
        "a second copy, or written before the copies)"
        if len(dirs) == 1
        else ""
    )
    raise StaticDataError(
        where,
        f"no copy of the static data could be read ({'; '.join(failed) or 'none found'}){single}. The "
        "checkpoints that use it are intact but cannot be restored without it (none was "
        "quarantined): put its directory back from a backup, or start over (delete the "
        "checkpoint directory)",
    )
