"""A fault in any coordinator-only step raises the same error on every rank; none waits."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.faults import STEPS
from tests.mpirun import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _results(stdout: str) -> list[dict[str, object]]:
    import json

    decoder = json.JSONDecoder()
    out, pos = [], 0
    while (pos := stdout.find("RESULT {", pos)) >= 0:
        obj, pos = decoder.raw_decode(stdout, pos + len("RESULT "))
        out.append(obj)
    return out


@pytest.mark.parametrize(("n", "kind"), [(1, "world"), (2, "world"), (3, "node"), (4, "self")])
def test_fault_in_every_coordinator_step_raises_everywhere(
    tmp_path: Path, n: int, kind: str
) -> None:
    proc = run_mpi(n, ["tests/mpi/faults.py", str(tmp_path), kind], timeout=240)
    got = _results(proc.stdout)
    assert {(r["step"], r["rank"]) for r in got} == {(s, r) for s in STEPS for r in range(n)}
    for step in STEPS:
        seen = [r for r in got if r["step"] == step]
        assert all(r["same"] for r in seen), (step, seen)
        errors = {(r["error"], r["message"]) for r in seen}
        assert len(errors) == 1, (step, errors)
        ((kind_seen, message),) = errors
        assert kind_seen != "none", f"{step}: the injected fault was swallowed"
        assert "injected fault" in str(message), (step, message)
