"""Adapter from a torch.distributed process group to :class:`resilient.parallel.comm.Comm`. The sole torch user.

A DDP job launched by ``torchrun``, ``srun`` or ``mpiexec`` has a process group, not an mpi4py
communicator; ``CheckpointManager(root, comm=group)`` wraps it in :class:`TorchComm`, and the
layouts, the commit protocol, validation and rotation are the same as under MPI. Like
:mod:`resilient.parallel.mpi` this module imports nothing from the rest of the library but
:mod:`resilient.errors`, and torch only when a :class:`TorchComm` is made (the caller already holds
a process group, so torch is loaded): ``import resilient`` never imports torch.

Objects travel with torch's object collectives (``all_gather_object``, ``gather_object``,
``broadcast_object_list``, ``scatter_object_list``: pickled, as mpi4py's lower-case methods do); ``any_true`` is one
``all_reduce(MAX)`` of a one-element int tensor.

Backends: tested with gloo on CPU. Under NCCL the object collectives move their bytes through
``torch.cuda.current_device()`` (each rank must have called ``torch.cuda.set_device``), and the
small tensors of ``barrier`` and ``any_true`` are put on that device too.

Waiting: a rank waiting for a slow writer must not spin (on oversubscribed cores it would steal
the writer's core). Gloo's blocking wait already sleeps in a condition variable: a rank waiting
3 s in ``barrier`` or ``all_gather_object`` for a peer used 0.01-0.02 s of CPU here, less than
polling with 0.2-2 ms sleeps (0.05 s). So under gloo every collective simply waits. Other
backends (NCCL's ``wait()`` only orders CUDA streams, and copying the result back may spin in the
CUDA driver) first wait in an asynchronous ``all_reduce`` polled with ``is_completed()`` and short
sleeps, as :class:`resilient.parallel.mpi.MPIComm` does with ``Ibarrier``. Either way a collective fails
after the process group's timeout (torch's default: 30 minutes under gloo), so a writer slower
than that needs ``init_process_group(timeout=...)``.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from resilient.errors import ConfigError
from resilient.parallel.nodes import node_label

__all__ = ["TorchChannel", "TorchComm"]

T = TypeVar("T")

_SLEEP_MIN_S = 0.0002
_SLEEP_MAX_S = 0.002


def _hostname() -> str:
    """This process's node (the key of :meth:`TorchComm.split_node`; tests replace it): the
    launcher's node name where it exports one (``SLURMD_NODENAME``), else the host name."""
    return node_label()


