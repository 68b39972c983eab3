"""The Snakemake workflow (workflows/Snakefile, local profile) and its checkpoint-dir helpers.

Real ``snakemake`` runs with real MPI ranks and simulated walltime kills: every attempt is cut
short by ``resilient run --walltime``, checkpoints and exits 75, and is requeued in place
(``--requeue``, the profile's default: no Snakemake retry is spent on a stop) or, with
``requeue=false``, ends the job for Snakemake's retry to resume. Each run works in ``tmp_path``
(``--directory``), with the campaign replaced by a small test campaign.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import yaml

from resilient import CheckpointManager
from resilient.integrations.snakemake import (
    MpiLaunch,
    SimulatedWalltime,
    TaskLabel,
    cleanup_command,
    mpi_resources,
    resilient_run,
    retries,
    slurm_requeue,
)
from resilient.io import logs, storage
from resilient.io.checkpoints import latest_valid, list_checkpoints
from resilient.job.ledger import read_ledger
from resilient.workflow import (
    checkpoint_dir,
    cleanup,
    fingerprint,
    latest_checkpoint,
    main,
    stale_siblings,
    task_key,
)
from tests.mpirun import REPO, clean_env, mpiexec

SNAKEFILE = REPO / "workflows" / "Snakefile"
PROFILE = REPO / "configs" / "profiles" / "local"

# Attempts last WALLTIME s: USR1 after 3 s stops the run (the small margin keeps the deadline
# check from racing the signal), SIGTERM at 4 s, SIGKILL at 5 s. So an attempt makes fewer
# than 3 s / step_delay steps, 85 heat steps (>= 35 ms each) or 60 train steps (>= 50 ms),
# fewer still after the MPI start-up (0.7-1 s): ~60 and ~45 seen. Each task needs more than
# twice that (180 / 130 steps), so every task is stopped at least twice before it finishes.
WALLTIME = 4
POLICY = {
    "checkpoint_comm": "node",
    "save_when": {"every_steps": 20, "on_signal": True},
    "keep": {"last": 2},
    "walltime_margin_s": 0.2,
}
CASES = {
    "hot": {"nx": 48, "ny": 48, "steps": 180, "alpha": 0.2},
    "wide": {"nx": 64, "ny": 32, "steps": 180, "alpha": 0.15},
}
TRAIN = {"ranks": 2, "steps": 130, "checkpoint_every": 20, "step_delay": 0.05}
HEAT_DELAY = 0.035


def campaign(tmp: Path, **changes: Any) -> dict[str, Any]:
    """The test campaign (same shape as configs/campaign.yaml), results and ckpt in ``tmp``."""
    cases = {name: dict(c) for name, c in CASES.items()}
    for name, c in changes.pop("cases", {}).items():
        cases[name].update(c)
    doc: dict[str, Any] = {
        "results": str(tmp / "results"),
        "checkpoint_root": str(tmp / "ckpt"),
        "walltime": None,  # pipeline.py's key; the Snakefile refuses it (resilient_walltime)
        "heat": {"ranks": 4, "checkpoint_every": 20, "step_delay": HEAT_DELAY, "cases": cases},
        "train": dict(TRAIN),
        # explicit: Snakemake's job subprocesses merge the Snakefile's default configfile back
        # in despite --replace-workflow-config, so an absent section would read as the
        # default's `enabled: auto` there (and as absent in the main process)
        "train_torch": {"enabled": False},
    }
    doc.update(changes)
    return doc


def snakemake(
    tmp: Path,
    doc: dict[str, Any],
    *targets: str,
    retries: int = 10,
    requeue: bool = True,
    cleanup_ckpt: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run the workflow with the local profile in ``tmp/work``; return the finished process."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    policy = tmp / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    configfile = tmp / "campaign.yaml"
    configfile.write_text(yaml.safe_dump(doc))
    cmd = [
        sys.executable, "-m", "snakemake", "--profile", str(PROFILE), "-s", str(SNAKEFILE),
        "--directory", str(work), "--configfile", str(configfile), "--replace-workflow-config",
        # the command-line --configfile replaces the profile's (workflow-config.yaml): its
        # resilient_* keys (read by resilient_run()) are given here
        "--config", f"resilient_walltime={WALLTIME}", "resilient_signal=USR1@1",
        "resilient_kill_wait=1", f"resilient_requeue={requeue}", f"checkpoint_config={policy}",
        f"retries={retries}", f"cleanup_checkpoints={cleanup_ckpt}",
        "--", *targets,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp, env=clean_env(), capture_output=True, text=True, timeout=600
    )
    (tmp / "snakemake.log").open("a").write(proc.stdout + proc.stderr)
    return proc


def fail(proc: subprocess.CompletedProcess[str]) -> str:
    return f"snakemake exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}"


def task_dirs(tmp: Path) -> dict[str, Path]:
    """Checkpoint dirs by task name (``heat/hot``, ``train``): must be exactly one each."""
    out: dict[str, Path] = {}
    for rule_dir in sorted((tmp / "ckpt").iterdir()):
        for d in sorted(rule_dir.iterdir()):
            if d.name.startswith("."):  # resilient run's records beside the directories
                continue
            name = (
                rule_dir.name
                if rule_dir.name == "train"
                else f"{rule_dir.name}/{d.name.rsplit('-', 1)[0]}"
            )
            assert name not in out, f"two checkpoint dirs for {name}: {out[name]}, {d}"
            out[name] = d
    return out


def dataset_sha256(path: Path) -> str:
    """sha256 of every dataset's bytes in name order (as the summary rule computes it)."""
    names: list[str] = []
    digest = hashlib.sha256()
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
        for n in sorted(names):
            digest.update(np.ascontiguousarray(f[n][()]).tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Uninterrupted runs of the apps themselves (no resilient run, no Snakemake, no delay)."""
    d = tmp_path_factory.mktemp("reference")
    out: dict[str, str] = {}
    runs = {
        f"heat/{name}": [
            "-n", "4", sys.executable, "-m", "apps.heat", "--nx", str(c["nx"]), "--ny", str(c["ny"]),
            "--steps", str(c["steps"]), "--alpha", str(c["alpha"]),
        ]
        for name, c in CASES.items()
    }  # fmt: skip
    runs["train"] = ["-n", "2", sys.executable, "-m", "apps.train", "--steps", str(TRAIN["steps"])]
    for task, args in runs.items():
        tag = task.replace("/", "-")
        cmd = [mpiexec(), *args, "--checkpoint-dir", str(d / tag), "--out", str(d / f"{tag}.h5")]
        proc = subprocess.run(
            cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[task] = dataset_sha256(d / f"{tag}.h5")
    return out


# --------------------------------------------------------------------------- workflow runs


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_walltime_kills_resume_to_bit_identical_outputs(
    tmp_path: Path, reference: dict[str, str]
) -> None:
    """Each task needs several walltime stops and has no Snakemake retry at all (retries=0):
    the stops are requeued in place, so the budget is never spent on them."""
    proc = snakemake(tmp_path, campaign(tmp_path), retries=0, cleanup_ckpt=True)
    assert proc.returncode == 0, fail(proc)
    assert "Trying to restart" not in proc.stdout + proc.stderr

    dirs = task_dirs(tmp_path)
    assert sorted(dirs) == ["heat/hot", "heat/wide", "train"]
    for task, d in dirs.items():
        ledger = read_ledger(d)
        codes = [r["exit_code"] for r in ledger]
        assert codes[-1] == 0 and codes.count(75) >= 2, (task, codes)
        assert ledger[0]["latest_before"] is None
        for before, after in itertools.pairwise(ledger):  # each resumed where the last stopped
            assert after["latest_before"] == before["latest_after"], (task, ledger)
        # cleanup_checkpoints: the data is gone, the logs stay
        assert list_checkpoints(d) == [] and not (d / "static").exists()
        assert {p.name for p in d.iterdir()} >= {"attempts.jsonl", "saves.jsonl", ".resilient-root"}

    summary = json.loads((tmp_path / "results" / "summary.json").read_text())["tasks"]
    assert sorted(summary) == sorted(reference)
    results = tmp_path / "results"
    outputs = {f"heat/{c}": results / "heat" / f"{c}.h5" for c in CASES}
    outputs["train"] = results / "train" / "model.h5"
    for task, path in outputs.items():
        assert dataset_sha256(path) == reference[task], f"{task} differs from the reference"
        assert summary[task]["sha256"] == reference[task]
        assert summary[task]["output"] == str(path)
        assert Path(summary[task]["checkpoint_dir"]) == dirs[task]
    assert summary["heat/hot"]["steps"] == CASES["hot"]["steps"]
    assert summary["train"]["steps"] == TRAIN["steps"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_changed_parameter_starts_fresh_while_unchanged_case_resumes(tmp_path: Path) -> None:
    targets = [str(tmp_path / "results" / "heat" / f"{c}.h5") for c in CASES]
    # a partial run: every case is stopped once and, without requeue or retries, left unfinished
    first = snakemake(tmp_path, campaign(tmp_path), *targets, retries=0, requeue=False)
    assert first.returncode != 0, fail(first)
    before = task_dirs(tmp_path)
    for task in ("heat/hot", "heat/wide"):
        assert [r["exit_code"] for r in read_ledger(before[task])] == [75]

    changed = campaign(tmp_path, cases={"hot": {"alpha": 0.1}})
    second = snakemake(tmp_path, changed, *targets, requeue=False)  # Snakemake's retries
    assert second.returncode == 0, fail(second)

    hot_dirs = sorted((tmp_path / "ckpt" / "heat").glob("hot-*"))
    assert len(hot_dirs) == 2
    (new_hot,) = (d for d in hot_dirs if d != before["heat/hot"])
    ledger = read_ledger(new_hot)
    assert ledger[0]["latest_before"] is None, ledger  # a fresh start
    assert ledger[-1]["exit_code"] == 0
    assert stale_siblings(new_hot) == [str(before["heat/hot"])]
    assert len(read_ledger(before["heat/hot"])) == 1  # the old one is left alone
    assert latest_valid(before["heat/hot"]) is not None

    wide = sorted((tmp_path / "ckpt" / "heat").glob("wide-*"))
    assert wide == [before["heat/wide"]]  # same parameters, same directory
    ledger = read_ledger(wide[0])
    assert ledger[1]["latest_before"] is not None, ledger  # resumed
    assert ledger[1]["latest_before"] == ledger[0]["latest_after"]
    assert ledger[-1]["exit_code"] == 0
    with h5py.File(tmp_path / "results" / "heat" / "hot.h5") as f:
        assert int(f.attrs["steps"]) == CASES["hot"]["steps"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_changed_rank_count_resumes_instead_of_starting_over(
    tmp_path: Path, reference: dict[str, str]
) -> None:
    """A rule whose rank count changes between attempts (4, then 2) keeps its checkpoint
    directory (the key has no rank count) and resumes the 4-rank checkpoint on 2 ranks."""
    out = tmp_path / "results" / "heat" / "hot.h5"
    first = snakemake(tmp_path, campaign(tmp_path), str(out), retries=0, requeue=False)
    assert first.returncode != 0, fail(first)
    (before,) = task_dirs(tmp_path).values()
    assert [r["exit_code"] for r in read_ledger(before)] == [75]

    doc = campaign(tmp_path)
    doc["heat"]["ranks"] = 2
    second = snakemake(tmp_path, doc, str(out))
    assert second.returncode == 0, fail(second)
    assert list(task_dirs(tmp_path).values()) == [before]
    ledger = read_ledger(before)
    assert ledger[1]["latest_before"] == ledger[0]["latest_after"] is not None, ledger
    assert ledger[-1]["exit_code"] == 0
    assert dataset_sha256(out) == reference["heat/hot"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_dir_survives_a_failed_job(tmp_path: Path) -> None:
    out = tmp_path / "results" / "heat" / "hot.h5"
    proc = snakemake(tmp_path, campaign(tmp_path), str(out), retries=0, requeue=False)
    assert proc.returncode != 0, fail(proc)
    assert "Error in rule heat" in proc.stdout + proc.stderr
    assert not out.exists()
    (d,) = task_dirs(tmp_path).values()
    ledger = read_ledger(d)
    assert [r["exit_code"] for r in ledger] == [75]
    latest = latest_valid(d)
    assert latest is not None and latest.step == ledger[0]["latest_after"]
    assert latest_checkpoint(d) == str(latest.path)


# --------------------------------------------------------------------------- a user's own rule

# A user's own Snakefile, as docs/howto/snakemake.md includes it: the helper import, a keyed
# checkpoint directory in params, retries(N), the resilient_run() prefix. No sys.path or
# PYTHONPATH lines: `resilient` is installed, `mpiexec` and `python` come from PATH (here the
# venv's; the test's environment stands in for an installed `apps`). The simulated walltime
# comes from the workflow config (the local profile's resilient_walltime), not from the rule.
USER_SNAKEFILE = (REPO / "docs" / "examples" / "snakemake" / "Snakefile").read_text()


def user_ckpt(tmp: Path, case: str) -> Path:
    """The user's rule's checkpoint directory for ``case``."""
    return tmp / checkpoint_dir("ckpt", "heat", {"steps": 150}, wildcards={"case": case})


def user_snakemake(
    tmp: Path,
    walltime: float | None,
    *targets: str,
    snakefile: str = USER_SNAKEFILE,
    config: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """A user's Snakefile in ``tmp`` with this repository's local profile; ``walltime``
    overrides the profile's, with `resilient run`'s default signal lead and kill wait (the
    settings these tests were written for; ``None``: the profile's walltime and settings)."""
    (tmp / "Snakefile").write_text(snakefile)
    policy = tmp / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "--profile", str(PROFILE), "-s", "Snakefile"]
    if walltime is not None or config:
        wall = () if walltime is None else (
            f"resilient_walltime={walltime}", "resilient_signal=null", "resilient_kill_wait=5"
        )
        cmd += ["--config", *wall, f"checkpoint_config={policy}", *config]
    cmd += [*options, "--", *targets]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    with (tmp / "snakemake.log").open("a") as fh:
        fh.write(proc.stdout + proc.stderr)
    return proc


def test_a_users_rule_gets_the_profiles_walltime(tmp_path: Path) -> None:
    """A dry run: the local profile's `config:` reaches `resilient run` through
    resilient_run(), with Snakemake's interpreter; without a walltime there are no options."""
    proc = user_snakemake(tmp_path, None, "results/hot.h5", options=("-n", "-p"))
    assert proc.returncode == 0, fail(proc)
    ckpt = checkpoint_dir("ckpt", "heat", {"steps": 150}, wildcards={"case": "hot"})
    prefix = (
        f"{sys.executable} -m resilient.cli run --walltime 6 --signal USR1@1 --kill-wait 1 "
        f"--requeue --checkpoint-dir {ckpt} --task 'heat case=hot' --outputs results/hot.h5 "
        "-- mpiexec"
    )
    assert prefix in proc.stdout, proc.stdout
    proc = user_snakemake(
        tmp_path, None, "results/hot.h5", config=("resilient_walltime=null",), options=("-n", "-p")
    )
    assert proc.returncode == 0, fail(proc)
    assert f"run --checkpoint-dir {ckpt} --task 'heat case=hot'" in proc.stdout, proc.stdout
    assert "--walltime" not in proc.stdout


def test_one_key_on_the_command_line_keeps_the_profiles_others(tmp_path: Path) -> None:
    """`--config resilient_walltime=5` is merged over the profile's config file key by key: the
    signal, kill wait, requeue and checkpoint policy stay the profile's (a profile's `config:`
    entry would be replaced whole). Snakemake runs in a directory of the user's, away from the
    repository, with the profile named by its absolute path."""
    (tmp_path / "Snakefile").write_text(USER_SNAKEFILE)
    cmd = [
        sys.executable, "-m", "snakemake", "--profile", str(PROFILE), "-s", "Snakefile",
        "-n", "-p", "--config",
    ]  # fmt: skip
    ckpt = checkpoint_dir("ckpt", "heat", {"steps": 150}, wildcards={"case": "hot"})
    for config, options in [
        (["resilient_walltime=5"], "--walltime 5 --signal USR1@1 --kill-wait 1 --requeue"),
        (["resilient_requeue=false"], "--walltime 6 --signal USR1@1 --kill-wait 1 --checkpoint"),
    ]:
        proc = subprocess.run(
            [*cmd, *config, "--", "results/hot.h5"],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, fail(proc)
        assert f"{sys.executable} -m resilient.cli run {options}" in proc.stdout, proc.stdout
        assert f"--checkpoint-dir {ckpt} --task 'heat case=hot'" in proc.stdout, proc.stdout
        assert "--config configs/checkpoint/demo.yaml" in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_users_rule_outlasts_its_retries_with_walltime_stops_that_progress(
    tmp_path: Path,
) -> None:
    """150 steps of >= 30 ms under 3-s attempts: more walltime stops than the rule's 1 retry,
    each with progress, requeued in place; it finishes, bit-identical to an uninterrupted run."""
    proc = user_snakemake(tmp_path, 3, "results/slow.h5")
    assert proc.returncode == 0, fail(proc)
    assert "Trying to restart" not in proc.stdout + proc.stderr  # no retry spent
    ledger = read_ledger(user_ckpt(tmp_path, "slow"))
    codes = [r["exit_code"] for r in ledger]
    assert len(codes) >= 3 and codes[:-1] == [75] * (len(codes) - 1) and codes[-1] == 0, codes
    assert all(r["progress"] for r in ledger), ledger
    for before, after in itertools.pairwise(ledger):
        assert after["latest_before"] == before["latest_after"], ledger

    ref = tmp_path / "ref"
    cmd = [
        mpiexec(), "-n", "2", sys.executable, "-m", "apps.heat", "--steps", "150",
        "--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5"),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, timeout=180)
    assert done.returncode == 0, done
    assert dataset_sha256(tmp_path / "results" / "slow.h5") == dataset_sha256(ref / "out.h5")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_users_rule_without_progress_stops_with_93_after_two_attempts(tmp_path: Path) -> None:
    """A 0.05-s walltime, far shorter than the program's start (Python and numpy alone take
    longer): no attempt can checkpoint. The program is started twice, then exit 93; Snakemake's
    one retry finds the ledger and `resilient run` refuses at once (exit 93) without starting
    the program a third time. (0.3 s was not short enough: a program that started in 0.2 s
    took its final checkpoint at the stop signal, made progress and was rightly requeued.)"""
    proc = user_snakemake(tmp_path, 0.05, "results/stuck.h5")
    assert proc.returncode != 0, fail(proc)
    ledger = read_ledger(user_ckpt(tmp_path, "stuck"))
    assert [r["exit_code"] for r in ledger][-1] == 93, ledger
    assert len(ledger) == 2 and not any(r["progress"] for r in ledger), ledger
    text = proc.stdout + proc.stderr
    assert text.count("Trying to restart") == 1, text[-4000:]
    assert "2 consecutive attempts made no progress" in text and "not starting again" in text
    assert not (tmp_path / "results" / "stuck.h5").exists()

    # Issue 33: the person who fixed the cause (here: the walltime) runs snakemake again: a new
    # run, which starts the program again with one line, and finishes
    again = user_snakemake(tmp_path, 30, "results/stuck.h5")
    assert again.returncode == 0, fail(again)
    text = again.stdout + again.stderr
    assert text.count("a new run of this task: started anew (snakemake pid") == 1, text[-4000:]
    ledger = read_ledger(user_ckpt(tmp_path, "stuck"))
    assert [r["exit_code"] for r in ledger][1:] == [93, 0], ledger
    assert ledger[-1]["new_run"].startswith("started anew") and ledger[0]["engine"] != ledger[-1]["engine"]
    assert (tmp_path / "results" / "stuck.h5").exists()


# The checkpoint directory declared as the output: Snakemake deletes it before each retry.
# With the helper, `resilient run` sees it among the job's outputs and refuses before the
# first attempt; with a prefix written by hand, it notices on the retry that the directory it
# checkpointed into is gone.
OUTPUT_SNAKEFILE_HELPER = """
from resilient.integrations.snakemake import resilient_run, retries

rule heat:
    output: directory("ckpt/{case}")
    retries: retries(1)
    shell: resilient_run("{output}") + "mpiexec -n 2 python -m apps.heat --steps 150"
           " --checkpoint-dir {output:q} --out results/{wildcards.case}.h5"
"""
OUTPUT_SNAKEFILE_BY_HAND = """
rule heat:
    output: directory("ckpt/{case}")
    retries: 2
    shell: "resilient run --checkpoint-dir {output} --walltime {config[resilient_walltime]} --"
           " mpiexec -n 2 python -m apps.heat --steps 150 --step-delay 0.03 --checkpoint-every 10"
           " --config {config[checkpoint_config]} --checkpoint-dir {output} --out results/{wildcards.case}.h5"
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_dir_declared_as_output_is_refused_with_the_helper(tmp_path: Path) -> None:
    proc = user_snakemake(tmp_path, 3, "ckpt/hot", snakefile=OUTPUT_SNAKEFILE_HELPER)
    assert proc.returncode != 0, fail(proc)
    text = proc.stdout + proc.stderr
    assert (
        "the checkpoint directory ckpt/hot is the declared output ckpt/hot of task 'heat case=hot'"
        in text
    ), text[-4000:]
    assert "Keep checkpoints out of a task's outputs" in text and "params: ckpt=" in text
    assert "returned non-zero exit status 78" in text, text[-4000:]
    assert "resilient run [heat case=hot]: the checkpoint directory" in text  # named
    assert "]: attempt" not in text  # the program never started
    assert not (tmp_path / "ckpt" / ".hot.resilient-attempts").exists()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_dir_declared_as_output_by_hand_is_refused_on_the_retry(
    tmp_path: Path,
) -> None:
    """The first attempt checkpoints and is stopped (exit 75); Snakemake deletes the output,
    the checkpoint directory, and retries: `resilient run` refuses (78) instead of starting
    again from step 0, and refuses the next retry at once too."""
    proc = user_snakemake(tmp_path, 3, "ckpt/hot", snakefile=OUTPUT_SNAKEFILE_BY_HAND)
    assert proc.returncode != 0, fail(proc)
    text = proc.stdout + proc.stderr
    # no --task: the lines are named after the checkpoint directory
    assert text.count("resilient run [ckpt/hot]: attempt") == 1, text[-4000:]  # one start
    assert "attempt 1: stopped early" in text, text[-4000:]
    assert (
        text.count(
            "the checkpoint directory ckpt/hot of the task was deleted after attempt 1 (exit 75)"
        )
        == 2
    ), text[-4000:]
    assert "Keep checkpoints out of a task's outputs" in text
    assert text.count("Trying to restart") == 2
    sidecar = tmp_path / "ckpt" / ".hot.resilient-attempts"
    assert [r["exit_code"] for r in logs.read_log(sidecar, logs.SIDECAR)] == [75]


# A fixed checkpoint directory keeps the checkpoints of other parameters: the program refuses
# them (its run_key differs: exit 78, "belongs to another run"), and `resilient run` neither
# retries nor requeues that. checkpoint_dir() keys the directory with the parameters, so a
# change starts fresh beside the old one.
RUN_KEY_SNAKEFILE = """
from resilient.integrations.snakemake import checkpoint_dir, resilient_run, retries

ALPHA = float(config["alpha"])
HEAT = "mpiexec -n 2 python -m apps.heat --nx 32 --ny 32 --steps 60 --checkpoint-every 10"

rule fixed:
    output: "results/fixed.h5"
    params: ckpt="ckpt/fixed", alpha=ALPHA
    retries: retries(1)
    shell: resilient_run() + HEAT + " --alpha {params.alpha} --checkpoint-dir {params.ckpt:q} --out {output}"

rule keyed:
    output: "results/keyed.h5"
    params: ckpt=lambda wc: checkpoint_dir("ckpt", "keyed", {"alpha": ALPHA}), alpha=ALPHA
    retries: retries(1)
    shell: resilient_run() + HEAT + " --alpha {params.alpha} --checkpoint-dir {params.ckpt:q} --out {output}"
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_changed_parameter_in_a_fixed_directory_fails_with_78(tmp_path: Path) -> None:
    targets = ("results/fixed.h5", "results/keyed.h5")
    first = user_snakemake(
        tmp_path, 30, *targets, snakefile=RUN_KEY_SNAKEFILE, config=("alpha=0.2",)
    )
    assert first.returncode == 0, fail(first)
    keyed_before = sorted((tmp_path / "ckpt" / "keyed").glob("keyed-*"))

    # the params changed: Snakemake reruns both jobs
    second = user_snakemake(
        tmp_path, 30, *targets, snakefile=RUN_KEY_SNAKEFILE, config=("alpha=0.15",)
    )
    assert second.returncode != 0, fail(second)
    text = second.stdout + second.stderr
    assert "belongs to another run" in text and "returned non-zero exit status 78" in text
    assert "Error in rule fixed" in text and "Error in rule keyed" not in text
    # the program refused once; Snakemake's retry was refused at once, without starting it
    # (no ledger line), and nothing was retried or requeued inside `resilient run`
    codes = [r["exit_code"] for r in read_ledger(tmp_path / "ckpt" / "fixed")]
    assert codes == [0, 78], codes
    assert text.count("Trying to restart") == 1, text[-4000:]
    assert "Not starting the program again for this retry (exit 78)" in text, text[-4000:]

    keyed = sorted((tmp_path / "ckpt" / "keyed").glob("keyed-*"))
    (fresh,) = set(keyed) - set(keyed_before)
    ledger = read_ledger(fresh)
    assert [r["exit_code"] for r in ledger] == [0] and ledger[0]["latest_before"] is None
    assert json.loads((fresh / "run_key.json").read_text())["alpha"] == 0.15
    with h5py.File(tmp_path / "results" / "keyed.h5") as f:
        assert int(f.attrs["steps"]) == 60


# --------------------------------------------------------------------------- helpers


@dataclass
class FakeWorkflow:
    """What the helpers read of Snakemake's Workflow."""

    config: dict[str, Any] = field(default_factory=dict)
    remote_exec: bool = False
    globals: dict[str, Any] = field(default_factory=dict)


def test_retries_are_zero_inside_a_cluster_job() -> None:
    assert retries(10, FakeWorkflow()) == 10
    assert retries(10, FakeWorkflow(remote_exec=True)) == 0
    assert retries(3) == 3  # no workflow running in this process
    with pytest.raises(ValueError):
        retries(-1, FakeWorkflow())


def test_simulated_walltime_from_the_config() -> None:
    assert SimulatedWalltime.from_config({}) is None
    for unset in (None, "null", "", "0", "none", False):
        assert SimulatedWalltime.from_config({"resilient_walltime": unset}) is None
    wall = SimulatedWalltime.from_config(
        {"resilient_walltime": "6", "resilient_signal": "USR1@1", "resilient_kill_wait": 1}
    )
    assert wall == SimulatedWalltime(walltime_s=6, signal="USR1@1", kill_wait_s=1)
    assert wall.options() == [
        "--walltime",
        "6",
        "--signal",
        "USR1@1",
        "--kill-wait",
        "1",
        "--requeue",
    ]
    assert wall.options(min_walltime_s=12)[:2] == ["--walltime", "12"]
    plain = SimulatedWalltime.from_config(
        {"resilient_walltime": "5m", "resilient_requeue": "false"}
    )
    assert plain is not None and plain.options() == ["--walltime", "300"]
    compound = SimulatedWalltime.from_config(
        {"resilient_walltime": "1h30m", "resilient_kill_wait": "1m", "resilient_requeue": False}
    )
    assert compound is not None and compound.options() == ["--walltime", "5400", "--kill-wait", "60"]
    for bad in ({"resilient_walltime": "soon"}, {"resilient_walltime": 6, "resilient_signal": "USR1"},
                {"resilient_walltime": 6, "resilient_requeue": "maybe"}):  # fmt: skip
        with pytest.raises(ValueError, match="resilient_"):
            SimulatedWalltime.from_config(bad)


def test_resilient_run_names_its_settings_in_the_snakefile_namespace() -> None:
    """The command text stays the same whatever the walltime or the interpreter (Snakemake
    reruns a finished job whose command text changed); the settings go to a global."""
    py = shlex.quote(sys.executable)
    local = FakeWorkflow(
        config={"resilient_walltime": 6, "resilient_signal": "USR1@1", "resilient_kill_wait": 1}
    )
    cluster = FakeWorkflow()
    for wf in (local, cluster):
        assert resilient_run(workflow=wf) == (
            "{_resilient_run} --checkpoint-dir {params.ckpt:q} "
            "--task {_resilient_task:{rule} {wildcards}:u} --outputs {output:q} -- "
        )
    assert local.globals["_resilient_run"] == (
        f"{py} -m resilient.cli run --walltime 6 --signal USR1@1 --kill-wait 1 --requeue"
    )
    assert cluster.globals["_resilient_run"] == f"{py} -m resilient.cli run"
    text = resilient_run("ckpt/x y", min_walltime=12, min_kill_wait=3, workflow=local)
    assert text.startswith("{_resilient_run_w12_k3} --checkpoint-dir 'ckpt/x y' ")
    assert local.globals["_resilient_run_w12_k3"].endswith(
        "--walltime 12 --signal USR1@1 --kill-wait 3 --requeue"
    )
    assert "--checkpoint-dir {output:q} " in resilient_run("{output}", workflow=cluster)
    assert resilient_run(workflow=object()).startswith(f"{py} -m resilient.cli run --checkpoint")
    assert cleanup_command(workflow=cluster) == (
        "{_resilient_python} -m resilient.workflow cleanup {params.ckpt:q} {output:q}"
    )
    assert cluster.globals["_resilient_python"] == py


@pytest.mark.parametrize(
    ("spec", "word"),
    [
        ("sim case=a,n=1:", "'sim case=a,n=1'"),  # as Snakemake passes it (the u stripped)
        ("sim case=a:u", "'sim case=a'"),  # a formatter that keeps the u
        ("sim :", "sim"),  # a rule without wildcards
        ("sim case=x'y;$(id):", "'sim case=x'\"'\"'y;$(id)'"),
        ("sim case=a:u:", "'sim case=a:u'"),  # a value that ends in :u
        ("sim case=a\nb:", "'sim case=a b'"),  # one line
    ],
)
def test_task_label_quotes_its_spec(spec: str, word: str) -> None:
    assert format(TaskLabel(), spec) == word
    assert len(shlex.split(word)) == 1  # one word for the shell


TASK_SNAKEFILE = """
from resilient.integrations.snakemake import resilient_run

rule all:
    input: expand("out/{case}.{n}.txt", case=["a", "b c", "x'y;$(touch pwned)"], n=[1])

rule sim:
    output: "out/{case}.{n}.txt"
    params: ckpt="ckpt/{case}"
    shell: resilient_run() + "python -c pass && touch {output:q}"
"""


def test_the_rule_and_its_wildcards_name_every_line(tmp_path: Path) -> None:
    """A real Snakemake: the label reaches `resilient run` as one word, whatever the values
    (Snakemake ignores `:q` on `{wildcards}` itself: the label must not rely on it)."""
    (tmp_path / "Snakefile").write_text(TASK_SNAKEFILE)
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "-c1", "-j1", "-s", "Snakefile"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, fail(proc)
    text = proc.stdout + proc.stderr
    for case in ("a", "b c", "x'y;$(touch pwned)"):
        line = f"resilient run [sim case={case},n=1]: attempt 1: finished;"
        assert line in text, text[-4000:]
    assert not (tmp_path / "pwned").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "a.1.txt", "b c.1.txt", "x'y;$(touch pwned).1.txt",
    ]  # fmt: skip


