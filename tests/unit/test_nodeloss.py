"""What Slurm says of a job's nodes after a failed attempt (resilient.job.nodeloss), and how
``resilient run`` records an attempt that lost one: pure logic, with ``scontrol`` answered by
the test (the real one is exercised on the local Slurm by tests/test_slurm_node_loss.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from resilient.io.checkpoints import protected_steps, resumable_step
from resilient.job.guard import trailing_no_progress
from resilient.job.ledger import read_ledger
from resilient.job.nodeloss import LostNode, is_lost, job_nodelist, lost_nodes, parse_nodes
from resilient.job.options import RunOptions
from resilient.job.outcome import AttemptEnd, classify
from resilient.job.run import run
from resilient.model import filenames
from tests.unit.ckutil import job_free_env

# `scontrol -o show node n1,n2,n3` on Slurm 22.05 while n2's slurmd is dead (abridged)
SHOW_NODE = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 State=MIXED ThreadsPerCore=1 "
    "Partitions=debug,multi BootTime=None\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=DOWN* ThreadsPerCore=1 "
    "Partitions=multi Reason=Not responding [slurm@2026-11-26T19:48:31]\n"
    "NodeName=n3 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=IDLE+DRAIN ThreadsPerCore=1 "
    "Reason=maintenance [root@2026-11-26T19:40:00] Comment=(null)\n"
)


@pytest.mark.parametrize(
    ("state", "lost"),
    [("DOWN*", True), ("DOWN", True), ("IDLE*", True), ("ALLOCATED+FAIL", True),
     ("MIXED+NOT_RESPONDING", True), ("POWERED_DOWN", True), ("ALLOCATED", False),
     ("MIXED", False), ("IDLE+DRAIN", False), ("ALLOCATED+COMPLETING", False)],
)  # fmt: skip
def test_which_states_are_lost(state: str, lost: bool) -> None:
    assert is_lost(state) is lost


def test_parse_nodes_keeps_the_lost_ones_with_their_reason() -> None:
    assert parse_nodes(SHOW_NODE) == [LostNode("n2", "DOWN*", "Not responding")]
    assert LostNode("n2", "DOWN*", "Not responding").describe() == "n2 (DOWN*: Not responding)"
    assert LostNode("n4", "IDLE*").describe() == "n4 (IDLE*)"
    assert parse_nodes("") == [] and parse_nodes("garbage State=") == []


class FakeScontrol:
    """Answers ``scontrol`` as a test wants; records the calls."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers, self.calls = answers, []  # type: ignore[var-annotated]

    def __call__(self, args: Sequence[str]) -> tuple[int, str]:
        self.calls.append(list(args))
        for key, answer in self.answers.items():
            if " ".join(args).startswith(key):
                return answer
        return 1, "scontrol: error: unexpected"


def test_the_jobs_nodelist_from_the_environment_or_the_job() -> None:
    fake = FakeScontrol({"show job -o 7": (0, "JobId=7 JobName=x NodeList=n[1-2] BatchHost=n1")})
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"}
    assert job_nodelist(env, scontrol=fake) == "n[1-3]" and not fake.calls
    assert job_nodelist({"SLURM_JOB_ID": "7"}, known="n[4-5]", scontrol=fake) == "n[4-5]"
    # the executor plugin's job step may lack the node list: the job's
    assert job_nodelist({"SLURM_JOB_ID": "7"}, scontrol=fake) == "n[1-2]"
    assert fake.calls == [["show", "job", "-o", "7"]]
    assert job_nodelist({}, scontrol=fake) == ""
    assert job_nodelist({"SLURM_JOB_ID": "7"}, scontrol=FakeScontrol({})) == ""


def test_lost_nodes_are_the_jobs_own_and_nothing_when_scontrol_fails() -> None:
    answers = {"show hostnames n[1-2]": (0, "n1\nn2\n"), "show hostnames n1,n3": (0, "n1 n3"),
               "-o show node": (0, SHOW_NODE)}  # fmt: skip
    fake = FakeScontrol(answers)
    assert lost_nodes("n[1-2]", scontrol=fake) == [LostNode("n2", "DOWN*", "Not responding")]
    assert fake.calls == [["show", "hostnames", "n[1-2]"], ["-o", "show", "node", "n1,n2"]]
    assert lost_nodes("n1,n3", scontrol=fake) == []  # n2 is not this job's
    assert lost_nodes("n[1-2]", scontrol=FakeScontrol({})) == []  # not guessed
    answers.pop("-o show node")
    assert lost_nodes("n[1-2]", scontrol=FakeScontrol(answers)) == []
    assert lost_nodes("", scontrol=fake) == []


