"""The invariants of a crash state, checked as a user would see the state after the restart.

Each state (a tree under ``base``: the checkpoint root ``ck``, the logs beside it) is looked at
with the library's own readers and the root checker (:func:`tests.roothealth.look`: ``resilient
ls``, ``status``, ``report``, ``verify --full``, ``latest --full`` and a restore on one
process), and compared with what the operation's own start and end showed (:class:`Expected`):

1. no traceback anywhere, and ``latest`` and ``status`` name the step the restore returns
   (the root checker's :func:`~tests.roothealth.problems`, and ``status --json``);
2. a step is visible either complete and valid or not at all: ``verify --full`` calls no step
   INVALID that was not already so before the operation;
3. the newest checkpoint a restore returned before the operation, or a newer one, is
   restored, and bit for bit what that step held before or after the operation;
4. nothing committed is lost by rotation: every step visible both before and after the
   operation is visible in every state between;
5. every log (the attempts' ledger, the save log, the partner-copy log, the note beside the
   root...) reads as its records before the operation followed by a prefix of those the
   operation added: a lost last line at most, nothing changed, nothing invented; and the
   attempts, as the next attempt counts them (the root's ledger and the records still
   waiting in the task's own directory, ``own/``, moved without the copies already there),
   are those before the operation or after it, or in between;
6. a node-local step and its copy (a partner's, or the XOR parity of its set) are never both
   lost: every (node, step) of the node-local tier that was protected before the operation
   and is kept after it is protected in every state between (its own files valid, or a valid
   partner copy of them on another node, or, with XOR, every other member's files and a
   valid parity of the set's);
7. the program starts again: a :class:`resilient.CheckpointManager` on the root restores the
   step the checker's restore returned (or finds none where that found none), saves a new
   step and closes, without an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.io import logs
from resilient.io.targets import DirectoryTarget
from resilient.model import filenames
from tests.crash.ops import BLOCKS
from tests.roothealth import Digests, Health, look, problems

__all__ = ["Expected", "Seen", "expected", "see", "violations"]

LOG_KINDS: Mapping[str, logs.LogKind] = {
    filenames.ATTEMPT_LEDGER: logs.ATTEMPTS,
    filenames.SAVE_LOG: logs.SAVES,
    filenames.PROGRESS_LOG: logs.PROGRESS,
    filenames.STOP_LOG: logs.STOPS,
    filenames.PROTECT_LOG: logs.PROTECTED,
}
SIDECAR_SUFFIX = ".resilient-attempts"
ROOT = "ck"
OWN = "own"  # a task's own directory (``resilient run`` without --checkpoint-dir)
ATTEMPTS_COUNTED = "attempts counted"


@dataclass(frozen=True)
class Seen:
    """What one tree shows: the visible steps, those ``verify`` calls INVALID, the restore,
    and the records of each log (by its path under the tree)."""

    visible: tuple[int, ...]
    invalid: frozenset[int]
    health: Health | None  # None: no checkpoint root (an operation that creates it)
    logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    protected: frozenset[tuple[str, int]] = frozenset()  # (node, step) of the node-local tier


@dataclass(frozen=True)
class Expected:
    """What the operation's start and end showed: the restored step and each visible
    step's digests, before and after; the logs before and after."""

    restored_before: int | None
    before: dict[int, Digests]
    after: dict[int, Digests]
    invalid_before: frozenset[int]
    logs_before: dict[str, list[dict[str, Any]]]
    logs_after: dict[str, list[dict[str, Any]]]
    protected_before: frozenset[tuple[str, int]] = frozenset()
    protected_after: frozenset[tuple[str, int]] = frozenset()


def _logs(tree: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for name, kind in LOG_KINDS.items():
        path = tree / ROOT / name
        if path.exists():
            found[f"{ROOT}/{name}"] = logs.read_log(path, kind)
    for path in tree.glob(f".*{SIDECAR_SUFFIX}"):
        found[path.name] = logs.read_log(path, logs.SIDECAR)
    if (tree / OWN).is_dir():  # attempts counted before the program named its directory
        found[ATTEMPTS_COUNTED] = _attempts_counted(tree)
    return found


def _attempts_counted(tree: Path) -> list[dict[str, Any]]:
    """The attempts the next ``resilient run`` counts: the ledger it would move into the
    root (the library's own move, on a scratch copy), without the attempt numbers."""
    import shutil
    import tempfile

    from resilient.job.ledger import AttemptRecord, Where, read_ledger

    with tempfile.TemporaryDirectory() as tmp:
        own, root = Path(tmp) / OWN, Path(tmp) / ROOT
        shutil.copytree(tree / OWN, own)
        root.mkdir()
        if (tree / ROOT / filenames.ATTEMPT_LEDGER).exists():
            shutil.copy(tree / ROOT / filenames.ATTEMPT_LEDGER, root)
        Where(given=None, own=own, program=root).append(AttemptRecord(attempt=0, start=-1.0))
        counted = read_ledger(root)[:-1]  # without the probe's own record
    return [{k: v for k, v in r.items() if k != "attempt"} for r in counted]


def see(tree: Path) -> Seen:
    """Look at the tree ``tree`` (a materialized state)."""
    root = tree / ROOT
    protected = _protected(tree)
    if not root.exists():
        return Seen((), frozenset(), None, _logs(tree), protected)
    health = look(root, blocks=BLOCKS)
    visible = tuple(sorted(DirectoryTarget(root).steps())) if root.is_dir() else ()
    verify = health.command("verify")
    invalid = frozenset(int(s) for s in re.findall(r"^step (\d+): INVALID", verify.stdout, re.M))
    return Seen(visible, invalid, health, _logs(tree), protected)


def _valid(target: DirectoryTarget, step: int) -> bool:
    from resilient.errors import InvalidCheckpointError
    from resilient.io.checkpoints import verify_node_files

    try:
        verify_node_files(target, step)
    except (InvalidCheckpointError, OSError):
        return False
    return True


def _parity(run: Path, step: int) -> tuple[str, ...] | None:
    """The nodes of the XOR set whose parity ``run`` holds for ``step``, if that parity is
    committed and matches its digest."""
    import json

    from resilient.io.wire import digest_file

    xor = DirectoryTarget(run / "xor")
    if step not in xor.steps():
        return None
    where = xor.path(step)
    try:
        record = json.loads((where / "XOR.json").read_text())
        if digest_file(where / "parity.xor") != record["digest"]:
            return None
        return tuple(str(label) for label in record["labels"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _protected(tree: Path) -> frozenset[tuple[str, int]]:
    """The (node, step) pairs of the node-local tier (``local/<node>/<run>/``) that survive
    the loss of any one node: see the module's rule 6."""
    runs = {n.name: r for n in sorted((tree / "local").glob("*")) for r in n.glob("*")}
    own: dict[str, set[int]] = {}
    for node, run in runs.items():
        target = DirectoryTarget(run)
        own[node] = {s for s in target.steps() if _valid(target, s)}
    copies: set[tuple[str, int]] = set()
    for holder, run in runs.items():
        for source in (run / "partner").glob("*"):
            if source.name != holder:
                target = DirectoryTarget(source)
                copies |= {(source.name, s) for s in target.steps() if _valid(target, s)}
    # XOR: (node, step) -> the set's members, where the node's parity of the step is valid
    parity = {(n, s): m for n, run in runs.items() for s in own[n] if (m := _parity(run, s))}
    sets = {s: m for (_, s), m in parity.items()}
    found: set[tuple[str, int]] = set()
    for node in runs:
        for step in own[node] | {s for n, s in copies if n == node} | set(sets):
            members = sets.get(step, ())
            others = [o for o in members if o != node]
            by_parity = node in members and all((o, step) in parity for o in others)
            if (node, step) in copies or by_parity:
                found.add((node, step))  # a copy elsewhere: survives the loss of this node
    return frozenset(found)


def _digests(tree: Path, steps: tuple[int, ...]) -> dict[int, Digests]:
    out: dict[int, Digests] = {}
    for step in steps:
        r = look(tree / ROOT, blocks=BLOCKS, step=step).restore
        if r.step == step:
            out[step] = r.digests
    return out


def expected(before: Path, after: Path) -> Expected:
    """The expectations from the trees before and after the operation (no crash)."""
    b, a = see(before), see(after)
    for seen, when in ((b, "before"), (a, "after")):
        found = problems(seen.health) if seen.health else []
        assert not found, f"the state {when} the operation is not healthy: {found}"
    return Expected(
        restored_before=b.health.restore.step if b.health else None,
        before=_digests(before, b.visible),
        after=_digests(after, a.visible),
        invalid_before=b.invalid,
        logs_before=b.logs,
        logs_after=a.logs,
        protected_before=b.protected,
        protected_after=a.protected,
    )


def violations(tree: Path, want: Expected) -> list[str]:
    """What in the state ``tree`` breaks the module's invariants (empty: none). Changes the
    tree (the restart saves into it)."""
    found = _seen_violations(see(tree), want)
    return found + _restart(tree)


def _restart(tree: Path) -> list[str]:
    from resilient import CheckpointManager, CheckpointNotFoundError
    from tests.crash.ops import state

    try:
        with CheckpointManager(tree / ROOT) as m:
            try:
                step, _ = m.restore(blocks=BLOCKS)
            except CheckpointNotFoundError:
                step = 0
            m.save(step + 1, state(step + 1, 0, 1))
    except Exception as exc:
        return [f"the next start failed: {type(exc).__name__}: {exc}"]
    return []


def _seen_violations(seen: Seen, want: Expected) -> list[str]:
    found = _tier_violations(seen, want)
    return found + _root_violations(seen, want)


def _tier_violations(seen: Seen, want: Expected) -> list[str]:
    lost = sorted((want.protected_before & want.protected_after) - seen.protected)
    if not lost:
        return []
    return [
        f"node-local steps without any copy left: {', '.join(f'{n} step {s}' for n, s in lost)}"
    ]


def _root_violations(seen: Seen, want: Expected) -> list[str]:
    if seen.health is None:  # no root: nothing restorable, which is right only if none was
        found = [] if want.restored_before is None else ["the checkpoint root is gone"]
        return found + _log_violations(seen, want)
    if want.restored_before is None and not seen.visible:
        # nothing committed yet: a half-made root may be "not a checkpoint root" to the
        # commands (a clear exit 2), as long as the program can start in it
        clear = all(c.code in (0, 1, 2) and c.traceback is None for c in seen.health.commands)
        if clear and seen.health.restore.traceback is None:
            return _log_violations(seen, want)
    found = problems(seen.health)
    bad = sorted(seen.invalid - want.invalid_before)
    if bad:
        verify = seen.health.command("verify").stdout
        lines = [ln for ln in verify.splitlines() if "INVALID" in ln]
        found.append(f"visible but invalid: {'; '.join(lines)[:300]}")
    restored = seen.health.restore
    status = seen.health.command("status", "--json")
    # (status's quick check sees sizes, not a flipped bit: not where the setup flipped one)
    if status.code == 0 and restored.traceback is None and not want.invalid_before:
        try:
            latest = json.loads(status.stdout).get("latest_step")
        except ValueError:
            latest = "unreadable"
        if latest != restored.step:
            found.append(f"status says the latest step is {latest}, the restore {restored.step}")
    if want.restored_before is not None and (
        restored.step is None or restored.step < want.restored_before
    ):
        why = f" ({restored.error_type}: {restored.error})" if restored.error else ""
        found.append(
            f"restored {restored.step}, older than step {want.restored_before} (committed "
            f"before the operation){why}"
        )
    if restored.step is not None:
        allowed = [d for d in (want.before.get(restored.step), want.after.get(restored.step)) if d]
        if dict(restored.digests) not in [dict(d) for d in allowed]:
            found.append(f"restored step {restored.step}: not what it held before or after")
    lost = sorted((set(want.before) & set(want.after)) - set(seen.visible))
    if lost:
        found.append(f"steps {lost} lost: visible before and after the operation")
    return found + _log_violations(seen, want)


def _log_violations(seen: Seen, want: Expected) -> list[str]:
    found = []
    for name in sorted({*want.logs_before, *want.logs_after}):
        got = seen.logs.get(name, [])
        before = want.logs_before.get(name, [])
        after = want.logs_after.get(name, [])
        if got[: len(before)] != before:
            found.append(f"{name}: records written before the operation lost or changed")
        elif got != after[: len(got)]:
            found.append(f"{name}: records that the operation did not write")
    return found
