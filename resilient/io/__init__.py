"""File I/O of one process: a checkpoint's files written, read, fsynced, committed and checked.

Owns, from the top (one module a line):

* :mod:`.moves`: a committed step's bytes moved from one target into another's pending step
* :mod:`.runkey`: a run's identity, recorded in its checkpoint directory
* :mod:`.repair`: a damaged copy of the static data repaired from the intact one
* :mod:`.checkpoints`: finding and validating checkpoints in a target (the CLI's and the coordinator's)
* :mod:`.targets`: where checkpoints live: the storage target protocol and its implementations
* :mod:`.commit`: a save's temporary directory, from creation to the atomic rename
* :mod:`.xorwire`: XOR parity computed and a lost member rebuilt over a channel
* :mod:`.wire`: files sent and received over a channel (partner copies and their rebuild)
* :mod:`.skeleton`: a data file's HDF5 bytes, built once on its group's leader and kept
* :mod:`.manifests`: a committed set's marker, manifest and manifest shards, read and checked
* :mod:`.fileio`: data files byte by byte (``pwrite``/``preadv``, ``O_DIRECT``, fsync, reuse)
* :mod:`.devicecopy`: device tensors copied once into a reused, pinned host arena
* :mod:`.storage`: the root, its lock, durable small files, quarantine, transient retries
* :mod:`.logs`: the append-only logs (record shapes, the one tolerant reader, the one append)
* :mod:`.staging`: the buffers of an asynchronous save
* :mod:`.background`: one piece of local work on a thread, its outcome kept
* :mod:`.digests`: checksums of file ranges as they are read, and of arrays on a helper thread
* :mod:`.idle`: CPU work done between the runs of a write

May import: :mod:`resilient.model` and :mod:`resilient.errors`. Never a communicator: what
happens here happens on one rank; agreeing on it is :mod:`resilient.parallel`'s, above.
"""
