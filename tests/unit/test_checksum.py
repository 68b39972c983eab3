"""Checksums of arrays (resilient.checksum): the bytes in C order, whatever the memory layout;
the helper thread's digests equal the caller's."""

from __future__ import annotations

import numpy as np
import xxhash

from resilient.checksum import Digests, digest_array, digest_arrays


def c_order_digest(arr: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(arr).tobytes())


def mixed() -> list[np.ndarray]:
    base = np.arange(60.0).reshape(6, 10)
    return [
        base,
        base[:, ::2],  # strided
        base.T,  # Fortran order
        np.asarray(3.5),  # 0-d
        np.zeros((0, 4)),  # empty
        base[1:3],  # a contiguous view
        np.arange(7, dtype=">i4"),
    ]


def test_digest_arrays_hashes_the_c_order_bytes_of_any_layout() -> None:
    arrays = mixed()
    want = [c_order_digest(a) for a in arrays]
    assert digest_arrays(arrays) == want
    assert [digest_array(a) for a in arrays] == want
    contiguous = [a for a in arrays if a.flags.c_contiguous]
    assert digest_arrays(contiguous) == [c_order_digest(a) for a in contiguous]


def test_digests_taken_on_the_helper_thread_land_by_position() -> None:
    arrays: list[np.ndarray] = [np.full(1000 + i, i, dtype=np.int64) for i in range(50)]
    digests = Digests(len(arrays) + 1)  # the last position is never added
    digests.add(list(range(49, 19, -1)), arrays[49:19:-1])
    digests.add(list(range(20)), arrays[:20])
    got = digests.result()
    assert got[:50] == digest_arrays(arrays) and got[50] == ""
