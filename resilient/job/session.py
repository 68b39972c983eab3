"""Session: resilience for an existing MPI time loop in about ten lines.

::

    with resilient.Session(checkpoint_dir, comm=MPI.COMM_WORLD, save_when=EverySteps(100)) as s:
        step, state = s.restore_or(initial_state)
        while step < n_steps and not s.should_stop():
            state = advance(state); step += 1
            s.maybe_save(step, state)
    # stopped early (walltime warning, SIGTERM, deadline): final checkpoint, then exit 75

Every method but :attr:`stopped` is collective over ``comm``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from resilient._renamed import renamed_keyword
from resilient.checkpoint.manager import CheckpointManager
from resilient.checkpoint.redundancy import DEFAULT_SET_SIZE
from resilient.checkpoint.restorer import StateValidator
from resilient.errors import CheckpointNotFoundError, ConfigError, ForeignRunError
from resilient.io.storage import is_permanent_storage_error
from resilient.job import flux, handoff
from resilient.job.exitcodes import EXIT_CONFIG, EXIT_FOREIGN_RUN, EXIT_PERMANENT, EXIT_RESUME
from resilient.job.protocol import (
    ENV_CHECKPOINT_DIR,
    ENV_HANDOFF,
    attempt_number,
    record_stop,
)
from resilient.job.slurm import DEFAULT_STOP_SIGNALS, StopSignals, find_deadline, job_of
from resilient.job.timeline import Timeline
from resilient.model.arrays import template_spec
from resilient.model.blocks import unwrap
from resilient.model.payload import split_template
from resilient.model.policies import BeforeWalltime, KeepPolicyLike, SavePolicyLike
from resilient.parallel.collective import Collective
from resilient.parallel.comm import as_comm

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session:
    """A checkpoint manager plus walltime and signal awareness for one run of a program.

    Args:
        checkpoint_dir: the checkpoint directory; default ``$RESILIENT_CHECKPOINT_DIR`` (set by
            ``resilient run``); ``ckpt_dir`` is its deprecated alias.
            Under ``resilient run`` rank 0 tells it which directory that is
            (:mod:`resilient.job.handoff`), so progress is judged there; with neither, under
            ``resilient run`` rank 0 says so in one line and every rank exits 78, elsewhere a
            :class:`~resilient.errors.ConfigError`.
        comm: mpi4py communicator or torch.distributed process group (or ``None`` for one
            process).
        checkpoint_comm: ``"self"``, ``"node"``, ``"world"`` or a sub-communicator.
        save_when: save policy (e.g. ``EverySteps(100) | EverySeconds(1800)``).
        keep: keep policy (e.g. ``KeepLast(3)``).
        margin_s: stop when less than this (plus the measured save cost) is left before the
            deadline: the rule of :class:`~resilient.model.policies.BeforeWalltime` (the one setting
            for the deadline; ``walltime_margin_s`` in the YAML). If less than the margin is
            left at the start, half the time left is used instead (with a warning), so that a
            short run still makes and saves progress.
        signals: signals that request a stop (a flag only; acted upon at the next step), or a
            :class:`StopSignals` the program installed early (before its slow imports: a
            warning signal that arrives before any handler is installed kills the process).
            In a Flux job (``$FLUX_JOB_ID``) ``SIGALRM``, Flux's time limit, is added to the
            names: it means SIGKILL in 5 s, so the step is saved only if saves took under
            2 s, else the run exits 75 with its newest checkpoint (:mod:`resilient.job.flux`);
            a :class:`StopSignals` given here should name it too.
        validate: ``callable(state) -> bool`` run after a restore; a rejected checkpoint is
            quarantined and the next older one tried.
        exit_on_stop: on leaving the ``with`` block after a stop, raise ``SystemExit(75)`` if this
            run committed a checkpoint (progress saved: resume me), else ``SystemExit(1)``; on a
            permanent storage error ``SystemExit(74)``; when the checkpoint directory belongs to
            another run (:class:`~resilient.errors.ForeignRunError`: another ``run_key``, or
            restored arrays of another shape) ``SystemExit(78)``, at construction or on leaving
            the block. The code after the ``with`` block does not run in these cases.
        async_save: :meth:`maybe_save` saves with ``blocking=False`` (the program waits only
            for a memory copy; the commit happens at the next save, at the latest when the
            session ends). A stop waits for the save in flight, then writes the final
            checkpoint synchronously.
        local_dir: node-local storage for checkpoints, flushed to ``checkpoint_dir`` every
            ``flush_every`` checkpoints and always at the end of the session (see
            :class:`~resilient.checkpoint.manager.CheckpointManager`); ``local_keep`` per node;
            ``redundancy="partner"``: a copy of each node's local checkpoint on another node;
            ``"xor"``: XOR parity over sets of up to ``xor_set_size`` nodes.
        run_key: the parameters that define the run's result: a later run on the same
            ``checkpoint_dir`` with other values is refused (see
            :class:`~resilient.checkpoint.manager.CheckpointManager`).
        static_copies: copies of the static data's files, 2 or 1 (see
            :class:`~resilient.checkpoint.manager.CheckpointManager`).
        environ: environment to read the deadline from (injectable for tests).
    """

    @renamed_keyword("ckpt_dir", "checkpoint_dir")
    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        comm: Any = None,
        checkpoint_comm: Any = "self",
        save_when: SavePolicyLike | None = None,
        keep: KeepPolicyLike | None = None,
        margin_s: float = 60.0,
        signals: Iterable[str | int] | StopSignals = DEFAULT_STOP_SIGNALS,
        validate: StateValidator | None = None,
        exit_on_stop: bool = True,
        gc_every: int | None = None,
        async_save: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        flush_every: int = 1,
        local_keep: int = 2,
        redundancy: str | None = None,
        xor_set_size: int = DEFAULT_SET_SIZE,
        run_key: Mapping[str, Any] | None = None,
        static_copies: int = 2,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._session_start = time.time()
        env = os.environ if environ is None else environ
        root = checkpoint_dir if checkpoint_dir is not None else env.get(ENV_CHECKPOINT_DIR)
        self._attempt = attempt_number(env)
        told = env.get(ENV_HANDOFF, "").strip()
        self._handoff = Path(told) if told else None  # under `resilient run`: tell it the root
        if not root:
            self._no_directory(comm, exit_on_stop=exit_on_stop)
        self.root = Path(str(root))
        self.validate = validate
        self.margin_s = float(margin_s)
        self._stop_before_deadline = BeforeWalltime(margin_s=self.margin_s)
        self.exit_on_stop = exit_on_stop
        self.async_save = bool(async_save)
        self._clock = clock
        self._time_limit = frozenset(flux.time_limit_signals(env))
        if not isinstance(signals, StopSignals):
            signals = StopSignals((*signals, *self._time_limit))
        self._signals = signals
        self._save_at_stop = True  # False: the time limit's signal came and a save would not fit
        self._own_signals = not self._signals.is_active
        self.deadline, self.deadline_source = find_deadline(env)
        try:
            self.manager = CheckpointManager(
                self.root,
                comm=comm,
                checkpoint_comm=checkpoint_comm,
                keep=keep,
                save_when=save_when,
                gc_every=gc_every,
                lock_owner=job_of(env),
                local_dir=local_dir,
                flush_every=flush_every,
                local_keep=local_keep,
                redundancy=redundancy,
                xor_set_size=xor_set_size,
                run_key=run_key,
                static_copies=static_copies,
            )
        except ForeignRunError as exc:
            # every rank raises it; one line from the first rank (all ranks without a comm)
            first = getattr(comm, "rank", 0) == 0
            if first:
                self._hand_off(self.root)
            self._exit_foreign(exc, log_it=first)
            raise
        self.comm = self.manager.comm
        if self.comm.rank == 0:
            self._hand_off(self.root)
        self._coll = Collective(self.comm)
        # A margin longer than half the time left could stop the loop before its first step,
        # every time: clamp it for this run (BeforeWalltime.fit_to), and say so once.
        self._time_left_at_start = self.time_left_s
        self._stop_before_deadline = self._stop_before_deadline.fit_to(self._time_left_at_start)
        if self._stop_before_deadline.margin_s != self.margin_s and self.comm.rank == 0:
            log.warning(
                "stop margin %.1f s would leave less than half of the %.1f s left before the "
                "deadline (%s) for steps: "
                "using %.1f s instead, so that this run can make and save progress",
                self.margin_s,
                self._time_left_at_start,
                self.deadline_source,
                self._stop_before_deadline.margin_s,
            )
        self.stopped = False
        self.stop_reason = ""
        self._last: tuple[int, Mapping[str, Any], Mapping[str, Any] | None] | None = None
        self._saved_step: int | None = None
        self.saves_this_run = 0
        self._static: Mapping[str, Any] | None = None
        # rank 0 records where the attempt's time goes (resilient report's phases)
        self._timeline = Timeline(self.root, attempt=self._attempt) if self.comm.rank == 0 else None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Session:
        self._signals.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        permanent = exc is not None and is_permanent_storage_error(exc)
        loop_end = time.time()
        try:
            if exc is None:  # stopped early, or finished: the last step is saved either way
                self._final_save()
        finally:
            if self._own_signals:
                self._signals.__exit__(exc_type, exc, tb)
            if exc is None:
                self.manager.close()
            else:
                self.manager.__exit__(exc_type, exc, tb)
            if self._timeline is not None:
                step = self._last[0] if self._last is not None else self._saved_step
                self._timeline.end(
                    time.time(), step, loop_end=loop_end, stopped=self.stopped,
                    raised=None if exc_type is None else exc_type.__name__,
                )  # fmt: skip
        if exc is None and self.stopped:
            self._record_stop()
        if exc is None and self.stopped and self.exit_on_stop:
            # The process is about to exit: a second warning signal (Slurm repeats them, launchers
            # forward them) must not kill it now.
            self._signals.ignore()
            if self.saves_this_run:
                raise SystemExit(EXIT_RESUME)
            log.error("stopped (%s) before saving any progress: exiting 1", self.stop_reason)
            raise SystemExit(1)
        if permanent and self.exit_on_stop:
            log.error("permanent storage error, exiting %d: %s", EXIT_PERMANENT, exc)
            raise SystemExit(EXIT_PERMANENT) from exc
        if isinstance(exc, ForeignRunError):
            self._exit_foreign(exc, log_it=self.comm.rank == 0)

    def _hand_off(self, root: Path | None) -> None:
        """Under ``resilient run``: tell it which directory this program uses (rank 0 only;
        best effort, :mod:`resilient.job.handoff`)."""
        if self._handoff is not None:
            handoff.record(self._handoff, root, attempt=self._attempt, now=time.time())

    def _no_directory(self, comm: Any, *, exit_on_stop: bool) -> NoReturn:
        """No ``checkpoint_dir`` and no ``$RESILIENT_CHECKPOINT_DIR``. Under ``resilient run`` (with
        ``exit_on_stop``): rank 0 says so in one line and tells the wrapper, and every rank
        exits 78 (:data:`~resilient.job.exitcodes.EXIT_CONFIG`), without a traceback; the
        wrapper ends the task with the fix. Otherwise a :class:`ConfigError`."""
        message = f"no checkpoint directory given and ${ENV_CHECKPOINT_DIR} is not set"
        if self._handoff is None or not exit_on_stop:
            raise ConfigError(message)
        if _first_rank(comm):
            log.error(
                "%s: this program keeps no checkpoints. Give `resilient run` a "
                "--checkpoint-dir DIR (the Session takes it from $%s), or give the program's "
                "Session a directory (exiting %d)", message, ENV_CHECKPOINT_DIR, EXIT_CONFIG,
            )  # fmt: skip
            self._hand_off(None)
        raise SystemExit(EXIT_CONFIG)

    def _exit_foreign(self, exc: ForeignRunError, *, log_it: bool) -> None:
        """With ``exit_on_stop``: log ``exc`` and exit :data:`EXIT_FOREIGN_RUN`."""
        if not self.exit_on_stop:
            return
        if log_it:
            log.error("%s (exiting %d)", exc, EXIT_FOREIGN_RUN)
            # why, for `resilient run`'s ledger and the workflow engine's error
            record_stop(self.root, {
                "time": time.time(), "attempt": attempt_number(os.environ),
                "reason": str(exc), "foreign": True,
            })  # fmt: skip
        raise SystemExit(EXIT_FOREIGN_RUN) from exc

    # ------------------------------------------------------------------ loop API

    @property
    def time_left_s(self) -> float | None:
        """Seconds to the deadline on this rank's clock, if a deadline is known."""
        return None if self.deadline is None else self.deadline - self._clock()

    def restore_or(
        self,
        initial: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        static: Mapping[str, Any] | None = None,
        step: int = 0,
        blocks: Mapping[str, Any] | None = None,
        into: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Collective: the newest valid checkpoint's ``(step, state)``, else ``(step, initial)``.

        ``static`` is saved with every checkpoint (stored once by content hash); a restored
        state includes the static entries too. ``blocks`` gives this rank's block of each
        :class:`~resilient.model.blocks.Block` leaf for a checkpoint saved on another rank count (see
        :meth:`~resilient.checkpoint.manager.CheckpointManager.restore`). A restored array whose shape or
        dtype differs from ``initial``'s (a mapping; a callable is not called to compare) is a
        :class:`ConfigError` on every rank, naming the leaf: the checkpoints belong to a run
        with other parameters (Block leaves may differ: an elastic restore). Either way the state comes back
        without wrappers: ``initial``'s and ``static``'s Blocks and Replicated values are
        unwrapped too.

        ``into`` (for example ``{"model": model.state_dict()}``) restores in place, as
        :meth:`~resilient.checkpoint.manager.CheckpointManager.restore` does: the restored arrays
        and tensors are written into those very objects (no second copy in host memory; the
        target's device wins over the saved one), and the state returned holds them. Its
        shapes and dtypes are checked against the checkpoint first: a mismatch is a
        :class:`ConfigError` naming the leaf, on every rank. Without a checkpoint the targets
        are left as they are and ``initial`` is returned.
        """
        self._static = static
        try:
            restored_step, state = self.manager.restore(
                validate=self.validate, blocks=blocks, into=into
            )
        except CheckpointNotFoundError:
            init = initial() if callable(initial) else initial
            state = unwrap(dict(init))
            if static:
                state.update(unwrap(dict(static)))
            self._note_restored(step, resumed=False)
            return step, state
        if not callable(initial):
            self._coll.check(
                "comparing the checkpoint with the initial state",
                lambda: _same_arrays(initial, state, self.root),
            )
        self._saved_step = restored_step
        self._note_restored(restored_step, resumed=True)
        return restored_step, state

    def should_stop(self) -> bool:
        """Collective: whether to stop now (a signal on any rank, or the deadline is near).

        All ranks get the same answer at the same step (one small allreduce). A stop signal
        that came before this run's first step (during the program's imports or the restore:
        ``resilient run`` holds the warning back until the session listens) takes effect after
        that step, which :class:`~resilient.model.policies.OnSignal` saves: stopping with
        nothing of this run to save would end the attempt without progress (exit 1).
        """
        if self.stopped:
            return True
        left = self.time_left_s
        step = self._last[0] if self._last is not None else 0
        # the deadline rule alone: "this step is saved already" does not let the loop go on
        ctx = dataclasses.replace(
            self.manager.save_context(step, time_left_s=left), last_saved_step=None
        )
        near_deadline = self._stop_before_deadline(ctx)
        signalled = self._signals.is_set and self._last is not None  # a step of this run
        if self.comm.any_true(signalled or near_deadline):
            self.stopped = True
            if self.comm.any_true(self._no_time_to_save()):  # on every rank, or none
                self._save_at_stop = False
            if self._signals.received is not None:
                self.stop_reason = f"signal {self._signals.received.name}"
            elif near_deadline:
                self.stop_reason = f"deadline in {left:.0f} s"
            else:
                self.stop_reason = "stop requested on another rank"
        return self.stopped

    def maybe_save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Collective: remember ``state`` and save it if the save policy says so.

        Returns:
            Whether a checkpoint was written.
        """
        self._last = (step, state, metrics)
        if self._timeline is not None:
            self._timeline.sample(time.time(), step)
        if self.manager.in_flight:
            t0 = time.time()
            self.manager.poll()  # commit a finished background save now, not at the next one
            if self._timeline is not None and not self.manager.in_flight:
                self._timeline.wait(t0, time.time(), step)
        stop = self._signals.is_set
        if not self.manager.should_save(
            step, time_left_s=self.time_left_s, stop_requested=stop, veto=self._no_time_to_save()
        ):
            return False
        self.save(step, state, metrics=metrics, blocking=not self.async_save)
        return True

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        blocking: bool = True,
    ) -> None:
        """Collective: write a checkpoint of ``step`` now (``blocking=False``: in the background,
        see :meth:`~resilient.checkpoint.manager.CheckpointManager.save`)."""
        self._last = (step, state, metrics)
        t0 = time.time()
        self.manager.save(
            step, self._without_static(state), static=self._static, metrics=metrics,
            blocking=blocking,
        )  # fmt: skip
        if self._timeline is not None:
            self._timeline.save(t0, time.time(), step)
        self._saved_step = step
        self.saves_this_run += 1

    def _note_restored(self, step: int, *, resumed: bool) -> None:
        """Rank 0: say where the loop starts, and record it (the end of the start-up)."""
        if self._timeline is None:
            return
        passed = self.manager.passed_over
        self._timeline.restored(
            time.time(), step, resumed=resumed, session_start=self._session_start,
            passed_over=passed,
        )  # fmt: skip
        skipped = ", ".join(map(str, passed))
        if passed and resumed:  # a fallback: say it where a user looks, not only at INFO
            log.warning(
                "resumed from step %d in %s: the newer checkpoint(s) of step %s failed "
                "validation and were quarantined", step, self.root, skipped,
            )  # fmt: skip
        elif passed:
            log.warning(
                "no valid checkpoint in %s (step %s failed validation and was quarantined): "
                "starting at step %d", self.root, skipped, step,
            )  # fmt: skip
        elif resumed:
            log.info("resumed from step %d in %s", step, self.root)
        else:
            log.info("no checkpoint in %s: starting at step %d", self.root, step)

    def _record_stop(self) -> None:
        """Rank 0 appends why the run stopped early to the stop log (read by ``resilient run``)."""
        if self.comm.rank != 0:
            return
        step = self._last[0] if self._last is not None else self._saved_step
        record = {
            "time": time.time(),
            "attempt": self._attempt,
            "step": step,
            "reason": self.stop_reason,
            "saved": self.saves_this_run > 0,
            "margin_s": self.margin_s,
            "margin_used_s": self._stop_before_deadline.margin_s,
            "time_left_at_start_s": self._time_left_at_start,
            "deadline_source": self.deadline_source,
        }
        record_stop(self.root, record)

    def _without_static(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        if not self._static:
            return state
        return {k: v for k, v in state.items() if k not in self._static}

    def _no_time_to_save(self) -> bool:
        """Whether the time limit's signal (Flux's SIGALRM) came on this rank and a save
        would not fit before the kill (:func:`resilient.job.flux.save_before_kill`)."""
        return self._signals.received in self._time_limit and not flux.save_before_kill(
            self.manager.save_cost_s
        )

    def _final_save(self) -> None:
        if self._last is None:
            return
        step, state, metrics = self._last
        if step != self._saved_step and not self._save_at_stop:
            if self.comm.rank == 0:
                log.warning(
                    "%s: the time limit, killed in %.0f s; a save took %.1f s: not saving "
                    "step %d, the newest checkpoint stays step %s",
                    self.stop_reason, flux.KILL_TIMEOUT_S, self.manager.save_cost_s or 0.0,
                    step, self._saved_step,
                )  # fmt: skip
            return
        if step != self._saved_step:
            why = f"stopping ({self.stop_reason})" if self.stopped else "finished"
            log.info("%s: final checkpoint of step %d", why, step)
            self.save(step, state, metrics=metrics)


def _first_rank(comm: Any) -> bool:
    """Whether this process is rank 0 of ``comm`` (any communicator :func:`as_comm` takes;
    ``True`` for one it does not, whose error comes later)."""
    try:
        return as_comm(comm).rank == 0
    except Exception:  # not a communicator: the manager says so, not this
        return True


def _same_arrays(initial: Mapping[str, Any], state: Mapping[str, Any], root: Path) -> None:
    """Raise :class:`ConfigError` if an array leaf of ``state`` (restored from ``root``) has
    another shape or dtype than the same leaf of ``initial`` (Block leaves excepted)."""
    wanted, blocks = split_template(initial)
    got, _ = split_template(state)
    for path, value in wanted.items():
        if path in blocks or path not in got:
            continue
        (want_shape, want_dtype), (shape, dtype) = template_spec(value), template_spec(got[path])
        if (want_shape, want_dtype) != (shape, dtype):
            raise ForeignRunError(
                f"the checkpoint in {root} holds {path!r} with shape {shape} and dtype "
                f"{dtype}, but this run's initial state has shape {want_shape} and dtype "
                f"{want_dtype}: the checkpoint directory belongs to a run with other "
                "parameters; give these parameters a directory of their own, or delete it"
            )
