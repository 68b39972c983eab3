"""A crash at every file-system call (ALICE's method, tests/crash): a seeded sample in the suite.

Each operation of tests/crash/ops.py runs on its ranks with every call recorded; of the states a
crash could leave under ext4's and XFS's rules, :data:`SAMPLE` per model (seeded, or all where
there are fewer) are checked as a user would see them (tests/crash/check.py). The whole matrix,
every state: ``python bench/bench_crash.py`` (docs/explanation/guarantees.md publishes it).

The negative controls plant the faults the checks are for (a data file, or the manifest and
the marker, never fsynced before the rename) into a real recording: the checks must then find violations. And the
violations the matrix found, kept as the states they were: a crash during the first start's
marker, and a step saved again (its old directory renamed aside before the new one came in).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.io import storage
from resilient.model import filenames
from tests.crash.matrix import examine, record, run
from tests.crash.ops import BLOCKS, OPERATIONS, global_array, state

pytestmark = [pytest.mark.timeout(600)]

SAMPLE = 30  # states per operation and model: 60 per operation
SEED = 20261129


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("crash")


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_no_crash_state_breaks_an_invariant(name: str, work: Path) -> None:
    rows = run(name, work, sample=SAMPLE, seed=SEED)
    for row in rows:
        assert not row.unrecorded, row.unrecorded  # every call of the library was seen
        assert row.tried == min(SAMPLE, row.states) and row.calls > 0, row
    found = [f"{f.where}: {'; '.join(f.problems)}" for r in rows for f in r.found]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("op", "planted"), [("save-self", "no data fsync"),
                                             ("save-world", "no manifest fsync")])  # fmt: skip
def test_the_checks_find_a_planted_fault(op: str, planted: str, tmp_path: Path) -> None:
    """Without the fsync of a data file (or of the manifest and marker) before the rename, a
    committed step may hold lost or torn bytes: the checks must say so."""
    record(OPERATIONS[op], tmp_path / op)
    rows = examine(op, tmp_path / op, models=["ext4"], planted=planted)
    problems = [p for r in rows for f in r.found for p in f.problems]
    assert any("visible but invalid" in p for p in problems), problems


def test_a_step_saved_again_is_swapped_in_at_once(tmp_path: Path) -> None:
    """Found by the matrix: the old directory renamed to the trash, then the new one renamed
    in; a crash between left no step under the number. Now one exchange (renameat2): every
    state of the operation checked, none without the step."""
    record(OPERATIONS["save-again"], tmp_path / "op")
    ops = [json.loads(line)["op"] for p in (tmp_path / "op").glob("log-*.jsonl")
           for line in p.read_text().splitlines()[1:]]  # fmt: skip
    assert "exchange" in ops, sorted(set(ops))
    rows = examine("save-again", tmp_path / "op", models=["ext4"])
    assert all(r.states == r.tried for r in rows)
    assert not [f for r in rows for f in r.found], [f.where for r in rows for f in r.found]


def test_where_no_exchange_is_possible_a_step_saved_again_still_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "exchange_dirs", lambda a, b: False)
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(20, state(20, 0, 1))
        m.save(20, state(20, 0, 1, version=1))
    with CheckpointManager(tmp_path / "ck") as m:
        step, got = m.restore(blocks=BLOCKS)
    assert step == 20 and np.array_equal(got["g"], global_array(20, 1))
    assert not [p for p in (tmp_path / "ck").iterdir() if filenames.is_trash(p.name)]


def test_exchange_dirs_swaps_two_directories(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    if not storage.exchange_dirs(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this filesystem")
    assert (a / "y").read_text() == "from b" and (b / "x").read_text() == "from a"
    with pytest.raises(FileNotFoundError):
        storage.exchange_dirs(a, tmp_path / "missing")


@pytest.mark.parametrize("marker_bytes", [b"", b'{"format": "resil'])
def test_a_crash_while_the_first_start_wrote_the_marker_does_not_block_the_next(
    tmp_path: Path, marker_bytes: bytes
) -> None:
    """Found by the matrix: the root made, its marker still under its temporary name (empty
    or torn); the next start refused the directory as not empty and not a checkpoint root."""
    root = tmp_path / "ck"
    root.mkdir()
    leftover = root / filenames.replacement_name(filenames.ROOT_MARKER, storage.new_token())
    leftover.write_bytes(marker_bytes)
    with CheckpointManager(root) as m:
        m.save(1, state(1, 0, 1))
    assert not leftover.exists()
    with CheckpointManager(root) as m:
        assert m.restore(blocks=BLOCKS)[0] == 1


def test_a_foreign_file_shaped_like_a_leftover_still_refuses_the_directory(tmp_path: Path) -> None:
    """Only the marker's own leftovers are removed: another hidden file keeps the refusal."""
    from resilient import ConfigError

    root = tmp_path / "ck"
    root.mkdir()
    (root / f".results.csv.{'0' * 16}").write_text("a user's file")
    with pytest.raises(ConfigError, match="not empty"):
        CheckpointManager(root).save(1, state(1, 0, 1))
    assert os.listdir(root) == [f".results.csv.{'0' * 16}"]


def test_a_crash_while_the_ledger_moved_counts_no_attempt_twice(tmp_path: Path) -> None:
    """Found by the matrix: the ledger of a task's own directory moves to the program's once
    it names one; a crash after the records were appended there but before the old ledger was
    removed moved them again at the next attempt: 2 attempts counted as 4."""
    from resilient.job.ledger import AttemptRecord, Where, read_ledger

    own, program = tmp_path / "own", tmp_path / "program"
    own.mkdir()
    program.mkdir()
    first = Where(given=None, own=own)
    for n in (1, 2):
        first.append(AttemptRecord(attempt=n, start=100.0 * n, end=100.0 * n + 50, exit_code=75))
    (program / filenames.ATTEMPT_LEDGER).write_bytes((own / filenames.ATTEMPT_LEDGER).read_bytes())
    Where(given=None, own=own, program=program).append(AttemptRecord(attempt=3, start=300.0))
    got = read_ledger(program)
    assert [(r["attempt"], r["start"]) for r in got] == [(1, 100.0), (2, 200.0), (3, 300.0)]
    assert not (own / filenames.ATTEMPT_LEDGER).exists()
