"""Partner copies of the node-local tier: a node's files of each checkpoint, kept on another node.

SCR's PARTNER scheme (redset's ``redset_apply_partner``), written for this library: the failure
group is the node (what :meth:`~resilient.parallel.comm.Comm.split_node` says), the nodes form a ring in
the order of their first rank, and each node keeps a copy of the files of the node before it.
Two nodes are each other's partner; three or more (odd or even) form the ring. One node has no
partner: the tier says so once at start, and its checkpoints are protected only by the flush to
the shared root. On the receiving node the copy lives beside its own checkpoints::

    <local root>/partner/<node of origin>/step_00000040/   the origin node's data files,
                                                            manifest.json, COMMITTED,
                                                            PARTNER.json (size and digest
                                                            of each file)

*Copy* (:meth:`PartnerCopies.copy_job`): after every local commit, on the writer thread of
each node's first rank, with no collective: send this node's files to the next node and receive
the previous node's into a temporary directory, hashed as they are read and as they arrive,
fsynced and committed by the same protocol as every checkpoint (:class:`~resilient.io.commit.
PendingDir`): a copy cut short is never used. Copies are rotated in step with the originals
(the newest ``keep``); copies from a node that is no longer this node's left neighbour go.

*Rebuild* (:meth:`PartnerCopies.inventory`, :func:`plan_rebuild`,
:meth:`PartnerCopies.rebuild`; collective in :class:`~resilient.checkpoint.tiers.LocalTier`): every node
lists the files of each step it holds, its own or as a partner (each distinct manifest reaches
the coordinator once: :func:`gather_inventories`); the newest step that every node can complete
is chosen; a node that lacks files of its ranks (its directory wiped, or a new node
in the place of a lost one) gets them from a node that holds them and commits them as its own
copy of the step. A partner copy whose bytes do not match its digest is quarantined and the next
option is tried. Two adjacent nodes lost: the first one's files exist nowhere, so an older step
or the shared root is used, and the plan says why.

The transfers are point-to-point over a :class:`~resilient.parallel.comm.Channel`, as the byte
streams of :mod:`resilient.io.wire`. A second scheme (XOR) would provide the same three
operations beside this one (:mod:`resilient.checkpoint.redundancy` chooses).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from resilient.errors import InvalidCheckpointError, ResilientError
from resilient.io.commit import PendingDir
from resilient.io.targets import Target
from resilient.io.wire import Outgoing, receive_files, send_files
from resilient.model import filenames
from resilient.model.checksum import hash128
from resilient.model.codec import parse_manifest
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, ManifestError
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Channel

__all__ = [
    "Held",
    "Inventories",
    "PartnerCopies",
    "Rebuild",
    "Ring",
    "candidate_steps",
    "gather_inventories",
    "held_in",
    "node_files",
    "problems_everywhere",
    "plan_rebuild",
    "transfers_for",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass(frozen=True, slots=True)
class Ring:
    """The nodes in the order of their first rank; each node's partner is the next one.

    Attributes:
        leaders: the first rank of each node (the rank that acts for it).
        labels: each node's name.
        ranks: the ranks of each node.
    """

    leaders: tuple[int, ...]
    labels: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, node_of_rank: Sequence[tuple[int, str]]) -> Ring:
        """The ring of nodes given ``(first rank of its node, node name)`` for every rank."""
        members: dict[int, list[int]] = {}
        labels: dict[int, str] = {}
        for rank, (leader, label) in enumerate(node_of_rank):
            members.setdefault(leader, []).append(rank)
            labels[leader] = label
        leaders = tuple(sorted(members))
        return cls(
            leaders, tuple(labels[n] for n in leaders), tuple(tuple(members[n]) for n in leaders)
        )

    def __len__(self) -> int:
        return len(self.leaders)

    def right(self, leader: int) -> int:
        """The node that keeps ``leader``'s node's copies."""
        return self.leaders[(self.leaders.index(leader) + 1) % len(self)]

    def left(self, leader: int) -> int:
        """The node whose copies ``leader``'s node keeps."""
        return self.leaders[(self.leaders.index(leader) - 1) % len(self)]

    def label(self, leader: int) -> str:
        """The name of ``leader``'s node."""
        return self.labels[self.leaders.index(leader)]

    def ranks_of(self, leader: int) -> tuple[int, ...]:
        """The ranks of ``leader``'s node."""
        return self.ranks[self.leaders.index(leader)]


