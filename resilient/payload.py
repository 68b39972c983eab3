"""What a caller hands to ``save()``: checked and split into arrays and JSON values. Pure.

:func:`split_state` is the one place that decides what a state may hold; :class:`SaveRequest`
checks one rank's arguments of a save before anything touches the disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resilient.checksum import digest_array
from resilient.errors import ConfigError
from resilient.manifest import dtype_itemsize, is_valid_key

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["LocalData", "SaveRequest", "split_state"]


@dataclass(frozen=True, slots=True)
class LocalData:
    """One rank's payload split into arrays (written to HDF5) and JSON values (manifest)."""

    arrays: Mapping[str, npt.NDArray[np.generic]]
    values: Mapping[str, Any]

    def describe(self) -> list[Any]:
        """A JSON-able content description (names, dtypes, shapes, checksums, values)."""
        return [
            sorted(
                (k, a.dtype.str, list(a.shape), digest_array(a)) for k, a in self.arrays.items()
            ),
            json.dumps(dict(self.values), sort_keys=True, allow_nan=True),
        ]

    def names(self) -> set[str]:
        """Every name, arrays and values."""
        return set(self.arrays) | set(self.values)


EMPTY = LocalData({}, {})


def split_state(state: Mapping[str, Any] | None, *, what: str = "state") -> LocalData:
    """Split a user mapping into arrays and JSON values, checking names and types.

    Raises:
        ConfigError: a key is not a legal name or a value is neither an array nor JSON-able.
    """
    import numpy as np

    arrays: dict[str, npt.NDArray[np.generic]] = {}
    values: dict[str, Any] = {}
    if state is None:
        return LocalData(arrays, values)
    if not isinstance(state, Mapping):
        raise ConfigError(f"{what} must be a mapping of names to arrays or JSON values")
    for key, value in state.items():
        if not isinstance(key, str) or not is_valid_key(key):
            raise ConfigError(
                f"{what} key {key!r}: use letters, digits, '_', '.', '-', '+' (<= 128 chars, no '/')"
            )
        if isinstance(value, (np.ndarray, np.generic)):
            arr = np.asarray(value)
            if not arr.flags.c_contiguous:
                arr = np.array(arr, order="C")
            try:
                dtype_itemsize(arr.dtype.str)
            except ValueError:
                raise ConfigError(
                    f"{what}[{key!r}]: dtype {arr.dtype} is not supported (numeric and bool only)"
                ) from None
            arrays[key] = arr
        else:
            try:
                json.dumps(value, allow_nan=True)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{what}[{key!r}]: {type(value).__name__} is neither a numpy array nor JSON-able"
                ) from None
            values[key] = value
    return LocalData(arrays, values)


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
    ) -> SaveRequest:
        """Check and split one rank's arguments (local: no communication, no I/O).

        Raises:
            ConfigError: a bad step, name, value or metric, or a name in both state and static.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        data = split_state(state)
        static_data = None if static is None else split_state(static, what="static")
        if metrics is not None:
            try:
                json.dumps(dict(metrics), allow_nan=True)
            except (TypeError, ValueError):
                raise ConfigError("metrics must be a mapping of JSON values") from None
        clash = data.names() & (static_data.names() if static_data else set())
        if clash:
            raise ConfigError(f"names in both state and static: {sorted(clash)}")
        return cls(step, data, static_data, dict(metrics or {}))
