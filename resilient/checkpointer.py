"""One save or one read of a set of per-rank arrays: plan -> write -> commit. Collective.

Used by :class:`resilient.manager.CheckpointManager` for checkpoints and static data alike.
Every phase captures its local errors as data, so that every rank always enters every
collective: a failure anywhere becomes the same exception on every rank, never a hang.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient import hdf5, layout, storage
from resilient.checksum import digest_array, digest_bytes, digest_text
from resilient.comm import Comm, describe_error
from resilient.errors import CollectiveError, CommitError, ConfigError
from resilient.manifest import (
    DatasetEntry,
    FileEntry,
    LayoutInfo,
    Manifest,
    RankEntry,
    combine_checksums,
    dtype_itemsize,
    is_valid_key,
)
from resilient.validate import marker_text

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["LocalData", "Topology", "read_rank", "split_state", "write_set"]

log = logging.getLogger(__name__)


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
class _Plan:
    specs: tuple[hdf5.ArraySpec, ...]
    values: Mapping[str, Any]
    digests: Mapping[str, str]


def _bcast_outcome(comm: Comm, outcome: BaseException | None) -> None:
    result = comm.bcast(outcome, root=0)
    if result is not None:
        raise result


def write_set(
    topo: Topology,
    tmp: Path,
    final: Path,
    *,
    step: int,
    data: LocalData,
    local_error: BaseException | None,
    kind: str = "checkpoint",
    static: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    library_version: str = "",
) -> Manifest:
    """Collective over ``topo.comm``: write ``data`` of every rank into ``tmp`` and commit it as ``final``.

    The coordinator has already created ``tmp``. On any failure every rank raises the same
    error and ``tmp`` is removed; ``final`` and everything else are untouched.
    """
    comm, group = topo.comm, topo.group
    what = f"save of {kind} step {step}"
    path = tmp / topo.file_name
    err: str | None = describe_error(local_error) if local_error else None

    # Phase 1 (group): the leader learns its members' plans and creates the file.
    plan: _Plan | None = None
    if err is None:
        try:
            plan = _Plan(
                specs=tuple(
                    hdf5.ArraySpec(k, tuple(a.shape), a.dtype.str) for k, a in data.arrays.items()
                ),
                values=dict(data.values),
                digests={k: digest_array(a) for k, a in data.arrays.items()},
            )
        except Exception as exc:
            err = describe_error(exc)
    plans = group.gather((comm.rank, plan), root=0)
    reply: tuple[hdf5.FileSkeleton | None, str | None] = (None, None)
    if group.rank == 0:
        assert plans is not None
        if all(p is not None for _, p in plans):
            try:
                members = [(r, p.specs, p.values) for r, p in plans if p is not None]
                created = storage.retry_io(
                    lambda: hdf5.create_skeleton(
                        path, step=step, layout_kind=topo.kind, ranks=members
                    ),
                    what=f"creating {path}",
                    cleanup=lambda: path.unlink(missing_ok=True),
                )
                reply = (created, None)
            except Exception as exc:
                reply = (None, describe_error(exc))
        else:
            reply = (None, "another rank of this file failed")
    skeleton, leader_err = group.bcast(reply, root=0)
    if err is None and skeleton is None:
        err = leader_err if group.rank == 0 else f"file leader failed: {leader_err}"

    # Phase 2 (local): every rank writes its own bytes at its offsets and fsyncs.
    entry: RankEntry | None = None
    if err is None and skeleton is not None and plan is not None:
        try:
            offsets = skeleton.offsets[comm.rank]
            items = [(o, data.arrays[k]) for k, o in offsets.items() if o is not None]
            storage.retry_io(lambda: hdf5.write_arrays(path, items), what=f"writing {path}")
            entry = RankEntry(
                file=topo.file_name,
                datasets=tuple(
                    DatasetEntry(
                        s.name,
                        s.shape,
                        s.dtype,
                        offsets[s.name],
                        data.arrays[s.name].nbytes,
                        plan.digests[s.name],
                    )
                    for s in plan.specs
                ),
                values=plan.values,
            )
        except Exception as exc:
            err = describe_error(exc)

    # Phase 3 (all): the coordinator checks everyone, writes manifest + marker, renames.
    file_info = None
    if group.rank == 0 and skeleton is not None:
        file_info = (
            topo.file_name,
            skeleton.size,
            skeleton.meta_segments,
            topo.groups[topo.group_index],
        )
    results = comm.gather((entry, file_info, err), root=0)
    outcome: BaseException | None = None
    manifest: Manifest | None = None
    if comm.rank == 0:
        assert results is not None
        failures = {r: e for r, (_, _, e) in enumerate(results) if e is not None}
        if failures:
            outcome = CollectiveError(what, failures)
        else:
            try:
                manifest = _build_manifest(
                    topo,
                    results,
                    step=step,
                    kind=kind,
                    static=static,
                    metrics=metrics or {},
                    library_version=library_version,
                )
                _commit(tmp, final, manifest)
            except Exception as exc:
                outcome = CommitError(f"{what}: commit failed: {describe_error(exc)}")
        if outcome is not None:
            _discard(tmp)
    _bcast_outcome(comm, outcome)
    if comm.rank != 0:
        manifest = _placeholder_manifest(topo, step, kind)
    assert manifest is not None
    return manifest


def _placeholder_manifest(topo: Topology, step: int, kind: str) -> Manifest:
    # Non-coordinating ranks do not need the full manifest after a save.
    return Manifest(
        step=step, time=time.time(), layout=topo.layout_info, files=(), ranks=(), kind=kind
    )


def _build_manifest(
    topo: Topology,
    results: list[Any],
    *,
    step: int,
    kind: str,
    static: str | None,
    metrics: Mapping[str, Any],
    library_version: str,
) -> Manifest:
    from resilient.manifest import Segment

    ranks = tuple(r[0] for r in results)
    files = []
    for _, info, _ in results:
        if info is None:
            continue
        name, size, meta, members = info
        segs = [(s.offset, s.length, s.checksum) for s in meta]
        for r in members:
            for d in ranks[r].datasets:
                if d.offset is not None and d.nbytes:
                    segs.append((d.offset, d.nbytes, d.checksum))
        segs.sort()
        files.append(
            FileEntry(
                name=name,
                size=size,
                checksum=digest_text(combine_checksums(segs)),
                ranks=tuple(members),
                meta_segments=tuple(Segment(s.offset, s.length, s.checksum) for s in meta),
            )
        )
    return Manifest(
        step=step,
        time=time.time(),
        layout=topo.layout_info,
        files=tuple(files),
        ranks=ranks,
        kind=kind,
        static=static,
        metrics=dict(metrics),
        library_version=library_version,
    )


def _commit(tmp: Path, final: Path, manifest: Manifest) -> None:
    text = manifest.to_json().encode()
    marker = marker_text(manifest.step, digest_bytes(text)).encode()
    for name, content in ((layout.MANIFEST, text), (layout.COMMITTED, marker)):
        target = tmp / name
        storage.retry_io(
            lambda t=target, c=content: storage.write_durable(t, c),  # type: ignore[misc]
            what=f"writing {target}",
            cleanup=lambda t=target: t.unlink(missing_ok=True),  # type: ignore[misc]
        )
    storage.retry_io(lambda: storage.commit_dir(tmp, final), what=f"committing {final}")


def _discard(tmp: Path) -> None:
    try:
        if tmp.exists():
            storage.remove_tree(tmp)
    except OSError as exc:  # leftover tmp dirs are cleaned at the next start
        log.warning("could not remove %s: %s", tmp, exc)


def read_rank(directory: Path, manifest: Manifest, rank: int) -> dict[str, Any]:
    """Read one rank's arrays and values from a checkpoint, verifying each array's checksum.

    Raises:
        InvalidCheckpointError: a checksum mismatch or a truncated file.
        OSError: the file cannot be read (transient errors are retried first).
    """
    return storage.retry_io(
        lambda: _read_rank(directory, manifest, rank), what=f"reading {directory} for rank {rank}"
    )


def _read_rank(directory: Path, manifest: Manifest, rank: int) -> dict[str, Any]:
    import numpy as np

    from resilient.errors import InvalidCheckpointError

    entry = manifest.ranks[rank]
    out: dict[str, Any] = dict(entry.values)
    fd = os.open(directory / entry.file, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        for d in entry.datasets:
            arr = np.empty(d.shape, dtype=np.dtype(d.dtype))
            if d.offset is not None and d.nbytes:
                try:
                    hdf5.read_into(fd, d.offset, arr)
                except EOFError as exc:
                    raise InvalidCheckpointError(
                        str(directory), f"{entry.file} truncated: {exc}"
                    ) from None
            if digest_array(arr) != d.checksum:
                raise InvalidCheckpointError(
                    str(directory),
                    f"checksum mismatch: rank {rank} dataset {d.name!r} in {entry.file}",
                )
            out[d.name] = arr
    finally:
        os.close(fd)
    return out
