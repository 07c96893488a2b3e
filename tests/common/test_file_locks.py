"""gqakit.common.file_locks: a lock taken by a process whose forked child outlives it is free once it dies.

`datasets.map(num_proc=N)` forks workers while gqakit holds a token cache's lock and the run's uptrain.lock; a
review killed a run (SIGKILL) mid-tokenisation and the orphaned workers kept both locks: the next run waited on
the cache forever, or was told the run folder was in use by a dead pid. Here a process takes each lock, forks a
child that would sleep for a minute, and dies without letting go."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fcntl")

HOLDER = """
import os, sys, time
from pathlib import Path
kind, path = sys.argv[1], Path(sys.argv[2])
if kind == "cache":
    from gqakit.uptrain.data.token_build import _locked
    hold = _locked(path)
else:
    from gqakit.uptrain.run.lock import run_lock
    hold = run_lock(path, notice=lambda line: None)
with hold:
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)  # dies holding the lock, as under SIGKILL: nothing is released in Python
"""


@pytest.mark.parametrize("kind", ["cache", "run"])
def test_a_dead_holders_forked_child_keeps_neither_the_lock_nor_running(tmp_path, kind):
    import fcntl
    import os

    path = tmp_path / ("cache.lock" if kind == "cache" else "run")
    done = subprocess.run([sys.executable, "-c", HOLDER, kind, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.strip())
    lock_file = path if kind == "cache" else path / "uptrain.lock"
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the child held it
    for _ in range(100):  # killed with its parent (PR_SET_PDEATHSIG); a zombie is reaped by init
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        pytest.fail(f"the forked child {child} outlived its parent")
