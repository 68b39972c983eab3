"""The XOR code of ``redundancy="xor"`` in one process: the sets and the grid (pure), and the
encode and rebuild of :mod:`resilient.io.xorwire` over an in-process channel, one thread per
member, for every set size from 3 to 8 and every subset of lost members (as redset's test does):
a set recovers exactly when at most one member is lost, bit for bit, and a corrupted parity is
detected. The same code runs over MPI in tests/test_multinode.py."""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient.checkpoint.partner import Ring
from resilient.checkpoint.xorsets import Holdings, ParityHeld, plan_staging_rebuild, plan_xor
from resilient.io import fileio, xorwire
from resilient.io.xorwire import DataStream, LostMember, Share, contribute, encode, receive_lost
from resilient.model.codec import manifest_json
from resilient.model.layout import Layout
from resilient.model.manifest import DatasetTable, FileEntry, Manifest, RankEntry, Segment
from resilient.model.xorcode import (
    ALIGN,
    chunk_size,
    column_range,
    ring_schedule,
    sets_of,
    xor_into,
)


class Net:
    """A channel between ``n`` ranks of this process: one queue per ordered pair."""

    def __init__(self, n: int) -> None:
        self.queues = {(a, b): queue.Queue[bytes]() for a in range(n) for b in range(n) if a != b}

    def end(self, rank: int) -> _End:
        return _End(self, rank)


class _End:
    def __init__(self, net: Net, rank: int) -> None:
        self.net, self.rank = net, rank

    def send(self, dest: int, data: bytes | bytearray | memoryview) -> None:
        self.net.queues[(self.rank, dest)].put(bytes(data))

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        msg = self.net.queues[(source, self.rank)].get(timeout=60)
        if len(msg) != len(into):
            raise ValueError(f"a message of {len(msg)} bytes, {len(into)} expected")
        into[:] = msg


