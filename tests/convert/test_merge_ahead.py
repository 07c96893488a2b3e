"""Layer merges computed ahead of the writer, side by side (`convert/merge_ahead.py`).

* `MergeAhead` keeps at most `workers` merges started and not yet taken, in the layers' order; each runs with
  torch on one thread; a layer asked for out of order is still merged once; an error is raised by `get`;
  `close` leaves torch's thread setting as it found it;
* `convert-gqa --method aligned` writes the same bytes on 1 and on 3 threads (every merge runs on one thread
  whatever the number of workers); `fit` the same tensors within 1e-6 (its calibration forward runs on torch's
  threads, whose fp32 sums may round differently by thread count on some processors).
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gqakit.cli import convert_main
from gqakit.convert.methods.merge_ahead import MergeAhead, merge_workers
from tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"


def test_merges_ahead_are_bounded_in_order_and_on_one_thread():
    lock, running, seen = threading.Lock(), [0], []
    peak = [0]

    def merge(layer):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            seen.append((layer, torch.get_num_threads()))
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        if layer == 5:
            raise ValueError("layer 5 failed")
        return layer * 10

    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        ahead = MergeAhead([0, 1, 2, 3, 4, 5], merge, 2)
        assert ahead.get(0) == 0 and ahead.get(1) == 10
        assert ahead.get(4) == 40  # out of order
        assert ahead.get(2) == 20 and ahead.get(3) == 30
        with pytest.raises(ValueError, match="layer 5 failed"):
            ahead.get(5)
        ahead.close()
        assert torch.get_num_threads() == 3
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [3]
    finally:
        torch.set_num_threads(saved)
    assert sorted(layer for layer, _ in seen) == [0, 1, 2, 3, 4, 5]  # each merged once
    assert {threads for _, threads in seen} == {1} and peak[0] <= 2
    assert merge_workers(1) == 1 and merge_workers(100) == max(1, min(torch.get_num_threads(), 8))


@pytest.mark.parametrize("method", ["aligned", "fit"])
def test_output_bytes_do_not_depend_on_threads(method, tmp_path):
    src = make_tiny_llama(tmp_path / "src", heads=4, layers=3, head_dim=8, vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, src / name)
    extra = ["--calibration", str(TEXT), "--calibration-tokens", "512", "--calibration-window", "32"]
    outs = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            out = tmp_path / f"out{threads}"
            args = ["--groups", "2", str(src), "-o", str(out), "--method", method, "-q"]
            assert convert_main(args + (extra if method == "fit" else [])) == 0
            assert torch.get_num_threads() == threads
            outs.append(out / "model.safetensors")
    finally:
        torch.set_num_threads(saved)
    if method == "aligned":
        assert outs[0].read_bytes() == outs[1].read_bytes()
    else:
        a, b = load_file(outs[0]), load_file(outs[1])
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6)
