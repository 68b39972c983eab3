"""as_comm: what it accepts, decided without importing torch or mpi4py."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from resilient.parallel.comm import SerialComm, _is_torch_group, as_comm


def fake(module: str, name: str) -> Any:
    """An instance of a class named ``name`` that claims to live in ``module``."""
    return type(name, (), {"__module__": module})()


def test_torch_process_groups_are_recognised_by_name() -> None:
    assert _is_torch_group(fake("torch.distributed.distributed_c10d", "ProcessGroup"))
    assert _is_torch_group(fake("torch._C._distributed_c10d", "ProcessGroup"))  # torch 2.1
    assert _is_torch_group(fake("torch._C._distributed_c10d", "ProcessGroupGloo"))
    assert _is_torch_group(types.ModuleType("torch.distributed"))


def test_other_objects_are_not_torch_groups() -> None:
    assert not _is_torch_group(fake("torchvision.ops", "ProcessGroup"))
    assert not _is_torch_group(fake("torch.nn", "Module"))
    assert not _is_torch_group(fake("mpi4py.MPI", "Intracomm"))
    assert not _is_torch_group(types.ModuleType("torch"))
    assert not _is_torch_group(None)
    assert not _is_torch_group(SerialComm())


def test_as_comm_passes_comms_through_and_rejects_strangers() -> None:
    assert isinstance(as_comm(None), SerialComm)
    comm = SerialComm()
    assert as_comm(comm) is comm
    with pytest.raises(TypeError, match=r"torch\.distributed process group"):
        as_comm(object())


def test_recognising_a_group_does_not_import_torch() -> None:
    had_torch = "torch" in sys.modules
    _is_torch_group(fake("torch.distributed.distributed_c10d", "ProcessGroup"))
    _is_torch_group(object())
    assert ("torch" in sys.modules) == had_torch
