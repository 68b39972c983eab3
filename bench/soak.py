"""Reliability soak: SIGKILL the 4-rank heat app under ``resilient run`` at random moments.

Usage (from the repository root, with the project's environment)::

    python bench/soak.py --trials 200 --layouts self,node,world --mode both --json soak.json
    python bench/soak.py --trials 4 --mode both            # the short form (tests/test_soak.py)

For every layout (``self``: a file per rank, ``node``: a file per node, ``world``: one shared
file) and saving mode (``sync``, ``async``), it repeats ``--trials`` times: start
``resilient run -- mpiexec -n 4 python -m apps.heat ...`` on the current campaign's checkpoint
root (a checkpoint every ``--every`` steps), wait for a random moment, then SIGKILL either one
random rank process or every process of the job, the wrapper included (a node crash). About
half of the kills wait for a save to start (a pending ``.step_*.tmp-*`` directory in the root)
and land in it; the others land at a uniformly random time after the launch (start-up,
restore, stepping, saving). A kill counts as *inside a save* when a pending directory that
existed just before the kill is still there once every process is gone: that save was neither
committed nor rolled back.

After each kill, once no process of the job is left, the ``resilient`` command line (its
``main()``, in this process; ``--cli-subprocess`` runs it as a program instead) checks:

* *lost*: the newest valid checkpoint (``resilient status --json``) is older than the newest
  one committed before the kill (the highest ``step_*`` directory holding its ``COMMITTED``
  marker just before the kill, or the newest valid one seen after the previous kill);
* *regression*: the newest valid step is lower than at the previous observation of the same
  campaign (after the previous kill);
* *verify failure*: ``resilient verify ROOT STEP --full`` rejects the newest valid checkpoint;
* *invalid directory*: any ``step_*`` directory (a name readers trust) fails validation.

The next trial resumes the same campaign. A launch that finishes before its kill completes the
campaign: its newest valid checkpoint must be the last step (and pass ``verify --full``), and
its output file is compared byte for byte with an uninterrupted run's (same layout,
same rank count, no ``resilient run``, no kills) and a new campaign starts on a fresh root. The
campaign open after the last trial is run to completion without kills and compared too.

Printed (and written with ``--json``), per layout and mode and in total: trials (kills), kills
inside a save, rank kills, job kills, launches, campaigns completed, lost, regressions, verify
failures, invalid directories, non-identical outputs, hangs (a job that did not end within
``--hang-timeout`` s of a rank kill, or a process that survived its job) and unexpected exits.
Exit status 0 when every failure count is 0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's resilient and apps/, not an installed copy

from resilient import cli  # noqa: E402
from resilient.io import logs  # noqa: E402
from resilient.job.launch import find_mpiexec  # noqa: E402
from resilient.model import filenames  # noqa: E402

FAILURES = (
    "lost",
    "lost_protected",
    "regressions",
    "verify_failures",
    "invalid_dirs",
    "non_identical",
    "hangs",
    "unexpected_exits",
)
_POLL_S = 0.002


@dataclass
class Counts:
    """What one layout and mode went through."""

    layout: str
    mode: str
    trials: int = 0  # kills
    kills_in_save: int = 0
    rank_kills: int = 0
    job_kills: int = 0
    node_kills: int = 0  # --node-loss: one node's ranks and its local directory
    double_losses: int = 0  # --node-loss: both nodes lost with nothing protected in between
    rebuilds: int = 0  # --node-loss: launches that rebuilt a node's files from partner copies
    launches: int = 0
    campaigns: int = 0  # completed and compared
    lost: int = 0
    lost_protected: int = 0  # --node-loss: resumed older than the newest protected checkpoint
    regressions: int = 0
    verify_failures: int = 0
    invalid_dirs: int = 0
    non_identical: int = 0
    hangs: int = 0
    unexpected_exits: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def failures(self) -> int:
        return sum(getattr(self, name) for name in FAILURES)


@dataclass
class Settings:
    ranks: int
    steps: int
    every: int
    nx: int
    ny: int
    step_delay: float
    save_share: float
    rank_share: float
    max_delay_s: float
    hang_timeout_s: float
    cli_subprocess: bool
    keep_roots: bool
    node_loss: bool = False


# --------------------------------------------------------------------------- processes


def clean_env() -> dict[str, str]:
    """This environment minus inherited launcher variables, with this checkout first."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPIR_", "SLURM_", "RESILIENT_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def job_pids(root: Path) -> list[int]:
    """Every live process whose command line names ``root`` (the wrapper, mpiexec, the ranks)."""
    key, me, out = str(root), os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and any(key in a for a in _cmdline(int(entry))):
            out.append(int(entry))
    return out


