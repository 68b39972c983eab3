"""``resilient run`` refuses a checkpoint directory that the workflow engine owns (exit 78):
one declared as (or inside) an output, and one deleted between attempts (seen from the record
beside it), instead of starting again from step 0."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.io import logs
from resilient.job.exitcodes import EXIT_FOREIGN_RUN
from resilient.job.ledger import read_ledger, sidecar_path
from resilient.job.options import RunOptions
from resilient.job.run import run
from resilient.workflow import cleanup
from tests.mpirun import clean_env

CRASH = (sys.executable, "-c", "raise SystemExit(3)")
OK = (sys.executable, "-c", "pass")


def opts(ckpt: Path, command: tuple[str, ...], **kw: object) -> RunOptions:
    return RunOptions(command=command, checkpoint_dir=ckpt, backoff_s=0.0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("output", ["ckpt/hot", "ckpt", "ckpt/"])
def test_a_checkpoint_dir_in_the_outputs_is_refused_before_the_first_attempt(
    tmp_path: Path, output: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ck = Path("ckpt/hot")
    with caplog.at_level(logging.ERROR, logger="resilient.job.run"):
        code = run(opts(ck, OK, task="heat", outputs=(Path("results/x.h5"), Path(output))))
    assert code == EXIT_FOREIGN_RUN
    assert not ck.exists()  # the program never ran, nothing was created
    msg = caplog.text
    assert "task 'heat'" in msg and "ckpt/hot" in msg and f"declared output {Path(output)}" in msg
    assert "params: ckpt=" in msg and "Keep checkpoints out of a task's outputs" in msg


def test_an_output_beside_or_inside_the_checkpoint_dir_is_fine(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt" / "hot"
    outputs = (tmp_path / "ckpt" / "hot.h5", tmp_path / "ckpt" / "hotter", ck / "final.h5")
    assert run(opts(ck, OK, outputs=outputs)) == 0
    assert [r["exit_code"] for r in read_ledger(ck)] == [0]


def test_a_directory_deleted_between_attempts_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = tmp_path / "ckpt" / "hot"
    assert run(opts(ck, CRASH, task="heat")) == 3
    side = sidecar_path(ck)
    assert side == tmp_path / "ckpt" / ".hot.resilient-attempts"
    assert [r["exit_code"] for r in logs.read_log(side, logs.SIDECAR)] == [3]
    assert run(opts(ck, CRASH)) == 93  # still there: a second attempt runs (and ends the run)
    assert len(read_ledger(ck)) == 2

    shutil.rmtree(ck)  # what Snakemake does to an output before a retry
    with caplog.at_level(logging.ERROR, logger="resilient.job.run"):
        assert run(opts(ck, OK, task="heat")) == EXIT_FOREIGN_RUN
    assert "was deleted after attempt 2 (exit 93)" in caplog.text
    assert "task 'heat'" in caplog.text and str(side) in caplog.text
    assert not ck.exists()
    ck.mkdir()  # an empty directory, as an engine may create for a directory() output
    assert run(opts(ck, OK)) == EXIT_FOREIGN_RUN  # again at once: still not started

    side.unlink()  # on purpose: start over
    assert run(opts(ck, CRASH, max_no_progress=1)) == 93
    (ck / "attempts.jsonl").unlink()  # the reset that exit 93's message advises: not refused
    assert run(opts(ck, CRASH, max_no_progress=1)) == 93
    shutil.rmtree(ck)
    side.unlink()
    assert run(opts(ck, OK)) == 0
    assert [r["exit_code"] for r in read_ledger(ck)] == [0]


def test_a_finished_run_may_start_over_and_cleanup_removes_the_record(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt" / "hot"
    assert run(opts(ck, OK)) == 0
    shutil.rmtree(ck)  # a finished run's directory, deleted: nothing to resume, start fresh
    assert run(opts(ck, CRASH)) == 3
    out = tmp_path / "out.h5"
    out.write_bytes(b"done")
    removed = cleanup(ck, [out], keep_logs=False)
    assert str(sidecar_path(ck)) in removed and not sidecar_path(ck).exists()
    assert run(opts(ck, OK)) == 0  # not refused: the whole task was cleaned up


def test_the_command_line_takes_task_and_outputs(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt" / "hot"
    cmd = [
        sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ck),
        "--task", "heat", "--outputs", str(tmp_path / "a.h5"), str(ck), "--", *OK,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_FOREIGN_RUN, proc.stderr
    assert (
        f"the checkpoint directory {ck} is the declared output {ck} of task 'heat'" in proc.stderr
    )