# ---------------------------------------------------------------------- what a node holds


@dataclass(frozen=True, slots=True)
class Held:
    """The files of one step a node holds: the manifest, and each file's path, size and
    recorded digest (``None``: the node's own copy)."""

    manifest: str
    files: dict[str, tuple[Path, int, str | None]]
    partner: Target | None = None  # the partner copies some of them come from

    def summary(self) -> tuple[str, dict[str, str]]:
        """What the coordinator is told of it: the content address of the manifest (xxh3-128;
        the text itself is sent once, by one node: :func:`gather_inventories`) and, per
        file, ``own`` or ``partner``."""
        return hash128(self.manifest), {
            n: ("own" if d is None else "partner") for n, (_, _, d) in self.files.items()
        }


# Per node (its first rank), per step: (its manifest's text, {file: 'own'|'partner'}).
Inventories = dict[int, dict[int, tuple[str, dict[str, str]]]]
# What a rank tells the coordinator first: its rank, per step Held.summary() (a node's first
# rank; empty elsewhere), and what else the caller gathers.
_Report = tuple[int, dict[int, tuple[str, dict[str, str]]], T]


def gather_inventories(
    coll: Collective, ring: Ring, held: Mapping[int, Held] | Exception, extra: T, *, what: str
) -> tuple[Inventories, list[T]] | Exception | None:
    """Collective over ``coll`` (two gathers and a broadcast): what every node holds of each
    step (``held``, on its first rank: its own and partner copies), as the coordinator plans
    from it, and every rank's ``extra`` (by rank); on the coordinator, ``None`` elsewhere.

    Every distinct manifest crosses to the coordinator once, from the first node that holds
    it; each node sends, per step, its content address and its file list: what the
    coordinator receives grows with the node count by their file lists, not by the index
    (16,384 ranks on 256 nodes: the index of every step from every node, ~1.6 GB, before).

    Returns:
        On the coordinator, the inventories and extras, or the exception that kept it from
        making them (to :meth:`~resilient.parallel.collective.Collective.announce`).

    Raises:
        ResilientError: ``held`` was an exception on some rank, the same on every rank.
    """
    mine: _Report[T] | Exception = (
        held if isinstance(held, Exception)
        else (coll.rank, {s: h.summary() for s, h in held.items()}, extra)
    )  # fmt: skip
    gathered = coll.gather(mine)
    reports: list[_Report[T]] = []
    ask: dict[int, list[tuple[int, str]]] | Exception | None = None
    if gathered is not None:
        try:
            reports = list(gathered.values())
            ask = _index_senders(reports, ring)
        except Exception as exc:
            ask = exc
    asked = coll.announce(what, ask)
    texts: dict[str, str] | Exception = {}
    try:
        if isinstance(held, Mapping):
            texts = {a: held[s].manifest for s, a in asked.get(coll.rank, ())}
    except Exception as exc:
        texts = exc
    sent = coll.gather(texts)
    if sent is None:
        return None
    try:
        index = {a: text for got in sent.values() for a, text in got.items()}
        inventories = {
            r: {s: (index[a], files) for s, (a, files) in inv.items()}
            for r, inv, _ in reports
            if r in ring.leaders
        }
    except Exception as exc:
        return exc
    return inventories, [x for _, _, x in reports]


def _index_senders(reports: Sequence[_Report[Any]], ring: Ring) -> dict[int, list[tuple[int, str]]]:
    """Per node (first rank), the manifests it sends (``(step, content address)``): each
    distinct one by the first node that holds it."""
    first: dict[str, tuple[int, int]] = {}
    for rank, inv, _ in reports:
        if rank in ring.leaders:
            for step, (address, _) in inv.items():
                first.setdefault(address, (rank, step))
    ask: dict[int, list[tuple[int, str]]] = {}
    for address, (node, step) in first.items():
        ask.setdefault(node, []).append((step, address))
    return ask


@dataclass(frozen=True, slots=True)
class Rebuild:
    """A plan: the step to restore, its manifest, and the transfers that complete every node's
    copy (``(from node, to node, file names)``, in the order both sides run them)."""

    step: int
    manifest: str
    transfers: tuple[tuple[int, int, tuple[str, ...]], ...]


