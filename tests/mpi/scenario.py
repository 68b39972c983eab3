"""Checkpoint scenarios run under ``mpiexec -n N``; driven by tests/test_mpi_core.py.

Usage: python tests/mpi/scenario.py SCENARIO ROOT COMM [ARG]

COMM is one of self, node, world, split (``COMM_WORLD.Split(rank // 2)``). Each rank prints
``RESULT <json>`` on success; any failure raises (mpiexec then exits non-zero).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import resilient
from resilient import KeepLast

world = MPI.COMM_WORLD
rank, size = world.rank, world.size
# SCENARIO_ASYNC=1: the saves of roundtrip, kill and fail are asynchronous (blocking=False),
# committed by the following wait() (or save, restore, close)
BLOCKING = os.environ.get("SCENARIO_ASYNC") != "1"
# SCENARIO_SHARD_RANKS=K: every manager writes a sharded manifest of shards of K ranks (whole
# file groups), whenever the set has more than K ranks
SHARD_RANKS = int(os.environ.get("SCENARIO_SHARD_RANKS", "0"))
CheckpointManager = (
    functools.partial(resilient.CheckpointManager, manifest_shard_ranks=SHARD_RANKS)
    if SHARD_RANKS
    else resilient.CheckpointManager
)


def checkpoint_comm(kind: str) -> Any:
    if kind == "split":
        return world.Split(rank // 2, rank)
    return kind


def make_state(step: int, r: int = rank) -> dict[str, Any]:
    rng = np.random.default_rng(1000 * r + step)
    return {
        "T": rng.standard_normal((r * 50 + 7, 3)),
        # > 1 MiB and not a multiple of the page size: the O_DIRECT path with unaligned tail
        "big": rng.standard_normal(140_001 + 513 * r),
        "idx": np.arange(r + 1, dtype=np.int32) * step,
        "flags": rng.integers(0, 2, size=(4,)).astype(bool),
        "empty": np.zeros((0, 2) if r % 2 == 0 else (5, 2), dtype=np.float32),
        "c": np.complex128(step + 1j * r),
        "count": step * 10 + r,
        "meta": {"rank": r, "list": [1, 2.5, "x"], "f": 0.1 + step},
    }


def make_static(r: int = rank, version: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(77 + r + 1000 * version)
    return {"mesh": rng.standard_normal((r + 2, 2)), "coeff": float(r) + version}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        g = got[k]
        if isinstance(v, (np.ndarray, np.generic)):
            v = np.asarray(v)
            assert isinstance(g, np.ndarray), (k, type(g))
            assert g.dtype == v.dtype and g.shape == v.shape, (
                k,
                g.dtype,
                v.dtype,
                g.shape,
                v.shape,
            )
            assert g.tobytes() == v.tobytes(), f"{k} differs"
        else:
            assert g == v and type(g) is type(v), (k, g, v)


def result(**kw: Any) -> None:
    print("RESULT " + json.dumps({"rank": rank, **kw}), flush=True)


def scenario_roundtrip(root: str, kind: str) -> None:
    with CheckpointManager(
        root, comm=world, checkpoint_comm=checkpoint_comm(kind), keep=KeepLast(2)
    ) as m:
        for step in (1, 2, 3):
            m.save(
                step, make_state(step), static=make_static(), metrics={"loss": 1.0 / step},
                blocking=BLOCKING,
            )  # fmt: skip
        m.wait()
        assert m.latest_step() == 3
        static_dirs = os.listdir(os.path.join(root, "static"))
        named = sorted(d for d in static_dirs if not d.startswith("."))
        assert len(named) == 2 and named[1] == f"{named[0]}.copy", static_dirs  # two copies
        # changed static data is written again; the old one is collected once unreferenced
        m.save(4, make_state(4), static=make_static(version=1), blocking=BLOCKING)
        m.save(5, make_state(5), static=make_static(version=1), blocking=BLOCKING)
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    assert steps == ["step_00000004", "step_00000005"], steps
    static_dirs = [d for d in os.listdir(os.path.join(root, "static")) if not d.startswith(".")]
    assert len(static_dirs) == 2, static_dirs  # (the new content's two copies)
    # a new manager (a new job) restores bit-identically
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        step, state = m.restore()
        assert step == 5
        assert_same(state, {**make_state(5), **make_static(version=1)})
        check_part(m)
        step, state = m.restore(step=4)
        assert step == 4
        assert_same(state, {**make_state(4), **make_static(version=1)})
    # the files are ordinary HDF5 files
    if rank == 0:
        import h5py

        ckpt = os.path.join(root, "step_00000005")
        with open(os.path.join(ckpt, "manifest.json")) as fh:
            manifest = json.load(fh)
        entries = rank_entries(ckpt, manifest)
        for r in range(size):
            fname = entries[r]["file"]
            with h5py.File(os.path.join(ckpt, fname), "r") as f:
                g = f[f"rank_{r:05d}"]
                assert int(g.attrs["rank"]) == r and manifest["step"] == 5
                want = make_state(5, r)
                assert g["T"][()].tobytes() == want["T"].tobytes()
                assert g["idx"][()].tobytes() == want["idx"].tobytes()
    result(ok=True)


def rank_entries(ckpt: str, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every rank's entry of a manifest as JSON: its own, or its shards' (schema 3)."""
    if manifest["schema_version"] < 3:
        return dict(enumerate(manifest["ranks"]))
    assert "ranks" not in manifest and SHARD_RANKS and size > SHARD_RANKS
    entries: dict[int, dict[str, Any]] = {}
    for shard in manifest["shards"]:
        with open(os.path.join(ckpt, shard["name"])) as fh:
            doc = json.load(fh)
        entries.update(zip(doc["ranks"], doc["entries"], strict=True))
    assert sorted(entries) == list(range(size))
    return entries


