"""How the suite is spread over pytest-xdist workers (tests/scheduling.py): pure logic."""

from __future__ import annotations

from dataclasses import dataclass

from tests import scheduling


@dataclass
class Item:
    """What scheduling reads of a pytest item: its node id."""

    nodeid: str


def test_the_timed_unit_starts_first_slurm_then_timing_then_the_heavy_modules_then_the_rest() -> None:
    items = [
        Item("tests/unit/test_tree.py::test_a"),
        Item("tests/test_soak.py::test_b"),
        Item("tests/test_warn_signal.py::test_local"),
        Item("tests/test_slurm_multinode.py::test_lost"),
        Item("tests/test_demo.py::test_demo"),
    ]
    scheduling.mark_units(items)  # type: ignore[arg-type]
    got = [(item.nodeid, scheduling.unit_of(item.nodeid)) for item in items]
    assert got == [
        ("tests/test_slurm_multinode.py::test_lost", "timed"),
        ("tests/test_warn_signal.py::test_local", "timed"),
        ("tests/test_demo.py::test_demo", "timed"),
        ("tests/test_soak.py::test_b", "tests/test_soak.py"),
        ("tests/unit/test_tree.py::test_a", "tests/unit/test_tree.py"),
    ]


def test_a_unit_is_the_timed_unit_a_split_test_or_a_module() -> None:
    assert scheduling.unit_of("tests/test_slurm_sbatch.py::test_array[x]") == "timed"
    assert scheduling.unit_of("tests/test_parsl.py::test_flow") == "timed"
    one = "tests/test_torchdist.py::test_round_trip_is_bit_identical[4]"
    assert scheduling.unit_of(one) == one
    assert scheduling.unit_of("tests/unit/test_tree.py::test_a[x]") == "tests/unit/test_tree.py"
    assert scheduling.unit_of("docs/tutorial.md::line:12,column:1") == "docs/tutorial.md"
