"""Importing resilient is cheap and side-effect free; serial use needs no MPI, torch or workflow tool."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

BLOCKER = textwrap.dedent(
    """
    import sys

    BLOCKED = {"mpi4py", "snakemake", "parsl", "torch"}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked by the test")
            return None

    sys.meta_path.insert(0, Blocker())
    for mod in list(sys.modules):
        if mod.partition(".")[0] in BLOCKED:
            del sys.modules[mod]
    """
)


def run_python(code: str, *args: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_serial_round_trip_without_mpi4py_snakemake_parsl_torch(tmp_path: Path) -> None:
    code = BLOCKER + textwrap.dedent(
        """
        import json
        blocked = []
        for name in ("mpi4py", "mpi4py.MPI", "snakemake", "parsl", "torch"):
            try:
                __import__(name)
            except ImportError:
                blocked.append(name)

        import numpy as np
        import resilient
        from resilient import CheckpointManager

        root = sys.argv[1]
        x = np.arange(10_000, dtype=np.float32).reshape(100, 100)
        with CheckpointManager(root) as m:
            m.save(1, {"x": x, "it": 1})
            m.save(2, {"x": x * 2, "it": 2}, static={"grid": np.arange(7)})
        with CheckpointManager(root) as m:
            step, state = m.restore()
        print(json.dumps({
            "blocked": blocked,
            "step": step,
            "it": state["it"],
            "x_ok": bool((state["x"] == x * 2).all()) and state["x"].dtype == np.float32,
            "grid": state["grid"].tolist(),
            "mpi_loaded": sorted(
                m for m in sys.modules
                if m.partition(".")[0] in ("mpi4py", "snakemake", "parsl", "torch")
            ),
        }))
        """
    )
    out = run_python(code, str(tmp_path / "ck"))
    assert out["blocked"] == ["mpi4py", "mpi4py.MPI", "snakemake", "parsl", "torch"]
    assert out["step"] == 2
    assert out["it"] == 2
    assert out["x_ok"] is True
    assert out["grid"] == list(range(7))
    assert out["mpi_loaded"] == []


def test_import_resilient_loads_neither_mpi4py_nor_h5py_nor_torch() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        before = set(sys.modules)
        import resilient
        import resilient.checkpoint.manager, resilient.io.checkpoints, resilient.model.policies, resilient.job.session
        import resilient.parallel.comm, resilient.parallel.setcomms
        new = set(sys.modules) - before
        heavy = ("mpi4py", "h5py", "snakemake", "parsl", "torch")
        print(json.dumps({
            "loaded": sorted(m for m in new if m.partition(".")[0] in heavy),
            "resilient": "resilient" in sys.modules,
        }))
        """
    )
    out = run_python(code)
    assert out["resilient"] is True
    assert out["loaded"] == []


def test_import_resilient_installs_no_signal_handlers_and_no_logging() -> None:
    code = textwrap.dedent(
        """
        import json, logging, signal
        names = ["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU"]
        names = [n for n in names if hasattr(signal, n)]
        def handlers():
            return {n: repr(signal.getsignal(getattr(signal, n))) for n in names}
        def log_state():
            return [
                repr(logging.getLogger().handlers),
                logging.getLogger().level,
                repr(logging.getLogger("resilient").handlers),
            ]
        before, log_before = handlers(), log_state()
        import resilient
        import resilient.checkpoint.manager, resilient.io.storage, resilient.checkpoint.saveset
        print(json.dumps({
            "before": before, "after": handlers(),
            "log_before": log_before, "log_after": log_state(),
            "n": len(names),
        }))
        """
    )
    out = run_python(code)
    assert isinstance(out["n"], int) and out["n"] >= 4
    assert out["after"] == out["before"]
    assert out["log_after"] == out["log_before"]


def test_serial_manager_does_not_load_mpi4py(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import json, sys
        import numpy as np
        from resilient import CheckpointManager
        with CheckpointManager(sys.argv[1]) as m:
            m.save(3, {"a": np.ones(4)})
            step, _ = m.restore()
        print(json.dumps({
            "step": step, "mpi4py": "mpi4py" in sys.modules, "torch": "torch" in sys.modules
        }))
        """
    )
    out = run_python(code, str(tmp_path / "ck"))
    assert out == {"step": 3, "mpi4py": False, "torch": False}


def test_the_early_signal_handlers_import_no_checkpoint_machinery() -> None:
    # a program installs its stop-signal handlers first thing (apps/heat.py): under Slurm a
    # warning signal can come within a second of the start, and 4 ranks starting on 2 busy
    # cores took seconds to import numpy and the manager; the package imports them when used
    out = run_python(
        "import json, sys\n"
        "from resilient.job.slurm import StopSignals\n"
        "early = sorted(m for m in ('numpy', 'resilient.checkpoint.manager') if m in sys.modules)\n"
        "from resilient import Resume, resumable, CheckpointManager, KeepLast\n"
        "print(json.dumps({'early': early, 'kind': type(resumable).__name__,\n"
        "                  'manager': 'resilient.checkpoint.manager' in sys.modules}))\n"
    )
    assert out == {"early": [], "kind": "function", "manager": True}