def scenario_save(root: str, kind: str, steps: str) -> None:
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        for step in map(int, steps.split(",")):
            m.save(step, make_state(step), static=make_static())
    result(ok=True)


def scenario_restore(root: str, kind: str, expect: str) -> None:
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        try:
            step, state = m.restore()
        except resilient.ResilientError as exc:
            result(error=type(exc).__name__, message=str(exc))
            return
        assert step == int(expect), (step, expect)
        assert_same(state, {**make_state(step), **make_static()})
    result(ok=True, step=step)


def scenario_resave(root: str, kind: str) -> None:
    """A restart: restore, then save again with the restored file's skeleton (a file shared by
    several ranks: its leader holds the group's entries, the others only their own), with
    rotation writing over dropped checkpoints' files; then the newest restores."""
    comm = checkpoint_comm(kind)
    with CheckpointManager(root, comm=world, checkpoint_comm=comm, keep=KeepLast(1)) as m:
        m.save(1, make_state(1), static=make_static())
    for restart in range(2):
        with CheckpointManager(root, comm=world, checkpoint_comm=comm, keep=KeepLast(1)) as m:
            step, state = m.restore()
            assert step == 1 + 2 * restart, step
            assert_same(state, {**make_state(step), **make_static()})
            for nxt in (step + 1, step + 2):
                m.save(nxt, make_state(nxt), static=make_static())
    with CheckpointManager(root, comm=world, checkpoint_comm=comm) as m:
        step, state = m.restore()
        assert step == 5, step
        assert_same(state, {**make_state(5), **make_static()})
    result(ok=True, step=step)


def scenario_kill(root: str, kind: str, where: str) -> None:
    """Save step 1 cleanly, then die (SIGKILL) at ``where`` during the save of step 2."""
    phase, _, victim = where.partition("@")
    victims = range(size) if victim in ("", "all") else [int(victim)]
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        m.save(1, make_state(1), static=make_static())
        if rank in victims:
            _arm_kill(phase)
        m.save(2, make_state(2), static=make_static(), blocking=BLOCKING)
        m.wait()
    result(ok=True, survived=True)


