"""Hand freed heap back to the operating system (glibc only; a no-op elsewhere)."""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's
_eager: int | None = None  # the mmap threshold return_freed_memory_eagerly set, if it did


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(param, value))
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the OS (no-op elsewhere): large freed blocks otherwise keep
    counting against the process's resident memory while the next phase allocates its own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def return_freed_memory_eagerly(threshold: int = 1 << 20) -> None:
    """Make glibc serve allocations of `threshold` bytes and more from their own mappings, which go back to the
    OS when freed (no-op elsewhere). By default glibc raises that threshold as large blocks are freed and
    then keeps freed blocks of up to 32 MiB on its heap, where a layer merge's many temporaries count against
    resident memory long after they are gone. Process-wide, so the console script sets it for its own
    process (a library caller that goes on to train keeps its allocator as it was)."""
    global _eager
    if _mallopt(M_MMAP_THRESHOLD, threshold):  # also stops glibc's adaptation of the thresholds
        _eager = threshold


@contextlib.contextmanager
def heap_kept(mmap_threshold: int = 4 << 20, trim_threshold: int = 64 << 20) -> Iterator[None]:
    """Within this block glibc serves blocks under `mmap_threshold` from its heap and keeps up to `trim_threshold`
    of freed heap, after `return_freed_memory_eagerly` (else a no-op): a training loop that allocates the same
    activations at every step then faults their pages in once, not at every step (a transfer step of SmolLM2's
    attention: about 12,000 page faults and 1.5x the time otherwise; `benchmarks/heap_reuse.py`). Larger blocks
    are still mapped and returned one by one: with 32 MiB and 1 GiB, transfer at the Llama-2-7B layer shape peaked
    390 MiB higher than without the block, with these 56 MiB. On leaving, the eager threshold returns and the
    freed heap goes back to the OS."""
    if _eager is None:
        yield
        return
    _mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    _mallopt(M_TRIM_THRESHOLD, trim_threshold)
    try:
        yield
    finally:
        _mallopt(M_MMAP_THRESHOLD, _eager)
        _mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        release_freed_memory()
