"""Array leaves of a state: numpy arrays, torch tensors and other array-likes, as numpy and back.

Which values are arrays, how they become C-contiguous numpy arrays that :mod:`resilient.io.fileio`
writes (without a copy where possible), and what they become again on restore:

* numpy arrays and scalars: as they are (a non-contiguous array is copied);
* torch tensors (CPU; a CUDA tensor is copied to the host, by the caller's
  :class:`~resilient.model.payload.DeviceCopy` where it has one): ``tensor.numpy()`` shares memory.
  Dtypes numpy lacks (``bfloat16``, the float8 types) are stored as unsigned words of the same
  size, their dtype recorded, so a reader without torch still gets the bits. They come back as
  tensors of the saved dtype, on the saved device when it exists here, else on the CPU (the
  caller logs that: :func:`restore_leaf` tells it);
* DTensors (FSDP2, tensor parallelism): this rank's block of the global tensor, or an empty
  block where another rank writes the same replica (:mod:`resilient.model.dtensors`);
* anything else with ``__array__`` (jax arrays) or the buffer protocol (``memoryview``,
  ``bytearray``): ``numpy.asarray``, which shares memory where the object allows it.

torch is never imported by this module: a tensor is recognised through
:func:`~resilient.model.torchlazy.loaded` (a program holding one has imported torch already), and
torch is imported (:func:`~resilient.model.torchlazy.load`) on restore only for a leaf saved from
a tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from resilient.errors import ConfigError
from resilient.model import dtensors, torchlazy
from resilient.model.entries import dtype_itemsize

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "as_tensor",
    "device_exists",
    "fill_leaf",
    "is_tensor",
    "leaf_meta",
    "numpy_dtype",
    "restore_leaf",
    "storable_dtype",
    "template_spec",
    "to_numpy",
    "writable_view",
]

# torch dtypes numpy has no dtype for, stored as unsigned words of their size
_WORDS = {"bfloat16": "<u2", "float8_e4m3fn": "|u1", "float8_e5m2": "|u1",
          "float8_e4m3fnuz": "|u1", "float8_e5m2fnuz": "|u1"}  # fmt: skip


def _torch_tensor_type() -> Any:
    torch = torchlazy.loaded()
    return None if torch is None else getattr(torch, "Tensor", None)


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch)."""
    cls = _torch_tensor_type()
    return cls is not None and isinstance(value, cls)


def leaf_meta(value: Any) -> Mapping[str, Any] | None:
    """The tree metadata of an array leaf (``{}`` for numpy), or ``None`` if ``value`` is not one.

    JSON scalars (``int``, ``float``, ...) are not arrays; numpy scalars are (0-d arrays).
    """
    import numpy as np

    if isinstance(value, (np.ndarray, np.generic)):
        return {}
    if is_tensor(value):
        meta: dict[str, Any] = {"torch": str(value.dtype).removeprefix("torch.")}
        if value.device.type != "cpu":
            meta["device"] = str(value.device)
        if dtensors.is_dtensor(value):  # a Block of its global tensor, as this rank stores it
            piece = dtensors.piece(value, what="DTensor")
            meta["block"] = {"global_shape": list(piece.global_shape),
                             "start": list(piece.stored_start)}  # fmt: skip
            meta["dtensor"] = dict(piece.meta)
        return meta
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return None
    if hasattr(value, "__array__") or isinstance(value, (memoryview, bytearray)):
        return {"array_like": type(value).__name__}
    return None


def to_numpy(value: Any, *, what: str) -> npt.NDArray[np.generic]:
    """The C-contiguous numpy array to write for an array leaf (shares memory where possible).

    Raises:
        ConfigError: a dtype that cannot be stored (objects, strings, ...), naming ``what``.
    """
    import numpy as np

    if type(value) is np.ndarray and value.flags.c_contiguous and storable_dtype(value.dtype.str):
        return value  # the common case, checked in ~1 us
    if dtensors.is_dtensor(value):
        value = dtensors.piece(value, what=what).stored
    if is_tensor(value):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if name in _WORDS:
            torch = torchlazy.load()
            word = torch.int16 if _WORDS[name] == "<u2" else torch.uint8
            arr = tensor.view(word).numpy().view(_WORDS[name])
        else:
            try:
                arr = tensor.numpy()
            except TypeError as exc:
                raise ConfigError(f"{what}: torch dtype {tensor.dtype} is not supported") from exc
    else:
        arr = np.asarray(value)
    out: npt.NDArray[np.generic] = arr
    if not out.flags.c_contiguous:
        out = np.ascontiguousarray(out)
    if not storable_dtype(out.dtype.str):
        raise ConfigError(f"{what}: dtype {out.dtype} is not supported (numeric and bool only)")
    return out


