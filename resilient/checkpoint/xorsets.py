"""XOR parity of the node-local tier (``redundancy="xor"``): a lost node rebuilt from its set's
survivors, for ``1 / (n - 1)`` of the bytes a partner copy costs.

SCR's XOR scheme (redset's ``redset_apply_xor``), written for this library on the code of
:mod:`resilient.model.xorcode` and the transfers of :mod:`resilient.io.xorwire`. The nodes (what
:meth:`~resilient.parallel.comm.Comm.split_node` says), in the order of their first rank, form
sets of at most ``xor_set_size`` (default 8) nodes; a node's first rank acts for all its files,
as with partner copies. Each node keeps, beside its own checkpoints, its column's parity::

    <local root>/xor/step_00000040/   parity.xor  (chunk bytes: its column of the set's grid)
                                      XOR.json    (the set, the chunk, the parity's digest)
                                      manifest.json, COMMITTED

*Encode* (:meth:`XorParity.copy_job`): after every local commit, on the writer thread of each
node's first rank, with no collective: the set's ring reduce-scatter over the channel, then the
members pass their outcomes around the ring; each commits its parity only if every member's
encode went well (a parity computed from a member's unreadable file is wrong everywhere). The
newest ``keep`` parities are kept, as the local copies are.

*Rebuild* (:meth:`XorParity.rebuild_newest`, collective): every node lists its own copies and
its parities; the coordinator picks the newest step every node can complete (:func:`plan_xor`):
at most one node lost or wiped per set, every survivor of that set holding its own copy and its
parity of the same set and chunk. The survivors stream their chunks and parities through a chain
to the lost node's place (a new node, or the same one wiped), which writes its files and its
parity, commits them, and checks every checksum of its manifest before the step is used (a
mismatch: quarantined, and the next older step tried). Two nodes lost in one set: the plan says
which and the restore goes to an older step or the shared root.

A job of fewer than 3 nodes keeps partner copies instead (:func:`~resilient.checkpoint.partner.
make_copy_scheme` says so once). An elastic restore from the tier (another layout) finds the
nodes' own copies only (:mod:`resilient.checkpoint.tierstaging`): a node lost before it is not
rebuilt from parity, and the shared root is used.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.checkpoint.partner import (
    Held,
    Ring,
    candidate_steps,
    gather_inventories,
    held_in,
    node_files,
    problems_everywhere,
)
from resilient.errors import InvalidCheckpointError, ResilientError
from resilient.io.checkpoints import verify_node_files
from resilient.io.targets import Target
from resilient.io.wire import CHUNK, digest_file, recv_doc, send_doc
from resilient.io.xorwire import (
    PARITY_MISMATCH,
    PARITY_UNREADABLE,
    DataStream,
    LostMember,
    Share,
    contribute,
    encode,
    receive_lost,
)
from resilient.model import filenames
from resilient.model.codec import parse_manifest
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, ManifestError
from resilient.model.xorcode import XorSet, chunk_size, sets_of, stream_sizes
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Channel

__all__ = [
    "DEFAULT_SET_SIZE",
    "ParityHeld",
    "XorParity",
    "XorPlan",
    "plan_xor",
]

log = logging.getLogger(__name__)

DEFAULT_SET_SIZE = 8  # SCR's default: +14 % of the data per set


@dataclass(frozen=True, slots=True)
class ParityHeld:
    """A committed parity a node holds for one step: the set's members (ring positions), the
    chunk, the parity's digest; and, for an elastic restore on other nodes, the members' names,
    this node's place among them and each member's files (name and size, in stream order)."""

    members: tuple[int, ...]
    chunk: int
    digest: str
    labels: tuple[str, ...] = ()
    member: int = -1
    files: tuple[tuple[tuple[str, int], ...], ...] = ()


@dataclass(frozen=True, slots=True)
class XorPlan:
    """A rebuild: the step, its manifest, and per set that lost a node ``(set index, lost
    member's place in the set)``; empty when every node holds its files."""

    step: int
    manifest: str
    lost: tuple[tuple[int, int], ...]


def plan_xor(
    inventories: Mapping[int, Mapping[int, tuple[str, Mapping[str, str]]]],
    parities: Mapping[int, Mapping[int, ParityHeld]],
    ring: Ring,
    sets: Sequence[XorSet],
    current: Layout,
    *,
    only: int | None = None,
    at_least: int | None = None,
    excluded: frozenset[int] = frozenset(),
) -> tuple[XorPlan | None, str | None]:
    """Pure: the newest step every node can complete, from the nodes' own copies
    (``inventories``, per node's first rank) and parities (``parities``, likewise), and why
    newer ones cannot be (``None`` when the newest one can). ``only``, ``at_least`` and
    ``excluded`` as in :func:`~resilient.checkpoint.partner.plan_rebuild`."""
    why: str | None = None
    for step, text in candidate_steps(inventories, only=only, at_least=at_least, excluded=excluded):
        try:
            manifest = parse_manifest(text)
        except ManifestError:
            continue
        if manifest.layout != current or len(manifest.ranks) != sum(map(len, ring.ranks)):
            continue
        sizes = [node_files(manifest, ring.ranks[p]) for p in range(len(ring))]
        missing = [
            p for p, leader in enumerate(ring.leaders)
            if any(
                inventories.get(leader, {}).get(step, ("", {}))[1].get(n) != "own"
                for n in sizes[p]
            )
        ]  # fmt: skip
        lost: list[tuple[int, int]] = []
        problem = None
        for xset in sets:
            gone = [m for m in xset.members if m in missing]
            if not gone:
                continue
            if len(gone) > 1:
                problem = (
                    f"local checkpoint step {step} cannot be rebuilt: nodes "
                    f"{', '.join(ring.labels[m] for m in gone)} of one XOR set were all lost "
                    "(a set survives the loss of one node)"
                )
                break
            chunk = chunk_size([sum(sizes[m].values()) for m in xset.members])
            short = [
                ring.labels[m] for m in xset.members
                if m != gone[0] and not _holds(parities, ring.leaders[m], step, xset, chunk)
            ]  # fmt: skip
            if short:
                problem = (
                    f"local checkpoint step {step} cannot be rebuilt on node "
                    f"{ring.labels[gone[0]]}: node(s) {', '.join(short)} of its XOR set hold "
                    "no parity of it"
                )
                break
            lost.append((xset.index, xset.position(gone[0])))
        if problem is not None:
            why = why or problem
            continue
        return XorPlan(step, text, tuple(lost)), why
    return None, why


def _holds(
    parities: Mapping[int, Mapping[int, ParityHeld]],
    leader: int,
    step: int,
    xset: XorSet,
    chunk: int,
) -> bool:
    held = parities.get(leader, {}).get(step)
    return held is not None and held.members == xset.members and held.chunk == chunk


class XorParity:
    """The XOR parity of one node-local tier, as seen by one rank (a
    :class:`~resilient.checkpoint.partner.CopyScheme`).

    Args:
        local: this node's local tier (parities live in its ``xor`` directory).
        ring: the nodes of the job (3 or more).
        coll: the tier's ranks (collective steps of :meth:`rebuild_newest`).
        channel: point-to-point transfers between the tier's ranks.
        keep: parities kept (the tier's ``local_keep``).
        set_size: the most nodes in a set (see :func:`~resilient.model.xorcode.sets_of`).
    """

    def __init__(
        self,
        local: Target,
        ring: Ring,
        coll: Collective,
        channel: Channel,
        *,
        keep: int,
        set_size: int,
    ) -> None:
        self.local = local
        self.parity = local.child(filenames.XOR_DIR)
        self.ring = ring
        self.coll = coll
        self.channel = channel
        self.keep = keep
        self.sets = sets_of(len(ring), set_size)
        self.node = next(
            n for n, ranks in zip(ring.leaders, ring.ranks, strict=True) if coll.rank in ranks
        )
        self.place = ring.leaders.index(self.node)
        self.set = next(s for s in self.sets if self.place in s.members)

    @property
    def acts(self) -> bool:
        """Whether this rank acts for its node (its first rank)."""
        return self.coll.rank == self.node

    @property
    def has_partner(self) -> bool:
        """Always: a job of fewer than 3 nodes gets partner copies instead."""
        return True

    def clean_up(self) -> None:
        """Local, on a node's first rank: remove parities cut short by a crash."""
        if self.acts:
            self.parity.clean_up()

    def _rank_of(self, member: int) -> int:
        """The acting rank of the set's ``member``-th node."""
        return self.ring.leaders[self.set.members[member]]

    # ------------------------------------------------------------------ encode

    def copy_job(self, step_dir: Path, manifest: Manifest) -> Callable[[], str | None]:
        """This rank's part of computing the parity of the committed local checkpoint
        ``step_dir``: on a node's first rank, the set's encode (no collective: it runs on the
        writer thread); elsewhere nothing. The returned function returns why this node's parity
        is not committed (``None``: it is) and raises only if the transfer itself broke."""
        if not self.acts:
            return lambda: None
        step = manifest.step
        n = len(self.set)
        me = self.set.position(self.place)
        # this node's files, from its part of the index (what every caller holds)
        mine = stream_sizes(node_files(manifest, self.ring.ranks[self.place]))

        def run() -> str | None:
            # every member's files, passed around the set: no member leaves the ring before
            # the encode (a member that did would leave the others waiting for its bytes)
            listed = self._around([list(f) for f in mine])
            sizes = {
                m: {str(f[0]): int(f[1]) for f in files}
                for m, files in zip(self.set.members, listed, strict=True)
            }
            chunk = chunk_size([sum(s.values()) for s in sizes.values()])
            pending = self.parity.pending(step)
            data = DataStream(
                [(name, size, _opener(self.local, step, name)) for name, size in mine]
            )
            problem: str | None = None
            try:
                self.parity.create(pending)
            except OSError as exc:
                problem = f"creating {pending.path}: {exc.strerror or exc}"
            writer = None
            if problem is None:
                try:
                    writer = self.parity.open_writer(
                        pending, filenames.XOR_PARITY, direct=chunk >= CHUNK
                    )
                except OSError as exc:
                    problem = f"creating the parity: {exc.strerror or exc}"
            sink = writer if writer is not None else _Discard()
            try:
                digest, found = encode(
                    self.channel, self._rank_of((me - 1) % n), self._rank_of((me + 1) % n),
                    me, n, chunk, data, sink,
                )  # fmt: skip
            finally:
                data.close()
            problem = problem or found
            if writer is not None:
                try:
                    writer.close(sync=problem is None)
                except OSError as exc:
                    problem = problem or f"syncing the parity: {exc.strerror or exc}"
            index: Manifest | None = None
            try:  # the whole index, committed with the parity (the caller may hold a part)
                index = self.local.manifest(step)
            except (OSError, InvalidCheckpointError) as exc:
                problem = problem or f"reading the manifest of step {step}: {exc}"
            problems = [str(p) for p in self._around(problem) if p]
            where = f"XOR parity of step {step} on node {self.ring.labels[self.place]}"
            if not problems and index is not None:
                record = self._record(step, me, chunk, digest, sizes)
                try:
                    self.parity.write(pending, filenames.XOR_RECORD, json.dumps(record).encode())
                    self.parity.commit(pending, index, what=where)
                except (OSError, ManifestError, ResilientError) as exc:
                    problems = [str(exc)]
            if problems:
                if problem is None and problems:
                    problem = f"another node of its set: {problems[0]}"
                self.parity.rollback(pending)
                return f"{where}: {problem or problems[0]}"
            self._rotate()
            return None

        return run

    def _record(
        self, step: int, me: int, chunk: int, digest: str, sizes: Mapping[int, dict[str, int]]
    ) -> dict[str, Any]:
        """What ``XOR.json`` says (:func:`parity_record` reads it)."""
        return {
            "step": step, "members": list(self.set.members), "member": me,
            "labels": [self.ring.labels[m] for m in self.set.members], "chunk": chunk,
            "digest": digest,
            "files": [[list(f) for f in stream_sizes(sizes[m])] for m in self.set.members],
        }  # fmt: skip

    def _around(self, doc: Any) -> list[Any]:
        """Every member's ``doc`` (JSON), by place in the set, on every member: ``n - 1``
        rounds of a ring, each sending what it received in the round before while receiving
        the next (no member waits on a send)."""
        n = len(self.set)
        me = self.set.position(self.place)
        nxt, prv = self._rank_of((me + 1) % n), self._rank_of((me - 1) % n)
        out: list[Any] = [None] * n
        out[me] = last = doc
        with ThreadPoolExecutor(1, thread_name_prefix="resilient-xor-send") as sender:
            for t in range(n - 1):
                sent = sender.submit(send_doc, self.channel, nxt, last)
                last = recv_doc(self.channel, prv, limit=16 << 20)
                sent.result()
                out[(me - t - 1) % n] = last
        return out

    def _rotate(self) -> None:
        try:
            for step in sorted(self.parity.steps(), reverse=True)[self.keep :]:
                self.parity.remove(step)
        except OSError as exc:
            log.warning("could not rotate the XOR parities in %s: %s", self.parity, exc)

    # ------------------------------------------------------------------ rebuild

    def inventory(
        self, own_steps: Sequence[int], current: Layout
    ) -> tuple[dict[int, Held], dict[int, ParityHeld]]:
        """Local, on a node's first rank: the node's own copies of each step (of the layout
        ``current``, sizes checked) and its committed parities (their size checked)."""
        held: dict[int, Held] = {}
        for step in own_steps:
            found = held_in(self.local, step, current, None)
            if found is not None:
                held[step] = found
        parities: dict[int, ParityHeld] = {}
        for step in self.parity.steps():
            got = _parity_record(self.parity, step)
            if got is not None:
                parities[step] = got
        return held, parities

    def rebuild_newest(
        self,
        own_steps: Callable[[], list[int]],
        current: Layout,
        *,
        step: int | None,
        at_least: int | None,
    ) -> None:
        """Collective: give every node its ranks' files of the newest step that the sets can
        complete (at most one node lost per set), if any node lacks them."""
        coll = self.coll
        excluded: set[int] = set()
        for _ in range(3):  # a rebuild that failed excludes its step; the choice is made again
            listed: tuple[dict[int, Held], dict[int, ParityHeld]] | Exception
            try:
                listed = self.inventory(own_steps(), current) if self.acts else ({}, {})
            except OSError as exc:
                log.warning("could not list the local tier %s: %s", self.local, exc)
                listed = ({}, {})
            except Exception as exc:  # raised on every rank by gather_inventories
                listed = exc
            held = listed[0] if isinstance(listed, tuple) else listed
            extra = listed[1] if isinstance(listed, tuple) else {}
            got = gather_inventories(
                coll, self.ring, held, extra, what="listing local copies and XOR parities"
            )
            decision: tuple[XorPlan | None, str | None] | Exception | None = None
            if got is not None:
                try:
                    if isinstance(got, Exception):
                        raise got
                    inventories, extras = got
                    parities = {r: extras[r] for r in self.ring.leaders}
                    decision = plan_xor(
                        inventories, parities, self.ring, self.sets, current, only=step,
                        at_least=at_least, excluded=frozenset(excluded),
                    )  # fmt: skip
                except Exception as exc:
                    decision = exc
            plan, why = coll.announce("listing local copies and XOR parities", decision)
            if why is not None and coll.is_coordinator:
                log.warning(
                    "%s; using %s", why,
                    f"local step {plan.step}" if plan is not None else "the shared root",
                )  # fmt: skip
            if plan is None or not plan.lost:
                return
            problems = problems_everywhere(
                coll, functools.partial(self._rebuild, plan, listed),
                f"rebuilding step {plan.step} from XOR parity",
            )  # fmt: skip
            if not problems:
                if coll.is_coordinator:
                    nodes = [self.ring.labels[self.sets[s].members[m]] for s, m in plan.lost]
                    log.warning(
                        "rebuilt local step %d on node(s) %s from XOR parity",
                        plan.step, ", ".join(nodes),
                    )  # fmt: skip
                return
            if coll.is_coordinator:
                log.warning("could not rebuild local step %d: %s", plan.step, problems[0])
            excluded.add(plan.step)

    def _rebuild(
        self, plan: XorPlan, listed: tuple[dict[int, Held], dict[int, ParityHeld]] | Exception
    ) -> str | None:
        """This node's part of the plan (its set lost a node; otherwise nothing): a survivor
        contributes, the lost node receives and commits. Returns what went wrong here."""
        lost = dict(plan.lost).get(self.set.index)
        if not self.acts or lost is None:
            return None
        step = plan.step
        manifest = parse_manifest(plan.manifest)
        n = len(self.set)
        me = self.set.position(self.place)
        sizes = {m: node_files(manifest, self.ring.ranks[m]) for m in self.set.members}
        chunk = chunk_size([sum(s.values()) for s in sizes.values()])
        chain = [(lost + i) % n for i in range(1, n)]
        label = self.ring.labels[self.set.members[lost]]
        if me == lost:
            return self._receive(plan, manifest, chunk, chain[-1], label)
        held = listed[1].get(step) if isinstance(listed, tuple) else None
        at = chain.index(me)
        prev = self._rank_of(chain[at - 1]) if at else None
        nxt = self._rank_of(chain[at + 1]) if at + 1 < len(chain) else self._rank_of(lost)
        data = DataStream(
            [(name, size, _opener(self.local, step, name))
             for name, size in stream_sizes(sizes[self.place])]
        )  # fmt: skip
        reader = None
        try:
            try:
                reader = self.parity.open_reader(step, filenames.XOR_PARITY)
            except OSError:
                reader = None
            share = Share(
                me, chunk, data, reader if reader is not None else _Missing(),
                held.digest if held else "",
            )  # fmt: skip
            problem = contribute(self.channel, prev, nxt, n, chunk, share)
        finally:
            data.close()
            if reader is not None:
                reader.close()
        if problem is not None:
            self._quarantine_parity(step, problem)
            return f"node {self.ring.labels[self.place]} could not help rebuild {label}: {problem}"
        return None

    def _receive(
        self, plan: XorPlan, manifest: Manifest, chunk: int, prev_member: int, label: str
    ) -> str | None:
        """The lost node's part: receive, write, commit its copy and its parity, verify."""
        step = plan.step
        n = len(self.set)
        me = self.set.position(self.place)
        mine = stream_sizes(node_files(manifest, self.ring.ranks[self.place]))
        pending = self.local.pending(step)
        parity_pending = self.parity.pending(step)
        error: str | None = None
        writer = None
        try:
            self.local.create(pending)
            self.parity.create(parity_pending)
            writer = self.parity.open_writer(
                parity_pending, filenames.XOR_PARITY, direct=chunk >= CHUNK
            )
        except OSError as exc:
            error = f"creating the rebuilt copy: {exc.strerror or exc}"
        sizes = dict(mine)

        def open_file(name: str) -> Any:
            if error is not None:
                return _Discard()
            return self.local.open_writer(pending, name, direct=sizes[name] >= CHUNK)

        got = receive_lost(
            self.channel, self._rank_of(prev_member), LostMember(me, mine), n, chunk,
            open_file, writer if writer is not None else _Discard(),
        )  # fmt: skip
        error = error or got.error
        if writer is not None:
            try:
                writer.close(sync=error is None)
            except OSError as exc:
                error = error or f"syncing the parity: {exc.strerror or exc}"
        what = f"rebuilt step {step}"
        if error is None:
            try:
                self.local.commit(pending, manifest, what=what)
                verify_node_files(self.local, step)
            except InvalidCheckpointError as exc:
                self._quarantine_own(step, exc.reason)
                error = exc.reason
            except (OSError, ManifestError, ResilientError) as exc:
                error = str(exc)
        if error is None:
            members = {m: node_files(manifest, self.ring.ranks[m]) for m in self.set.members}
            record = self._record(step, me, chunk, got.parity_digest, members)
            try:
                self.parity.write(parity_pending, filenames.XOR_RECORD, json.dumps(record).encode())
                self.parity.commit(
                    parity_pending, manifest, what=f"rebuilt XOR parity of step {step}"
                )
            except (OSError, ManifestError, ResilientError) as exc:
                log.warning("rebuilt step %d on node %s, but not its parity: %s", step, label, exc)
        else:
            self.local.rollback(pending)
            self.parity.rollback(parity_pending)
            return f"rebuilding step {step} on node {label}: {error}"
        return None

    def _quarantine_parity(self, step: int, reason: str) -> None:
        if reason != PARITY_MISMATCH and not reason.startswith(PARITY_UNREADABLE):
            return
        log.warning("XOR parity %s is corrupt, quarantined: %s", self.parity.where(step), reason)
        try:
            self.parity.quarantine(step, reason)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", self.parity.where(step), exc)

    def _quarantine_own(self, step: int, reason: str) -> None:
        log.warning("rebuilt local step %s failed its checksums, quarantined: %s",
                    self.local.where(step), reason)  # fmt: skip
        try:
            self.local.quarantine(step, reason)
        except OSError as exc:
            log.warning("could not quarantine %s: %s", self.local.where(step), exc)


def _opener(target: Target, step: int, name: str) -> Callable[[], Any]:
    return lambda: target.open_reader(step, name)


def _parity_record(target: Target, step: int) -> ParityHeld | None:
    """A committed parity's record, if it parses and its parity file has the chunk's size."""
    try:
        doc = json.loads(target.read(step, filenames.XOR_RECORD))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    members, chunk, digest = doc.get("members"), doc.get("chunk"), doc.get("digest")
    labels, member, files = doc.get("labels"), doc.get("member"), doc.get("files")
    if (
        not _ints(members)
        or not isinstance(chunk, int)
        or not isinstance(member, int)
        or not _ints([chunk, member])
        or chunk <= 0
        or not isinstance(digest, str)
        or not isinstance(labels, list)
        or not all(isinstance(x, str) for x in labels)
        or not isinstance(files, list)
        or not isinstance(members, list)
        or not len(members) == len(labels) == len(files)
        or not 0 <= member < len(members)
    ):
        return None
    streams: list[tuple[tuple[str, int], ...]] = []
    for listed in files:
        if not isinstance(listed, list) or not all(_file_item(f) for f in listed):
            return None
        streams.append(tuple((f[0], f[1]) for f in listed))
    found = target.stat(step, filenames.XOR_PARITY)
    if found is None or found.size != chunk:
        return None
    return ParityHeld(tuple(members), chunk, digest, tuple(labels), member, tuple(streams))


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    )