def candidate_steps(
    inventories: Mapping[int, Mapping[int, tuple[str, Mapping[str, str]]]],
    *,
    only: int | None,
    at_least: int | None,
    excluded: Iterable[int],
) -> Iterator[tuple[int, str]]:
    """Pure: the steps the nodes hold (``inventories``), newest first, with the first holder's
    manifest text: ``only`` that one, none older than ``at_least``, none of ``excluded``
    (what a rebuild or an elastic staging considers, in order)."""
    skip = set(excluded)
    for step in sorted({s for inv in inventories.values() for s in inv}, reverse=True):
        if (only is not None and step != only) or step in skip:
            continue
        if at_least is not None and step < at_least:
            return
        yield step, next(inv[step][0] for inv in inventories.values() if step in inv)


def plan_rebuild(
    inventories: Mapping[int, Mapping[int, tuple[str, Mapping[str, str]]]],
    ring: Ring,
    current: Layout,
    *,
    only: int | None = None,
    at_least: int | None = None,
    excluded: frozenset[int] = frozenset(),
) -> tuple[Rebuild | None, str | None]:
    """Pure: the newest step every node can complete from what the nodes hold, and why newer
    ones cannot be (``None`` when the newest one can).

    Args:
        inventories: per node (first rank), per step, ``(manifest, {file: 'own'|'partner'})``.
        ring: the nodes of this job.
        current: the job's layout (a step of another layout is not a candidate here).
        only: consider this step alone.
        at_least: ignore steps older than this (the shared root has it).
        excluded: steps a rebuild already failed for.
    """
    why: str | None = None
    for step, text in candidate_steps(inventories, only=only, at_least=at_least, excluded=excluded):
        try:
            manifest = parse_manifest(text)
        except ManifestError:
            continue
        if manifest.layout != current or len(manifest.ranks) != sum(map(len, ring.ranks)):
            continue
        needs = {n: node_files(manifest, ring.ranks_of(n)) for n in ring.leaders}
        transfers, lost = transfers_for(needs, step, inventories, ring)
        if lost:
            why = why or (
                f"local checkpoint step {step} cannot be rebuilt: "
                + "; ".join(f"{', '.join(files)} of node {ring.label(n)}" for n, files in lost)
                + " exist on no node of this job (the node and its partner were both lost)"
            )
            continue
        return Rebuild(step, text, transfers), why
    return None, why


def transfers_for(
    needs: Mapping[int, Iterable[str]],
    step: int,
    inventories: Mapping[int, Mapping[int, tuple[str, Mapping[str, str]]]],
    ring: Ring,
) -> tuple[tuple[tuple[int, int, tuple[str, ...]], ...], list[tuple[int, list[str]]]]:
    """Pure: the transfers that give every node (first rank) the files of ``step`` it
    ``needs``, and what is lost (per node, the files no node holds). A node's own copy of a
    file needs no transfer; one it holds as a partner copy is a transfer to itself (copied,
    its digest checked); any other comes from a node holding its own copy if one does."""
    held: dict[str, list[tuple[int, str]]] = {}  # file -> [(node, own|partner)]
    for node, inv in inventories.items():
        for name, kind in inv.get(step, ("", {}))[1].items():
            held.setdefault(name, []).append((node, kind))
    moves: dict[tuple[int, int], list[str]] = {}
    lost: list[tuple[int, list[str]]] = []
    for node in ring.leaders:
        mine = inventories.get(node, {}).get(step, ("", {}))[1]
        needed = sorted(set(needs.get(node, ())))
        missing = []
        for name in needed:
            if mine.get(name) == "own":
                continue
            holders = held.get(name, [])
            if not holders:
                missing.append(name)
                continue
            # this node's partner copy first (no transfer), then a node's own copy
            src = min(holders, key=lambda h: (h[0] != node, h[1] != "own", h[0]))[0]
            moves.setdefault((src, node), []).append(name)
        if missing:
            lost.append((node, missing))
    transfers = tuple((s, d, tuple(names)) for (s, d), names in sorted(moves.items()))
    return transfers, lost


# ---------------------------------------------------------------------- one node's copies


