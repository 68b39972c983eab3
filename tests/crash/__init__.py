"""Crash-state testing (ALICE's method, in process): record an operation's file-system calls
(:mod:`tests.crash.record`), build every state a crash could leave under ext4's and XFS's
rules (:mod:`tests.crash.states`), and check each as a user would see it
(:mod:`tests.crash.check`); the operations (:mod:`tests.crash.ops`) and the matrix
(:mod:`tests.crash.matrix`, ``bench/bench_crash.py``)."""