def run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each function on a thread of its own; their results (an exception re-raised)."""
    out: list[Any] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # re-raised below
            out[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def stream(directory: Path, files: dict[str, int]) -> DataStream:
    return DataStream(
        [
            (n, s, functools.partial(fileio.FileReader, directory / n))
            for n, s in sorted(files.items())
        ]
    )


def make_members(tmp_path: Path, n: int, seed: int) -> list[dict[str, int]]:
    """``n`` members' files of uneven sizes (one member's file empty, one not a whole page)."""
    rng = np.random.default_rng(seed)
    members = []
    for j in range(n):
        d = tmp_path / f"m{j}"
        d.mkdir()
        sizes = {
            "rank_00000.h5": int(rng.integers(1, 30_000)),
            "rank_00001.h5": 0 if j == 1 else 977 * (j + 1),
        }
        for name, size in sizes.items():
            (d / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        members.append(sizes)
    return members


def encode_set(tmp_path: Path, members: list[dict[str, int]]) -> tuple[int, list[str]]:
    n = len(members)
    chunk = chunk_size([sum(m.values()) for m in members])
    net = Net(n)

    def one(j: int) -> tuple[str, str | None]:
        data = stream(tmp_path / f"m{j}", members[j])
        parity = fileio.FileWriter(tmp_path / f"m{j}" / "parity", direct=False)
        try:
            return encode(net.end(j), (j - 1) % n, (j + 1) % n, j, n, chunk, data, parity)
        finally:
            parity.close(sync=False)
            data.close()

    got = run_all([functools.partial(one, j) for j in range(n)])
    assert [p for _, p in got] == [None] * n
    return chunk, [d for d, _ in got]


def rebuild(
    tmp_path: Path, members: list[dict[str, int]], chunk: int, digests: list[str], lost: int
) -> tuple[xorwire.Rebuilt, list[str | None]]:
    """Rebuild member ``lost`` into ``tmp_path/new``: the survivors in ring order after it."""
    n = len(members)
    chain = [(lost + i) % n for i in range(1, n)]
    net = Net(n)
    new = tmp_path / "new"
    new.mkdir(exist_ok=True)

    def survivor(pos: int) -> str | None:
        j = chain[pos]
        data = stream(tmp_path / f"m{j}", members[j])
        parity = fileio.FileReader(tmp_path / f"m{j}" / "parity")
        try:
            return contribute(
                net.end(j), chain[pos - 1] if pos else None,
                chain[pos + 1] if pos + 1 < len(chain) else lost,
                n, chunk, Share(j, chunk, data, parity, digests[j]),
            )  # fmt: skip
        finally:
            parity.close()
            data.close()

    def replacement() -> xorwire.Rebuilt:
        parity = fileio.FileWriter(new / "parity", direct=False)
        try:
            files = LostMember(lost, tuple(sorted(members[lost].items())))
            opener = lambda name: fileio.FileWriter(new / name, direct=False)  # noqa: E731
            return receive_lost(net.end(lost), chain[-1], files, n, chunk, opener, parity)
        finally:
            parity.close(sync=False)

    got = run_all([lambda p=p: survivor(p) for p in range(len(chain))] + [replacement])
    return got[-1], got[:-1]


# ---------------------------------------------------------------------- pure


def test_sets_hold_at_most_the_set_size_and_never_fewer_than_three() -> None:
    assert sets_of(2, 8) == () and sets_of(1, 8) == ()
    assert [s.members for s in sets_of(8, 8)] == [tuple(range(8))]
    assert [len(s) for s in sets_of(9, 8)] == [5, 4]
    assert [len(s) for s in sets_of(17, 8)] == [6, 6, 5]
    assert [len(s) for s in sets_of(4, 3)] == [4]  # two sets of 2 would be too small
    for nodes in range(3, 40):
        for size in range(3, 10):
            sets = sets_of(nodes, size)
            assert [m for s in sets for m in s.members] == list(range(nodes))
            assert all(len(s) >= 3 for s in sets)
            if size >= 6:
                assert all(len(s) <= size for s in sets)
    with pytest.raises(ValueError, match="at least 3"):
        sets_of(5, 2)


def test_each_member_holds_a_seventh_of_the_largest_at_eight() -> None:
    assert chunk_size([7 * ALIGN * 10] * 8) == ALIGN * 10
    assert chunk_size([0, 0, 0]) == ALIGN
    assert chunk_size([1, 2 * ALIGN + 1, 5]) == 2 * ALIGN  # ceil(8193 / 2) rounded to pages


def test_the_grid_places_every_byte_of_a_member_once() -> None:
    for n in range(3, 9):
        for j in range(n):
            starts = sorted(column_range(j, k, 100)[0] for k in range(n) if k != j)
            assert starts == [i * 100 for i in range(n - 1)]
            with pytest.raises(ValueError):
                column_range(j, j, 100)
            rounds = ring_schedule(j, n)
            assert rounds[-1][1] == j and len({s for s, _ in rounds}) == n - 1
            assert j not in {s for s, _ in rounds}


def test_xor_into_handles_a_tail_shorter_than_a_word() -> None:
    a, b = bytearray(b"\x01" * 11), bytes(range(11))
    xor_into(memoryview(a), memoryview(b))
    assert a == bytes(x ^ 1 for x in range(11))


# ---------------------------------------------------------------------- over a channel


@pytest.mark.parametrize("n", range(3, 9))
def test_every_loss_of_one_member_is_rebuilt_bit_for_bit(tmp_path: Path, n: int) -> None:
    members = make_members(tmp_path, n, seed=n)
    chunk, digests = encode_set(tmp_path, members)
    for j in range(n):  # the parity is the XOR of its column, as the grid says
        expected = bytearray(chunk)
        for i in range(n):
            if i != j:
                start, _ = column_range(i, j, chunk)
                piece = bytearray(chunk)
                data = stream(tmp_path / f"m{i}", members[i])
                data.read(memoryview(piece), start)
                xor_into(memoryview(expected), memoryview(piece))
        assert (tmp_path / f"m{j}" / "parity").read_bytes() == expected
    for lost in range(n):
        got, problems = rebuild(tmp_path, members, chunk, digests, lost)
        assert got.error is None and problems == [None] * (n - 1)
        assert got.parity_digest == digests[lost]
        for name in members[lost]:
            assert (tmp_path / "new" / name).read_bytes() == (
                tmp_path / f"m{lost}" / name
            ).read_bytes(), (n, lost, name)
        for f in (tmp_path / "new").iterdir():
            f.unlink()


def one_rank_per_node(n: int, sizes: list[int]) -> tuple[Ring, Layout, str]:
    layout = Layout("self", n, tuple((r,) for r in range(n)))
    h = "0123456789abcdef"
    files = tuple(
        FileEntry(f"rank_{r:05d}.h5", sizes[r], h, (r,), (Segment(0, sizes[r], h),))
        for r in range(n)
    )
    ranks = tuple(RankEntry(f"rank_{r:05d}.h5", DatasetTable.of([])) for r in range(n))
    text = manifest_json(Manifest(step=7, time=1.0, layout=layout, files=files, ranks=ranks))
    return Ring.of([(r, f"n{r}") for r in range(n)]), layout, text


@pytest.mark.parametrize("n", range(3, 9))
def test_a_set_is_rebuilt_exactly_when_at_most_one_node_is_lost(n: int) -> None:
    sizes = [5000 + 100 * r for r in range(n)]
    ring, layout, text = one_rank_per_node(n, sizes)
    (xset,) = sets_of(n, 8)
    parity = ParityHeld(xset.members, chunk_size(sizes), "d")
    for k in range(n + 1):
        for lost in itertools.combinations(range(n), k):
            inventories = {
                r: ({} if r in lost else {7: (text, {f"rank_{r:05d}.h5": "own"})}) for r in range(n)
            }
            parities = {r: ({} if r in lost else {7: parity}) for r in range(n)}
            plan, why = plan_xor(inventories, parities, ring, (xset,), layout)
            if k <= 1:
                assert plan is not None and why is None
                assert plan.lost == tuple((0, m) for m in lost)
            elif k == n:  # no node holds anything: nothing to rebuild, nothing to say
                assert plan is None and why is None
            else:
                assert plan is None and why is not None and "of one XOR set were all lost" in why
                assert all(f"n{m}" in why for m in lost)
    # one survivor without the parity (or of another chunk): that set cannot be rebuilt
    inventories = {
        r: ({} if r == 0 else {7: (text, {f"rank_{r:05d}.h5": "own"})}) for r in range(n)
    }
    other = ParityHeld(xset.members, parity.chunk + 4096, "d")
    parities = {r: ({} if r == 0 else {7: other if r == 1 else parity}) for r in range(n)}
    plan, why = plan_xor(inventories, parities, ring, (xset,), layout)
    assert plan is None and why is not None and "node(s) n1 of its XOR set hold no parity" in why


def test_a_corrupted_parity_chunk_is_detected(tmp_path: Path) -> None:
    n = 4
    members = make_members(tmp_path, n, seed=11)
    chunk, digests = encode_set(tmp_path, members)
    parity = tmp_path / "m2" / "parity"
    raw = bytearray(parity.read_bytes())
    raw[5] ^= 0xFF
    parity.write_bytes(raw)
    got, problems = rebuild(tmp_path, members, chunk, digests, lost=0)
    assert problems[1] is not None and "digest" in problems[1]  # member 2 is second in the chain
    assert got.error is not None and "could not contribute" in got.error


def test_an_unreadable_survivor_file_completes_the_stream_and_says_so(tmp_path: Path) -> None:
    n = 3
    members = make_members(tmp_path, n, seed=5)
    chunk, digests = encode_set(tmp_path, members)
    (tmp_path / "m2" / "rank_00000.h5").unlink()
    got, problems = rebuild(tmp_path, members, chunk, digests, lost=0)
    assert problems[0] is None and problems[1] is not None and "rank_00000.h5" in problems[1]
    assert got.error is not None


def test_a_lost_member_is_rebuilt_onto_a_survivor_that_adds_its_own_share(
    tmp_path: Path,
) -> None:
    n = 5
    members = make_members(tmp_path, n, seed=3)
    chunk, digests = encode_set(tmp_path, members)
    lost, receiver = 2, 4
    chain = [j for j in range(n) if j not in (lost, receiver)] + [receiver]
    net = Net(n)
    new = tmp_path / "new"
    new.mkdir()

    def share(j: int) -> Share:
        data = stream(tmp_path / f"m{j}", members[j])
        return Share(j, chunk, data, fileio.FileReader(tmp_path / f"m{j}" / "parity"), digests[j])

    def survivor(at: int) -> str | None:
        prev = chain[at - 1] if at else None
        return contribute(net.end(chain[at]), prev, chain[at + 1], n, chunk, share(chain[at]))

    def receive() -> xorwire.Rebuilt:
        files = LostMember(lost, tuple(sorted(members[lost].items())))
        return receive_lost(
            net.end(receiver), chain[-2], files, n, chunk,
            lambda name: fileio.FileWriter(new / name, direct=False),
            fileio.FileWriter(new / "parity", direct=False), share=share(receiver),
        )  # fmt: skip

    got = run_all([functools.partial(survivor, i) for i in range(len(chain) - 1)] + [receive])
    assert got[-1].error is None and got[:-1] == [None] * (len(chain) - 1)
    for name in members[lost]:
        assert (new / name).read_bytes() == (tmp_path / f"m{lost}" / name).read_bytes()


def test_an_elastic_staging_plans_one_lost_node_per_set_onto_the_roomiest_survivor() -> None:
    files = tuple(((f"rank_{j:05d}.h5", 1000 + j),) for j in range(4))
    labels = ("a", "b", "c", "d")

    def parity(j: int) -> ParityHeld:
        return ParityHeld((0, 1, 2, 3), 4096, "x", labels, j, files)

    def node(label: str, free: int, *, holds: bool = True) -> Holdings:
        j = labels.index(label)
        return Holdings(
            label, free, {9: parity(j)}, {9: frozenset({files[j][0][0]})} if holds else {}
        )

    # a job on a, c and d: b is gone; d has the most room
    plan, why = plan_staging_rebuild(
        {0: node("a", 10**6), 2: node("c", 10**6), 3: node("d", 10**7)}
    )
    assert why is None and plan is not None
    (r,) = plan
    assert (r.step, r.lost, r.chunk) == (9, 1, 4096) and r.chain[-1] == (3, 3)
    assert [j for _, j in r.chain] == [0, 2, 3]
    # nothing lost: nothing to do
    everyone = {i: node(x, 10**6) for i, x in enumerate(labels)}
    assert plan_staging_rebuild(everyone) == (None, None)
    # two lost, one survivor absent, no room: none, and why
    two = plan_staging_rebuild({0: node("a", 10**6), 3: node("d", 10**6)})
    assert two[0] is None and two[1] is not None and "nodes b, c of one XOR set" in two[1]
    absent = plan_staging_rebuild(
        {0: node("a", 10**6), 2: node("c", 10**6, holds=False)} | {3: node("d", 10**6)}
    )
    assert absent[0] is None and absent[1] is not None
    full = plan_staging_rebuild({0: node("a", 10), 2: node("c", 10), 3: node("d", 10)})
    assert (
        full[0] is None
        and full[1] is not None
        and "do not fit" in full[1]
        and "(1001 bytes)" in full[1]
    )
