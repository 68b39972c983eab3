"""HDF5 metadata of a checkpoint file, computed without HDF5. Pure: no I/O, no h5py.

:func:`plan_file` lays out a file for a group of ranks: its bytes of HDF5 metadata, where each
dataset's data goes, and the file's size. :mod:`resilient.io.fileio` writes those bytes; each rank
then writes its arrays' bytes at their offsets. h5py built the same structure at ~26 us per
dataset; here it takes ~0.6-0.8 us, because equal records (object headers of datasets of one
dtype and rank, symbol table entries, B-tree keys, heap names) are built as numpy arrays, not
one by one. ``fileio.build_skeleton``, median of 7 warm runs on the project's 2-core machine
(1-D float64 datasets in one group; h5py as of b762f85; the spread is the machine's)::

    datasets         1        100        4,000       100,000
    h5py          0.69 ms   2.74 ms     105 ms      2,750 ms
    h5format      0.5 ms    0.5 ms    2.3-2.9 ms      80 ms

The format is HDF5's oldest, which every HDF5 reader since 1.8 reads (h5py, h5ls, h5dump; it
is what h5py writes with ``libver="earliest"``), and which has no checksums and fixed-size
records:

* superblock version 0 (8-byte addresses and lengths);
* object headers version 1, each one chunk, no modification times;
* groups as symbol tables: a version 1 B-tree (``TREE``, type 0) of one node, whose children
  are symbol table nodes (``SNOD``) holding the entries sorted by name (``strcmp`` of the UTF-8
  bytes), and a local heap (``HEAP``) holding the names ("" at offset 0, as HDF5 has it); a
  group's entry caches its B-tree and heap addresses, as HDF5 writes them. A heap's data
  segment need not follow its prefix: all prefixes are one block, all data segments another;
* datasets: dataspace message version 1 (rank 0 is a scalar; maximum dims = dims), datatype
  message version 1, fill value message version 2, data layout message version 3, contiguous
  (an empty dataset has the undefined address and size 0). The fill value message says
  "allocated early, never filled" and has the *default* fill value, not an undefined one: that
  is what h5py wrote for our skeletons, and with an undefined fill value h5py's
  ``Dataset.fillvalue`` raises. Every message has the flags HDF5 gives it; tests compare them;
* attributes: message version 1: ``resilient_layout`` (a fixed-length, NUL-padded string:
  h5py reads it as ``bytes``; a variable-length one would need a global heap) and
  ``resilient_ranks`` (int64 array) on the root group, ``rank`` (int64 scalar) on each rank's
  group. A header message holds at most 64 KiB, so a file of more than 8,183 ranks has
  ``resilient_ranks`` as a dataset of the root instead (its data lies with the metadata).

Datatypes are the ones h5py gives the numpy dtypes :func:`resilient.model.entries.dtype_itemsize`
accepts (tests compare them byte for byte with HDF5's), so h5py reads every dataset back with
its dtype: integers and IEEE floats of either byte order; ``f16`` (``numpy.longdouble``: x87's
80-bit format in 16 bytes on x86-64, IEEE quad elsewhere); ``b1`` as an 8-bit enum ``FALSE=0,
TRUE=1``; complex numbers as a compound of ``r`` and ``i``. One exception: for a big-endian
``c32`` h5py's type has little-endian members (it then writes such data wrong); ours says what
the bytes are, big-endian, so HDF5 and h5dump read it right, and h5py does when asked for
little-endian values (``dset.astype("<c32")``).

The K values of the superblock (entries per symbol table node: 2 x "leaf K"; children per
B-tree node: 2 x "internal K") hold for the whole file. They are chosen per file so that every
group's B-tree is one node and the metadata is smallest (4,000 datasets in one group: 125
nodes of 32 entries; 100,000: 391 of 256). HDF5 reads them, and adds to such a file.

Layout of a file (every piece of metadata on an 8-byte boundary)::

    superblock | data: rank by rank, datasets in the order given | headers of the root and the
    ranks' groups | headers of the other groups | B-tree nodes | local heaps' prefixes | their
    data segments | symbol table nodes | dataset headers, by (dtype, rank)

The data comes first, right after the 96-byte superblock, so that where each dataset goes
depends on the shapes and dtypes alone (:func:`place_data`): a save writes its arrays while
the rest of the metadata, which needs those offsets, is still being built. HDF5 puts no
constraint on where objects lie; the superblock (at 0) points to the root group's header.
Datasets of at least 1 MiB (:data:`PAGE_ALIGNED_MIN`) start on 4,096-byte boundaries (so that a
writer may write them with ``O_DIRECT``: :mod:`resilient.io.fileio` does), smaller
ones on 64-byte boundaries one after the other (their views are aligned, and 4,000 small
arrays are one run of data). The zeros before the first dataset and between two datasets (when
a small one's size is not a multiple of 64) are pieces of their own, and the zeros after the
last one belong to the metadata's piece, so that pieces and datasets tile the file (the
manifest checks that its segments do).
"""

from __future__ import annotations

import functools
import itertools
import operator
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from resilient.model.filenames import rank_group_name

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["ArraySpec", "FileMap", "Spec", "datatype_message", "place_data", "plan_file"]

PAGE_ALIGNED_MIN = 1 << 20  # datasets from this size start on a page (a writer may use O_DIRECT)
PAGE = 4096
SMALL_ALIGN = 64  # alignment of smaller datasets

_UNDEF = 0xFFFF_FFFF_FFFF_FFFF  # HDF5's undefined address
_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SUPERBLOCK = 96  # version 0 with 8-byte addresses, the root's symbol table entry included
_MAX_MESSAGE = 0xFFFF  # a header message's size is 16 bits
_MAX_RANK = 32  # HDF5's maximum dataspace rank
_HEAP_FREE_NONE = 1  # a local heap's "no free block"
_LINK_GROUP = 1  # symbol table entry cache type: a group, scratch pad = B-tree and heap addresses

# message types
_DATASPACE, _DATATYPE, _FILL, _LAYOUT, _ATTRIBUTE, _SYMBOL_TABLE = 0x1, 0x3, 0x5, 0x8, 0xC, 0x11
_CONSTANT = 0x1  # message flag: the message never changes

