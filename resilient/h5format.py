"""HDF5 metadata of a checkpoint file, computed without HDF5. Pure: no I/O, no h5py.

:func:`plan_file` lays out a file for a group of ranks: its bytes of HDF5 metadata, where each
dataset's data goes, and the file's size. :mod:`resilient.hdf5` writes those bytes; each rank
then writes its arrays' bytes at their offsets. h5py built the same structure at ~22 us per
dataset (4,000 datasets: 90-150 ms, most of a "first save" whose target is ~18 ms); this module
takes ~0.3-0.5 us per dataset (the numbers are in the commit that added it and in
``tests/unit/test_h5format.py``), because equal records (object headers of datasets of one
dtype and rank, symbol table entries, B-tree keys) are built as numpy record arrays, not one by
one.

The format is HDF5's oldest, which every HDF5 reader since 1.8 reads (h5py, h5ls, h5dump),
and which has no checksums and fixed-size records:

* superblock version 0 (8-byte addresses and lengths);
* object headers version 1, each one chunk, no modification times;
* groups as symbol tables: a version 1 B-tree (``TREE``, type 0) of one node, whose children
  are symbol table nodes (``SNOD``) holding the entries sorted by name (``strcmp`` of the UTF-8
  bytes), and a local heap (``HEAP``) holding the names; a group's cached entry carries its
  B-tree and heap addresses, as HDF5 writes them;
* datasets: dataspace message version 1 (rank 0 is a scalar; maximum dims = dims), datatype
  message version 1, fill value message version 2 (allocation early, fill never, the default
  fill value: what h5py's skeletons had, and ``Dataset.fillvalue`` works; an *undefined* fill
  value makes it raise), data layout message version 3, contiguous (an empty dataset has the
  undefined address and size 0);
* attributes: message version 1: ``resilient_layout`` (a fixed-length, NUL-padded string:
  h5py reads it as ``bytes``) and ``resilient_ranks`` (int64 array) on the root group, ``rank``
  (int64 scalar) on each rank's group.

Datatypes are the ones h5py writes for the numpy dtypes :func:`resilient.manifest.dtype_itemsize`
accepts, so h5py reads every dataset back with the dtype it had: integers and IEEE floats of
either byte order; ``f16`` (``numpy.longdouble``: x87's 80-bit format in 16 bytes on x86-64,
IEEE quad elsewhere); ``b1`` as an 8-bit enum ``FALSE=0, TRUE=1``; complex numbers as a compound
of ``r`` and ``i``.

The K values of the superblock (entries per symbol table node: 2 x "leaf K"; children per
B-tree node: 2 x "internal K") hold for the whole file. They are chosen per file so that every
group's B-tree is one node and the metadata is smallest; equal structures get equal values.

Layout of a file (every piece of metadata on an 8-byte boundary)::

    superblock | headers of the root and rank groups | headers of the other groups |
    B-tree nodes | local heaps | symbol table nodes | dataset headers, by (dtype, rank) |
    data: rank by rank, datasets in the order given

All metadata is one run at the start. Datasets of at least 1 MiB (written with ``O_DIRECT``)
start on 4,096-byte boundaries, smaller ones on 64-byte boundaries one after the other (their
views are aligned, and 4,000 small arrays are one run of data). The zeros between two datasets,
if any, are pieces of their own, so that pieces and datasets tile the file.
"""

from __future__ import annotations

import functools
import itertools
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resilient.layout import rank_group_name

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["ArraySpec", "FileLayout", "datatype_message", "plan_file"]

DIRECT_MIN = 1 << 20  # datasets from this size are written with O_DIRECT: page-aligned
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


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array a rank wants written: its name, shape and dtype string."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class FileLayout:
    """A file as :func:`plan_file` laid it out.

    Attributes:
        pieces: the bytes that are not datasets' data, as ``(offset, bytes)`` sorted by offset:
            the metadata (one piece from offset 0, up to the first dataset), then the zeros
            between datasets, if any. Pieces and non-empty datasets tile the file.
        offsets: per rank, each dataset's data offset (``None`` for an empty dataset).
        size: the file's size.
    """

    pieces: tuple[tuple[int, bytes], ...]
    offsets: dict[int, dict[str, int | None]]
    size: int


