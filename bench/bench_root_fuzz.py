"""Root fuzz: damage every file of a real checkpoint root, one at a time, in every way.

Usage (from the repository root, with the project's environment)::

    python bench/bench_root_fuzz.py --json root_fuzz.json      # every file x every damage
    python bench/bench_root_fuzz.py --quick                    # one layout, a damage per file

A real root first: ``apps.heat`` under ``resilient run --walltime ... --signal USR1@...``, a few
attempts each stopped early (a checkpoint every 10 steps, the newest two kept), in two layouts:
``one`` (one rank, a file per node) and ``sharded`` (two ranks, a file per rank, a sharded
manifest: ``tests/mpi/sharded_heat.py``). Every file the root then holds (its steps' data
files, manifests, shards and ``COMMITTED``; the static data's; every log, the run key, the
marker, the lock) and the sidecar ``PARENT/.NAME.resilient-attempts`` beside it is damaged
in each way of ``tests/rootdamage.py`` (a bit flip, garbage lines, a non-UTF-8 byte, a
truncation to half, a deletion, an empty file), each on a fresh copy of the root. Then the
root checker (``tests/roothealth.py``: ``resilient ls``, ``status``, ``report``, ``verify
--full`` and ``latest --full``, and a restore on one process) looks at it, and with
``--resume`` the program is run again to completion under ``resilient run --requeue``.

Each trial counts once, by file kind, in the first of these that applies:

* *crash*: a traceback in any command, the restore or ``resilient run``, or a process that died
  without its answer (must be 0);
* *lost*: the restore returned less than the newest intact step (the newest step whose own
  directory was not damaged: a damaged step costs that step, nothing else costs any), or that
  step's arrays differ from what it saved, or (``--resume``) the final output differs from an
  uninterrupted run's (must be 0);
* *error*: a clear error (a ``ResilientError``'s message, a command's nonzero exit with its
  one-line message, ``resilient run``'s nonzero exit without a traceback) where the right
  answer was a restore;
* *fell back*: restored the newest intact step, older than the newest (the damaged file was
  the newest step's own);
* *newest*: restored the newest step.

Prints a table per layout and file kind and the totals; exit status 0 when crash and lost are
0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's resilient, apps/ and tests/

from benchutil import library_revision, write_json  # noqa: E402

from resilient.job.launch import find_mpiexec  # noqa: E402
from resilient.model import filenames  # noqa: E402
from tests.rootdamage import DAMAGES, damage, file_kind  # noqa: E402
from tests.roothealth import Digests, Health, child_env, probe, problems  # noqa: E402

OUTCOMES = ("newest", "fell back", "error", "crash", "lost")
NX, NY = 24, 16
BLOCKS = {leaf: ((NX, NY), (0, 0), (NX, NY)) for leaf in ("u", "kappa")}
LAYOUTS = {  # ranks, program, checkpoint_comm
    "one": (1, ["-m", "apps.heat"], "node"),
    "sharded": (2, ["tests/mpi/sharded_heat.py"], "self"),
}
# with --quick: the damages tried per file (the rest are tried on the logs and markers only)
QUICK = ("bitflip", "delete")


@dataclass(frozen=True)
class Trial:
    layout: str
    kind: str
    file: str
    damage: str
    outcome: str
    why: str


def heat(layout: str, ckpt: Path, out: Path, steps: int, delay: float) -> list[str]:
    ranks, program, comm = LAYOUTS[layout]
    return [
        find_mpiexec(), "-n", str(ranks), sys.executable, *program, "--nx", str(NX),
        "--ny", str(NY), "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--out", str(out),
        "--checkpoint-every", "10", "--step-delay", str(delay),
        "--config", str(REPO / "configs/checkpoint/demo.yaml"), "--checkpoint-comm", comm,
    ]  # fmt: skip


def resilient_run(args: list[str], cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilient.cli", "run", *args, "--", *cmd],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def committed_steps(root: Path) -> list[int]:
    steps = (filenames.parse_step_dir(p.name) for p in root.glob("step_*"))
    have = (s for s in steps if s is not None)
    return sorted(s for s in have if (root / filenames.step_dir_name(s) / "COMMITTED").exists())


def build_root(layout: str, base: Path, attempts: int, steps: int, walltime: float) -> list[int]:
    """``base/ck`` after ``attempts`` attempts stopped early; its committed steps."""
    ckpt = base / "ck"
    for _ in range(attempts):
        proc = resilient_run(
            ["--checkpoint-dir", str(ckpt), "--walltime", f"{walltime:g}",
             "--signal", f"USR1@{walltime / 2:g}", "--kill-wait", "1"],
            heat(layout, ckpt, base / "out.h5", steps, delay=0.05),
        )  # fmt: skip
        if proc.returncode != 75:
            raise SystemExit(f"building the {layout} root: exit {proc.returncode}\n{proc.stderr}")
    found = committed_steps(ckpt)
    if len(found) < 2:
        raise SystemExit(f"the {layout} root has {found}: fewer than two checkpoints")
    return found


def reference_output(layout: str, work: Path, steps: int) -> bytes:
    import h5py

    proc = subprocess.run(heat(layout, work / "ck", work / "out.h5", steps, delay=0.0),
                          cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed: {proc.stderr[-3000:]}")
    with h5py.File(work / "out.h5") as f:
        return bytes(f["T"][()].tobytes())


def classify(
    health: Health | None,
    died: str | None,
    *,
    newest: int,
    intact: int | None,
    digests: Mapping[int, Digests],
) -> tuple[str, str]:
    """The outcome of one trial (see the module's docstring) and why, in one line."""
    if health is None:
        return "crash", (died or "the checker's child died")[-300:]
    found = problems(health)  # tracebacks, exits without a reason
    crashes = [p for p in found if "traceback" in p]
    if crashes:
        return "crash", crashes[0]
    r = health.restore
    if r.step is not None and dict(digests.get(r.step, {})) != r.digests:
        return "lost", f"step {r.step} restored with other data than it saved"
    if r.step is None or (intact is not None and r.step < intact):
        if r.error_type not in (None, "CheckpointNotFoundError"):
            return "error", f"{r.error_type}: {r.error}"[:300]
        return "lost", f"restored {r.step}, newest intact {intact}: {r.error}"[:300]
    if found:
        return "error", found[0][:300]
    return ("newest" if r.step == newest else "fell back"), f"step {r.step}"


def one_trial(*args: Any, **kwargs: Any) -> Trial:
    """:func:`trial`; a failure of the bench itself (not of the library) is its own outcome."""
    try:
        return trial(*args, **kwargs)
    except Exception as exc:
        layout, base, target, how = args[:4]
        return Trial(layout, "?", str(target.relative_to(base)), how, "bench error", repr(exc))


def trial(
    layout: str, base: Path, target: Path, how: str, work: Path, *, steps: list[int],
    digests: Mapping[int, Digests], resume: int | None, ref: bytes | None,
) -> Trial:  # fmt: skip
    root = base / "ck"
    kind = file_kind(root, target)
    shutil.copytree(base, work, symlinks=True)
    ckpt = work / "ck"
    copy = work / target.relative_to(base)
    damage(copy, how)
    rel = target.relative_to(root) if root in target.parents else Path(target.name)
    step = filenames.parse_step_dir(rel.parts[0]) if len(rel.parts) > 1 else None
    intact = max((s for s in steps if s != step), default=None)
    try:
        health: Health | None = probe(ckpt, blocks=BLOCKS)
        died = None
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        health, died = None, str(exc)
    outcome, why = classify(health, died, newest=steps[-1], intact=intact, digests=digests)
    if resume is not None and outcome in ("newest", "fell back", "error"):
        proc = resilient_run(
            ["--checkpoint-dir", str(ckpt), "--walltime", "60", "--signal", "USR1@5",
             "--kill-wait", "1", "--requeue"],
            heat(layout, ckpt, work / "out.h5", resume, delay=0.0),
        )  # fmt: skip
        last = proc.stderr.strip().splitlines()[-1:] or [""]
        if "Traceback (most recent call last)" in proc.stderr:
            outcome, why = "crash", f"resilient run: {last[0]}"[:300]
        elif proc.returncode != 0 and outcome != "error":
            outcome, why = "error", f"resilient run exit {proc.returncode}: {last[0]}"[:300]
        elif proc.returncode == 0 and _field(work / "out.h5") != ref:
            outcome, why = "lost", "the final output differs from an uninterrupted run's"
    shutil.rmtree(work, ignore_errors=True)
    return Trial(layout, kind, str(target.relative_to(base)), how, outcome, why)


def _field(path: Path) -> bytes | None:
    import h5py

    try:
        with h5py.File(path) as f:
            return bytes(f["T"][()].tobytes())
    except OSError:
        return None


def sweep(args: argparse.Namespace, work: Path) -> list[Trial]:
    trials: list[Trial] = []
    layouts = ["one"] if args.quick else args.layouts.split(",")
    for layout in layouts:
        base = work / f"root-{layout}"
        base.mkdir(parents=True)
        steps = build_root(layout, base, args.attempts, args.steps, args.walltime)
        digests = {}
        for s in steps:  # what each step saved, restored from the undamaged root
            r = probe(base / "ck", blocks=BLOCKS, step=s).restore
            if r.step != s:
                raise SystemExit(f"the undamaged root did not restore step {s}: {r.error}")
            digests[s] = r.digests
        ref = reference_output(layout, work / f"ref-{layout}", args.steps) if args.resume else None
        files = sorted(p for p in (base / "ck").rglob("*") if p.is_file())
        files.append(base / filenames.attempt_sidecar_name("ck"))
        files.append(base / filenames.handoff_sidecar_name("ck"))
        jobs = []
        for target in files:
            kind = file_kind(base / "ck", target)
            hows = list(DAMAGES)
            if args.quick and (kind.startswith(("step", "static"))):
                hows = list(QUICK)
            jobs += [(target, how) for how in hows]
        print(f"{layout}: steps {steps}, {len(files)} files, {len(jobs)} trials", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            resume = args.steps if args.resume else None
            futures = [
                pool.submit(one_trial, layout, base, target, how, work / f"t-{layout}-{i}",
                            steps=steps, digests=digests, resume=resume, ref=ref)
                for i, (target, how) in enumerate(jobs)
            ]  # fmt: skip
            trials += [f.result() for f in futures]
    return trials


def table(trials: Sequence[Trial]) -> list[str]:
    rows: dict[tuple[str, str], Counter[str]] = {}
    for t in trials:
        rows.setdefault((t.layout, t.kind), Counter())[t.outcome] += 1
    width = max(len(k) for _, k in rows) + 2
    head = f"{'layout':8} {'file kind':{width}} {'trials':>6} " + " ".join(
        f"{o:>9}" for o in OUTCOMES
    )
    lines = [head]
    total: Counter[str] = Counter()
    for (layout, kind), counts in sorted(rows.items()):
        total.update(counts)
        n = sum(counts.values())
        lines.append(
            f"{layout:8} {kind:{width}} {n:>6} " + " ".join(f"{counts[o]:>9}" for o in OUTCOMES)
        )
    n = sum(total.values())
    lines.append(f"{'all':8} {'':{width}} {n:>6} " + " ".join(f"{total[o]:>9}" for o in OUTCOMES))
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="layout one only; data, manifests and markers: bit flip and deletion")  # fmt: skip
    p.add_argument("--layouts", default="one,sharded", help="comma-separated: one, sharded")
    p.add_argument("--attempts", type=int, default=3, help="attempts that build the root")
    p.add_argument("--steps", type=int, default=400, help="the program's steps (not reached)")
    p.add_argument("--walltime", type=float, default=8.0,
                   help="each building attempt's walltime (s); its warning comes at half")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="also run each damaged root to completion under resilient run")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="trials at a time")
    p.add_argument("--json", help="write every trial here")
    p.add_argument("--show", type=int, default=3, help="print why for this many of each outcome")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="root-fuzz-") as tmp:
        trials = sweep(args, Path(tmp))
    wall = time.perf_counter() - t0
    print(f"root fuzz at {library_revision()}: {len(trials)} trials in {wall:.0f} s")
    print("\n".join(table(trials)))
    for outcome in ("crash", "lost", "error", "bench error"):
        shown = [t for t in trials if t.outcome == outcome][: args.show]
        for t in shown:
            print(f"  {outcome}: {t.layout} {t.file} {t.damage}: {t.why}")
    write_json(args.json, {"revision": library_revision(), "wall_s": wall,
                           "trials": [asdict(t) for t in trials]})  # fmt: skip
    bad = sum(t.outcome in ("crash", "lost") for t in trials)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