def test_mpi_resources_go_with_the_launcher_words() -> None:
    """The plugin's `mpi` resource always comes with `nodes` and `tasks`; the launcher words
    follow the launcher chosen when the job runs (srun gets the node count too)."""
    assert mpi_resources(nodes=2, tasks=4, launcher="srun --mpi=pmi2") == {
        "nodes": 2, "tasks": 4, "mpi": "srun --mpi=pmi2",
    }  # fmt: skip
    assert mpi_resources(tasks=4)["mpi"]  # srun where there is one, else an mpiexec
    for nodes, tasks in ((0, 4), (2, 1), (1, 0)):
        with pytest.raises(ValueError, match="nodes <= tasks"):
            mpi_resources(nodes=nodes, tasks=tasks)
    assert format(MpiLaunch(), "srun --mpi=pmi2|2|4:") == "srun --mpi=pmi2 -N 2 -n 4"
    assert format(MpiLaunch(), "/usr/bin/srun|3|6:u") == "/usr/bin/srun -N 3 -n 6"
    assert format(MpiLaunch(), "/venv/bin/mpiexec|1|4:") == "/venv/bin/mpiexec -n 4"
    for bad in ("|2|4:", "srun|two|4:", "srun:"):
        with pytest.raises(ValueError, match="mpi_resources"):
            format(MpiLaunch(), bad)
    wf = FakeWorkflow()
    assert resilient_run(mpi=True, workflow=wf).endswith(
        " -- {_resilient_mpi:{resources.mpi}|{resources.nodes}|{resources.tasks}:u} "
    )
    assert isinstance(wf.globals["_resilient_mpi"], MpiLaunch)
    assert resilient_run(mpi=True, workflow=object()).endswith(
        " -- {resources.mpi} -n {resources.tasks} "
    )


