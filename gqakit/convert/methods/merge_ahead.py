"""Layer merges (`aligned`, `fit`) computed ahead of the writer, several side by side, each on one thread.

A merge on all of torch's threads slows 3-4x beside another process that shares the cores: each of its ops
waits at its end for a thread that is not scheduled (benchmarks/merge_layer.py --busy). On one thread the
same merge slows about 1.5x. Layers are independent, so `workers` merges run at once, each on one thread:
on a quiet machine the cores are as busy as one merge on all of them would keep them, and on a shared one a
descheduled thread delays its own layer only. Each layer's result is the same whatever the number of
workers (every merge runs on one thread).

Memory: at most `workers` layers are being merged or wait, merged, for the writer: `workers` x one layer's
merge (147 MiB above its weights at Llama-2-7B's shape, docs/results/merge-memory.md) plus their merged tensors.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

import torch

from gqakit.common.cpu_split import on_one_thread, one_threaded_pool, restore_threads
from gqakit.convert.threads import one_thread

T = TypeVar("T")
MAX_WORKERS = 8  # bounds the memory above; more cores than this add little to a write pass of byte copies


def merge_workers(layers: int) -> int:
    """Layers merged side by side: torch's intra-op threads, at most MAX_WORKERS and the number of layers."""
    return max(1, min(torch.get_num_threads(), MAX_WORKERS, layers))


class MergeAhead(Generic[T]):
    """`merge(layer)` for the layers in `order`, up to `workers` of them ahead of the one asked for; `get` returns
    a layer's result (raising its error) in any order, `close` cancels what has not started and waits for the
    rest (their inputs may be in a folder the caller removes next)."""

    def __init__(self, order: Sequence[int], merge: Callable[[int], T], workers: int):
        self.merge, self.order, self.next = merge, list(order), 0
        self.workers = workers
        self.threads = torch.get_num_threads()
        self.pool = one_threaded_pool(workers, "gqakit-merge") if workers > 1 else None
        self.futures: dict[int, Future] = {}
        self.started: set[int] = set()

    def _fill(self) -> None:
        while len(self.futures) < self.workers and self.next < len(self.order):
            layer = self.order[self.next]
            self.next += 1
            if layer not in self.started:
                self.started.add(layer)
                self.futures[layer] = self.pool.submit(on_one_thread(self.merge), layer)

    def get(self, layer: int) -> T:
        if self.pool is None:
            with one_thread():  # as in a pool thread: the same bits whatever the workers
                return self.merge(layer)
        if layer not in self.futures:
            self._fill()
        future = self.futures.pop(layer, None)
        if future is None:  # not among the layers ahead (asked for out of order, or again): merged on its own
            self.started.add(layer)
            future = self.pool.submit(on_one_thread(self.merge), layer)
        try:
            return future.result()
        finally:
            self._fill()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            restore_threads(self.threads)
            self.futures.clear()
