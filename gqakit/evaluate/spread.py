"""How far a perplexity can be trusted: the spread of per-window perplexities and a percentile bootstrap interval
over windows. Pure functions of per-window summed NLL (nats) and scored-token counts; no model, no I/O.

A window is what one forward scored (a strided window of a decoder, a span-corrupted window or an input/target row
of an encoder-decoder). Resampling windows, not tokens, keeps the dependence between tokens of one window inside a
resample, as the field's long-text evaluations do.
"""
from __future__ import annotations

import math

import torch


def window_spread(window_nll: list[float], window_tokens: list[int]) -> dict:
    """{"windows", "window_ppl_min", "window_ppl_max", "window_ppl_std"}: the count of windows and the min, max
    and standard deviation (population, 0 for one window) of their perplexities exp(nll_w / tokens_w)."""
    if len(window_nll) != len(window_tokens) or not window_nll:
        raise ValueError(f"need as many window NLLs as counts, at least one: got {len(window_nll)} and "
                         f"{len(window_tokens)}")
    ppl = torch.tensor([nll / n for nll, n in zip(window_nll, window_tokens)], dtype=torch.float64).exp()
    return {"windows": len(window_nll), "window_ppl_min": ppl.min().item(), "window_ppl_max": ppl.max().item(),
            "window_ppl_std": ppl.std(correction=0).item()}


def bootstrap_interval(window_nll: list[float], window_tokens: list[int], n: int = 1000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of the token-weighted perplexity over W windows.

    Resample b (b = 0 .. n-1, in order) draws W window indices with replacement, `torch.randint(W, (W,),
    generator=g)` from one `torch.Generator` seeded with `seed`, and has perplexity exp(sum nll / sum tokens) over
    the drawn windows (a window drawn twice counts twice). The interval is the (1 - level) / 2 and (1 + level) / 2
    quantiles of the n perplexities (linear interpolation between order statistics, numpy's default). One window
    gives a zero-width interval at its perplexity. Memory is O(W) whatever n.
    """
    if len(window_nll) != len(window_tokens) or not window_nll:
        raise ValueError(f"need as many window NLLs as counts, at least one: got {len(window_nll)} and "
                         f"{len(window_tokens)}")
    if n < 1:
        raise ValueError(f"the bootstrap needs at least one resample, got {n}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    nll = torch.tensor(window_nll, dtype=torch.float64)
    tokens = torch.tensor(window_tokens, dtype=torch.float64)
    w = len(window_nll)
    g = torch.Generator().manual_seed(seed)
    ppl = torch.empty(n, dtype=torch.float64)
    for b in range(n):
        counts = torch.bincount(torch.randint(w, (w,), generator=g), minlength=w).to(torch.float64)  # (W,)
        ppl[b] = math.exp((counts @ nll).item() / (counts @ tokens).item())
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(ppl, q).tolist()
    return low, high


def paired_ratio_interval(nll_a: list[float], nll_b: list[float], window_tokens: list[int], n: int = 1000,
                          seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(ratio, low, high): model A's perplexity over model B's on the same windows, and a percentile bootstrap
    interval of that ratio with both models resampled by the same draws (`bootstrap_interval`'s, same seed): two
    models whose own intervals overlap can still be told apart, since a window that is hard for one is hard for
    the other."""
    if not (len(nll_a) == len(nll_b) == len(window_tokens)) or not nll_a:
        raise ValueError(f"need the same windows for both models: got {len(nll_a)}, {len(nll_b)} and "
                         f"{len(window_tokens)}")
    a, b = torch.tensor(nll_a, dtype=torch.float64), torch.tensor(nll_b, dtype=torch.float64)
    tokens = torch.tensor(window_tokens, dtype=torch.float64)
    w = len(nll_a)
    g = torch.Generator().manual_seed(seed)
    ratios = torch.empty(n, dtype=torch.float64)
    for r in range(n):
        counts = torch.bincount(torch.randint(w, (w,), generator=g), minlength=w).to(torch.float64)
        ratios[r] = math.exp(((counts @ a) - (counts @ b)).item() / (counts @ tokens).item())
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(ratios, q).tolist()
    return math.exp(((a - b).sum() / tokens.sum()).item()), low, high