def _die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_kill(phase: str) -> None:
    from resilient.io import fileio
    from resilient.io.commit import PendingDir

    if phase == "write":  # half-way through writing this rank's bytes
        real = os.pwrite

        def pwrite(fd: int, data: Any, offset: int) -> int:
            real(fd, memoryview(data)[: max(1, len(data) // 2)], offset)
            _die()
            return 0

        def pwritev(fd: int, buffers: Any, offset: int) -> int:
            return pwrite(fd, buffers[0], offset)

        fileio.os.pwrite = pwrite  # type: ignore[attr-defined]
        fileio.os.pwritev = pwritev  # type: ignore[attr-defined]
    elif phase == "manifest":  # coordinator dies before writing the manifest
        PendingDir.prepare = _die  # type: ignore[method-assign]
    elif phase == "rename":  # manifest and marker written, not yet renamed
        PendingDir._publish = _die  # type: ignore[method-assign]
    elif phase == "after-rename":  # committed, before rotation and the final barrier
        real_publish = PendingDir._publish

        def publish_then_die(self: PendingDir) -> None:
            real_publish(self)
            _die()

        PendingDir._publish = publish_then_die  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown phase {phase}")


def scenario_fail(root: str, kind: str, how: str) -> None:
    """One rank fails inside save(); every rank must raise the same error; step 1 survives."""
    victim = size - 1
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        m.save(1, make_state(1))
        state = make_state(2)
        if rank == victim:
            if how == "enospc":
                from resilient.io import fileio

                def full(*_: Any) -> int:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                fileio.os.pwrite = full  # type: ignore[attr-defined]
                fileio.os.pwritev = full  # type: ignore[attr-defined]
            elif how == "badvalue":
                state["bad"] = object()
            elif how == "badstep":
                pass
        step = 3 if (how == "badstep" and rank == victim) else 2
        try:
            m.save(step, state, blocking=BLOCKING)
            m.wait()
        except resilient.ResilientError as exc:
            err = (type(exc).__name__, str(exc))
        else:
            err = ("none", "")
        errors = world.allgather(err)
        assert len(set(errors)) == 1, errors
        assert errors[0][0] in ("CollectiveError", "ConfigError"), errors[0]
        if how == "enospc":
            assert "No space left on device" in errors[0][1], errors[0]
        leftovers = [d for d in os.listdir(root) if d.startswith(".step_")]
        assert leftovers == [], leftovers
        step, got = m.restore()
        assert step == 1
        assert_same(got, make_state(1))
    result(ok=True, error=errors[0][0], message=errors[0][1])


def check_part(m: resilient.CheckpointManager) -> None:
    """A restore gave this rank its part of the manifest: its own entry, and its file group's
    for the group's leader; only the files they name; this run's layout put back."""
    restored = m._restorer.last_restored
    assert restored is not None
    part = restored[1]
    assert part.is_part and len(part.ranks) == size
    group = next(g for g in part.layout.groups if rank in g)
    assert {f.name for f in part.files} == {part.ranks[rank].file}
    assert part.layout == m.layout
    sharded = part.sharded
    if sharded is not None:  # its own shard only (a shard holds whole file groups)
        assert SHARD_RANKS and len(sharded.shards) == 1, sharded
        holds = {r for f in sharded.shards[0].files for r in m.layout.groups[_file_index(f)]}
        assert set(group) <= holds and len(holds) < size, (holds, group)
        mine = {r for f in part.files for r in f.ranks}  # its file group's entries only loaded
        assert [r for r in range(size) if sharded.loaded(r)] == sorted(mine), mine
        return
    held = part.ranks.held  # type: ignore[attr-defined]
    assert held == (group if group[0] == rank else (rank,)), (held, group)


def _file_index(name: str) -> int:
    """The group index in a data file's name (``rank_00003.h5``, ``group_00001.h5``)."""
    return int(name.split("_")[1].split(".")[0])


def scenario_shards(root: str, kind: str, how: str) -> None:
    """A sharded manifest whose shard is missing, changed or extra, or whose index was edited:
    quick or full validation says so, and a restore falls back to the previous checkpoint,
    quarantining the bad one (every rank alike)."""
    from resilient.io.checkpoints import iter_checkpoints, validate_checkpoint
    from resilient.io.manifests import load_manifest
    from resilient.model import filenames

    assert SHARD_RANKS and size > SHARD_RANKS
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        for step in (1, 2):
            m.save(step, make_state(step), static=make_static())
    ckpt = os.path.join(root, filenames.step_dir_name(2))
    found: dict[str, str] = {}
    if rank == 0:
        shard = os.path.join(ckpt, filenames.shard_name(1))
        with open(shard, "rb") as fh:
            text = fh.read()
        if how == "missing":
            os.unlink(shard)
        elif how == "changed":  # one hex digit of a checksum: still a well-formed shard
            at = text.index(b'"checksums":"') + len(b'"checksums":"')
            digit = b"0" if text[at : at + 1] != b"0" else b"1"
            with open(shard, "r+b") as fh:
                fh.seek(at)
                fh.write(digit)
        elif how == "extra":
            with open(os.path.join(ckpt, filenames.shard_name(7)), "wb") as fh:
                fh.write(text)
        elif how == "index":  # a shard's size edited in the index
            index = os.path.join(ckpt, filenames.MANIFEST)
            with open(index) as fh:
                doc = json.load(fh)
            doc["shards"][1]["size"] += 1
            with open(index, "w") as fh:
                json.dump(doc, fh, separators=(",", ":"))
        elif how in ("data", "static", "static-both"):  # rank 1's data file cut short (its
            # static data's: in one copy, or in both)
            wheres = [ckpt]
            if how != "data":
                static = str(load_manifest(Path(ckpt)).static)
                names = [filenames.static_dir_name(static), filenames.static_copy_dir_name(static)]
                wheres = [os.path.join(root, filenames.STATIC_DIR, n) for n in names]
                wheres = wheres[:1] if how == "static" else wheres
            for where in wheres:
                os.truncate(os.path.join(where, filenames.file_name(kind, 1)), 10)
        else:
            raise ValueError(how)
        for full in (False, True):
            try:
                validate_checkpoint(Path(ckpt), full=full)
                found["full" if full else "quick"] = "valid"
            except resilient.InvalidCheckpointError as exc:
                found["full" if full else "quick"] = exc.reason
    world.barrier()
    restored: int | None = None
    with CheckpointManager(root, comm=world, checkpoint_comm=checkpoint_comm(kind)) as m:
        if how == "static-both":  # both steps share it: neither is restored, on any rank,
            try:  # and neither is quarantined (their own files are intact)
                m.restore()
            except resilient.StaticDataError as exc:
                found["error"] = str(exc)
        elif how == "static":  # read from the other copy (and repaired): nothing lost
            restored, state = m.restore()
            assert restored == 2, restored
            assert_same(state, {**make_state(2), **make_static()})
        else:
            restored, state = m.restore()
            assert restored == 1, restored
            assert_same(state, {**make_state(1), **make_static()})
    if rank == 0:
        records = list(iter_checkpoints(Path(root), quarantined=True))
        found["quarantined"] = next(
            (r.reason for r in records if r.status == "quarantined"), "(none)"
        )
        valid = [r.step for r in records if r.status == "valid"]
        assert valid == {"static": [2, 1], "static-both": []}.get(how, [1]), valid
    result(ok=True, step=restored, **found)


def scenario_scatter(root: str, kind: str) -> None:
    """Collective.scatter: each rank gets its own value; a failing coordinator raises the same
    error on every rank."""
    from resilient.parallel.collective import Collective
    from resilient.parallel.comm import as_comm

    coll = Collective(as_comm(world))
    got = coll.scatter("scattering", lambda: [f"for {r}" for r in range(size)])

    def refuse() -> list[str]:
        raise ValueError("no")

    errors = []
    for fn in (refuse, lambda: ["too few"] * (size + 1)):
        try:
            coll.scatter("refusing", fn)
        except resilient.ResilientError as exc:
            errors.append([type(exc).__name__, str(exc)])
    result(ok=True, got=got, errors=errors)


def scenario_reply(root: str, kind: str) -> None:
    """Collective.gather then announce(everywhere=False): the answer stays on the coordinator
    (the others get None); a failing answer still raises the same error on every rank."""
    from resilient.parallel.collective import Collective
    from resilient.parallel.comm import as_comm

    coll = Collective(as_comm(world))

    def summed(what: str, *, everywhere: bool) -> int:
        gathered = coll.gather(coll.rank + 1)
        return coll.announce(
            what, None if gathered is None else sum(gathered.values()), everywhere=everywhere
        )

    got = summed("summing", everywhere=False)
    everywhere = summed("summing", everywhere=True)
    coll.gather(1)
    try:
        coll.announce(
            "refusing", ValueError("no") if coll.is_coordinator else None, everywhere=False
        )
    except resilient.ResilientError as exc:
        error = [type(exc).__name__, str(exc)]
    result(ok=True, got=got, everywhere=everywhere, size=coll.comm.size, error=error)


class CountingComm:
    """A communicator that counts every raw collective call of itself and of the
    communicators split from it (one shared tally)."""

    COUNTED = ("allgather", "gather", "bcast", "scatter", "barrier", "any_true")

    def __init__(self, inner: Any, calls: list[str] | None = None) -> None:
        self.inner = inner
        self.calls: list[str] = [] if calls is None else calls

    @property
    def rank(self) -> int:
        return int(self.inner.rank)

    @property
    def size(self) -> int:
        return int(self.inner.size)

    def allgather(self, obj: Any) -> Any:
        self.calls.append("allgather")
        return self.inner.allgather(obj)

    def gather(self, obj: Any, root: int = 0) -> Any:
        self.calls.append("gather")
        return self.inner.gather(obj, root)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.calls.append("bcast")
        return self.inner.bcast(obj, root)

    def scatter(self, objs: Any, root: int = 0) -> Any:
        self.calls.append("scatter")
        return self.inner.scatter(objs, root)

    def barrier(self) -> None:
        self.calls.append("barrier")
        self.inner.barrier()

    def any_true(self, flag: bool) -> bool:
        self.calls.append("any_true")
        return bool(self.inner.any_true(flag))

    def split_node(self) -> CountingComm:
        return CountingComm(self.inner.split_node(), self.calls)

    def split(self, color: int) -> CountingComm:
        return CountingComm(self.inner.split(color), self.calls)

    def channel(self) -> Any:
        return self.inner.channel()


def scenario_rounds(root: str, kind: str, tier: str) -> None:
    """Count the raw collective calls (on the save's communicator and every one split from it)
    of blocking saves with an unchanged structure and unchanged static data, after a first
    save, and of the first save after a restart (restored, then saved with the restored
    file's skeleton); ``tier="local"``: with a node-local tier (no partner copies, no flush);
    ``"local-sharded"``: the same with a manifest shard per rank; with SCENARIO_SHARD_RANKS,
    a sharded manifest on the shared root."""
    from resilient.parallel.mpi import MPIComm

    counting = CountingComm(MPIComm(world))
    group: Any = kind
    if kind == "split":
        group = CountingComm(MPIComm(world.Split(rank // 2, rank)), counting.calls)
    local = str(Path(root) / "local") if tier.startswith("local") else None
    shard_ranks = 1 if tier == "local-sharded" else (SHARD_RANKS or None)
    per_save = []
    for steps in ((1, 2, 3, 4), (6,)):  # then a restart: restore, save (the skeleton reused)
        with CheckpointManager(
            Path(root) / "shared", comm=counting, checkpoint_comm=group, keep=KeepLast(2),
            local_dir=local, flush_every=1000, manifest_shard_ranks=shard_ranks,
        ) as m:  # fmt: skip
            if steps[0] > 1:
                assert m.restore()[0] == 4
            for step in steps:
                del counting.calls[:]
                m.save(step, make_state(1), static=make_static(), metrics={"loss": 1.0 / step})
                per_save.append(list(counting.calls))
    result(ok=True, calls=per_save)


def main() -> None:
    scenario, root, kind = sys.argv[1:4]
    arg = sys.argv[4] if len(sys.argv) > 4 else ""
    fn = globals()[f"scenario_{scenario}"]
    fn(root, kind, arg) if arg else fn(root, kind)


if __name__ == "__main__":
    main()
