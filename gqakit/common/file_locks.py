"""`flock` locks that only the process that took them holds, never the children it forks.

A forked child shares its parent's open file descriptions, and an `flock` lock lasts while any descriptor of
its description is open. `datasets.map(num_proc=N)` forks its workers while gqakit holds a token cache's lock
and the run folder's `uptrain.lock`; when the parent was killed (SIGKILL), the orphaned workers kept both locks,
and the next run waited on the cache lock forever or was told the run folder is in use. Descriptors taken
through `hold` are closed in every forked child (`os.register_at_fork`), and a child forked (by the main
thread) while one is held is killed with its parent (Linux `PR_SET_PDEATHSIG`): its work belongs to the
parent's run. Children started by `subprocess` (fork and exec in C) run no such hook and keep nothing: their
descriptors are closed at exec (Python opens them non-inheritable).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

_HELD: set[int] = set()
_PR_SET_PDEATHSIG = 1
_FORKING = [0, False]  # the pid that forks, and whether from its main thread; read in the child


def _before_fork() -> None:
    _FORKING[:] = [os.getpid(), threading.current_thread() is threading.main_thread()]


def _in_child() -> None:
    held = list(_HELD)
    _HELD.clear()
    for fd in held:
        with contextlib.suppress(OSError):
            os.close(fd)
    # the signal comes when the forking THREAD ends: only a main thread's end is the process's
    if held and _FORKING[1] and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != _FORKING[0]:  # the parent died before the signal was asked for
                os.kill(os.getpid(), signal.SIGKILL)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)


def hold(fd: int) -> int:
    """Mark `fd` (a descriptor that holds or will hold an flock) as this process's alone; returns it."""
    _HELD.add(fd)
    return fd


def release(fd: int) -> None:
    """Forget `fd` before it is closed."""
    _HELD.discard(fd)