def test_slurm_requeue_from_the_config() -> None:
    """`resilient_slurm_requeue: true` adds --requeue where no walltime is simulated."""
    py = shlex.quote(sys.executable)
    on = FakeWorkflow(config={"resilient_slurm_requeue": "true"})
    resilient_run(workflow=on)
    assert on.globals["_resilient_run"] == f"{py} -m resilient.cli run --requeue"
    assert slurm_requeue(on) and not slurm_requeue(FakeWorkflow()) and not slurm_requeue()
    assert not slurm_requeue(FakeWorkflow(config={"resilient_slurm_requeue": "null"}))
    with pytest.raises(ValueError, match="resilient_slurm_requeue"):
        slurm_requeue(FakeWorkflow(config={"resilient_slurm_requeue": "maybe"}))
    local = FakeWorkflow(config={"resilient_walltime": 6, "resilient_slurm_requeue": True})
    resilient_run(workflow=local)  # a simulated walltime: its own requeue
    assert local.globals["_resilient_run"] == f"{py} -m resilient.cli run --walltime 6 --requeue"


MPI_SNAKEFILE = """
from resilient.integrations.snakemake import checkpoint_dir, mpi_resources, resilient_run, retries

rule sim:
    output: "results/{case}.h5"
    params: ckpt=lambda wc: checkpoint_dir("ckpt", "sim", {"a": 1}, wildcards=wc)
    resources: **mpi_resources(nodes=2, tasks=4, launcher="mpiexec")
    retries: retries(10)
    shell: resilient_run(mpi=True) + "python sim.py --case {wildcards.case} --out {output}"
"""


