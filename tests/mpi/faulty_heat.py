"""``apps.heat`` with injected faults, for the ``resilient run`` tests.

Environment:
    FAULT=crash@STEP[:ATTEMPTS]     rank 0 exits with code 1 at STEP (only in those attempts,
                                    comma-separated; every attempt if omitted)
    FAULT=randomcrash:ATTEMPTS      rank 0 exits 1 at a random step (seeded by the attempt)
    FAULT=killsave@STEP:ATTEMPTS    every rank SIGKILLs itself inside the commit of STEP
    FAULT=enospc@STEP               the save of STEP hits ENOSPC on the last rank
    FAULT=usr1@STEP:RANK            RANK (only) receives SIGUSR1 at STEP
    FAULT=slowrestore@SECONDS       every rank sleeps SECONDS after its restore (a slow start)
    STOPLOG=PATH                    each rank appends "rank step" when its loop ends
"""

from __future__ import annotations

import errno
import os
import random
import signal
import sys
from typing import Any

from mpi4py import MPI

from apps import heat

rank = MPI.COMM_WORLD.rank
attempt = os.environ.get("RESILIENT_ATTEMPT", "1")
fault = os.environ.get("FAULT", "")
kind, _, spec = fault.partition("@") if "@" in fault else fault.partition(":")


def _in_attempts(which: str) -> bool:
    return not which or attempt in which.split(",")


real_advance = heat.advance
counter: dict[str, int | None] = {"step": None}


def _step_hook(at_step: int, action: Any) -> None:
    def advance(dom: Any, u: Any, kappa: Any, alpha: float) -> Any:
        out = real_advance(dom, u, kappa, alpha)
        counter["step"] = (counter["step"] or 0) + 1
        if counter["step"] == at_step:
            action()
        return out

    heat.advance = advance


if kind == "crash":
    step_s, _, which = spec.partition(":")
    if _in_attempts(which) and rank == 0:
        _step_hook(int(step_s), lambda: os._exit(1))
elif kind == "randomcrash":
    if _in_attempts(spec) and rank == 0:
        _step_hook(random.Random(int(attempt)).randint(5, 40), lambda: os._exit(1))
elif kind == "killsave":
    step_s, _, which = spec.partition(":")
    if _in_attempts(which):
        from resilient.io.commit import PendingDir

        real_prepare = PendingDir.prepare  # every commit starts here (blocking or not)

        def prepare(self: PendingDir, manifest: Any, *, what: str, copies: Any = None) -> None:
            if manifest.step == int(step_s):
                os.kill(os.getpid(), signal.SIGKILL)
            real_prepare(self, manifest, what=what, copies=copies)

        PendingDir.prepare = prepare  # type: ignore[method-assign]
        if rank != 0:  # non-coordinators die while the coordinator commits
            from resilient.io import fileio

            real_write = fileio.write_file

            def write(path: Any, *args: Any, **kwargs: Any) -> None:
                real_write(path, *args, **kwargs)
                if f"step_{int(step_s):08d}" in str(path):
                    os.kill(os.getpid(), signal.SIGKILL)

            fileio.write_file = write
elif kind == "enospc":
    if rank == MPI.COMM_WORLD.size - 1:
        from resilient.io import fileio

        real_pwrite, real_pwritev = os.pwrite, os.pwritev

        def full_for_step(fd: int) -> None:
            if f"step_{int(spec):08d}" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def pwrite(fd: int, data: Any, offset: int) -> int:
            full_for_step(fd)
            return real_pwrite(fd, data, offset)

        def pwritev(fd: int, buffers: Any, offset: int) -> int:
            full_for_step(fd)
            return real_pwritev(fd, buffers, offset)

        fileio.os.pwrite = pwrite  # type: ignore[attr-defined]
        fileio.os.pwritev = pwritev  # type: ignore[attr-defined]
elif kind == "usr1":
    step_s, _, who = spec.partition(":")
    if rank == int(who):
        _step_hook(int(step_s), lambda: os.kill(os.getpid(), signal.SIGUSR1))
elif kind == "slowrestore":
    import time

    from resilient.job.session import Session

    real_restore_or = Session.restore_or

    def restore_or(self: Session, *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        out = real_restore_or(self, *args, **kwargs)
        time.sleep(float(spec))
        return out

    Session.restore_or = restore_or  # type: ignore[method-assign]

if os.environ.get("STOPLOG"):
    from resilient.job.session import Session

    real_should_stop = Session.should_stop

    def should_stop(self: Session) -> bool:
        stop = real_should_stop(self)
        if stop:
            with open(os.environ["STOPLOG"], "a") as fh:
                fh.write(f"{rank} {self._last[0] if self._last else None}\n")
        return stop

    Session.should_stop = should_stop  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(heat.main(sys.argv[1:]))
