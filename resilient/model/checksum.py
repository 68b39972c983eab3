"""Content checksums (xxh3-64, ~30 GB/s here: free next to a ~2 GB/s disk) of bytes, text and
arrays in memory. Checksums taken while reading a file, or on a helper thread, are
:mod:`resilient.io.digests`'."""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "digest_array",
    "digest_arrays",
    "digest_bytes",
    "digest_stripes",
    "digest_text",
    "hash128",
]


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """xxh3-64 of ``data`` as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_text(text: str) -> str:
    """xxh3-64 of the UTF-8 encoding of ``text``."""
    return digest_bytes(text.encode())


def digest_array(arr: npt.NDArray[np.generic]) -> str:
    """xxh3-64 of an array's bytes in C order (no copy when it is C-contiguous)."""
    if arr.flags.c_contiguous:  # numpy exports a plain buffer: no view objects (5x faster)
        return xxhash.xxh3_64_hexdigest(arr)  # type: ignore[arg-type]
    # a copy in C order (a flattening reshape may be a strided view, whose bytes are not plain)
    import numpy as np

    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(arr))  # type: ignore[arg-type]


def digest_arrays(arrays: list[npt.NDArray[np.generic]]) -> list[str]:
    """:func:`digest_array` of each array, C-contiguous ones without a Python call each."""
    try:  # numpy refuses to export any other array's buffer as plain bytes
        return list(map(xxhash.xxh3_64_hexdigest, arrays))  # type: ignore[arg-type]
    except ValueError:
        return list(map(digest_array, arrays))


def digest_stripes(arr: npt.NDArray[np.generic], rows: int) -> list[str]:
    """xxh3-64 of each stripe of ``rows`` rows (axis 0) of a C-contiguous array (no copy)."""
    if arr.ndim == 0 or arr.shape[0] == 0:
        return []
    if not arr.nbytes:  # rows of no bytes (another axis is empty): empty stripes
        return [digest_bytes(b"")] * -(-arr.shape[0] // rows)
    view = memoryview(arr.reshape(-1).view("u1"))  # type: ignore[arg-type]
    step = rows * (arr.nbytes // arr.shape[0])
    return [digest_bytes(view[pos : pos + step]) for pos in range(0, len(view), step)]


def hash128(text: str) -> str:
    """xxh3-128 of ``text`` as 32 hex digits (content addresses of static data)."""
    return xxhash.xxh3_128_hexdigest(text.encode())