def _file_item(item: Any) -> bool:
    """``[name, size]`` of a data file or a manifest shard (nothing else may become a path)."""
    return (
        isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], str)
        and (filenames.is_data_file_name(item[0]) or filenames.is_shard_name(item[0]))
        and isinstance(item[1], int)
        and not isinstance(item[1], bool)
        and item[1] >= 0
    )


class _Discard:
    """A writer that keeps nothing (the stream must still be read to its end)."""

    def write(self, view: memoryview, pos: int) -> None:
        pass

    def resize(self, size: int) -> None:
        pass

    def close(self, *, sync: bool) -> None:
        pass


class _Missing:
    """A reader of a parity that is not there: every read fails (the stream goes on)."""

    def read(self, view: memoryview, pos: int) -> None:
        raise OSError("the parity file is missing")

    def readv(self, buffers: list[Any], pos: int) -> int:
        raise OSError("the parity file is missing")

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- elastic restores


@dataclass(frozen=True, slots=True)
class Holdings:
    """What a node of a job holds for an elastic restore: its name, the free bytes of its tier,
    its parities (of any job's sets) and, per step, the names of the files it holds (its own
    and partner copies)."""

    label: str
    free: int
    parities: dict[int, ParityHeld]
    held: dict[int, frozenset[str]]