class TorchComm:
    """A :class:`Comm` over a torch.distributed process group.

    Args:
        group: a ``ProcessGroup``, ``torch.distributed.group.WORLD``, the ``torch.distributed``
            module itself, or ``None``: the last two mean the default (world) group. The
            default group must be initialised (``torch.distributed.init_process_group``), and
            this process must be a member of ``group``.

    Ranks are ranks within ``group``; torch's own ``src``/``dst`` arguments are global ranks, and
    the translation happens here.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() before passing a process group as comm"
            )
        if group is dist or group is dist.group.WORLD:
            group = None
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"expected a torch.distributed ProcessGroup, got {type(group).__name__}"
            )
        self.group: Any = group
        self._rank = int(dist.get_rank(group))
        if self._rank < 0:
            raise ConfigError("this process is not a member of the process group passed as comm")
        self._size = int(dist.get_world_size(group))
        self._backend = str(dist.get_backend(group))
        self._node: TorchComm | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def backend(self) -> str:
        """The group's backend (``gloo``, ``nccl``, ...)."""
        return self._backend

    def _global(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (what torch's ``src``/``dst`` want)."""
        if self.group is None:
            return group_rank
        import torch.distributed as dist

        return int(dist.get_global_rank(self.group, group_rank))

    def _device(self) -> Any:
        import torch

        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _wait_polled(self) -> None:
        """Wait for every rank in an asynchronous all_reduce polled with short sleeps."""
        import torch
        import torch.distributed as dist

        token = torch.zeros(1, dtype=torch.int32, device=self._device())
        work = dist.all_reduce(token, group=self.group, async_op=True)
        delay = _SLEEP_MIN_S
        while not work.is_completed():
            time.sleep(delay)
            delay = min(delay * 1.5, _SLEEP_MAX_S)
        work.wait()

    def _settle(self) -> None:
        """Before an object collective: wait without spinning where the backend would spin."""
        if self._size > 1 and self._backend != "gloo":
            self._wait_polled()

    def barrier(self) -> None:
        """Collective: a barrier that sleeps instead of spinning (see the module docstring)."""
        if self._size == 1:
            return
        if self._backend == "gloo":
            import torch.distributed as dist

            dist.barrier(group=self.group)  # waits in a condition variable: measured, no spin
        else:
            self._wait_polled()

    def allgather(self, obj: T) -> list[T]:
        if self._size == 1:
            return [obj]
        import torch.distributed as dist

        self._settle()
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        if self._size == 1:
            return [obj]
        import torch.distributed as dist

        self._settle()
        out: list[Any] | None = [None] * self._size if self._rank == root else None
        dist.gather_object(obj, out, dst=self._global(root), group=self.group)
        return out

    def bcast(self, obj: T, root: int = 0) -> T:
        if self._size == 1:
            return obj
        import torch.distributed as dist

        self._settle()
        box: list[Any] = [obj if self._rank == root else None]
        dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        result: T = box[0]
        return result

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        if self._size == 1:
            assert objs is not None
            return objs[0]
        import torch.distributed as dist

        self._settle()
        box: list[Any] = [None]
        mine = list(objs) if self._rank == root and objs is not None else None
        dist.scatter_object_list(box, mine, src=self._global(root), group=self.group)
        result: T = box[0]
        return result

    def any_true(self, flag: bool) -> bool:
        """Collective: logical OR of ``flag`` over ranks (one small all_reduce, no barrier)."""
        if self._size == 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def split_node(self) -> TorchComm:
        """Collective: the ranks of this group on this host (built once, then cached).

        Hostnames are gathered; the ranks of each host form one group, in the order of their
        lowest rank. torch requires every process of the *job* to call ``new_group`` for every
        new group, in the same order: over the world group every rank does so for every host.
        Over a smaller group (whose other processes are not here) each rank creates only its
        own host's group, with ``use_local_synchronization`` (torch >= 2.1).
        """
        if self._node is None:
            self._node = self._split_by(_hostname())
        return self._node

    def split(self, color: int) -> TorchComm:
        """Collective: the ranks of this group passing the same ``color`` (a new group, made as
        :meth:`split_node` makes its)."""
        return self._split_by(color)

    def _split_by(self, label: object) -> TorchComm:
        labels = self.allgather(label)
        by_label: dict[object, list[int]] = {}
        for r, value in enumerate(labels):
            by_label.setdefault(value, []).append(r)
        if len(by_label) == 1:
            return self
        import torch.distributed as dist

        backend = self._backend
        if self.group is None:
            made: Any = None
            for members in by_label.values():  # dict order: by lowest rank, the same everywhere
                pg = dist.new_group(ranks=members, backend=backend)
                if members == by_label[label]:
                    made = pg
        else:
            ranks = [self._global(r) for r in by_label[label]]
            made = dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=True)
        return TorchComm(made)

    def channel(self) -> TorchChannel:
        """Collective: a :class:`TorchChannel` on a new gloo group of this group's ranks
        (gloo whatever this group's backend: the bytes are on the CPU)."""
        import torch.distributed as dist

        if self.group is None:
            group = dist.new_group(backend="gloo")
        else:
            ranks = [self._global(r) for r in range(self._size)]
            group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        return TorchChannel(group, [self._global(r) for r in range(self._size)])


class TorchChannel:
    """Point-to-point transfers of bytes with gloo's ``send``/``recv`` on a group of their own
    (gloo's blocking wait sleeps in a condition variable: no spinning)."""

    def __init__(self, group: Any, global_ranks: list[int]) -> None:
        self.group = group
        self._global = global_ranks

    def send(self, dest: int, data: bytes | bytearray | memoryview) -> None:
        import torch
        import torch.distributed as dist

        if len(data) == 0:
            return
        if isinstance(data, bytes):
            data = bytearray(data)  # torch.frombuffer wants a writable buffer
        tensor = torch.frombuffer(data, dtype=torch.uint8)
        dist.send(tensor, dst=self._global[dest], group=self.group)

    def recv(self, source: int, into: bytearray | memoryview) -> None:
        import torch
        import torch.distributed as dist

        if len(into) == 0:
            return
        tensor = torch.frombuffer(into, dtype=torch.uint8)
        dist.recv(tensor, src=self._global[source], group=self.group)
