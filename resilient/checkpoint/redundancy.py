"""What ``redundancy=`` names: how the node-local tier protects a node's files against its loss.

* ``"partner"`` (:mod:`resilient.checkpoint.partner`): a full copy of each node's files on the
  next node. Survives the loss of any node whose neighbour survives; doubles the tier's bytes.
* ``"xor"`` (:mod:`resilient.checkpoint.xorsets`): parity over sets of up to ``xor_set_size``
  nodes (default 8). Survives one lost node per set; adds ``1 / (n - 1)`` of the largest
  node's data per node (+14 % at 8).

Both provide the three operations of :class:`CopyScheme`; :func:`make_copy_scheme` makes the
one asked for (collective).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from resilient.checkpoint.partner import PartnerCopies, Ring
from resilient.checkpoint.xorsets import DEFAULT_SET_SIZE, XorParity
from resilient.errors import ConfigError
from resilient.io.targets import Target
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest
from resilient.model.xorcode import MIN_SET
from resilient.parallel.collective import Collective

__all__ = [
    "DEFAULT_SET_SIZE",
    "REDUNDANCY_SCHEMES",
    "CopyScheme",
    "check_redundancy",
    "check_set_size",
    "make_copy_scheme",
]

log = logging.getLogger(__name__)

REDUNDANCY_SCHEMES = ("partner", "xor")


def check_redundancy(name: str | None) -> str | None:
    """``name`` if it names a redundancy scheme (or is ``None``: none).

    Raises:
        ConfigError: an unknown scheme.
    """
    if name is None or name in REDUNDANCY_SCHEMES:
        return name
    raise ConfigError(
        f"redundancy must be one of {', '.join(REDUNDANCY_SCHEMES)} (or none), got {name!r}"
    )


def check_set_size(size: object) -> int:
    """``size`` if it is a usable XOR set size (an integer from 3).

    Raises:
        ConfigError: anything else.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < MIN_SET:
        raise ConfigError(
            f"xor_set_size must be an integer of at least {MIN_SET} nodes, got {size!r}"
        )
    return size


class CopyScheme(Protocol):
    """How the node-local tier keeps what rebuilds a node's files elsewhere (what
    ``redundancy=`` names): :class:`~resilient.checkpoint.partner.PartnerCopies` or
    :class:`~resilient.checkpoint.xorsets.XorParity`. Made collectively by
    :func:`make_copy_scheme`."""

    @property
    def has_partner(self) -> bool:
        """Whether the scheme protects anything here (partner copies: two nodes or more)."""
        ...

    def copy_job(self, step_dir: Path, manifest: Manifest) -> Callable[[], str | None]:
        """This rank's part of protecting a committed local checkpoint (no collective: it
        runs on the writer thread); the job returns why it is not protected (``None``: it
        is)."""
        ...

    def rebuild_newest(
        self,
        own_steps: Callable[[], list[int]],
        current: Layout,
        *,
        step: int | None,
        at_least: int | None,
    ) -> None:
        """Collective: complete every node's copy of the newest step (or ``step``, not older
        than ``at_least``) that the nodes can rebuild between them."""
        ...


def make_copy_scheme(
    name: str,
    local: Target,
    nodes: Sequence[tuple[int, str]],
    coll: Collective,
    *,
    keep: int,
    shared_root: Path,
    set_size: int = DEFAULT_SET_SIZE,
) -> CopyScheme:
    """Collective: the scheme ``name`` for the local tier ``local``, given ``(first rank of its
    node, node name)`` of every rank. Says once (the coordinator) when one node has no partner,
    and when ``xor`` falls back to partner copies (fewer than 3 nodes).

    Raises:
        ConfigError: an unknown scheme or set size, or no channel between the ranks.
    """
    check_redundancy(name)
    check_set_size(set_size)
    channel = coll.check("opening a channel for the node-local tier's copies", coll.comm.channel)
    ring = Ring.of(nodes)
    copies: PartnerCopies | XorParity
    if name == "xor" and len(ring) >= MIN_SET:
        copies = XorParity(local, ring, coll, channel, keep=keep, set_size=set_size)
        coll.check("cleaning up XOR parities", copies.clean_up)
        return copies
    if name == "xor" and len(ring) > 1 and coll.is_coordinator:
        log.warning(
            "redundancy='xor' needs %d nodes or more, this job has %d (%s): keeping partner "
            "copies instead (a full copy of each node's files on the other)",
            MIN_SET, len(ring), ", ".join(ring.labels),
        )  # fmt: skip
    copies = PartnerCopies(local, ring, coll, channel, keep=keep)
    coll.check("cleaning up partner copies", copies.clean_up)
    if len(ring) == 1 and coll.is_coordinator:
        log.warning(
            "redundancy=%r on one node (%s): there is no other node to keep a copy, so "
            "local checkpoints are protected only by their flush to %s",
            name, ring.labels[0], shared_root,
        )  # fmt: skip
    return copies