def rank_pids(root: Path) -> list[int]:
    """The heat app's rank processes of ``root`` (started by mpiexec's proxy)."""
    out = []
    for pid in job_pids(root):
        argv = _cmdline(pid)
        if argv and Path(argv[0]).name.startswith("python") and "apps.heat" in argv:
            out.append(pid)
    return out


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _reap_zombies_ok(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (dead, waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_gone(root: Path, timeout_s: float) -> list[int]:
    """Wait until no live process names ``root``; return the survivors after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        alive = [p for p in job_pids(root) if not _reap_zombies_ok(p)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.02)


# --------------------------------------------------------------------------- the root


def pending_dirs(root: Path) -> set[str]:
    """Temporary directories of saves in progress (or killed) under ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return set()
    return {n for n in names if filenames.parse_tmp_dir(n) is not None}


def newest_committed(root: Path) -> int | None:
    """The highest step whose directory holds its commit marker (what a reader may trust)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    steps = [s for s in map(filenames.parse_step_dir, names) if s is not None]
    for step in sorted(steps, reverse=True):
        if (root / filenames.step_dir_name(step) / filenames.COMMITTED).exists():
            return step
    return None


def _env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def run_cli(args: list[str], *, subprocess_cli: bool) -> tuple[int, str]:
    """``resilient ARGS``: exit code and standard output."""
    if subprocess_cli:
        proc = subprocess.run(
            [sys.executable, "-m", "resilient.cli", *args], cwd=REPO, env=clean_env(),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return proc.returncode, proc.stdout
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(args)
    return code, out.getvalue()


# --------------------------------------------------------------------------- one campaign


NODES = ("nodeA", "nodeB")


def heat_command(
    s: Settings, root: Path, out: Path, lay: str, mode: str, local: Path | None = None
) -> list[str]:
    """The heat run; with ``local`` (``--node-loss``) on two MPI nodes of this machine, each
    with its local tier in ``local/<node>`` and partner copies, flushed every 5 saves."""
    half = s.ranks // 2
    nodes = ["-hosts", f"{NODES[0]}:{s.ranks - half},{NODES[1]}:{half}", "-launcher", "fork"]
    tier = ["--local-dir", f"{local}/$PMI_HOSTNAME", "--redundancy", "partner",
            "--flush-every", "5"]  # fmt: skip
    return [
        find_mpiexec(), "-n", str(s.ranks), *(nodes if local else []),
        sys.executable, "-m", "apps.heat", *(tier if local else []),
        "--nx", str(s.nx), "--ny", str(s.ny), "--steps", str(s.steps),
        "--checkpoint-dir", str(root), "--out", str(out), "--checkpoint-every", str(s.every),
        "--checkpoint-comm", lay, "--step-delay", str(s.step_delay),
        *(["--async-save"] if mode == "async" else []),
    ]  # fmt: skip


def wrapped(command: list[str], root: Path) -> list[str]:
    return [
        sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(root),
        "--max-no-progress", "1000000", "--", *command,
    ]  # fmt: skip


def reference_output(s: Settings, base: Path, lay: str, mode: str) -> bytes:
    """The output file of an uninterrupted run (no wrapper, no kills)."""
    d = base / f"reference-{lay}-{mode}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cmd = heat_command(s, d / "ck", d / "out.h5", lay, mode)
    cmd[cmd.index("--step-delay") + 1] = "0"
    subprocess.run(
        cmd, cwd=REPO, env=clean_env(), check=True, timeout=600,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    data = (d / "out.h5").read_bytes()
    shutil.rmtree(d, ignore_errors=True)
    return data


class Campaign:
    """One checkpoint root, resumed launch after launch until the run finishes."""

    def __init__(self, base: Path, number: int) -> None:
        self.dir = base / f"c{number:04d}"
        self.root = self.dir / "ck"
        self.out = self.dir / "out.h5"
        self.dir.mkdir(parents=True)
        self.observed: int | None = None  # newest valid step at the last observation
        self.launches = 0
        self.local = self.dir / "local"  # --node-loss: the nodes' local directories
        self.promise: int | None = None  # --node-loss: the next launch resumes at least here
        self.lost_nodes: set[str] = set()  # --node-loss: lost since the last new protection
        self.lost_at = 0.0
        self.launched_at = 0.0

    def log(self) -> Any:
        return open(self.dir / f"launch-{self.launches:03d}.log", "wb")


class Soak:
    def __init__(self, s: Settings, rng: random.Random, counts: Counts, base: Path) -> None:
        self.s, self.rng, self.c, self.base = s, rng, counts, base
        self.number = 0
        self.reference = b""

    def problem(self, what: str) -> None:
        self.c.problems.append(what)
        print(f"  PROBLEM [{self.c.layout}/{self.c.mode}] {what}", flush=True)

    def new_campaign(self) -> Campaign:
        self.number += 1
        return Campaign(self.base, self.number)

    def run(self, trials: int) -> None:
        t0 = time.monotonic()
        self.reference = reference_output(self.s, self.base, self.c.layout, self.c.mode)
        campaign = self.new_campaign()
        while self.c.trials < trials:
            if self.trial(campaign):
                campaign = self.new_campaign()
            elif self.c.trials % 25 == 0:
                print(
                    f"  [{self.c.layout}/{self.c.mode}] {self.c.trials} kills, "
                    f"{self.c.kills_in_save} inside a save, {self.c.campaigns} campaigns, "
                    f"{self.c.failures()} failures, {time.monotonic() - t0:.0f} s",
                    flush=True,
                )
        self.finish(campaign)
        self.c.seconds = round(time.monotonic() - t0, 1)

    def launch(self, campaign: Campaign) -> subprocess.Popen[bytes]:
        local = campaign.local if self.s.node_loss else None
        cmd = wrapped(
            heat_command(self.s, campaign.root, campaign.out, self.c.layout, self.c.mode, local),
            campaign.root,
        )
        campaign.launched_at = time.time()
        campaign.launches += 1
        self.c.launches += 1
        with campaign.log() as fh:
            return subprocess.Popen(
                cmd, cwd=REPO, env=clean_env(), stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def finish(self, campaign: Campaign) -> None:
        """Run the open campaign to its end without kills and compare its output."""
        for _ in range(3):  # a launch without a kill finishes; allow a spare for a crash
            proc = self.launch(campaign)
            code = proc.wait(timeout=600)
            self.check_resume(campaign)
            if code == 0:
                self.completed(campaign)
                return
            self.c.unexpected_exits += 1
            self.problem(f"{campaign.dir}: launch without a kill exited {code}")
        self.problem(f"{campaign.dir}: never completed")

    def completed(self, campaign: Campaign) -> None:
        """A campaign ran to its end: its final checkpoint and its output are checked."""
        self.c.campaigns += 1
        final = self.observe(campaign, when="at the end", floor=self.s.steps)
        if final is not None and not self.verify(campaign, final):
            self.c.verify_failures += 1
        if not campaign.out.exists() or campaign.out.read_bytes() != self.reference:
            self.c.non_identical += 1
            self.problem(f"{campaign.dir}: output differs from the uninterrupted run")
        elif not self.s.keep_roots and not self.c.problems:
            shutil.rmtree(campaign.dir, ignore_errors=True)

    def wait_for_kill_moment(
        self, proc: subprocess.Popen[bytes], campaign: Campaign, *, by_rank: bool
    ) -> list[int] | None:
        """Sleep until the moment to kill; the processes to kill then (found while waiting, so
        that the kill follows the moment closely), or ``None`` if the job ended first."""
        start, found_at = time.monotonic(), 0.0
        victims: list[int] = []

        def refresh() -> None:
            nonlocal found_at, victims
            if time.monotonic() - found_at > 0.05 and len(victims) < self.s.ranks + 2:
                victims = rank_pids(campaign.root) if by_rank else job_pids(campaign.root)
                found_at = time.monotonic()

        if self.rng.random() < self.s.save_share:  # the n-th save of this launch
            skip, seen = self.rng.randrange(0, 3), set(pending_dirs(campaign.root))
            jitter = self.rng.uniform(0.0, 0.005)
            while proc.poll() is None:
                new = pending_dirs(campaign.root) - seen
                if new and skip == 0:
                    time.sleep(jitter)
                    break
                if new:
                    skip -= 1
                    seen |= new
                if time.monotonic() - start > 120:
                    break  # no save for two minutes: kill anyway
                refresh()
                time.sleep(_POLL_S)
        else:
            delay = self.rng.uniform(0.2, self.s.max_delay_s)
            while proc.poll() is None and time.monotonic() - start < delay:
                refresh()
                time.sleep(0.01)
        end = time.monotonic() + 60
        while by_rank and not victims and proc.poll() is None and time.monotonic() < end:
            victims = rank_pids(campaign.root)  # killed before the ranks started: wait for one
            time.sleep(0.01)
        return victims if proc.poll() is None else None

    def reap(self, campaign: Campaign) -> None:
        """Wait until no process of the job is left; a survivor counts as a hang (killed)."""
        survivors = wait_gone(campaign.root, self.s.hang_timeout_s)
        if survivors:
            self.c.hangs += 1
            self.problem(f"{campaign.dir}: processes {survivors} survived their job")
            _kill(survivors)
            wait_gone(campaign.root, 10)

    def check_resume(self, campaign: Campaign) -> None:
        """``--node-loss``: the launch that just ended resumed at least from the newest
        checkpoint protected before the last node loss (its first progress record)."""
        if campaign.promise is None:
            return
        records = [
            r for r in logs.read_log(campaign.root / filenames.PROGRESS_LOG, logs.PROGRESS)
            if r["time"] >= campaign.launched_at and r["step"] is not None
        ]  # fmt: skip
        if not records:
            return  # killed before it restored: the next launch must keep the promise
        resumed = int(records[0]["step"])
        log_file = campaign.dir / f"launch-{campaign.launches:03d}.log"
        with contextlib.suppress(OSError):
            self.c.rebuilds += "from partner copies" in log_file.read_text(errors="replace")
        if resumed < campaign.promise:
            self.c.lost_protected += 1
            self.problem(
                f"{campaign.root}: resumed from step {resumed} after a node loss, but step "
                f"{campaign.promise} was protected before it"
            )
        campaign.promise = None

    def node_trial(self, campaign: Campaign) -> bool:
        """``--node-loss``: one launch, then one node lost at a random moment (its ranks
        killed, the job with them, and its local directory wiped); ``True`` if the campaign
        ended first."""
        before = campaign.observed
        proc = self.launch(campaign)
        delay, start = self.rng.uniform(0.2, self.s.max_delay_s), time.monotonic()
        while proc.poll() is None and time.monotonic() - start < delay:
            time.sleep(0.01)
        if proc.poll() is not None:
            self.check_resume(campaign)
            return self.ended(proc, campaign)
        node = self.rng.choice(NODES)
        # what partner copies promise: the newest checkpoint protected since the last loss
        # (all of them before the first); a second node lost before anything new was
        # protected loses the copies of the first (beyond what the scheme promises)
        fresh = [
            int(r["step"]) for r in logs.read_log(campaign.root / filenames.PROTECT_LOG, logs.PROTECTED)
            if float(r.get("time", 0)) > campaign.lost_at
        ]  # fmt: skip
        if fresh:
            campaign.lost_nodes = set()
        protected = max(fresh, default=None)
        committed = newest_committed(campaign.root)
        on_node = [p for p in rank_pids(campaign.root) if _env(p).get("PMI_HOSTNAME") == node]
        _kill(on_node)  # the node dies; the job dies with it (and its launcher, its wrapper)
        _kill([proc.pid, *job_pids(campaign.root)])
        shutil.rmtree(campaign.local / node, ignore_errors=True)
        proc.wait()
        self.check_resume(campaign)  # this launch's own resume, if an earlier loss asked
        self.c.trials += 1
        self.c.node_kills += 1
        self.reap(campaign)
        shutil.rmtree(campaign.local / node, ignore_errors=True)  # a late write recreated it
        campaign.lost_nodes.add(node)
        campaign.lost_at = time.time()
        if len(campaign.lost_nodes) > 1:
            self.c.double_losses += 1
            campaign.promise = committed  # only the shared root's own
        else:
            candidates = [x for x in (protected, committed, campaign.promise) if x is not None]
            campaign.promise = max(candidates, default=None)
        floor = max((x for x in (committed, before) if x is not None), default=None)
        self.observe(campaign, when="after the node loss", floor=floor)
        return False

    def trial(self, campaign: Campaign) -> bool:
        """One launch and (unless it finishes first) one kill; ``True`` if the campaign ended."""
        if self.s.node_loss:
            return self.node_trial(campaign)
        before = campaign.observed
        by_rank = self.rng.random() < self.s.rank_share
        proc = self.launch(campaign)
        victims = self.wait_for_kill_moment(proc, campaign, by_rank=by_rank)
        if victims is None or (by_rank and not victims):
            return self.ended(proc, campaign)
        pending_before = pending_dirs(campaign.root)
        committed = newest_committed(campaign.root)
        if by_rank:
            _kill([self.rng.choice(victims)])
        else:  # a node crash: every process of the job, the wrapper too
            _kill([proc.pid, *victims])
            _kill(job_pids(campaign.root))  # anything started since the last look
        self.c.trials += 1
        self.c.rank_kills += by_rank
        self.c.job_kills += not by_rank
        try:
            proc.wait(timeout=self.s.hang_timeout_s)
        except subprocess.TimeoutExpired:
            self.c.hangs += 1
            self.problem(
                f"{campaign.dir}: job still running {self.s.hang_timeout_s} s after a rank kill"
            )
            _kill([proc.pid, *job_pids(campaign.root)])
            proc.wait()
        self.reap(campaign)
        if pending_before & pending_dirs(campaign.root):
            self.c.kills_in_save += 1
        floor = max((x for x in (committed, before) if x is not None), default=None)
        after = self.observe(campaign, when="after the kill", floor=floor)
        if after is not None and not self.verify(campaign, after):
            self.c.verify_failures += 1
        return False

    def ended(self, proc: subprocess.Popen[bytes], campaign: Campaign) -> bool:
        """The job ended before its kill: it finished (campaign complete) or failed."""
        code = proc.wait(timeout=600)
        if code == 0:
            self.completed(campaign)
            return True
        self.c.unexpected_exits += 1
        self.problem(f"{campaign.dir}: launch {campaign.launches} exited {code} without a kill")
        return False

    def observe(self, campaign: Campaign, *, when: str, floor: int | None = None) -> int | None:
        """The newest valid step now (``resilient status --json``), checked against the past."""
        if not campaign.root.exists():
            return None
        code, text = run_cli(
            ["status", str(campaign.root), "--json"], subprocess_cli=self.s.cli_subprocess
        )
        if code != 0:
            self.problem(f"{campaign.root}: resilient status exited {code} {when}")
            self.c.unexpected_exits += 1
            return campaign.observed
        doc = json.loads(text)
        latest: int | None = doc["latest_step"]
        bad = [c for c in doc["checkpoints"] if c["status"] == "invalid"]
        if bad:
            self.c.invalid_dirs += len(bad)
            self.problem(f"{campaign.root}: invalid committed directories {when}: {bad}")
        if floor is not None and (latest is None or latest < floor):
            self.c.lost += 1
            self.problem(
                f"{campaign.root}: step {floor} was committed, newest valid {when}: {latest}"
            )
        if campaign.observed is not None and (latest is None or latest < campaign.observed):
            self.c.regressions += 1
            self.problem(
                f"{campaign.root}: newest valid step went {campaign.observed} -> {latest} {when}"
            )
        if latest is not None:
            campaign.observed = latest
        return latest

    def verify(self, campaign: Campaign, step: int) -> bool:
        code, text = run_cli(
            ["verify", str(campaign.root), str(step), "--full"],
            subprocess_cli=self.s.cli_subprocess,
        )
        if code != 0:
            self.problem(f"{campaign.root}: verify --full of step {step}: {text.strip()}")
        return code == 0


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200, help="kills per layout (split over modes)")
    p.add_argument("--layouts", default="self,node,world", help="comma-separated")
    p.add_argument("--mode", choices=["sync", "async", "both"], default="both")
    p.add_argument("--async", dest="mode", action="store_const", const="async",
                   help="same as --mode async")  # fmt: skip
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seed", type=int, default=20261123)
    p.add_argument("--json", type=Path, help="write the counts here")
    p.add_argument("--workdir", type=Path, help="campaign roots go here (default: a temp dir)")
    p.add_argument("--steps", type=int, default=240, help="steps of one campaign")
    p.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    p.add_argument("--nx", type=int, default=512)
    p.add_argument("--ny", type=int, default=512)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--save-share", type=float, default=0.5, help="kills aimed at a save")
    p.add_argument("--rank-share", type=float, default=0.5, help="kills of one rank (else the job)")
    p.add_argument(
        "--max-delay", type=float, default=6.0, help="latest random kill, s after launch"
    )
    p.add_argument("--hang-timeout", type=float, default=60.0)
    p.add_argument("--cli-subprocess", action="store_true", help="run `resilient` as a program")
    p.add_argument("--keep", action="store_true", help="keep the roots of completed campaigns")
    p.add_argument(
        "--node-loss", action="store_true",
        help="two MPI nodes with local tiers and partner copies; each kill loses one node "
        "(its ranks and its local directory)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.node_loss and ("world" in args.layouts.split(",") or args.ranks < 2):
        p.error("--node-loss needs --ranks >= 2 and layouts self or node (a file per node)")
    if args.trials < 1 or args.ranks < 1:
        p.error("--trials and --ranks must be >= 1")
    return args


def _modes(mode: str) -> list[str]:
    return ["sync", "async"] if mode == "both" else [mode]


def _split(total: int, parts: int) -> Iterator[int]:
    for i in range(parts):
        yield total // parts + (1 if i < total % parts else 0)


def format_table(rows: Sequence[Counts]) -> str:
    cols = ["trials", "kills_in_save", "rank_kills", "job_kills", "node_kills", "double_losses",
            "rebuilds", "launches", "campaigns",
            *FAILURES, "seconds"]  # fmt: skip
    head = f"{'layout':6} {'mode':5} " + " ".join(f"{c:>{max(len(c), 6)}}" for c in cols)
    lines = [head]
    for r in rows:
        values = " ".join(f"{getattr(r, c):>{max(len(c), 6)}}" for c in cols)
        lines.append(f"{r.layout:6} {r.mode:5} {values}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    s = Settings(
        ranks=args.ranks, steps=args.steps, every=args.every, nx=args.nx, ny=args.ny,
        step_delay=args.step_delay, save_share=args.save_share, rank_share=args.rank_share,
        max_delay_s=args.max_delay, hang_timeout_s=args.hang_timeout,
        cli_subprocess=args.cli_subprocess, keep_roots=args.keep, node_loss=args.node_loss,
    )  # fmt: skip
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    modes = _modes(args.mode)
    made = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="resilient-soak-")) if made else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rows: list[Counts] = []
    t0 = time.monotonic()
    print(f"soak: {args.trials} kills per layout over {modes}, {args.ranks} ranks, in {work}")
    for lay in layouts:
        for mode, n in zip(modes, _split(args.trials, len(modes)), strict=True):
            counts = Counts(lay, mode)
            rows.append(counts)
            base = work / f"{lay}-{mode}"
            shutil.rmtree(base, ignore_errors=True)
            Soak(s, rng, counts, base).run(n)
            print(format_table([counts]).splitlines()[1], flush=True)
    total = Counts("all", "-")
    for r in rows:
        for name in ("trials", "kills_in_save", "rank_kills", "job_kills", "node_kills",
                     "double_losses", "rebuilds", "launches",
                     "campaigns", *FAILURES):  # fmt: skip
            setattr(total, name, getattr(total, name) + getattr(r, name))
    total.seconds = round(time.monotonic() - t0, 1)
    print(format_table([*rows, total]))
    if args.json:
        doc = {
            "command": [sys.executable, *sys.argv] if argv is None else list(argv),
            "settings": asdict(s),
            "seed": args.seed,
            "rows": [asdict(r) for r in rows],
            "total": asdict(total),
        }
        args.json.write_text(json.dumps(doc, indent=1))
    failed = total.failures() > 0 or any(r.failures() for r in rows)
    if made and not failed:
        shutil.rmtree(work, ignore_errors=True)
    elif failed:
        print(f"soak: FAILURES; campaign roots kept in {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
