"""The bounded co-runner of the `--busy` benchmarks: another torch process doing 1024 x 1024 matmuls on every core
(whatever OMP_NUM_THREADS says), as a second job on a shared machine does; stopped when the block ends."""
from __future__ import annotations

import contextlib
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
    co = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle)
        yield
    finally:
        co.kill()
        co.wait()