@dataclass(frozen=True, slots=True)
class SetRebuild:
    """One set's lost member rebuilt onto a survivor for an elastic restore: the step, the
    set's members (names), the lost one's place, the survivors' acting ranks in chain order
    (the receiver last) with their places, the chunk and every member's files."""

    step: int
    labels: tuple[str, ...]
    lost: int
    chain: tuple[tuple[int, int], ...]
    chunk: int
    files: tuple[tuple[tuple[str, int], ...], ...]


def plan_staging_rebuild(
    holdings: Mapping[int, Holdings],
    *,
    only: int | None = None,
    at_least: int | None = None,
) -> tuple[tuple[SetRebuild, ...] | None, str | None]:
    """Pure: for the newest step (or ``only``; not older than ``at_least``) whose parities
    this job's nodes hold (``holdings``, by acting rank), the sets of an earlier job that lost
    one member no node here holds the files of, each rebuilt onto the survivor with the most
    free space; ``None`` when the newest step needs none (or none can be), and why not."""
    steps = sorted({s for h in holdings.values() for s in h.parities}, reverse=True)
    why: str | None = None
    for step in steps:
        if (only is not None and step != only) or (at_least is not None and step < at_least):
            continue
        held = frozenset().union(*(h.held.get(step, frozenset()) for h in holdings.values()))
        sets: dict[tuple[str, ...], dict[int, tuple[int, ParityHeld]]] = {}
        for rank, h in holdings.items():
            parity = h.parities.get(step)
            if parity is not None and parity.labels[parity.member] == h.label:
                sets.setdefault(parity.labels, {})[parity.member] = (rank, parity)
        rebuilds: list[SetRebuild] = []
        problem: str | None = None
        for labels, members in sets.items():
            files = next(iter(members.values()))[1].files
            lost = [j for j in range(len(labels)) if not {n for n, _ in files[j]} <= held]
            if not lost:
                continue
            if len(lost) > 1:
                problem = (
                    f"local step {step} cannot be staged from XOR parity: the files of nodes "
                    f"{', '.join(labels[j] for j in lost)} of one XOR set are on no node of "
                    "this job (a set rebuilds one node)"
                )
                break
            survivors = [j for j in range(len(labels)) if j != lost[0]]
            absent = [labels[j] for j in survivors if j not in members]
            if absent:
                problem = (
                    f"local step {step} cannot be staged: node {labels[lost[0]]}'s files are "
                    f"on no node of this job, and node(s) {', '.join(absent)} of its XOR set "
                    "are not in it either"
                )
                break
            need = sum(size for _, size in files[lost[0]])
            receiver = max(survivors, key=lambda j: holdings[members[j][0]].free)
            if holdings[members[receiver][0]].free < need:
                problem = (
                    f"node {labels[lost[0]]}'s files of local step {step} ({need} bytes) would "
                    f"be rebuilt from XOR parity for an elastic restore, but they do not fit on "
                    f"any node of its set here (node {labels[receiver]} has "
                    f"{holdings[members[receiver][0]].free} bytes free)"
                )
                break
            order = [j for j in survivors if j != receiver] + [receiver]
            chain = tuple((members[j][0], j) for j in order)
            rebuilds.append(
                SetRebuild(step, labels, lost[0], chain, members[receiver][1].chunk, files)
            )
        if problem is not None:
            why = why or problem
            continue
        return (tuple(rebuilds) or None), why
    return None, why


