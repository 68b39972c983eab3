"""`RunOptions.argv()` writes the command line that `resilient run`'s parser reads back: the
options are spelled once (the parser and RunOptions cannot drift apart)."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilient.job.options import (
    RunOptions,
    build_parser,
    format_duration,
    options_from_args,
    parse_duration,
)

# a value other than the default for every field of RunOptions
OTHER: dict[str, Any] = {
    "checkpoint_dir": Path("a dir/ck"),
    "walltime_s": 90.5,
    "warn_signal": signal.SIGUSR2,
    "warn_before_s": 0.25,
    "kill_wait_s": 0.0,
    "max_no_progress": 5,
    "retries": 3,
    "requeue": True,
    "backoff_s": 0.5,
    "backoff_max_s": 7.0,
    "task": "sim case=a",
    "outputs": (Path("out/a.h5"), Path("out b")),
}


def parse(argv: list[str]) -> RunOptions:
    return options_from_args(build_parser().parse_args(argv), environ={})


def test_every_field_has_a_value_to_round_trip() -> None:
    assert set(OTHER) | {"command"} == {f.name for f in dataclasses.fields(RunOptions)}


@pytest.mark.parametrize("name", sorted(OTHER))
def test_each_option_round_trips(name: str) -> None:
    extra = {"walltime_s": 60.0} if name == "requeue" else {}  # --requeue needs a walltime
    if name == "warn_signal":
        extra = {"warn_before_s": 30.0}  # the command line names the signal with its lead
    opts = RunOptions(command=("prog", "-x", "--", "a b"), **{name: OTHER[name], **extra})
    assert parse(opts.argv()) == opts


def test_all_options_at_once_and_none_round_trip() -> None:
    opts = RunOptions(command=("mpiexec", "-n", "4", "./sim"), **OTHER)
    assert parse(opts.argv()) == opts
    plain = RunOptions(command=("true",))
    assert plain.argv() == ["--", "true"]  # the defaults are left to resilient run
    assert parse(plain.argv()) == plain


def test_a_signal_without_its_lead_has_no_command_line() -> None:
    with pytest.raises(ValueError, match="SIG@SECONDS"):
        RunOptions(command=("p",), warn_signal=signal.SIGUSR2).argv()


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_format_duration_reads_back_exactly(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds
