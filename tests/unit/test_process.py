"""What ``resilient run`` ends after its program: only the processes of that program's tree
(resilient.job.process.end_what_it_left), never another child or adopted orphan of its own
process (a daemon a test or an engine started, such as slurmd), whose exit status it leaves
for its own wait."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from resilient.job.process import become_subreaper, end_what_it_left, of_tree
from resilient.job.protocol import ENV_TREE

ORPHAN = (
    "import os, sys, time\n"
    "if os.fork() == 0:\n"  # the grandchild, orphaned when its parent exits at once
    "    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "    time.sleep(60)\n"
)


def _orphan(tmp_path: Path, name: str, env: dict[str, str]) -> int:
    """A grandchild left running by a child that exits (adopted by this subreaper)."""
    pidfile = tmp_path / name
    subprocess.run([sys.executable, "-c", ORPHAN, str(pidfile)], env=env, check=True)
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            return int(pidfile.read_text())
        time.sleep(0.01)
    raise AssertionError("the orphan did not start")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_only_the_programs_leftovers_are_killed(tmp_path: Path) -> None:
    assert become_subreaper()
    token = "a" * 32
    mine = _orphan(tmp_path, "program", {**os.environ, ENV_TREE: token})
    other = _orphan(tmp_path, "daemon", {k: v for k, v in os.environ.items() if k != ENV_TREE})
    harness = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])  # another child
    try:
        assert of_tree(mine, token) and not of_tree(other, token)
        while _alive(harness.pid):
            time.sleep(0.01)
        assert end_what_it_left(token, grace_s=0.2) == [mine]
        assert not _alive(mine) and _alive(other)
        assert harness.wait(timeout=5) == 7  # its exit status was left for its own wait
    finally:
        for pid in (mine, other):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
