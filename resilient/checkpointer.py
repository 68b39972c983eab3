"""One save or one read of a set of per-rank arrays: plan -> write -> commit. Collective.

Used by :class:`resilient.manager.CheckpointManager` for checkpoints and by
:class:`resilient.statics.StaticStore` for static data. Call order of :func:`save_set` (DCP's
``_save_state_dict``: plan, write, finish)::

    every rank      RankPlan.of(data)                 names, shapes, dtypes, checksums, values
    file group      leader: hdf5.create_skeleton()    file with early-allocated datasets; offsets
    every rank      hdf5.write_arrays()               its bytes at its offsets, then fsync
    coordinator     build_manifest(); pending.commit()  manifest, COMMITTED, rename

Every phase goes through :class:`~resilient.collective.Collective`, so a failure anywhere becomes
the same exception on every rank, never a hang, and the temporary directory is rolled back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient import hdf5, storage
from resilient.checksum import digest_array, digest_text
from resilient.collective import Collective
from resilient.commit import PendingDir
from resilient.errors import InvalidCheckpointError
from resilient.manifest import (
    DatasetEntry,
    FileEntry,
    Manifest,
    RankEntry,
    Segment,
    combine_checksums,
    file_segments,
)
from resilient.payload import LocalData
from resilient.topology import Topology

__all__ = ["FileWritten", "RankPlan", "RankWritten", "build_manifest", "read_rank", "save_set"]


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank will write: its arrays' specs and checksums, and its JSON values."""

    rank: int
    specs: tuple[hdf5.ArraySpec, ...]
    digests: Mapping[str, str]
    values: Mapping[str, Any]

    @classmethod
    def of(cls, rank: int, data: LocalData) -> RankPlan:
        """Plan ``data`` of ``rank`` (checksums every array; no I/O)."""
        return cls(
            rank=rank,
            specs=tuple(
                hdf5.ArraySpec(k, tuple(a.shape), a.dtype.str) for k, a in data.arrays.items()
            ),
            digests={k: digest_array(a) for k, a in data.arrays.items()},
            values=dict(data.values),
        )

    def entry(self, file: str, offsets: Mapping[str, int | None], data: LocalData) -> RankEntry:
        """This rank's manifest entry once its arrays sit at ``offsets`` in ``file``."""
        return RankEntry(
            file=file,
            datasets=tuple(
                DatasetEntry(
                    s.name,
                    s.shape,
                    s.dtype,
                    offsets[s.name],
                    data.arrays[s.name].nbytes,
                    self.digests[s.name],
                )
                for s in self.specs
            ),
            values=self.values,
        )


@dataclass(frozen=True, slots=True)
class FileWritten:
    """A data file as its group leader created it: name, size, HDF5's own bytes, its ranks."""

    name: str
    size: int
    meta_segments: tuple[Segment, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankWritten:
    """What one rank reports after writing: its manifest entry; the file, from its leader."""

    entry: RankEntry
    file: FileWritten | None


def save_set(
    topo: Topology,
    pending: PendingDir,
    *,
    step: int,
    data: LocalData,
    kind: str = "checkpoint",
    static: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    library_version: str = "",
) -> Manifest:
    """Collective over ``topo.comm``: call on all ranks. Write ``data`` of every rank into
    ``pending`` and commit it.

    The coordinator has already created ``pending``. On any failure every rank raises the same
    error and ``pending`` is rolled back; everything else is untouched.

    Returns:
        The committed manifest, on every rank.
    """
    what = f"save of {kind} step {step}"
    path = pending.path / topo.file_name

    def write() -> RankWritten:
        plan = RankPlan.of(topo.comm.rank, data)
        skeleton = Collective(topo.group).all_reduce(
            f"creating {topo.file_name}",
            lambda: plan,
            lambda plans: _create_file(path, step, topo.kind, plans),
        )
        offsets = skeleton.offsets[topo.comm.rank]
        items = [(o, data.arrays[k]) for k, o in offsets.items() if o is not None]
        storage.retry_io(lambda: hdf5.write_arrays(path, items), what=f"writing {path}")
        file = None
        if topo.group.rank == 0:
            file = FileWritten(topo.file_name, skeleton.size, skeleton.meta_segments, topo.members)
        return RankWritten(plan.entry(topo.file_name, offsets, data), file)

    def commit(written: list[RankWritten]) -> Manifest:
        manifest = build_manifest(
            topo, written, step=step, kind=kind, static=static, metrics=metrics or {},
            library_version=library_version,
        )  # fmt: skip
        pending.commit(manifest, what=what)
        return manifest

    coll = Collective(topo.comm)
    try:
        return coll.all_reduce(what, write, commit)
    except Exception:
        if coll.is_coordinator:
            pending.rollback()
        raise


def _create_file(
    path: Path, step: int, kind: str, plans: Sequence[RankPlan]
) -> hdf5.FileSkeleton:
    members = [(p.rank, p.specs, p.values) for p in plans]
    return storage.retry_io(
        lambda: hdf5.create_skeleton(path, step=step, layout_kind=kind, ranks=members),
        what=f"creating {path}",
        cleanup=lambda: path.unlink(missing_ok=True),
    )


def build_manifest(
    topo: Topology,
    written: Sequence[RankWritten],
    *,
    step: int,
    kind: str,
    static: str | None,
    metrics: Mapping[str, Any],
    library_version: str,
) -> Manifest:
    """The manifest of a written set; each file's checksum over its segments' checksums."""
    draft = Manifest(
        step=step,
        time=time.time(),
        layout=topo.layout_info,
        files=tuple(
            FileEntry(w.file.name, w.file.size, "", w.file.ranks, tuple(w.file.meta_segments))
            for w in written
            if w.file is not None
        ),
        ranks=tuple(w.entry for w in written),
        kind=kind,
        static=static,
        metrics=dict(metrics),
        library_version=library_version,
    )
    files = tuple(
        FileEntry(
            f.name,
            f.size,
            digest_text(combine_checksums([(o, n, c) for o, n, c, _ in file_segments(draft, f)])),
            f.ranks,
            f.meta_segments,
        )
        for f in draft.files
    )
    return Manifest(
        step=draft.step, time=draft.time, layout=draft.layout, files=files, ranks=draft.ranks,
        kind=kind, static=static, metrics=draft.metrics, library_version=library_version,
    )  # fmt: skip


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
