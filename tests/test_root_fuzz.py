"""One damaged file of a checkpoint root between two attempts of ``resilient run``: it costs at
most the checkpoint it belongs to, and nothing crashes (issue 44).

For each kind of file (a step's data file, manifest, shard of a sharded manifest and
``COMMITTED``; the static data's data file, manifest, shard and ``COMMITTED``, and its second
copy's; each log, the run key and the root marker and their copies, the lock, the sidecar
``PARENT/.NAME.resilient-attempts`` and the hand-off ``PARENT/.NAME.resilient-handoff``) and each
kind of damage (bit flip, garbage line, non-UTF-8 bytes, truncation, deletion, an empty file;
the meaningful pairs, each file kind and each damage at least once): ``apps.heat`` on one rank
(two ranks with a sharded manifest) ran one attempt under ``resilient run --walltime ...
--signal USR1@...`` that stopped early (a shared setup, copied per case); then the file is
damaged and ``resilient run ... --requeue`` runs the program again to completion. Each case
must end with exit 0 and no traceback, resume from the newest checkpoint the damage left
intact (the older one when the damaged file is the newest step's own, else the newest), leave
a healthy root (:func:`tests.roothealth.check_root`: the CLI and a restore of the last step,
bit for bit as an uninterrupted run's) and write the uninterrupted run's output bit for bit.

The cases run concurrently (a thread pool of subprocesses in a module-scoped fixture); each
parametrized test asserts one case's result.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest

from resilient.model import filenames
from tests.mpirun import REPO, mpiexec
from tests.rootdamage import damage
from tests.roothealth import Blocks, Digests, child_env, probe, problems

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

STEPS = 60
NX, NY = 24, 16
BLOCKS: Blocks = {leaf: ((NX, NY), (0, 0), (NX, NY)) for leaf in ("u", "kappa")}
# the first attempt's walltime and warning (seconds): stopped after some checkpoints (one every
# 10 steps, the newest two kept), long before STEPS; longer ones if a loaded machine's start-up
# left it no second checkpoint
FIRST_TRIES = (("4", "USR1@2"), ("6", "USR1@3"), ("10", "USR1@6"))
WORKERS = 3


@dataclass(frozen=True)
class Layout:
    """How the program runs: its rank count, script and checkpoint_comm."""

    ranks: int
    program: tuple[str, ...]
    comm: str


LAYOUTS = {
    "one": Layout(1, ("-m", "apps.heat"), "node"),
    # a shard per rank (tests/mpi/sharded_heat.py); a sharded manifest needs two file groups
    "sharded": Layout(2, ("tests/mpi/sharded_heat.py",), "self"),
}


def heat(layout: Layout, ckpt: Path, out: Path, delay: float) -> list[str]:
    return [
        mpiexec(), "-n", str(layout.ranks), sys.executable, *layout.program,
        "--nx", str(NX), "--ny", str(NY), "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
        "--out", str(out), "--checkpoint-every", "10", "--step-delay", str(delay),
        "--config", str(REPO / "configs/checkpoint/demo.yaml"), "--checkpoint-comm", layout.comm,
    ]  # fmt: skip


def resilient_run(args: list[str], cmd: list[str]) -> subprocess.CompletedProcess[str]:
    full = [sys.executable, "-m", "resilient.cli", "run", *args, "--", *cmd]
    return subprocess.run(
        full, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240
    )


def field(path: Path) -> bytes | None:
    """The output's field, or ``None`` where there is no complete output."""
    try:
        with h5py.File(path) as f:
            if int(f.attrs["steps"]) != STEPS:
                return None
            return bytes(f["T"][()].tobytes())
    except OSError:
        return None


def valid_steps(root: Path) -> list[int]:
    """The committed steps of ``root`` (a marker in each), oldest first; read before damage."""
    steps = (filenames.parse_step_dir(p.name) for p in root.glob("step_*"))
    committed = (s for s in steps if s is not None)
    return sorted(
        s for s in committed if (root / filenames.step_dir_name(s) / "COMMITTED").exists()
    )


@dataclass(frozen=True)
class First:
    """The shared setup of a layout: a directory holding the root ``ck`` (and its sidecar)
    after one attempt that stopped early, and the root's two steps."""

    base: Path
    older: int
    newest: int


def first_attempt(layout: Layout, base: Path) -> First:
    """One attempt of ``layout`` under a simulated walltime, stopped early with two steps."""
    for walltime, warn in FIRST_TRIES:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        ckpt = base / "ck"
        proc = resilient_run(
            ["--checkpoint-dir", str(ckpt), "--walltime", walltime, "--signal", warn,
             "--kill-wait", "1"],
            heat(layout, ckpt, base / "out.h5", delay=0.05),
        )  # fmt: skip
        steps = valid_steps(ckpt)
        if proc.returncode == 75 and len(steps) == 2 and steps[-1] < STEPS:
            return First(base, steps[0], steps[1])
    raise AssertionError(f"no first attempt with two checkpoints: {proc.stderr[-3000:]}")


# ------------------------------------------------------------------ the cases


def newest_step(root: Path) -> Path:
    return root / filenames.step_dir_name(valid_steps(root)[-1])


def static_dir(root: Path) -> Path:
    found = sorted((root / filenames.STATIC_DIR).glob("[0-9a-f]" * 32))
    assert found, f"no static data in {root}"
    return found[0]  # the first copy, where there are two


def static_copy_dir(root: Path) -> Path:
    return static_dir(root).with_name(filenames.static_copy_dir_name(static_dir(root).name))


def data_file(d: Path) -> Path:
    return sorted(p for p in d.iterdir() if filenames.is_data_file_name(p.name))[0]


Select = Callable[[Path], Path]


def in_root(name: str) -> Select:
    return lambda root: root / name


SELECT: dict[str, Select] = {
    "step data": lambda r: data_file(newest_step(r)),
    "step manifest": lambda r: newest_step(r) / filenames.MANIFEST,
    "step shard": lambda r: newest_step(r) / filenames.shard_name(0),
    "step COMMITTED": lambda r: newest_step(r) / filenames.COMMITTED,
    "static data": lambda r: data_file(static_dir(r)),
    "static manifest": lambda r: static_dir(r) / filenames.MANIFEST,
    "static shard": lambda r: static_dir(r) / filenames.shard_name(0),
    "static COMMITTED": lambda r: static_dir(r) / filenames.COMMITTED,
    "static copy manifest": lambda r: static_copy_dir(r) / filenames.MANIFEST,
    "static copy data": lambda r: data_file(static_copy_dir(r)),
    "sidecar": lambda r: r.parent / filenames.attempt_sidecar_name(r.name),
    "handoff": lambda r: r.parent / filenames.handoff_sidecar_name(r.name),
}
for _name in ("attempts.jsonl", "progress.jsonl", "stops.jsonl", "saves.jsonl", "run_key.json",
              "run_key.copy.json", ".resilient-root", ".resilient-root.copy", ".lock"):  # fmt: skip
    SELECT[_name] = in_root(_name)

# (layout, file kind, damage): a damaged file of the newest step costs that step (the program
# resumes from the older one); any other damage costs nothing (it resumes from the newest)
CASES: list[tuple[str, str, str]] = [
    ("one", "step data", "bitflip"),
    ("one", "step data", "truncate"),
    ("one", "step manifest", "bitflip"),
    ("one", "step manifest", "delete"),
    ("one", "step COMMITTED", "empty"),
    ("one", "step COMMITTED", "garbage"),
    ("sharded", "step manifest", "truncate"),  # the index of a sharded manifest
    ("sharded", "step shard", "bitflip"),
    ("sharded", "step shard", "delete"),
    ("one", "static manifest", "bitflip"),
    ("one", "static manifest", "delete"),
    ("one", "static data", "bitflip"),
    ("one", "static COMMITTED", "truncate"),
    ("one", "static copy manifest", "bitflip"),
    ("one", "static copy data", "delete"),
    ("sharded", "static shard", "delete"),
    ("one", "attempts.jsonl", "garbage"),
    ("one", "attempts.jsonl", "truncate"),
    ("one", "attempts.jsonl", "utf8"),
    ("one", "progress.jsonl", "utf8"),
    ("one", "progress.jsonl", "garbage"),
    ("one", "stops.jsonl", "garbage"),
    ("one", "stops.jsonl", "empty"),
    ("one", "stops.jsonl", "utf8"),
    ("one", "saves.jsonl", "truncate"),
    ("one", "saves.jsonl", "utf8"),
    ("one", "run_key.json", "garbage"),
    ("one", "run_key.json", "delete"),
    ("one", "run_key.json", "empty"),
    ("one", "run_key.json", "bitflip"),  # "apps.heat" -> "apps/heat": another run's key?
    ("one", ".resilient-root", "garbage"),
    ("one", ".resilient-root", "delete"),
    ("one", ".resilient-root.copy", "empty"),
    ("one", "run_key.copy.json", "bitflip"),
    ("one", ".lock", "garbage"),
    ("one", ".lock", "delete"),
    ("one", "sidecar", "garbage"),
    ("one", "sidecar", "utf8"),
    ("one", "sidecar", "delete"),
    ("one", "handoff", "garbage"),
    ("one", "handoff", "utf8"),
]


