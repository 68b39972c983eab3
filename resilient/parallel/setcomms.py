"""The communicators of a checkpoint set (``checkpoint_comm``): who writes which file.

The grouping itself is the set's *layout* (:class:`resilient.model.layout.Layout`, what a
manifest records); :class:`SetComms` is that layout with the communicators that carry it out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from resilient.errors import ConfigError
from resilient.model import filenames
from resilient.model.layout import Layout
from resilient.parallel.collective import Collective
from resilient.parallel.comm import Comm, SerialComm, as_comm

__all__ = ["SetComms", "deal_through_leaders", "make_set_comms", "shard_groups", "shard_members"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class SetComms:
    """The communicators of a set's layout: who writes which file. Built once per manager
    (collectively).

    Attributes:
        comm: all ranks of the checkpoint set; its rank 0 coordinates.
        group: the ranks sharing this rank's file; its rank 0 creates the file.
        kind: ``self``, ``node``, ``world`` or ``custom``.
        groups: the world ranks of every group, ordered by their lowest rank.
        group_index: index of this rank's group in ``groups``.
        shard: the ranks whose manifest entries share this rank's manifest shard (whole
            groups, consecutive in ``groups``); ``None``: the manifest is one file.
        shard_index: the index of this rank's shard.
        shards: the ranks (of ``comm``) of every shard, in order (``()``: no shards).
        leaders: on each shard's leader (its lowest rank), the leaders of every shard, in
            shard order (rank ``i`` leads shard ``i``; rank 0 of ``comm`` leads shard 0 and
            coordinates); ``None`` on the other ranks and without shards. A set-level round
            goes through it in two levels: up a shard to its leader, then up the leaders to
            rank 0 (and back down the same way), so that no rank but a leader talks to rank 0.
    """

    comm: Comm
    group: Comm
    kind: str
    groups: tuple[tuple[int, ...], ...]
    group_index: int
    shard: Comm | None = None
    shard_index: int = 0
    shards: tuple[tuple[int, ...], ...] = ()
    leaders: Comm | None = None

    @property
    def shard_members(self) -> tuple[int, ...]:
        """The ranks (of ``comm``) of this rank's shard, in order (``()``: no shards)."""
        return self.shards[self.shard_index] if self.shards else ()

    @property
    def layout(self) -> Layout:
        """This set's layout, as a manifest records it."""
        return Layout(self.kind, self.comm.size, self.groups)

    @property
    def file_name(self) -> str:
        return filenames.file_name(self.kind, self.group_index)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks (of ``comm``) sharing this rank's file."""
        return self.groups[self.group_index]


def _resolve(comm: Comm, checkpoint_comm: Any) -> tuple[str, Comm]:
    if not isinstance(checkpoint_comm, str):
        return "custom", as_comm(checkpoint_comm)
    if checkpoint_comm == "self":
        return "self", SerialComm()
    if checkpoint_comm == "node":
        return "node", comm.split_node()
    if checkpoint_comm == "world":
        return "world", comm
    raise ConfigError(
        f"checkpoint_comm must be 'self', 'node', 'world' or a communicator, got {checkpoint_comm!r}"
    )


def shard_groups(
    groups: Sequence[Sequence[int]], shard_ranks: int, *, nodes: Sequence[int] | None = None
) -> list[int]:
    """Pure: the manifest shard of each group: consecutive groups, a shard closed once it holds
    ``shard_ranks`` ranks or more (a group is never split). ``nodes``: the node of each group
    (e.g. its first rank's node leader); a shard then never spans two nodes (a node-local
    tier's copy on a node holds the shards of that node's ranks): a node's groups fill shards
    of their own, in the order of their first group."""
    if nodes is None:
        nodes = [0] * len(groups)
    out: list[int] = [0] * len(groups)
    open_shard: dict[int, tuple[int, int]] = {}  # node -> (its open shard, ranks in it)
    count = 0
    for i, (group, node) in enumerate(zip(groups, nodes, strict=True)):
        shard, held = open_shard.get(node, (-1, shard_ranks))
        if held >= shard_ranks:
            shard, held, count = count, 0, count + 1
        out[i] = shard
        open_shard[node] = (shard, held + len(group))
    return out


