"""Cost of walltime awareness per step, and work lost per forced kill with and without a warning.

Two modes, each measured in one run of this script::

    mpiexec -n 4 python bench/bench_walltime.py overhead [--nx 512 --ny 512 --steps 300 --runs 7]
    python bench/bench_walltime.py lostwork [--runs 5]          # no mpiexec: it launches its own

``overhead`` (under ``mpiexec``) times loops of ``--steps`` iterations of one operation on every
rank and reports microseconds per step and the ratio to one heat step:

``heat``
    ``apps.heat.advance`` (halo exchange + explicit Euler update) on a ``--nx`` x ``--ny``
    global grid: the reference.
``should_stop``
    ``Session.should_stop()`` alone (a deadline far away): one small allreduce.
``save_never``
    ``Session.maybe_save()`` with ``EverySteps(10**9)`` and no deadline: the save decision
    (a sleeping barrier + a bcast from rank 0), plus the progress sample (rank 0, <= 1/s).
``save_walltime``
    ``Session.maybe_save()`` with ``BeforeWalltime(margin_s=60) | EverySteps(10**9)`` and a
    deadline 10**6 s away: the walltime policy's per-step decision. Nothing is ever saved.
``loop``
    the whole loop of ``apps.heat``: advance + ``should_stop`` + walltime ``maybe_save``;
    its overhead is ``loop - heat`` (collectives between compute phases also absorb load
    imbalance, so this can differ from the sum of the isolated costs).
``policy_local``, ``lib_barrier``, ``raw_bcast`` (diagnostics)
    what the save decision is made of: the policy evaluated on one rank (``save_context`` +
    ``BeforeWalltime | EverySteps``, no communication), and the two halves of the decision's
    ``bcast``: the library's sleeping barrier (``resilient.parallel.mpi.MPIComm.barrier``, back-to-back
    calls) and a plain mpi4py ``bcast`` of a bool.

Each loop starts after a sleeping barrier (``Ibarrier`` polled with ``time.sleep``: MACHINE.md
gotcha 10), is timed with ``time.perf_counter`` on every rank, and the run's time is the
maximum over ranks (allreduce MAX). One untimed warm-up round of every mode, then ``--runs``
rounds, each running every mode once in a per-round shuffled order (seeded, the same on every
rank). Reported: median, min, max (us per step), the overhead fraction ``mode / heat`` (ratio
of medians) and, in brackets, the paired fraction (median of the per-round ratios, robust
against drift between rounds: MACHINE.md gotcha 11).

``lostwork`` (no ``mpiexec``: it starts 4-rank ``apps.heat`` jobs itself with the venv's
``mpiexec``) measures the work lost when a job is stopped at its walltime, in two scenarios,
``--runs`` times each, alternating:

``warned``
    ``python -m resilient.cli run --walltime W --signal USR1@1 -- mpiexec ... apps.heat``: the
    program gets SIGUSR1 one second before the deadline, checkpoints at the next step and exits
    75. Lost = the highest step reached minus the latest valid checkpoint (exact: the final
    save also writes a progress sample).
``unwarned``
    ``mpiexec ... apps.heat`` started directly (the program knows no deadline), then after W
    seconds the whole process tree gets SIGKILL (process group + every descendant found in
    ``/proc``): a kill without warning. Lost = the step reached at the kill minus the latest
    valid checkpoint. Rank 0 samples ``(time, step)`` into ``progress.jsonl`` every 0.25 s at
    first, sparser as the run ages (``resilient.job.timeline``), and ``saves.jsonl`` has one
    line per checkpoint, so the highest *recorded* step is a lower bound that can be a sample
    old; the step at the kill is therefore extrapolated
    from the newest record with the run's mean step rate (both numbers are reported).

W is ``--walltime`` plus a uniform random jitter in ``[0, --jitter)`` (seeded, the same W for
the two scenarios of a pair), so the kill falls at a random phase of the checkpoint cycle: the
expected loss without a warning is about half a checkpoint interval. The policy YAML is written
to the temp dir: ``checkpoint_comm: node``, ``save_when: {every_steps: N, on_signal: true}``,
``keep: {last: 2}``, ``walltime_margin_s: 0``.

A warned job loses no steps but stops early: the time from its last commit to the deadline is
walltime that produced no saved progress, just like the time from the last commit to the kill
of an unwarned job. Both are reported ("last commit to deadline/kill"), with the latest valid
step at the end and its paired difference (warned - unwarned, same W): the warning pays off
only when the time since the last checkpoint exceeds the warning's lead.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/bench_walltime.py` puts bench/, not the repo, first
    sys.path.insert(0, str(ROOT))

from benchutil import library_revision  # noqa: E402

import resilient  # noqa: E402
from resilient.io import logs  # noqa: E402
from resilient.io.checkpoints import latest_valid  # noqa: E402
from resilient.job.process import descendants  # noqa: E402
from resilient.model import filenames  # noqa: E402

OVERHEAD_MODES = (
    "heat", "should_stop", "save_never", "save_walltime", "loop",
    "policy_local", "lib_barrier", "raw_bcast",
)  # fmt: skip
WHAT = {
    "heat": "apps.heat.advance (halo exchange + update): the reference",
    "should_stop": "Session.should_stop() alone (one small allreduce)",
    "save_never": "maybe_save(), EverySteps(10**9), no deadline (barrier + bcast)",
    "save_walltime": "maybe_save(), BeforeWalltime(60) \\| EverySteps(10**9), far deadline",
    "loop": "advance + should_stop + walltime maybe_save (the apps.heat loop)",
    "policy_local": "diagnostic: the walltime policy evaluated locally (no communication)",
    "lib_barrier": "diagnostic: resilient.parallel.mpi.MPIComm.barrier() (Ibarrier + backoff sleeps)",
    "raw_bcast": "diagnostic: mpi4py comm.bcast(False) alone (what follows that barrier)",
}
SUMMARY_KEYS = (
    "steps_lost",
    "steps_lost_recorded",
    "seconds_lost",
    "since_commit_s",
    "latest_valid",
)
# Variables through which a program could learn a deadline (or a launcher's PMI state).
_SCRUB_PREFIXES = ("SLURM_", "PMI_", "HYDRA_", "OMPI_", "PMIX_")
_SCRUB = ("RESILIENT_DEADLINE", "RESILIENT_CHECKPOINT_DIR", "RESILIENT_ATTEMPT")


# ---------------------------------------------------------------------------- shared helpers


def spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nJSON written to {path}")


# ---------------------------------------------------------------------------- overhead


def run_overhead(args: argparse.Namespace) -> int:
    """Per-step cost of should_stop / maybe_save against one heat step (under mpiexec)."""
    import importlib

    from mpi4py import MPI

    from resilient.job.session import Session
    from resilient.model.policies import BeforeWalltime, EverySteps
    from resilient.parallel.mpi import MPIComm

    # Imported by name so that mypy checks this file, not apps/ (outside the typed package).
    heat_app: Any = importlib.import_module("apps.heat")
    Domain, advance, initial_state = heat_app.Domain, heat_app.advance, heat_app.initial_state
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    def sleep_barrier() -> None:
        """A barrier whose waiting ranks sleep instead of spinning (MACHINE.md gotcha 10)."""
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    base: Path | None = None
    if rank == 0:
        base = Path(tempfile.mkdtemp(prefix="resilient-bench-walltime-", dir=args.dir))
    revision = library_revision() if rank == 0 else ""
    base = comm.bcast(base, root=0)
    assert base is not None
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    sessions: list[Session] = []
    try:
        dom = Domain(comm, args.nx, args.ny)
        state0, static = initial_state(dom)
        kappa = static["kappa"]
        u_heat = state0["u"].copy()
        u_loop = state0["u"].copy()
        far = {"RESILIENT_DEADLINE": f"{time.time() + 1e6:.3f}"}
        s_never = Session(
            base / "never", comm=comm, save_when=EverySteps(10**9), margin_s=60.0, environ={}
        )
        sessions.append(s_never)
        s_wall = Session(
            base / "walltime",
            comm=comm,
            save_when=BeforeWalltime(margin_s=60.0) | EverySteps(10**9),
            margin_s=60.0,
            environ=far,
        )
        sessions.append(s_wall)
        s_loop = Session(
            base / "loop",
            comm=comm,
            save_when=BeforeWalltime(margin_s=60.0) | EverySteps(10**9),
            margin_s=60.0,
            environ=far,
        )
        sessions.append(s_loop)
        assert s_wall.deadline is not None and s_never.deadline is None
        step = 0  # shared step counter: EverySteps(10**9) would fire at step 0

        def heat() -> None:
            nonlocal u_heat
            u_heat = advance(dom, u_heat, kappa, 0.2)

        def should_stop() -> None:
            if s_wall.should_stop():
                raise AssertionError("should_stop() said yes with a far deadline")

        def save_never() -> None:
            nonlocal step
            step += 1
            if s_never.maybe_save(step, {"u": u_heat}):
                raise AssertionError("save_never saved")

        def save_walltime() -> None:
            nonlocal step
            step += 1
            if s_wall.maybe_save(step, {"u": u_heat}):
                raise AssertionError("save_walltime saved")

        def loop() -> None:
            nonlocal u_loop, step
            if s_loop.should_stop():
                raise AssertionError("should_stop() said yes with a far deadline")
            u_loop = advance(dom, u_loop, kappa, 0.2)
            step += 1
            if s_loop.maybe_save(step, {"u": u_loop}):
                raise AssertionError("loop saved")

        lib_comm = MPIComm(comm)

        def policy_local() -> None:
            nonlocal step
            step += 1
            mgr = s_wall.manager
            assert mgr.save_when is not None
            ctx = mgr.save_context(step, time_left_s=s_wall.time_left_s)
            if mgr.save_when(ctx):
                raise AssertionError("the walltime policy fired")

        def raw_bcast() -> None:
            comm.bcast(False, root=0)

        bodies: dict[str, Callable[[], None]] = {
            "heat": heat,
            "should_stop": should_stop,
            "save_never": save_never,
            "save_walltime": save_walltime,
            "loop": loop,
            "policy_local": policy_local,
            "lib_barrier": lib_comm.barrier,
            "raw_bcast": raw_bcast,
        }

        def timed_loop(body: Callable[[], None], n: int) -> float:
            """Seconds per step: ``n`` calls of ``body``, max over ranks."""
            sleep_barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                body()
            seconds = time.perf_counter() - t0
            worst: float = comm.allreduce(seconds, op=MPI.MAX)
            return worst / n

        modes = list(OVERHEAD_MODES)
        for mode in modes:  # warm-up, untimed
            timed_loop(bodies[mode], args.steps)
        rng = random.Random(args.seed)  # same sequence on every rank
        times: dict[str, list[float]] = {m: [] for m in modes}
        for rnd in range(args.runs):
            order = rng.sample(modes, len(modes))
            for mode in order:
                times[mode].append(timed_loop(bodies[mode], args.steps))
            if rank == 0:
                line = " ".join(f"{m}={1e6 * times[m][-1]:.1f}us" for m in order)
                print(f"round {rnd + 1}/{args.runs}: {line}", file=sys.stderr, flush=True)
        for s in sessions:
            s.manager.close()
        sessions.clear()
        saved = (
            sum(len(list((base / n).glob("step_*"))) for n in ("never", "walltime", "loop"))
            if rank == 0
            else 0
        )
        if saved:
            raise AssertionError(f"{saved} checkpoints were written; none expected")
    except BaseException:  # no collective on the error path
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
        raise
    sleep_barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    if rank != 0:
        return 0

    ref = times["heat"]
    ref_med = statistics.median(ref)
    rows: dict[str, dict[str, Any]] = {}
    for mode in modes:
        ts = times[mode]
        row: dict[str, Any] = {"us_per_step": [1e6 * t for t in ts]}
        row.update({f"{k}_us": 1e6 * v for k, v in spread(ts).items()})
        if mode == "loop":  # the loop contains a heat step: its overhead is loop - heat
            row["fraction"] = (statistics.median(ts) - ref_med) / ref_med
            row["paired_fraction"] = statistics.median(
                (a - b) / b for a, b in zip(ts, ref, strict=True)
            )
        elif mode != "heat":
            row["fraction"] = statistics.median(ts) / ref_med
            row["paired_fraction"] = statistics.median(a / b for a, b in zip(ts, ref, strict=True))
        rows[mode] = row
    mpi_library = " ".join(MPI.Get_library_version().split()[:3])
    load_after = os.getloadavg()
    local = (dom.x1 - dom.x0, dom.y1 - dom.y0)

    print(
        f"\n# bench_walltime overhead: {size} ranks, heat {args.nx}x{args.ny} global "
        f"({local[0]}x{local[1]} per rank, dims {dom.dims[0]}x{dom.dims[1]}), "
        f"{args.steps} steps per loop, {args.runs} rounds after 1 warm-up, "
        f"{started:%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"host {platform.node()}, {os.cpu_count()} CPUs, resilient {resilient.__version__} "
        f"({revision}), mpi {mpi_library}; loadavg before {load_before[0]:.2f}, "
        f"after {load_after[0]:.2f}"
    )
    print(
        "\nPer step, max over ranks; fraction = mode / heat (ratio of medians; paired = median "
        "of per-round ratios); for `loop`: (loop - heat) / heat\n"
    )
    print("| mode | us/step median | min | max | fraction of a heat step (paired) | what |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, r in rows.items():
        frac = "-"
        if "fraction" in r:
            frac = f"{100 * r['fraction']:.1f}% ({100 * r['paired_fraction']:.1f}%)"
        print(
            f"| {mode} | {r['median_us']:.1f} | {r['min_us']:.1f} | {r['max_us']:.1f} "
            f"| {frac} | {WHAT[mode]} |"
        )
    write_json(
        args.json,
        {
            "mode": "overhead",
            "date_utc": started.isoformat(timespec="seconds"),
            "ranks": size,
            "nx": args.nx,
            "ny": args.ny,
            "local_shape": local,
            "steps_per_loop": args.steps,
            "runs": args.runs,
            "seed": args.seed,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "resilient_version": resilient.__version__,
            "resilient_revision": revision,
            "mpi_library": mpi_library,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "results": rows,
        },
    )
    return 0


# ---------------------------------------------------------------------------- lost work


def step_records(root: Path) -> list[tuple[float, int]]:
    """``(time, step)`` from ``progress.jsonl`` (rank 0's timeline) and ``saves.jsonl``, by time."""
    recs = []
    for name, kind in ((filenames.PROGRESS_LOG, logs.PROGRESS), (filenames.SAVE_LOG, logs.SAVES)):
        for r in logs.read_log(root / name, kind):
            t, s = r.get("time"), r["step"]
            if t is not None and s is not None:
                recs.append((float(t), s))
    return sorted(recs)


def save_time(root: Path, step: int) -> float | None:
    """Commit time (``saves.jsonl``) of the checkpoint of ``step``."""
    times = [
        r["time"] for r in logs.read_log(root / filenames.SAVE_LOG, logs.SAVES)
        if r["step"] == step and "time" in r
    ]  # fmt: skip
    return float(times[-1]) if times else None


def mpiexec_path() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise SystemExit("no mpiexec next to the interpreter or on PATH")
    return found


def child_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith(_SCRUB_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def kill_tree(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGKILL the process group of ``proc`` and every descendant; return the pids signalled."""
    targets = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return targets


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: Sequence[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return the survivors."""
    end = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


class LostWork:
    """Launches the runs of the ``lostwork`` mode in one temporary directory."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.mpiexec = mpiexec_path()
        self.env = child_env()
        self.config = base / "policy.yaml"
        self.config.write_text(
            "checkpoint_comm: node\n"
            f"save_when:\n  every_steps: {args.checkpoint_every}\n  on_signal: true\n"
            "keep:\n  last: 2\n"
            "walltime_margin_s: 0\n"
        )
        self.count = 0

    def app(self, ckdir: Path) -> list[str]:
        a = self.args
        return [
            self.mpiexec, "-n", str(a.ranks), sys.executable, "-m", "apps.heat",
            "--nx", str(a.nx), "--ny", str(a.ny), "--steps", str(a.app_steps),
            "--step-delay", str(a.step_delay), "--checkpoint-every", str(a.checkpoint_every),
            "--config", str(self.config), "--checkpoint-dir", str(ckdir),
            "--out", str(ckdir.parent / (ckdir.name + ".h5")),
        ]  # fmt: skip

    def fresh(self, scenario: str) -> tuple[Path, Path]:
        self.count += 1
        ckdir = self.base / f"{self.count:02d}-{scenario}"
        return ckdir, self.base / f"{self.count:02d}-{scenario}.log"

    def warned(self, walltime: float) -> dict[str, Any]:
        """``resilient run --walltime W --signal USR1@lead``: checkpoint at the signal, exit 75."""
        ckdir, logpath = self.fresh("warned")
        cmd = [
            sys.executable, "-m", "resilient.cli", "run", "--checkpoint-dir", str(ckdir),
            "--walltime", f"{walltime:.3f}", "--signal", f"USR1@{self.args.warn_lead:g}",
            "--", *self.app(ckdir),
        ]  # fmt: skip
        with open(logpath, "wb") as log:
            t_start = time.time()
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                code = proc.wait(timeout=walltime + 60)
            except subprocess.TimeoutExpired:
                wait_gone(kill_tree(proc))
                proc.wait()
                raise RuntimeError(
                    f"warned run did not end within W + 60 s; log {logpath}"
                ) from None
        t_end = time.time()
        rec = latest_valid(ckdir)
        latest = rec.step if rec else 0
        recs = step_records(ckdir)
        reached = max([latest] + [s for _, s in recs])
        ledger = logs.read_log(ckdir / filenames.ATTEMPT_LEDGER, logs.ATTEMPTS)
        att = ledger[-1] if ledger else {}
        deadline = float(att.get("start", t_start)) + walltime
        saves = logs.read_log(ckdir / filenames.SAVE_LOG, logs.SAVES)
        rate = step_rate(recs)
        committed = save_time(ckdir, latest) if rec else None
        return {
            "scenario": "warned",
            "walltime_s": walltime,
            "exit_code": code,
            "reason": att.get("reason"),
            "latest_valid": latest,
            "reached_recorded": reached,
            "reached_est": reached,  # the final save writes a progress sample: exact
            "steps_lost": reached - latest,
            "steps_lost_recorded": reached - latest,
            "step_time_s": 1.0 / rate if rate else None,
            "seconds_lost": (reached - latest) / rate if rate else None,
            "checkpoints": len(saves),
            "final_save_cost_s": saves[-1].get("cost_s") if saves else None,
            "final_save_before_deadline_s": deadline - float(saves[-1]["time"]) if saves else None,
            "ended_before_deadline_s": deadline - float(att.get("end", t_end)),
            "since_commit_s": deadline - committed if committed else None,
            "cli_start_s": float(att["start"]) - t_start if "start" in att else None,
            "log": str(logpath),
        }

    def unwarned(self, walltime: float) -> dict[str, Any]:
        """``mpiexec`` started directly, SIGKILL to the whole tree after ``walltime`` seconds."""
        ckdir, logpath = self.fresh("unwarned")
        with open(logpath, "wb") as log:
            t_start = time.time()
            proc = subprocess.Popen(
                self.app(ckdir), cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            while time.time() < t_start + walltime:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the app ended before the kill ({proc.returncode}); {logpath}"
                    )
                time.sleep(min(0.01, max(0.0, t_start + walltime - time.time())))
            t_kill = time.time()
            pids = kill_tree(proc)
            code = proc.wait()
            survivors = wait_gone(pids)
        if survivors:
            raise RuntimeError(f"processes survived SIGKILL: {survivors}")
        rec = latest_valid(ckdir)
        latest = rec.step if rec else 0
        recs = step_records(ckdir)
        reached_recorded = max([latest] + [s for _, s in recs])
        rate = step_rate(recs)
        if recs and rate:
            t_last, s_last = recs[-1]
            reached_est = max(reached_recorded, s_last + rate * (t_kill - t_last))
        else:
            reached_est = float(reached_recorded)
        committed = save_time(ckdir, latest) if rec else None
        return {
            "scenario": "unwarned",
            "walltime_s": walltime,
            "exit_code": code,
            "latest_valid": latest,
            "reached_recorded": reached_recorded,
            "reached_est": reached_est,
            "steps_lost": reached_est - latest,
            "steps_lost_recorded": reached_recorded - latest,
            "step_time_s": 1.0 / rate if rate else None,
            "seconds_lost": (reached_est - latest) / rate if rate else None,
            "since_commit_s": t_kill - committed if committed else None,
            "newest_record_age_s": t_kill - recs[-1][0] if recs else None,
            "killed_mid_save": any(ckdir.glob(".step_*.tmp-*")),
            "checkpoints": len(logs.read_log(ckdir / filenames.SAVE_LOG, logs.SAVES)),
            "processes_killed": len(pids) + 1,
            "log": str(logpath),
        }


def step_rate(recs: Sequence[tuple[float, int]]) -> float | None:
    """Mean steps per second between the first and the newest record (None if too few)."""
    if len(recs) < 2 or recs[-1][0] <= recs[0][0] or recs[-1][1] <= recs[0][1]:
        return None
    return (recs[-1][1] - recs[0][1]) / (recs[-1][0] - recs[0][0])


def _med(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(runs: Sequence[dict[str, Any]], key: str, spec: str) -> str:
    vals = [float(r[key]) for r in runs if r.get(key) is not None]
    return format(statistics.fmean(vals), spec) if vals else "-"


def _range(runs: Sequence[dict[str, Any]], key: str, spec: str) -> str:
    vals = [float(r[key]) for r in runs if r.get(key) is not None]
    if not vals:
        return "-"
    med, lo, hi = (format(v, spec) for v in (statistics.median(vals), min(vals), max(vals)))
    return f"{med} ({lo}-{hi})"


def run_lostwork(args: argparse.Namespace) -> int:
    """Lost work per forced kill, with and without the warning signal (launches its own jobs)."""
    if any(k.startswith(("PMI_", "HYDRA_")) for k in os.environ):
        raise SystemExit("lostwork launches its own mpiexec: run it without mpiexec")
    base = Path(tempfile.mkdtemp(prefix="resilient-bench-lostwork-", dir=args.dir))
    started = datetime.datetime.now(datetime.timezone.utc)
    revision = library_revision()
    rng = random.Random(args.seed)
    results: dict[str, list[dict[str, Any]]] = {"warned": [], "unwarned": []}
    try:
        bench = LostWork(args, base)
        for i in range(args.runs):
            walltime = args.walltime + rng.uniform(0.0, args.jitter)
            order = ["warned", "unwarned"] if i % 2 == 0 else ["unwarned", "warned"]
            for scenario in order:
                res = bench.warned(walltime) if scenario == "warned" else bench.unwarned(walltime)
                results[scenario].append(res)
                print(
                    f"run {i + 1}/{args.runs} {scenario}: W={walltime:.2f} s exit "
                    f"{res['exit_code']}, latest valid {res['latest_valid']}, reached "
                    f"{res['reached_recorded']} recorded / {res['reached_est']:.0f} est, "
                    f"lost {res['steps_lost']:.0f} steps",
                    file=sys.stderr,
                    flush=True,
                )
    except BaseException:
        print(f"logs kept in {base}", file=sys.stderr)
        raise
    if args.keep:
        print(f"logs and checkpoints kept in {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)

    warned, unwarned = results["warned"], results["unwarned"]
    bad = [r["exit_code"] for r in warned if r["exit_code"] != 75]
    step_time = _med(warned + unwarned, "step_time_s")
    every = args.checkpoint_every
    expected_steps = every / 2
    expected_s = expected_steps * step_time if step_time else None
    print(
        f"\n# bench_walltime lostwork: apps.heat {args.nx}x{args.ny}, {args.ranks} ranks, "
        f"--step-delay {args.step_delay:g}, checkpoint every {every} steps (node layout), "
        f"W = {args.walltime:g} s + U[0, {args.jitter:g}), {args.runs} runs per scenario, "
        f"{started:%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"host {platform.node()}, {os.cpu_count()} CPUs, resilient {resilient.__version__} "
        f"({revision}); median step time {_fmt(step_time and 1e3 * step_time, '.1f')} ms, "
        f"checkpoint interval {every} steps = {_fmt(step_time and every * step_time, '.2f')} s"
    )
    print(
        "\nMedian (min-max) over runs. steps lost = step reached at the stop/kill - latest valid "
        "checkpoint; `recorded` = from progress.jsonl + saves.jsonl only (rank 0's samples, every "
        "0.25 s at first and sparser later: a lower bound); `est` extrapolates the newest record to the kill time "
        "with the run's mean step rate; seconds = est steps x step time.\n"
    )
    print(
        "| scenario | exit | steps lost (est) | steps lost (recorded) | seconds lost "
        "| last commit to deadline/kill, s | latest valid step at the end | checkpoints |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in (("warned: USR1 1 s before", warned), ("unwarned: SIGKILL", unwarned)):
        codes = ",".join(sorted({str(r["exit_code"]) for r in runs}))
        print(
            f"| {name} | {codes} | {_range(runs, 'steps_lost', '.0f')} "
            f"| {_range(runs, 'steps_lost_recorded', '.0f')} "
            f"| {_range(runs, 'seconds_lost', '.2f')} "
            f"| {_range(runs, 'since_commit_s', '.2f')} | {_range(runs, 'latest_valid', '.0f')} "
            f"| {_range(runs, 'checkpoints', '.0f')} |"
        )
    print(
        f"| expected without warning (half an interval) | | {expected_steps:.0f} | | "
        f"{_fmt(expected_s, '.2f')} | {_fmt(expected_s, '.2f')} | | |"
    )
    kept_diff = [
        float(w["latest_valid"] - u["latest_valid"]) for w, u in zip(warned, unwarned, strict=True)
    ]
    print(
        f"\nWarned runs: final save cost {_range(warned, 'final_save_cost_s', '.3f')} s, "
        f"committed {_range(warned, 'final_save_before_deadline_s', '.2f')} s before the "
        f"deadline, job ended {_range(warned, 'ended_before_deadline_s', '.2f')} s before it "
        f"(walltime left unused). Unwarned: kills during a save "
        f"{sum(1 for r in unwarned if r['killed_mid_save'])}/{len(unwarned)}, newest record "
        f"{_range(unwarned, 'newest_record_age_s', '.2f')} s old at the kill. Progress kept "
        f"at the end, warned - unwarned (paired by W): median {statistics.median(kept_diff):+.0f} "
        f"steps ({min(kept_diff):+.0f} to {max(kept_diff):+.0f}). Means (the expected value is "
        f"a mean): steps lost unwarned {_mean(unwarned, 'steps_lost', '.1f')}, seconds "
        f"{_mean(unwarned, 'seconds_lost', '.2f')}; last commit to deadline/kill warned "
        f"{_mean(warned, 'since_commit_s', '.2f')} s, unwarned "
        f"{_mean(unwarned, 'since_commit_s', '.2f')} s."
    )
    if bad:
        print(f"\nWARNING: warned runs exited {bad} (75 expected)")
    write_json(
        args.json,
        {
            "mode": "lostwork",
            "date_utc": started.isoformat(timespec="seconds"),
            "ranks": args.ranks,
            "nx": args.nx,
            "ny": args.ny,
            "step_delay_s": args.step_delay,
            "checkpoint_every": every,
            "warn_lead_s": args.warn_lead,
            "walltime_s": args.walltime,
            "jitter_s": args.jitter,
            "runs": args.runs,
            "seed": args.seed,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "resilient_version": resilient.__version__,
            "resilient_revision": revision,
            "median_step_time_s": step_time,
            "expected_unwarned_steps_lost": expected_steps,
            "expected_unwarned_seconds_lost": expected_s,
            "summary": {
                name: {k: _med(runs, k) for k in SUMMARY_KEYS} for name, runs in results.items()
            },
            "kept_steps_warned_minus_unwarned": kept_diff,
            "runs_detail": results,
        },
    )
    return 1 if bad else 0


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="mode", required=True)

    o = sub.add_parser("overhead", help="per-step cost of should_stop/maybe_save (under mpiexec)")
    o.add_argument("--nx", type=int, default=512, help="global grid (default 512)")
    o.add_argument("--ny", type=int, default=512)
    o.add_argument("--steps", type=int, default=300, help="steps per timed loop (default 300)")
    o.add_argument("--runs", type=int, default=7, help="timed rounds (default 7)")

    lw = sub.add_parser("lostwork", help="lost work per forced kill (launches its own mpiexec)")
    lw.add_argument("--runs", type=int, default=5, help="runs per scenario (default 5)")
    lw.add_argument("--ranks", type=int, default=4)
    lw.add_argument("--nx", type=int, default=96)
    lw.add_argument("--ny", type=int, default=96)
    lw.add_argument("--step-delay", type=float, default=0.01)
    lw.add_argument("--checkpoint-every", type=int, default=50)
    lw.add_argument("--app-steps", type=int, default=100_000, help="never reached")
    lw.add_argument("--walltime", type=float, default=6.0, help="W without jitter, s (default 6)")
    lw.add_argument("--jitter", type=float, default=2.0, help="W += U[0, jitter) (default 2)")
    lw.add_argument("--warn-lead", type=float, default=1.0, help="USR1 this long before W")
    lw.add_argument("--keep", action="store_true", help="keep the logs and checkpoints")

    for q in (o, lw):
        q.add_argument("--dir", default=None, help="parent of the temporary directory")
        q.add_argument("--json", default=None, help="also write the results as JSON to this path")
        q.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.runs < 1 or (args.mode == "overhead" and args.steps < 1):
        p.error("--runs and --steps must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "overhead":
        return run_overhead(args)
    return run_lostwork(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        if "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
        raise