def test_classify_a_lost_node() -> None:
    lost = "n2 (DOWN*: Not responding)"
    reason, code = classify(
        AttemptEnd(
            status=-9,
            sent="SIGTERM",
            progress=True,
            no_progress_run=0,
            max_no_progress=3,
            lost=lost,
        )
    )
    assert (reason, code) == (f"Slurm lost node {lost} under it after a newer checkpoint", 75)
    reason, code = classify(
        AttemptEnd(
            status=137, sent=None, progress=False, no_progress_run=0, max_no_progress=3, lost=lost
        )
    )
    assert code == 137 and reason.endswith("not counted as an attempt without progress")


def test_attempts_that_lost_a_node_do_not_count_towards_93() -> None:
    ledger: list[dict[str, object]] = [{"progress": False, "exit_code": 1}, {"progress": False, "exit_code": 137,
              "lost_nodes": ["n2"]}, {"progress": False, "exit_code": 1}]  # fmt: skip
    assert trailing_no_progress(ledger) == 2


def protect(root: Path, step: int, when: float) -> None:
    with open(root / filenames.PROTECT_LOG, "a") as fh:
        fh.write(json.dumps({"time": when, "step": step, "protect_s": 0.01}) + "\n")


def test_resumable_step_counts_protected_local_steps(tmp_path: Path) -> None:
    from resilient.checkpoint.manager import CheckpointManager

    root = tmp_path / "ck"
    with CheckpointManager(root) as mgr:
        mgr.save(10, {"x": [1.0, 2.0]})
    assert resumable_step(root) == 10
    protect(root, 20, 100.0)
    protect(root, 30, 200.0)
    (root / filenames.PROTECT_LOG).open("a").write('{"step": true}\nnot json\n')
    assert protected_steps(root) == {20, 30} and protected_steps(root, since=150.0) == {30}
    assert resumable_step(root) == 30
    assert resumable_step(root, protected_since=300.0) == 10  # none since: the shared root's
    assert resumable_step(tmp_path / "missing") is None


def fake_scontrol(bin_dir: Path) -> None:
    """An ``scontrol`` on PATH that says n2 of job n[1-2] is down."""
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        args = " ".join(sys.argv[1:])
        if args.startswith("show hostnames"):
            print("n1"); print("n2")
        elif args.startswith("-o show node"):
            sys.stdout.write({SHOW_NODE!r})
        else:
            sys.exit(1)
        """)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


# a program that protected local step 30 (its partner copies committed), then lost its peers:
# killed, as srun's forced termination kills the surviving ranks
LOSES_A_NODE = textwrap.dedent("""\
    import json, os, signal, sys, time
    with open(os.path.join(sys.argv[1], "protected.jsonl"), "a") as fh:
        fh.write(json.dumps({"time": time.time(), "step": int(sys.argv[2])}) + "\\n")
    os.kill(os.getpid(), signal.SIGKILL)
    """)


def test_run_records_a_lost_node_after_progress_as_75(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir, ck = tmp_path / "bin", tmp_path / "ck"
    fake_scontrol(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = job_free_env(SLURM_JOB_ID="9", SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="2")
    prog = (sys.executable, "-c", LOSES_A_NODE, str(ck))
    assert run(RunOptions(command=(*prog, "30"), checkpoint_dir=ck), environ=env) == 75
    (rec,) = read_ledger(ck)
    assert rec["lost_nodes"] == ["n2"] and rec["progress"] is True
    assert (rec["latest_before"], rec["latest_after"]) == (None, 30)
    assert rec["reason"] == (
        "Slurm lost node n2 (DOWN*: Not responding) under it after a newer checkpoint"
    )
    # again without progress: 128 + 9 passed through, and never 93
    opts = RunOptions(command=(*prog, "30"), checkpoint_dir=ck, max_no_progress=1)
    for _ in range(2):
        assert run(opts, environ=env) == 128 + signal.SIGKILL
    assert [r["lost_nodes"] for r in read_ledger(ck)] == [["n2"]] * 3
    assert [r["latest_before"] for r in read_ledger(ck)] == [None, 30, 30]
    # outside Slurm the same kill is not a lost node
    assert run(opts, environ=job_free_env()) == 128 + signal.SIGKILL
    assert read_ledger(ck)[-1]["lost_nodes"] == []
