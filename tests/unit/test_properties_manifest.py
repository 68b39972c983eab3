"""Property-based tests of the manifest reader (issue 11.3): a manifest is untrusted input.

Arbitrary JSON documents, arbitrary bytes and mutations of a valid manifest (values replaced
by arbitrary JSON, keys dropped or added, strings like ``../x`` and ``/etc/passwd``, huge
integers, NaN, deep nesting) must give a :class:`Manifest` or a :class:`ManifestError`, never
another exception. On disk, behind a ``COMMITTED`` marker that matches it (so that the parser
is reached), a hostile manifest must never make a reader (the validators, ``resilient ls``,
``verify --full``, ``status``) open or list a path outside the checkpoint root, nor change
anything on disk; the readers answer with their verdict, never an exception.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient import CheckpointManager, cli
from resilient.errors import InvalidCheckpointError
from resilient.io import logs
from resilient.io.checkpoints import latest_valid, list_checkpoints, validate_checkpoint
from resilient.io.manifests import load_manifest, marker_text
from resilient.model import filenames
from resilient.model.checksum import digest_bytes
from resilient.model.codec import manifest_json, parse_manifest
from resilient.model.manifest import Manifest, ManifestError
from tests.unit.test_manifest import sample_doc

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

HOSTILE_STRINGS = [
    "../x", "/etc/passwd", "..", ".", "", "../../../../etc/passwd", "rank_00000.h5/../../x",
    "../world.h5", "world.h5\x00", "static/../../x", "step_00000001", "/", "~", "\\..\\x",
    "0123456789abcdef0123456789abcdef", "../0123456789abcdef0123456789abcdef", "a" * 300,
    "NaN", "\ud800", "rank_00000.h5",
]  # fmt: skip
HUGE_INTS = [2**62, 2**62 + 1, 2**63, -(2**63), 2**64, 10**400, -(10**400), -1]
DEEP = "__deep__"  # replaced in the JSON text by a deeply nested array (json.dumps would recurse)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(HOSTILE_STRINGS),
)
KEYS = st.one_of(st.text(max_size=6), st.sampled_from(sorted(sample_doc())))
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(KEYS, children, max_size=4),
    ),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, (*prefix, i))


def _encode(doc: Any, depth: int) -> str:
    text = json.dumps(doc, allow_nan=True)
    return text.replace(json.dumps(DEEP), "[" * depth + "0" + "]" * depth)


@st.composite
def mutated_manifests(draw: st.DrawFn, base: dict[str, Any] | None = None) -> str:
    """A valid manifest's JSON with 1 to 4 mutations."""
    doc = json.loads(json.dumps(base if base is not None else sample_doc()))
    depth = draw(st.sampled_from([2, 50, 900, 5000, 100_000]))
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "hostile", "delete", "add", "deep"]))
        if not path:
            if op in ("replace", "hostile", "deep"):
                doc = draw(json_values)
            continue
        parent: Any = doc
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        if op == "replace":
            parent[last] = draw(json_values)
        elif op == "hostile":
            parent[last] = draw(st.sampled_from(HOSTILE_STRINGS + HUGE_INTS + [math.nan]))
        elif op == "deep":
            parent[last] = DEEP
        elif op == "delete":
            del parent[last]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_values)
        else:
            parent.insert(last, draw(json_values))
    return _encode(doc, depth)


def _check_accepted(m: Manifest) -> None:
    """What a manifest the parser accepted may contain."""
    assert all(filenames.is_data_file_name(f.name) for f in m.files)
    assert m.static is None or filenames.is_static_dir(m.static)
    assert 0 <= m.step <= 2**62 and math.isfinite(m.time)
    assert parse_manifest(manifest_json(m)).step == m.step  # what it writes back, it reads


def _parse(text: str | bytes) -> None:
    try:
        m = parse_manifest(text)
    except ManifestError:
        return
    _check_accepted(m)


@SETTINGS
@given(doc=json_values)
def test_arbitrary_json_gives_a_manifest_or_a_manifest_error(doc: Any) -> None:
    _parse(json.dumps(doc, allow_nan=True))


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_arbitrary_bytes_give_a_manifest_error(raw: bytes | str) -> None:
    _parse(raw)


@SETTINGS
@given(text=mutated_manifests())
def test_mutated_manifests_give_a_manifest_or_a_manifest_error(text: str) -> None:
    _parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 5000 + "1" + "}" * 5000,
        json.dumps({**sample_doc(), "time": 10**400}),
        json.dumps({**sample_doc(), "time": math.nan}),
        json.dumps({**sample_doc(), "time": -math.inf}),
        json.dumps({**sample_doc(), "time": 1e300}),
        json.dumps({**sample_doc(), "metrics": DEEP}).replace(f'"{DEEP}"', "[" * 5000 + "]" * 5000),
    ],
    ids=[
        "deep-array",
        "deep-object",
        "huge-int-time",
        "nan-time",
        "inf-time",
        "far-future-time",
        "deep-metrics",
    ],
)
def test_found_by_hypothesis_deep_nesting_and_unusable_times_are_manifest_errors(
    text: str,
) -> None:
    """Were RecursionError (json's decoder) and OverflowError (float() of a huge int); a NaN
    or far-future time was accepted and then crashed ``resilient ls`` (time.localtime)."""
    with pytest.raises(ManifestError):
        parse_manifest(text)


