"""House style the eye checks too late: every line of the project's Python and shell files is at most 120
characters (docs/architecture.md, "The floor rule"). Markdown tables and YAML command examples are exempt."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIDTH = 120


def long_lines(paths: list[Path]) -> list[str]:
    """'path:line: N characters' for each line of `paths` longer than WIDTH."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > WIDTH:
                found.append(f"{path.relative_to(REPO)}:{number}: {len(line)} characters (wrap it to {WIDTH})")
    return found


def source_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return [REPO / name for name in listed.stdout.split()]
    return [p for d in ("gqakit", "benchmarks", "tests") for p in (REPO / d).rglob("*.py")]  # not a git checkout


def test_no_line_longer_than_120():
    assert long_lines(source_files()) == []


def test_the_check_sees_a_long_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    ok, bad = tmp_path / "ok.py", tmp_path / "bad.py"
    ok.write_text("x = 1\n" + "#" * WIDTH + "\n")
    bad.write_text("x = 1\n" + "#" * (WIDTH + 1) + "\n")
    assert long_lines([ok]) == []
    assert long_lines([bad]) == [f"bad.py:2: {WIDTH + 1} characters (wrap it to {WIDTH})"]
