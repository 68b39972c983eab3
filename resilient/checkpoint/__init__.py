"""Checkpoints of a set of ranks: saving, committing, restoring, rotating. Collective.

Owns, from the top (one module a line):

* :mod:`.manager`: :class:`~.manager.CheckpointManager`, steps, policies, rotation (the core's API)
* :mod:`.saving`: a save from plan to commit, at most one in flight, the local tier's flush
* :mod:`.savepaths`: where a save is committed (the shared root or every node's local tier)
* :mod:`.tiers`: the node-local tier
* :mod:`.localelastic`: an elastic restore from the node-local tier (a step staged)
* :mod:`.partner`: partner copies of the local tier
* :mod:`.restorer`: the newest valid checkpoint, with fallback
* :mod:`.catalog`: what the coordinator knows of a checkpoint directory
* :mod:`.statics`: static data, saved once
* :mod:`.saveset`: one save of a set (plan, write, finish)
* :mod:`.reading`: one rank's read
* :mod:`.elastic`: a read on another rank count

May import: :mod:`resilient.io`, :mod:`resilient.parallel`, :mod:`resilient.model`,
:mod:`resilient.errors`. Knows nothing of Slurm, launchers, signals or workflow engines.
"""
