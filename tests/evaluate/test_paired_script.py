"""benchmarks/paired.py: two models of one report, or of two reports of the same windows (--b-report)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def report(folder: Path, model: str, nll: list[float], tokens: list[int]) -> Path:
    folder.mkdir()
    row = {"model": model, "window_nll": nll, "window_tokens": tokens}
    (folder / "results.json").write_text(json.dumps({"kind": "ppl", "results": {"rows": [row]}}))
    return folder


def paired(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "paired.py"), *args], capture_output=True,
                          text=True)


def test_two_reports_compare_window_by_window(tmp_path):
    """A is better than B on every window by 0.02 nats per token: the ratio is exp(-0.02) and A wins every window."""
    tokens = [100, 100, 50]
    a = report(tmp_path / "a", "mla", [230.0, 410.0, 120.0], tokens)
    b = report(tmp_path / "b", "mqa", [232.0, 412.0, 121.0], tokens)
    out = paired(str(a), "mla", "mqa", "--b-report", str(b))
    assert out.returncode == 0, out.stderr
    assert "perplexity ratio 0.9802" in out.stdout and "better on 3 of 3 windows" in out.stdout


def test_other_windows_and_unknown_models_are_refused(tmp_path):
    a = report(tmp_path / "a", "mla", [230.0, 410.0], [100, 100])
    b = report(tmp_path / "b", "mqa", [232.0, 412.0], [100, 90])
    other = paired(str(a), "mla", "mqa", "--b-report", str(b))
    assert other.returncode == 2 and "scored different windows" in other.stderr
    unknown = paired(str(a), "mla", "gqa", "--b-report", str(b))
    assert unknown.returncode == 2 and "'gqa' is not a model of" in unknown.stderr
