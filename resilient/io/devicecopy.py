"""One copy of a state's device tensors into host memory kept for the next saves: page-locked
(pinned) for CUDA tensors, so that the copy engine moves the bytes at its own speed.

:class:`DeviceStaging` (the :class:`~resilient.model.payload.DeviceCopy` of a manager) keeps one
arena: an anonymous memory map holding a buffer for every device tensor of the state, each
page-aligned from 1 MiB (the writer hands those to ``O_DIRECT`` as they are) and 64-byte aligned
below. It is mapped at the first save, reused by every later save while the structure is the
same (paths, shapes, dtypes), replaced when it changes, and unmapped by :meth:`DeviceStaging.close`.
Its size is the device tensors' bytes plus that alignment: per process, the size of the device
state. The saves write from it: no ``tensor.cpu()`` (pageable, new memory every save) and no
second host copy into the asynchronous staging buffers (:mod:`.staging`).

The copies are a :class:`CopyEngine`'s. :class:`CudaEngine` registers the arena with the CUDA
driver (``cudaHostRegister``) and copies on a stream of its own per device that first waits on
that device's current stream (the copy sees every kernel queued before the save), every copy
issued with ``non_blocking=True``, one synchronisation per device at the end. A restore copies
back through :class:`Upload`: each tensor's copy is issued as soon as its buffer is read and
verified, while the next ones are read, and one synchronisation ends them all.
:class:`HostEngine` takes the same path for CPU tensors, without pinning and with each copy
done when issued: it is what CI runs.

Why a registered map and not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator
rounds each allocation up to a power of two (a 4.1 GiB state would lock 8 GiB) and keeps freed
blocks cached for the whole process, so neither the size nor its release would be ours; a map is
exactly the arena's size, page-aligned for ``O_DIRECT``, and :meth:`DeviceStaging.close` unregisters
and unmaps it. Where the host cannot lock that much memory, the arena stays pageable, with one
logged warning: the same copies, synchronous in effect.

torch is never imported here: a tensor comes from a program that imported it, and the calls into
torch go through :mod:`resilient.model.torchlazy`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from resilient.errors import ConfigError
from resilient.model import torchlazy
from resilient.model.arrays import as_tensor, is_tensor, storable_dtype, template_spec

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "CopyEngine",
    "CudaEngine",
    "DeviceStaging",
    "HostEngine",
    "PinError",
    "Upload",
    "Uploads",
    "default_engine",
]

log = logging.getLogger(__name__)

_PAGE_FROM = 1 << 20  # buffers from this size start on a page (O_DIRECT: fileio.DIRECT_MIN)
_SMALL_ALIGN = 64


class PinError(OSError):
    """The host could not lock (pin) a staging arena's memory."""


class CopyEngine(ABC):
    """How a staging arena is pinned and how tensors are copied to and from its buffers.

    Call order: :meth:`wants` (per leaf of a save or restore target) or :meth:`wants_device`
    (per leaf a restore makes anew) → :meth:`pin` (once per arena) → :meth:`to_host` (per save)
    or :meth:`uploads` (per restore) → :meth:`unpin` (before the arena is unmapped, only if
    :meth:`pin` succeeded).
    """

    @abstractmethod
    def wants(self, value: Any) -> bool:
        """Whether ``value`` is a tensor this engine copies."""

    @abstractmethod
    def wants_device(self, device: str) -> bool:
        """Whether this engine copies tensors on torch device ``device`` (``"cuda:1"``; one
        that exists here)."""

    @abstractmethod
    def pin(self, region: mmap.mmap) -> None:
        """Lock ``region`` in memory for fast transfers.

        Raises:
            PinError: it could not be locked (the arena stays pageable).
        """

    @abstractmethod
    def unpin(self, region: mmap.mmap) -> None:
        """Undo :meth:`pin`."""

    @abstractmethod
    def to_host(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy each ``(tensor, host)`` pair's tensor into its host tensor (a view of the
        arena); every copy is complete when this returns."""

    @abstractmethod
    def uploads(self, devices: Collection[Any]) -> Uploads:
        """The copies of one restore into tensors on ``devices`` (torch devices), which follow
        the work queued so far on the calling thread's current streams."""