class PartnerCopies:
    """The partner copies of one node-local tier, as seen by one rank.

    Args:
        local: this node's local tier (partner copies live in its :data:`~resilient.model.
            filenames.PARTNER_DIR`).
        ring: the nodes of the job.
        coll: the tier's ranks (collective steps of :meth:`rebuild_newest`).
        channel: point-to-point transfers between the tier's ranks.
        keep: partner copies kept per node of origin (the tier's ``local_keep``).
    """

    def __init__(
        self, local: Target, ring: Ring, coll: Collective, channel: Channel, *, keep: int
    ) -> None:
        self.local = local
        self.partners = local.child(filenames.PARTNER_DIR)
        self.ring = ring
        self.coll = coll
        self.rank = coll.rank
        self.channel = channel
        self.keep = keep
        self.node = next(
            n for n, ranks in zip(ring.leaders, ring.ranks, strict=True) if self.rank in ranks
        )

    @property
    def acts(self) -> bool:
        """Whether this rank acts for its node (its first rank)."""
        return self.rank == self.node

    @property
    def has_partner(self) -> bool:
        """Whether there is a partner at all (two nodes or more)."""
        return len(self.ring) > 1

    def partner_target(self, label: str) -> Target:
        """Where this node keeps the copies of node ``label``."""
        return self.partners.child(filenames.partner_dir_name(label))

    def clean_up(self) -> None:
        """Local, on a node's first rank: remove copies cut short by a crash."""
        if not self.acts:
            return
        for sub in self.partners.children():
            sub.clean_up()

    # ------------------------------------------------------------------ copy

    def copy_job(self, step_dir: Path, manifest: Manifest) -> Callable[[], str | None]:
        """This rank's part of copying the committed local checkpoint ``step_dir``: on a
        node's first rank, send the node's files to the next node and receive the previous
        node's; elsewhere nothing. No collective (it runs on the writer thread). The returned
        function returns what went wrong with the copy this node received (``None``: it is
        committed) and raises only if the transfer itself broke."""
        if not self.acts or not self.has_partner:
            return lambda: None
        sizes = node_files(manifest, self.ring.ranks_of(self.node))
        outgoing = [Outgoing(n, step_dir / n, size, None) for n, size in sizes.items()]

        def run() -> str | None:
            unread: str | None = None
            try:  # the index as committed (the caller may hold only its node's part of it)
                text = self.local.read(manifest.step, filenames.MANIFEST).decode()
            except (OSError, UnicodeDecodeError) as exc:
                # the copy still goes (the next node waits for it) and is not committed there:
                # an empty manifest does not parse
                text, unread = "", f"reading the manifest of step {manifest.step}: {exc}"
            header = {"step": manifest.step, "source": self.ring.label(self.node),
                      "manifest": text}  # fmt: skip
            sent = _run_beside(
                lambda: send_files(self.channel, self.ring.right(self.node), header, outgoing)
            )
            try:
                received = self._receive_copy(self.ring.left(self.node))
            finally:
                problems = sent()
            if unread is not None or problems:
                why = unread or problems[0]
                return f"sending node {self.ring.label(self.node)}'s copy: {why}"
            return received

        return run

    def _receive_copy(self, left: int) -> str | None:
        """Receive ``left``'s node's files and commit them as its partner copy here."""
        label = self.ring.label(left)
        target = self.partner_target(label)
        pending: list[PendingDir] = []

        def directory(header: dict[str, Any]) -> Path:
            step = header.get("step")
            if not isinstance(step, int) or step < 0:
                raise OSError(f"a header without a step: {step!r}")
            pending.append(target.pending(step))
            target.create(pending[0])
            return pending[0].path

        got = receive_files(self.channel, left, directory)
        step = got.header.get("step")
        what = f"partner copy of node {label}'s step {step} on node {self.ring.label(self.node)}"
        error = got.error
        if error is None and not got.header.get("manifest"):
            error = f"node {label} sent no manifest (it could not read its own)"
        if error is None and pending:
            try:
                manifest = parse_manifest(str(got.header.get("manifest", "")))
                record = {"source": label,
                          "files": {n: [got.sizes[n], got.digests[n]] for n in got.sizes}}  # fmt: skip
                target.write(pending[0], filenames.PARTNER_RECORD, json.dumps(record).encode())
                target.commit(pending[0], manifest, what=what)
            except (OSError, ManifestError, ResilientError) as exc:
                error = str(exc)
        if error is not None:
            if pending:
                target.rollback(pending[0])
            return f"{what}: {error}"
        self._rotate(label)
        return None

    def _rotate(self, label: str) -> None:
        """Keep the newest ``keep`` copies of ``label``'s node; drop other nodes' copies."""
        mine = self.partner_target(label)
        try:
            for sub in self.partners.children():
                if sub != mine:
                    sub.drop()
            for step in sorted(mine.steps(), reverse=True)[self.keep :]:
                mine.remove(step)
        except OSError as exc:
            log.warning("could not rotate the partner copies in %s: %s", self.partners, exc)

    # ------------------------------------------------------------------ rebuild

    def inventory(self, own_steps: Sequence[int], current: Layout | None) -> dict[int, Held]:
        """Local, on a node's first rank: what this node holds per step, its own copies
        (``own_steps``, in ``root``) and its partner copies, whose sizes check out; of the
        layout ``current`` only (``None``: of any layout, for an elastic restore)."""
        held: dict[int, Held] = {}
        for step in own_steps:
            found = held_in(self.local, step, current, None)
            if found is not None:
                held[step] = found
        for sub in self.partners.children():
            for step in sub.steps():
                record = _partner_record(sub, step)
                found = held_in(sub, step, current, record) if record is not None else None
                if found is None:
                    continue
                if step in held:  # add what the node's own copy lacks
                    files = {**found.files, **held[step].files}
                    held[step] = Held(held[step].manifest, files, sub)
                else:
                    held[step] = found
        return held

    def rebuild(
        self, plan: Rebuild, held: Mapping[int, Held], *, into: Target | None = None
    ) -> str | None:
        """Collective over the nodes named in ``plan`` (their first ranks; other ranks return at
        once): run the plan's transfers and commit each receiving node's copy of the step.
        Returns what went wrong here (``None``: fine). A partner copy found corrupt while
        being sent is quarantined.

        ``into``: commit every node's copy there instead of in its local tier, also where
        nothing is received (a staged copy for an elastic restore:
        :mod:`resilient.checkpoint.tierstaging`)."""
        if not self.acts:
            return None
        sends = [t for t in plan.transfers if t[0] == self.node and t[1] != self.node]
        receives = [t for t in plan.transfers if t[1] == self.node]
        mine = held.get(plan.step)
        target = self.local if into is None else into
        sent = _run_beside(lambda: self._send_all(plan, sends, mine))
        try:
            received = (
                self._receive_all(plan, receives, mine, target)
                if receives or into is not None
                else None
            )
        finally:
            problems = sent()
        return received or (problems[0] if problems else None)

    def _send_all(
        self, plan: Rebuild, sends: list[tuple[int, int, tuple[str, ...]]], mine: Held | None
    ) -> list[str]:
        problems: list[str] = []
        for _, dest, names in sends:
            files = [Outgoing(n, *mine.files[n]) if mine else _missing(n) for n in names]
            found = send_files(self.channel, dest, {"step": plan.step}, files)
            if found and mine is not None and mine.partner is not None:
                self._quarantine(mine.partner, plan.step, found[0])
            problems += found
        return problems

    def _receive_all(
        self,
        plan: Rebuild,
        receives: list[tuple[int, int, tuple[str, ...]]],
        mine: Held | None,
        target: Target,
    ) -> str | None:
        """Build this node's copy of the step in a temporary directory of ``target``: link the
        files it has, copy those it holds as a partner, receive the rest; commit it if all went
        well. Every stream is read to its end whatever failed before (its sender waits)."""
        pending = target.pending(plan.step)
        needed = {n for t in receives for n in t[2]}
        error = _attempt(lambda: target.create(pending))
        if error is None and mine is not None:
            own = [
                (n, p)
                for n, (p, _, d) in mine.files.items()
                if d is None and n not in needed and p.parent != pending.path
            ]
            error = _attempt(lambda: _link_all(target, pending, own, self.local, plan.step))
        for src, _, names in receives:
            if src == self.node:  # held here as a partner copy: verify while copying
                assert mine is not None
                if error is None:
                    error = self._copy_verified(mine, plan.step, names, pending, target)
                    if error and mine.partner is not None:
                        self._quarantine(mine.partner, plan.step, error)
                continue
            got = receive_files(self.channel, src, lambda _h: pending.path)
            error = error or got.error
        if error is None:
            manifest = plan.manifest
            what = f"rebuilt step {plan.step}"
            error = _attempt(lambda: target.commit(pending, parse_manifest(manifest), what=what))
        if error is not None:
            target.rollback(pending)
            return f"rebuilding step {plan.step} on node {self.ring.label(self.node)}: {error}"
        return None

    def run_rebuild(
        self,
        plan: Rebuild,
        held: Mapping[int, Held],
        what: str,
        *,
        into: Target | None = None,
    ) -> list[str]:
        """Collective over :attr:`coll`: :meth:`rebuild` on every rank, then what went wrong
        on any node, on every rank (empty: every node's copy is committed; an exception of the
        coordinator's raised on every rank, saying ``what``)."""
        return problems_everywhere(self.coll, lambda: self.rebuild(plan, held, into=into), what)

    def rebuild_newest(
        self,
        own_steps: Callable[[], list[int]],
        current: Layout,
        *,
        step: int | None,
        at_least: int | None,
    ) -> None:
        """Collective: give every node its ranks' files of the newest step that the nodes can
        complete between them (own copies and partner copies), if any is missing somewhere."""
        coll = self.coll
        excluded: set[int] = set()
        for _ in range(3):  # a corrupt partner copy is quarantined and the choice made again
            try:
                listed: dict[int, Held] | Exception = self._held(own_steps, current)
            except Exception as exc:  # this rank's failure, raised on every rank
                listed = exc
            got = gather_inventories(
                coll, self.ring, listed, None, what="listing local and partner copies"
            )
            held = listed if isinstance(listed, dict) else {}  # (a dict: nothing was raised)
            decision: tuple[Rebuild | None, str | None] | Exception | None = None
            if got is not None:
                try:
                    if isinstance(got, Exception):
                        raise got
                    inventories, _ = got
                    decision = plan_rebuild(
                        inventories, self.ring, current, only=step, at_least=at_least,
                        excluded=frozenset(excluded),
                    )  # fmt: skip
                except Exception as exc:
                    decision = exc
            plan, why = coll.announce("listing local and partner copies", decision)
            if why is not None and coll.is_coordinator:
                log.warning(
                    "%s; using %s", why,
                    f"local step {plan.step}" if plan is not None else "the shared root",
                )  # fmt: skip
            if plan is None or not plan.transfers:
                return
            problems = self.run_rebuild(
                plan, held, f"rebuilding step {plan.step} from partner copies"
            )
            if not problems:
                if coll.is_coordinator:
                    nodes = sorted({self.ring.label(d) for _, d, _ in plan.transfers})
                    log.warning(
                        "rebuilt local step %d on node(s) %s from partner copies",
                        plan.step, ", ".join(nodes),
                    )  # fmt: skip
                return
            if coll.is_coordinator:
                log.warning("could not rebuild local step %d: %s", plan.step, problems[0])
            excluded.add(plan.step)

    def _held(self, own_steps: Callable[[], list[int]], current: Layout) -> dict[int, Held]:
        """What this node holds (own and partner copies), on its acting rank; nothing when its
        local tier cannot be listed (logged)."""
        if not self.acts:
            return {}
        try:
            return self.inventory(own_steps(), current)
        except OSError as exc:
            log.warning("could not list the local tier %s: %s", self.local, exc)
            return {}

    def _copy_verified(
        self, held: Held, step: int, names: Sequence[str], pending: PendingDir, target: Target
    ) -> str | None:
        """Copy files this node holds of ``step`` as a partner into ``pending`` (of
        ``target``), checking their digests."""
        for name in names:
            path, _, digest = held.files[name]
            source = self.local if digest is None or held.partner is None else held.partner
            try:
                copied = target.copy(pending, name, source, step)
            except OSError as exc:
                return f"copying {path}: {exc.strerror or exc}"
            if digest is not None and copied != digest:
                return f"{path}: its bytes do not match the digest recorded when it was copied"
        return None

    def _quarantine(self, partner: Target, step: int, reason: str) -> None:
        path = partner.where(step)
        log.warning("partner copy %s is corrupt, quarantined: %s", path, reason)
        try:
            partner.quarantine(step, reason)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", path, exc)


