"""The slow, obviously-correct attention that every kernel in this package is tested against.

Convention for fully masked query rows (no key allowed, e.g. a left-padding query that sees only
padding): the output row is 0 and its log-sum-exp is -inf, and gradients through such a row are 0.
(A plain softmax over an all -inf row would give NaN; transformers' eager attention, which adds the
dtype's most negative value instead of -inf, gives a uniform average over the masked keys.) With sink
logits `s_aux` no row is fully masked: the sink is always there, so such a row puts all its weight
on the sink, whose value is zero, and gives 0 with lse = s_aux (gpt-oss's eager gives the same).
"""
from __future__ import annotations

import torch

from gqakit.attention.masks import dense_allowed


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, G, T, d) -> (B, H, T, d): query head h reads K/V head h // (H / G), as in transformers."""
    groups = x.shape[1]
    if num_heads % groups:
        raise ValueError(f"{num_heads} query heads do not split into {groups} K/V heads; "
                         "num_key_value_heads must divide num_attention_heads")
    return x.repeat_interleave(num_heads // groups, dim=1)  # (B, H, T, d)


def eager_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, *, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(cap(q k^T * scale) + mask [, s_aux]) v, one head at a time, in fp32 (fp64 for fp64 inputs).

    q (B, H, Tq, dq); k (B, G, Tk, dq); v (B, G, Tk, dv) with G dividing H. `mask` is a boolean
    (True = may attend) or additive float tensor broadcastable from (B or 1, H or 1, Tq, Tk); in a float
    mask, entries <= finfo.min / 2 (and -inf) mask (see `masks.dense_allowed`), others are added to
    the scores. `softcap` c replaces each score s by c * tanh(s / c) before the mask (Gemma2);
    `s_aux` (H,) adds one key per head with logit s_aux[h] and value 0 to every softmax (gpt-oss).
    Returns the output (B, H, Tq, dv) in q's dtype and the log-sum-exp of the final logits (sink
    included) (B, H, Tq). Differentiable by autograd (also in s_aux).
    """
    num_heads = q.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    k = repeat_kv(k, num_heads).to(work)  # (B, H, Tk, dq)
    v = repeat_kv(v, num_heads).to(work)  # (B, H, Tk, dv)
    outs, lses = [], []
    for h in range(num_heads):
        scores = q[:, h].to(work) @ k[:, h].transpose(-1, -2) * scale  # (B, Tq, Tk)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = torch.ones_like(scores, dtype=torch.bool)
        if mask is not None:
            m = mask[:, h if mask.shape[1] > 1 else 0]  # (B or 1, Tq, Tk)
            allowed = dense_allowed(m).expand_as(scores)
            if m.dtype != torch.bool:
                scores = scores + m.to(work)
        if s_aux is not None:  # the sink: one more always-allowed key column, dropped after the softmax
            sink = s_aux[h].to(work).expand(*scores.shape[:2], 1)  # (B, Tq, 1)
            scores = torch.cat([scores, sink], dim=-1)
            allowed = torch.cat([allowed, torch.ones_like(sink, dtype=torch.bool)], dim=-1)
        live = allowed.any(dim=-1, keepdim=True)  # (B, Tq, 1): rows with at least one key
        # Dead rows get finite scores so softmax and its gradient stay NaN-free; they are zeroed below.
        scores = torch.where(live, scores.masked_fill(~allowed, float("-inf")), torch.zeros_like(scores))
        probs = torch.softmax(scores, dim=-1) * live
        lse = torch.logsumexp(scores, dim=-1).masked_fill(~live[..., 0], float("-inf"))
        if s_aux is not None:
            probs = probs[..., :-1]  # the sink's value is zero
        outs.append(probs @ v[:, h])  # (B, Tq, dv)
        lses.append(lse)
    out = torch.stack(outs, dim=1).to(q.dtype)  # (B, H, Tq, dv)
    return out, torch.stack(lses, dim=1)  # (B, H, Tq)
