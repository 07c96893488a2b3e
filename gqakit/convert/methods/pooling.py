"""Pure tensor maths for regrouping K/V heads: no I/O, no configs, just tensors and ints.

Heads live along one axis of a tensor in contiguous blocks of `head_size` entries (a projection
weight `[K*d, in]` has `head_size = d` along axis 0). Regrouping K heads into G groups uses
contiguous groups, as transformers' `repeat_kv` expects: query head h reads K/V head h // (H/G).
"""
from __future__ import annotations

import torch


def _exact_accumulator(dtype: torch.dtype) -> torch.dtype:
    """n identical values sum exactly (then divide back exactly) with 2 + log2(n) spare mantissa bits."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else torch.float64


def _split_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    if t.shape[0] % num_heads:
        raise ValueError(f"axis 0 of size {t.shape[0]} does not split into {num_heads} heads")
    return t.reshape(num_heads, t.shape[0] // num_heads, *t.shape[1:])  # (K, d, ...)


def pool_heads(t: torch.Tensor, num_heads: int, groups: int, method: str = "mean") -> torch.Tensor:
    """Merge `num_heads` heads stacked along axis 0 into `groups` heads (groups divides num_heads).

    `mean` averages each group's heads (Ainslie et al. 2023); `first` keeps each group's first head.
    The mean is accumulated in a dtype wide enough that a group of identical heads pools to exactly
    that head (float32 for 16-bit inputs, float64 for float32); the result has the input dtype.
    """
    if num_heads % groups:
        raise ValueError(f"{num_heads} heads do not split into {groups} groups")
    heads = _split_heads(t, num_heads)  # (K, d, ...)
    grouped = heads.reshape(groups, num_heads // groups, *heads.shape[1:])  # (G, K/G, d, ...)
    if method == "mean":
        merged = grouped.to(_exact_accumulator(t.dtype)).mean(dim=1)
    elif method == "first":
        merged = grouped[:, 0]
    else:
        raise ValueError(f"unknown pooling method {method!r}; choose one of mean, first")
    return merged.reshape(-1, *t.shape[1:]).to(t.dtype)  # (G*d, ...)


def expand_heads(t: torch.Tensor, num_heads: int, groups: int) -> torch.Tensor:
    """Repeat each of `num_heads` heads `groups // num_heads` times: an exact GQA-K -> GQA-G expansion."""
    if groups % num_heads:
        raise ValueError(f"{groups} groups are not a multiple of {num_heads} heads")
    heads = _split_heads(t, num_heads)  # (K, d, ...)
    return heads.repeat_interleave(groups // num_heads, dim=0).reshape(-1, *t.shape[1:])  # (G*d, ...)


def regroup(t: torch.Tensor, num_heads: int, groups: int, method: str = "mean") -> torch.Tensor:
    """K heads -> G heads: pool when G divides K, expand by repetition when K divides G."""
    if groups == num_heads:
        return t
    if num_heads % groups == 0:
        return pool_heads(t, num_heads, groups, method)
    if groups % num_heads == 0:
        return expand_heads(t, num_heads, groups)
    raise ValueError(f"cannot regroup {num_heads} heads into {groups}: neither divides the other")


def merge_norms(stack: torch.Tensor, method: str = "mean") -> torch.Tensor:
    """One group's per-head norm weights (n, d) -> the merged head's (d,): the first, or their mean (as given)."""
    if method not in ("mean", "first"):
        raise ValueError(f"unknown pooling method {method!r}; choose one of mean, first")
    return stack[0] if method == "first" else stack.mean(dim=0)


def random_heads(shape: tuple[int, ...], std: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh projection drawn from N(0, std^2) with its own seeded generator (order-independent)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def relative_error(original: torch.Tensor, regrouped: torch.Tensor, num_heads: int) -> float:
    """||W - expand(W')|| / ||W||: how far the G-head projection, repeated back to K heads, is from W."""
    head_rows = original.shape[0] // num_heads
    groups = regrouped.shape[0] // head_rows
    if groups >= num_heads:  # expansion keeps every original head: compare the first copies
        diff = original.float() - pool_heads(regrouped, groups, num_heads, "first").float()
        return (diff.norm() / original.float().norm().clamp_min(1e-30)).item()
    heads = original.to(torch.float32, copy=True).reshape(groups, num_heads // groups, head_rows, -1)  # (G, K/G, d, in)
    total = torch.linalg.vector_norm(heads)
    heads.sub_(regrouped.float().reshape(groups, 1, head_rows, -1))  # broadcast over the group, no repeat
    return (torch.linalg.vector_norm(heads) / total.clamp_min(1e-30)).item()
