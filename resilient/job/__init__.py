"""A job's life: the time loop, its walltime and signals, and ``resilient run`` around it.

Owns, the program's side:
    :mod:`.session`: :class:`~.session.Session`, a time loop that saves before the walltime and exits 75.
    :mod:`.resumable`: ``@resumable``, an in-process function re-run from its latest valid checkpoint.
    :mod:`.slurm`: the deadline and the stop signals (Slurm's environment, ``squeue``).
    :mod:`.flux`: Flux's time limit (SIGALRM, then SIGKILL in 5 s) and ``flux job timeleft``.
    :mod:`.warning`: the warning signal held back until the program listens, then ignored.
    :mod:`.timeline`: where each attempt's time went (the events a Session records).
    :mod:`.handoff`: the file a Session names its checkpoint directory in, for ``resilient run``.
    :mod:`.launch`: which MPI launcher starts ranks.

Owns, ``resilient run``'s side (a program run resumably, retried and requeued by exit code):
    :mod:`.run`: the loop: checks before the first attempt, the attempts, the requeue.
    :mod:`.options`: :class:`~.options.RunOptions`, its command line and its parser.
    :mod:`.ledger`: the attempts' ledger, its typed records, where it is kept, its sidecar.
    :mod:`.process`: the program's process tree, the signals sent to it, one launch of it.
    :mod:`.outcome`: one attempt's reason and exit code, as named rules.
    :mod:`.outputs`: the task's declared outputs, never the checkpoint directory.
    :mod:`.requeue`: requeue in place on Slurm (and the simulated walltime's requeue).
    :mod:`.guard`: an engine's retry after a run ended for good, refused at once.
    :mod:`.nodeloss`: the nodes Slurm lost under an attempt.
    :mod:`.steps`: a job step narrower than its job.

Shared by both:
    :mod:`.exitcodes`: the exit-code contract and the named rules over it.
    :mod:`.protocol`: what the program and ``resilient run`` tell each other (environment
    variables, files).

May import: :mod:`resilient.checkpoint` and everything below it. Knows nothing of Snakemake or
Parsl: those are :mod:`resilient.integrations`, above.
"""
