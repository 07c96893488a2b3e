"""Publish an output folder atomically, and clean up after runs that were stopped.

A run writes into `.OUT.gqakit-tmp-PID` beside OUT and renames it to OUT at the end; with --force an
existing OUT (a folder, a file or a symlink: the entry itself, never what a link points to) is first
renamed to `.OUT.gqakit-old-PID` and removed once the new folder is in place. The last file written into the
folder, `.gqakit-written.json`, lists what the run wrote: --force later replaces the folder only while it holds
nothing else (`check_replaceable`). Ctrl-C and SIGTERM (what `kill`, systemd and job schedulers send) both raise
KeyboardInterrupt while the folder is written, so the temporary folder is removed on the way out.

Only `kill -9`, a crash or a power cut can leave such a folder behind. The next run that writes the
same OUT removes the leftovers whose process is gone, and says so on stderr. "Gone" is
`os.kill(pid, 0)` failing with ProcessLookupError on this machine: a leftover whose PID has since been
reused by an unrelated process looks alive and is kept (the safe mistake, cleaned up by a later run).
On a folder shared between machines a live run elsewhere looks gone here, so do not write the same
OUT from two machines at once.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gqakit.common.errors import GqakitError, opt

KINDS = ("tmp", "old")
# How a folder shows that gqakit wrote it: a file and a string it holds. --force replaces nothing else.
WRITTEN_BY_GQAKIT = (("README.md", "Made by gqakit"), ("README.md", "tags: [gqakit"), ("uptraining.json", ""),
                     ("results.json", '"gqakit"'), ("header.json", '"gqakit-token-cache"'),
                     ("pretraining.json", '"pretraining_tokens"'))  # gqakit.reference.train's models
# What a run published: every file's path and size, written last into the folder. --force replaces a folder that has
# this record only when it holds nothing else (a note a user added since, or a file of theirs copied in, stays).
WRITTEN = ".gqakit-written.json"


def sibling(out: Path, kind: str, pid: int | None = None) -> Path:
    """The hidden working name `.OUT.gqakit-KIND-PID` beside `out`."""
    return out.with_name(f".{out.name}.gqakit-{kind}-{os.getpid() if pid is None else pid}")


def pid_alive(pid: int) -> bool:
    """Is there a process with this id on this machine? (Another user's process counts as alive.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # no process can have this id
        return False
    return True


def stale_leftovers(out: Path) -> list[tuple[Path, int]]:
    """`.OUT.gqakit-tmp-PID` / `.OUT.gqakit-old-PID` siblings of `out` whose process has exited."""
    try:
        names = os.listdir(out.parent)
    except OSError:  # no parent yet (it is made later) or unreadable: nothing to clean
        return []
    found = []
    for name in sorted(names):
        for kind in KINDS:
            prefix = f".{out.name}.gqakit-{kind}-"
            digits = name[len(prefix):]
            if name.startswith(prefix) and digits.isascii() and digits.isdigit():
                pid = int(digits)
                if pid != os.getpid() and not pid_alive(pid):
                    found.append((out.parent / name, pid))
    return found


def written_by_gqakit(folder: Path) -> bool:
    """Does `folder` carry one of gqakit's marks (a model card, a run record, a report, a token cache)?"""
    for name, mark in WRITTEN_BY_GQAKIT:
        try:
            with open(folder / name, encoding="utf-8", errors="replace") as f:
                if mark in f.read(1 << 16):
                    return True
        except OSError:
            continue
    return False


def _files(folder: Path) -> dict[str, int]:
    """Every entry below `folder` that is not a folder (links as themselves): its relative path and its size."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = Path(root, name)
            found[path.relative_to(folder).as_posix()] = path.lstat().st_size
    found.pop(WRITTEN, None)
    return found


def record_written(folder: Path) -> None:
    """Write `WRITTEN` into a finished output folder: what --force may later replace."""
    record = {"written_by": "gqakit", "files": dict(sorted(_files(folder).items()))}
    (folder / WRITTEN).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def not_written(folder: Path) -> list[str] | None:
    """The files in `folder` that its `WRITTEN` record does not list at their size (added or changed since); None
    when there is no readable record (a folder of an older gqakit, or not gqakit's)."""
    try:
        listed = json.loads((folder / WRITTEN).read_text(encoding="utf-8"))["files"]
        assert isinstance(listed, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None
    return [name for name, size in sorted(_files(folder).items()) if listed.get(name) != size]


def inside(path: Path, folder: Path) -> bool:
    """Is `path` `folder` itself or somewhere below it (links and `..` resolved)? A run that writes `folder`
    must refuse an input for which this holds either way round."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def check_replaceable(out: Path, option: str = "-o", replacer: str | None = None, kind: str | None = None) -> None:
    """--force may replace a symlink (the link itself), an empty folder, or a folder gqakit wrote: never
    a file or a folder of the user's, whatever --force says. `replacer` names what would replace it when that is not
    --force (a script that always rebuilds its output). With `kind` ("model" or "report"), a folder of the other kind
    is refused too: a report written with --force over a converted model replaced the model."""
    if not os.path.lexists(out) or out.is_symlink():
        return
    holds = ("model" if (out / "config.json").is_file() else "report" if (out / "results.json").is_file() else None)
    if kind is not None and holds is not None and holds != kind:
        raise GqakitError(f"{out} holds a {holds} ({'config.json' if holds == 'model' else 'results.json'}), and "
                          f"{replacer or opt('force')} replaces a {kind} only; choose another {option}")
    theirs = not_written(out) if out.is_dir() else None
    if theirs:
        more = f" (and {len(theirs) - 1} more)" if len(theirs) > 1 else ""
        raise GqakitError(f"{out} holds {theirs[0]}{more}, which gqakit did not write (or it changed since), so "
                          f"{replacer or opt('force')} will not replace the folder; move it out or choose another "
                          f"{option}")
    if out.is_dir() and (theirs == [] or not any(out.iterdir()) or written_by_gqakit(out)):
        return
    what = "a file" if not out.is_dir() else "a folder gqakit did not write"
    raise GqakitError(f"{out} is {what}, so {replacer or opt('force')} will not replace it (it may hold your files); "
                      f"remove it yourself or choose another {option}")


def remove_path(path: Path) -> None:
    """Remove a folder tree, a file or a symlink (the link itself: never what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _notice(text: str) -> None:
    """One line on stderr, prefixed like the CLI's own lines, whatever bytes a path in it holds."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = prog if prog in ("convert-gqa", "gqakit") else "gqakit"
    line = f"{prog}: {text}".encode("utf-8", "backslashreplace").decode("utf-8", "replace")
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()


def remove_stale_leftovers(out: Path) -> None:
    """Remove what stopped runs left beside `out`, one stderr line each; leftovers of live runs stay."""
    for path, pid in stale_leftovers(out):
        try:
            remove_path(path)
        except OSError as e:
            _notice(f"could not remove {path.name} left by a stopped run (pid {pid}): {e.strerror or e}; "
                    "remove it by hand")
        else:
            _notice(f"removed {path.name} left by a stopped run (pid {pid})")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class OutputTaken(GqakitError):
    """The output appeared while the run worked (no --force): another run published it first."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that the same cleanup runs (exit status 143, not 130)."""


def _raise_interrupt(signum, frame) -> None:
    raise Terminated


def _restore(signum: int, previous) -> None:
    signal.signal(signum, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, so that cleanup
    runs; the previous handler is restored on the way out. A no-op off the main thread (Python only
    runs signal handlers there) and where SIGTERM is ignored."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        _restore(signal.SIGTERM, previous)


def _interrupt_for(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM inside the block are held until it ends, then raised as usual. For writes that run
    through C++ (torch's checkpoint writer calls back into Python): an exception raised inside such a callback
    comes back as an unrelated RuntimeError ("unexpected pos"), so a stop would read as a failed write. A
    second signal raises at once (an impatient user still gets out); whatever the block then fails with, the
    interrupt is what propagates."""
    if not _in_main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum, frame):
        pending.append(signum)
        if len(pending) > 1:
            raise _interrupt_for(pending[0])

    held = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, hold) for s in held}
    try:
        yield
    except BaseException:
        if pending:
            raise _interrupt_for(pending[0]) from None
        raise
    finally:
        for s in held:
            _restore(s, previous[s])
    if pending:
        raise _interrupt_for(pending[0])


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM are ignored for the few renames that publish a finished output: landing
    between two of them would leave neither the old nor the new output in place."""
    if not _in_main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in held}
    try:
        yield
    finally:
        for s in held:
            _restore(s, previous[s])


def _publish(tmp: Path, out: Path, force: bool) -> Path | None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first. Returns what was moved aside."""
    taken = OutputTaken(f"{out} already exists; pass {opt('force')} to replace it or choose another -o")
    if not os.path.lexists(out):
        try:
            os.replace(tmp, out)
        except OSError as e:  # published by another process since the check (a folder that is not empty)
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and not force:
                raise taken from None
            raise
        return None
    if not force:  # it appeared while we worked
        raise taken
    old = sibling(out, "old")
    os.replace(out, old)  # a symlink is moved as a link: the folder it points to is not touched
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)  # put the previous output back
        raise
    return old


def publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished folder `tmp` to `out` with Ctrl-C and SIGTERM held off; with `force` an existing `out`
    is moved aside first and removed once the new one is in place. For writers whose temporary folder is shared
    by several processes (a distributed checkpoint); a single process uses `atomic_output`."""
    with _interrupts_held():
        old = _publish(tmp, out, force)
    if old is not None:
        _remove_old(old)


def _remove_old(old: Path) -> None:
    try:
        remove_path(old)
    except OSError as e:  # the new output is in place; a later run removes this one
        _notice(f"could not remove the previous output, moved to {old.name}: {e.strerror or e}")


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it gets its `WRITTEN` record and replaces `out`, on any
    failure, Ctrl-C or SIGTERM it vanishes. Leftovers of earlier runs that were killed are removed first."""
    remove_stale_leftovers(out)
    with sigterm_as_interrupt():
        tmp = sibling(out, "tmp")
        if os.path.lexists(tmp):  # this process's own, from an earlier failed call
            remove_path(tmp)
        parent = tmp.parent.absolute()
        made = [p for p in (*parent.parents[::-1], parent) if not p.exists()]  # outermost first
        tmp.mkdir(parents=True)
        try:
            yield tmp
            record_written(tmp)
            with _interrupts_held():
                old = _publish(tmp, out, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in reversed(made):  # the parent folders this run made, deepest first, if still empty
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    if old is not None:
        _remove_old(old)


def replace_file(path: Path, write) -> None:
    """Write one file atomically: `write(tmp)` fills `.NAME.gqakit-tmp-PID` beside it, which then replaces `path`
    (a stop or a full disk leaves the previous file, never half of one)."""
    path = Path(path)
    tmp = sibling(path, "tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_text(path: Path, text: str) -> None:
    """`replace_file` for a text file (UTF-8)."""
    replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

