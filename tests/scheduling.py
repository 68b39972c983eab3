"""How the suite is ordered in one process (CI's run, :func:`order_serial`) and spread over
pytest-xdist workers (``RESILIENT_TEST_WORKERS=3 bash .ci/dev test``).

In one process (the default, what CI runs) the order is: the tests that race no clock and
start few processes (the unit tests, the documentation's examples, the crash-state sample of
tests/test_crash.py, whose MPI runs take a second each) with the two Slurm campaigns started
beside the first of them and the plain sbatch scenarios (``sbatch_scenarios``) 75 s later;
the campaigns' modules; the untimed modules of many processes
(:data:`SERIAL_AFTER_CAMPAIGNS`); the other Slurm modules; the demo; the timing modules last.
Measured (2026-11-29, nothing else running): 34 min 2 s of pytest, no failure (41 min 59 s
before the sbatch scenarios moved beside the unit tests and the signal dispositions were put
back after each test; about 55 min in collection order); with the MPI and
PyTorch modules beside the campaigns too: 44 min 2 s, and a 4-rank MPI round trip timed out
at 120 s (done in 6 s beside busy loops or another mpiexec job).

Most of the suite's wall time is waiting, not computing: Slurm campaigns on 1-minute limits,
walltime stops, MPI and PyTorch start-ups. On 2 cores, three workers overlap that waiting.

A *unit* is what one worker runs, in order, in one process:

- the *timed* unit: the modules of :data:`TIMING_MODULES`, then the Slurm modules
  (``tests/test_slurm_*.py``), one after the other on one worker. Their programs race clocks:
  walltimes of a few seconds (a warning signal 1 s after the start, a stop before the kill),
  Slurm jobs on 1-minute limits. Two of them side by side eat each other's start-ups: with
  the Slurm modules and the timing modules on two workers, 6-7 tests failed a run (see
  below). The timing modules run at ``nice`` -5 where allowed (root, as CI runs).

  The two Slurm campaigns (the session fixture ``slurm_campaigns`` in tests/conftest.py:
  Snakemake workflows that wait minutes on 1-minute limits and little on the CPU) start with
  the unit's first test, so that they run while the timing modules do instead of after them
  (:func:`start_campaigns_first`); their modules (:data:`CAMPAIGN_MODULES`) come next and
  mostly find them finished, and the Slurm modules that take nodes down
  (:data:`NODE_MODULES`) come last, once the campaigns' jobs are gone;
- the tests of a module in :data:`SPLIT_MODULES` are a unit each (independent and long);
- every other module is a unit: its module-scoped fixtures run once, and a documentation
  page's blocks (Sybil) share one namespace. These units run at ``nice`` 10
  (:func:`yield_cpu`): they compute but race no clock, so on 2 cores they take what the timed
  unit leaves; the demo (:data:`OWN_PACE_MODULES`), which fits its walltimes to the start-ups
  it measures, at 0. ``nice`` reaches every process only with autogroup scheduling off
  (:func:`nice_across_sessions`).

A unit is known from the test's node id alone: xdist's own groups (``--dist loadgroup`` with
``xdist_group`` markers) rename node ids, which pytest 9.2 no longer allows (the groups are
silently lost), so they are not used.

Measured on this 2-core machine (2026-11-28), before the timed unit: 36 min 26 s for the
whole suite on 3 workers against about 55 min serially, but 7 tests failed, every one for
want of CPU at a start-up (walltimes of 2.5-3 s beside the Slurm jobs, the sbatch PyTorch
chain beside the local PyTorch tests); with autogroup off and three helpers' builds beside it
at ``nice`` 19, 6 failed in 43 min 29 s (the same kinds, and a 4-rank MPI test at ``nice`` 10
past its 240-s limit). With the timed unit, Slurm modules first: 46 min 41 s, the timed unit
the longest by 13 min, 9 of them waiting on the campaigns. Campaigns beside the timing
modules, the demo at ``nice`` 10: 37 min 10 s, 2 failed and 1 skipped: the demo (its
measured start-ups raised a walltime to 188 s: past its limit), a Parsl DAG under 2.5-s
walltimes in the first minutes (start-ups of 2.0-2.4 s beside the campaigns' engines, then
at -5 too), and a multi-node test skipped for a node still down after the node-loss tests.
Hence the demo at 0, the engines at 0 and the node modules' order: then 34 min 53 s with 1
failure (a Parsl app's 2.5-s tries, since 5 s), and 36 min 22 s with 3: Slurm jobs started
in the first minutes, when every worker starts its heaviest unit, lost their start-ups (the
multi-node campaign's and the engines' campaign's jobs; and a warning due at once under srun
came before the step existed).
With Slurm's daemons (and so their jobs) at -5 like the timing tests: 43 min 52 s, 6 failed
(the timing tests lost their start-ups instead). On 2 workers (``RESILIENT_TEST_WORKERS=2``:
every other unit on the second worker, done after about 32 min): 34 min 38 s, 4 failed (three
of the campaigns, the PyTorch Parsl app's 14-s tries). The campaigns and the timing modules
share the 2 cores in the first 15 minutes whatever their priorities.

Units start heaviest first (timing, Slurm, then :data:`HEAVY_FIRST`, measured by
``--durations``), the rest in collection order, so that no long unit starts last. Without
xdist nothing here is used: a serial run keeps collection order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "HEAVY_FIRST",
    "SLURM_GROUP",
    "SPLIT_MODULES",
    "TIMED_UNIT",
    "TIMING_GROUP",
    "TIMING_MODULES",
    "CAMPAIGN_MODULES",
    "NODE_MODULES",
    "OWN_PACE_MODULES",
    "make_scheduler",
    "mark_units",
    "nice_across_sessions",
    "nice_of",
    "order_serial",
    "start_campaigns_first",
    "unit_of",
    "yield_cpu",
]

SLURM_GROUP = "slurm"
SLURM_PREFIX = "tests/test_slurm_"
TIMING_GROUP = "timing"
TIMED_UNIT = "timed"  # the timing modules, then the Slurm modules

#: The Slurm modules whose tests await the campaigns of ``slurm_campaigns``.
CAMPAIGN_MODULES = ("tests/test_slurm_snakemake_mpi.py", "tests/test_slurm_workflows.py")
#: The other Slurm modules, last: some take nodes down, which the campaigns' jobs use. In this
#: order: after the node-loss tests a node may still be on its way back, and the multi-node
#: tests need all three (one run skipped one of them with multinode last).
NODE_MODULES = (
    "tests/test_slurm_multinode.py",
    "tests/test_slurm_node_loss.py",
    "tests/test_slurm_sbatch.py",
)

#: Modules whose programs run under walltimes of a few seconds (``grep -rn walltime tests``).
TIMING_MODULES = (
    "tests/test_snakemake.py",
    "tests/test_parsl.py",
    "tests/test_run_wrapper.py",
    "tests/test_train_torch.py",
    "tests/test_root_fuzz.py",
    "tests/test_warn_signal.py",
    "tests/test_run_handoff.py",
    "tests/test_damaged_logs.py",
    "tests/test_docs_tutorial.py",
    "tests/test_train_app.py",
    "tests/unit/test_walltime.py",
    "tests/unit/test_warning.py",
    "tests/unit/test_guard.py",
    "tests/unit/test_requeue.py",
    "tests/unit/test_run_logic.py",
    "tests/unit/test_run_engine_dirs.py",
    "tests/unit/test_run_output_folders.py",
)
NICE = 10
TIMING_NICE = -5

#: Modules that race no fixed clock but fit their walltimes to the start-ups they measure when
#: they begin (the demo): a unit of their own at ``nice`` 0, between the timing modules and
#: the rest. At ``nice`` 10 beside the timed unit the demo measured a 60-s PyTorch start-up,
#: gave that task 188-s walltimes and ran past its 14-minute limit.
OWN_PACE_MODULES = ("tests/test_demo.py",)

#: Modules whose tests are independent and long: each test is a unit of its own.
SPLIT_MODULES = frozenset({"tests/test_torchdist.py"})

#: The other units that take longest, in the order they start (after Slurm and timing).
HEAVY_FIRST = (
    "tests/test_demo.py",
    "tests/test_soak.py",
    "tests/test_torchdist.py",
    "tests/test_dtensor.py",
    "tests/test_multinode.py",
    "tests/test_docs_site.py",
    "tests/test_heat_elastic.py",
    "tests/test_mpi_core.py",
    "tests/test_elastic.py",
    "tests/test_faults.py",
    "tests/test_save_rounds.py",
)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _group(nodeid: str) -> str | None:
    module = _module(nodeid)
    if module.startswith(SLURM_PREFIX):
        return SLURM_GROUP
    return TIMING_GROUP if module in TIMING_MODULES else None


def _rank(item: pytest.Item) -> int:
    module = _module(item.nodeid)
    if module in TIMING_MODULES:
        return 0
    if module.startswith(SLURM_PREFIX):
        order = (*CAMPAIGN_MODULES, *NODE_MODULES)
        return 1 + (order.index(module) if module in order else len(order))
    heavy = HEAVY_FIRST.index(module) if module in HEAVY_FIRST else len(HEAVY_FIRST)
    return 2 + len(CAMPAIGN_MODULES) + len(NODE_MODULES) + heavy


def mark_units(items: list[pytest.Item]) -> None:
    """Order the items heaviest unit first (a stable sort: within a unit, collection order;
    in the timed unit, timing modules, campaign modules, then node modules); the scheduler
    hands out the units in this order."""
    items.sort(key=_rank)


CAMPAIGNS_FIXTURE = "slurm_campaigns"


def start_campaigns_first(items: list[pytest.Item]) -> pytest.Item | None:
    """After :func:`mark_units`: where a campaign module's test is among ``items``, the timed
    unit's first test also asks for the session fixture ``slurm_campaigns``, so that the
    campaigns start with it and run while the timing modules do. Returns that test."""
    if not any(_module(item.nodeid) in CAMPAIGN_MODULES for item in items):
        return None
    first = next(item for item in items if _group(item.nodeid) is not None)
    names: list[str] = first.fixturenames  # type: ignore[attr-defined]
    if CAMPAIGNS_FIXTURE not in names:
        names.insert(0, CAMPAIGNS_FIXTURE)
    return first


#: In a serial run, the untimed modules that start many processes (MPI ranks, PyTorch,
#: Chromium): after the campaigns, not beside them (4 MPI ranks beside the campaigns' Slurm
#: jobs timed out at 120 s twice, the same test done in 6 s beside busy loops or another
#: mpiexec job).
SERIAL_AFTER_CAMPAIGNS = tuple(m for m in HEAVY_FIRST if m not in OWN_PACE_MODULES)


def _serial_rank(item: pytest.Item) -> int:
    module = _module(item.nodeid)
    last = 5 + len(NODE_MODULES)
    if module in TIMING_MODULES:
        return last
    if module in OWN_PACE_MODULES:
        return last - 1
    if module in CAMPAIGN_MODULES:
        return 1
    if module in SERIAL_AFTER_CAMPAIGNS:
        return 2
    if module.startswith(SLURM_PREFIX):
        return 3 + (NODE_MODULES.index(module) if module in NODE_MODULES else len(NODE_MODULES))
    return 0


def order_serial(items: list[pytest.Item]) -> pytest.Item | None:
    """Without workers (CI's run): the light tests that race no clock first (single
    processes: the unit tests, the documentation's examples), the Slurm campaigns running
    beside them from the first one on (they wait minutes on Slurm's 1-minute limits and
    little on the CPU); then the campaigns' modules, which find them finished; the untimed
    modules of many processes (:data:`SERIAL_AFTER_CAMPAIGNS`); the other Slurm modules
    (:data:`NODE_MODULES`, in that order); the demo; and the timing modules last, when no
    Slurm job is left to take their start-ups' CPU. A stable sort: collection order within
    each part. Returns the test the campaigns start with (``None``: no campaign module
    selected)."""
    items.sort(key=_serial_rank)
    if not items or not any(_module(item.nodeid) in CAMPAIGN_MODULES for item in items):
        return None
    first = items[0]
    names: list[str] = first.fixturenames  # type: ignore[attr-defined]
    if CAMPAIGNS_FIXTURE not in names:
        names.insert(0, CAMPAIGNS_FIXTURE)
    return first


def nice_of(nodeid: str) -> int | None:
    """The ``nice`` a test asks for (:func:`yield_cpu`); ``None``: it keeps the worker's."""
    group = _group(nodeid)
    if group is not None:
        return TIMING_NICE if group == TIMING_GROUP else None
    return 0 if _module(nodeid) in OWN_PACE_MODULES else NICE


def yield_cpu(item: pytest.Item) -> None:
    """Before each test: a test of the timed unit asks for ``nice`` :data:`TIMING_NICE`
    (allowed to root, as CI runs; elsewhere it stays at 0; the Slurm modules after the timing
    modules keep it, their jobs run at slurmd's), a test of :data:`OWN_PACE_MODULES` for 0,
    and every other unit takes ``nice`` :data:`NICE`, so that a start-up under a walltime of
    seconds gets the CPU before the CPU-bound tests; what the test starts inherits it. A
    worker that took 10 goes back to 0 for the demo only as root."""
    want = nice_of(item.nodeid)
    if want is None or os.getpriority(os.PRIO_PROCESS, 0) == want:
        return
    with contextlib.suppress(PermissionError):  # not root: a lower value than now is refused
        os.setpriority(os.PRIO_PROCESS, 0, want)


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


@contextlib.contextmanager
def nice_across_sessions() -> Iterator[str]:
    """While the suite runs on workers, let ``nice`` rank every process on the machine.

    Linux's autogroup scheduling (on by default) shares the CPU fairly between *sessions*
    and applies ``nice`` only within one. The tests' programs run in sessions of their own
    (``resilient run`` starts its program with ``start_new_session``; slurmd's jobs too),
    so with autogroup on, the priorities :func:`yield_cpu` sets do not reach them: measured
    here, two CPU-bound processes at ``nice`` -5 and 10 on one core got 2.09 s of CPU each
    in 4 s when in two sessions, and the first ran alone until it ended when in one.
    As root (as CI runs), autogroup is switched off for the run and switched back after;
    elsewhere it stays as it is. Yields a line saying which."""
    try:
        before = AUTOGROUP.read_text().strip()
    except OSError:
        yield "no autogroup scheduling here: nice ranks every process"
        return
    if before == "0":
        yield "autogroup scheduling is off: nice ranks every process"
        return
    try:
        AUTOGROUP.write_text("0\n")
    except OSError:
        yield (
            "autogroup scheduling is on and may not be switched off (not root): nice ranks"
            " processes only within a session, the short-walltime tests may lose start-ups"
        )
        return
    try:
        yield f"autogroup scheduling switched off for this run ({AUTOGROUP} = 0, back to {before} after)"
    finally:
        with contextlib.suppress(OSError):
            AUTOGROUP.write_text(before + "\n")


def unit_of(nodeid: str) -> str:
    """The unit of a test, from its node id."""
    if _group(nodeid) is not None:
        return TIMED_UNIT
    module = _module(nodeid)
    return nodeid if module in SPLIT_MODULES else module


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler of ``--dist loadgroup`` here: units as the module docstring says, in the
    order :func:`mark_units` gave."""
    from xdist.scheduler.loadscope import LoadScopeScheduling  # type: ignore[import-untyped]

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc,unused-ignore]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep the order mark_units gave
    return UnitScheduling(config, log)
