"""CheckpointManager: steps, policies, fallback and rotation on top of :mod:`checkpointer`."""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from resilient import layout, storage
from resilient._version import __version__
from resilient.checkpointer import LocalData, Topology, read_rank, split_state, write_set
from resilient.checksum import hash128
from resilient.comm import Comm, SerialComm, agree, as_comm, describe_error
from resilient.errors import (
    CheckpointNotFoundError,
    ConfigError,
    InvalidCheckpointError,
    LayoutMismatchError,
    ResilientError,
)
from resilient.manifest import LayoutInfo, ManifestError, parse_manifest
from resilient.policies import CheckpointInfo, KeepPolicyLike, SaveContext, SavePolicyLike
from resilient.rotation import plan_rotation
from resilient.validate import (
    list_checkpoints,
    load_manifest,
    validate_checkpoint,
)

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

StateValidator = Callable[[Mapping[str, Any]], bool]


class CheckpointManager:
    """Save and restore per-rank state as checkpoints under ``root``.

    Construction, :meth:`save`, :meth:`restore`, :meth:`latest_step`, :meth:`should_save` and
    :meth:`close` are collective over ``comm``: call them on all ranks, in the same order.

    Args:
        root: the checkpoint root directory (created if needed; shared by all ranks).
        comm: the ranks of this checkpoint set: an mpi4py communicator, a
            :class:`resilient.comm.Comm`, or ``None`` for one process. Rank 0 coordinates.
        checkpoint_comm: which ranks share a file: ``"self"`` (one file per rank), ``"node"``
            (one per node), ``"world"`` (one for all), or any sub-communicator of ``comm``
            (one file per group of it).
        keep: keep policy applied after every commit (``None`` keeps everything).
        save_when: save policy behind :meth:`should_save` (``None``: never by policy).
        gc_every: run ``gc.collect()`` after every ``gc_every`` saves (long runs grow otherwise).
        clock: monotonic clock, injectable for tests.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        comm: Any = None,
        checkpoint_comm: Any = "self",
        keep: KeepPolicyLike | None = None,
        save_when: SavePolicyLike | None = None,
        gc_every: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.comm: Comm = as_comm(comm)
        self.keep = keep
        self.save_when = save_when
        self.gc_every = gc_every
        self._clock = clock
        self._lock = storage.RootLock(self.root)
        self._deleter = storage.BackgroundDeleter()
        self._closed = False
        self._saves = 0
        self._last_saved_step: int | None = None
        self._last_saved_time: float | None = clock()
        self.save_cost_s: float | None = None
        if gc_every is not None and (not isinstance(gc_every, int) or gc_every < 1):
            raise ConfigError(f"gc_every must be a positive integer or None, got {gc_every!r}")
        self.topology = _make_topology(self.comm, checkpoint_comm)
        error: BaseException | None = None
        if self.comm.rank == 0:
            try:
                storage.ensure_root(self.root)
                self._lock.acquire()
                storage.cleanup_leftovers(self.root)
            except (ResilientError, OSError) as exc:
                self._lock.release()
                error = exc
        outcome = self.comm.bcast(error, root=0)
        if outcome is not None:
            raise outcome

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Collective: release the root's lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._deleter.wait()
        self.comm.barrier()
        self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:  # other ranks may be elsewhere: no collective on the error path
            self._closed = True
            self._deleter.wait()
            self._lock.release()

    @property
    def layout(self) -> LayoutInfo:
        """The layout this manager writes."""
        return self.topology.layout_info

    # ------------------------------------------------------------------ queries

    def latest_step(self) -> int | None:
        """Collective: the step of the newest checkpoint that passes quick validation."""
        step = None
        if self.comm.rank == 0:
            step = _newest_valid_step(self.root)
        return self.comm.bcast(step, root=0)

    def should_save(
        self, step: int, *, time_left_s: float | None = None, stop_requested: bool = False
    ) -> bool:
        """Collective: whether ``save_when`` asks for a save at ``step`` (rank 0 decides).

        Cheap enough to call every step: one small allreduce (ranks arrive together here, so
        no sleeping barrier), not a broadcast behind a barrier.
        """
        decision = False
        if self.comm.rank == 0 and self.save_when is not None:
            ctx = self.save_context(step, time_left_s=time_left_s, stop_requested=stop_requested)
            decision = bool(self.save_when(ctx))
        return self.comm.any_true(decision)  # only rank 0's vote can be true

    def save_context(
        self, step: int, *, time_left_s: float | None = None, stop_requested: bool = False
    ) -> SaveContext:
        """The :class:`SaveContext` a save policy sees at ``step`` (local, no communication)."""
        return SaveContext(
            step=step,
            now=self._clock(),
            last_saved_step=self._last_saved_step,
            last_saved_time=self._last_saved_time,
            time_left_s=time_left_s,
            stop_requested=stop_requested,
            save_cost_s=self.save_cost_s,
        )

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        static: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Path:
        """Collective over ``comm``: write and commit a checkpoint of ``step``.

        Args:
            step: a non-negative integer, the same on every rank.
            state: this rank's piece: names -> numpy arrays or small JSON values.
            static: data that does not change between steps; stored once by content hash and
                shared by later checkpoints (rewritten only when it changes).
            metrics: JSON values describing the checkpoint (rank 0's are kept), e.g. a loss
                for :class:`~resilient.policies.KeepBest`.

        Returns:
            The committed checkpoint directory.

        Raises:
            CollectiveError: some rank failed; raised on every rank, earlier checkpoints intact.
        """
        self._check_open()
        start = self._clock()
        what = f"save of step {step}"
        error: BaseException | None = None
        data = static_data = LocalData({}, {})
        try:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ConfigError(f"step must be a non-negative int, got {step!r}")
            data = split_state(state)
            static_data = split_state(static, what="static")
            if metrics is not None:
                try:
                    json.dumps(dict(metrics), allow_nan=True)
                except (TypeError, ValueError):
                    raise ConfigError("metrics must be a mapping of JSON values") from None
            clash = set(data.arrays) | set(data.values)
            clash &= set(static_data.arrays) | set(static_data.values)
            if clash:
                raise ConfigError(f"names in both state and static: {sorted(clash)}")
        except Exception as exc:
            error = exc
        steps = self.comm.allgather(step if error is None else None)
        known = {s for s in steps if s is not None}
        if error is None and len(known) > 1:
            error = ConfigError(f"ranks disagree on the step: {sorted(known)}")
        agree(self.comm, what, error)

        static_hash = self._save_static(step, static is not None, static_data)

        tmp = self._make_tmp(step)
        manifest = write_set(
            self.topology,
            tmp,
            self.root / layout.step_dir_name(step),
            step=step,
            data=data,
            local_error=None,
            static=static_hash,
            metrics=metrics,
            library_version=__version__,
        )
        if self.comm.rank == 0:
            storage.append_log(
                self.root / layout.SAVE_LOG,
                {"step": step, "time": time.time(), "cost_s": round(self._clock() - start, 6),
                 "bytes": manifest.nbytes, "metrics": dict(metrics or {})},
            )  # fmt: skip
            self._rotate()
        self.comm.barrier()
        self._saves += 1
        self._last_saved_step = step
        end = self._clock()
        self._last_saved_time = end
        cost = end - start
        self.save_cost_s = cost if self.save_cost_s is None else 0.5 * (self.save_cost_s + cost)
        if self.gc_every and self._saves % self.gc_every == 0:
            gc.collect()
        return self.root / layout.step_dir_name(step)

    def _make_tmp(self, step: int, *, static: bool = False) -> Path:
        """Collective: rank 0 creates a temporary directory and tells everyone its path."""
        reply: tuple[Path | None, BaseException | None] = (None, None)
        if self.comm.rank == 0:
            try:
                token = storage.new_token()
                if static:
                    parent = self.root / layout.STATIC_DIR
                    parent.mkdir(exist_ok=True)
                    tmp = parent / f".tmp-{token}"
                else:
                    tmp = self.root / layout.tmp_dir_name(step, token)
                tmp.mkdir()
                reply = (tmp, None)
            except OSError as exc:
                reply = (None, exc)
        path, error = self.comm.bcast(reply, root=0)
        if error is not None:
            raise ResilientError(
                f"cannot create a temporary directory in {self.root}: {describe_error(error)}"
            )
        assert path is not None
        return path

    def _save_static(self, step: int, given: bool, data: LocalData) -> str | None:
        """Collective: content-hash the static data; write it only if not stored yet."""
        desc = self.comm.allgather(data.describe() if given else None)
        if all(d is None for d in desc):
            return None
        content = hash128(
            json.dumps([self.topology.layout_info.kind, len(desc), desc], sort_keys=True)
        )
        final = self.root / layout.STATIC_DIR / layout.static_dir_name(content)
        exists = False
        if self.comm.rank == 0:
            try:
                validate_checkpoint(final, kind="static")
                exists = True
            except InvalidCheckpointError:
                exists = False
        if self.comm.bcast(exists, root=0):
            return content
        tmp = self._make_tmp(step, static=True)
        write_set(
            self.topology,
            tmp,
            final,
            step=step,
            data=data,
            local_error=None,
            kind="static",
            library_version=__version__,
        )
        return content

    def _rotate(self) -> None:
        """Rank 0 only: apply the keep policy, then drop unreferenced static data.

        Renames are synchronous (a deleted checkpoint stops counting at once); the unlinking
        runs on a background thread.
        """
        try:
            records = list_checkpoints(self.root)
            valid = [r for r in records if r.status == "valid" and r.manifest is not None]
            infos = [
                CheckpointInfo(step=r.step, time=r.manifest.time, metrics=r.manifest.metrics)
                for r in valid
                if r.manifest is not None
            ]
            plan = plan_rotation(infos, self.keep)
            trash = []
            for r in valid:
                if r.step in plan.delete:
                    trash.append(storage.move_to_trash(r.path))
                    log.info("rotation deleted checkpoint of step %d", r.step)
            trash += _collect_static(self.root)
            self._deleter.delete(trash)
        except (OSError, ResilientError) as exc:
            log.warning("rotation in %s failed (checkpoints are intact): %s", self.root, exc)

    # ------------------------------------------------------------------ restore

    def restore(
        self, step: int | None = None, *, validate: StateValidator | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Collective over ``comm``: load the newest valid checkpoint (or ``step``'s).

        Each rank reads its own piece (and its static data, merged into the state) and checks
        every array's checksum. A checkpoint that fails on any rank, or whose state
        ``validate`` rejects on any rank, is quarantined and the next older one is tried.

        Returns:
            ``(step, state)`` for this rank.

        Raises:
            CheckpointNotFoundError: no valid checkpoint (or ``step`` is not valid).
            LayoutMismatchError: the newest checkpoint has another layout or rank count.
        """
        self._check_open()
        tried: set[str] = set()
        while True:
            choice = self._choose(step, tried)
            if isinstance(choice, BaseException):
                raise choice
            path, manifest_text, static_text = choice
            tried.add(path.name)
            reason: str | None = None
            state: dict[str, Any] = {}
            try:
                manifest = parse_manifest(manifest_text)
                state = read_rank(path, manifest, self.comm.rank)
                if static_text is not None:
                    static_manifest = parse_manifest(static_text)
                    static_dir = self.root / layout.STATIC_DIR / str(manifest.static)
                    state.update(read_rank(static_dir, static_manifest, self.comm.rank))
                if validate is not None and not validate(state):
                    reason = f"state rejected by the application's validate hook on rank {self.comm.rank}"
            except InvalidCheckpointError as exc:
                reason = exc.reason
            except (OSError, ManifestError, ValueError) as exc:
                reason = describe_error(exc)
            except Exception as exc:  # a validate hook that raised counts as a rejection
                reason = f"validate hook raised {describe_error(exc)}"
            reasons = self.comm.gather(reason, root=0)
            verdict = "ok"
            if self.comm.rank == 0:
                assert reasons is not None
                bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
                if bad:
                    verdict = "retry"
                    why = "; ".join(f"rank {r}: {w}" for r, w in bad[:4])
                    try:
                        storage.quarantine(path, manifest_step(path), why)
                    except OSError as exc:
                        log.warning("could not quarantine %s: %s", path, exc)
            if self.comm.bcast(verdict, root=0) == "ok":
                restored = manifest_step(path)
                self._last_saved_step = restored
                return restored, state
            if step is not None:
                raise CheckpointNotFoundError(
                    f"checkpoint of step {step} in {self.root} failed validation"
                )

    def _choose(
        self, step: int | None, tried: set[str]
    ) -> tuple[Path, str, str | None] | BaseException:
        """Collective: rank 0 picks the next candidate; everyone gets it (or the error)."""
        result: tuple[Path, str, str | None] | BaseException = CheckpointNotFoundError(
            f"no valid checkpoint in {self.root}"
        )
        if self.comm.rank == 0:
            try:
                result = self._pick_candidate(step, tried)
            except (ResilientError, OSError) as exc:
                result = exc
        return self.comm.bcast(result, root=0)

    def _pick_candidate(self, step: int | None, tried: set[str]) -> tuple[Path, str, str | None]:
        current = self.topology.layout_info
        names = sorted(
            (n for n in os.listdir(self.root) if layout.parse_step_dir(n) is not None), reverse=True
        )
        if step is not None:
            names = [layout.step_dir_name(step)] if layout.step_dir_name(step) in names else []
        for name in names:
            if name in tried:
                continue
            path = self.root / name
            try:
                manifest = validate_checkpoint(path)
            except InvalidCheckpointError as exc:
                storage.quarantine(path, manifest_step(path), exc.reason)
                continue
            saved = manifest.layout
            if saved.nranks != current.nranks or saved.kind != current.kind:
                raise LayoutMismatchError(saved.describe(), current.describe())
            text = (path / layout.MANIFEST).read_text()
            static_text = None
            if manifest.static is not None:
                static_text = (
                    self.root / layout.STATIC_DIR / manifest.static / layout.MANIFEST
                ).read_text()
            return path, text, static_text
        if step is not None:
            raise CheckpointNotFoundError(f"no valid checkpoint of step {step} in {self.root}")
        raise CheckpointNotFoundError(f"no valid checkpoint in {self.root}")

    def _check_open(self) -> None:
        if self._closed:
            raise ResilientError("this CheckpointManager is closed")


def manifest_step(path: Path) -> int:
    """The step encoded in a checkpoint directory's name."""
    step = layout.parse_step_dir(path.name)
    return -1 if step is None else step


def _newest_valid_step(root: Path) -> int | None:
    try:
        names = sorted(
            (n for n in os.listdir(root) if layout.parse_step_dir(n) is not None), reverse=True
        )
    except FileNotFoundError:
        return None
    for name in names:
        try:
            validate_checkpoint(root / name)
        except InvalidCheckpointError:
            continue
        return layout.parse_step_dir(name)
    return None


def _collect_static(root: Path) -> list[Path]:
    """Trash static-data directories that no checkpoint (valid or quarantined) references."""
    static_root = root / layout.STATIC_DIR
    if not static_root.is_dir() or static_root.is_symlink():
        return []
    referenced: set[str] = set()
    for name in os.listdir(root):
        if layout.parse_step_dir(name) is None and layout.parse_quarantined(name) is None:
            continue
        try:
            m = load_manifest(root / name)
        except InvalidCheckpointError:
            if layout.parse_quarantined(name) is not None:
                return []  # cannot tell what a broken quarantined checkpoint uses: keep everything
            continue
        if m.static:
            referenced.add(m.static)
    trash = []
    for name in os.listdir(static_root):
        if layout.is_static_dir(name) and name not in referenced:
            trash.append(storage.move_to_trash(static_root / name))
            log.info("deleted unreferenced static data %s", name)
    return trash


def _make_topology(comm: Comm, checkpoint_comm: Any) -> Topology:
    """Collective: resolve ``checkpoint_comm`` into the groups of ranks sharing a file."""
    error: BaseException | None = None
    group: Comm = SerialComm()
    kind = "custom"
    try:
        if isinstance(checkpoint_comm, str):
            if checkpoint_comm == "self":
                kind, group = "self", SerialComm()
            elif checkpoint_comm == "node":
                kind, group = "node", comm.split_node()
            elif checkpoint_comm == "world":
                kind, group = "world", comm
            else:
                raise ConfigError(
                    f"checkpoint_comm must be 'self', 'node', 'world' or a communicator, got {checkpoint_comm!r}"
                )
        else:
            group = as_comm(checkpoint_comm)
    except (ConfigError, TypeError) as exc:
        error = exc
    agree(comm, "checkpoint_comm setup", error)
    members = tuple(group.allgather(comm.rank))
    everyone = comm.allgather(members)
    groups = sorted(set(everyone), key=min)
    seen = [r for g in groups for r in g]
    if sorted(seen) != list(range(comm.size)) or len(members) != group.size:
        raise ConfigError(
            "checkpoint_comm does not partition comm: every rank must be in exactly one group "
            f"(groups seen: {groups[:8]})"
        )
    return Topology(
        comm=comm, group=group, kind=kind, groups=tuple(groups), group_index=groups.index(members)
    )