def rebuild_for_staging(
    local: Target,
    ring: Ring,
    coll: Collective,
    channel: Channel,
    free: Callable[[], int],
    *,
    step: int | None,
    at_least: int | None,
) -> None:
    """Collective over ``coll``: before an elastic restore stages a step, rebuild from XOR
    parity the files of each node of an earlier job that no node of this one holds (one per
    set of that job), onto the survivor of its set with the most free space (``free()``: its
    tier's free bytes), as a partner copy there (``partner/<lost node>/``, with its digests),
    checked against every checksum of the manifest: the staging then takes it like any partner
    copy. Says once when the files do not fit on any survivor (two members of a set lost, or a
    survivor missing: the staging itself says which files are on no node)."""
    acts = coll.rank in ring.leaders
    mine: Holdings | Exception | None = None
    if acts:
        try:
            mine = _holdings(local, ring, coll.rank, free)
        except OSError as exc:
            log.warning("could not list the local tier %s: %s", local, exc)
            mine = Holdings(ring.labels[ring.leaders.index(coll.rank)], 0, {}, {})
        except Exception as exc:  # raised on every rank by announce
            mine = exc
    gathered = coll.gather(mine)
    decision: tuple[tuple[SetRebuild, ...] | None, str | None] | Exception | None = None
    if gathered is not None:
        try:
            values = gathered.values()
            decision = plan_staging_rebuild(
                {r: h for r, h in enumerate(values) if isinstance(h, Holdings)},
                only=step, at_least=at_least,
            )  # fmt: skip
        except Exception as exc:
            decision = exc
    plan, why = coll.announce("listing XOR parities for an elastic restore", decision)
    if why is not None and coll.is_coordinator:  # no room: said; else the staging says why
        log.log(logging.WARNING if "do not fit" in why else logging.INFO, "%s", why)
    if plan is None:
        return
    problems = problems_everywhere(
        coll,
        lambda: next(
            (p for r in plan if (p := _staging_part(local, coll.rank, channel, r)) is not None),
            None,
        ),
        "rebuilding from XOR parity for an elastic restore",
    )
    if coll.is_coordinator:
        if problems:
            log.warning("could not rebuild from XOR parity for an elastic restore: %s", problems[0])
        else:
            for r in plan:
                log.warning(
                    "rebuilt node %s's files of local step %d on node %s from XOR parity, for "
                    "an elastic restore", r.labels[r.lost], r.step, r.labels[r.chain[-1][1]],
                )  # fmt: skip


