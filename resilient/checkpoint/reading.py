"""One rank's read of a checkpoint: its arrays read back, each checked against its checksum, and its
state rebuilt (the read side of :mod:`resilient.checkpoint.saveset`). Local: no communication; the
restorer (:mod:`resilient.checkpoint.restorer`) decides what to read and agrees with the other ranks.

A read of a few MiB or more checksums each piece on the caller's checksum thread while the next
piece is read, and faults the pages of new arrays in a piece ahead of the read. Device tensors
(CUDA, with a device staging) are read into the staging's pinned arena, and each is copied to its
device, on the same thread right after its checksum matched, while the next ones are read.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient.errors import ConfigError, InvalidCheckpointError
from resilient.io import fileio, storage
from resilient.io.devicecopy import DeviceStaging, Upload
from resilient.io.digests import Digests
from resilient.io.staging import allocate, fault_in
from resilient.model import torchlazy
from resilient.model.arrays import (
    device_exists,
    fill_leaf,
    leaf_meta,
    numpy_dtype,
    restore_leaf,
    template_spec,
    writable_view,
)
from resilient.model.checksum import digest_arrays
from resilient.model.manifest import DatasetTable, Manifest, RankEntry
from resilient.model.tree import Memo, leaf_metas, unflatten

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass

__all__ = ["Opener", "check_template", "log_absent", "read_rank"]


Opener = Callable[[str], fileio.RangeReader]
"""Opens a data file of one committed copy of a step by name (a target's
``functools.partial(target.open_reader, step)``, or :meth:`~resilient.io.targets.SetRef.opener`)."""


def read_rank(
    files: Opener,
    where: str,
    manifest: Manifest,
    rank: int,
    *,
    into: Mapping[str, Any] | None = None,
    memo: Memo | None = None,
    digester: Executor | None = None,
    device: DeviceStaging | None = None,
    absent: set[str] | None = None,
) -> dict[str, Any]:
    """Read one rank's state from a checkpoint, verifying each array's checksum, and rebuild its
    structure (torch tensors where tensors were saved). The data file is read through
    ``files`` (``where``: the copy's place, for messages).

    What a failed read leaves in ``into``: arrays read into in place (numpy arrays, CPU
    tensors) may hold any part of the checkpoint's bytes; device tensors may hold the verified
    bytes of the datasets uploaded before the failure (never a dataset that failed its
    checksum, nor one after it). The restorer then quarantines the checkpoint and reads the
    next older one into the same targets, which overwrites every leaf that one holds.

    Args:
        into: existing arrays or tensors by leaf path (see :func:`check_template`) that array
            leaves are read into instead of new ones; they appear in the result as themselves.
        memo: the caller's :class:`~resilient.model.tree.Memo` for rebuilding the structure.
        digester: the caller's checksum thread (see :class:`~resilient.io.digests.Digests`;
            ``None``: one for this read).
        device: the owner's device staging: the tensors it wants are read into its (pinned)
            arena, and each is copied to its device once verified, while the next are read
            (one synchronisation at the end). Those are the ``into`` tensors it wants (CUDA
            tensors), and the leaves without a target saved on a device that exists here and
            that it copies: new tensors on that device (no pageable host copy).
        absent: devices that tensors were saved on and that do not exist here are added to it
            (those tensors come back on the CPU); ``None``: this read logs them, one line.

    Raises:
        InvalidCheckpointError: a checksum mismatch or a truncated file.
        OSError: the file cannot be read (transient errors are retried first).
    """
    missing: set[str] = set() if absent is None else absent
    state = storage.retry_io(
        lambda: _read_rank(
            files, where, manifest, rank, into or {}, memo, digester, device, missing
        ),
        what=f"reading {where} for rank {rank}",
    )
    if absent is None and missing:
        log_absent(where, missing)
    return state


def log_absent(where: str | Path, devices: set[str]) -> None:
    """Say, in one line, that tensors of ``where`` (a copy of a step) saved on ``devices`` came
    back on the CPU."""
    log.warning("%s: tensors saved on %s are restored on the CPU (no such device here)",
                where, ", ".join(sorted(devices)))  # fmt: skip


def check_template(entry: RankEntry, into: Mapping[str, Any], *, what: str) -> None:
    """Check that the arrays of ``into`` that the checkpoint holds have its shapes and dtypes.

    Raises:
        ConfigError: naming the first leaf that does not fit, or that is read-only.
    """
    metas = leaf_metas(entry.tree) if entry.tree is not None else {}
    if _fits_plainly(entry.datasets, into, metas):
        return
    for d in entry.datasets:
        target = into.get(d.name)
        if target is None:
            continue
        saved = metas.get(d.name, {}).get("torch")
        here = leaf_meta(target) or {}
        shape, dtype = template_spec(target)
        if shape != d.shape or dtype != d.dtype or saved != here.get("torch"):
            kind = f"torch.{saved}" if saved else d.dtype
            have = f"torch.{here['torch']}" if "torch" in here else dtype
            raise ConfigError(
                f"{what}: {d.name!r} is {have} {shape} here but {kind} {d.shape} in the checkpoint"
            )
        if not _is_writable(target):
            raise ConfigError(f"{what}: {d.name!r} is read-only and cannot be restored in place")


def _fits_plainly(table: DatasetTable, into: Mapping[str, Any], metas: Mapping[str, Any]) -> bool:
    """Whether every template leaf is a writable numpy array of its dataset's shape and dtype,
    saved from numpy (a state dict of numpy arrays: checked without Python per leaf)."""
    import numpy as np

    targets = list(map(into.get, table.names))
    if not _all_present(targets):
        kept = [i for i, t in enumerate(targets) if t is not None]
        if not kept:
            return True
        targets = [targets[i] for i in kept]
        shapes, dtypes = [table.shapes[i] for i in kept], [table.dtypes[i] for i in kept]
    else:
        shapes, dtypes = list(table.shapes), list(table.dtypes)
    # dtypes compared as numpy dtypes (equal exactly when their strings are): a dtype's `.str`
    # builds a new string each time, ~17x slower for thousands of arrays
    kinds = {d: numpy_dtype(d) for d in set(dtypes)}
    return (
        set(map(type, targets)) == {np.ndarray}
        and list(map(_shape, targets)) == shapes
        and list(map(_dtype, targets)) == list(map(kinds.__getitem__, dtypes))
        and all(map(_writeable, targets))
        and not any(map(_TORCH, metas.values()))  # (a state dict saved from torch: not plain)
    )


_dtype = operator.attrgetter("dtype")
_TORCH = operator.methodcaller("get", "torch")
_c_contiguous = operator.attrgetter("flags.c_contiguous")
_writeable = operator.attrgetter("flags.writeable")


def _all_present(values: Sequence[Any]) -> bool:
    """Whether no value is ``None``, at C speed (``None not in values`` would compare arrays
    with ``==``, element by element)."""
    return all(map(operator.is_not, values, itertools.repeat(None)))


def _plain_targets(into: Mapping[str, Any]) -> bool:
    """Whether every target is a writable C-contiguous numpy array (its own writable view)."""
    import numpy as np

    targets = into.values()
    return (
        set(map(type, targets)) <= {np.ndarray}
        and all(map(_writeable, targets))
        and all(map(_c_contiguous, targets))
    )


def _is_writable(target: Any) -> bool:
    flags = getattr(target, "flags", None)
    return flags is None or bool(flags.writeable)


def _read_rank(
    files: Opener,
    where: str,
    manifest: Manifest,
    rank: int,
    into: Mapping[str, Any],
    memo: Memo | None,
    digester: Executor | None,
    device: DeviceStaging | None,
    absent: set[str],
) -> dict[str, Any]:
    entry = manifest.ranks[rank]
    table = entry.datasets
    names, count = table.names, len(table)
    # what is read into: the caller's arrays, and new tensors on the saved devices
    made = {} if device is None else _device_targets(entry, into, device)
    targets = {**into, **made} if made else into
    # the targets to read into directly (a template leaf without one, e.g. a CUDA tensor
    # without a device staging, gets a new array, copied into it once verified; a CUDA
    # tensor, with a device staging, gets its buffer in the pinned arena, copied to the device
    # once verified)
    on_device: dict[str, Any] = {}
    if _plain_targets(targets):  # numpy arrays to read into as they are
        views: Mapping[str, Any] = targets
    else:
        own = {name: writable_view(target) for name, target in targets.items()}
        if device is not None:
            on_device = {n: targets[n] for n in names if n in targets and device.wants(targets[n])}
            own.update(device.bounce(on_device) if on_device else {})
        views = own
    direct = list(map(views.get, names)) if targets else [None] * count
    fresh_at: Sequence[int]
    if not targets:
        fresh_at = range(count)
    elif _all_present(direct):
        fresh_at = ()
    else:
        fresh_at = [i for i, view in enumerate(direct) if view is None]
    offsets: Sequence[int | None] = table.offsets
    shapes: Sequence[tuple[int, ...]] = table.shapes
    dtypes: Sequence[str] = table.dtypes
    sizes: Sequence[int] = table.nbytes
    if len(fresh_at) != count:
        offsets, shapes, dtypes, sizes = (
            [offsets[i] for i in fresh_at],
            [shapes[i] for i in fresh_at],
            [dtypes[i] for i in fresh_at],
            [sizes[i] for i in fresh_at],
        )
    nbytes = sum(table.nbytes)
    # from a few MiB on, checksums are taken on a helper thread while the next bytes are read;
    # not for arrays of a few KiB, whose hashing costs less than the threads' handovers
    pipelined = nbytes >= _PIPELINE_MIN and nbytes >= _PIPELINE_MEAN * count
    digests = Digests(count, helper=digester) if pipelined else None
    upload = None if device is None or not on_device else device.upload(on_device)
    try:
        arrays = _read_verified(
            files, where, entry, rank, direct, fresh_at, offsets, shapes, dtypes, sizes, digests,
            upload,
        )  # fmt: skip
    finally:
        if upload is not None:  # (after an error too: the arena may be written again only then)
            upload.finish()
    by_name = dict(zip(names, arrays, strict=True))
    if views is not targets:  # (plain numpy targets were read into as they are: nothing to do)
        for name, template in targets.items():
            if name not in by_name:
                continue
            if views[name] is None:  # a template leaf that could not be read into directly
                fill_leaf(template, by_name[name])
            by_name[name] = template
    if entry.tree is None:  # written before nested states: flat names, values beside them
        return {**entry.values, **by_name}
    built = unflatten(
        entry.tree,
        lambda path, meta: (
            by_name[path] if path in targets else restore_leaf(by_name[path], meta, absent=absent)
        ),
        lambda paths: map(by_name.__getitem__, paths),  # numpy leaves: as read
        memo=memo,
    )
    assert isinstance(built, dict)
    return built


def _read_verified(
    files: Opener,
    where: str,
    entry: RankEntry,
    rank: int,
    direct: list[Any],
    fresh_at: Sequence[int],
    offsets: Sequence[int | None],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[str],
    sizes: Sequence[int],
    digests: Digests | None,
    upload: Upload | None,
) -> list[Any]:
    """The arrays of ``entry``'s datasets, read (into ``direct`` where it holds a view, else
    into new arrays) and verified; ``upload``'s copies started, each right after its dataset's
    checksum matched where ``digests`` takes them as the read goes, else all once every
    checksum matched.

    Raises:
        InvalidCheckpointError: a checksum mismatch or a truncated file.
    """
    table = entry.datasets
    names, count = table.names, len(table)
    numpy_dtypes = {d: numpy_dtype(d) for d in set(dtypes)}
    checks = None
    if upload is not None and digests is not None:
        pending = set(upload.pending)
        on = {i: n for i, n in enumerate(names) if n in pending}
        checks = _Checks(digests, upload, on, table.checksums)
    reader = files(entry.file)
    try:
        new = fileio.read_new(
            reader,
            offsets,
            shapes,
            list(map(numpy_dtypes.__getitem__, dtypes)),
            allocate=allocate,
            arrived=None if digests is None else _Told(digests, fresh_at, checks),
            nbytes=sizes,
        )
        if len(new) == count:
            arrays = new
        else:
            at: Sequence[int]
            if not fresh_at and None not in table.offsets:  # all read into the caller's
                at, items = range(count), list(zip(table.offsets, direct, strict=True))
            else:
                at = [
                    i
                    for i, view in enumerate(direct)
                    if view is not None and table.offsets[i] is not None
                ]
                items = [(table.offsets[i], direct[i]) for i in at]
            fileio.read_many(
                reader,
                items,  # type: ignore[arg-type]
                arrived=None if digests is None else _Told(digests, at, checks),
            )
            if fresh_at:
                made = iter(new)
                arrays = [next(made) if v is None else v for v in direct]
            else:
                arrays = direct  # (no None among them)
    except EOFError as exc:
        raise InvalidCheckpointError(where, f"{entry.file} truncated: {exc}") from None
    finally:
        reader.close()
        got = None if digests is None else digests.result()  # no thread reads them after this
    if got is None:
        got = digest_arrays(arrays)
    else:  # empty arrays are never read: their checksums are taken here
        for i in (i for i, d in enumerate(got) if not d):
            got[i] = digest_arrays([arrays[i]])[0]
    if "".join(got) != table.digests:
        bad = next(n for n, g, w in zip(names, got, table.checksums, strict=True) if g != w)
        raise InvalidCheckpointError(
            where, f"checksum mismatch: rank {rank} dataset {bad!r} in {entry.file}"
        )
    if upload is not None:  # what was not copied as it was read (small reads, empty tensors)
        upload.put(upload.pending)
    return arrays


def _device_targets(
    entry: RankEntry, into: Mapping[str, Any], device: DeviceStaging
) -> dict[str, Any]:
    """New tensors, by path, for the leaves without a target that were saved from a tensor on
    a device that exists here and that ``device`` copies: read through its arena, one device
    allocation each."""
    if entry.tree is None or torchlazy.loaded() is None:
        return {}
    made = {}
    at = {name: i for i, name in enumerate(entry.datasets.names)}
    for path, meta in leaf_metas(entry.tree).items():
        saved_on, torch_dtype = meta.get("device"), meta.get("torch")
        if not isinstance(saved_on, str) or not isinstance(torch_dtype, str) or path in into:
            continue
        if path not in at or not device_exists(saved_on):
            continue
        target = device.new_target(entry.datasets.shapes[at[path]], torch_dtype, saved_on)
        if target is not None:  # (else a device the engine does not copy: restore_leaf's)
            made[path] = target
    return made


_PIPELINE_MIN = 4 << 20
_PIPELINE_MEAN = 16 << 10  # measured: 4,000 x 4 KiB lost 0.6 ms, 1,000 x 64 KiB won 1.8 ms


@dataclass(frozen=True, slots=True)
class _Told:
    """Hands what a read completed (positions in its request) to ``digests`` by dataset, and
    faults new memory in on their helper thread."""

    digests: Digests
    positions: Sequence[int]
    checks: _Checks | None = None

    def arrays(self, got: Sequence[int], arrays: Sequence[Any]) -> None:
        positions = [self.positions[k] for k in got]
        self.digests.add(positions, arrays)
        if self.checks is not None:
            self.checks.taken(positions)

    def piece(self, position: int, data: memoryview, last: bool) -> None:
        self.digests.add_piece(self.positions[position], data, last)
        if last and self.checks is not None:
            self.checks.taken([self.positions[position]])

    def fault(self, data: memoryview) -> Callable[[], object]:
        return self.digests.alongside(functools.partial(fault_in, data)).result


@dataclass(frozen=True, slots=True)
class _Checks:
    """Starts the copy of each device dataset (at positions ``on``) to its device right after
    its checksum, on the checksum thread, once it matched; at the first that does not, stops
    the copies (the read raises when it ends)."""

    digests: Digests
    upload: Upload
    on: Mapping[int, str]  # position -> name of the datasets with a device target
    want: Sequence[str]

    def taken(self, positions: Sequence[int]) -> None:
        """The digests at ``positions`` are being taken (on the checksum thread)."""
        mine = [p for p in positions if p in self.on]
        if mine:
            self.digests.alongside(functools.partial(self._check, mine))

    def _check(self, positions: list[int]) -> None:
        for position, got in zip(positions, self.digests.taken(positions), strict=True):
            if got != self.want[position]:
                self.upload.stop()
                return
            self.upload.put([self.on[position]])


_shape = operator.attrgetter("shape")
