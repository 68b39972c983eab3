"""What a caller hands to ``save()``: checked and split into array leaves and a tree. Pure.

:func:`split_state` is the one place that decides what a state may hold; :class:`SaveRequest`
checks one rank's arguments of a save before anything touches the disk.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from resilient.errors import ConfigError
from resilient.model import dtensors
from resilient.model.arrays import leaf_meta, storable_dtype, to_numpy
from resilient.model.blocks import BlockSpec
from resilient.model.checksum import digest_array
from resilient.model.tree import Memo, TreeError, flatten

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DeviceCopy",
    "LocalData",
    "SaveRequest",
    "local_targets",
    "put_back",
    "split_state",
    "split_template",
]


class DeviceCopy(Protocol):
    """Copies a state's device tensors to host memory of its own, all at once (implemented by
    :class:`resilient.io.devicecopy.DeviceStaging`)."""

    def wants(self, value: Any) -> bool:
        """Whether ``value`` (an array leaf) is one of the tensors :meth:`stage` copies."""
        ...

    def stage(self, tensors: Mapping[str, Any]) -> Mapping[str, npt.NDArray[np.generic]]:
        """Copy ``tensors`` (by path) to host buffers; their contents, stored as
        :func:`~resilient.model.arrays.to_numpy` would give them, by path. The buffers are the
        stager's, valid until its next :meth:`stage`: a private copy, written as it is."""
        ...


@dataclass(frozen=True, slots=True)
class LocalData:
    """One rank's payload: its array leaves by path (written to HDF5) and its tree (the
    structure with the JSON leaves inline, kept in the manifest; see :mod:`resilient.model.tree`)."""

    arrays: Mapping[str, npt.NDArray[np.generic]]
    tree: Any = None
    striped: frozenset[str] = frozenset()  # Block leaves: checksummed by stripes too
    staged: frozenset[str] = frozenset()  # copies of device tensors: private, never staged again

    def describe(self) -> list[Any]:
        """A JSON-able content description (paths, dtypes, shapes, checksums, the tree)."""
        return [
            sorted(
                (k, a.dtype.str, list(a.shape), digest_array(a)) for k, a in self.arrays.items()
            ),
            json.dumps(self.tree, allow_nan=True),
        ]

    def names(self) -> set[str]:
        """The top-level names."""
        if self.tree is None:
            return set()
        if self.tree[0] == "p":
            return set(self.tree[2])
        return {key for _, key, _ in self.tree[1]}


EMPTY = LocalData({}, None)


def split_state(
    state: Mapping[str, Any] | None,
    *,
    what: str = "state",
    memo: Memo | None = None,
    device: DeviceCopy | None = None,
) -> LocalData:
    """Flatten a user mapping (any nesting of mappings, lists and tuples whose leaves are
    arrays, tensors or JSON values) into array leaves and a tree (``memo``: the caller's
    :class:`~resilient.model.tree.Memo`, if any; ``device``: copies the device tensors it
    wants in one go, else each is copied to the host by :func:`~resilient.model.arrays.to_numpy`).

    Raises:
        ConfigError: a key that is neither a string nor an int, a value that is neither an
            array nor JSON, or an array dtype that cannot be stored.
    """
    if state is None:
        return EMPTY
    try:
        flat = flatten(state, leaf_meta, what=what, plain=_plain_types(), memo=memo)
    except TreeError as exc:
        raise ConfigError(str(exc)) from None
    for p, meta in flat.metas.items():
        if "dtensor" in meta:  # what this rank stores of it: its local piece, or none
            flat.arrays[p] = dtensors.piece(flat.arrays[p], what=f"{what}[{p!r}]").stored
    values = list(flat.arrays.values())
    on_device: Mapping[str, Any] = {}
    if set(map(type, values)) <= _plain_types() and _all_storable(values):
        arrays = flat.arrays  # the common case: no per-leaf call
    else:
        on_device = (
            {} if device is None else {p: v for p, v in flat.arrays.items() if device.wants(v)}
        )
        arrays = {
            p: to_numpy(v, what=f"{what}[{p!r}]")
            for p, v in flat.arrays.items()
            if p not in on_device
        }
        if on_device:
            assert device is not None
            staged = device.stage(on_device)
            arrays = {p: staged[p] if p in staged else arrays[p] for p in flat.arrays}
    striped = []
    for p, meta in flat.metas.items():
        block = meta.get("block")
        if block is not None:
            BlockSpec.of(block["global_shape"], block["start"], arrays[p].shape,
                         what=f"{what}[{p!r}]")  # fmt: skip
            striped.append(p)
    return LocalData(arrays, flat.tree, frozenset(striped), frozenset(on_device))


@functools.cache  # a constant, built once (numpy is imported lazily)
def _plain_types() -> frozenset[type]:
    """Array leaves written as they are, without metadata: numpy arrays."""
    import numpy as np

    return frozenset({np.ndarray})


