"""resilient.job.warning: a warning signal held back at the start is recorded, never fatal (real
signals, in fresh interpreters: the signal mask and handlers are per process)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

from resilient.job import warning
from resilient.job.protocol import ENV_WARN_SIGNALS

PROBE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    os.kill(os.getpid(), signal.SIGUSR1)  # the warning, during the imports
    time.sleep(0.05)
    import resilient
    from resilient.job.slurm import StopSignals
    with StopSignals(["USR1", "USR2"]) as stop:
        received = stop.received.name if stop.received else None
    os.kill(os.getpid(), signal.SIGUSR1)  # a late warning, while the output is written
    time.sleep(0.05)
    print(json.dumps({"received": received,
                      "after": repr(signal.getsignal(signal.SIGUSR1)),
                      "term_after": repr(signal.getsignal(signal.SIGTERM))}))
    """
)


@contextlib.contextmanager
def default_dispositions() -> Iterator[None]:
    """A child starts with default dispositions (an ignored one, left by another test in this
    process, would survive exec)."""
    sigs = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
    old = {s: signal.signal(s, signal.SIG_DFL) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def spawn(code: str, env: dict[str, str], *, block: bool) -> subprocess.CompletedProcess[str]:
    with default_dispositions(), warning.blocked([signal.SIGUSR1] if block else []):
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )


def run_probe(env: dict[str, str], *, block: bool) -> subprocess.CompletedProcess[str]:
    return spawn(PROBE, env, block=block)


def test_a_blocked_warning_waits_for_the_stop_signals_and_a_late_one_is_ignored() -> None:
    proc = run_probe({"PATH": "/usr/bin:/bin"}, block=True)  # resilient run without the variable
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["received"] == "SIGUSR1"
    assert out["after"] == repr(signal.SIG_IGN)
    assert out["term_after"] == repr(signal.SIG_DFL)  # SIGTERM keeps its meaning


def test_the_variable_alone_records_a_warning_from_import_resilient_on() -> None:
    """srun starts tasks with an empty mask: the variable is what reaches them."""
    probe = PROBE.replace(
        "import json, os, signal, sys, time",
        "import json, os, signal, sys, time\nimport resilient",
        1,
    )
    env = {"PATH": "/usr/bin:/bin", ENV_WARN_SIGNALS: "USR1"}
    proc = spawn(probe, env, block=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["received"] == "SIGUSR1"


def test_without_the_mask_or_the_variable_the_warning_still_kills() -> None:
    """What the two pieces prevent (and what import resilient leaves alone without them)."""
    proc = run_probe({"PATH": "/usr/bin:/bin"}, block=False)
    assert proc.returncode == -signal.SIGUSR1


def test_warning_signals_names_only_non_terminating_signals() -> None:
    env = {ENV_WARN_SIGNALS: "USR1, SIGUSR2 TERM 2 bogus 12"}
    assert warning.warning_signals(env) == (signal.SIGUSR1, signal.SIGUSR2)
    assert warning.warning_signals({}) == ()
    assert not warning.is_warning(signal.SIGTERM) and warning.is_warning(signal.SIGUSR2)


def test_a_programs_own_handler_is_kept_and_gets_the_held_back_signal() -> None:
    probe = textwrap.dedent(
        """
        import json, os, signal
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        os.kill(os.getpid(), signal.SIGUSR1)  # held back by the mask
        before = list(got)
        import resilient  # unblocks it: delivered to the program's own handler
        print(json.dumps({"before": before, "after": got}))
        """
    )
    env = {"PATH": "/usr/bin:/bin", ENV_WARN_SIGNALS: "SIGUSR1"}
    proc = spawn(probe, env, block=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"before": [], "after": [int(signal.SIGUSR1)]}