def test_a_multinode_rule_gets_the_launcher_of_its_resources(tmp_path: Path) -> None:
    """A real Snakemake (dry run): the launcher words come from the job's resources, after a
    profile's set-resources."""
    (tmp_path / "Snakefile").write_text(MPI_SNAKEFILE)
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "-n", "-p", "-c1", "-s", "Snakefile", "results/a.h5"]
    shells = {}
    for name, extra in (("local", []), ("slurm", ["--set-resources", "sim:mpi=srun --mpi=pmi2",
                                                   "--config", "resilient_slurm_requeue=true"])):  # fmt: skip
        proc = subprocess.run(
            [*cmd, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, fail(proc)
        (shells[name],) = [
            line.split("Shell command: ", 1)[1]
            for line in (proc.stdout + proc.stderr).splitlines()
            if "Shell command: " in line
        ]
    tail = "python sim.py --case a --out results/a.h5"
    assert shells["local"].endswith(f"--outputs results/a.h5 -- mpiexec -n 4 {tail}")
    assert shells["slurm"].endswith(f"-- srun --mpi=pmi2 -N 2 -n 4 {tail}")
    assert " run --requeue --checkpoint-dir " in shells["slurm"]


def test_checkpoint_dir_is_deterministic_and_keyed(tmp_path: Path) -> None:
    params = {"nx": 96, "alpha": 0.2}
    a = checkpoint_dir("ckpt", "heat", params, wildcards={"case": "hot"})
    assert a == checkpoint_dir(
        "ckpt", "heat", dict(reversed(params.items())), wildcards={"case": "hot"}
    )
    assert Path(a).parent == Path("ckpt/heat")
    key, digest = Path(a).name.rsplit("-", 1)
    assert key == "hot" and len(digest) == 12 and int(digest, 16) >= 0
    assert a != checkpoint_dir("ckpt", "heat", {"nx": 96, "alpha": 0.25}, wildcards={"case": "hot"})
    assert Path(checkpoint_dir("ckpt", "train")).name.startswith("train-")
    multi = checkpoint_dir("ckpt", "r", wildcards={"a": "x", "b": "y"})
    assert Path(multi).name.startswith("x_y-")

    # unsafe wildcard values stay inside the rule's directory and still differ
    for value in ("../../etc", "a/b", ".hidden"):
        p = Path(checkpoint_dir("ckpt", "heat", wildcards={"case": value}))
        assert p.parent == Path("ckpt/heat") and not p.name.startswith("."), p
    assert task_key({"case": "a/b"}) == task_key({"case": "a_b"})
    assert checkpoint_dir("c", "r", wildcards={"case": "a/b"}) != checkpoint_dir(
        "c", "r", wildcards={"case": "a_b"}
    )
    with pytest.raises(ValueError):
        checkpoint_dir("ckpt", "../x")

    # inputs: path, size and content count; mtime alone does not
    f = tmp_path / "mesh.dat"
    f.write_bytes(b"0123456789")
    one = fingerprint(params, [str(f)])
    os.utime(f, (1, 1))
    assert fingerprint(params, [str(f)]) == one
    f.write_bytes(b"0123456780")
    assert fingerprint(params, [str(f)]) != one
    assert fingerprint(params, str(f)) == fingerprint(params, [str(f)])
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "t1").write_text("x")
    tree = fingerprint(None, [str(folder)])
    (folder / "t1").write_text("y")
    assert fingerprint(None, [str(folder)]) != tree
    with pytest.raises(FileNotFoundError):
        fingerprint(None, [str(tmp_path / "missing")])


def make_root(path: Path, steps: tuple[int, ...] = (1, 2, 3)) -> None:
    with CheckpointManager(path) as m:
        for s in steps:
            m.save(s, {"x": np.full(10, s)}, static={"grid": np.arange(4)})
    logs.append_record(path / "attempts.jsonl", {"attempt": 1, "exit_code": 0})


def test_cleanup_keeps_logs_and_needs_every_output(tmp_path: Path) -> None:
    ck = Path(checkpoint_dir(tmp_path / "ckpt", "heat", {"alpha": 0.2}, wildcards={"case": "hot"}))
    old = Path(checkpoint_dir(tmp_path / "ckpt", "heat", {"alpha": 0.1}, wildcards={"case": "hot"}))
    other = Path(
        checkpoint_dir(tmp_path / "ckpt", "heat", {"alpha": 0.1}, wildcards={"case": "hotter"})
    )
    for d in (ck, old, other):
        make_root(d)
    (ck / "step_00000002").rename(ck / "step_00000002.quarantined-0123456789abcdef")
    assert stale_siblings(ck) == [str(old)]
    assert latest_checkpoint(ck) == str(ck / "step_00000003")

    out = tmp_path / "out.h5"
    assert cleanup(ck, [str(out)]) == []  # output missing: keep everything
    assert latest_checkpoint(ck) is not None
    out.write_bytes(b"done")
    removed = cleanup(ck, str(out))
    assert {Path(p).name for p in removed} == {
        "step_00000001", "step_00000002.quarantined-0123456789abcdef", "step_00000003", "static"
    }  # fmt: skip
    assert sorted(p.name for p in ck.iterdir()) == [
        ".lock", ".resilient-root", ".resilient-root.copy", "attempts.jsonl", "saves.jsonl"
    ]  # fmt: skip
    assert latest_checkpoint(ck) is None and read_ledger(ck) == [{"attempt": 1, "exit_code": 0}]
    assert old.exists()  # stale siblings stay unless asked

    cleanup(ck, [str(out)], remove_stale=True)
    assert not old.exists() and other.exists() and stale_siblings(ck) == []
    assert not any(p.name.startswith(".trash") for p in ck.parent.iterdir())
    cleanup(ck, [str(out)], keep_logs=False)
    assert not ck.exists() and other.exists()


def test_cleanup_command_never_fails_the_job(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt" / "heat" / "hot-0123456789ab"
    make_root(ck)
    out = tmp_path / "out.h5"
    out.write_bytes(b"done")
    lock = storage.RootLock(ck)
    lock.acquire()  # a job still writing there
    try:
        assert main(["cleanup", str(ck), str(out)]) == 0
        assert latest_checkpoint(ck) is not None
    finally:
        lock.release()
    proc = subprocess.run(
        [sys.executable, "-m", "resilient.workflow", "cleanup", str(ck), str(out)],
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert latest_checkpoint(ck) is None and read_ledger(ck)


# --------------------------------------------------------------------------- the PyTorch task

# 100 steps of 0.15 s are 15 s of steps alone: longer than one 14-s attempt however fast torch
# starts (at 0.1 s a step, a fast machine once finished in one attempt and nothing was resumed).
# FSDP2: the sharded state (DTensors) through the rule; DDP is apps.train_torch's default, which
# tests/test_train_torch.py covers
TORCH_TASK = {
    "enabled": True, "ranks": 2, "steps": 100, "strategy": "fsdp2", "checkpoint_every": 10,
    "step_delay": 0.15, "min_walltime": 14,
}  # fmt: skip


@pytest.mark.torch
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_torch_task_resumes_to_bit_identical_output(tmp_path: Path) -> None:
    """The campaign's ``train_torch`` rule (``apps.train_torch --strategy fsdp2`` on 2 processes
    started by mpiexec): stopped by the simulated walltime (14 s per attempt, torch's start-up
    included), retried, finished bit-identical to an uninterrupted run."""
    ref = tmp_path / "reference"
    cmd = [
        mpiexec(), "-n", "2", sys.executable, "-m", "apps.train_torch",
        "--steps", str(TORCH_TASK["steps"]), "--strategy", "fsdp2",
        "--checkpoint-dir", str(ref / "ck"), "--out", str(ref / "out.h5"),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr

    out = tmp_path / "results" / "train_torch" / "model.h5"
    proc = snakemake(tmp_path, campaign(tmp_path, train_torch=dict(TORCH_TASK)), str(out))
    assert proc.returncode == 0, fail(proc)
    (d,) = (tmp_path / "ckpt" / "train_torch").glob("train_torch-*")
    codes = [r["exit_code"] for r in read_ledger(d)]
    assert codes[-1] == 0 and codes.count(75) >= 1, codes
    assert dataset_sha256(out) == dataset_sha256(ref / "out.h5")


def test_torch_task_only_when_enabled(tmp_path: Path) -> None:
    """``train_torch.enabled: false`` (or no section) leaves the rule out of ``all``; ``true``
    puts it in (a dry run: nothing is executed)."""
    doc = campaign(tmp_path)
    for section, expected in ((None, False), ({**TORCH_TASK, "enabled": False}, False),
                              ({**TORCH_TASK, "enabled": True}, True)):  # fmt: skip
        if section is not None:
            doc["train_torch"] = section
        configfile = tmp_path / "campaign.yaml"
        configfile.write_text(yaml.safe_dump(doc))
        cmd = [
            sys.executable, "-m", "snakemake", "-n", "-s", str(SNAKEFILE), "--cores", "1",
            "--directory", str(tmp_path / "dry"), "--configfile", str(configfile),
            "--replace-workflow-config",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ("train_torch" in proc.stdout) is expected, proc.stdout