def _holdings(local: Target, ring: Ring, rank: int, free: Callable[[], int]) -> Holdings:
    parities: dict[int, ParityHeld] = {}
    xor = local.child(filenames.XOR_DIR)
    for step in xor.steps():
        found = _parity_record(xor, step)
        if found is not None:
            parities[step] = found
    held: dict[int, set[str]] = {}
    for target in (local, *local.child(filenames.PARTNER_DIR).children()):
        for step in target.steps():
            names = {
                n for n in target.file_names(step)
                if filenames.is_data_file_name(n) or filenames.is_shard_name(n)
            }  # fmt: skip
            held.setdefault(step, set()).update(names)
    label = ring.labels[ring.leaders.index(rank)]
    return Holdings(label, free(), parities, {s: frozenset(n) for s, n in held.items()})


def _staging_part(local: Target, rank: int, channel: Channel, r: SetRebuild) -> str | None:
    """This rank's part of one set's rebuild for a staging (nothing if not in its chain)."""
    places = [rank_ for rank_, _ in r.chain]
    if rank not in places:
        return None
    at = places.index(rank)
    me = r.chain[at][1]
    n = len(r.labels)
    xor = local.child(filenames.XOR_DIR)
    record = _parity_record(xor, r.step)
    data = DataStream([(name, size, _opener(local, r.step, name)) for name, size in r.files[me]])
    reader: Any = None
    try:
        try:
            reader = xor.open_reader(r.step, filenames.XOR_PARITY)
        except OSError:
            reader = _Missing()
        share = Share(me, r.chunk, data, reader, record.digest if record else "")
        prev = r.chain[at - 1][0] if at else None
        if at + 1 < len(places):
            problem = contribute(channel, prev, places[at + 1], n, r.chunk, share)
            return None if problem is None else f"node {r.labels[me]}: {problem}"
        assert prev is not None  # a set has 3 members or more: 2 survivors at least
        return _receive_for_staging(local, channel, prev, r, share)
    finally:
        data.close()
        if reader is not None:
            reader.close()


