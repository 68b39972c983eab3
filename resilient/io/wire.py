"""Files sent and received over a channel: the byte stream of a partner copy and its rebuild.

One stream carries a header (a JSON document with the files' names and sizes, and whatever the
caller adds), each file's bytes in chunks of :data:`CHUNK`, then a trailer with the files'
digests (xxh3-128) and the first problem the sender met::

    header length (8 bytes, little-endian) | header | file bytes ... | trailer length | trailer

The stream is always complete, so neither side waits for bytes that do not come: a file the
sender cannot read goes as zeros and the trailer says so; a receiver that cannot write (a full
disk) reads the rest and drops it. The files' bytes are read and written with
:class:`~resilient.io.fileio.FileReader` and :class:`~resilient.io.fileio.FileWriter`.

Local: each call pairs with one call on the peer (no collective); a channel is anything with
the two methods of :class:`Channel` (:class:`resilient.parallel.comm.Channel` is one; this
package may not import :mod:`resilient.parallel`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resilient.io import fileio
from resilient.model import filenames
from resilient.model.h5format import PAGE

__all__ = [
    "CHUNK",
    "Channel",
    "digest_file",
    "Outgoing",
    "Received",
    "new_hash",
    "receive_files",
    "recv_doc",
    "send_doc",
    "send_files",
]

CHUNK = 8 << 20  # bytes per message of a file's body
_MAX_DOC = 256 << 20  # the largest header or trailer accepted (a manifest of many ranks)
_MAX_FILE = 1 << 50


class Channel(Protocol):
    """Point-to-point transfers of bytes to and from other ranks, in the order sent."""

    def send(self, dest: int, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` to rank ``dest``; returns once the buffer may be reused."""
        ...

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        """Receive exactly ``len(into)`` bytes from rank ``source`` into ``into``."""
        ...


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A file to send: its name at the destination, where it is here, its size, and the digest
    recorded when it was received as a partner copy (``None`` for a node's own file)."""

    name: str
    path: Path
    size: int
    digest: str | None


@dataclass(frozen=True, slots=True)
class Received:
    """What :func:`receive_files` got: the header, each file's size and digest, and the first
    error (``None``: every file arrived intact and is durable)."""

    header: dict[str, Any]
    sizes: dict[str, int]
    digests: dict[str, str]
    error: str | None


def new_hash() -> Any:
    """A new xxh3-128 hash: the digest a partner copy records of each file."""
    import xxhash

    return xxhash.xxh3_128()


def digest_file(path: Path) -> str:
    """The xxh3-128 digest of the whole file ``path`` (what a partner copy records)."""
    h = new_hash()
    reader = fileio.FileReader(path)
    try:
        size = os.fstat(reader.fd).st_size
        with fileio.Bounce(min(CHUNK, max(size, 1))) as bounce, bounce.lend() as buf:
            for pos in range(0, size, len(buf)):
                view = buf[: min(len(buf), size - pos)]
                reader.read(view, pos)
                h.update(view)
    finally:
        reader.close()
    return str(h.hexdigest())


def send_doc(channel: Channel, dest: int, doc: Any) -> None:
    """Send ``doc`` as JSON, its length first (what :func:`recv_doc` reads)."""
    body = json.dumps(doc).encode()
    channel.send(dest, len(body).to_bytes(8, "little"))
    channel.send(dest, body)


def recv_doc(channel: Channel, source: int, *, limit: int = _MAX_DOC) -> Any:
    """A JSON document :func:`send_doc` sent (at most ``limit`` bytes).

    Raises:
        ValueError: a longer document announced, or one that is not JSON.
    """
    head = bytearray(8)
    channel.recv(source, head)
    size = int.from_bytes(head, "little")
    if size > limit:
        raise ValueError(f"rank {source} announced a message of {size} bytes")
    body = bytearray(size)
    channel.recv(source, body)
    return json.loads(body)


class _Reader:
    """Reads one file chunk by chunk, hashing it; after a problem, hands out zeros."""

    def __init__(self, f: Outgoing) -> None:
        self.path = f.path
        self.hash = new_hash()
        self.problem: str | None = None
        self.file: fileio.FileReader | None = None
        try:
            self.file = fileio.FileReader(f.path)
        except OSError as exc:
            self.problem = f"{f.path}: {exc.strerror or exc}"

    def read(self, view: memoryview, pos: int) -> memoryview:
        if self.problem is None and self.file is not None:
            try:
                self.file.read(view, pos)
                self.hash.update(view)
            except (OSError, EOFError) as exc:
                self.problem = f"{self.path}: {exc}"
        if self.problem is not None:
            view[:] = bytes(len(view))
        return view

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def send_files(
    channel: Channel, dest: int, header: Mapping[str, Any], files: Sequence[Outgoing]
) -> list[str]:
    """Send ``header`` (with the files' names and sizes), each file's bytes, then a trailer with
    their digests; returns the problems found (a file unreadable, short, or not matching its
    recorded digest: its bytes are sent as zeros, and the trailer tells the receiver not to keep
    them). The stream is always complete, so the receiver never waits for bytes that do not
    come. The next chunk is read (and hashed) on a helper thread while one is being sent."""
    send_doc(channel, dest, {**header, "files": [[f.name, f.size] for f in files]})
    size = min(CHUNK, max((f.size for f in files), default=0))
    bufs = (memoryview(bytearray(size)), memoryview(bytearray(size)))
    problems: list[str] = []
    digests: list[str] = []
    with ThreadPoolExecutor(1, thread_name_prefix="resilient-partner-read") as pool:
        for f in files:
            reader = _Reader(f)
            try:
                chunks = [(pos, min(CHUNK, f.size - pos)) for pos in range(0, f.size, CHUNK)]
                ahead = pool.submit(reader.read, bufs[0][: chunks[0][1]], 0) if chunks else None
                for i in range(len(chunks)):
                    assert ahead is not None
                    view = ahead.result()
                    if i + 1 < len(chunks):
                        pos, n = chunks[i + 1]
                        ahead = pool.submit(reader.read, bufs[(i + 1) % 2][:n], pos)
                    channel.send(dest, view)
            finally:
                reader.close()
            digest, problem = reader.hash.hexdigest(), reader.problem
            if problem is None and f.digest is not None and digest != f.digest:
                problem = f"{f.path}: its bytes do not match the digest recorded when copied"
            if problem is not None:
                problems.append(problem)
            digests.append(digest)
    send_doc(channel, dest, {"digests": digests, "error": problems[0] if problems else None})
    return problems


def _check_header(header: Any, source: int) -> list[tuple[str, int]]:
    """The ``(name, size)`` list of a header from ``source`` (which is this library's code;
    still, nothing but a data file's or a manifest shard's name may become a path)."""
    files = header.get("files") if isinstance(header, dict) else None
    if not isinstance(files, list):
        raise ValueError(f"rank {source} sent a malformed header")
    out: list[tuple[str, int]] = []
    for item in files:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not (filenames.is_data_file_name(item[0]) or filenames.is_shard_name(item[0]))
            or not isinstance(item[1], int)
            or not 0 <= item[1] < _MAX_FILE
        ):
            raise ValueError(f"rank {source} sent a malformed file entry {item!r}")
        out.append((item[0], item[1]))
    return out


