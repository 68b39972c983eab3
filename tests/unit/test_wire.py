"""The byte streams of partner copies (:mod:`resilient.io.wire`) over an in-process channel:
a round trip, and every fault leaves a complete stream and an error that says what happened."""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from resilient.io import fileio
from resilient.io.wire import CHUNK, Outgoing, Received, new_hash, receive_files, send_files


class Loopback:
    """A channel between ranks 0 and 1 of this process (one queue per direction)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], queue.Queue[bytes]] = {
            (0, 1): queue.Queue(),
            (1, 0): queue.Queue(),
        }

    def end(self, rank: int) -> _End:
        return _End(self, rank)


class _End:
    def __init__(self, loop: Loopback, rank: int) -> None:
        self.loop = loop
        self.rank = rank

    def send(self, dest: int, data: bytes | bytearray | memoryview) -> None:
        self.loop.queues[(self.rank, dest)].put(bytes(data))

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        msg = self.loop.queues[(source, self.rank)].get(timeout=30)
        if len(msg) != len(into):
            raise ValueError(f"a message of {len(msg)} bytes, {len(into)} expected")
        into[:] = msg


def transfer(
    files: list[Outgoing], directory: Callable[[dict[str, Any]], Path]
) -> tuple[list[str], Received]:
    """Send ``files`` from rank 0 on a thread; receive them on rank 1 here."""
    loop = Loopback()
    sent: list[list[str]] = []
    thread = threading.Thread(
        target=lambda: sent.append(send_files(loop.end(0), 1, {"step": 4}, files))
    )
    thread.start()
    try:
        got = receive_files(loop.end(1), 0, directory)
    finally:
        thread.join(timeout=30)
    return sent[0], got


def outgoing(tmp_path: Path, sizes: dict[str, int]) -> list[Outgoing]:
    src = tmp_path / "src"
    src.mkdir()
    out = []
    for i, (name, size) in enumerate(sizes.items()):
        (src / name).write_bytes(bytes([i + 1]) * size)
        out.append(Outgoing(name, src / name, size, None))
    return out


def into(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    def make(header: dict[str, Any]) -> Path:
        target = tmp_path / f"dst_{header['step']}"
        target.mkdir()
        return target

    return make


def digest_of(data: bytes) -> str:
    h = new_hash()
    h.update(data)
    hexdigest: str = h.hexdigest()
    return hexdigest


def test_files_arrive_whole_and_durable(tmp_path: Path) -> None:
    sizes = {"rank_00000.h5": CHUNK * 2 + 4096, "rank_00001.h5": 123, "rank_00002.h5": 0}
    problems, got = transfer(outgoing(tmp_path, sizes), into(tmp_path))
    assert problems == [] and got.error is None
    assert got.header["step"] == 4 and got.sizes == sizes
    for name in sizes:
        data = (tmp_path / "dst_4" / name).read_bytes()
        assert data == (tmp_path / "src" / name).read_bytes()
        assert got.digests[name] == digest_of(data)


def test_an_unreadable_file_goes_as_zeros_and_the_receiver_is_told(tmp_path: Path) -> None:
    files = outgoing(tmp_path, {"rank_00000.h5": 5000, "rank_00001.h5": 10})
    os.unlink(files[0].path)
    problems, got = transfer(files, into(tmp_path))
    assert len(problems) == 1 and "rank_00000.h5" in problems[0]
    assert got.error is not None and got.error.startswith("the sender could not read it")


def test_a_copy_whose_bytes_changed_since_it_was_recorded_is_refused(tmp_path: Path) -> None:
    (f,) = outgoing(tmp_path, {"rank_00000.h5": 100})
    problems, got = transfer([Outgoing(f.name, f.path, f.size, "0" * 32)], into(tmp_path))
    assert problems == [f"{f.path}: its bytes do not match the digest recorded when copied"]
    assert got.error is not None


def test_a_full_disk_on_the_receiver_reads_the_rest_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: fileio.FileWriter, view: memoryview, pos: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.FileWriter, "write", full)
    sizes = {"rank_00000.h5": CHUNK + 1, "rank_00001.h5": 7}
    problems, got = transfer(outgoing(tmp_path, sizes), into(tmp_path))
    assert problems == []
    assert got.error is not None and "No space left on device" in got.error
    assert got.error.startswith("writing ")


def test_a_directory_that_cannot_be_made_drops_the_stream(tmp_path: Path) -> None:
    def refuse(_: dict[str, Any]) -> Path:
        raise OSError(errno.EROFS, "read-only file system")

    problems, got = transfer(outgoing(tmp_path, {"rank_00000.h5": 10}), refuse)
    assert problems == []
    assert got.error == "creating a directory for the copy: [Errno 30] read-only file system"


def test_a_header_naming_anything_but_a_data_file_is_refused(tmp_path: Path) -> None:
    (f,) = outgoing(tmp_path, {"rank_00000.h5": 10})
    with pytest.raises(ValueError, match="malformed file entry"):
        transfer([Outgoing("../escape.h5", f.path, f.size, None)], into(tmp_path))
