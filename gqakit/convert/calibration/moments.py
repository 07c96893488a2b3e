"""The statistics an activation-aware merge is weighted by, summed per window in float64, and the held-out
score of a merge (the relative error of the attention logits it changes).

Statistics of layer i (float64 sums, stored as float32 in one file per layer), over the
attention input x (the tensor `q_proj` reads) of the fitting windows:

* `input` E[x x^T] and `mean` E[x];
* `key`  E over query heads and query positions m of Cov_{s ~ a_m}(x_s): the covariance of the inputs a
  query attends to, weighted by its attention probabilities a_m. A first-order change of the logits
  changes the softmax only through this covariance, so it is the metric in which key errors matter;
* `value` E over heads and queries of xbar_m xbar_m^T with xbar_m = sum_s a_ms x_s (the attention-averaged
  input that value heads turn into what reaches o_proj), and `value_mean` E[xbar_m].

Per window, with X (T, n) its attention inputs and A_h (T, T) head h's probabilities (row m: query m), the
sums over heads and queries collapse onto T x T matrices: with P = sum_h A_h^T A_h and w = sum_h sum_m A_h[m]
(the attention each key position receives), value = X^T P X, key = X^T (diag(w) - P) X and
value_mean = w^T X (`attention_terms`, `add_moment`). No (H*T, n) or n x n temporary is needed: each sum grows
by one float64 `addmm_` per window.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

F64 = torch.float64
STATS = ("input", "mean", "key", "value", "value_mean")
SUMS = ("key", "value", "input")  # the n x n statistics, in the order they are summed


def attention_terms(probs: torch.Tensor) -> torch.Tensor:
    """What the key and value statistics need of one window's attention probabilities probs (H, T, T), in their
    precision: (T + 1, T), rows 0..T-1 P = sum_h A_h^T A_h and row T w = sum_h sum_m A_h[m] (the attention each
    key position receives). Nothing n-sized: a window's statistics are then one (T, n) product each."""
    T = probs.shape[-1]
    flat = probs.reshape(-1, T)  # (H*T, T): every head's query rows, a view
    return torch.cat([flat.T @ flat, flat.sum(0, keepdim=True)])


def add_moment(total: torch.Tensor, name: str, x: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """total (n, n) float64 += X^T M X over one window, X = x (T, n) and `terms` from `attention_terms`:
    M = I for `input`, P for `value` (the sum over heads and queries of xbar xbar^T) and diag(w) - P for `key`
    (the sum over heads and queries of E_a[x x^T] - xbar xbar^T). One float64 `addmm_`."""
    x = x.to(F64)  # (T, n): small; every product with x accumulates in float64
    if name == "input":
        return total.addmm_(x.T, x)
    T = x.shape[0]
    pair = terms[:T].to(F64, copy=True)  # (T, T), changed in place below: never the caller's terms
    if name == "key":
        pair.neg_().diagonal().add_(terms[T].to(F64))  # diag(w) - P
    return total.addmm_(x.T, pair @ x)


def sum_moments(windows: int, read: Callable[[int], tuple[torch.Tensor, torch.Tensor]], heads: int,
                keep: Callable[[str, torch.Tensor], None], device="cpu") -> None:
    """One layer's statistics (`STATS`, expectations in float64) over its fitting windows, handed to
    keep(name, value) one at a time. `read(w)` gives window w's attention input (T, n) and its
    `attention_terms`. Each n x n sum runs over every window alone and is dropped once `keep` returns, so one
    n x n float64 sum exists at a time (`keep` writes it out)."""
    T, n = read(0)[0].shape
    tokens = windows * T
    queries = heads * tokens  # head x query pairs
    mean = torch.zeros(n, dtype=F64, device=device)
    value_mean = torch.zeros(n, dtype=F64, device=device)
    for name in SUMS:
        total = torch.zeros(n, n, dtype=F64, device=device)
        for w in range(windows):
            x, terms = read(w)
            x = x.to(F64)  # once: add_moment's own conversion is then a no-op
            add_moment(total, name, x, terms)
            if name == "input":  # the two means ride along with the last pass
                mean += x.sum(0)
                value_mean += terms[T].to(F64) @ x
        keep(name, total.div_(max(tokens if name == "input" else queries, 1)))
        del total
    keep("mean", mean.div_(max(tokens, 1)))
    keep("value_mean", value_mean.div_(max(queries, 1)))


def reference_moments(x: torch.Tensor, probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same statistics from an explicit loop over heads and queries (slow; for tests). x (N, T, n),
    probs (N, H, T, T)."""
    x, probs = x.to(F64), probs.to(F64)
    n = x.shape[-1]
    acc = {k: torch.zeros(n, n, dtype=F64) for k in ("input", "key", "value")}
    acc.update(mean=torch.zeros(n, dtype=F64), value_mean=torch.zeros(n, dtype=F64))
    tokens = queries = 0
    for w in range(x.shape[0]):
        for t in range(x.shape[1]):
            acc["input"] += torch.outer(x[w, t], x[w, t])
            acc["mean"] += x[w, t]
            tokens += 1
        for h in range(probs.shape[1]):
            for m in range(x.shape[1]):
                a = probs[w, h, m]
                xbar = a @ x[w]
                second = sum(a[s] * torch.outer(x[w, s], x[w, s]) for s in range(x.shape[1]))
                acc["key"] += second - torch.outer(xbar, xbar)
                acc["value"] += torch.outer(xbar, xbar)
                acc["value_mean"] += xbar
                queries += 1
    return {k: v / (tokens if k in ("input", "mean") else queries) for k, v in acc.items()}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half RoPE on (..., T, d) with cos/sin (T, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def logit_error(held: dict, before: tuple, after: tuple, num_heads: int, kv_before: int, kv_after: int,
                head_dim: int) -> float:
    """Relative error of every query head's attention logits (before scaling and softcapping) on held-out
    windows: sqrt(sum ||S'_j - S_j||^2 / sum ||S_j||^2) over allowed query/key pairs.

    `before` / `after` are (q_w, k_w, q_b, k_b) of the original (heads in the merge's order) and merged layer.
    One query head at a time: only its rows (and its K/V head's) are ever float64.
    """
    num = den = 0.0
    allowed = held["allowed"].to(F64)
    cos, sin = held["cos"].to(F64), held["sin"].to(F64)

    def project(x, w, b, head):  # (T, d): one head's rows of w (and b), rotated
        rows = slice(head * head_dim, (head + 1) * head_dim)
        y = x @ w[rows].to(F64).T
        return rope(y if b is None else y + b[rows].to(F64), cos, sin)

    def logits(x, j, q_w, k_w, q_b, k_b, kv):  # (T, T): query head j against its K/V head
        return (project(x, q_w, q_b, j) @ project(x, k_w, k_b, j // (num_heads // kv)).T) * allowed

    for x in held["x"]:
        x = x.to(F64)  # (T, n)
        for j in range(num_heads):
            s0 = logits(x, j, *before, kv_before)
            s1 = logits(x, j, *after, kv_after)
            num += float((s1 - s0).pow(2).sum())
            den += float(s0.pow(2).sum())
    return math.sqrt(num / max(den, 1e-300))
