"""The root's append-only logs (:mod:`resilient.io.logs`): damaged lines never crash a reader."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from resilient.io import logs
from resilient.job.guard import Invocation, trailing_no_progress, verdict
from resilient.job.ledger import read_ledger, sidecar_path
from resilient.job.protocol import program_stop
from resilient.model import filenames

GOOD = [
    {"attempt": 1, "exit_code": 75, "start": 1.0, "end": 2.0, "progress": True, "reason": "w"},
    {"attempt": 2, "exit_code": 1, "start": 3.0, "end": 4.0, "progress": False, "reason": "x"},
]

DAMAGE: dict[str, bytes] = {
    "garbage": b"\x00\x13garbage{{{",
    "not UTF-8": b'{"attempt": 9, "exit_code": 0, "reason": "caf\xe9"}',
    "a JSON list": b"[1, 2, 3]",
    "a JSON string": b'"attempt"',
    "a string where a number belongs": b'{"attempt": "3", "exit_code": 0}',
    "a bool where an int belongs": b'{"attempt": true, "exit_code": 0}',
    "a float where an int belongs": b'{"attempt": 3.0, "exit_code": 0}',
    "a list where an object belongs": b'{"attempt": 3, "exit_code": 0, "program_stop": [1]}',
    "a number where a bool belongs": b'{"attempt": 3, "exit_code": 0, "progress": 1}',
    "a required field missing": b'{"attempt": 3}',
    "nested beyond the decoder": b"[" * 100_000,
}


def write(path: Path, *lines: bytes, end: bytes = b"\n") -> Path:
    path.write_bytes(b"\n".join(lines) + end)
    return path


def line(rec: dict[str, object]) -> bytes:
    return json.dumps(rec).encode()


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_warned", set())


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_line_is_skipped_with_one_warning(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "attempts.jsonl", line(GOOD[0]), DAMAGE[damage], line(GOOD[1]))
    for _ in range(3):  # read again and again: still one warning for the file
        assert logs.read_log(path, logs.ATTEMPTS) == GOOD
    (said,) = warnings(caplog)
    assert str(path) in said and "1 damaged line" in said and "using its 2 valid records" in said


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "attempts.jsonl", line(GOOD[0]), line(GOOD[1])[:17], end=b"")
    assert logs.read_log(path, logs.ATTEMPTS) == GOOD[:1]
    third = {**GOOD[1], "attempt": 3}
    logs.append_record(path, third, durable=True)
    assert logs.read_log(path, logs.ATTEMPTS) == [GOOD[0], third]
    assert path.read_bytes().endswith(b"\n" + line(third) + b"\n")
    assert len(warnings(caplog)) == 1


def test_empty_missing_and_all_garbage_files_have_no_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert logs.read_log(tmp_path / "missing.jsonl", logs.STOPS) == []
    assert logs.read_log(write(tmp_path / "empty.jsonl", end=b""), logs.STOPS) == []
    assert logs.read_log(write(tmp_path / "blank.jsonl", b"", b"  "), logs.STOPS) == []
    assert not warnings(caplog)  # nothing damaged: nothing said
    junk = write(tmp_path / "junk.jsonl", *DAMAGE.values())
    assert logs.read_log(junk, logs.ATTEMPTS) == []
    (said,) = warnings(caplog)
    assert f"{len(DAMAGE)} damaged lines" in said and "using its 0 valid records" in said


def test_a_log_that_cannot_be_read_is_empty_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "progress.jsonl").mkdir()  # IsADirectoryError: an OSError
    assert logs.read_log(tmp_path / "progress.jsonl", logs.PROGRESS) == []
    assert logs.read_log(tmp_path / "progress.jsonl", logs.PROGRESS) == []
    (said,) = warnings(caplog)
    assert "cannot read the timeline" in said


def test_a_huge_record_is_one_write_and_reads_back_whole(tmp_path: Path) -> None:
    path = tmp_path / "stops.jsonl"
    big = {"time": 1.0, "reason": "x" * 100_000, "attempt": 1}
    logs.append_record(path, {"time": 0.5})
    logs.append_record(path, big)
    logs.append_record(path, {"time": 2.0})
    assert logs.read_log(path, logs.STOPS) == [{"time": 0.5}, big, {"time": 2.0}]
    assert path.read_bytes().count(b"\n") == 3


def test_a_failed_append_warns_once_unless_durable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gone" / "saves.jsonl"  # its folder does not exist: ENOENT
    logs.append_record(path, {"step": 1})
    logs.append_record(path, {"step": 2})
    (said,) = warnings(caplog)
    assert "could not append" in said
    with pytest.raises(FileNotFoundError):
        logs.append_record(path, {"attempt": 1, "exit_code": 0}, durable=True)


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        (logs.PROGRESS, {"time": 1, "step": None, "event": "end", "loop_end": 0.5},
         {"time": 1, "step": "3"}),
        (logs.STOPS, {"time": 1.5, "attempt": None, "margin_s": 10, "saved": False},
         {"time": 1.5, "margin_s": "10"}),
        (logs.SAVES, {"step": 3, "time": 2.0, "metrics": {}, "static": None},
         {"step": 3, "metrics": []}),
        (logs.PROTECTED, {"step": 3, "time": 2.0}, {"step": True}),
        (logs.SIDECAR, {"attempt": 1, "exit_code": 75, "time": 3.0},
         {"attempt": 1, "exit_code": "75"}),
    ],
)  # fmt: skip
def test_each_log_has_its_shape(
    kind: logs.LogKind, good: dict[str, object], bad: dict[str, object], tmp_path: Path
) -> None:
    path = write(tmp_path / "log.jsonl", line(good), line(bad), line({**good, "new_field": [1]}))
    assert logs.read_log(path, kind) == [good, {**good, "new_field": [1]}]  # unknown: kept


def test_the_guard_decides_from_the_valid_lines(tmp_path: Path) -> None:
    """93 after two attempts without progress, whatever lies between them."""
    ck = tmp_path / "ck"
    ck.mkdir()
    now = Invocation("f", engine="snakemake job", retry="Snakemake attempt 3")  # a retry
    stalled = [{**GOOD[1], "attempt": n, "fingerprint": "f"} for n in (1, 2)]
    write(
        ck / filenames.ATTEMPT_LEDGER,
        line(stalled[0]),
        b'{"attempt": 5, "exit_code": 0, "progress": "yes"}',  # would reset the count
        b"\xff\xfe",
        line(stalled[1]),
        b'{"exit_code": 0',
        end=b"",
    )
    ledger = read_ledger(ck)
    assert ledger == stalled and trailing_no_progress(ledger) == 2
    assert verdict(ledger, now, max_no_progress=2).refuse == 93


def test_a_stop_record_of_the_wrong_shape_is_not_this_attempts(tmp_path: Path) -> None:
    write(
        tmp_path / filenames.STOP_LOG,
        b'{"time": "15", "attempt": 1, "reason": "a string time"}',
        b'{"time": 15, "attempt": "1", "reason": "a string attempt"}',
        b'{"time": 16, "attempt": 1, "reason": "this one"}',
    )
    got = program_stop(tmp_path, attempt=1, start=10.0, end=20.0)
    assert got is not None and got["reason"] == "this one"


def test_the_sidecar_is_read_by_the_same_reader(tmp_path: Path) -> None:
    side = sidecar_path(tmp_path / "ck")
    write(side, b"\x80", line({"attempt": 1, "exit_code": 75}), b'{"attempt": "2"}')
    assert logs.read_log(side, logs.SIDECAR) == [{"attempt": 1, "exit_code": 75}]
    assert os.path.basename(side) == ".ck.resilient-attempts"
