"""Attention transfer's layers split over processes under torchrun (`convert/layer_share.py`).

* 2 processes write the same bytes as 1 process with the same threads per process (one each), the same card
  rows (each layer's held-out errors and steps), and say so in the card; nothing is left beside the output;
* under torchrun, other methods, --transfer-inputs converted and --dry-run are refused in one line, once.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fork_cli import torchrun
from tiny_models import make_tiny_llama

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"
SMALL = ["--calibration", str(TEXT), "--calibration-tokens", "512", "--calibration-window", "32"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def _convert(n: int, *args: str) -> subprocess.CompletedProcess:
    env = _env()
    if n > 1:  # the launcher and its workers forked from one import of torch (fork_cli)
        launch, env = torchrun(n, env)
        launcher = [*launch, "-m", "gqakit.cli"]
    else:
        launcher = [sys.executable, "-m", "gqakit.cli"]
    return subprocess.run([*launcher, "convert", *args, "-q"], env=env, capture_output=True, text=True,
                          timeout=600)


def _card_rows(path: Path) -> list[str]:
    card = (path / "README.md").read_text()
    return [line for line in card.splitlines() if line[:2] == "| " and line[2:3].isdigit()]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("share") / "src", heads=4, layers=3, head_dim=8,
                           vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, path / name)
    return path


def test_two_processes_write_the_one_process_output(src, tmp_path):
    common = ["--groups", "1", str(src), "--method", "transfer", "--transfer-steps", "20", *SMALL]
    one, two = tmp_path / "one", tmp_path / "two"
    run = _convert(1, *common, "-o", str(one))
    assert run.returncode == 0, run.stderr[-2000:]
    run = _convert(2, *common, "-o", str(two))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("wrote ") == 1  # rank 0 reports
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
    assert _card_rows(one) == _card_rows(two) and len(_card_rows(two)) == 3
    assert "layers split over 2 processes (torchrun)" in (two / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


@pytest.mark.parametrize("args, needle", [
    (["--method", "fit", *SMALL], "splits only --method transfer's layers"),
    (["--method", "transfer", *SMALL, "--transfer-inputs", "converted"], "cannot be split over processes"),
    (["--method", "transfer", *SMALL, "--dry-run"], "--dry-run under torchrun"),
])
def test_refused_under_torchrun(src, tmp_path, args, needle):
    run = _convert(2, "--groups", "1", str(src), "-o", str(tmp_path / "out"), *args)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "convert-gqa: error" in line or "gqakit: error" in line]
    assert len(lines) == 1 and needle in lines[0], run.stderr[-2000:]
    assert not any(tmp_path.iterdir())