@functools.lru_cache(maxsize=64)  # bounded cache of a pure function of immutable arguments
def numpy_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype of a dtype string (cached: a restore looks up thousands)."""
    import numpy as np

    return np.dtype(dtype)


@functools.lru_cache(maxsize=64)  # bounded cache of a pure function of immutable arguments
def storable_dtype(dtype: str) -> bool:
    """Whether arrays of numpy dtype string ``dtype`` can be stored (numeric and bool)."""
    try:
        dtype_itemsize(dtype)
    except ValueError:
        return False
    return True


def as_tensor(arr: npt.NDArray[np.generic], name: str) -> Any:
    """A CPU tensor of torch dtype ``name`` sharing ``arr``'s memory (``arr`` as stored: the
    unsigned words of a dtype numpy lacks)."""
    torch = torchlazy.load()  # the leaf is (or was, when it was saved) a tensor
    if name in _WORDS:  # stored as unsigned words: view them as a signed int tensor first
        signed = "<i2" if _WORDS[name] == "<u2" else "|u1"
        return torch.from_numpy(arr.view(signed)).view(getattr(torch, name))
    return torch.from_numpy(arr)


def restore_leaf(
    arr: npt.NDArray[np.generic], meta: Mapping[str, Any], *, absent: set[str] | None = None
) -> Any:
    """What an array read back becomes: a torch tensor for a leaf saved from one, else ``arr``.

    A tensor saved on a device that does not exist here stays on the CPU, its device added to
    ``absent`` (for the caller to say so, once per restore)."""
    name = meta.get("torch")
    if not isinstance(name, str):
        return arr
    tensor = as_tensor(arr, name)
    device = meta.get("device")
    if isinstance(device, str):
        try:
            tensor = tensor.to(device) if device_exists(device) else tensor
            moved = tensor.device.type != "cpu"
        except (RuntimeError, AssertionError):  # (e.g. a build of torch without that backend)
            moved = False
        if not moved and absent is not None:
            absent.add(device)
    return tensor


def device_exists(device: str) -> bool:
    """Whether torch device ``device`` (``"cuda:1"``) exists in this process."""
    torch = torchlazy.load()
    kind, _, index = device.partition(":")
    backend = getattr(torch, kind, None)
    if backend is None or not hasattr(backend, "is_available"):
        return True  # a backend this check does not know: let ``.to()`` decide
    if not backend.is_available():
        return False
    count = getattr(backend, "device_count", None)
    return not index.isdigit() or count is None or int(index) < int(count())


def fill_leaf(target: Any, arr: npt.NDArray[np.generic]) -> None:
    """Copy a verified array into a restore template's leaf that could not be read into
    directly (a read-only view aside: a torch tensor on another device, or not contiguous).

    A tensor is filled from a CPU tensor over ``arr``'s memory: no device memory is allocated
    (the target's device wins, whatever device the checkpoint was saved from)."""
    import numpy as np

    if isinstance(target, np.ndarray):
        np.copyto(target, arr)
    else:
        target.copy_(as_tensor(arr, str(target.dtype).removeprefix("torch.")))


def writable_view(value: Any) -> npt.NDArray[np.generic] | None:
    """A numpy view of an existing array or CPU tensor to read into (``None`` if there is
    none, e.g. a CUDA tensor or a read-only array)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value if value.flags.writeable and value.flags.c_contiguous else None
    if is_tensor(value):
        if value.device.type != "cpu" or not value.is_contiguous():
            return None
        return to_numpy(value, what="restore target")
    return None


def template_spec(value: Any) -> tuple[tuple[int, ...], str]:
    """Shape and stored dtype string of an array leaf (without copying a device tensor)."""
    import numpy as np

    if is_tensor(value):
        name = str(value.dtype).removeprefix("torch.")
        if name in _WORDS:
            return tuple(value.shape), _WORDS[name]
        return tuple(value.shape), np.dtype(str(value.dtype).removeprefix("torch.")).str
    arr = np.asarray(value)
    return tuple(arr.shape), arr.dtype.str
