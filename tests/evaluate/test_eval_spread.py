"""`gqakit eval ppl`'s honest numbers: the bootstrap interval over windows against a slow explicit loop, the
per-window spread, the whole text with --max-tokens 0, and the new columns in the table, JSON and CSV."""
from __future__ import annotations

import csv
import math
import random

import pytest
import torch

from eval_tiny import checkpoint, run_eval, text, tokenizer
from gqakit.common import report
from gqakit.evaluate.spread import bootstrap_interval, paired_ratio_interval, window_spread


def windows(n: int, seed: int = 0) -> tuple[list[float], list[int]]:
    rng = random.Random(seed)
    tokens = [rng.randint(20, 64) for _ in range(n)]
    return [t * rng.uniform(2.0, 4.0) for t in tokens], tokens


def slow_interval(nll, tokens, n, seed, level=0.95):
    """The documented protocol, one Python loop per resample and per drawn window, and numpy's linear quantile."""
    g = torch.Generator().manual_seed(seed)
    w = len(nll)
    ppl = []
    for _ in range(n):
        drawn = torch.randint(w, (w,), generator=g).tolist()
        s_nll = s_tok = 0.0
        for j in drawn:
            s_nll += nll[j]
            s_tok += tokens[j]
        ppl.append(math.exp(s_nll / s_tok))
    ppl.sort()

    def quantile(q):
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return ppl[lo] + (ppl[hi] - ppl[lo]) * (pos - lo)

    return quantile((1 - level) / 2), quantile((1 + level) / 2)


def test_bootstrap_equals_slow_loop_and_is_seeded():
    nll, tokens = windows(17)
    got = bootstrap_interval(nll, tokens, 300, seed=5)
    assert got == pytest.approx(slow_interval(nll, tokens, 300, 5), rel=1e-12)
    assert bootstrap_interval(nll, tokens, 300, seed=5) == got  # deterministic for a seed
    assert bootstrap_interval(nll, tokens, 300, seed=6) != got
    point = math.exp(sum(nll) / sum(tokens))
    low, high = got
    assert low < point < high


def test_one_window_gives_zero_width():
    low, high = bootstrap_interval([70.0], [30], 50, seed=1)
    assert low == high == pytest.approx(math.exp(70 / 30), rel=1e-15)


def test_spread():
    spread = window_spread([math.log(2) * 10, math.log(4) * 5], [10, 5])
    assert spread["windows"] == 2
    assert spread["window_ppl_min"] == pytest.approx(2) and spread["window_ppl_max"] == pytest.approx(4)
    assert spread["window_ppl_std"] == pytest.approx(1)
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_interval([], [], 10)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tok = tokenizer()
    root = tmp_path_factory.mktemp("spread")
    (root / "text.txt").write_text(text(500, seed=3), encoding="utf-8")
    return {"root": root, "text": root / "text.txt", "model": checkpoint(root / "m", tok)}


def test_whole_text_reports_windows_and_interval(files):
    out_dir = files["root"] / "whole"
    code, out, err = run_eval("ppl", files["model"], "--text", files["text"], "--max-length", 64, "--max-tokens", 0,
                              "--bootstrap", 200, "--seed", 3, "-o", out_dir, "-q")
    assert code == 0, err
    record = report.read_report(out_dir)
    row = record["results"]["rows"][0]
    assert record["results"]["bootstrap"] == 200 and record["results"]["seed"] == 3
    assert row["windows"] == len(row["window_nll"]) == len(row["window_tokens"]) == math.ceil(row["text_tokens"] / 64)
    assert sum(row["window_tokens"]) == row["scored_tokens"] == row["text_tokens"] - row["windows"]
    assert sum(row["window_nll"]) == pytest.approx(row["nll"], rel=1e-9)
    assert (row["ppl_ci_low"], row["ppl_ci_high"]) == bootstrap_interval(row["window_nll"], row["window_tokens"],
                                                                         200, 3)
    assert row["window_ppl_min"] <= row["ppl_ci_low"] <= row["perplexity"] <= row["ppl_ci_high"]
    assert row["ppl_ci_high"] <= row["window_ppl_max"] and row["kv_cache"] == "none"
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].endswith("| scored tokens | windows | window perplexity (min-max) | 95% interval |")
    assert table[1].split(" | ")[5] == f"{row['windows']:,}"
    assert f"{row['ppl_ci_low']:.3f}-{row['ppl_ci_high']:.3f}" in table[1]
    csv_row = next(csv.DictReader(open(out_dir / "results.csv")))
    assert {"windows", "window_ppl_std", "ppl_ci_low", "ppl_ci_high", "kv_cache"} <= set(csv_row)
    assert "window_nll" not in csv_row

    capped = files["root"] / "capped"  # the whole text equals no cap
    assert run_eval("ppl", files["model"], "--text", files["text"], "--max-length", 64, "--bootstrap", 200,
                    "--seed", 3, "-o", capped, "-q")[0] == 0
    assert report.read_report(capped)["results"]["rows"][0]["nll"] == row["nll"]


def test_the_paired_ratio_tells_apart_models_whose_own_intervals_overlap():
    """Windows of very different difficulty, and model A 2% better than B on every one: their own intervals overlap
    widely, the paired ratio's interval is tight around 0.98 and excludes 1; it is deterministic for a seed, and a
    model against itself is 1 exactly."""
    gen = torch.Generator().manual_seed(0)
    tokens = [512] * 40
    hard = (torch.rand(40, generator=gen, dtype=torch.float64) * 2 + 3).tolist()  # mean NLL per token 3..5
    b = [h * t for h, t in zip(hard, tokens)]
    a = [x + t * math.log(0.98) for x, t in zip(b, tokens)]  # perplexity 0.98x on every window
    low_a, high_a = bootstrap_interval(a, tokens)
    low_b, high_b = bootstrap_interval(b, tokens)
    assert low_b < high_a  # the two rows' own intervals overlap
    ratio, low, high = paired_ratio_interval(a, b, tokens)
    assert ratio == pytest.approx(0.98) and low == pytest.approx(0.98) and high == pytest.approx(0.98)
    noisy = [x + float(e) for x, e in zip(a, torch.randn(40, generator=gen, dtype=torch.float64) * 5)]
    first = paired_ratio_interval(noisy, b, tokens, seed=3)
    assert first == paired_ratio_interval(noisy, b, tokens, seed=3) and first[1] < first[0] < first[2] < 1
    assert paired_ratio_interval(b, b, tokens) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same windows"):
        paired_ratio_interval(a, b[:-1], tokens)
