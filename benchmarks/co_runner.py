"""The bounded co-runner of the `--busy` benchmarks: another torch process doing 1024 x 1024 matmuls on every core
(whatever OMP_* says: it runs with torch's defaults, not this process's thread settings), as a second job on a shared machine does; stopped when the block ends."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

SCRIPT = """
import os, time, torch
torch.set_num_threads(os.cpu_count())
a = torch.randn(1024, 1024)
end = time.time() + 3600
while time.time() < end:
    a @ a
"""


@contextlib.contextmanager
def co_running(settle: float = 2.0):
    """Inside this block a co-running torch process keeps every core busy (it is given `settle` seconds first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
    co = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        time.sleep(settle)
        yield
    finally:
        co.kill()
        co.wait()
