"""One run at a time per run folder: `OUTPUT/uptrain.lock`, held with `flock` for the run's lifetime.

The kernel releases an `flock` when its process dies (even by SIGKILL), so a lock file left by a dead
run is free: the next run takes it over and says whose it was. The file holds the holder's pid, host
and start time, for the message that refuses a second run while the first is alive. Only the main
process locks; under torchrun the other ranks stop with it if it refuses.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gqakit.common import file_locks
from gqakit.common.errors import GqakitError

LOCK = "uptrain.lock"


def _holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except ValueError:
        holder = {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _acquire(path: Path) -> tuple[int, dict]:
    """(open fd holding the lock, the previous holder's record or {}); refuses while another process holds it."""
    while True:
        fd = file_locks.hold(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))  # not kept by forked children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            file_locks.release(fd)
            os.close(fd)
            raise GqakitError(f"output_dir {path.parent} is in use by another uptrain run ({_describe(holder)}); "
                              "wait for it to finish or stop it, or choose another output_dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file that its last holder unlinked while we opened it
            return fd, _holder(fd)
        file_locks.release(fd)
        os.close(fd)


@contextlib.contextmanager
def run_lock(out: Path, notice: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the run folder `out` (created if missing) for the duration; a folder this call created is
    removed again if nothing but the lock was written into it (a start-up that failed leaves nothing)."""
    out = Path(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd, previous = _acquire(path)
    try:
        if previous.get("pid") not in (None, os.getpid()):
            notice(f"uptrain: taking over {path} from a run that is no longer running ({_describe(previous)})")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # before closing: nobody can lock this inode in between and believe it current
        file_locks.release(fd)
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty
