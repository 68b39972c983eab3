"""The one strict reader of "a mapping with known keys and types". Pure (no I/O).

Every schema of the project goes through :class:`Section`: checkpoint-policy YAML
(:mod:`resilient.config`), manifests read from disk (:mod:`resilient.model.manifest`), Parsl configs and
the example campaign. A section knows where it came from (a file name) and its key path, so every
error names both::

    sec = Section(doc, where="configs/parsl/local.yaml")
    sec.only({"retries", "executor"})
    retries = sec.get("retries", int, 0, minimum=0)
    executor = sec.section("executor")          # required sub-mapping
    kind = executor.choice("kind", ("htex", "mpi"), None)

The error type is a parameter: :class:`~resilient.errors.ConfigError` for settings (the default),
``ManifestError`` for manifests. Booleans are never accepted where a number is expected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from resilient.errors import ConfigError

__all__ = ["MISSING", "Section", "type_names"]


class _Missing:
    """Marker for "no default: the key is required"."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

ErrorFactory = Callable[[str], Exception]


def type_names(typ: type | tuple[type, ...]) -> str:
    """``int``, or ``int or float`` for a tuple of types."""
    types = typ if isinstance(typ, tuple) else (typ,)
    return " or ".join(t.__name__ for t in types)


class Section:
    """A mapping being read strictly: unknown keys, missing required keys and wrong types raise.

    Args:
        doc: the parsed document (or a part of it); anything but a mapping raises at once.
        where: where it came from (a file name, or ``"config"``); starts every message.
        path: the key path of this section inside the document (``""`` for the top level).
        error: builds the exception from a message (default :class:`ConfigError`).
    """

    __slots__ = ("doc", "error", "path", "where")

    def __init__(
        self, doc: Any, *, where: str, path: str = "", error: ErrorFactory = ConfigError
    ) -> None:
        self.where = where
        self.path = path
        self.error = error
        if not isinstance(doc, Mapping):
            raise self._fail(
                path or "top level",
                f"not an object: expected a mapping, got {type(doc).__name__}",
            )
        self.doc: Mapping[str, Any] = doc

    # ------------------------------------------------------------------ helpers

    def name(self, key: str | int) -> str:
        """The full key path of ``key`` (``executor.kind``, ``ranks[3]``)."""
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def _fail(self, name: str, message: str) -> Exception:
        return self.error(f"{self.where}: {name}: {message}")

    def fail(self, key: str, message: str) -> Exception:
        """An error about ``key`` (to raise): ``"<where>: <path.key>: <message>"``."""
        return self._fail(self.name(key), message)

    def __contains__(self, key: object) -> bool:
        return key in self.doc

    def __iter__(self) -> Iterator[str]:
        return iter(self.doc)

    def items(self) -> Iterator[tuple[str, Any]]:
        """The raw ``(key, value)`` pairs, in document order."""
        return iter(self.doc.items())

    # ------------------------------------------------------------------ checks

    def only(
        self,
        allowed: set[str] | frozenset[str],
        *,
        other: Mapping[str, set[str]] | None = None,
        kind: str = "",
    ) -> Section:
        """Raise on any key not in ``allowed``; returns ``self`` for chaining.

        ``other`` maps a kind to the keys only it accepts, so that a key of another kind gets
        "only for kind 'slurm'" instead of "unknown key".
        """
        for key in sorted(map(str, self.doc)):
            if key in allowed:
                continue
            owner = [k for k, keys in (other or {}).items() if key in keys]
            if owner:
                raise self.fail(key, f"only for kind {owner[0]!r}, not {kind!r}")
            raise self.fail(key, f"unknown key {key!r}; allowed: {sorted(allowed)}")
        return self

    def get(
        self,
        key: str,
        typ: type | tuple[type, ...],
        default: Any = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        """The value of ``key`` checked against ``typ``; ``default`` if absent or null.

        With ``default=MISSING`` the key is required. ``minimum``/``maximum`` bound numbers.
        """
        value: Any = self.doc.get(key)
        if value is None:
            if default is MISSING:
                raise self.fail(key, f"missing field {key!r} (required)")
            return default
        return self.check(key, value, typ, minimum=minimum, maximum=maximum)

    def require(
        self,
        key: str,
        typ: type | tuple[type, ...],
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        """The value of the required ``key``, checked against ``typ``."""
        return self.get(key, typ, MISSING, minimum=minimum, maximum=maximum)

    def check(
        self,
        key: str | int,
        value: Any,
        typ: type | tuple[type, ...],
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        """Check one value (of ``key``, for the message) against ``typ`` and the bounds."""
        types = typ if isinstance(typ, tuple) else (typ,)
        if isinstance(value, bool) and bool not in types:
            raise self._fail(
                self.name(key), f"wrong type bool: expected {type_names(typ)}, got a boolean"
            )
        if not isinstance(value, types):
            raise self._fail(
                self.name(key),
                f"wrong type {type(value).__name__} {_short(value)}, expected {type_names(typ)}",
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if minimum is not None and value < minimum:
                raise self._fail(
                    self.name(key), f"out of range: must be >= {minimum}, got {value!r}"
                )
            if maximum is not None and value > maximum:
                raise self._fail(
                    self.name(key), f"out of range: must be <= {maximum}, got {value!r}"
                )
        return value

    def choice(self, key: str, choices: Sequence[str], default: str | None) -> str | None:
        """A string that must be one of ``choices`` (``default`` if absent; MISSING: required)."""
        value: str | None = self.get(key, str, default)
        if value is not None and value not in choices:
            raise self.fail(key, f"one of {list(choices)}, got {value!r}")
        return value

    def section(self, key: str) -> Section:
        """The required sub-mapping ``key``."""
        if self.doc.get(key) is None:
            raise self.fail(key, f"missing field {key!r} (required)")
        return Section(self.doc[key], where=self.where, path=self.name(key), error=self.error)

    def optional_section(self, key: str) -> Section | None:
        """The sub-mapping ``key``, or ``None`` if absent or null."""
        if self.doc.get(key) is None:
            return None
        return self.section(key)

    def sections(self, key: str) -> list[Section]:
        """The required list ``key`` of mappings, each as a :class:`Section` (``key[i]``)."""
        items = self.require(key, list)
        return [
            Section(item, where=self.where, path=f"{self.name(key)}[{i}]", error=self.error)
            for i, item in enumerate(items)
        ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