def problems_everywhere(coll: Collective, fn: Callable[[], str | None], what: str) -> list[str]:
    """Collective over ``coll`` (a gather and a broadcast): ``fn()`` on every rank (what went
    wrong there, ``None``: nothing), then every rank's problems on every rank (an exception of
    a rank's raised on every rank, saying ``what``)."""
    try:
        problem: str | Exception | None = fn()
    except Exception as exc:
        problem = exc
    outcomes = coll.gather(problem)
    found: list[str] | Exception | None = None
    if outcomes is not None:
        try:
            found = [p for p in outcomes.values() if p]
        except Exception as exc:
            found = exc
    problems: list[str] = coll.announce(what, found)
    return problems


def node_files(manifest: Manifest, ranks: Sequence[int]) -> dict[str, int]:
    """The files a node's copy of ``manifest`` holds for its ``ranks``, with their sizes: their
    data files and, of a sharded manifest, their manifest shards (a shard never spans two
    nodes). From the index alone (no shard is read)."""
    sharded = manifest.sharded
    sizes = {f.name: f.size for f in manifest.files}
    if sharded is None:
        return {n: sizes[n] for n in sorted({manifest.ranks[r].file for r in ranks})}
    out = {n: sizes[n] for n in sorted({sharded.file_of(r).name for r in ranks})}
    for shard in sorted({sharded.shard_of(r) for r in ranks}, key=lambda s: s.name):
        out[shard.name] = shard.size
    return out


