"""Who writes which file: the groups of ranks of a checkpoint set (``checkpoint_comm``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resilient import layout
from resilient.collective import Collective
from resilient.comm import Comm, SerialComm, as_comm
from resilient.errors import ConfigError
from resilient.manifest import LayoutInfo

__all__ = ["Topology", "make_topology"]


@dataclass(frozen=True, slots=True)
class Topology:
    """Who writes which file. Built once per manager (collectively).

    Attributes:
        comm: all ranks of the checkpoint set; its rank 0 coordinates.
        group: the ranks sharing this rank's file; its rank 0 creates the file.
        kind: ``self``, ``node``, ``world`` or ``custom``.
        groups: the world ranks of every group, ordered by their lowest rank.
        group_index: index of this rank's group in ``groups``.
    """

    comm: Comm
    group: Comm
    kind: str
    groups: tuple[tuple[int, ...], ...]
    group_index: int

    @property
    def layout_info(self) -> LayoutInfo:
        return LayoutInfo(self.kind, self.comm.size, self.groups)

    @property
    def file_name(self) -> str:
        return layout.file_name(self.kind, self.group_index)

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


def make_topology(comm: Comm, checkpoint_comm: Any) -> Topology:
    """Collective over ``comm``: call on all ranks. Resolve ``checkpoint_comm`` into groups.

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
    return Topology(
        comm=comm, group=group, kind=kind, groups=tuple(groups), group_index=groups.index(members)
    )
