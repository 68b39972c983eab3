"""``resilient export``: a checkpoint's Block leaves as global arrays in one HDF5 file.

Every :class:`~resilient.model.blocks.Block` leaf of a checkpoint (and of its static data) becomes one
dataset of its global shape, at the leaf's path (``u``, ``model/layer1.weight``). By default it is
an HDF5 *virtual dataset* over the stored blocks in the checkpoint's data files: nothing is
copied, and the sources are named by absolute path, so the exported file may live anywhere but
reads only while the checkpoint exists (rotation deletes it). ``copy=True`` writes the data
itself, block by block (one stored block in memory at a time), verifying every block's and
stripe's checksum on the way: a self-contained file.

Array leaves inside :class:`~resilient.model.blocks.Replicated` values are written once, from saved
rank 0, as plain datasets (verified). Undeclared per-rank arrays (neither a Block nor inside a
Replicated value) have no global shape: they are skipped with a note; JSON values stay in the
checkpoint's ``manifest.json``. Attributes: the file's ``step`` and ``checkpoint`` (its path);
each global dataset's ``global_shape``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient._renamed import renamed_keyword
from resilient.checkpoint.elasticread import ReadStats, StoredBlock, read_stored_block
from resilient.errors import CheckpointNotFoundError, InvalidCheckpointError, StaticDataError
from resilient.io import fileio
from resilient.io.checkpoints import (
    latest_valid,
    resolve_static,
    statics_of,
    validate_checkpoint,
)
from resilient.io.manifests import SetFiles, load_entries, load_manifest
from resilient.io.targets import DirectoryTarget
from resilient.model import filenames
from resilient.model.checksum import digest_array
from resilient.model.filenames import rank_group_name
from resilient.model.manifest import Manifest, ManifestError
from resilient.model.tiling import block_of
from resilient.model.tree import elastic_kinds, leaf_paths

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["ExportResult", "export"]


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        step: the checkpoint's step.
        path: the exported file.
        datasets: the global datasets (leaf paths) and the replicated ones.
        skipped: notes on what was left out, one line each.
        stats: what was read (with ``copy``).
    """

    step: int
    path: Path
    datasets: tuple[str, ...]
    skipped: tuple[str, ...]
    stats: ReadStats = field(default_factory=ReadStats)


@dataclass(frozen=True, slots=True)
class VirtualSource:
    """One stored block as a source of a virtual dataset: its file, the dataset in it, its shape
    and where it starts in the global array."""

    file: Path
    dataset: str
    shape: tuple[int, ...]
    start: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GlobalDataset:
    """One dataset of an exported file (:mod:`resilient.export`).

    Attributes:
        name: its path in the file (groups are created as needed).
        shape: its shape.
        dtype: its dtype string.
        sources: for a virtual dataset, the stored blocks it maps (no data is copied).
        pieces: otherwise, yields ``(start, array)`` pieces that together fill it.
        attrs: its attributes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[VirtualSource, ...] | None = None
    pieces: Callable[[], Iterator[tuple[tuple[int, ...], npt.NDArray[Any]]]] | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)


def write_global_file(
    path: Path, datasets: Sequence[GlobalDataset], *, attrs: Mapping[str, Any]
) -> None:
    """Write ``path`` (through a temporary file and a rename) holding ``datasets``: virtual
    datasets over the checkpoint's files, or real data written piece by piece."""
    import h5py
    import numpy as np

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w", libver=("v110", "latest")) as f:
            for key, value in attrs.items():
                f.attrs[key] = value
            for d in datasets:
                dtype = np.dtype(d.dtype)
                size: int = math.prod(d.shape)
                if d.sources is not None and size:
                    layout = h5py.VirtualLayout(shape=d.shape, dtype=dtype)
                    for s in d.sources:
                        if math.prod(s.shape):
                            index = tuple(
                                slice(a, a + n) for a, n in zip(s.start, s.shape, strict=True)
                            )
                            layout[index] = h5py.VirtualSource(
                                os.fspath(s.file), s.dataset, shape=s.shape, dtype=dtype
                            )
                    dset = f.create_virtual_dataset(d.name, layout)
                else:
                    dset = f.create_dataset(d.name, shape=d.shape, dtype=dtype)
                    for start, arr in d.pieces() if d.pieces is not None else ():
                        if arr.size:
                            dset[
                                tuple(
                                    slice(a, a + n) for a, n in zip(start, arr.shape, strict=True)
                                )
                            ] = arr
                for key, value in d.attrs.items():
                    dset.attrs[key] = value
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@renamed_keyword("root", "checkpoint_dir")
def export(
    checkpoint_dir: Path, out: Path, *, step: int | None = None, copy: bool = False
) -> ExportResult:
    """Write the Block leaves of a checkpoint of ``checkpoint_dir`` as global arrays to ``out``.

    Args:
        checkpoint_dir: the checkpoint directory (``root`` is its deprecated alias).
        out: the HDF5 file to write (replaced atomically).
        step: the checkpoint's step (default: the newest valid one).
        copy: write the data (verified) instead of virtual datasets.

    Raises:
        CheckpointNotFoundError: no valid checkpoint (of ``step``).
        InvalidCheckpointError: the checkpoint fails validation, or (with ``copy``) a checksum.
    """
    if step is None:
        record = latest_valid(checkpoint_dir)
        if record is None or record.manifest is None:
            raise CheckpointNotFoundError(f"no valid checkpoint in {checkpoint_dir}")
        path, manifest = record.path, record.manifest
    else:
        path = checkpoint_dir / filenames.step_dir_name(step)
        if not path.exists():
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {checkpoint_dir}")
        manifest = validate_checkpoint(path)
    sets = [(path, manifest)]
    if manifest.static is not None:  # its first intact copy (read only: nothing repaired)
        statics = statics_of(DirectoryTarget(checkpoint_dir))
        source = resolve_static(statics, manifest.static)
        if not source.dirs:
            raise StaticDataError(
                statics.where(source.meta),
                f"no whole copy: {'; '.join(w for _, w in source.damaged)}",
            )
        static_dir = Path(statics.where(source.dirs[0]))
        sets.append((static_dir, load_manifest(static_dir, kind="static")))
    stats = ReadStats()
    datasets: list[GlobalDataset] = []
    skipped: list[str] = []
    for directory, m in sets:
        try:
            m = load_entries(SetFiles.in_directory(directory), m)  # every rank's entry
        except ManifestError as exc:
            raise InvalidCheckpointError(str(directory), f"bad manifest: {exc}") from None
        datasets += _datasets(directory.resolve(), m, copy=copy, stats=stats, skipped=skipped)
    write_global_file(
        out, datasets, attrs={"step": manifest.step, "checkpoint": str(path.resolve())}
    )
    return ExportResult(manifest.step, out, tuple(d.name for d in datasets), tuple(skipped), stats)