def plan_file(layout_kind: str, ranks: Sequence[tuple[int, Sequence[ArraySpec]]]) -> FileLayout:
    """Lay out the HDF5 file of a group of ranks.

    Each rank gets a group ``/rank_00003``; a dataset ``model/layer1.weight`` of that rank is
    dataset ``layer1.weight`` of group ``/rank_00003/model``. Equal arguments give equal bytes.

    Args:
        layout_kind: stored as the root's ``resilient_layout`` attribute.
        ranks: per rank of the group, its rank and its array specs.

    Raises:
        ValueError: a name HDF5 cannot hold (empty, or with an empty component or a NUL), two
            datasets of one name, a name both a group and a dataset, a rank listed twice, an
            unsupported dtype, a negative dimension, more than 32 dimensions, or more ranks
            than one attribute holds (8,183).
    """
    import numpy as np

    tree = _Tree()
    for rank, specs in ranks:
        tree.add_rank(int(rank), specs)
    if len(set(tree.ranks)) != len(tree.ranks):
        raise ValueError(f"a rank is listed twice: {tree.ranks}")
    datasets = _Datasets(tree)
    links = _Links(tree)
    n_groups = len(tree.g_parent)
    lk, ik = _choose_k(links.counts)
    cap = 2 * lk  # entries per symbol table node
    n_nodes = -(-links.counts // cap)  # symbol table nodes per group
    node_first = np.cumsum(n_nodes) - n_nodes
    total_nodes = int(n_nodes.sum())

    # --- addresses (every structure starts on an 8-byte boundary) ---
    special = [_group_header(tree, g, layout_kind) for g in tree.special]
    header_addr = np.zeros(n_groups, np.int64)
    pos = _SUPERBLOCK
    for g, image in zip(tree.special, special, strict=True):
        header_addr[g] = pos
        pos += len(image)
    plain = np.array(tree.plain, dtype=np.int64)
    header_addr[plain] = pos + _PLAIN_GROUP * np.arange(plain.size)
    pos += _PLAIN_GROUP * plain.size
    btree_words = 4 + 4 * ik  # 3 words of header, 2K+1 keys, 2K children
    btree_addr = pos + 8 * btree_words * np.arange(n_groups)
    pos += 8 * btree_words * n_groups
    heap_size = 32 + links.heap_data
    heap_addr = pos + np.cumsum(heap_size) - heap_size
    pos += int(heap_size.sum())
    node_words = 1 + 5 * cap
    node_base = pos
    pos += 8 * node_words * total_nodes
    class_base = []
    for c in datasets.classes:
        class_base.append(pos)
        datasets.header_addr[c.members] = pos + c.size * np.arange(c.members.size)
        pos += c.size * c.members.size
    offsets, size, first_data, gaps = _place_data(datasets.nbytes, pos)

    # --- the bytes ---
    out = np.zeros(-(-first_data // 8) * 8, np.uint8)
    words = out.view("<u8")
    superblock = _superblock(lk, ik, size, header_addr[0], btree_addr[0], heap_addr[0])
    out[:_SUPERBLOCK] = np.frombuffer(superblock, np.uint8)
    for g, image in zip(tree.special, special, strict=True):
        a = int(header_addr[g])
        out[a : a + len(image)] = np.frombuffer(image, np.uint8)
        # its first message is the symbol table's: after the prefix and the message header
        words[a // 8 + 3] = btree_addr[g]
        words[a // 8 + 4] = heap_addr[g]
    if plain.size:
        w = words[int(header_addr[plain[0]]) // 8 :][: 5 * plain.size].reshape(plain.size, 5)
        w[:, 0] = 1 | 1 << 16 | 1 << 32  # version 1, one message, reference count 1
        w[:, 1] = 24  # the message: its 8-byte header and 16 bytes
        w[:, 2] = _SYMBOL_TABLE | 16 << 16
        w[:, 3] = btree_addr[plain]
        w[:, 4] = heap_addr[plain]

    # B-tree nodes: 3 words of header, then key 0, child 0, key 1, ..., child n-1, key n; key 0
    # is "" (heap offset 0) and key i+1 the last name of child i
    bt = words[int(btree_addr[0]) // 8 :][: btree_words * n_groups].reshape(n_groups, btree_words)
    bt[:, 0] = np.uint64(_TREE_WORD) | n_nodes.astype(np.uint64) << np.uint64(48)
    bt[:, 1:3] = _UNDEF  # no siblings
    node_group = np.repeat(np.arange(n_groups), n_nodes)
    j = np.arange(total_nodes) - node_first[node_group]  # each node's index in its group
    last = links.first[node_group] + np.minimum((j + 1) * cap, links.counts[node_group]) - 1
    bt[node_group, 4 + 2 * j] = node_base + 8 * node_words * np.arange(total_nodes)
    bt[node_group, 5 + 2 * j] = links.heap_offset[last]

    # local heaps: a prefix of 4 words, then "" at offset 0 and the names in sorted order
    hw = heap_addr // 8
    words[hw] = _HEAP_WORD
    words[hw + 1] = links.heap_data
    words[hw + 2] = _HEAP_FREE_NONE
    words[hw + 3] = heap_addr + 32
    if links.n:
        src = np.frombuffer(links.sorted_names(), np.uint8)
        ends = np.cumsum(links.sorted_lens)
        dest = heap_addr[links.parent] + 32 + links.heap_offset - (ends - links.sorted_lens)
        out[np.repeat(dest, links.sorted_lens) + np.arange(src.size)] = src

    # symbol table nodes: a word of header ("SNOD", version, count), then 5 words per entry:
    # name's heap offset, object header, cache type, and a group's B-tree and heap
    if total_nodes:
        in_group = np.arange(links.n) - links.first[links.parent]
        node = node_first[links.parent] + in_group // cap
        count = np.bincount(node, minlength=total_nodes).astype(np.uint64)
        nw = node_base // 8 + node_words * np.arange(total_nodes)
        words[nw] = np.uint64(_SNOD_WORD) | count << np.uint64(48)
        ew = node_base // 8 + node_words * node + 1 + 5 * (in_group % cap)
        target = links.order - datasets.n + 1  # a group link's group, else <= 0
        is_group = target > 0
        group = target[is_group]
        header = np.zeros(links.n, np.int64)
        header[~is_group] = datasets.header_addr[links.order[~is_group]]
        header[is_group] = header_addr[group]
        words[ew] = links.heap_offset
        words[ew + 1] = header
        words[ew[is_group] + 2] = _LINK_GROUP
        words[ew[is_group] + 3] = btree_addr[group]
        words[ew[is_group] + 4] = heap_addr[group]

    # dataset headers, one block of equal records per class
    for c, base in zip(datasets.classes, class_base, strict=True):
        rows = c.rows(offsets[c.members], datasets.nbytes[c.members])
        out[base : base + rows.nbytes] = rows.view(np.uint8).reshape(-1)

    pieces = [(0, out[:first_data].tobytes()), *((o, bytes(n)) for o, n in gaps)]
    return FileLayout(tuple(pieces), tree.offsets(offsets, datasets.nbytes), size)


_PLAIN_GROUP = 40  # header of a group without attributes: prefix + symbol table message


class _Tree:
    """The groups and datasets of a file, in flat lists.

    Group 0 is the root; ``special`` groups (the root, the ranks') have attributes, ``plain``
    ones (nested: ``model`` in ``model/layer1.weight``) have none. Datasets are numbered rank
    by rank, in the order given.
    """

    def __init__(self) -> None:
        self.g_parent: list[int] = [-1]
        self.g_name: list[str] = [""]
        self.special: list[int] = [0]
        self.plain: list[int] = []
        self.rank_of: dict[int, int] = {}  # group -> rank, for ranks' groups
        self.ranks: list[int] = []
        self.rank_slices: list[tuple[int, int, int]] = []  # rank, first dataset, end
        self.names: list[str] = []
        self.leaves: list[str] = []
        self.d_parent: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []

    def add_rank(self, rank: int, specs: Sequence[ArraySpec]) -> None:
        gid = self._new_group(0, rank_group_name(rank), special=True)
        self.rank_of[gid] = rank
        self.ranks.append(rank)
        names = [s.name for s in specs]
        _check_names(names)
        parts = [n.rpartition("/") for n in names]
        paths = {"": gid}
        for path in dict.fromkeys([p[0] for p in parts]):  # in order: equal input, equal ids
            self._subgroup(paths, path)
        start = len(self.names)
        self.names += names
        self.leaves += [p[2] for p in parts]
        self.d_parent += [paths[p[0]] for p in parts]
        self.shapes += [tuple(s.shape) for s in specs]
        self.dtypes += [s.dtype for s in specs]
        self.rank_slices.append((rank, start, len(self.names)))

    def _new_group(self, parent: int, name: str, *, special: bool) -> int:
        gid = len(self.g_parent)
        self.g_parent.append(parent)
        self.g_name.append(name)
        (self.special if special else self.plain).append(gid)
        return gid

    def _subgroup(self, paths: dict[str, int], path: str) -> int:
        found = paths.get(path)
        if found is None:
            head, _, last = path.rpartition("/")
            found = self._new_group(self._subgroup(paths, head), last, special=False)
            paths[path] = found
        return found

    def offsets(
        self, offsets: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> dict[int, dict[str, int | None]]:
        """Per rank, each dataset's offset (``None`` if empty)."""
        values: list[int | None] = offsets.tolist()
        for i in (nbytes == 0).nonzero()[0].tolist():
            values[i] = None
        return {
            rank: dict(zip(self.names[a:b], values[a:b], strict=True))
            for rank, a, b in self.rank_slices
        }


def _check_names(names: list[str]) -> None:
    """Raise ValueError unless every name is a valid path: non-empty components, no NUL."""
    if "\0" in "".join(names):
        bad = next(n for n in names if "\0" in n)
        raise ValueError(f"dataset name {bad!r} contains a NUL character")
    joined = "\0" + "\0".join(names) + "\0"
    if "\0\0" in joined or "\0/" in joined or "/\0" in joined or "//" in joined:
        bad = next(n for n in names if "" in n.split("/"))
        raise ValueError(f"dataset name {bad!r} has an empty component (HDF5 cannot hold it)")


class _DatasetClass:
    """Datasets of one dtype and rank: their object headers are equal records but for dims,
    data address and size, so they are built as one numpy record array."""

    def __init__(self, dtype: str, ndim: int) -> None:
        import numpy as np

        dt, self.itemsize = datatype_message(dtype)
        self.ndim = ndim
        self.members: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        space = _dataspace(ndim, [0] * ndim)
        dt_padded = _pad8(dt)
        messages = [
            _message(_DATASPACE, space, 0),
            _message(_DATATYPE, dt_padded, _CONSTANT),
            _message(_FILL, _FILL_DEFAULT, _CONSTANT),
            _message(_LAYOUT, struct.pack("<BBQQ6x", 3, 1, 0, 0), _CONSTANT),
        ]
        body = b"".join(messages)
        self.template = _header_prefix(len(messages), len(body)) + body
        self.size = len(self.template)
        layout = self.size - 32  # the layout message's header
        fields: dict[str, tuple[str, int]] = {
            "flags": ("u1", layout + 4),
            "addr": ("<u8", layout + 10),
            "nbytes": ("<u8", layout + 18),
        }
        if ndim:
            fields["dims"] = (f"({ndim},)<u8", 32)
            fields["maxdims"] = (f"({ndim},)<u8", 32 + 8 * ndim)
        self.record = np.dtype(
            {
                "names": list(fields),
                "formats": [f for f, _ in fields.values()],
                "offsets": [o for _, o in fields.values()],
                "itemsize": self.size,
            }
        )

    def rows(
        self, offsets: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.void]:
        """The object headers of :attr:`members`, given their offsets and sizes."""
        import numpy as np

        n = self.members.size
        # a bytearray, not a copy: a copy of records need not copy the bytes outside fields
        rows = np.frombuffer(bytearray(self.template * n), dtype=self.record)
        allocated = nbytes > 0
        rows["flags"] = allocated  # HDF5 marks an allocated layout constant
        rows["addr"] = np.where(allocated, offsets, -1).astype(np.uint64)
        rows["nbytes"] = nbytes
        if self.ndim:
            rows["dims"] = self.dims
            rows["maxdims"] = self.dims
        return rows

    dims: npt.NDArray[np.int64]


class _Datasets:
    """Every dataset's class, dims, size in bytes and (filled in later) header address."""

    def __init__(self, tree: _Tree) -> None:
        import numpy as np

        n = self.n = len(tree.names)
        ndims = np.fromiter(map(len, tree.shapes), np.int64, n)
        flat = np.fromiter(itertools.chain.from_iterable(tree.shapes), np.int64, int(ndims.sum()))
        if flat.size and flat.min() < 0:
            raise ValueError("a dataset has a negative dimension")
        if n and ndims.max() > _MAX_RANK:
            raise ValueError(f"a dataset has more than {_MAX_RANK} dimensions")
        starts = np.cumsum(ndims) - ndims
        class_of: dict[tuple[str, int], int] = {}
        keys = zip(tree.dtypes, ndims.tolist(), strict=True)
        cls = np.fromiter((class_of.setdefault(k, len(class_of)) for k in keys), np.int64, n)
        self.classes = [_DatasetClass(dtype, ndim) for dtype, ndim in class_of]
        self.nbytes = np.zeros(n, np.int64)
        self.header_addr = np.zeros(n, np.int64)
        if len(self.classes) == 1:
            self.classes[0].members = np.arange(n)
        else:
            by_class = np.argsort(cls, kind="stable")
            bounds = np.searchsorted(cls[by_class], np.arange(len(self.classes) + 1))
            for i, c in enumerate(self.classes):
                c.members = by_class[bounds[i] : bounds[i + 1]]
        for c in self.classes:
            dims = flat[starts[c.members][:, None] + np.arange(c.ndim)]
            # sizes up to 2**62 bytes (HDF5 takes 64-bit sizes; numpy products would wrap)
            if dims.size and np.log2(np.maximum(dims, 1)).sum(axis=1).max() > 62 - c.itemsize:
                raise ValueError("a dataset is too large")
            c.dims = dims
            self.nbytes[c.members] = dims.prod(axis=1) * c.itemsize


class _Links:
    """Every link (each dataset's, then each group's but the root's), sorted by parent group,
    then by name: a group's links are one run, in HDF5's order.

    Attributes:
        order: link numbers in sorted order (datasets first: link ``i < n_datasets`` is dataset
            ``i``, then group ``i - n_datasets + 1``).
        parent: each sorted link's group.
        counts: links per group; ``first``: each group's first sorted link.
        heap_offset: each sorted link's name's offset in its group's local heap.
        heap_data: size of each group's heap data.
    """

    def __init__(self, tree: _Tree) -> None:
        import numpy as np

        names = [*tree.leaves, *tree.g_name[1:]]
        self.n = len(names)
        n_groups = len(tree.g_parent)
        # one encode and one split for all names: the names hold no NUL (checked)
        self.encoded = "\0".join(names).encode("utf-8").split(b"\0") if names else []
        parent = np.array([*tree.d_parent, *tree.g_parent[1:]], dtype=np.int64)
        lens = np.fromiter(map(len, self.encoded), np.int64, self.n)
        self.order = _sort_links(self.encoded, parent, lens, names)
        self.parent = parent[self.order]
        self.counts = np.bincount(self.parent, minlength=n_groups).astype(np.int64)
        self.first = np.cumsum(self.counts) - self.counts
        self.sorted_lens = lens[self.order]
        padded = (self.sorted_lens // 8 + 1) * 8  # the name, its NUL, padded to 8 bytes
        before = np.cumsum(padded) - padded
        self.heap_offset = 8 + before - before[self.first][self.parent] if self.n else before
        self.heap_data = 8 + np.bincount(self.parent, weights=padded, minlength=n_groups).astype(
            np.int64
        )

    def sorted_names(self) -> bytes:
        return b"".join([self.encoded[i] for i in self.order.tolist()])


_SORT_BYTES = 1 << 27  # above this many bytes of fixed-width names, sort in Python


def _sort_links(
    encoded: list[bytes], parent: npt.NDArray[np.int64], lens: npt.NDArray[np.int64], names: list[str]
) -> npt.NDArray[np.int64]:
    """Link numbers sorted by parent, then name bytes (``strcmp``'s order); ValueError on
    two links of one name in one group."""
    import numpy as np

    n = len(encoded)
    if n == 0:
        return np.zeros(0, np.int64)
    width = int(lens.max())
    if n * width <= _SORT_BYTES:  # numpy compares fixed-width bytes as unsigned, like strcmp
        fixed = np.array(encoded, dtype=f"S{width}")
        order = np.lexsort((fixed, parent))
        same = fixed[order[1:]] == fixed[order[:-1]]
    else:  # one very long name among many: fixed width would take too much memory
        keys = list(zip(parent.tolist(), encoded, strict=True))
        order = np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
        same = np.array([encoded[a] == encoded[b] for a, b in itertools.pairwise(order.tolist())])
    dup = np.flatnonzero(same & (parent[order[1:]] == parent[order[:-1]]))
    if dup.size:
        raise ValueError(
            f"two objects named {names[int(order[dup[0]])]!r} in one group "
            "(a dataset given twice, or a name that is both a dataset and a group)"
        )
    return order.astype(np.int64)


def _choose_k(counts: npt.NDArray[np.int64]) -> tuple[int, int]:
    """The superblock's (leaf K, internal K): every group's B-tree is one node (at most 2K
    children of 2 x leaf K entries each) and the metadata is smallest (ties: smaller K)."""
    best: tuple[int, int, int] | None = None
    largest = int(counts.max()) if counts.size else 0
    groups = counts.size
    for lk in (1 << e for e in range(15)):  # up to 2 x 16,384 entries per node
        nodes = -(-counts // (2 * lk))
        ik = max(1, -(-int(nodes.max(initial=0)) // 2))
        if 2 * ik > 0xFFFF:  # a node's entry count is 16 bits
            continue
        total = int(nodes.sum()) * (8 + 80 * lk) + groups * (32 + 32 * ik)
        if best is None or total < best[0]:
            best = (total, lk, ik)
    if best is None:
        raise ValueError(f"a group of {largest} objects is too large")
    return best[1], best[2]


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
    for big in [*np.flatnonzero(nbytes >= DIRECT_MIN).tolist(), n]:
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
        string = struct.pack("<BBxxI", 0x13, 1 | (0 if text.isascii() else 1) << 4, max(len(text), 1))
        attrs = [
            _attribute("resilient_layout", string, _dataspace(0, ()), text or b"\0"),
            _attribute(
                "resilient_ranks",
                int64,
                _dataspace(1, (len(ranks),)),
                struct.pack(f"<{len(ranks)}q", *ranks),
            ),
        ]
    else:
        attrs = [_attribute("rank", int64, _dataspace(0, ()), struct.pack("<q", tree.rank_of[g]))]
    messages = [_message(_SYMBOL_TABLE, bytes(16), 0), *attrs]
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


@functools.lru_cache(maxsize=256)
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
        "<BBBBIHHBBBBI", 0x11, flags, sign, 0, size, 0, precision, e_loc, e_size, m_loc, m_size, bias
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