def test_a_deeply_nested_commit_marker_is_garbled_not_a_crash(tmp_path: Path) -> None:
    """The same RecursionError, in the other JSON file of a checkpoint (found next to it)."""
    step = tmp_path / filenames.step_dir_name(1)
    step.mkdir()
    (step / filenames.COMMITTED).write_text("[" * 60_000)
    with pytest.raises(InvalidCheckpointError, match="garbled"):
        load_manifest(step)


def test_a_deeply_nested_log_line_is_skipped_like_a_torn_one(tmp_path: Path) -> None:
    log = tmp_path / filenames.SAVE_LOG
    log.write_text("[" * 100_000 + "\n" + '{"step": 1}\n')
    assert logs.read_log(log, logs.SAVES) == [{"step": 1}]


# --------------------------------------------------------------------------- on disk

_audit: dict[str, Any] = {"thread": None, "events": []}
_WATCHED = {"open", "os.listdir", "os.scandir"}
_CHANGES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate",
            "os.chmod", "os.symlink", "os.link"}  # fmt: skip


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if _audit["thread"] != threading.get_ident():
        return
    if event in _WATCHED or event in _CHANGES:
        _audit["events"].append((event, args[0] if args else None))


sys.addaudithook(_hook)  # process-wide and permanent: it records only inside `_recording`


@contextlib.contextmanager
def _recording() -> Iterator[list[tuple[str, Any]]]:
    events: list[tuple[str, Any]] = []
    _audit["events"], _audit["thread"] = events, threading.get_ident()
    try:
        yield events
    finally:
        _audit["thread"] = None


@pytest.fixture(scope="module")
def real_root() -> Iterator[tuple[Path, Path, str]]:
    """A root with one real checkpoint (static data too), the checkpoint dir, its manifest."""
    base = Path(tempfile.mkdtemp(prefix="resilient-props-"))
    root = base / "root" / "ck"
    outside = base / "outside"  # bait: what a hostile name could reach
    outside.mkdir()
    for name in ("world.h5", "rank_00000.h5", "passwd", "manifest.json", "COMMITTED"):
        (outside / name).write_bytes(b"outside")
    with CheckpointManager(root) as m:
        m.save(7, {"x": np.arange(600.0), "v": {"a": 1}}, static={"g": np.ones(300)})
    step = root / filenames.step_dir_name(7)
    try:
        yield root, step, (step / filenames.MANIFEST).read_text()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _inside(root: Path, path: Any) -> bool:
    if isinstance(path, int):
        return True  # a file descriptor: opened by a path checked when it was opened
    text = os.fsdecode(path)
    full = os.path.abspath(text)
    top = os.path.abspath(root)
    return full == top or full.startswith(top + os.sep)


def _read_everything(root: Path, step: Path) -> None:
    """Every reader, with its contract: a verdict, never an exception."""
    for full in (False, True):
        with contextlib.suppress(InvalidCheckpointError):
            load_manifest(step)
        with contextlib.suppress(InvalidCheckpointError):
            validate_checkpoint(step, full=full)
        list_checkpoints(root, full=full)
        latest_valid(root, full=full)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        for argv in (
            ["ls", str(root), "--full"],
            ["status", str(root), "--json", "--full"],
            ["verify", str(root), "--full"],
            ["verify", str(root), "7", "--full"],
            ["latest", str(root), "--full"],
        ):
            assert cli.main(argv) in (0, 1), (argv, out.getvalue()[-2000:])


@settings(SETTINGS, max_examples=60)
@given(data=st.data())
def test_a_hostile_manifest_on_disk_never_reaches_outside_the_root(
    real_root: tuple[Path, Path, str], data: st.DataObject
) -> None:
    root, step, original = real_root
    text = data.draw(mutated_manifests(json.loads(original)))
    raw = text.encode("utf-8", "surrogatepass")
    (step / filenames.MANIFEST).write_bytes(raw)
    (step / filenames.COMMITTED).write_text(marker_text(7, digest_bytes(raw)))
    try:
        with _recording() as events:
            _read_everything(root, step)
    finally:
        (step / filenames.MANIFEST).write_text(original)
        (step / filenames.COMMITTED).write_text(marker_text(7, digest_bytes(original.encode())))
    outside = [(e, p) for e, p in events if not _inside(root, p)]
    assert not outside, outside
    changes = [(e, p) for e, p in events if e in _CHANGES]
    assert not changes, changes
    assert any(e == "open" for e, _ in events)  # the hook saw the readers at work


def test_the_audit_hook_sees_a_read_outside_the_root(real_root: tuple[Path, Path, str]) -> None:
    """The check above can fail: a read of a sibling directory is recorded as outside."""
    root, _, _ = real_root
    with _recording() as events:
        (root.parent.parent / "outside" / "passwd").read_bytes()
    assert [p for _, p in events if not _inside(root, p)]