def receive_files(
    channel: Channel, source: int, directory: Callable[[dict[str, Any]], Path]
) -> Received:
    """Receive what :func:`send_files` sends into ``directory(header)`` (created by it), each
    file fsynced. Chunks are written (and files fsynced) on a helper thread while the next
    chunk arrives. A failure to write (a full disk) does not stop the reception: the rest of
    the stream is read and dropped, and the result names the error."""
    header = recv_doc(channel, source)
    files = _check_header(header, source)
    errors: list[str] = []
    target: Path | None = None
    try:
        target = directory(header)
    except OSError as exc:
        errors.append(f"creating a directory for the copy: {exc}")
    size = min(CHUNK, max((n for _, n in files), default=0))
    half = -(-max(size, 1) // PAGE) * PAGE  # each buffer page-aligned: O_DIRECT takes it as is
    digests: dict[str, str] = {}

    def write(out: fileio.FileWriter | None, view: memoryview, pos: int, name: str) -> None:
        if out is not None and not errors:
            try:
                out.write(view, pos)
            except OSError as exc:
                errors.append(f"writing {name}: {exc.strerror or exc}")

    def close(out: fileio.FileWriter | None, name: str) -> None:
        if out is None:
            return
        try:
            out.close(sync=not errors)
        except OSError as exc:
            errors.append(f"syncing {name}: {exc.strerror or exc}")

    pending: list[Future[None]] = [Future(), Future()]
    for f in pending:
        f.set_result(None)
    with (
        fileio.Bounce(2 * half) as buffer,
        buffer.lend() as both,
        ThreadPoolExecutor(1, thread_name_prefix="resilient-partner-write") as writer,
    ):
        bufs = (both[:size], both[half : half + size])
        i = 0
        for name, nbytes in files:
            h, out = new_hash(), None
            if not errors and target is not None:
                try:
                    out = fileio.FileWriter(target / name, direct=nbytes >= CHUNK)
                except OSError as exc:
                    errors.append(f"creating {target / name}: {exc.strerror or exc}")
            for pos in range(0, nbytes, CHUNK):
                pending[i % 2].result()  # the buffer's previous write is done
                view = bufs[i % 2][: min(CHUNK, nbytes - pos)]
                channel.recv(source, view)
                h.update(view)
                where = str(target / name) if target else name
                pending[i % 2] = writer.submit(write, out, view, pos, where)
                i += 1
            writer.submit(close, out, name)  # after this file's writes, in order
            digests[name] = h.hexdigest()
    error = errors[0] if errors else None
    trailer = recv_doc(channel, source)
    theirs = trailer.get("digests") if isinstance(trailer, dict) else None
    if isinstance(trailer, dict) and trailer.get("error"):
        error = error or f"the sender could not read it: {trailer['error']}"
    elif theirs != [digests[n] for n, _ in files]:
        error = error or "the bytes received differ from the bytes sent"
    return Received(header, dict(files), digests, error)
