"""Hand freed heap back to the operating system (glibc only; a no-op elsewhere)."""
from __future__ import annotations

import ctypes


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
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD (malloc.h); also stops its adaptation
    except (OSError, AttributeError):
        pass