def _receive_for_staging(
    local: Target, channel: Channel, prev: int, r: SetRebuild, share: Share
) -> str | None:
    """The receiver's part: the lost member's files as a partner copy in ``local``."""
    lost = r.labels[r.lost]
    target = local.child(filenames.PARTNER_DIR).child(filenames.partner_dir_name(lost))
    pending = target.pending(r.step)
    error: str | None = None
    try:
        target.create(pending)
    except OSError as exc:
        error = f"creating {pending.path}: {exc.strerror or exc}"
    sizes = dict(r.files[r.lost])

    def open_file(name: str) -> Any:
        if error is not None:
            return _Discard()
        return target.open_writer(pending, name, direct=sizes[name] >= CHUNK)

    got = receive_lost(
        channel, prev, LostMember(r.lost, r.files[r.lost]), len(r.labels), r.chunk, open_file,
        _Discard(), share=share,
    )  # fmt: skip
    error = error or got.error
    where = f"node {lost}'s files of step {r.step}, rebuilt on node {r.labels[r.chain[-1][1]]}"
    if error is None:
        try:
            digests = {name: digest_file(pending.path / name) for name in sizes}
            record = {"source": lost, "files": {n: [sizes[n], digests[n]] for n in sizes}}
            target.write(pending, filenames.PARTNER_RECORD, json.dumps(record).encode())
            target.commit(pending, local.manifest(r.step), what=where)
            verify_node_files(target, r.step)
        except InvalidCheckpointError as exc:
            log.warning("%s failed its checksums, quarantined: %s", where, exc.reason)
            try:
                target.quarantine(r.step, exc.reason)
            except OSError as again:
                log.warning("could not quarantine %s: %s", target.where(r.step), again)
            return f"{where}: {exc.reason}"
        except (OSError, ManifestError, ResilientError) as exc:
            error = str(exc)
    if error is not None:
        target.rollback(pending)
        return f"{where}: {error}"
    return None
