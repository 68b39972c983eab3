"""Checkpoints of a set of ranks: saving, committing, restoring, rotating. Collective.

Owns, from the top (one module a line):

* :mod:`.manager`: :class:`~.manager.CheckpointManager`, steps, policies, rotation (the core's API)
* :mod:`.saving`: a save from plan to commit, at most one in flight
* :mod:`.tiermanager`: the node-local tier as a manager of its own (its commits, partner copies,
  flushes and restore chain)
* :mod:`.savepaths`: where saves are committed (the shared root alone, or a node-local tier);
  the shared root's records
* :mod:`.tierstaging`: the tier's staging of an elastic restore
* :mod:`.tiers`: the node-local tier's copies on disk
* :mod:`.redundancy`: what ``redundancy=`` names (the scheme that protects the local tier)
* :mod:`.xorsets`: XOR parity of the local tier over sets of nodes
* :mod:`.partner`: partner copies of the local tier
* :mod:`.restorer`: the newest valid checkpoint, with fallback
* :mod:`.catalog`: what the coordinator knows of a checkpoint directory
* :mod:`.statics`: static data, saved once
* :mod:`.saveset`: one save of a set (plan, write, finish)
* :mod:`.reading`: one rank's read
* :mod:`.elasticread`: an elastic restore's plan and reads (another rank count or decomposition)

May import: :mod:`resilient.io`, :mod:`resilient.parallel`, :mod:`resilient.model`,
:mod:`resilient.errors`. Knows nothing of Slurm, launchers, signals or workflow engines.
"""
