"""The command-line contract for user errors, checked through the real console scripts:
exit code 2, exactly one line on stderr (`PROG: error: ...`), no traceback, nothing written.

    result, changed = run_refused(tmp_path, "convert-gqa", "--groups", "2", str(model))
    assert "--groups" in result.stderr
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def console_script(name: str) -> str:
    """The installed console script `name` (gqakit, convert-gqa) of the Python running the tests."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"console script {name} is not installed; pip install -e . first"
    return found


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


def run_cli(prog: str, *args: str | bytes, cwd: Path | None = None, env: dict | None = None,
            stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run console script `prog` with `args` (bytes for names that are not UTF-8); text is decoded leniently."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run([console_script(prog), *args], cwd=cwd, env=full_env, input=stdin,
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