def make_set_comms(
    comm: Comm, checkpoint_comm: Any, *, shard_ranks: int | None = None, by_node: bool = False
) -> SetComms:
    """Collective over ``comm``: call on all ranks. Resolve ``checkpoint_comm`` into groups.

    With ``shard_ranks``, a set of more ranks than that writes a sharded manifest: each shard
    (:func:`shard_groups`) gets a communicator of its own, and the shards' leaders one
    together (:attr:`SetComms.leaders`), made here. ``by_node``: no shard spans two nodes
    (:meth:`~resilient.parallel.comm.Comm.split_node`; for a node-local tier, whose groups lie
    on one node each).

    Raises:
        ConfigError: an unknown name, or groups that do not partition ``comm``.
    """
    coll = Collective(comm)
    kind, group = coll.check("checkpoint_comm setup", lambda: _resolve(comm, checkpoint_comm))
    members = tuple(group.allgather(comm.rank))
    everyone = comm.allgather(members)
    groups = sorted(set(everyone), key=min)

    def check_partition() -> None:
        seen = [r for g in groups for r in g]
        if sorted(seen) != list(range(comm.size)) or len(members) != group.size:
            raise ConfigError(
                "checkpoint_comm does not partition comm: every rank must be in exactly one "
                f"group (groups seen: {groups[:8]})"
            )

    coll.check("checkpoint_comm setup", check_partition)
    index = groups.index(members)
    comms = SetComms(comm=comm, group=group, kind=kind, groups=tuple(groups), group_index=index)
    shards: list[int] = []
    if shard_ranks and comm.size > shard_ranks:
        nodes = _node_of_groups(comm, groups) if by_node else None
        shards = shard_groups(groups, shard_ranks, nodes=nodes)
    if len(set(shards)) < 2:
        return comms
    mine = shards[index]
    shard = coll.check("manifest shard setup", lambda: comm.split(mine))
    every = shard_members(groups, shards)
    leads = comm.rank == every[mine][0]
    leaders = coll.check("manifest shard setup", lambda: comm.split(0 if leads else 1))
    return dataclasses.replace(
        comms, shard=shard, shard_index=mine, shards=every, leaders=leaders if leads else None
    )


def shard_members(
    groups: Sequence[Sequence[int]], of_group: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Pure: the ranks of each shard, in order, from the shard of each group
    (:func:`shard_groups`)."""
    out: list[list[int]] = [[] for _ in range(max(of_group, default=-1) + 1)]
    for group, shard in zip(groups, of_group, strict=True):
        out[shard].extend(group)
    return tuple(tuple(sorted(m)) for m in out)


def deal_through_leaders(
    comms: SetComms,
    what: str,
    answers: Sequence[T] | Exception | None,
    spread: Callable[[T], Sequence[U]],
) -> U:
    """Collective over ``comms.comm`` with shards (two scatters): call on all ranks. The
    coordinator passes one answer per shard (shard order), or the exception that kept it from
    making them; the other ranks pass ``None``. Each shard's leader receives its shard's
    answer (over :attr:`SetComms.leaders`), runs ``spread`` on it, which returns one answer
    per rank of its shard (rank order), and deals them (over :attr:`SetComms.shard`): the
    coordinator sends one message per shard, not per rank.

    ``spread`` should turn its own failures into answers: one that raises fails its shard's
    ranks only (each raises it), not every rank.

    Returns:
        This rank's answer, on every rank.

    Raises:
        ResilientError: the coordinator's error (or answers that are not one per shard), the
            same on every rank.
    """
    assert comms.shard is not None
    spread_out: Sequence[U] | Exception | None = None
    if comms.leaders is not None:
        try:
            mine = Collective(comms.leaders, name=comms.comm.rank).deal(what, answers)
            spread_out = spread(mine)
        except Exception as exc:
            spread_out = exc
    return Collective(comms.shard, name=comms.comm.rank).deal(what, spread_out)


def _node_of_groups(comm: Comm, groups: Sequence[Sequence[int]]) -> list[int]:
    """Collective over ``comm``: the node of each group (the first rank of its first rank's
    node)."""
    node = Collective(comm).check("grouping ranks by node", comm.split_node)
    leader = node.bcast(comm.rank)
    leaders = comm.allgather(leader)
    return [leaders[group[0]] for group in groups]
