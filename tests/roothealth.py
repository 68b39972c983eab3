"""The health of a checkpoint root, as the tests (the fuzz tests, the crash tests) check it.

A root is healthy when

* the command line that users read it with (``resilient ls``, ``status``, ``status --json``,
  ``report``, ``report --json``, ``verify --full`` and ``latest --step --full``) ends without a
  traceback, each with exit 0 or with its documented nonzero answer where that is the right
  one (``latest``: 1 and "no valid checkpoint" when the restore finds none either;
  ``verify``: 1 when it names an INVALID step, or finds no checkpoint);
* ``latest --full`` names the step that a restore returns;
* a restore (:meth:`resilient.CheckpointManager.restore`, one process, on a copy of the root so
  that a quarantine does not change it) returns the newest intact step, and each of its arrays
  is bit for bit what that step saved: the same as a reference's (an uninterrupted run's) digests.

:func:`check_root` asserts all of it; :func:`probe` only looks (:func:`look`: the same in this
process) (the benchmark
``bench/bench_root_fuzz.py`` sorts its outcomes with :func:`problems`).

The commands and the restore run in one child process (``python -m tests.roothealth ROOT``):
each command through ``resilient.cli.main``, the ``resilient`` console script's entry point,
with its own captured stdout and stderr; an exception that escapes ``main`` is recorded as a
traceback, never raised. ``isolated=True`` starts ``python -m resilient.cli`` once per command
instead (slower: an interpreter each). The child prints one JSON document; a child that dies
without one (a crash, a hang past ``timeout``) fails the check.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: The commands run on a root, without the root (it comes last).
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("ls",),
    ("status",),
    ("status", "--json"),
    ("report",),
    ("report", "--json"),
    ("verify", "--full"),
    ("latest", "--step", "--full"),
)

#: Per leaf of a restored state: ``"dtype shape sha256"`` of an array, ``repr`` of a value.
Digests = Mapping[str, str]
#: ``{leaf: (global_shape, start, shape)}``: the block of each Block leaf the restore asks for
#: (a checkpoint of N ranks restored on one process: the whole array).
Blocks = Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[int]]]


@dataclass(frozen=True)
class CommandResult:
    """One ``resilient`` command on the root: its arguments, exit code and output."""

    argv: tuple[str, ...]
    code: int
    stdout: str
    stderr: str
    traceback: str | None  # an exception that escaped the command's main()

    @property
    def name(self) -> str:
        return "resilient " + " ".join(a for a in self.argv if not a.startswith("/"))


@dataclass(frozen=True)
class RestoreResult:
    """A restore of the newest valid checkpoint on one process (on a copy of the root)."""

    step: int | None  # None: nothing restored
    digests: dict[str, str]
    error: str | None  # a ResilientError's message (CheckpointNotFoundError: none valid)
    error_type: str | None
    traceback: str | None  # any other exception
    log: str  # what the library logged (warnings: the fallbacks, repairs)


@dataclass(frozen=True)
class Health:
    """What :func:`probe` saw of a root."""

    root: Path
    commands: tuple[CommandResult, ...]
    restore: RestoreResult

    def command(self, *argv: str) -> CommandResult:
        """The result of the command that began with ``argv`` (e.g. ``"latest"``)."""
        for c in self.commands:
            if c.argv[: len(argv)] == argv:
                return c
        raise KeyError(argv)


def digest(value: Any) -> str:
    """A leaf's digest: dtype, shape and SHA-256 of an array's bytes; ``repr`` of a value."""
    import numpy as np

    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return f"{data.dtype.str} {list(data.shape)} {hashlib.sha256(data.tobytes()).hexdigest()}"
    return repr(value)


def flatten(state: Any, prefix: str = "") -> dict[str, str]:
    """``{leaf path: digest}`` of a restored state (dicts, lists and tuples walked)."""
    if isinstance(state, Mapping):
        out: dict[str, str] = {}
        for key, value in state.items():
            out.update(flatten(value, f"{prefix}{key}/"))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, value in enumerate(state):
            out.update(flatten(value, f"{prefix}{i}/"))
        return out
    return {prefix.rstrip("/"): digest(state)}


def problems(
    health: Health,
    *,
    expect_step: int | None = None,
    reference: Mapping[int, Digests] | None = None,
) -> list[str]:
    """What is wrong with ``health`` (empty: healthy). ``expect_step``: the step the restore
    must return (the newest intact one); ``reference``: the digests each step must have."""
    found: list[str] = []
    restored = health.restore
    for c in health.commands:
        if c.traceback is not None:
            found.append(f"{c.name}: traceback: {c.traceback.strip().splitlines()[-1]}")
        elif "Traceback (most recent call last)" in c.stderr:
            found.append(f"{c.name}: a traceback in its output: {_tail(c.stderr)}")
        elif c.argv[0] == "latest":
            if c.code == 1 and "no valid checkpoint" in c.stderr:
                if restored.step is not None:
                    found.append(f"{c.name}: none valid, but the restore returned {restored.step}")
            elif c.code != 0:
                found.append(f"{c.name}: exit {c.code}: {_tail(c.stderr)}")
            elif restored.step is not None and c.stdout.strip() != str(restored.step):
                found.append(f"{c.name}: {c.stdout.strip()}, the restore {restored.step}")
        elif c.argv[0] == "verify":
            said_why = "INVALID" in c.stdout or "no checkpoints" in c.stdout
            if c.code not in (0, 1) or (c.code == 1 and not said_why):
                found.append(f"{c.name}: exit {c.code}: {_tail(c.stderr or c.stdout)}")
        elif c.code != 0:
            found.append(f"{c.name}: exit {c.code}: {_tail(c.stderr)}")
    if restored.traceback is not None:
        found.append(f"restore: traceback: {restored.traceback.strip().splitlines()[-1]}")
    elif "Traceback (most recent call last)" in restored.log:
        found.append(f"restore: a traceback in its log: {_tail(restored.log)}")
    if expect_step is not None and restored.step != expect_step:
        found.append(
            f"restore: step {restored.step}, expected {expect_step}"
            + (f" ({restored.error_type}: {restored.error})" if restored.error else "")
        )
    if reference is not None and restored.step is not None:
        want = reference.get(restored.step)
        if want is None:
            found.append(f"restore: no reference for step {restored.step}")
        elif dict(want) != restored.digests:
            differ = sorted(
                k for k in {*want, *restored.digests} if want.get(k) != restored.digests.get(k)
            )
            found.append(f"restore: step {restored.step} differs from its reference in {differ}")
    return found


def check_root(
    root: Path,
    *,
    expect_step: int | None = None,
    reference: Mapping[int, Digests] | None = None,
    blocks: Blocks | None = None,
    isolated: bool = False,
    timeout: float = 120,
) -> Health:
    """Assert that ``root`` is healthy (see the module's docstring); return what was seen.

    Args:
        root: a checkpoint root (not changed: the restore works on a copy).
        expect_step: the step a restore must return (the newest intact step); ``None``: any,
            including none when ``latest`` agrees.
        reference: ``{step: digests}`` (:func:`flatten` of the state that step holds, e.g.
            :func:`probe` of an uninterrupted run's root): the restored step must be in it and
            bit for bit equal.
        blocks: the block of each Block leaf to restore (needed for a checkpoint of another
            rank count than one).
        isolated: run each command as its own ``python -m resilient.cli`` process.
        timeout: seconds for the child process.
    """
    health = probe(root, blocks=blocks, isolated=isolated, timeout=timeout)
    found = problems(health, expect_step=expect_step, reference=reference)
    assert not found, f"{root} is not healthy:\n  " + "\n  ".join(found)
    return health


def probe(
    root: Path,
    *,
    blocks: Blocks | None = None,
    step: int | None = None,
    isolated: bool = False,
    timeout: float = 120,
) -> Health:
    """Run the commands and the restore (of ``step``, default the newest valid one) on
    ``root`` in a child process; what they gave."""
    cmd = [sys.executable, "-m", "tests.roothealth", str(root)]
    if step is not None:
        cmd += ["--step", str(step)]
    if blocks:
        cmd += ["--blocks", json.dumps({k: [list(p) for p in v] for k, v in blocks.items()})]
    if isolated:
        cmd.append("--isolated")
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(
            f"the root checker's child died (exit {proc.returncode}) on {root}:\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return _health(root, json.loads(proc.stdout))


def _health(root: Path, doc: dict[str, Any]) -> Health:
    commands = tuple(
        CommandResult(tuple(c["argv"]), int(c["code"]), c["stdout"], c["stderr"], c["traceback"])
        for c in doc["commands"]
    )
    r = doc["restore"]
    restore = RestoreResult(
        r["step"], dict(r["digests"]), r["error"], r["error_type"], r["traceback"], r["log"]
    )
    return Health(Path(root), commands, restore)


def child_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's or a job's variables, with the repository on
    ``PYTHONPATH``: for the processes a test starts on a root."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPIR_", "SLURM_", "RESILIENT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _tail(text: str, n: int = 300) -> str:
    text = " | ".join(line for line in text.strip().splitlines()[-3:])
    return text[-n:]


# ---------------------------------------------------------------- the child process


def _run_command(argv: Sequence[str], *, isolated: bool) -> dict[str, Any]:
    if isolated:
        proc = subprocess.run(
            [sys.executable, "-m", "resilient.cli", *argv],
            capture_output=True, text=True, timeout=120, env=child_env(),
        )  # fmt: skip
        tb = proc.stderr if "Traceback (most recent call last)" in proc.stderr else None
        return {"argv": list(argv), "code": proc.returncode, "stdout": proc.stdout,
                "stderr": proc.stderr, "traceback": tb}  # fmt: skip
    from resilient import cli

    out, err = io.StringIO(), io.StringIO()
    tb = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            tb, code = traceback.format_exc(), 1
    return {"argv": list(argv), "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "traceback": tb}  # fmt: skip


def _restore(root: Path, blocks: Blocks | None, step: int | None) -> dict[str, Any]:
    import logging

    from resilient import CheckpointManager, ResilientError

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    result: dict[str, Any] = {"step": None, "digests": {}, "error": None, "error_type": None,
                              "traceback": None}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="roothealth-") as tmp:
        copy = Path(tmp) / root.name
        try:
            shutil.copytree(root, copy, symlinks=True)
            with CheckpointManager(copy) as manager:
                restored, state = manager.restore(step, blocks=blocks)
            result["step"], result["digests"] = restored, flatten(state)
        except ResilientError as exc:
            result["error"], result["error_type"] = str(exc), type(exc).__name__
        except BaseException:
            result["traceback"] = traceback.format_exc()
        finally:
            logging.getLogger().removeHandler(handler)
    result["log"] = log.getvalue()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The child: print one JSON document of the commands' and the restore's results."""
    p = argparse.ArgumentParser(description="the health of a checkpoint root (tests)")
    p.add_argument("root", type=Path)
    p.add_argument("--blocks", help="JSON: {leaf: [global_shape, start, shape]}")
    p.add_argument("--step", type=int, help="restore this step (default: the newest valid)")
    p.add_argument("--isolated", action="store_true", help="a process per command")
    args = p.parse_args(argv)
    blocks = json.loads(args.blocks) if args.blocks else None
    root = Path(os.path.abspath(args.root))
    sys.stdout.write(json.dumps(_look(root, blocks, args.step, isolated=args.isolated)) + "\n")
    return 0


def _look(root: Path, blocks: Blocks | None, step: int | None, *, isolated: bool) -> dict[str, Any]:
    commands = [_run_command([*c, str(root)], isolated=isolated) for c in COMMANDS]
    return {"commands": commands, "restore": _restore(root, blocks, step)}


def look(root: Path, *, blocks: Blocks | None = None, step: int | None = None) -> Health:
    """:func:`probe` in this process (the crash tests look at thousands of roots): the
    commands through ``resilient.cli.main``, the restore on a copy. Never raises for what the
    root holds (a traceback is recorded, as in the child)."""
    return _health(root, _look(Path(os.path.abspath(root)), blocks, step, isolated=False))


if __name__ == "__main__":
    sys.exit(main())