def _all_storable(arrays: list[npt.NDArray[np.generic]]) -> bool:
    """Whether numpy arrays are all C-contiguous, of dtypes a checkpoint stores (one check per
    distinct dtype)."""
    return all(map(_C_CONTIGUOUS, arrays)) and all(
        storable_dtype(d.str) for d in set(map(operator.attrgetter("dtype"), arrays))
    )


_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")


def split_template(
    template: Mapping[str, Any], *, memo: Memo | None = None
) -> tuple[dict[str, Any], dict[str, BlockSpec]]:
    """A restore template's array leaves by path (the arrays a restore reads into) and its
    :class:`~resilient.model.blocks.Block` leaves' blocks by path (what an elastic restore reads into
    them), from one pass over it. A DTensor leaf is a block: its whole local piece (the
    caller reads into its local tensor: :func:`local_targets`).

    Raises:
        ConfigError: the template is not a state (see :func:`split_state`), or a block is not
            inside its global shape.
    """
    try:
        flat = flatten(
            template, leaf_meta, what="restore template", plain=_plain_types(), memo=memo
        )
    except TreeError as exc:
        raise ConfigError(str(exc)) from None
    import numpy as np

    from resilient.model.arrays import template_spec

    arrays: dict[str, Any] = flat.arrays
    blocks: dict[str, BlockSpec] = {}
    if any(issubclass(t, np.generic) for t in set(map(type, arrays.values()))):
        # numpy scalars are immutable: they come back as new values, like JSON leaves
        arrays = {p: v for p, v in arrays.items() if not isinstance(v, np.generic)}
    for p, meta in flat.metas.items():
        if "dtensor" in meta:  # every rank reads all it holds (a replica too)
            piece = dtensors.piece(flat.arrays[p], what=f"restore template[{p!r}]")
            blocks[p] = BlockSpec(piece.global_shape, piece.start, tuple(piece.local.shape))
            continue
        block = meta.get("block")
        if block is not None:
            shape, _ = template_spec(flat.arrays[p])
            blocks[p] = BlockSpec.of(block["global_shape"], block["start"], shape,
                                     what=f"restore template[{p!r}]")  # fmt: skip
    return arrays, blocks


def local_targets(arrays: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, Any]]:
    """A restore template's array leaves (of :func:`split_template`) with each DTensor replaced
    by its local tensor (read into in place: the DTensor's own memory), and the DTensors by the
    ``id`` of their local tensors, for :func:`put_back`."""
    swaps: dict[int, Any] = {}
    out = dict(arrays)
    for path, value in arrays.items():
        if dtensors.is_dtensor(value):
            local = dtensors.piece(value, what=f"restore template[{path!r}]").local
            out[path] = local
            swaps[id(local)] = value
    return out, swaps


def put_back(state: Any, swaps: Mapping[int, Any]) -> Any:
    """``state`` (a restored structure of dicts, lists and tuples) with each leaf whose ``id``
    is in ``swaps`` (a local tensor read into) replaced by its DTensor."""
    if not swaps:
        return state
    if isinstance(state, dict):
        return {k: put_back(v, swaps) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [put_back(v, swaps) for v in state]
        return tuple(items) if isinstance(state, tuple) else items
    return swaps.get(id(state), state)


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """One rank's checked arguments of a save.

    Attributes:
        step: the step (a non-negative int).
        data: the state, split.
        static: the static data, split, or ``None`` when none was given.
        metrics: JSON metrics.
    """

    step: int
    data: LocalData
    static: LocalData | None
    metrics: Mapping[str, Any]

    @classmethod
    def build(
        cls,
        step: Any,
        state: Mapping[str, Any],
        static: Mapping[str, Any] | None,
        metrics: Mapping[str, Any] | None,
        *,
        memo: Memo | None = None,
        device: DeviceCopy | None = None,
    ) -> SaveRequest:
        """Check and split one rank's arguments (local: no communication, no I/O; ``memo``: the
        caller's :class:`~resilient.model.tree.Memo`, if any; ``device``: copies the state's
        device tensors, see :func:`split_state`; static data is copied leaf by leaf: it is
        written at once, and rarely).

        Raises:
            ConfigError: a bad step, name, value or metric, or a name in both state and static.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        data = split_state(state, memo=memo, device=device)
        static_data = None if static is None else split_state(static, what="static", memo=memo)
        if metrics is not None:
            try:
                json.dumps(dict(metrics), allow_nan=True)
            except (TypeError, ValueError):
                raise ConfigError("metrics must be a mapping of JSON values") from None
        clash = data.names() & (static_data.names() if static_data else set())
        if clash:
            raise ConfigError(f"names in both state and static: {sorted(clash)}")
        return cls(step, data, static_data, dict(metrics or {}))
