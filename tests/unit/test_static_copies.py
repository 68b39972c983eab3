"""Shared pieces in two copies: static data, the run key, the root marker (issue 44).

Real files, real managers: each piece is damaged the ways a disk or a user damages it (a
flipped bit, deletion, truncation, an empty file) in each copy.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient import CheckpointManager
from resilient.errors import ConfigError, ForeignRunError, StaticDataError
from resilient.io import logs, storage
from resilient.io.checkpoints import latest_valid, list_checkpoints, resumable_step
from resilient.model import filenames
from tests.mpirun import run_mpi
from tests.unit.ckutil import assert_state_equal, state_of, static_of

DATA = "rank_00000.h5"


def flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x04
    path.write_bytes(bytes(b))


def delete(path: Path) -> None:
    path.unlink()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "flip": flip, "delete": delete, "truncate": truncate, "empty": empty,
}  # fmt: skip


def make_root(root: Path, *, copies: int = 2) -> str:
    with CheckpointManager(root, static_copies=copies, run_key={"nx": 4}) as m:
        for step in (1, 2):
            m.save(step, state_of(step), static=static_of(1))
    (h,) = [n for n in storage.names_in(root / "static") if filenames.is_static_dir(n)]
    return h


def restore(root: Path, **kw: Any) -> tuple[int, dict[str, Any]]:
    with CheckpointManager(root, **kw) as m:
        return m.restore()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("piece", ["manifest.json", "COMMITTED", DATA])
@pytest.mark.parametrize("which", ["first", "copy"])
def test_one_damaged_copy_of_the_static_data_costs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, piece: str, which: str
) -> None:
    root = tmp_path / "ck"
    h = make_root(root)
    name = h if which == "first" else f"{h}.copy"
    DAMAGE[damage](root / "static" / name / piece)
    # the CLI's and the wrapper's view: every step valid
    assert [r.status for r in list_checkpoints(root, full=True)] == ["valid", "valid"]
    assert resumable_step(root) == 2
    caplog.set_level(logging.WARNING)
    step, state = restore(root)
    assert step == 2
    assert_state_equal(state, {**state_of(2), **static_of(1)})
    assert not [n for n in storage.names_in(root) if ".quarantined-" in n]
    repaired = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    if (which, piece, damage) == ("copy", DATA, "flip"):
        # a restore reads the first copy's bytes only: the flip in the second is for a full
        # check to see (it passes on the first copy meanwhile)
        assert repaired == []
        return
    assert len(repaired) == 1 and f"{name}/" in repaired[0], repaired
    for piece_name in ("manifest.json", "COMMITTED", DATA):  # both copies whole again
        first = (root / "static" / h / piece_name).read_bytes()
        assert first == (root / "static" / f"{h}.copy" / piece_name).read_bytes()


def test_both_copies_damaged_is_an_error_naming_the_files_not_a_quarantine(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    h = make_root(root)
    flip(root / "static" / h / "manifest.json")
    delete(root / "static" / f"{h}.copy" / "COMMITTED")
    with pytest.raises(StaticDataError) as err:
        restore(root)
    text = str(err.value)
    assert "manifest.json does not match" in text and "no COMMITTED marker" in text, text
    assert "backup" in text and "start over" in text
    assert [r.status for r in list_checkpoints(root)] == ["invalid", "invalid"]
    assert not [n for n in storage.names_in(root) if ".quarantined-" in n]


def test_a_single_data_copy_names_the_option_when_damaged(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    h = make_root(root, copies=1)
    copy = root / "static" / f"{h}.copy"
    assert sorted(p.name for p in copy.iterdir()) == ["COMMITTED", "manifest.json"]
    assert json.loads((copy / "COMMITTED").read_text())["data_copies"] == 1
    # its metadata still has two copies
    delete(root / "static" / h / "manifest.json")
    assert restore(root)[0] == 2
    assert (root / "static" / h / "manifest.json").is_file()
    truncate(root / "static" / h / DATA)
    with pytest.raises(StaticDataError, match="static_copies=1"):
        restore(root)


def test_static_copies_is_checked() -> None:
    with pytest.raises(ConfigError, match="static_copies must be 1 or 2"):
        CheckpointManager("/nonexistent/never", static_copies=3)


def test_both_copies_are_collected_when_unreferenced(tmp_path: Path) -> None:
    from resilient.model.policies import KeepLast

    root = tmp_path / "ck"
    with CheckpointManager(root, keep=KeepLast(1)) as m:
        m.save(1, state_of(1), static=static_of(1))
        m.save(2, state_of(2), static=static_of(2))
        m.save(3, state_of(3), static=static_of(2))
    names = sorted(n for n in storage.names_in(root / "static") if not n.startswith("."))
    assert len(names) == 2 and names[1] == f"{names[0]}.copy"


def test_a_root_written_before_the_copies_restores_bit_for_bit(tmp_path: Path) -> None:
    # tests/unit/data/static_v1_root: written by the library before static copies (f5a1262):
    # one static directory, run_key.json and .resilient-root without copies
    root = tmp_path / "v1"
    shutil.copytree(Path(__file__).parent / "data" / "static_v1_root", root)
    mesh: dict[str, Any] = {
        "coords": np.linspace(0, 1, 16).reshape(4, 4),
        "ids": np.arange(6, dtype=np.int32),
    }
    with CheckpointManager(root, run_key={"nx": 8, "alpha": 0.5}) as m:
        step, state = m.restore()
        assert step == 2
        assert state["u"].tobytes() == (np.arange(8, dtype=np.float64) * 2).tobytes()
        assert state["t"] == 0.5
        for k, v in mesh.items():
            assert state[k].tobytes() == v.tobytes() and state[k].dtype == v.dtype
    with pytest.raises(ForeignRunError):
        CheckpointManager(root, run_key={"nx": 9, "alpha": 0.5})


def test_an_old_roots_static_data_gains_its_second_copy_at_the_next_save(tmp_path: Path) -> None:
    """A campaign that goes on in a root from before the copies stops depending on one copy
    of its static data: the next save that refers to it adds the second copy, after which a
    damaged first copy costs nothing."""
    root = tmp_path / "v1"
    shutil.copytree(Path(__file__).parent / "data" / "static_v1_root", root)
    h = "7b5398ac6999e22ed26d708a86007834"
    with CheckpointManager(root, run_key={"nx": 8, "alpha": 0.5}) as m:
        step, state = m.restore()
        static = {k: state[k] for k in ("coords", "ids")}
        m.save(3, {"u": state["u"] * 1.5, "t": 0.75}, static=static)
    assert (root / "static" / f"{h}.copy" / "manifest.json").is_file()
    flip(root / "static" / h / "manifest.json")
    step, state = restore(root)
    assert step == 3 and state["ids"].tobytes() == np.arange(6, dtype=np.int32).tobytes()


def test_a_damaged_static_manifest_of_an_old_root_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    shutil.copytree(Path(__file__).parent / "data" / "static_v1_root", root)
    flip(root / "static" / "7b5398ac6999e22ed26d708a86007834" / "manifest.json")
    with pytest.raises(StaticDataError, match="one copy only"):
        restore(root)
    assert latest_valid(root) is None


def test_the_cli_sees_the_steps_valid_with_one_copy_and_names_the_damaged_one(
    tmp_path: Path,
) -> None:
    from resilient import cli

    def run(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(list(argv))
        return code, out.getvalue()

    root = tmp_path / "ck"
    h = make_root(root)
    flip(root / "static" / h / "manifest.json")
    for argv in (["ls"], ["latest"], ["status"]):
        code, said = run(*argv, str(root))
        assert code == 0 and "invalid" not in said, (argv, said)
    code, said = run("verify", str(root), "--full")
    assert code == 0 and f"its copy {h}/ failed" in said and "repairs it" in said, said
    delete(root / "static" / f"{h}.copy" / "COMMITTED")
    for argv in (["ls"], ["latest"], ["status"], ["verify", "--full"]):
        code, said = run(argv[0], str(root), *argv[1:])
        assert "Traceback" not in said, said
    assert code == 1 and "backup" in said, said


# ---------------------------------------------------------------------- run key and marker


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("name", [filenames.RUN_KEY, filenames.RUN_KEY_COPY])
def test_one_damaged_run_key_copy_is_repaired_and_still_guards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, name: str
) -> None:
    root = tmp_path / "ck"
    make_root(root)
    before = {n: (root / n).read_bytes() for n in (filenames.RUN_KEY, filenames.RUN_KEY_COPY)}
    DAMAGE[damage](root / name)
    caplog.set_level(logging.INFO)
    with pytest.raises(ForeignRunError):  # another run's key is still refused
        CheckpointManager(root, run_key={"nx": 5})
    # (a deleted copy reads as a root from before the copies: "added", at info)
    said = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(said) == 1 and "from the other copy" in said[0], said
    assert {n: (root / n).read_bytes() for n in before} == before
    assert restore(root, run_key={"nx": 4})[0] == 2


def test_a_flipped_bit_that_still_parses_in_the_run_key_is_seen(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    make_root(root)
    (root / filenames.RUN_KEY).write_text('{"nx": 5}')  # what another run would accept
    with pytest.raises(ForeignRunError, match="nx: 4 there, 5 now"):
        CheckpointManager(root, run_key={"nx": 5})
    assert json.loads((root / filenames.RUN_KEY).read_text()) == {"nx": 4}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("name", [filenames.ROOT_MARKER, filenames.ROOT_MARKER_COPY])
def test_one_damaged_marker_copy_is_repaired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, name: str
) -> None:
    root = tmp_path / "ck"
    make_root(root)
    before = (root / name).read_bytes()
    DAMAGE[damage](root / name)
    assert storage.is_root(root)
    caplog.set_level(logging.WARNING)
    assert restore(root)[0] == 2
    assert (root / name).read_bytes() == before
    assert [r for r in caplog.records if name in r.getMessage() and "repaired" in r.getMessage()]


def test_a_flipped_bit_that_still_parses_in_the_marker_is_seen(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    make_root(root)
    doc = json.loads((root / filenames.ROOT_MARKER).read_text())
    doc["version"] = 3
    (root / filenames.ROOT_MARKER).write_text(json.dumps(doc))
    assert storage.marker_problem(root) is None  # the copy is intact
    assert restore(root)[0] == 2
    assert json.loads((root / filenames.ROOT_MARKER).read_text())["version"] == 1


def test_both_markers_damaged_is_named_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    make_root(root)
    (root / filenames.ROOT_MARKER).write_bytes(b"\xffgarbage")
    (root / filenames.ROOT_MARKER_COPY).write_bytes(b"")
    problem = storage.marker_problem(root)
    assert problem is not None and "marker" in problem and "damaged" in problem
    with pytest.raises(ConfigError, match="is damaged"):
        CheckpointManager(root)
    fix = problem.split("`")[1]  # the printf the message gives
    payload = fix.split("'")[3]
    (root / filenames.ROOT_MARKER).write_text(payload)
    assert restore(root)[0] == 2


def test_resilient_run_names_a_damaged_marker_not_a_deleted_directory(tmp_path: Path) -> None:
    from resilient.job.ledger import sidecar_path
    from resilient.job.options import RunOptions
    from resilient.job.outputs import not_this_runs

    root = tmp_path / "ck"
    make_root(root)
    logs.append_record(sidecar_path(root), {"attempt": 1, "exit_code": 75, "time": 0.0})
    (root / filenames.ROOT_MARKER).write_text("garbage")
    (root / filenames.ROOT_MARKER_COPY).unlink()
    why = not_this_runs(RunOptions(command=("true",)), root)
    assert why is not None and "damaged" in why and "deleted" not in why, why


@pytest.mark.parametrize("command", ["ls", "status", "latest", "verify"])
def test_the_cli_names_a_damaged_marker_with_the_fix(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from resilient import cli

    root = tmp_path / "ck"
    make_root(root)
    (root / filenames.ROOT_MARKER).write_text("garbage")
    (root / filenames.ROOT_MARKER_COPY).unlink()
    assert cli.main([command, str(root)]) == 2
    said = capsys.readouterr().err
    assert "is damaged" in said and "printf" in said and "no checkpoint roots" not in said, said


SHARDED = """
import sys
import numpy as np
from mpi4py import MPI
from pathlib import Path
from typing import Any
from resilient import CheckpointManager
root = Path(sys.argv[1])
comm = MPI.COMM_WORLD
mesh = {"m": np.arange(300.0) + comm.rank}
with CheckpointManager(root, comm=comm, manifest_shard_ranks=1) as m:
    if sys.argv[2] == "save":
        for step in (1, 2):
            m.save(step, {"u": np.full(50, step + comm.rank, dtype=np.float64)}, static=mesh)
    else:
        step, state = m.restore()
        assert step == 2 and state["m"].tobytes() == mesh["m"].tobytes(), step
        if comm.rank == 0:  # one line: two ranks' prints may interleave in the launcher's output
            print(f"restored {step}", flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="mpiexec")
def test_a_damaged_shard_of_the_static_data_on_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    root = tmp_path / "ck"
    run_mpi(2, [str(script), str(root), "save"])
    (h,) = [n for n in storage.names_in(root / "static") if filenames.is_static_dir(n)]
    shards = sorted((root / "static" / h).glob("manifest-*.json"))
    assert len(shards) == 2
    for other in ("", ".copy"):
        assert sorted(p.name for p in (root / "static" / f"{h}{other}").glob("manifest-*"))
    flip(shards[0])
    delete(shards[1])
    proc = run_mpi(2, [str(script), str(root), "restore"])
    assert "restored 2" in proc.stdout
    assert not [n for n in storage.names_in(root) if ".quarantined-" in n]
    for shard in shards:
        assert shard.read_bytes() == (root / "static" / f"{h}.copy" / shard.name).read_bytes()
