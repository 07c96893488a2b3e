"""The slow, obviously-correct attention that every kernel in this package is tested against.

Convention for fully masked query rows (no key allowed, e.g. a left-padding query that sees only
padding): the output row is 0 and its log-sum-exp is -inf, and gradients through such a row are 0.
(A plain softmax over an all -inf row would give NaN; transformers' sdpa gives a uniform average.)
"""
from __future__ import annotations

import torch


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, G, T, d) -> (B, H, T, d): query head h reads K/V head h // (H / G), as in transformers."""
    groups = x.shape[1]
    if num_heads % groups:
        raise ValueError(f"{num_heads} query heads do not split into {groups} K/V heads; "
                         "num_key_value_heads must divide num_attention_heads")
    return x.repeat_interleave(num_heads // groups, dim=1)  # (B, H, T, d)


def eager_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale, masked) v, one head at a time, in fp32.

    q (B, H, Tq, d); k, v (B, G, Tk, d) with G dividing H; `mask` a boolean (B or 1, 1, Tq, Tk),
    True = may attend (None = attend everywhere). Returns the output (B, H, Tq, d) in q's dtype and
    the log-sum-exp of the scaled, masked scores (B, H, Tq) in fp32. Differentiable by autograd.
    """
    num_heads = q.shape[1]
    k = repeat_kv(k, num_heads).float()  # (B, H, Tk, d)
    v = repeat_kv(v, num_heads).float()
    outs, lses = [], []
    for h in range(num_heads):
        scores = q[:, h].float() @ k[:, h].transpose(-1, -2) * scale  # (B, Tq, Tk)
        if mask is None:
            lse = torch.logsumexp(scores, dim=-1)  # (B, Tq)
            outs.append(torch.softmax(scores, dim=-1) @ v[:, h])
            lses.append(lse)
            continue
        allowed = mask[:, 0].expand_as(scores)  # (B, Tq, Tk)
        live = allowed.any(dim=-1, keepdim=True)  # (B, Tq, 1): rows with at least one key
        # Dead rows get finite scores so softmax and its gradient stay NaN-free; they are zeroed below.
        scores = torch.where(live, scores.masked_fill(~allowed, float("-inf")), torch.zeros_like(scores))
        probs = torch.softmax(scores, dim=-1) * live
        lse = torch.logsumexp(scores, dim=-1).masked_fill(~live[..., 0], float("-inf"))
        outs.append(probs @ v[:, h])  # (B, Tq, d)
        lses.append(lse)
    out = torch.stack(outs, dim=1).to(q.dtype)  # (B, H, Tq, d)
    return out, torch.stack(lses, dim=1)  # (B, H, Tq)