def _datasets(
    directory: Path, manifest: Manifest, *, copy: bool, stats: ReadStats, skipped: list[str]
) -> list[GlobalDataset]:
    first = manifest.ranks[0]
    if first.tree is None:
        skipped.append(f"{directory.name}: written before nested states (no declared blocks)")
        return []
    kinds = [elastic_kinds(r.tree) if r.tree is not None else None for r in manifest.ranks]
    mine = kinds[0]
    assert mine is not None
    out: list[GlobalDataset] = []
    for path in mine.blocks:
        if not all(k is not None and path in k.blocks for k in kinds):
            skipped.append(f"{path}: a Block on some ranks only")
            continue
        stored = []
        for r, entry in enumerate(manifest.ranks):
            d = next(d for d in entry.datasets if d.name == path)
            stored.append(StoredBlock(r, entry.file, d, block_of(leaf_paths(entry.tree)[path], d)))
        spec = stored[0].spec
        dtype = stored[0].dataset.dtype
        attrs = {"global_shape": list(spec.global_shape)}
        if copy:
            out.append(GlobalDataset(path, spec.global_shape, dtype, attrs=attrs,
                                          pieces=_pieces(directory, stored, stats)))  # fmt: skip
        else:
            sources = tuple(
                VirtualSource(
                    directory / sb.file,
                    f"/{rank_group_name(sb.rank)}/{path}",
                    sb.spec.shape,
                    sb.spec.start,
                )
                for sb in stored
            )
            out.append(GlobalDataset(path, spec.global_shape, dtype, sources=sources,
                                          attrs=attrs))  # fmt: skip
    by_name = {d.name: d for d in first.datasets}
    for path in sorted(mine.replicated):
        d = by_name[path]
        out.append(GlobalDataset(path, d.shape, d.dtype, attrs={"replicated": True},
                                      pieces=_replicated(directory, first.file, d, stats)))  # fmt: skip
    skipped += [f"{p}: per-rank data (neither a Block nor Replicated)" for p in mine.blocking
                if p in by_name]  # fmt: skip
    return out


def _pieces(
    directory: Path, stored: list[StoredBlock], stats: ReadStats
) -> Callable[[], Iterator[tuple[tuple[int, ...], npt.NDArray[Any]]]]:
    def pieces() -> Iterator[tuple[tuple[int, ...], npt.NDArray[Any]]]:
        for sb in stored:
            if math.prod(sb.spec.shape):
                yield sb.spec.start, read_stored_block(directory, sb, stats=stats)

    return pieces


def _replicated(
    directory: Path, file: str, d: Any, stats: ReadStats
) -> Callable[[], Iterator[tuple[tuple[int, ...], npt.NDArray[Any]]]]:
    def pieces() -> Iterator[tuple[tuple[int, ...], npt.NDArray[Any]]]:
        import numpy as np

        arr: npt.NDArray[np.generic] = np.empty(d.shape, dtype=np.dtype(d.dtype))
        if d.offset is not None and d.nbytes:
            reader = fileio.FileReader(directory / file)
            try:
                fileio.read_many(reader, [(d.offset, arr)])
            except EOFError as exc:
                raise InvalidCheckpointError(str(directory), f"{file} truncated: {exc}") from None
            finally:
                reader.close()
            stats.bytes_read += d.nbytes
        if digest_array(arr) != d.checksum:
            raise InvalidCheckpointError(
                str(directory), f"checksum mismatch: rank 0 dataset {d.name!r} in {file}"
            )
        yield (0,) * arr.ndim, arr

    return pieces
