"""The checkpoint core over a torch.distributed process group (gloo, 1..4 real processes).

No mpi4py and no mpiexec: each rank is a process started here with the env:// variables of
``init_process_group`` (as ``torchrun`` and ``srun`` wrappers set them), or by
``python -m torch.distributed.run`` itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed", reason="needs PyTorch (pip install 'resilient-hpc[torch]')")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
SCENARIO = "tests/torch/scenario.py"
KINDS = ["self", "node", "world"]
TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def agent_store() -> Any:
    """A rendezvous store served by this process, as torchrun's agent serves one.

    With ``TORCHELASTIC_USE_AGENT_STORE=True`` every rank is a client of it. Its port is bound
    here, at once: a port picked free and bound later by rank 0 was taken in between once
    (other jobs on this machine), and the other ranks then waited on someone else's store.
    """
    import torch.distributed as dist

    store_type = vars(dist)["TCPStore"]  # re-exported by torch.distributed, not in its stubs
    return store_type("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def run_ranks(n: int, args: list[str], **extra: str) -> list[dict[str, Any]]:
    """Start ``n`` ranks of ``python SCENARIO ARGS``; their RESULT lines, by rank.

    Fails if any rank fails, and if they have not all finished within ``TIMEOUT_S`` (a hang).
    """
    store = agent_store()  # lives until the ranks are done
    env = base_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        WORLD_SIZE=str(n),
        **extra,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, SCENARIO, *args],
            cwd=REPO,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    outputs: list[tuple[int, str, str]] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.send_signal(signal.SIGQUIT)  # faulthandler: every thread's stack to stderr
        time.sleep(1.0)
        for p in procs:
            p.kill()
        report = "".join(
            f"--- rank {r}\n{p.communicate()[1][-4000:]}\n" for r, p in enumerate(procs)
        )
        raise AssertionError(
            f"{n} ranks of {args} did not finish within {TIMEOUT_S} s\n{report}"
        ) from None
    failed = [(r, rc, err) for r, (rc, _, err) in enumerate(outputs) if rc != 0]
    assert not failed, "\n".join(f"--- rank {r} exited {rc}\n{err}" for r, rc, err in failed)
    return [parse_result(out) for _, out, _ in outputs]


def parse_result(stdout: str) -> dict[str, Any]:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    out: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return out


def expected_groups(n: int, kind: str) -> list[list[int]]:
    if kind == "self":
        return [[r] for r in range(n)]
    if kind in ("node", "world"):
        return [list(range(n))]  # one host here
    width = 2  # node2 and split: pairs
    return [list(range(i, min(i + width, n))) for i in range(0, n, width)]


#: Every ``checkpoint_comm`` of the scenarios; ``node2`` last (it fakes the hostname for good).
ALL_KINDS = [*KINDS, "split", "node2"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_round_trip_is_bit_identical(tmp_path: Path, n: int) -> None:
    """Each layout saved and restored by one launch of ``n`` ranks (then a new process group)."""
    root = str(tmp_path / "ck")
    saved = run_ranks(n, ["save", root, ",".join(ALL_KINDS)])
    assert [r["rank"] for r in saved] == list(range(n))
    for kind in ALL_KINDS:
        layout = saved[0]["layouts"][kind]
        assert layout["kind"] == {"node2": "node", "split": "custom"}.get(kind, kind), kind
        assert layout["nranks"] == n
        assert layout["groups"] == expected_groups(n, kind), kind
    restored = run_ranks(n, ["restore", root, ",".join(ALL_KINDS), "5"])  # a new process group
    assert [r["step"] for r in restored] == [5] * n


def test_a_sub_group_as_comm_splits_by_host(tmp_path: Path) -> None:
    """Two checkpoint sets over pair groups, each pair on two faked hosts: "node" is per rank."""
    got = run_ranks(4, ["subgroup", str(tmp_path / "ck"), "node"])
    assert [r["layout"] for r in got] == [{"kind": "node", "nranks": 2, "groups": [[0], [1]]}] * 4


@pytest.mark.parametrize("kind", ["self", "node"])
def test_partner_copies_over_gloo_rebuild_a_lost_node(tmp_path: Path, kind: str) -> None:
    root, local = str(tmp_path / "ck"), tmp_path / "local"
    run_ranks(4, ["partner", root, kind, str(local), "save"])
    (copies,) = (local / "host1").glob("ck-*/partner/host0/step_00000003")
    assert sorted(p.name for p in copies.glob("*.h5"))
    shutil.rmtree(local / "host0")  # host0's local disk is gone; its copy is on host1
    assert [r["step"] for r in run_ranks(4, ["partner", root, kind, str(local), "restore"])] == [
        3
    ] * 4


def test_xor_parity_over_gloo_rebuilds_a_lost_node(tmp_path: Path) -> None:
    root, local = str(tmp_path / "ck"), tmp_path / "local"
    run_ranks(3, ["xor", root, "self", str(local), "save"])
    (parity,) = (local / "host1").glob("ck-*/xor/step_00000003/parity.xor")
    assert parity.stat().st_size > 0
    shutil.rmtree(local / "host1")  # host1's local disk is gone; the others' parity rebuilds it
    got = run_ranks(3, ["xor", root, "self", str(local), "restore"])
    assert [r["step"] for r in got] == [3] * 3
    assert (next((local / "host1").glob("ck-*")) / "step_00000003" / "rank_00001.h5").is_file()


@pytest.mark.parametrize("n", [2, 3])
def test_async_round_trip_is_bit_identical(tmp_path: Path, n: int) -> None:
    root, kinds = str(tmp_path / "ck"), ",".join(KINDS)
    run_ranks(n, ["save", root, kinds], SCENARIO_ASYNC="1")
    assert [r["step"] for r in run_ranks(n, ["restore", root, kinds, "5"])] == [5] * n


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", [*KINDS, "node2"])
def test_one_rank_failing_raises_the_same_error_everywhere(
    tmp_path: Path, kind: str, mode: str
) -> None:
    extra = {"SCENARIO_ASYNC": "1"} if mode == "async" else {}
    got = run_ranks(3, ["fail", str(tmp_path / "ck"), kind], **extra)
    assert len({(r["error"], r["message"]) for r in got}) == 1, got
    assert got[0]["error"] == "CollectiveError"
    assert "No space left on device" in got[0]["message"]
    assert "rank(s) [2]" in got[0]["message"]


@pytest.mark.parametrize("kind", KINDS)
def test_session_stops_every_rank_at_the_same_step_and_resumes(tmp_path: Path, kind: str) -> None:
    root = str(tmp_path / "ck")
    first = run_ranks(3, ["session", root, kind])
    # SIGUSR1 reached rank 2 after step 5: every rank stops before step 6 (one any_true)
    assert {(r["first"], r["step"], r["stopped"]) for r in first} == {(0, 5, True)}, first
    assert [r["reason"] for r in first] == ["stop requested on another rank"] * 2 + [
        "signal SIGUSR1"
    ]
    again = run_ranks(3, ["session", root, kind])  # resumes from the final save of step 5
    assert {(r["first"], r["step"]) for r in again} == {(5, 10)}, again


def test_under_torchrun(tmp_path: Path) -> None:
    """``python -m torch.distributed.run`` starts the ranks (its agent sets the variables)."""
    root = str(tmp_path / "ck")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        SCENARIO, "save", root, "node",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('"ok": true') == 2, proc.stdout
    assert [r["step"] for r in run_ranks(2, ["restore", root, "node", "5"])] == [5, 5]


# --- the adapter itself, in this process (one rank) ------------------------------------


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_as_comm_wraps_the_group_the_module_and_world(one_rank: Any) -> None:
    from resilient.parallel.comm import as_comm
    from resilient.parallel.torchdist import TorchComm

    dist = one_rank
    for obj in (dist, dist.group.WORLD, dist.new_group([0])):
        comm = as_comm(obj)
        assert isinstance(comm, TorchComm)
        assert (comm.rank, comm.size) == (0, 1)
        assert comm.allgather("x") == ["x"]
        assert comm.gather(1) == [1]
        assert comm.bcast({"a": 1}) == {"a": 1}
        assert comm.any_true(True) and not comm.any_true(False)
        comm.barrier()
        assert comm.split_node() is comm.split_node()


def test_serial_round_trip_over_a_one_rank_group(one_rank: Any, tmp_path: Path) -> None:
    import numpy as np

    from resilient import CheckpointManager

    x = np.arange(12.0).reshape(3, 4)
    with CheckpointManager(tmp_path / "ck", comm=one_rank.group.WORLD) as m:
        m.save(1, {"x": x})
        step, state = m.restore()
    assert step == 1 and state["x"].tobytes() == x.tobytes()


def test_an_uninitialised_torch_distributed_is_a_config_error() -> None:
    import torch.distributed as dist

    from resilient.errors import ConfigError
    from resilient.parallel.comm import as_comm

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="init_process_group"):
        as_comm(dist)
