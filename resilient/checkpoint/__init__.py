"""Checkpoints of a set of ranks: saving, committing, restoring, rotating. Collective.

Owns, from the top:
    :mod:`.manager` (:class:`~.manager.CheckpointManager`: steps, policies, rotation; the
    public API of the core), :mod:`.saving` (a save from plan to commit, at most one in flight,
    the local tier's flush), :mod:`.tiers` (the node-local tier), :mod:`.partner` (partner
    copies of the local tier), :mod:`.restorer` (the newest valid checkpoint, with fallback),
    :mod:`.catalog` (what the coordinator knows of a root), :mod:`.statics` (static data,
    saved once), :mod:`.saveset` (one save of a set: plan, write, finish),
    :mod:`.reading` (one rank's read), :mod:`.elastic` (a read on another rank count).

May import: :mod:`resilient.io`, :mod:`resilient.parallel`, :mod:`resilient.model`,
:mod:`resilient.errors`. Knows nothing of Slurm, launchers, signals or workflow engines.
"""
