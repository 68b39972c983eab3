"""New memory for large arrays: anonymous maps, backed by huge pages where the kernel allows.

A restore reads into new memory, and new memory costs more than the read: the kernel must map
and zero every page on first touch. Measured here (../MACHINE.md), reading 62 MiB from the page
cache took 9 ms into a map advised ``MADV_HUGEPAGE`` (2 MiB pages: 31 faults instead of 15,872,
and fewer TLB misses in the copy), 15 ms into ``np.empty`` and 35 ms into a ``MAP_POPULATE`` map;
8 MiB arrays gave the same ranking. Below ~4 MiB a map has no whole huge page to gain, and one
faulted in at once (``MAP_POPULATE``) was the fastest of the three.

The advice is only a hint: with transparent huge pages off (``never``) a map is faulted in at
once instead. numpy itself gives the same advice for its large arrays.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["HUGE_MIN", "new_bytes"]

HUGE_MIN = 4 << 20  # from here on, a huge-page map (if the kernel allows)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the pages in at allocation
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def new_bytes(nbytes: int) -> npt.NDArray[np.uint8]:
    """A new writable, page-aligned ``uint8`` array of ``nbytes`` (an anonymous map, unmapped
    when the last array using it is gone)."""
    import numpy as np

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = nbytes >= HUGE_MIN and _huge_pages()
    region = mmap.mmap(-1, max(nbytes, 1), flags=flags if huge else flags | _POPULATE)
    if huge:
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8, nbytes)


@functools.cache
def _huge_pages() -> bool:
    """Whether an ``MADV_HUGEPAGE`` map gets huge pages (transparent huge pages ``always`` or
    ``madvise``; not on other systems)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _THP.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting
