"""The README's first command: a 4-rank save / kill / corrupt / restore showcase.

Runs ``apps.heat`` on 4 MPI ranks three ways and checks that they agree bit for bit:

1. an uninterrupted reference run;
2. a run under ``resilient run --walltime`` whose attempts are cut short by a simulated
   walltime (warning signal, then SIGTERM, then SIGKILL), plus one ``kill -9`` of every rank
   mid-run and one corrupted checkpoint that must be detected, quarantined and skipped;
3. the final fields compared byte for byte.

Needs no Slurm. Run from a clone: ``bash .ci/dev demo`` (or ``python -m resilient.demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from resilient.exitcodes import EXIT_OK, EXIT_RESUME
from resilient.run import read_ledger
from resilient.validate import latest_valid, list_checkpoints

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def heat_cmd(ckpt: Path, out: Path, steps: int, delay: float) -> list[str]:
    return [
        _mpiexec(),
        "-n",
        "4",
        sys.executable,
        "-m",
        "apps.heat",
        "--nx",
        "192",
        "--ny",
        "192",
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(ckpt),
        "--out",
        str(out),
        "--config",
        str(REPO / "configs/checkpoint/demo.yaml"),
        "--step-delay",
        str(delay),
    ]


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def flip_byte(path: Path) -> None:
    """Corrupt one byte in the middle of the largest data file of a checkpoint."""
    target = max((p for p in path.glob("*.h5")), key=lambda p: p.stat().st_size)
    with open(target, "r+b") as fh:
        size = fh.seek(0, 2)
        fh.seek(size - size // 3)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="output folder (default out/demo-TIME)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--walltime", type=float, default=4.0, help="simulated walltime per attempt, s")
    args = p.parse_args(argv)
    if not (REPO / "apps" / "heat.py").exists():
        raise SystemExit("run the demo from a clone of the repository (apps/heat.py not found)")
    out = args.out or REPO / "out" / time.strftime("demo-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    env = _env()
    delay = 0.01

    say(f"1/3 uninterrupted reference: 4 ranks, {args.steps} steps of a 192x192 heat equation")
    t0 = time.time()
    subprocess.run(
        heat_cmd(out / "ref-ckpt", out / "reference.h5", args.steps, delay),
        check=True,
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    say(f"    reference done in {time.time() - t0:.1f} s")

    ckpt, result = out / "ckpt", out / "resumed.h5"
    say(f"2/3 the same run under `resilient run --walltime {args.walltime:g}s`, killed and resumed")
    attempt, code = 0, None
    while code != EXIT_OK:
        attempt += 1
        if attempt > 60:
            say("giving up after 60 attempts")
            return 1
        cmd = [
            sys.executable,
            "-m",
            "resilient.cli",
            "run",
            "--checkpoint-dir",
            str(ckpt),
            "--walltime",
            f"{args.walltime}",
            "--signal",
            "USR1@1.5",
            "--kill-wait",
            "1",
            "--",
            *heat_cmd(ckpt, result, args.steps, delay),
        ]
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if attempt == 2:  # a crash: every rank killed at once, mid-run, no warning at all
            time.sleep(args.walltime * 0.6)
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
            code = -9
            say(f"    attempt {attempt}: kill -9 of all 4 ranks mid-run (a node crash)")
            continue
        code = proc.wait()
        latest = latest_valid(ckpt)
        step = latest.step if latest else None
        what = {EXIT_OK: "finished", EXIT_RESUME: "stopped by walltime, progress saved (75)"}
        say(
            f"    attempt {attempt}: exit {code} ({what.get(code, 'failed')}); latest valid step {step}"
        )
        if attempt == 3 and latest is not None:
            flip_byte(latest.path)
            say(
                f"    corrupted one byte of the checkpoint of step {latest.step}: "
                "the next attempt must detect it, quarantine it and fall back"
            )
        if code not in (EXIT_OK, EXIT_RESUME):
            say("    unexpected exit code")
            return 1

    say("3/3 checks")
    import h5py

    with h5py.File(out / "reference.h5") as f_ref, h5py.File(result) as f_res:
        same = f_ref["T"][()].tobytes() == f_res["T"][()].tobytes()
        steps_done = int(f_res.attrs["steps"])
    ledger = read_ledger(ckpt)
    quarantined = [r for r in list_checkpoints(ckpt) if r.status == "quarantined"]
    print()
    print(f"  {'attempt':>7}  {'exit':>4}  {'steps':>11}  reason")
    for rec in ledger:
        span = f"{rec.get('latest_before')} -> {rec.get('latest_after')}"
        print(f"  {rec['attempt']:>7}  {rec['exit_code']:>4}  {span:>11}  {rec['reason']}")
    print()
    subprocess.run([sys.executable, "-m", "resilient.cli", "ls", str(ckpt)], env=env, check=False)
    print()
    say(
        f"attempts: {attempt} (the crash of attempt 2 is not in the ledger: its wrapper was killed too)"
    )
    say(f"quarantined checkpoints: {[q.path.name for q in quarantined]}")
    say(f"final step {steps_done}; output bit-identical to the uninterrupted run: {same}")
    say(f"files: {out}")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "attempts": attempt,
                "bit_identical": same,
                "quarantined": [q.path.name for q in quarantined],
                "ledger": ledger,
            },
            indent=1,
        )
    )
    if not same or not quarantined:
        say("FAILED")
        return 1
    say("DEMO OK")
    return 0


def _children(pid: int) -> list[int]:
    from resilient.run import _descendants

    return _descendants(pid)


if __name__ == "__main__":
    sys.exit(main())
