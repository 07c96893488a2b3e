"""Split independent CPU work over Python threads whose torch ops each run on one core.

On CPU every torch op is a parallel region: its threads split the op and all wait at its end. The tiled
kernel issues hundreds of small ops (a few per score tile), so on a machine shared with another process
one descheduled thread stalls every op, and the kernel slows far more than torch's fused sdpa, which
waits once per call (issue 22: 3.7x sdpa beside one co-running process at T = 4,096). Here the kernel's
query blocks are dealt out to as many Python threads as torch has intra-op threads; each thread runs its
blocks' ops single-threaded (torch releases the GIL inside an op), so the threads meet once per call,
as sdpa's do, and a descheduled thread delays only its own share. The caller's own ops (set-up, a small
call's blocks, the sums at the end) run on one thread too (`one_thread_here`): left on torch's threads, a
small call's hundreds of ops each waited for every thread, and beside even a `nice -n 19` busy loop it ran
28-41x sdpa (issue 33).

The deal is fixed by the blocks' costs (largest first onto the least-loaded thread), never by timing, so a
result depends on the number of threads and the call's size only: the same inputs give the same bits on every
call, and every op runs single-threaded whichever path a call takes.
`one_threaded_pool` serves the conversion's layer merges the same way (`convert/methods/merge_ahead.py`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
_local = threading.local()  # .worker: a pool thread; .held: the caller's thread count inside one_thread_here
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def _start_worker() -> None:
    _local.worker = True


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: it starts its own pool when it first needs one."""
    global _pool, _pool_size, _lock
    _pool, _pool_size, _lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def on_one_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """fn, called on a pool thread with torch's ops there on that thread alone and the caller's grad mode."""
    grad = torch.is_grad_enabled()

    def call(*args, **kwargs) -> T:
        torch.set_num_threads(1)  # on every call: torch may re-apply the process default to a thread lazily
        with torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    return call


def one_threaded_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads say they are pool threads (`split_count` is 1 there: no nesting); submit
    `on_one_thread(fn)` to it, and call `restore_threads` with the caller's thread count when done."""
    return ThreadPoolExecutor(workers, name, initializer=_start_worker)


def restore_threads(threads: int) -> None:
    """A pool thread's set_num_threads(1) also sets the default of threads started later: put it back."""
    torch.set_num_threads(threads)


def split_count(device: torch.device) -> int:
    """How many threads a kernel on `device` is split over: torch's intra-op threads on CPU; 1 elsewhere, under
    torch.compile (traced code must not start threads), inside a pool thread (no nesting), or with one thread."""
    if device.type != "cpu" or getattr(_local, "worker", False) or torch.compiler.is_compiling():
        return 1
    held = getattr(_local, "held", None)
    return max(1, held if held is not None else torch.get_num_threads())


@contextlib.contextmanager
def one_thread_here(device: torch.device):
    """The block's torch ops on this thread alone (no op waits for other threads), torch's thread setting put back
    at the end; `split_count` inside still says the caller's count, so `run_split` deals work over that many
    one-thread workers. Nested blocks, pool threads, other devices and traced code are left as they are."""
    if (device.type != "cpu" or getattr(_local, "worker", False) or getattr(_local, "held", None) is not None
            or torch.compiler.is_compiling() or torch.get_num_threads() == 1):
        yield
        return
    threads = torch.get_num_threads()
    _local.held = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _local.held = None
        restore_threads(threads)


def first_arg_on_one_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """fn inside `one_thread_here` on the device of its first argument (a tensor)."""
    @functools.wraps(fn)
    def call(first: torch.Tensor, *args, **kwargs) -> T:
        with one_thread_here(first.device):
            return fn(first, *args, **kwargs)

    return call


def deal(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices of `costs` dealt into `parts` lists of about equal total cost: largest first, each onto the list
    with the least so far (ties: the lower list); each list in increasing index order. Empty lists are dropped."""
    loads = [0.0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(parts), key=lambda j: (loads[j], j))
        loads[j] += costs[i]
        out[j].append(i)
    return [sorted(part) for part in out if part]


def run_split(fn: Callable[[list[int]], T], parts: list[list[int]]) -> list[T]:
    """fn(part) for every part, each on its own pool thread (one part: on this thread); results in part order.
    Gradient mode is this thread's. An exception in any part is raised here once all parts have ended."""
    if len(parts) <= 1:
        return [fn(part) for part in parts]
    global _pool, _pool_size
    threads = torch.get_num_threads()
    call = on_one_thread(fn)
    with _lock:
        if _pool is None or _pool_size < len(parts):  # a smaller pool may still serve another caller: left be
            _pool, _pool_size = one_threaded_pool(len(parts), "gqakit-split"), len(parts)
        pool = _pool
    try:
        futures = [pool.submit(call, part) for part in parts]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]
    finally:
        restore_threads(threads)
