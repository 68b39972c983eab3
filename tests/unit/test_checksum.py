"""Checksums of arrays (resilient.model.checksum): the bytes in C order, whatever the memory layout;
the helper thread's digests (resilient.io.digests) equal the caller's, and the thread ends with its Digests."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash

from resilient.io.digests import Digests
from resilient.model.checksum import digest_array, digest_arrays


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


def helper_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("resilient-digest"))


def test_the_helper_thread_belongs_to_its_digests_and_ends_with_them() -> None:
    digests = Digests(3)
    assert helper_threads() == []  # none until work is handed over
    digests.add([0], [np.arange(10.0)])
    assert helper_threads() == ["resilient-digest_0"]
    assert digests.result()[0] == digest_array(np.arange(10.0))
    assert helper_threads() == []  # ended by result()
    digests.add([1], [np.arange(3.0)])  # a later add starts a thread of its own again
    digests.add([2], [object()])  # type: ignore[list-item]  # no buffer: its checksum fails
    assert helper_threads() == ["resilient-digest_0"]
    with pytest.raises(TypeError):
        digests.result()
    assert helper_threads() == []  # ended even when result() raises
    digests.close()  # idempotent


def test_a_helper_passed_in_is_used_and_left_running() -> None:
    arrays = [np.arange(100.0) + i for i in range(4)]
    with ThreadPoolExecutor(1, thread_name_prefix="owner") as pool:
        digests = Digests(4, helper=pool)
        digests.add([0, 1], arrays[:2])
        digests.add_piece(2, memoryview(arrays[2].tobytes()), last=True)
        ran = digests.alongside(lambda: threading.current_thread().name).result()
        digests.put([3], digest_arrays(arrays[3:]))
        assert digests.result() == digest_arrays(arrays)
        assert ran.startswith("owner") and helper_threads() == []
        assert pool.submit(lambda: 1).result() == 1  # still running: the owner's to end