def _run_beside(fn: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """Run ``fn`` on a thread of its own; the returned function joins it and returns its result
    (an exception becomes a problem: the other side then sees a broken stream)."""
    out: list[list[str]] = []

    def body() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # reported to the caller
            out.append([f"{type(exc).__name__}: {exc}"])

    thread = threading.Thread(target=body, name="resilient-partner-send", daemon=True)
    thread.start()

    def join() -> list[str]:
        thread.join()
        return out[0] if out else ["the sending thread died"]

    return join


def _attempt(fn: Callable[[], object]) -> str | None:
    """Run ``fn``; what went wrong (a file, a manifest or a commit error), or ``None``."""
    try:
        fn()
    except (OSError, ManifestError, ResilientError) as exc:
        return str(exc)
    return None


def _link_all(
    target: Target,
    pending: PendingDir,
    files: list[tuple[str, Path]],
    source: Target,
    step: int,
) -> None:
    """The ``files`` of ``source``'s committed ``step`` into ``pending`` (of ``target``)."""
    for name, _ in files:
        target.link(pending, name, source, step)


def _missing(name: str) -> Outgoing:
    return Outgoing(name, Path("/nonexistent") / name, 0, None)


def _partner_record(target: Target, step: int) -> dict[str, tuple[int, str]] | None:
    """``{file: (size, digest)}`` of a partner copy's record (``None`` if unreadable)."""
    try:
        doc = json.loads(target.read(step, filenames.PARTNER_RECORD))
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        return None
    out: dict[str, tuple[int, str]] = {}
    for name, value in files.items():
        if (
            isinstance(value, list)
            and len(value) == 2
            and isinstance(value[0], int)
            and isinstance(value[1], str)
            and (filenames.is_data_file_name(name) or filenames.is_shard_name(name))
        ):
            out[name] = (value[0], value[1])
    return out


def held_in(
    target: Target,
    step: int,
    current: Layout | None,
    record: dict[str, tuple[int, str]] | None,
) -> Held | None:
    """The files of a committed step whose size matches its manifest (of the layout
    ``current``; ``None``: of any)."""
    try:
        manifest = target.manifest(step)
    except InvalidCheckpointError as exc:
        log.warning("local checkpoint %s is not usable: %s", exc.path, exc.reason)
        return None
    if current is not None and manifest.layout != current:
        return None
    path = Path(target.where(step))  # what io.wire sends from (a directory target's files)
    files: dict[str, tuple[Path, int, str | None]] = {}
    sizes = {f.name: f.size for f in manifest.files}
    if manifest.sharded is not None:
        sizes.update({s.name: s.size for s in manifest.sharded.shards})
    for name, size in sizes.items():
        digest = None
        if record is not None:
            if name not in record or record[name][0] != size:
                continue
            digest = record[name][1]
        found = target.stat(step, name)
        if found is not None and found.size == size:
            files[name] = (path / name, size, digest)
    if not files:
        return None
    text = target.read(step, filenames.MANIFEST).decode()
    return Held(text, files, target if record is not None else None)