class Uploads(ABC):
    """One restore's copies from host buffers into device tensors, issued one by one as each
    buffer is ready, all complete at :meth:`finish`.

    Call order: :meth:`CopyEngine.uploads` (on the restoring thread) → :meth:`copy` (per
    tensor, from one thread at a time: the restoring thread or its checksum thread) →
    :meth:`finish` (once, on the restoring thread, after an error too: the host buffers may be
    written again only then).
    """

    @abstractmethod
    def copy(self, host: Any, target: Any) -> None:
        """Start copying CPU tensor ``host`` into ``target`` (maybe asynchronously: ``host``
        stays unchanged until :meth:`finish`)."""

    @abstractmethod
    def finish(self) -> None:
        """Wait until every copy is complete."""


class HostEngine(CopyEngine):
    """The device copy for CPU tensors: every torch tensor takes the path a CUDA tensor takes,
    minus the pinning and the streams (what CI, without a GPU, runs)."""

    def wants(self, value: Any) -> bool:
        return is_tensor(value)

    def wants_device(self, device: str) -> bool:
        return True

    def pin(self, region: mmap.mmap) -> None:
        """Nothing to pin."""

    def unpin(self, region: mmap.mmap) -> None:
        """Nothing to unpin."""

    def to_host(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        for tensor, host in pairs:
            host.copy_(tensor.detach())

    def uploads(self, devices: Collection[Any]) -> Uploads:
        return _HostUploads()


class _HostUploads(Uploads):
    """Copies done when issued."""

    def copy(self, host: Any, target: Any) -> None:
        target.copy_(host)

    def finish(self) -> None:
        """Every copy is done already."""


class CudaEngine(CopyEngine):
    """The device copy for CUDA tensors: a pinned arena, one stream of its own per device."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    def wants(self, value: Any) -> bool:
        return is_tensor(value) and value.device.type == "cuda"

    def wants_device(self, device: str) -> bool:
        return device.partition(":")[0] == "cuda"

    def pin(self, region: mmap.mmap) -> None:
        torch = torchlazy.load()
        # cudaHostRegisterPortable (1): pinned for every CUDA context, i.e. every device
        err = int(torch.cuda.cudart().cudaHostRegister(_address(region), len(region), 1))
        if err:
            _clear_cuda_error(torch)
            raise PinError(f"cudaHostRegister of {len(region)} bytes failed: cudaError {err}")

    def unpin(self, region: mmap.mmap) -> None:
        torch = torchlazy.load()
        err = int(torch.cuda.cudart().cudaHostUnregister(_address(region)))
        if err:
            _clear_cuda_error(torch)
            log.debug("cudaHostUnregister failed: cudaError %d", err)

    def to_host(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy on each tensor's device's stream, after that device's current stream; one
        synchronisation per device at the end."""
        torch = torchlazy.load()
        by_device: dict[Any, list[tuple[Any, Any]]] = {}
        for tensor, host in pairs:
            by_device.setdefault(tensor.device, []).append((tensor.detach(), host))
        used = []
        for device, group in by_device.items():
            stream = self._stream_after_current(device)
            with torch.cuda.stream(stream):
                for src, dst in group:
                    dst.copy_(src, non_blocking=True)
            used.append(stream)
        for stream in used:
            stream.synchronize()

    def uploads(self, devices: Collection[Any]) -> Uploads:
        return _CudaUploads({device: self._stream_after_current(device) for device in devices})

    def _stream_after_current(self, device: Any) -> Any:
        """This engine's stream for ``device``, made to wait on the calling thread's current
        stream of that device (what is queued there is done before what is queued here)."""
        torch = torchlazy.load()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream


class _CudaUploads(Uploads):
    """Copies issued asynchronously on one stream per device (chosen and ordered by
    :meth:`CudaEngine.uploads`), synchronised once at :meth:`finish`."""

    def __init__(self, streams: Mapping[Any, Any]) -> None:
        self._streams = streams

    def copy(self, host: Any, target: Any) -> None:
        torch = torchlazy.load()
        # (the stream context is per thread: set here, on whichever thread issues the copy)
        with torch.cuda.stream(self._streams[target.device]):
            target.copy_(host, non_blocking=True)

    def finish(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


class _NoDevice(CopyEngine):
    """No device copy (no CUDA here): every tensor goes through ``to_numpy``."""

    def wants(self, value: Any) -> bool:
        return False

    def wants_device(self, device: str) -> bool:
        return False

    def pin(self, region: mmap.mmap) -> None:
        """Nothing to pin."""

    def unpin(self, region: mmap.mmap) -> None:
        """Nothing to unpin."""

    def to_host(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        raise AssertionError("no tensor is wanted")

    def uploads(self, devices: Collection[Any]) -> Uploads:
        raise AssertionError("no tensor is wanted")


def default_engine() -> CopyEngine | None:
    """The engine for this process: :class:`CudaEngine` where CUDA is available, else one that
    copies nothing; ``None`` while torch is not imported (asked again later)."""
    torch = torchlazy.loaded()
    if torch is None:
        return None
    return CudaEngine() if torch.cuda.is_available() else _NoDevice()


Spec = tuple[str, tuple[int, ...], str, str]  # path, shape, stored dtype, torch dtype


class _Arena:
    """One memory map with a buffer per tensor of a structure, as numpy arrays (what the
    writer writes) and as CPU tensors over the same memory (what the copies fill)."""

    def __init__(self, specs: tuple[Spec, ...]) -> None:
        import numpy as np

        self.specs = specs
        offsets, end = [], 0
        for _, shape, dtype, _ in specs:
            size = math.prod(shape) * np.dtype(dtype).itemsize
            end = _round_up(end, mmap.PAGESIZE if size >= _PAGE_FROM else _SMALL_ALIGN)
            offsets.append(end)
            end += size
        self.nbytes = _round_up(max(end, 1), mmap.PAGESIZE)
        self.region = mmap.mmap(
            -1,
            self.nbytes,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0),
        )
        self.arrays: dict[str, npt.NDArray[np.generic]] = {}
        self.host: dict[str, Any] = {}
        for (path, shape, dtype, name), offset in zip(specs, offsets, strict=True):
            arr = np.frombuffer(
                self.region, dtype=dtype, count=math.prod(shape), offset=offset
            ).reshape(shape)
            self.arrays[path] = arr
            self.host[path] = as_tensor(arr, name)
        self.is_pinned = False

    def close(self) -> None:
        """Drop the views and unmap (where nobody else holds a view: else when the last goes)."""
        self.arrays.clear()
        self.host.clear()
        with contextlib.suppress(BufferError):  # a caller still holds a view
            self.region.close()


class DeviceStaging:
    """A state's device tensors copied to one reused host arena (local, no I/O).

    Args:
        engine: the copies (``None``: :func:`default_engine`, chosen at the first save that
            holds a tensor).
    """

    def __init__(self, engine: CopyEngine | None = None) -> None:
        self._engine = engine
        self._arena: _Arena | None = None
        self._unpinned_said = False

    @property
    def engine(self) -> CopyEngine:
        """The copies (chosen once torch is imported)."""
        if self._engine is None:
            self._engine = default_engine()
        return self._engine if self._engine is not None else _NoDevice()

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held (pinned where :attr:`is_pinned`)."""
        return 0 if self._arena is None else self._arena.nbytes

    @property
    def is_pinned(self) -> bool:
        """Whether the arena is page-locked."""
        return self._arena is not None and self._arena.is_pinned

    def wants(self, value: Any) -> bool:
        """Whether ``value`` is a tensor :meth:`stage` copies (a CUDA tensor, with CUDA)."""
        return self.engine.wants(value)

    def new_target(self, shape: tuple[int, ...], torch_dtype: str, device: str) -> Any | None:
        """An uninitialised tensor on ``device`` (one that exists here) for a restore to read
        into through the arena, if the engine copies tensors of that device; else ``None``.
        One device allocation, no host memory besides the arena."""
        if not self.engine.wants_device(device):
            return None
        torch = torchlazy.load()
        return torch.empty(shape, dtype=getattr(torch, torch_dtype), device=device)

    def stage(self, tensors: Mapping[str, Any]) -> dict[str, npt.NDArray[np.generic]]:
        """Copy ``tensors`` (by path) into the arena, reused if their structure is the one of
        the last call, else mapped anew; their stored arrays, by path, valid until the next
        :meth:`stage` or :meth:`close`. Every copy is complete when this returns: the caller
        may change the tensors."""
        arena = self._arena_for(tensors)
        self.engine.to_host([(t, arena.host[p]) for p, t in tensors.items()])
        return {p: arena.arrays[p] for p in tensors}

    def bounce(self, targets: Mapping[str, Any]) -> dict[str, npt.NDArray[np.generic]]:
        """The arena's buffers for ``targets`` (tensors by path), to read a restore into before
        :meth:`upload` (the same arena as a save of the same structure: a restore warms the
        next save's staging up, and the reverse)."""
        arena = self._arena_for(targets)
        return {p: arena.arrays[p] for p in targets}

    def upload(self, targets: Mapping[str, Any]) -> Upload:
        """The copies of the buffers that :meth:`bounce` gave for ``targets`` into them, each
        started by :meth:`Upload.put`; call on the restoring thread (the copies follow the
        work queued on its current streams). No device memory is allocated: each target is
        written on whatever device it lives."""
        arena = self._arena
        assert arena is not None, "bounce() first"
        devices = {t.device for t in targets.values()}
        return Upload({p: (arena.host[p], t) for p, t in targets.items()},
                      self.engine.uploads(devices))  # fmt: skip

    def close(self) -> None:
        """Unpin and unmap the arena (a later :meth:`stage` maps a new one)."""
        arena, self._arena = self._arena, None
        if arena is None:
            return
        if arena.is_pinned:
            self.engine.unpin(arena.region)
        arena.close()

    def _arena_for(self, tensors: Mapping[str, Any]) -> _Arena:
        specs = tuple(_spec(p, t) for p, t in tensors.items())
        if self._arena is not None and self._arena.specs == specs:
            return self._arena
        self.close()
        arena = _Arena(specs)
        try:
            self.engine.pin(arena.region)
            arena.is_pinned = True
        except PinError as exc:
            level = logging.DEBUG if self._unpinned_said else logging.WARNING
            log.log(level, "device tensors are staged in pageable memory (%d bytes could not "
                    "be page-locked; copies are slower): %s", arena.nbytes, exc)  # fmt: skip
            self._unpinned_said = True
        self._arena = arena
        return arena


class Upload:
    """One restore's copies of arena buffers into their target tensors (by path), each started
    as soon as its bytes are read and verified, all complete at :meth:`finish`.

    Call order: :meth:`DeviceStaging.upload` → :meth:`put` (per verified buffer; from one
    thread at a time) and :meth:`stop` (a check failed: no later :meth:`put` copies anything)
    → :meth:`finish` (on the restoring thread, after an error too).
    """

    def __init__(self, pairs: Mapping[str, tuple[Any, Any]], copies: Uploads) -> None:
        self._pending = dict(pairs)  # path -> (arena tensor, target)
        self._copies = copies
        self.is_stopped = False

    @property
    def pending(self) -> list[str]:
        """The paths not copied yet."""
        return list(self._pending)

    def put(self, paths: Iterable[str]) -> None:
        """Start the copies of ``paths`` (verified; ``paths`` copied already are skipped),
        unless :meth:`stop` was called."""
        if self.is_stopped:
            return
        for path in paths:
            pair = self._pending.pop(path, None)
            if pair is not None:
                self._copies.copy(*pair)

    def stop(self) -> None:
        """No later :meth:`put` copies anything (the restore failed a check)."""
        self.is_stopped = True

    def finish(self) -> None:
        """Wait until every copy started is complete."""
        self._copies.finish()


def _spec(path: str, tensor: Any) -> Spec:
    """A tensor's place in the arena.

    Raises:
        ConfigError: a dtype a checkpoint cannot store, naming ``path``.
    """
    try:
        shape, dtype = template_spec(tensor)
    except TypeError:
        dtype = ""
    if not storable_dtype(dtype):
        raise ConfigError(f"state[{path!r}]: torch dtype {tensor.dtype} is not supported")
    return path, shape, dtype, str(tensor.dtype).removeprefix("torch.")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _address(region: mmap.mmap) -> int:
    """The address of a memory map's first byte."""
    view = ctypes.c_char.from_buffer(region)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # (an export alive would keep the map from closing)


def _clear_cuda_error(torch: Any) -> None:
    """Read (and so reset) the CUDA runtime's last error, which a failed ``cudaHostRegister``
    leaves behind and torch's next kernel-launch check would raise as its own; best effort."""
    major = str(getattr(torch.version, "cuda", None) or "").partition(".")[0]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