def case_id(case: tuple[str, str, str]) -> str:
    layout, kind, how = case
    return f"{layout}-{kind.replace(' ', '_')}-{how}"


@dataclass(frozen=True)
class Outcome:
    """What one case gave: the run's exit and log, the step it resumed from, the output's
    equality with the reference, and the root checker's findings."""

    code: int
    stderr: str
    resumed: int | None
    expected_resume: int
    identical: bool
    problems: tuple[str, ...]


RESUMED = re.compile(r"resumed from step (\d+) in ")


def run_case(
    case: tuple[str, str, str], first: First, work: Path, ref_field: bytes,
    ref_digests: Mapping[int, Digests],
) -> Outcome:  # fmt: skip
    layout_name, kind, how = case
    layout = LAYOUTS[layout_name]
    shutil.copytree(first.base, work, symlinks=True)
    ckpt = work / "ck"
    damage(SELECT[kind](ckpt), how)
    expected = first.older if kind.startswith("step ") else first.newest
    proc = resilient_run(
        ["--checkpoint-dir", str(ckpt), "--walltime", "60", "--signal", "USR1@5",
         "--kill-wait", "1", "--requeue"],
        heat(layout, ckpt, work / "out.h5", delay=0.0),
    )  # fmt: skip
    found = RESUMED.search(proc.stderr)
    try:
        health = probe(ckpt, blocks=BLOCKS)
        seen = problems(health, expect_step=STEPS, reference=ref_digests)
    except AssertionError as exc:  # the checker's child died
        seen = [str(exc)]
    return Outcome(
        proc.returncode, proc.stderr, int(found.group(1)) if found else None, expected,
        field(work / "out.h5") == ref_field, tuple(seen),
    )  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every case's outcome: the shared setups (concurrently), then the cases (a pool)."""
    tmp = tmp_path_factory.mktemp("fuzz")

    def reference() -> tuple[bytes, dict[int, Digests]]:
        layout, ckpt, out = LAYOUTS["one"], tmp / "ref" / "ck", tmp / "ref" / "out.h5"
        proc = subprocess.run(heat(layout, ckpt, out, delay=0.0), cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=240)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        health = probe(ckpt, blocks=BLOCKS)  # the checker on a healthy root: no finding
        assert not problems(health, expect_step=STEPS), problems(health, expect_step=STEPS)
        got = field(out)
        assert got is not None
        return got, {STEPS: health.restore.digests}

    with ThreadPoolExecutor(WORKERS) as pool:
        ref = pool.submit(reference)
        firsts = {name: pool.submit(first_attempt, layout, tmp / f"first-{name}")
                  for name, layout in LAYOUTS.items()}  # fmt: skip
        ref_field, ref_digests = ref.result()
        setups = {name: f.result() for name, f in firsts.items()}
        futures = {
            case_id(c): pool.submit(
                run_case, c, setups[c[0]], tmp / case_id(c), ref_field, ref_digests
            )
            for c in CASES
        }
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_one_damaged_file_costs_at_most_its_checkpoint(
    outcomes: dict[str, Outcome], case: tuple[str, str, str]
) -> None:
    o = outcomes[case_id(case)]
    tail = o.stderr[-2500:]
    last = o.stderr.strip().splitlines()[-1] if o.stderr.strip() else ""
    assert "Traceback (most recent call last)" not in o.stderr, f"a traceback: {last}\n{tail}"
    assert o.code == 0, f"exit {o.code}: {last}\n{tail}"
    resumed = "scratch" if o.resumed is None else f"step {o.resumed}"
    assert o.resumed == o.expected_resume, (
        f"resumed from {resumed}, not from step {o.expected_resume}: {last}"
    )
    assert o.identical, f"the output differs from an uninterrupted run's\n{tail}"
    assert not o.problems, f"the root is not healthy: {'; '.join(o.problems)}"
