"""How the suite is spread over pytest-xdist workers (tests/scheduling.py): pure logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import scheduling


@dataclass
class Item:
    """What scheduling reads of a pytest item: its node id and its markers."""

    nodeid: str
    markers: list[Any] = field(default_factory=list)

    def get_closest_marker(self, name: str) -> Any:
        return next((m for m in reversed(self.markers) if m.name == name), None)

    def add_marker(self, marker: Any) -> None:
        self.markers.append(getattr(marker, "mark", marker))


def units(items: list[Item]) -> list[tuple[str, str | None]]:
    scheduling.mark_units(items)  # type: ignore[arg-type]
    out = []
    for item in items:
        group = item.get_closest_marker("xdist_group")
        out.append((item.nodeid, group.args[0] if group else None))
    return out


def test_slurm_tests_are_one_unit_first_then_the_timing_unit_then_the_heavy_modules() -> None:
    items = [
        Item("tests/unit/test_tree.py::test_a"),
        Item("tests/test_soak.py::test_b"),
        Item("tests/test_warn_signal.py::test_local"),
        Item("tests/test_warn_signal.py::test_srun", [pytest.mark.slurm.mark]),
        Item("tests/test_slurm_multinode.py::test_lost", [pytest.mark.multinode.mark]),
        Item("tests/test_demo.py::test_demo"),
    ]
    assert units(items) == [
        ("tests/test_warn_signal.py::test_srun", "slurm"),
        ("tests/test_slurm_multinode.py::test_lost", "slurm"),
        ("tests/test_warn_signal.py::test_local", "timing"),
        ("tests/test_demo.py::test_demo", "timing"),
        ("tests/test_soak.py::test_b", None),
        ("tests/unit/test_tree.py::test_a", None),
    ]


def test_a_unit_is_a_group_a_split_test_or_a_module() -> None:
    assert scheduling.unit_of("tests/test_slurm_sbatch.py::test_array@slurm") == "slurm"
    one = "tests/test_torchdist.py::test_round_trip_is_bit_identical[4]"
    assert scheduling.unit_of(one) == one
    assert scheduling.unit_of("tests/unit/test_tree.py::test_a[x]") == "tests/unit/test_tree.py"
    assert scheduling.unit_of("docs/tutorial.md::line:12,column:1") == "docs/tutorial.md"
