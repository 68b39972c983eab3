"""A job's life: the time loop, its walltime and signals, and ``resilient run`` around it.

Owns:
    :mod:`.session` (:class:`~.session.Session`: a time loop that saves before the walltime
    and exits 75), :mod:`.resumable` (``@resumable``: an in-process function re-run from its
    latest valid checkpoint), :mod:`.slurm` (the deadline and stop signals), :mod:`.run`
    (``resilient run``: a program run resumably, retried and requeued by exit code),
    :mod:`.exitcodes` (the exit-code contract), :mod:`.launch` (which MPI launcher starts
    ranks), :mod:`.timeline` (where each attempt's time went: the events a Session records
    and the phases ``resilient report`` adds up), :mod:`.guard` (an engine's retry after a
    run ended for good), :mod:`.requeue` (requeue in place on Slurm), :mod:`.steps` (a job
    step narrower than its job).

May import: :mod:`resilient.checkpoint` and everything below it. Knows nothing of Snakemake or
Parsl: those are :mod:`resilient.integrations`, above.
"""