# word 0 of a B-tree node: "TREE", type 0 (groups), level 0, and (from bit 48) its entry count
_TREE_WORD = int.from_bytes(b"TREE\x00\x00", "little")
_HEAP_WORD = int.from_bytes(b"HEAP", "little")  # "HEAP", version 0, 3 reserved bytes
_SNOD_WORD = int.from_bytes(b"SNOD\x01", "little")  # "SNOD", version 1, reserved; count: bit 48

_ENTRY = {  # a symbol table entry (40 bytes)
    "names": ["name", "header", "cache", "btree", "heap"],
    "formats": ["<u8", "<u8", "<u4", "<u8", "<u8"],
    "offsets": [0, 8, 16, 24, 32],
    "itemsize": 40,
}


class ArraySpec(NamedTuple):
    """One array a rank wants written: its name, shape and dtype string (a named tuple: a
    state dict has thousands)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


Spec = tuple[str, tuple[int, ...], str]
"""What :func:`plan_file` reads of an array: an :class:`ArraySpec`, or the plain tuple a
save builds for each of thousands of arrays (``zip``: ~5x cheaper than the named tuple)."""


@dataclass(frozen=True, slots=True)
class FileMap:
    """Where :func:`plan_file` put the bytes of a file (a map of its bytes, not a
    :class:`~resilient.model.layout.Layout`, which groups ranks into files).

    Attributes:
        meta_bytes: the bytes that are not datasets' data, as ``(offset, bytes)`` sorted by offset:
            the superblock (and zeros up to the first dataset), the zeros between datasets, if
            any, and the rest of the metadata (from the end of the data to the end of the
            file). Pieces and non-empty datasets tile the file.
        offsets: per rank, its datasets' data offsets in the order given (``None`` for an
            empty dataset).
        size: the file's size.
    """

    meta_bytes: tuple[tuple[int, bytes], ...]
    offsets: dict[int, tuple[int | None, ...]]
    size: int


def plan_file(layout_kind: str, ranks: Sequence[tuple[int, Sequence[Spec]]]) -> FileMap:
    """Plan the HDF5 file of a group of ranks: where each byte goes.

    Each rank gets a group ``/rank_00003``; a dataset ``model/layer1.weight`` of that rank is
    dataset ``layer1.weight`` of group ``/rank_00003/model``. Equal arguments give equal bytes.

    The steps: the groups, datasets and links of the tree; the data's offsets
    (:func:`_place_data`); every metadata structure's address (:class:`_Addresses`); the
    metadata's bytes, structure by structure (:func:`_write_metadata`); the metadata bytes that,
    with the data, tile the file (:func:`_meta_bytes`).

    Args:
        layout_kind: stored as the root's ``resilient_layout`` attribute.
        ranks: per rank of the group, its rank and its array specs.

    Raises:
        ValueError: a name HDF5 cannot hold (empty, with an empty component, a component
            ``.`` or a NUL), two
            datasets of one name, a name both a group and a dataset, a rank listed twice, an
            unsupported dtype, a negative dimension or more than 32 dimensions.
    """
    tree = _Tree(ranks)
    datasets = _Datasets(tree.shapes, tree.dtypes)
    links = _Links(tree)
    offsets, data_end, first_data, gaps = _place_data(datasets.nbytes, _SUPERBLOCK)
    special = [_group_header(tree, g, layout_kind) for g in range(tree.n_special)]
    at = _Addresses.of(tree, datasets, links, special, data_end)
    buf = _write_metadata(tree, datasets, links, special, offsets, at)
    meta_bytes = _meta_bytes(at, buf, first_data, data_end, gaps)
    by_rank = _by_rank(offsets, datasets.nbytes, tree.bounds, tree.ranks)
    return FileMap(tuple(meta_bytes), by_rank, at.size)


@dataclass(frozen=True, slots=True)
class _Addresses:
    """Where every metadata structure of a file goes: the data first, then the metadata from
    ``base`` (every structure 8-byte aligned), in the order of the module's diagram.

    Attributes:
        lk, ik: the symbol table nodes' and the B-trees' K (:func:`_choose_k`).
        cap: entries per symbol table node.
        n_nodes, node_first: per group, its symbol table nodes and the index of its first.
        base: where the metadata starts (the end of the data, 8-byte aligned).
        header_addr: per group, its object header.
        ranks_header, ranks_data: the root's ``ranks`` dataset (too many ranks for an
            attribute), its header and its data; ``-1`` when there is none.
        btree_words, btree_addr: a B-tree node's words; per group, its B-tree node.
        heap_addr, heap_data_addr, heap_data_base: per group, its local heap's prefix and data
            segment; where the data segments start.
        node_words, node_base: a symbol table node's words; where the nodes start.
        class_base: per class of dataset headers (:class:`_Datasets`), where its block starts.
        size: the file's size.
    """

    lk: int
    ik: int
    cap: int
    n_nodes: npt.NDArray[np.int64]
    node_first: npt.NDArray[np.int64]
    base: int
    header_addr: npt.NDArray[np.int64]
    ranks_header: int
    ranks_data: int
    btree_words: int
    btree_addr: npt.NDArray[np.int64]
    heap_addr: npt.NDArray[np.int64]
    heap_data_addr: npt.NDArray[np.int64]
    heap_data_base: int
    node_words: int
    node_base: int
    class_base: list[int]
    size: int

    @property
    def total_nodes(self) -> int:
        """The symbol table nodes of all groups."""
        return int(self.n_nodes.sum())

    @classmethod
    def of(
        cls, tree: _Tree, datasets: _Datasets, links: _Links, special: list[bytes], data_end: int
    ) -> _Addresses:
        """The addresses of a file whose data ends at ``data_end``; ``special``: the headers of
        the groups with attributes. Sets each dataset's header address in ``datasets``."""
        import numpy as np

        n_groups = len(tree.g_parent)
        lk, ik = _choose_k(links.counts)
        cap = 2 * lk  # entries per symbol table node
        n_nodes = -(-links.counts // cap)  # symbol table nodes per group
        node_first = np.cumsum(n_nodes) - n_nodes
        total_nodes = int(n_nodes.sum())
        base = pos = -(-data_end // 8) * 8
        header_addr = np.zeros(n_groups, np.int64)
        for g, image in enumerate(special):
            header_addr[g] = pos
            pos += len(image)
        ranks_header = ranks_data = -1
        if tree.ranks_dataset:  # too many ranks for an attribute: a dataset of the root
            ranks_header = pos
            pos += len(_ranks_dataset(tree.ranks, 0))
        n_plain = n_groups - tree.n_special
        header_addr[tree.n_special :] = pos + _PLAIN_GROUP * np.arange(n_plain)
        pos += _PLAIN_GROUP * n_plain
        btree_words = 4 + 4 * ik  # 3 words of header, 2K+1 keys, 2K children
        btree_addr = pos + 8 * btree_words * np.arange(n_groups)
        pos += 8 * btree_words * n_groups
        heap_addr = pos + 32 * np.arange(n_groups)  # local heaps' prefixes, then their data
        pos += 32 * n_groups
        heap_data_addr = pos + np.cumsum(links.heap_data) - links.heap_data
        heap_data_base = pos
        pos += int(links.heap_data.sum())
        node_words = 1 + 5 * cap
        node_base = pos
        pos += 8 * node_words * total_nodes
        class_base = []
        for c in datasets.classes:
            class_base.append(pos)
            datasets.header_addr[c.members] = pos + c.size * np.arange(c.members.size)
            pos += c.size * c.members.size
        if tree.ranks_dataset:  # its data: with the metadata
            ranks_data = pos
            pos += 8 * len(tree.ranks)
        return cls(
            lk, ik, cap, n_nodes, node_first, base, header_addr, ranks_header, ranks_data,
            btree_words, btree_addr, heap_addr, heap_data_addr, heap_data_base, node_words,
            node_base, class_base, pos,
        )  # fmt: skip


def _write_metadata(
    tree: _Tree,
    datasets: _Datasets,
    links: _Links,
    special: list[bytes],
    offsets: npt.NDArray[np.int64],
    at: _Addresses,
) -> npt.NDArray[np.uint8]:
    """The metadata's bytes, in a new buffer: 8 bytes, then the metadata from ``at.base`` (the
    8 bytes' last ``at.base - data_end`` are the zeros from the end of the data to ``base``:
    :func:`_meta_bytes` takes the tail piece as one copy).

    A new buffer per call, dropped on return: a buffer kept per thread for the next call would
    save faulting its pages in (~0.2 ms for the 0.7 MB of 4,000 datasets, once per structure:
    later saves reuse the skeleton) but stay, as large as the largest metadata, for the
    thread's life.
    """
    import numpy as np

    buf = np.zeros(8 + at.size - at.base, np.uint8)
    out = buf[8:]  # (word-aligned)
    # ``words`` counts from word 0 of the file: absolute addresses index it
    words = _Shifted(out.view("<u8"), at.base // 8)
    _write_group_headers(out, words, tree, special, at)
    _write_btrees(words, links, at)
    _write_heaps(out, words, links, at)
    _write_symbol_nodes(words, tree, datasets, links, at)
    for c, start in zip(datasets.classes, at.class_base, strict=True):  # one block per class
        c.fill(out[start - at.base : start - at.base + c.size * c.members.size], offsets,
               datasets.nbytes)  # fmt: skip
    return buf


def _write_group_headers(
    out: npt.NDArray[np.uint8], words: _Shifted, tree: _Tree, special: list[bytes], at: _Addresses
) -> None:
    """The groups' object headers (and the root's ``ranks`` dataset, if any): those with
    attributes from their images, the plain ones word by word."""
    import numpy as np

    base = at.base
    if tree.ranks_dataset:
        image = _ranks_dataset(tree.ranks, at.ranks_data)
        pos = at.ranks_header - base
        out[pos : pos + len(image)] = np.frombuffer(image, np.uint8)
        pos = at.ranks_data - base
        out[pos : pos + 8 * len(tree.ranks)] = np.array(tree.ranks, "<i8").view(np.uint8)
    for g, image in enumerate(special):
        a = int(at.header_addr[g])
        out[a - base : a - base + len(image)] = np.frombuffer(image, np.uint8)
        # its first message is the symbol table's: after the prefix and the message header
        words[a // 8 + 3] = at.btree_addr[g]
        words[a // 8 + 4] = at.heap_addr[g]
    n_plain = len(tree.g_parent) - tree.n_special
    if n_plain:
        pos = int(at.header_addr[tree.n_special]) // 8
        w = words[pos : pos + 5 * n_plain].reshape(n_plain, 5)
        w[:, 0] = 1 | 1 << 16 | 1 << 32  # version 1, one message, reference count 1
        w[:, 1] = 24  # the message: its 8-byte header and 16 bytes
        w[:, 2] = _SYMBOL_TABLE | 16 << 16
        w[:, 3] = at.btree_addr[tree.n_special :]
        w[:, 4] = at.heap_addr[tree.n_special :]


def _write_btrees(words: _Shifted, links: _Links, at: _Addresses) -> None:
    """One B-tree node per group: 3 words of header, then key 0, child 0, key 1, ..., child
    n-1, key n; key 0 is "" (heap offset 0) and key i+1 the last name of child i."""
    import numpy as np

    n_groups = at.btree_addr.size
    pos = int(at.btree_addr[0]) // 8
    bt = words[pos : pos + at.btree_words * n_groups].reshape(n_groups, at.btree_words)
    bt[:, 0] = np.uint64(_TREE_WORD) | at.n_nodes.astype(np.uint64) << np.uint64(48)
    bt[:, 1:3] = _UNDEF  # no siblings
    node_group = np.repeat(np.arange(n_groups), at.n_nodes)
    j = np.arange(at.total_nodes) - at.node_first[node_group]  # each node's index in its group
    last = links.first[node_group] + np.minimum((j + 1) * at.cap, links.counts[node_group]) - 1
    bt[node_group, 4 + 2 * j] = at.node_base + 8 * at.node_words * np.arange(at.total_nodes)
    bt[node_group, 5 + 2 * j] = links.heap_offset[last]


def _write_heaps(
    out: npt.NDArray[np.uint8], words: _Shifted, links: _Links, at: _Addresses
) -> None:
    """The local heaps: prefixes of 4 words; their data segments, one after the other, hold ""
    at offset 0, then the group's names in sorted order."""
    hw = at.heap_addr // 8
    words[hw] = _HEAP_WORD
    words[hw + 1] = links.heap_data
    words[hw + 2] = _HEAP_FREE_NONE
    words[hw + 3] = at.heap_data_addr
    pos = at.heap_data_base - at.base
    out[pos : pos + links.heap_bytes.size] = links.heap_bytes


def _write_symbol_nodes(
    words: _Shifted, tree: _Tree, datasets: _Datasets, links: _Links, at: _Addresses
) -> None:
    """The symbol table nodes: a word of header ("SNOD", version, count), then 5 words per
    entry: the name's heap offset, the object header, the cache type, and a group's B-tree and
    heap."""
    import numpy as np

    total_nodes = at.total_nodes
    if not total_nodes:
        return
    n_groups = at.btree_addr.size
    in_group = np.arange(links.n) - links.first[links.parent]
    node = at.node_first[links.parent] + in_group // at.cap
    count = np.bincount(node, minlength=total_nodes).astype(np.uint64)
    nw = at.node_base // 8 + at.node_words * np.arange(total_nodes)
    words[nw] = np.uint64(_SNOD_WORD) | count << np.uint64(48)
    ew = at.node_base // 8 + at.node_words * node + 1 + 5 * (in_group % at.cap)
    group = links.order - datasets.n + 1  # a group link's group, else <= 0
    is_dataset = group <= 0
    is_group = ~is_dataset & (group < n_groups)
    header = np.zeros(links.n, np.int64)
    header[is_dataset] = datasets.header_addr[links.order[is_dataset]]
    if tree.ranks_dataset:  # the last link
        header[group == n_groups] = at.ranks_header
    group = group[is_group]
    header[is_group] = at.header_addr[group]
    words[ew] = links.heap_offset
    words[ew + 1] = header
    words[ew[is_group] + 2] = _LINK_GROUP
    words[ew[is_group] + 3] = at.btree_addr[group]
    words[ew[is_group] + 4] = at.heap_addr[group]


def _meta_bytes(
    at: _Addresses,
    buf: npt.NDArray[np.uint8],
    first_data: int,
    data_end: int,
    gaps: list[tuple[int, int]],
) -> list[tuple[int, bytes]]:
    """The bytes that are not datasets' data, by offset: the superblock and the zeros up to the
    first dataset; the zeros between datasets; the zeros after the last one (up to 8-byte
    alignment) and the metadata (``buf``: see :func:`_write_metadata`). One piece without
    data."""
    lead = at.base - data_end
    superblock = _superblock(
        at.lk, at.ik, at.size, int(at.header_addr[0]), int(at.btree_addr[0]), int(at.heap_addr[0])
    )
    head = superblock + bytes(first_data - _SUPERBLOCK)
    tail = buf[8 - lead :].tobytes()
    if first_data == data_end:  # no data: one piece
        return [(0, head + tail)]
    return [(0, head), *((o, bytes(n)) for o, n in gaps), (data_end, tail)]


class _Shifted:
    """A word array indexed by absolute word numbers: ``words[i]`` is ``array[i - shift]``
    (numpy integer arrays and slices as indices too)."""

    __slots__ = ("array", "shift")

    def __init__(self, array: npt.NDArray[np.uint64], shift: int) -> None:
        self.array, self.shift = array, shift

    def _at(self, index: Any) -> Any:
        if isinstance(index, slice):
            return slice(index.start - self.shift, index.stop - self.shift, index.step)
        return index - self.shift

    def __getitem__(self, index: Any) -> Any:
        return self.array[self._at(index)]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.array[self._at(index)] = value


def place_data(ranks: Sequence[tuple[int, Sequence[Spec]]]) -> dict[int, tuple[int | None, ...]]:
    """Where :func:`plan_file` puts each rank's datasets (``None`` for an empty one), in the
    order given, computed from the shapes and dtypes alone (~0.1 ms for 4,000 datasets): the
    data comes first in the file, so the metadata can be built later.

    Raises:
        ValueError: an unsupported dtype, a negative dimension, more than 32 dimensions or a
            dataset too large (the checks of :func:`plan_file` on shapes and dtypes).
    """
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    bounds = [0]
    for _, specs in ranks:
        shapes += map(_SHAPE, specs)
        dtypes += map(_DTYPE, specs)
        bounds.append(len(shapes))
    nbytes = _Datasets(shapes, dtypes).nbytes
    offsets = _place_data(nbytes, _SUPERBLOCK)[0]
    return _by_rank(offsets, nbytes, bounds, [rank for rank, _ in ranks])


def _by_rank(
    offsets: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    bounds: list[int],
    ranks: list[int],
) -> dict[int, tuple[int | None, ...]]:
    """Per rank, its datasets' offsets in order (``None`` for an empty one)."""
    values: list[int | None] = offsets.tolist()
    for i in (nbytes == 0).nonzero()[0].tolist():
        values[i] = None
    return {rank: tuple(values[bounds[i] : bounds[i + 1]]) for i, rank in enumerate(ranks)}


_NAME, _SHAPE, _DTYPE = (operator.itemgetter(i) for i in range(3))  # ArraySpec's fields
_PLAIN_GROUP = 40  # header of a group without attributes: prefix + symbol table message
_FIXED_MAX = 1 << 27  # above this many bytes, names are compared as Python bytes objects


class _Tree:
    """The groups and datasets of a file.

    Datasets are numbered rank by rank, in the order given. Group 0 is the root, groups 1 to R
    the ranks' (they have attributes), the others nested ones (``model`` in
    ``model/layer1.weight``), numbered as first met.

    Names are handled as the UTF-8 bytes of all dataset names joined by NULs (``raw``): a name
    holds no NUL (checked), and ``/`` is one byte that no other character's UTF-8 contains.
    """

    def __init__(self, ranks: Sequence[tuple[int, Sequence[Spec]]]) -> None:
        import numpy as np

        self.ranks: list[int] = []
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.bounds = [0]  # rank i's datasets are bounds[i]:bounds[i + 1]
        for rank, specs in ranks:
            self.ranks.append(int(rank))
            # named tuples: fields by map (zip(*specs) is as fast for 4,000, 4x slower for
            # 100,000; a comprehension 25% slower)
            self.names += map(_NAME, specs)
            self.shapes += map(_SHAPE, specs)
            self.dtypes += map(_DTYPE, specs)
            self.bounds.append(len(self.names))
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a rank is listed twice: {self.ranks}")
        self.g_parent: list[int] = [-1]
        self.g_name: list[bytes] = [b""]
        self.rank_of: dict[int, int] = {}
        for rank in self.ranks:
            self.rank_of[self._new_group(0, rank_group_name(rank).encode())] = rank
        self.n_special = len(self.g_parent)
        # the ranks as an attribute of the root take 64 bytes + 8 per rank, in a header
        # message of at most 64 KiB; more ranks are a dataset of the root
        self.ranks_dataset = int(64 + 8 * len(self.ranks) > _MAX_MESSAGE)
        n = len(self.names)
        text = "\0".join(self.names)
        if text.count("\0") != max(n - 1, 0):
            bad = next(x for x in self.names if "\0" in x)
            raise ValueError(f"dataset name {bad!r} contains a NUL character")
        self.raw = text.encode("utf-8")
        text_arr = np.frombuffer(self.raw + b"\0", np.uint8)
        _check_paths(self.raw, text_arr, self.names)
        ends = np.flatnonzero(text_arr == 0)[:n]
        starts = np.concatenate(([0], ends[:-1] + 1))[:n]
        slashes = np.flatnonzero(text_arr == ord("/"))
        k = np.searchsorted(slashes, ends) - 1
        last = slashes[np.maximum(k, 0)] if slashes.size else np.zeros(n, np.int64)
        nested = (k >= 0) & (last >= starts)
        self.leaf_start = np.where(nested, last + 1, starts)
        self.leaf_len = ends - self.leaf_start
        parent_len = np.where(nested, last - starts, 0)
        # runs of datasets in one group (a rank's datasets of one group usually come together):
        # one dictionary look-up per run, not per dataset
        rank_index = np.repeat(np.arange(len(self.ranks)), np.diff(self.bounds))
        parents = _strings(text_arr, starts, parent_len)
        new = np.ones(n, bool)
        new[1:] = (parents[1:] != parents[:-1]) | (rank_index[1:] != rank_index[:-1])
        first = np.flatnonzero(new)
        paths: dict[tuple[int, bytes], int] = {}
        run_group = [
            self._subgroup(paths, r + 1, self.raw[s : s + p])
            for r, s, p in zip(
                rank_index[first].tolist(),
                starts[first].tolist(),
                parent_len[first].tolist(),
                strict=True,
            )
        ]
        self.d_parent = np.repeat(np.array(run_group, np.int64), np.diff(np.append(first, n)))

    def _new_group(self, parent: int, name: bytes) -> int:
        self.g_parent.append(parent)
        self.g_name.append(name)
        return len(self.g_parent) - 1

    def _subgroup(self, paths: dict[tuple[int, bytes], int], rank_group: int, path: bytes) -> int:
        """The group at ``path`` below ``rank_group``, created if new."""
        if not path:
            return rank_group
        found = paths.get((rank_group, path))
        if found is None:
            head, _, last = path.rpartition(b"/")
            found = self._new_group(self._subgroup(paths, rank_group, head), last)
            paths[(rank_group, path)] = found
        return found


def _check_paths(raw: bytes, text: npt.NDArray[np.uint8], names: list[str]) -> None:
    """ValueError unless every name (``raw``: joined by NULs; ``text``: its bytes and a NUL)
    has no empty component (no two separators, NUL or ``/``, in a row, none first) and none
    that is ``.`` (in an HDF5 path, the group itself: h5py refuses it too)."""
    if not names:
        return
    sep = (text == 0) | (text == ord("/"))
    if sep[0] or (sep[1:] & sep[:-1]).any():
        bad = next(n for n in names if "" in n.split("/"))
        raise ValueError(f"dataset name {bad!r} has an empty component (HDF5 cannot hold it)")
    wrapped = b"\0" + raw + b"\0"
    if any(p in wrapped for p in (b"\0.\0", b"\0./", b"/./", b"/.\0")):
        bad = next(n for n in names if "." in n.split("/"))
        raise ValueError(f"dataset name {bad!r} has a component '.' (HDF5 cannot hold it)")


def _strings(
    text: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], lens: npt.NDArray[np.int64]
) -> npt.NDArray[Any]:
    """The byte strings ``text[start:start + len]`` as a fixed-width ``S`` array (numpy compares
    those as unsigned bytes, i.e. in ``strcmp``'s order), or as Python bytes objects when that
    would take too much memory (one very long name among many). ``text`` ends with a NUL."""
    import numpy as np

    n = starts.size
    width = int(lens.max(initial=0))
    if width == 0:
        return np.zeros(n, "S1")
    if n * width > _FIXED_MAX:
        raw = text.tobytes()
        return np.array(
            [raw[s : s + k] for s, k in zip(starts.tolist(), lens.tolist(), strict=True)] + [None],
            dtype=object,
        )[:n]
    columns = np.arange(width, dtype=np.int32)  # (32-bit: fewer pages to touch)
    take = starts.astype(np.int32)[:, None] + columns
    if lens.min() < width:  # shorter ones end with NULs (text's last byte)
        np.putmask(take, columns >= lens[:, None], text.size - 1)
    fixed: npt.NDArray[Any] = text[take].view(f"S{width}").reshape(n)
    return fixed


@functools.lru_cache(maxsize=256)  # bounded cache of a pure function of immutable arguments
def _header_template(dtype: str, ndim: int) -> tuple[npt.NDArray[np.uint8], np.dtype[Any], int]:
    """The object header of a dataset of ``dtype`` and rank ``ndim`` (dims, address and size
    zero), the numpy record type of its variable fields, and the dtype's item size."""
    import numpy as np

    datatype, itemsize = datatype_message(dtype)
    messages = [
        _message(_DATASPACE, _dataspace(ndim, [0] * ndim), 0),
        _message(_DATATYPE, datatype, _CONSTANT),
        _message(_FILL, _FILL_DEFAULT, _CONSTANT),
        _message(_LAYOUT, struct.pack("<BBQQ", 3, 1, 0, 0), _CONSTANT),
    ]
    body = b"".join(messages)
    template = np.frombuffer(_header_prefix(len(messages), len(body)) + body, np.uint8)
    layout = template.size - 32  # the layout message's header
    fields: dict[str, tuple[Any, int]] = {
        "flags": (np.dtype("u1"), layout + 4),
        "addr": (np.dtype("<u8"), layout + 10),
        "nbytes": (np.dtype("<u8"), layout + 18),
    }
    if ndim:  # after the prefix and the dataspace message's header and first 8 bytes
        fields["dims"] = (np.dtype(("<u8", (ndim,))), 32)
        fields["maxdims"] = (np.dtype(("<u8", (ndim,))), 32 + 8 * ndim)
    record = np.dtype(
        {
            "names": list(fields),
            "formats": [f for f, _ in fields.values()],
            "offsets": [o for _, o in fields.values()],
            "itemsize": template.size,
        }
    )
    return template, record, itemsize


class _DatasetClass:
    """Datasets of one dtype and rank: their object headers are equal records but for dims,
    data address and size, so they are built as one numpy record array."""

    def __init__(self, dtype: str, ndim: int) -> None:
        import numpy as np

        self.ndim = ndim
        self.template, self.record, self.itemsize = _header_template(dtype, ndim)
        self.size = self.template.size
        self.members: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.dims: npt.NDArray[np.int64] = np.zeros((0, ndim), np.int64)

    def fill(
        self,
        out: npt.NDArray[np.uint8],
        offsets: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> None:
        """Write the object headers of :attr:`members` into ``out``, given every dataset's
        offset and size."""
        import numpy as np

        n = self.members.size
        out.reshape(n, self.size)[:] = self.template
        rows = out.view(self.record)
        size = nbytes[self.members]
        allocated = size > 0
        rows["flags"] = allocated  # HDF5 marks an allocated layout constant
        rows["addr"] = np.where(allocated, offsets[self.members].astype(np.uint64), _UNDEF)
        rows["nbytes"] = size
        if self.ndim:
            rows["dims"] = self.dims
            rows["maxdims"] = self.dims


class _Datasets:
    """Every dataset's class, dims, size in bytes and (filled in later) header address."""

    def __init__(self, shapes: list[tuple[int, ...]], dtypes: list[str]) -> None:
        import numpy as np

        n = self.n = len(shapes)
        ndim_list = list(map(len, shapes))
        if n and max(ndim_list) > _MAX_RANK:
            raise ValueError(f"a dataset has more than {_MAX_RANK} dimensions")
        # the usual case: one dtype, one rank (counting is cheaper than a set or a dict)
        one_rank = n > 0 and ndim_list.count(ndim_list[0]) == n
        one_kind = one_rank and dtypes.count(dtypes[0]) == n
        if one_rank:
            k = ndim_list[0]
            if k == 1:
                flat = np.fromiter(map(operator.itemgetter(0), shapes), np.int64, n)
            else:
                flat = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, n * k)
            all_dims = flat.reshape(n, k)
        else:
            flat = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, sum(ndim_list))
        if flat.size and flat.min() < 0:
            raise ValueError("a dataset has a negative dimension")
        if one_kind:
            self.classes = [_DatasetClass(dtypes[0], k)]
            self.classes[0].members = np.arange(n)
            self.classes[0].dims = all_dims
        elif n:
            kinds = dict.fromkeys(dtypes)  # in order of first use: equal input, equal bytes
            number = {d: i for i, d in enumerate(kinds)}
            ndim_arr = np.array(ndim_list, np.int64)
            code = np.fromiter(map(number.__getitem__, dtypes), np.int64, n) * 64 + ndim_arr
            _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
            by_use = np.argsort(first)  # classes in order of first use
            rank_of = np.empty_like(by_use)
            rank_of[by_use] = np.arange(by_use.size)
            cls = rank_of[inverse.reshape(-1)]
            by_class = np.argsort(cls, kind="stable")
            bounds = np.searchsorted(cls[by_class], np.arange(by_use.size + 1))
            starts = np.cumsum(ndim_arr) - ndim_arr
            self.classes = []
            for i, f in enumerate(first[by_use].tolist()):
                c = _DatasetClass(dtypes[f], ndim_list[f])
                c.members = by_class[bounds[i] : bounds[i + 1]]
                c.dims = flat[starts[c.members][:, None] + np.arange(c.ndim)]
                self.classes.append(c)
        else:
            self.classes = []
        self.nbytes = np.zeros(n, np.int64)
        self.header_addr = np.zeros(n, np.int64)
        for c in self.classes:
            # at most 2**62 bytes (numpy's products would wrap around silently)
            big = c.dims.max(axis=1, initial=0) >= 1 << 20
            if (
                big.any()
                and np.log2(np.maximum(c.dims[big], 1)).sum(axis=1).max() > 62 - c.itemsize
            ):
                raise ValueError("a dataset is too large")
            self.nbytes[c.members] = c.dims.prod(axis=1) * c.itemsize


class _Links:
    """Every link (each dataset's, then each group's but the root's), sorted by parent group,
    then by name: a group's links are one run, in HDF5's order.

    Attributes:
        text: every name's bytes (datasets' in :attr:`_Tree.raw`, then the groups'), ending
            with a NUL; link ``i``'s name is ``text[start[i]:start[i] + length[i]]``.
        order: link numbers in sorted order (link ``i < n_datasets`` is dataset ``i``, then
            link ``n_datasets + g - 1`` is group ``g``).
        parent: each sorted link's group.
        counts: links per group; ``first``: each group's first sorted link.
        heap_offset: each sorted link's name's offset in its group's local heap.
        heap_data: size of each group's heap data.
    """

    def __init__(self, tree: _Tree) -> None:
        import numpy as np

        n_groups = len(tree.g_parent)
        group_names = tree.g_name[1:] + [b"resilient_ranks"] * tree.ranks_dataset
        self.text = np.frombuffer(
            tree.raw + b"\0" + b"".join(g + b"\0" for g in group_names), np.uint8
        )
        g_len = np.array([len(g) for g in group_names], np.int64)
        g_start = len(tree.raw) + 1 + np.cumsum(g_len + 1) - (g_len + 1)
        self.start = np.concatenate((tree.leaf_start, g_start)).astype(np.int64)
        self.length = np.concatenate((tree.leaf_len, g_len)).astype(np.int64)
        parent = np.concatenate(
            (tree.d_parent, np.array(tree.g_parent[1:] + [0] * tree.ranks_dataset, np.int64))
        )
        self.n = parent.size
        names = _strings(self.text, self.start, self.length)
        if names.dtype.kind == "S":
            self.order = np.lexsort((names, parent))
        else:
            by_name = np.argsort(names, kind="stable")
            self.order = by_name[np.argsort(parent[by_name], kind="stable")]
        self.parent = parent[self.order]
        in_order = names[self.order]
        dup = np.flatnonzero(
            (in_order[1:] == in_order[:-1]) & (self.parent[1:] == self.parent[:-1])
        )
        if dup.size:
            i = int(self.order[dup[0]])
            name = tree.names[i] if i < len(tree.names) else in_order[dup[0]].decode()
            raise ValueError(
                f"two objects named {name!r} in one group (a dataset given twice, or a name "
                "that is both a dataset and a group)"
            )
        self.counts = np.bincount(self.parent, minlength=n_groups).astype(np.int64)
        self.first = np.cumsum(self.counts) - self.counts
        padded = (self.length[self.order] // 8 + 1) * 8  # the name, its NUL, to 8 bytes
        before = np.cumsum(padded) - padded
        self.heap_offset = 8 + before - before[self.first[self.parent]]
        weights = np.bincount(self.parent, weights=padded, minlength=n_groups)
        self.heap_data = 8 + weights.astype(np.int64)
        self.heap_bytes = _heap_bytes(in_order, padded, self.parent, n_groups)


def _heap_bytes(
    names: npt.NDArray[Any],
    padded: npt.NDArray[np.int64],
    parent: npt.NDArray[np.int64],
    n_groups: int,
) -> npt.NDArray[np.uint8]:
    """Every group's heap data, one after the other: "" (8 NULs), then the group's sorted
    ``names`` (sorted by group too), each NUL-padded to its ``padded`` length."""
    import numpy as np

    rows = np.arange(names.size) + parent + 1  # a row for "" before each group's names
    if names.dtype.kind != "S":  # Python bytes (very long names): joined one by one
        pieces = [bytes(8)] * (names.size + n_groups)
        for row, name, size in zip(rows.tolist(), names.tolist(), padded.tolist(), strict=True):
            pieces[row] = name + bytes(size - len(name))
        return np.frombuffer(b"".join(pieces), np.uint8)
    # a zero matrix, a row per name or "", wide enough for every padded name: each row's
    # first `padded` bytes (8 for "") are its part of the heap data
    width = names.dtype.itemsize
    stride = -(-(width + 1) // 8) * 8
    matrix = np.zeros((names.size + n_groups, stride), np.uint8)
    matrix[rows, :width] = names.view(np.uint8).reshape(names.size, width)
    keep = np.full(names.size + n_groups, 8, np.int64)
    keep[rows] = padded
    return matrix[np.arange(stride) < keep[:, None]]


def _choose_k(counts: npt.NDArray[np.int64]) -> tuple[int, int]:
    """The superblock's (leaf K, internal K): every group's B-tree is one node (at most 2K
    children of 2 x leaf K entries each) and the metadata is smallest (ties: smaller K)."""
    import numpy as np

    sizes, groups = np.unique(counts, return_counts=True)  # groups of each size
    leaf_k = 1 << np.arange(15)[:, None]  # candidates: up to 2 x 16,384 entries per node
    nodes = -(-sizes // (2 * leaf_k))
    internal_k = np.maximum(1, -(-nodes.max(axis=1, initial=0) // 2))
    leaf_k = leaf_k[:, 0]
    total = (nodes * groups).sum(axis=1) * (8 + 80 * leaf_k) + counts.size * (32 + 32 * internal_k)
    total[2 * internal_k > 0xFFFF] = np.iinfo(np.int64).max  # a node's count is 16 bits
    best = int(np.argmin(total))  # the first minimum: the smallest K
    if 2 * internal_k[best] > 0xFFFF:
        raise ValueError(f"a group of {int(counts.max())} objects is too large")
    return int(leaf_k[best]), int(internal_k[best])


def _place_data(
    nbytes: npt.NDArray[np.int64], start: int
) -> tuple[npt.NDArray[np.int64], int, int, list[tuple[int, int]]]:
    """Where the datasets' data go, from ``start`` on, in order: from 1 MiB page-aligned,
    smaller ones 64-byte aligned.

    Returns:
        each dataset's offset (meaningless for an empty one), the end of the data (the file's
        size), the first dataset's offset (``start`` if none), and the gaps between datasets
        as ``(offset, length)``.
    """
    import numpy as np

    n = nbytes.size
    offsets = np.zeros(n, np.int64)
    pos = start
    prev = 0
    for big in [*np.flatnonzero(nbytes >= PAGE_ALIGNED_MIN).tolist(), n]:
        if big > prev:  # a run of small (or empty) datasets, packed
            run = nbytes[prev:big]
            padded = -(-run // SMALL_ALIGN) * SMALL_ALIGN
            base = -(-pos // SMALL_ALIGN) * SMALL_ALIGN
            offsets[prev:big] = base + np.cumsum(padded) - padded
            nz = np.flatnonzero(run)
            if nz.size:
                pos = int(offsets[prev + nz[-1]] + run[nz[-1]])
        if big < n:
            offsets[big] = -(-pos // PAGE) * PAGE
            pos = int(offsets[big] + nbytes[big])
        prev = big + 1
    full = np.flatnonzero(nbytes)
    if not full.size:
        return offsets, start, start, []
    at = offsets[full]
    ends = at + nbytes[full]
    gap = at[1:] - ends[:-1]
    has = gap > 0
    gaps = list(zip(ends[:-1][has].tolist(), gap[has].tolist(), strict=True))
    return offsets, pos, int(at[0]), gaps


# --- records -------------------------------------------------------------------------------


def _pad8(b: bytes) -> bytes:
    return b + bytes(-len(b) % 8)


def _message(kind: int, body: bytes, flags: int) -> bytes:
    """A version 1 header message: type, size, flags, 3 reserved bytes, body (padded to 8)."""
    body = _pad8(body)
    if len(body) > _MAX_MESSAGE:
        raise ValueError(f"an HDF5 header message of {len(body)} bytes is too large")
    return struct.pack("<HHB3x", kind, len(body), flags) + body


def _header_prefix(n_messages: int, size: int) -> bytes:
    """Version 1 object header prefix: version, messages, reference count 1, size, padding."""
    return struct.pack("<BxHII4x", 1, n_messages, 1, size)


def _dataspace(ndim: int, dims: Sequence[int]) -> bytes:
    """Version 1 dataspace: rank 0 is a scalar; a simple one stores max dims = dims."""
    if ndim == 0:
        return struct.pack("<BBBx4x", 1, 0, 0)
    return struct.pack(f"<BBBx4x{2 * ndim}Q", 1, ndim, 1, *dims, *dims)


_FILL_DEFAULT = struct.pack("<BBBBI", 2, 1, 1, 1, 0)  # v2, early, never, default value (size 0)


def _attribute(name: str, datatype: bytes, space: bytes, data: bytes) -> bytes:
    encoded = name.encode("utf-8") + b"\0"
    head = struct.pack("<BxHHH", 1, len(encoded), len(datatype), len(space))
    body = head + _pad8(encoded) + _pad8(datatype) + _pad8(space) + data
    return _message(_ATTRIBUTE, body, 0)


def _group_header(tree: _Tree, g: int, layout_kind: str) -> bytes:
    """The header of the root or a rank's group: a symbol table message (addresses filled in
    later) and the group's attributes."""
    int64, _ = datatype_message("<i8")
    if g == 0:
        ranks = tree.ranks
        text = layout_kind.encode("utf-8")
        string = struct.pack(
            "<BBxxI", 0x13, 1 | (0 if text.isascii() else 1) << 4, max(len(text), 1)
        )
        attrs = [_attribute("resilient_layout", string, _dataspace(0, ()), text or b"\0")]
        if not tree.ranks_dataset:
            data = struct.pack(f"<{len(ranks)}q", *ranks)
            attrs.append(_attribute("resilient_ranks", int64, _dataspace(1, (len(ranks),)), data))
    else:
        attrs = [_attribute("rank", int64, _dataspace(0, ()), struct.pack("<q", tree.rank_of[g]))]
    messages = [_message(_SYMBOL_TABLE, bytes(16), 0), *attrs]
    body = b"".join(messages)
    return _header_prefix(len(messages), len(body)) + body


def _ranks_dataset(ranks: list[int], address: int) -> bytes:
    """The header of the root's ``resilient_ranks`` dataset, when there are too many ranks
    for an attribute (a header message holds at most 64 KiB): int64, data at ``address``."""
    datatype, _ = datatype_message("<i8")
    n = len(ranks)
    messages = [
        _message(_DATASPACE, _dataspace(1, (n,)), 0),
        _message(_DATATYPE, datatype, _CONSTANT),
        _message(_FILL, _FILL_DEFAULT, _CONSTANT),
        _message(_LAYOUT, struct.pack("<BBQQ", 3, 1, address, 8 * n), _CONSTANT),
    ]
    body = b"".join(messages)
    return _header_prefix(len(messages), len(body)) + body


def _superblock(lk: int, ik: int, eof: int, root: int, btree: int, heap: int) -> bytes:
    """Version 0: versions 0, 8-byte addresses and lengths, K values, base address 0, no
    free-space info, end of file, no driver info, then the root's symbol table entry."""
    return struct.pack(
        "<8s8BHHIQQQQQQII QQ".replace(" ", ""),
        _SIGNATURE,
        *(0, 0, 0, 0, 0, 8, 8, 0),
        lk,
        ik,
        0,
        0,
        _UNDEF,
        eof,
        _UNDEF,
        0,  # the root's link name offset
        int(root),
        _LINK_GROUP,
        0,
        int(btree),
        int(heap),
    )


# --- datatypes -----------------------------------------------------------------------------

_FLOATS = {  # size: sign bit, exponent (location, size), mantissa (location, size), bias,
    #          mantissa normalisation (2: implied leading 1), precision
    2: (15, 10, 5, 0, 10, 15, 2, 16),
    4: (31, 23, 8, 0, 23, 127, 2, 32),
    8: (63, 52, 11, 0, 52, 1023, 2, 64),
}
_X87 = (79, 64, 15, 0, 64, 16383, 0, 80)  # 80-bit extended in 16 bytes: explicit leading 1
_QUAD = (127, 112, 15, 0, 112, 16383, 2, 128)
_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8, 16), "c": (8, 16, 32)}


@functools.lru_cache(maxsize=256)  # bounded cache of a pure function of immutable arguments
def datatype_message(dtype: str) -> tuple[bytes, int]:
    """The body of a version 1 datatype message for a numpy dtype string, and its item size.

    Raises:
        ValueError: a dtype that checkpoints do not store.
    """
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unsupported dtype {dtype!r}") from exc
    if dt.kind not in _SIZES or dt.itemsize not in _SIZES[dt.kind] or dt.fields or dt.shape:
        raise ValueError(f"unsupported dtype {dtype!r}")
    big = dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big")
    if dt.kind == "b":  # what h5py writes for bool: enum of int8 {FALSE: 0, TRUE: 1}
        base = _fixed(1, signed=True, big=False)
        body = struct.pack("<BBBBI", 0x18, 2, 0, 0, 1) + base + _pad8(b"FALSE\0")
        return body + _pad8(b"TRUE\0") + b"\x00\x01", 1
    if dt.kind in "iu":
        return _fixed(dt.itemsize, signed=dt.kind == "i", big=big), dt.itemsize
    if dt.kind == "f":
        return _float(dt.itemsize, big=big), dt.itemsize
    half = dt.itemsize // 2  # complex: what h5py writes, a compound {r, i}
    member = _float(half, big=big)
    body = struct.pack("<BBBBI", 0x16, 2, 0, 0, dt.itemsize)
    for name, offset in ((b"r", 0), (b"i", half)):
        body += _pad8(name + b"\0") + struct.pack("<IB3xI4x16x", offset, 0, 0) + member
    return body, dt.itemsize


def _fixed(size: int, *, signed: bool, big: bool) -> bytes:
    """Fixed-point: class 0; byte order, signedness; bit offset 0, precision = size."""
    flags = (1 if big else 0) | (8 if signed else 0)
    return struct.pack("<BBBBIHH", 0x10, flags, 0, 0, size, 0, 8 * size)


def _float(size: int, *, big: bool) -> bytes:
    """Floating-point: class 1; byte order, normalisation, sign bit; the field layout."""
    sign, e_loc, e_size, m_loc, m_size, bias, norm, precision = _float_layout(size)
    flags = (1 if big else 0) | norm << 4
    return struct.pack(
        "<BBBBIHHBBBBI",
        0x11,
        flags,
        sign,
        0,
        size,
        0,
        precision,
        e_loc,
        e_size,
        m_loc,
        m_size,
        bias,
    )


def _float_layout(size: int) -> tuple[int, int, int, int, int, int, int, int]:
    if size != 16:
        return _FLOATS[size]
    import numpy as np

    info = np.finfo(np.longdouble)
    if info.nmant == 63 and info.nexp == 15:
        return _X87
    if info.nmant == 112 and info.nexp == 15:
        return _QUAD
    raise ValueError(f"numpy's longdouble here (nmant={info.nmant}) has no HDF5 description")
