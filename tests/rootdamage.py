"""Damage to one file of a checkpoint root, and the kind of each file: for the fuzz tests
(``tests/test_root_fuzz.py``) and the sweep over every file (``bench/bench_root_fuzz.py``).

Each damage is what a storage fault or a crash leaves: one flipped bit (the same size: only a
checksum sees it), a garbage line appended (a full disk, a torn write of several lines), bytes
that are not UTF-8, a truncation to half, a deletion, an empty file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from resilient.model import filenames

LOGS = ("attempts.jsonl", "progress.jsonl", "stops.jsonl", "saves.jsonl", "protected.jsonl")
# NULs of a full disk and a torn record; then lines of JSON that are no record (a list, a string)
# and a record of the wrong shape: NaN (which json.dumps writes), strings and lists where numbers
# belong, in the fields every log of a root has (attempts, progress, stops, saves, protected)
GARBAGE = (
    b'\x00\x00\x00garbage {"attempt": [1, \n[1, 2]\n"text"\n'
    b'{"attempt": NaN, "exit_code": [75], "start": 1, "end": 2, "time": "y", "t0": [], '
    b'"step": "x", "event": "save", "saved": "no", "cost_s": "z", "bytes": -1, '
    b'"latest_after": {}, "progress": "yes", "static": 5}\n'
)


def flip_bit(path: Path, offset: int | None = None) -> None:
    """Flip the lowest bit of the byte at ``offset`` (default: the middle of the file)."""
    data = bytearray(path.read_bytes())
    if not data:
        data = bytearray(b"\x01")
    else:
        at = len(data) // 2 if offset is None else offset
        data[at] ^= 0x01
    path.write_bytes(bytes(data))


def flip_data_bit(path: Path) -> None:
    """Flip a bit in the middle of the largest array of a data file (``*.h5`` beside its
    manifest, sharded or not), so that the flip lands in data, not in HDF5's padding; where
    the manifest cannot tell (damaged, or no array in that file), :func:`flip_bit`."""
    from resilient.io.manifests import SetFiles, load_entries
    from resilient.model.codec import parse_manifest

    offset = None
    try:
        manifest = parse_manifest((path.parent / filenames.MANIFEST).read_text())
        manifest = load_entries(SetFiles.in_directory(path.parent), manifest)
        for entry in manifest.ranks:
            table = entry.datasets
            if entry.file != path.name or not table.nbytes:
                continue
            i = table.nbytes.index(max(table.nbytes))
            start = table.offsets[i]
            if start is not None:
                offset = start + table.nbytes[i] // 2
            break
    except Exception:  # any damage of the manifest: the middle of the file
        offset = None
    flip_bit(path, offset)


def garbage_line(path: Path) -> None:
    """Append lines that are no valid record (:data:`GARBAGE`)."""
    with path.open("ab") as f:
        f.write(GARBAGE)


def not_utf8(path: Path) -> None:
    """Replace the byte in the middle of the file by ``0xFF`` (never valid UTF-8)."""
    data = bytearray(path.read_bytes()) or bytearray(b" ")
    data[len(data) // 2] = 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    """Keep the first half (a torn write; a torn last line of a log)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def delete(path: Path) -> None:
    path.unlink()


def empty(path: Path) -> None:
    path.write_bytes(b"")


DAMAGES: dict[str, Callable[[Path], None]] = {
    "bitflip": flip_bit,
    "garbage": garbage_line,
    "utf8": not_utf8,
    "truncate": truncate,
    "delete": delete,
    "empty": empty,
}


def damage(path: Path, kind: str) -> None:
    """Damage ``path`` in the way ``kind`` (a key of :data:`DAMAGES`) names; a bit flip in a
    data file lands in an array."""
    if kind == "bitflip" and filenames.is_data_file_name(path.name):
        flip_data_bit(path)
    else:
        DAMAGES[kind](path)


def file_kind(root: Path, path: Path) -> str:
    """What ``path`` (a file in ``root``, or the sidecar beside it) is, e.g. ``step data``,
    ``static manifest``, ``attempts.jsonl``, ``sidecar``."""
    if path.parent == root.parent and path.name == filenames.attempt_sidecar_name(root.name):
        return "sidecar"
    if path.parent == root.parent and path.name == filenames.handoff_sidecar_name(root.name):
        return "handoff"
    rel = path.relative_to(root).parts
    if len(rel) == 1:
        return rel[0]
    where = "step"
    if rel[0] == filenames.STATIC_DIR:
        where = "static copy" if filenames.parse_static_copy(rel[1]) else "static"
    name = rel[-1]
    if filenames.is_data_file_name(name):
        return f"{where} data"
    if name == filenames.MANIFEST:
        return f"{where} manifest"
    if filenames.is_shard_name(name):
        return f"{where} shard"
    if name == filenames.COMMITTED:
        return f"{where} COMMITTED"
    return f"{where} {name}"
