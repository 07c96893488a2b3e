"""benchmarks/paired.py: two models of one report, or of two reports of the same windows (--b-report)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def report(folder: Path, model: str, nll: list[float], tokens: list[int], **config) -> Path:
    folder.mkdir()
    row = {"model": model, "window_nll": nll, "window_tokens": tokens}
    config = {"text": "emma.txt", "max_length": 512, "stride": None, **config}
    (folder / "results.json").write_text(json.dumps({"kind": "ppl", "config": config, "results": {"rows": [row]}}))
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


def test_reports_of_other_texts_or_cuts_are_refused(tmp_path):
    """Equal window lengths were the only check: a model against itself on Emma and on Shakespeare came out
    "significantly" different (1.15x, a review). The text (by its bytes when two paths are given) and the cut must
    match."""
    emma = tmp_path / "emma.txt"
    emma.write_text("Emma Woodhouse, handsome, clever, and rich")
    same = tmp_path / "copy.txt"
    same.write_text(emma.read_text())
    shakespeare = tmp_path / "shakespeare.txt"
    shakespeare.write_text("First Citizen: Before we proceed any further, hear me speak.")
    a = report(tmp_path / "a", "mqa", [230.0, 410.0], [100, 100], text=str(emma))
    for name, config, ok in (("copy", dict(text=str(same)), True), ("other", dict(text=str(shakespeare)), False),
                             ("stride", dict(text=str(emma), stride=50), False)):
        b = report(tmp_path / name, "mqa", [232.0, 412.0], [100, 100], **config)
        out = paired(str(a), "mqa", "mqa", "--b-report", str(b))
        if ok:
            assert out.returncode == 0, out.stderr
        else:
            assert out.returncode == 2 and "the two reports scored other text or windows" in out.stderr, out.stderr
