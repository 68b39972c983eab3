"""Ranks and their agreement: the communicator the core talks to and the one way ranks agree.

Owns:
    :mod:`.comm` (:class:`~.comm.Comm`: serial, MPI or torch.distributed, chosen at run time),
    :mod:`.mpi` (the sole mpi4py user), :mod:`.torchdist` (the sole torch.distributed user),
    :mod:`.collective` (:class:`~.collective.Collective`: every step succeeds on all ranks or
    raises the same error on all), :mod:`.setcomms` (which ranks write which file: the layout),
    :mod:`.nodes` (what a node is called, from the launcher's environment, and its node-local
    paths).

May import: :mod:`resilient.model` and :mod:`resilient.errors`; mpi4py and torch only in
:mod:`.mpi` and :mod:`.torchdist`, lazily. Knows nothing of files (:mod:`resilient.io`).
"""
