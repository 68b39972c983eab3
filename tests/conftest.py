"""Session-wide hygiene for the tests that launch MPI jobs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import signals

SHM = Path("/dev/shm")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the items as :mod:`tests.scheduling` says: under pytest-xdist in units, the Slurm
    campaigns starting with the timed unit's first test; in one process (CI) the tests that
    race no clock first, the campaigns beside them, the timing modules last."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.scheduling import mark_units, start_campaigns_first

        mark_units(items)
        start_campaigns_first(items)
    elif not getattr(config.option, "numprocesses", None):
        from tests.scheduling import order_serial

        order_serial(items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist, a test of no group runs at lower priority (tests.scheduling)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.scheduling import yield_cpu

        yield_cpu(item)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: Any) -> None:
    """On the controller, before the workers start: ``nice`` must rank every process
    (:func:`tests.scheduling.nice_across_sessions`), undone when the session ends."""
    from tests.scheduling import nice_across_sessions

    undo = contextlib.ExitStack()
    line = undo.enter_context(nice_across_sessions())
    config.add_cleanup(undo.close)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"scheduling: {line}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (what ``RESILIENT_TEST_WORKERS=N bash .ci/dev test`` passes)
    spreads :mod:`tests.scheduling`'s units; any other ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log)


@pytest.fixture(scope="session", autouse=True)
def _own_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``resilient run`` without ``--checkpoint-dir`` keeps a task's ledger in its state
    directory (``~/.local/state/resilient``: resilient.job.handoff): the tests', and every
    ``resilient run`` they start, go to a directory of this session's, never the user's."""
    old = os.environ.get("RESILIENT_STATE_DIR")
    os.environ["RESILIENT_STATE_DIR"] = str(tmp_path_factory.mktemp("resilient-state"))
    yield
    if old is None:
        os.environ.pop("RESILIENT_STATE_DIR", None)
    else:
        os.environ["RESILIENT_STATE_DIR"] = old


@pytest.fixture(scope="session")
def slurm_scenarios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The background workflows of the two Slurm campaigns (tests/test_slurm_workflows.py and
    tests/test_slurm_snakemake_mpi.py), started together when the first of them is needed.

    Each waits minutes on Slurm's 1-minute limits and little on the CPU, so together they take
    the time of the longer, not the sum (the partitions are OverSubscribe=FORCE). The multi-node
    one is left out, and its tests skipped, where partition ``multi`` has fewer than 2 nodes.
    Whatever still runs is stopped at the end of the session.
    """
    from tests import test_slurm_snakemake_mpi as on_nodes
    from tests import test_slurm_workflows as engines
    from tests.slurmutil import require_slurm
    from tests.test_slurm_multinode import multi_nodes

    require_slurm()
    base = tmp_path_factory.mktemp("slurm-campaigns")
    t0 = time.monotonic()
    started: dict[str, Any] = {"snakemake_mpi": None, "snakemake_mpi_skipped": ""}
    try:
        started["workflows"] = engines.start_scenarios(base / "workflows", t0)
        try:
            multi_nodes()
        except pytest.skip.Exception as exc:
            started["snakemake_mpi_skipped"] = str(exc)
        else:
            started["snakemake_mpi"] = on_nodes.start_scenarios(base / "snakemake-mpi", t0)
        yield started
    finally:
        for key in ("workflows", "snakemake_mpi"):
            for run in (started.get(key) or {}).values():
                run.stop()


#: Seconds between the campaigns' start and the sbatch scenarios' (``slurm_campaigns``): all
#: at once, the campaigns' first allocations lost their start-ups to the PyTorch jobs' (one
#: step each, then 5 allocations instead of 3-4).
SBATCH_AFTER_S = 75
_sbatch_later: list[concurrent.futures.Future[dict[str, Any]]] = []


@pytest.fixture(scope="session")
def sbatch_scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain sbatch scenarios of tests/test_slurm_sbatch.py (job arrays, self-resubmitting
    and requeued jobs, PyTorch chains: 2-minute allocations on partition ``debug``), submitted
    :data:`SBATCH_AFTER_S` after the campaigns (``slurm_campaigns``), or now by their module."""
    from tests import test_slurm_sbatch as sbatch
    from tests.slurmutil import require_slurm

    if _sbatch_later:
        return _sbatch_later[0].result()
    require_slurm()
    return sbatch.start_scenarios(tmp_path_factory.mktemp("sbatch"))


@pytest.fixture(scope="session")
def slurm_campaigns(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """``slurm_scenarios`` started now where Slurm is there, and the sbatch scenarios
    :data:`SBATCH_AFTER_S` later (on a thread); nothing (no skip) where Slurm is not there:
    what the first test of a serial run asks for (:func:`tests.scheduling.order_serial`;
    under xdist the timed unit's first, :func:`tests.scheduling.start_campaigns_first`), so
    that they run beside the tests before theirs. Their own tests still ask for them (and
    skip)."""
    from tests import test_slurm_sbatch as sbatch
    from tests.slurmutil import require_slurm

    with contextlib.suppress(pytest.skip.Exception):
        request.getfixturevalue("slurm_scenarios")
    try:
        require_slurm()
    except pytest.skip.Exception:
        yield
        return
    base = tmp_path_factory.mktemp("sbatch")

    def later() -> dict[str, Any]:
        time.sleep(SBATCH_AFTER_S)
        return sbatch.start_scenarios(base)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sbatch") as pool:
        _sbatch_later.append(pool.submit(later))
        yield


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_mpich_segments() -> Iterator[None]:
    """Remove the shared-memory segments of the MPI jobs this session killed.

    MPICH unlinks a job's ``/dev/shm/mpich_shm_*`` segment when its ranks finalize; a rank
    killed by a test (SIGKILL, the point of the fault tests) leaves it behind: ~4 MB each, 27
    of them for the MPI suites alone, and 9 GB of tmpfs (RAM) after a few weeks of test runs
    on one machine. At the end of the session, segments that appeared during it and that no
    live process maps are removed; older ones, and those of jobs still running, are left alone.
    """
    before = _segments()
    yield
    for path in _segments() - before - _mapped():
        path.unlink(missing_ok=True)


def _segments() -> set[Path]:
    return set(SHM.glob("mpich_shm_*")) if SHM.is_dir() else set()


def _mapped() -> set[Path]:
    """The ``/dev/shm`` files some live process maps (those of processes we may read)."""
    found: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                found.add(Path(line[at:].removesuffix(" (deleted)")))
    return found


@pytest.fixture(autouse=True)
def _signal_dispositions_kept() -> Iterator[None]:
    """Each test leaves the signals of :data:`tests.signals.KEPT` as it found them (why:
    :mod:`tests.signals`; the documentation's pages: docs/conftest.py)."""
    saved = signals.taken()
    yield
    signals.put_back(saved)
