"""Token-weighted strided perplexity, as described in the transformers documentation.

Windows of `max_length` tokens advance by `stride`; each window scores only the tokens it has not
scored before (the first window scores all but its first token), so every token after the first is
scored exactly once and, with overlap, with up to `max_length - stride` tokens of context.
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def strided_nll(model, input_ids: torch.Tensor, max_length: int, stride: int | None = None,
                progress: bool = True) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of scored tokens of a 1-D token tensor."""
    stride = max_length if stride is None else stride
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {tuple(input_ids.shape)}")
    if not 0 < stride <= max_length:
        raise ValueError(f"stride {stride} must be in 1..max_length ({max_length})")
    n = input_ids.numel()
    if n < 2:
        raise ValueError(f"text has {n} token(s); perplexity needs at least 2")
    device = next(model.parameters()).device
    total, count, prev_end = 0.0, 0, 0
    starts = range(0, n, stride)
    for begin in tqdm(starts, desc="perplexity", unit="window", disable=not progress, leave=False):
        end = min(begin + max_length, n)
        window = input_ids[begin:end].to(device)[None]  # (1, L)
        logits = model(input_ids=window).logits.float()  # (1, L, V)
        # Score positions that are new in this window: targets at absolute index >= max(prev_end, 1).
        first_target = max(prev_end, begin + 1)
        if first_target < end:
            logp = torch.log_softmax(logits[0, first_target - begin - 1 : end - begin - 1], dim=-1)
            targets = window[0, first_target - begin : end - begin]
            total -= logp.gather(-1, targets[:, None]).sum().item()
            count += end - first_target
        prev_end = end
        if end == n:
            break
    return total, count


def perplexity(model, input_ids: torch.Tensor, max_length: int, stride: int | None = None,
               progress: bool = True) -> float:
    """exp(mean NLL) over every token after the first; see `strided_nll`."""
    nll, count = strided_nll(model, input_ids, max_length, stride, progress)
    return math.exp(nll / count)
