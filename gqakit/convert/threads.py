"""Run a stretch of many small ops on one thread.

On CPU every torch op large enough to parallelise is an OpenMP region that waits for all its threads. Thousands of tiny
problems (a 256 x 256 eigvalsh per candidate group) gain little from a second thread when the machine is quiet, and when
another job shares the cores each region waits for a thread that is not scheduled: the merge's group search measured
4-6x slower beside one co-running torch process with 2 threads, and about 1.5x on one (benchmarks/merge_layer.py
--busy). LAPACK decompositions are worse still: an SVD of a 64 x 1024 matrix ran 500x slower beside the co-runner (its
regions are many and small), so `lapack` runs every decomposition of the merges on one thread. One thread also makes the
stretch's rounding independent of the machine's core count.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside the block, restored after (the process-wide setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lapack(fn, *args, **kwargs):
    """fn(*args, **kwargs) (a torch.linalg decomposition) on one thread."""
    with one_thread():
        return fn(*args, **kwargs)
