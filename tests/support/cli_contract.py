"""The command-line contract for user errors, checked through the console scripts' entry points:
exit code 2, exactly one line on stderr (`PROG: error: ...`), no traceback, nothing written.

    result, changed = run_refused(tmp_path, "convert-gqa", "--groups", "2", str(model))
    assert "--groups" in result.stderr

`run_cli` runs the command forked from a server that imported torch and transformers once per test process
(tests/support/fork_cli.py: the real entry point, with the arguments, folder, standard streams and environment
given; an environment other than the server's, e.g. one given with `env=`, runs the real console script). The
console scripts themselves, and what only a fresh process shows (signals, start-up), are tested with
`console_script(name)` directly (tests/test_cli.py, the SIGTERM / SIGKILL tests).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fork_cli import client, real_script as console_script, shared  # console_script: the name the tests use


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file and folder under `folders`, hidden ones included."""
    seen = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                path = os.path.join(root, name)
                st = os.lstat(path)
                seen[path] = (st.st_size if name in files else -1, st.st_mtime_ns)
    return seen


_BASE: dict = {}  # the commands' default environment, as it was at the first run_cli


def _served_env() -> dict:
    if not _BASE:  # one environment: a test that changes os.environ afterwards runs the real console script
        _BASE.update({k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, OMP_NUM_THREADS="1")
    return shared(_BASE)


def run_cli(prog: str, *args: str | bytes, cwd: Path | None = None, env: dict | None = None,
            stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `prog` with `args` (bytes for names that are not UTF-8), forked from the server unless `env` or a
    changed os.environ differs from its environment; text is decoded leniently."""
    served = _served_env()
    full_env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, "OMP_NUM_THREADS": "1",
                **(env or {})}
    full_env["PATH"] = f"{os.path.dirname(client(served, prog))}{os.pathsep}{full_env.get('PATH', '')}"
    done = subprocess.run([client(served, prog), *args], cwd=cwd, env=full_env, input=stdin,
                          capture_output=True, timeout=timeout)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


def assert_one_line_error(result: subprocess.CompletedProcess, prog: str, *needles: str) -> str:
    """Exit 2, no traceback, one `PROG: error:` line on stderr containing every needle; returns the line.
    Besides it stderr may hold only gqakit's own notices of work done before the failure (`PROG: ...`,
    `uptrain: ...`) and warnings that Python or a library printed; nothing else."""
    stderr = result.stderr
    assert "Traceback" not in stderr, f"traceback instead of one line:\n{stderr}"
    assert result.returncode == 2, f"exit {result.returncode}, expected 2; stderr:\n{stderr}"
    errors = [ln for ln in stderr.splitlines() if ln.startswith(f"{prog}: error: ")]
    assert len(errors) == 1, f"expected one error line, got {len(errors)}:\n{stderr}"
    others = [ln for ln in stderr.splitlines() if ln.strip() and ln not in errors and "Warning" not in ln
              and not ln.startswith(("  ", f"{prog}: ", "uptrain: "))]
    assert not others, f"stderr holds more than the error line:\n{stderr}"
    line = errors[0]
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def run_refused(watch: Path | list[Path], prog: str, *args: str | bytes, needles: tuple[str, ...] = (),
                cwd: Path | None = None, env: dict | None = None, stdin: bytes | None = None) -> str:
    """Run `prog args`, assert the one-line refusal and that nothing under `watch` changed; returns the line."""
    folders = watch if isinstance(watch, list) else [watch]
    before = snapshot(*folders)
    result = run_cli(prog, *args, cwd=cwd, env=env, stdin=stdin)
    line = assert_one_line_error(result, prog, *needles)
    after = snapshot(*folders)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p] and before[p][0] != -1)
    assert not (added or removed or changed), f"{line}\nwritten: {added}\nremoved: {removed}\nchanged: {changed}"
    return line
