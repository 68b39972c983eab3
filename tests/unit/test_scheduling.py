"""How the suite is spread over pytest-xdist workers (tests/scheduling.py): pure logic."""

from __future__ import annotations

from dataclasses import dataclass

from tests import scheduling


@dataclass
class Item:
    """What scheduling reads of a pytest item: its node id."""

    nodeid: str


def test_the_timed_unit_starts_first_timing_then_campaigns_then_nodes_then_heavy_then_rest() -> None:
    items = [
        Item("tests/unit/test_tree.py::test_a"),
        Item("tests/test_soak.py::test_b"),
        Item("tests/test_slurm_multinode.py::test_lost"),
        Item("tests/test_slurm_workflows.py::test_flow"),
        Item("tests/test_warn_signal.py::test_local"),
        Item("tests/test_demo.py::test_demo"),
    ]
    scheduling.mark_units(items)  # type: ignore[arg-type]
    got = [(item.nodeid, scheduling.unit_of(item.nodeid)) for item in items]
    assert got == [
        ("tests/test_warn_signal.py::test_local", "timed"),
        ("tests/test_slurm_workflows.py::test_flow", "timed"),
        ("tests/test_slurm_multinode.py::test_lost", "timed"),
        ("tests/test_demo.py::test_demo", "tests/test_demo.py"),
        ("tests/test_soak.py::test_b", "tests/test_soak.py"),
        ("tests/unit/test_tree.py::test_a", "tests/unit/test_tree.py"),
    ]


@dataclass
class FunctionItem(Item):
    """A test function's item: it also has the fixtures it asks for."""

    fixturenames: list[str]


def test_the_campaigns_start_with_the_timed_units_first_test_only_when_selected() -> None:
    items = [
        FunctionItem("tests/test_soak.py::test_b", ["tmp_path"]),
        FunctionItem("tests/test_slurm_workflows.py::test_flow", ["slurm_scenarios"]),
        FunctionItem("tests/test_parsl.py::test_app", ["tmp_path"]),
    ]
    scheduling.mark_units(items)  # type: ignore[arg-type]
    first = scheduling.start_campaigns_first(items)  # type: ignore[arg-type]
    assert first is not None and id(first) == id(items[0])
    assert first.nodeid == "tests/test_parsl.py::test_app"
    assert items[0].fixturenames == ["slurm_campaigns", "tmp_path"]
    assert [i.fixturenames for i in items[1:]] == [["slurm_scenarios"], ["tmp_path"]]
    again = scheduling.start_campaigns_first(items)  # type: ignore[arg-type]
    assert again is first  # asked for once
    assert items[0].fixturenames == ["slurm_campaigns", "tmp_path"]
    no_campaign = [FunctionItem("tests/test_parsl.py::test_app", ["tmp_path"])]
    assert scheduling.start_campaigns_first(no_campaign) is None  # type: ignore[arg-type]
    assert no_campaign[0].fixturenames == ["tmp_path"]


def test_a_unit_is_the_timed_unit_a_split_test_or_a_module() -> None:
    assert scheduling.unit_of("tests/test_slurm_sbatch.py::test_array[x]") == "timed"
    assert scheduling.unit_of("tests/test_parsl.py::test_flow") == "timed"
    assert scheduling.unit_of("tests/test_demo.py::test_the_demo") == "tests/test_demo.py"
    one = "tests/test_torchdist.py::test_round_trip_is_bit_identical[4]"
    assert scheduling.unit_of(one) == one
    assert scheduling.unit_of("tests/unit/test_tree.py::test_a[x]") == "tests/unit/test_tree.py"
    assert scheduling.unit_of("docs/tutorial.md::line:12,column:1") == "docs/tutorial.md"


def test_timing_tests_ask_for_the_cpu_first_the_demo_next_the_rest_last() -> None:
    assert scheduling.nice_of("tests/test_parsl.py::test_app") == scheduling.TIMING_NICE == -5
    assert scheduling.nice_of("tests/test_slurm_sbatch.py::test_chain") is None  # keeps -5
    assert scheduling.nice_of("tests/test_demo.py::test_the_demo_on_two_ranks") == 0
    assert scheduling.nice_of("tests/test_soak.py::test_b") == scheduling.NICE == 10
    assert scheduling.nice_of("docs/tutorial.md::line:12,column:1") == 10


def test_a_serial_run_puts_the_untimed_tests_first_with_the_campaigns_and_timing_last() -> None:
    items = [
        FunctionItem("tests/test_demo.py::test_demo", ["tmp_path"]),
        FunctionItem("tests/test_warn_signal.py::test_local", ["tmp_path"]),
        FunctionItem("tests/test_slurm_sbatch.py::test_chain", ["tmp_path"]),
        FunctionItem("tests/test_slurm_workflows.py::test_flow", ["slurm_scenarios"]),
        FunctionItem("tests/test_slurm_multinode.py::test_lost", ["tmp_path"]),
        FunctionItem("tests/test_soak.py::test_b", ["tmp_path"]),
        FunctionItem("tests/unit/test_tree.py::test_a", []),
    ]
    first = scheduling.order_serial(items)  # type: ignore[arg-type]
    assert [i.nodeid.split("::")[0].removeprefix("tests/") for i in items] == [
        "unit/test_tree.py", "test_slurm_workflows.py", "test_soak.py",
        "test_slurm_multinode.py", "test_slurm_sbatch.py", "test_demo.py",
        "test_warn_signal.py",
    ]  # fmt: skip
    assert first is not None and id(first) == id(items[0])
    assert items[0].fixturenames == ["slurm_campaigns"]
    assert [i.fixturenames for i in items[1:3]] == [["slurm_scenarios"], ["tmp_path"]]
    no_campaign = [FunctionItem("tests/test_parsl.py::test_app", ["tmp_path"])]
    assert scheduling.order_serial(no_campaign) is None  # type: ignore[arg-type]
    assert no_campaign[0].fixturenames == ["tmp_path"]
