"""The node-local tier's staging of an elastic restore: a step saved on other ranks or nodes.

A job restarted on another rank count (or another decomposition, or other nodes) cannot read
the node-local checkpoints as they are: each rank's new blocks overlap stored blocks of files
that may sit on any node of the old job, as its own copy or as a partner copy
(:mod:`resilient.checkpoint.partner`). Before the shared root is looked at, the nodes of this
job stage the newest step they can complete between them (:meth:`TierStaging.stage`, called by
the tier's restore chain, :mod:`resilient.checkpoint.tiermanager`). Call order (every round
through :class:`~resilient.parallel.collective.Collective`; :func:`stage_newest`)::

    node leaders  only where the nodes can exchange files: the files of an earlier job's
                  node that no node here holds, one per XOR set, rebuilt from that set's
                  parity onto a survivor as a partner copy there
                  (:func:`~resilient.checkpoint.xorsets.rebuild_for_staging`)
    every rank    its new blocks; a node's first rank also what its node holds of every
                  step, of any layout (own copies and partner copies, sizes checked, partner
                  digests recorded: PartnerCopies.inventory), each distinct manifest sent
                  once, by the first node holding it (partner.gather_inventories)
    coordinator   plan_staging: the newest step (not older than the shared root's newest)
                  whose manifest has an elastic plan and whose files the nodes hold between
                  them; per node, the files holding stored blocks that overlap its ranks' new
                  blocks, plus saved rank 0's file for the replicated leaves (and, of a
                  manifest sharded by node, the shards of those files); who sends what
    node leaders  only for a step whose manifest is sharded by node (each node's copy holds
                  the index and its own ranks' shards, a partner copy its origin's): the
                  shards the coordinator lacks to plan it (ShardFetch), read from their own
                  or partner copies and checked against the index, gathered; one round per
                  such step planned (a shard no node can read: the step is passed over)
    node leaders  PartnerCopies.rebuild into <local root>/elastic/: own files linked, partner
                  copies copied with their digests checked, the rest received over the
                  channel (resilient.io.wire); committed with the saved manifest
    coordinator   one line: "staged local step N for an elastic restore on node(s) ..."

A partner copy found corrupt is quarantined and the choice made again (an older step, or
none: the shared root). Every rank then reads its new blocks from its own node's staged copy
(:meth:`~resilient.checkpoint.restorer.Restorer.read_elastic`), every stripe verified, with
the whole manifest (every entry: the elastic plan needs every rank's stored blocks) that the
coordinator announced: the staged shards are not read again.

Why a directory of its own (``<local root>/elastic/step_N``) and not a step of the tier: the
staged copy has another layout than this job and holds only what this node's ranks read, so
the tier's rotation, flush and same-layout restores must never see it. It is removed after
the restore (and at the next start, if a crash left it). The restored step is not adopted as
this run's unflushed checkpoint (another layout): the run's next save is newer, and until
then the old nodes' own and partner copies still hold it.

Why only the overlapping files: a restart on fewer nodes would otherwise move every node's
files to every node (the whole checkpoint times the node count over the wire).

Which calls are collective: :meth:`TierStaging.stage` and :func:`stage_newest` (over the
checkpoint set's communicator); :meth:`TierStaging.drop` and :func:`drop_staging` are local;
the planning (:func:`files_needed`, :func:`plan_staging`, :func:`took_shards`) is pure. What is
staged is then read like any checkpoint of another layout (:mod:`resilient.checkpoint.elasticread`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from resilient.checkpoint.elasticread import ElasticPlan, is_elastic
from resilient.checkpoint.partner import (
    Held,
    Inventories,
    PartnerCopies,
    Rebuild,
    Ring,
    candidate_steps,
    gather_inventories,
    transfers_for,
)
from resilient.checkpoint.tiers import LocalCheckpoint, LocalTier
from resilient.checkpoint.xorsets import XorParity, rebuild_for_staging
from resilient.errors import ConfigError, InvalidCheckpointError, LayoutMismatchError
from resilient.io import storage
from resilient.io.manifests import SetFiles, entries_from_shards, read_shard
from resilient.io.targets import DirectoryTarget
from resilient.model.blocks import BlockSpec, intersect
from resilient.model.codec import parse_manifest
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, ManifestError, ShardEntry
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Channel

__all__ = [
    "ShardFetch",
    "Staged",
    "StagePlan",
    "TierStaging",
    "files_needed",
    "plan_staging",
    "stage_newest",
    "took_shards",
]

log = logging.getLogger(__name__)

# What a node's first rank sends of the shards asked of it: each one's bytes, or why not.
_Shards = dict[str, bytes | str]


@dataclass(frozen=True, slots=True)
class StagePlan:
    """The coordinator's choice: the step, its whole manifest (every entry loaded), the
    transfers (as a :class:`~resilient.checkpoint.partner.Rebuild` with the manifest's text),
    and what crosses the wire (files, bytes)."""

    rebuild: Rebuild
    manifest: Manifest
    wire_files: int
    wire_bytes: int


@dataclass(frozen=True, slots=True)
class ShardFetch:
    """The coordinator's request before it plans a step whose manifest is sharded by node:
    the shards of ``step`` it lacks (every entry is needed to plan), each from one node that
    holds it (its first rank, with the shards it sends)."""

    step: int
    sources: tuple[tuple[int, tuple[ShardEntry, ...]], ...]


@dataclass(frozen=True, slots=True)
class Staged:
    """A step staged on every node of this job: this rank's node's directory of it and the
    whole manifest (the same on every rank)."""

    path: Path
    manifest: Manifest
    plan: StagePlan


def files_needed(
    manifest: Manifest, ring: Ring, wanted: Sequence[Mapping[str, BlockSpec]], *, current: str
) -> dict[int, set[str]]:
    """Pure: per node of ``ring`` (its first rank), the files of ``manifest`` its ranks read
    in an elastic restore: those holding stored blocks that overlap a rank's new block
    (``wanted[rank]``; all of a leaf's files where a rank gives no block for it: its read then
    fails, saying why), and saved rank 0's file where there are replicated leaves; of a
    sharded manifest also the shards of those files (the staged copy is then a node-local
    copy as a save leaves one: the shards of the files it holds).

    Raises:
        LayoutMismatchError: ``manifest`` has per-rank data that is neither a Block nor
            Replicated (see :meth:`ElasticPlan.of`; ``current`` names this job's layout).
    """
    plan = ElasticPlan.of(manifest, current=current)
    needs: dict[int, set[str]] = {}
    for node in ring.leaders:
        files = needs.setdefault(node, set())
        for rank in ring.ranks_of(node):
            blocks = wanted[rank]
            for path, stored in plan.blocks.items():
                want = blocks.get(path)
                files.update(
                    sb.file for sb in stored if want is None or intersect(sb.spec, want) is not None
                )
            if plan.replicated:
                files.add(plan.rank0_file)
        if manifest.sharded is not None:
            files.update(s.name for s in manifest.sharded.shards if files.intersection(s.files))
    return needs


def plan_staging(
    inventories: Mapping[int, Mapping[int, tuple[str, Mapping[str, str]]]],
    ring: Ring,
    wanted: Sequence[Mapping[str, BlockSpec]],
    *,
    current: Layout,
    shards: Mapping[int, Mapping[str, bytes]],
    only: int | None = None,
    at_least: int | None = None,
    excluded: frozenset[int] = frozenset(),
    wire: bool = True,
) -> tuple[StagePlan | ShardFetch | None, str | None]:
    """Coordinator (pure): the newest step the nodes can stage for an elastic restore, and why
    newer ones (or any) cannot be (``None``: nothing to say); or, on the way to it, a step of
    a manifest sharded by node whose shards are not all in ``shards`` yet: the request for
    them (:class:`ShardFetch`; call again with them, :func:`took_shards`).

    Args:
        inventories: per node (first rank), per step, ``(manifest, {file: 'own'|'partner'})``
            of any layout.
        ring: the nodes of this job.
        wanted: every rank's new blocks (by leaf path).
        current: this job's layout. A step of the same rank count and kind of layout is
            staged only where some rank's new blocks differ from its saved ones: otherwise
            the restore is not elastic (a plain read, which needs no blocks), and the local
            tier's own steps (rebuilt from partner copies) are what it reads.
        shards: per step, the bytes of the manifest shards received so far, by name.
        only: consider this step alone.
        at_least: ignore steps older than this (the shared root has it).
        excluded: steps a staging already failed for.
        wire: whether nodes can send each other files (``False``: only steps each node can
            stage from what it holds itself).
    """
    why: str | None = None
    for step, text in candidate_steps(inventories, only=only, at_least=at_least, excluded=excluded):
        same = {  # a node's holdings of this step count only where they are of this manifest
            n: {step: inv[step]}
            for n, inv in inventories.items()
            if inv.get(step, ("",))[0] == text
        }
        try:
            manifest = parse_manifest(text)
        except ManifestError:
            continue
        sharded = manifest.sharded
        if sharded is not None:
            got = shards.get(step, {})
            lacking = [s for s in sharded.shards if s.name not in got]
            if lacking:
                sources, lost = _shard_sources(lacking, step, same)
                if not lost:
                    return ShardFetch(step, sources), why
                why = why or (
                    f"local checkpoint step {step} cannot be staged for an elastic restore: "
                    f"no node of this job holds a readable copy of its manifest shards "
                    f"{', '.join(lost[:4])}"
                )
                continue
            try:
                manifest = entries_from_shards(manifest, got, where=f"local step {step}")
            except (ManifestError, InvalidCheckpointError) as exc:
                why = why or f"local checkpoint step {step}'s manifest shards: {exc}"
                continue
        if not is_elastic(manifest, current, wanted):
            continue
        try:
            needs = files_needed(manifest, ring, wanted, current=current.describe())
        except LayoutMismatchError as exc:
            return None, why or (
                f"local checkpoint step {step} cannot be restored elastically: {exc}"
            )
        transfers, lost_files = transfers_for(needs, step, same, ring)
        if lost_files:
            why = why or (
                f"local checkpoint step {step} cannot be staged for an elastic restore: "
                + "; ".join(
                    f"{', '.join(files)} (needed on node {ring.label(n)})"
                    for n, files in lost_files
                )
                + " exist on no node of this job"
            )
            continue
        sizes = {f.name: f.size for f in manifest.files}
        if sharded is not None:
            sizes.update((s.name, s.size) for s in sharded.shards)
        moved = [name for src, dst, names in transfers if src != dst for name in names]
        if moved and not wire:
            why = why or (
                f"local checkpoint step {step} cannot be staged for an elastic restore: it "
                "needs files from other nodes and the ranks have no channel between them"
            )
            continue
        plan = StagePlan(
            Rebuild(step, text, transfers), manifest, len(moved),
            sum(sizes.get(n, 0) for n in moved),
        )  # fmt: skip
        return plan, why
    return None, why


def _shard_sources(
    shards: Sequence[ShardEntry],
    step: int,
    inventories: Mapping[int, Mapping[int, tuple[str, Mapping[str, str]]]],
) -> tuple[tuple[tuple[int, tuple[ShardEntry, ...]], ...], list[str]]:
    """Pure: who sends each of ``shards`` of ``step`` (a node holding its own copy first, then
    one holding a partner copy; the first such node), and the names of those no node holds."""
    by_node: dict[int, list[ShardEntry]] = {}
    lost: list[str] = []
    for shard in shards:
        holders = [
            (kind != "own", node)
            for node, inv in inventories.items()
            if (kind := inv.get(step, ("", {}))[1].get(shard.name)) is not None
        ]
        if holders:
            by_node.setdefault(min(holders)[1], []).append(shard)
        else:
            lost.append(shard.name)
    return tuple((n, tuple(by_node[n])) for n in sorted(by_node)), lost


def took_shards(
    inventories: Inventories,
    shards: Mapping[int, Mapping[str, bytes]],
    fetch: ShardFetch,
    replies: Sequence[Mapping[str, bytes | str]],
) -> tuple[Inventories, dict[int, dict[str, bytes]]]:
    """Pure: what the coordinator knows after the nodes answered ``fetch`` (``replies``, by
    rank: each shard's bytes or why it could not be read): the shards received added, and a
    node that could not send one no longer counted as holding it (the next request asks
    another node, or the step is passed over). Every shard asked for is one or the other,
    so the requests end."""
    got = {s: dict(named) for s, named in shards.items()}
    held = {n: dict(inv) for n, inv in inventories.items()}
    for node, asked in fetch.sources:
        reply = replies[node] if node < len(replies) else {}
        for shard in asked:
            data = reply.get(shard.name)
            if isinstance(data, bytes):
                got.setdefault(fetch.step, {})[shard.name] = data
                continue
            text, files = held[node][fetch.step]
            held[node][fetch.step] = (text, {n: k for n, k in files.items() if n != shard.name})
    return held, got


class TierStaging:
    """The elastic restores a node-local tier stages in ``<local root>/elastic/`` on every node.

    Args:
        tier: the node-local tier (its nodes, own copies and partner copies).
    """

    def __init__(self, tier: LocalTier) -> None:
        self.tier = tier
        self._coll = Collective(tier.comms.comm)
        copies = tier.copies
        # the mover: partner copies if the tier keeps them, else made at the first staging
        self._mover: PartnerCopies | None = copies if isinstance(copies, PartnerCopies) else None

    def stage(
        self,
        blocks: Mapping[str, BlockSpec],
        *,
        step: int | None = None,
        at_least: int | None = None,
        excluded: frozenset[int] = frozenset(),
    ) -> LocalCheckpoint | None:
        """Collective: stage on every node, in the tier's :attr:`~LocalTier.staging`, what its
        ranks read of the newest step (or ``step``; not older than ``at_least``, none of
        ``excluded``) of any layout that the nodes can complete between them from their own
        and partner copies; ``None`` when there is none. The result's manifest is the whole
        one (every entry), its path this rank's node's staged copy, to be read elastically and
        then dropped (:meth:`drop`).

        Without partner copies, the channel between the nodes is opened at the first call;
        where it cannot be (MPI without ``MPI_THREAD_MULTIPLE``), only steps that every node
        can stage from its own files are used.
        """
        tier = self.tier
        if self._mover is None:
            ring = Ring.of([(v.leader, v.label) for v in tier.views])
            channel: Channel = _NoChannel()
            if isinstance(tier.copies, XorParity):
                channel = tier.copies.channel
            elif len(ring) > 1:
                try:
                    channel = self._coll.check(
                        "opening a channel for an elastic restore", tier.comms.comm.channel
                    )
                except ConfigError as exc:  # the same on every rank
                    if self._coll.is_coordinator:
                        log.warning("%s: nodes cannot exchange files for an elastic restore", exc)
            self._mover = PartnerCopies(tier.target, ring, self._coll, channel, keep=tier.keep)
        if not isinstance(self._mover.channel, _NoChannel):  # a node of an XOR set lost?
            rebuild_for_staging(
                tier.target, self._mover.ring, self._coll, self._mover.channel,
                lambda: storage.free_bytes(tier.root), step=step, at_least=at_least,
            )  # fmt: skip
        staged = stage_newest(
            self._mover, tier.staging, tier.target.steps, blocks,
            current=tier.comms.layout, step=step, at_least=at_least,
            excluded=excluded, wire=not isinstance(self._mover.channel, _NoChannel),
        )  # fmt: skip
        return None if staged is None else LocalCheckpoint(staged.path, staged.manifest)

    def drop(self) -> None:
        """Local: this node's leader removes what :meth:`stage` staged (best effort)."""
        if self._mover is not None:
            drop_staging(self._mover, self.tier.staging)


class _NoChannel:
    """The channel of a job on one node: every file a staging needs is on that node."""

    def send(self, dest: int, data: bytes | bytearray | memoryview) -> None:
        raise ValueError(f"no other node to send to (rank {dest})")

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        raise ValueError(f"no other node to receive from (rank {source})")


def stage_newest(
    copies: PartnerCopies,
    staging: DirectoryTarget,
    own_steps: Callable[[], list[int]],
    blocks: Mapping[str, BlockSpec],
    *,
    current: Layout,
    step: int | None,
    at_least: int | None,
    excluded: frozenset[int] = frozenset(),
    wire: bool = True,
) -> Staged | None:
    """Collective over ``copies.coll``: stage the newest step (or ``step``; not older than
    ``at_least``, none of ``excluded``) that the nodes of this job can complete between them
    in ``staging`` on every node; ``None`` when there is none (said once, with why). A partner
    copy that fails its digest is quarantined and the choice made again.

    Args:
        copies: the mover: this job's nodes, their channel and their local and partner copies.
        staging: where each node stages (a child of its local tier, not a step of it).
        own_steps: the steps of this node's own copies (called on a node's first rank).
        blocks: this rank's new blocks.
        current: this job's layout.
        wire: whether ``copies``' channel works (see :func:`plan_staging`).
    """
    coll, ring = copies.coll, copies.ring
    tried = set(excluded)
    for _ in range(3):
        try:
            listed: dict[int, Held] | Exception = _held(copies, own_steps)
        except Exception as exc:  # this rank's failure, raised on every rank
            listed = exc
        got = gather_inventories(
            coll, ring, listed, dict(blocks),
            what="listing local and partner copies for an elastic restore",
        )  # fmt: skip
        held = listed if isinstance(listed, dict) else {}  # (a dict: nothing was raised)
        chooser: _Chooser | Exception | None = None
        if got is not None:
            try:
                if isinstance(got, Exception):
                    raise got
                inventories, wanted = got
                chooser = _Chooser(
                    inventories, {}, functools.partial(
                        plan_staging, ring=ring, wanted=wanted, current=current, only=step,
                        at_least=at_least, excluded=frozenset(tried), wire=wire,
                    ),
                )  # fmt: skip
            except Exception as exc:
                chooser = exc
        plan, why = _choose(coll, chooser, held)
        if why is not None and coll.is_coordinator:
            log.warning(
                "%s; using %s", why,
                f"local step {plan.rebuild.step}" if plan is not None else "the shared root",
            )  # fmt: skip
        if plan is None:
            return None
        text = plan.rebuild.manifest
        usable = {s: h for s, h in held.items() if s == plan.rebuild.step and h.manifest == text}
        problems = copies.run_rebuild(
            plan.rebuild, usable, f"staging local step {plan.rebuild.step} for an elastic restore",
            into=staging,
        )  # fmt: skip
        if not problems:
            if coll.is_coordinator:
                log.warning(
                    "staged local step %d for an elastic restore on node(s) %s from local and "
                    "partner copies (%d files, %d bytes over the wire)",
                    plan.rebuild.step, ", ".join(ring.labels), plan.wire_files, plan.wire_bytes,
                )  # fmt: skip
            return Staged(staging.path(plan.rebuild.step), plan.manifest, plan)
        if coll.is_coordinator:
            log.warning(
                "could not stage local step %d for an elastic restore: %s",
                plan.rebuild.step, problems[0],
            )  # fmt: skip
        drop_staging(copies, staging)
        tried.add(plan.rebuild.step)
    return None


def drop_staging(copies: PartnerCopies, staging: DirectoryTarget) -> None:
    """Local, on a node's first rank: remove what was staged here (best effort, logged)."""
    if not copies.acts:
        return
    try:
        staging.drop()
    except OSError as exc:
        log.warning("could not remove %s: %s", staging.root, exc)


def _held(copies: PartnerCopies, own_steps: Callable[[], list[int]]) -> dict[int, Held]:
    """What this node holds of any layout, on its first rank; nothing when its local tier
    cannot be listed (logged)."""
    if not copies.acts:
        return {}
    try:
        return copies.inventory(own_steps(), None)
    except OSError as exc:
        log.warning("could not list the local tier %s: %s", copies.local, exc)
        return {}


@dataclass(frozen=True, slots=True)
class _Chooser:
    """The coordinator's planning state: what the nodes hold, the manifest shards received,
    and the planner (:func:`plan_staging` bound to the rest of its arguments)."""

    inventories: Inventories
    shards: Mapping[int, Mapping[str, bytes]]
    plan: Callable[..., tuple[StagePlan | ShardFetch | None, str | None]]

    def decide(self) -> tuple[StagePlan | ShardFetch | None, str | None]:
        return self.plan(self.inventories, shards=self.shards)

    def took(self, fetch: ShardFetch, replies: Sequence[Mapping[str, bytes | str]]) -> _Chooser:
        inventories, shards = took_shards(self.inventories, self.shards, fetch, replies)
        return _Chooser(inventories, shards, self.plan)


def _choose(
    coll: Collective, chooser: _Chooser | Exception | None, held: Mapping[int, Held]
) -> tuple[StagePlan | None, str | None]:
    """Collective over ``coll``: the coordinator's choice (``chooser``, on the coordinator
    only; or the exception that kept it from making one), the same on every rank, or the
    same error on every rank. Each :class:`ShardFetch` on the way is one more round: the
    nodes asked send the coordinator the shards it lacks (a node's first rank reads them
    from its own or partner copy, ``held``, checked against the index), gathered."""
    while True:
        decision: tuple[StagePlan | ShardFetch | None, str | None] | Exception | None = None
        if chooser is not None:
            try:
                if isinstance(chooser, Exception):
                    raise chooser
                decision = chooser.decide()
            except Exception as exc:
                decision = exc
        choice, why = coll.announce(
            "listing local and partner copies for an elastic restore", decision
        )
        if not isinstance(choice, ShardFetch):
            return choice, why
        try:
            mine: _Shards | Exception = _shards_asked(choice, held, coll.rank)
        except Exception as exc:  # this rank's failure, raised on every rank by announce
            mine = exc
        replies = coll.gather(mine)
        if replies is not None and isinstance(chooser, _Chooser):
            try:
                chooser = chooser.took(choice, replies.values())
            except Exception as exc:
                chooser = exc


def _shards_asked(fetch: ShardFetch, held: Mapping[int, Held], rank: int) -> _Shards:
    """Local: the bytes of the shards ``fetch`` asks of this rank's node (on its first rank),
    each checked against the index, or why one cannot be read (logged)."""
    asked = next((shards for node, shards in fetch.sources if node == rank), ())
    mine = held.get(fetch.step)
    out: _Shards = {}
    for shard in asked:
        try:
            if mine is None or shard.name not in mine.files:
                raise FileNotFoundError(f"no copy of {shard.name} here")
            out[shard.name] = read_shard(
                SetFiles.in_directory(mine.files[shard.name][0].parent), shard
            )
        except InvalidCheckpointError as exc:
            out[shard.name] = f"{exc.path}: {exc.reason}"
        except OSError as exc:
            out[shard.name] = str(exc)
        if isinstance(out[shard.name], str):
            log.warning(
                "manifest shard %s of local step %d cannot be sent for an elastic restore: %s",
                shard.name, fetch.step, out[shard.name],
            )  # fmt: skip
    return out
