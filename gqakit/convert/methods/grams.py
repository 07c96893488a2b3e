"""A layer's attention rows seen only through their inner products in an input metric.

Every quantity the aligned merges use (norms, Procrustes cross products, SVDs, least-squares refits,
similarity costs) is invariant under an orthogonal change of the input space, so it depends on the
rows W (r x n) and the metric M (n x n) only through the Gram matrix W M W^T. This module computes
those Grams in row and column blocks, never holding a whitened copy of a weight, a float64 copy of
M or a Cholesky factor: at hidden size 4096 each of those is 128 MiB, a Gram of one K/V head group
is 2 MiB. A merge then works in *factor coordinates* Y (Y Y^T = W M W^T, r x r) and maps a merged
row y back to the original basis as the same combination of original rows: y = c Y  =>  w = c W.

Rows may carry a bias as an extra column (`x` augmented with 1); a metric then has the block form
[[M, mu], [mu^T, c]]. Pure tensor maths: no I/O, no configs.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from gqakit.convert.threads import lapack

F64 = torch.float64
BLOCK = 256  # rows (and metric columns) per block: 8 MiB of float64 at hidden size 4096
PSD_TOLERANCE = 1e-6  # a Gram eigenvalue below -tol * the largest means the metric was not a second moment
RANK_TOLERANCE = 1e-12  # factor directions with eigenvalue below tol * the largest are treated as zero


class IndefiniteMetric(ValueError):
    """A Gram had an eigenvalue below -PSD_TOLERANCE times its largest: the metric is not positive semi-definite
    (not a second moment, or one whose float32 rounding the ridge did not cover)."""


class Metric(NamedTuple):
    """An input metric for rows of width n (+1 with a bias column), kept in its stored dtype.

    `moment` (n, n) or None with `scale` (n,) (the diagonal metric diag(scale^2)) or neither (the identity);
    the moment is a tensor or anything with `shape`, `rows(start, stop)` and `diagonal()` (a symmetric second
    moment read from a file one block at a time: its rows are its columns);
    with a bias column, `cross` (n,) is E[x] paired with the bias coordinate (None = 0) and `corner` its weight.
    `ridge` is added to the whole diagonal (the smallest that keeps a calibrated moment definite)."""

    n: int
    with_bias: bool
    moment: "torch.Tensor | RowBlocks | None" = None
    scale: torch.Tensor | None = None
    cross: torch.Tensor | None = None
    corner: float = 1.0
    ridge: float = 0.0

    @property
    def identity(self) -> bool:
        return self.moment is None and self.scale is None

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (b, n[+1]) float64 -> rows @ M: the moment is converted to float64 one column block at a time."""
        if self.identity:
            return rows
        n = self.n
        x = rows[:, :n]
        if self.scale is not None:
            out = x * self.scale.to(F64).abs().clamp_min(1e-8).pow(2)
        else:
            out = torch.empty_like(x)
            for j in range(0, n, BLOCK):
                out[:, j : j + BLOCK] = x @ _columns(self.moment, j, j + BLOCK).to(F64)
        if self.with_bias:
            b = rows[:, n:]  # (b, 1)
            last = b * self.corner
            if self.cross is not None:
                mu = self.cross.to(F64)
                out = out + b * mu
                last = last + (x @ mu)[:, None]
            out = torch.cat([out, last], dim=1)
        return out.add_(rows, alpha=self.ridge)


class RowBlocks(Protocol):
    """A symmetric (n, n) second moment that is read one block of rows at a time (never whole)."""

    shape: tuple[int, int]

    def rows(self, start: int, stop: int) -> torch.Tensor: ...

    def diagonal(self) -> torch.Tensor: ...


def _columns(moment, start: int, stop: int) -> torch.Tensor:
    """Columns start:stop of a moment: a slice of a tensor, or (symmetric: only the symmetric part of a metric
    reaches a Gram, which is symmetrised) the transposed rows of one read in blocks."""
    if isinstance(moment, torch.Tensor):
        return moment[:, start:stop]
    return moment.rows(start, stop).T


def moment_metric(moment: "torch.Tensor | RowBlocks", with_bias: bool, cross: torch.Tensor | None = None,
                  corner: float = 1.0, ridge: float = 1e-6) -> Metric:
    """The metric [[M, cross], [cross^T, corner]] (the bias block only `with_bias`) of a second moment M (n, n),
    kept in its stored dtype, plus a ridge of `ridge` times its mean diagonal: a moment from fewer
    calibration tokens than dimensions is singular, one stored in float32 slightly indefinite."""
    n = moment.shape[0]
    diagonal = float(moment.diagonal().to(F64).sum()) + (corner if with_bias else 0.0)
    return Metric(n, with_bias, moment=moment, cross=cross if with_bias else None, corner=corner,
                  ridge=ridge * diagonal / (n + int(with_bias)))


def metric_from_matrix(n: int, with_bias: bool, moment: torch.Tensor | None, scale: torch.Tensor | None,
                       ridge: float = 1e-6) -> Metric:
    """The metric of `align_and_merge_layer`'s `input_moment` ((n, n), or (n+1, n+1) for (x, 1) with biases) or
    `input_scale` ((n,): diag(scale^2)), with `moment_metric`'s ridge. An (n, n) moment with a bias column
    gives the bias coordinate weight 1 and no cross term. The (n+1)-wide moment is read through views."""
    if moment is None and scale is None:
        return Metric(n, with_bias)
    size = n + int(with_bias)
    if moment is not None:
        if moment.shape not in ((size, size), (n, n)):
            raise ValueError(f"input metric has shape {tuple(moment.shape)}; expected ({size}, {size})")
        if moment.shape[0] == n + 1:
            cross = (moment[:n, n].to(F64) + moment[n, :n].to(F64)) / 2
            return moment_metric(moment[:n, :n], with_bias, cross, float(moment[n, n]), ridge)
        return moment_metric(moment, with_bias, ridge=ridge)
    s2 = scale.to(F64).abs().clamp_min(1e-8).pow(2)
    diagonal = float(s2.sum()) + (1.0 if with_bias else 0.0)
    return Metric(n, with_bias, scale=scale, ridge=ridge * diagonal / size)


def rows_f64(w: torch.Tensor, b: torch.Tensor | None, start: int, stop: int, width: int) -> torch.Tensor:
    """Rows start:stop of the affine map (w, b) as float64 [rows, width]: the bias column, or zeros when the
    metric has a bias column and this projection has no bias."""
    out = w[start:stop].to(F64)
    if width > w.shape[1]:
        col = b[start:stop].to(F64)[:, None] if b is not None else out.new_zeros(out.shape[0], 1)
        out = torch.cat([out, col], dim=1)
    return out


def width(metric: Metric) -> int:
    return metric.n + int(metric.with_bias)


def row_energies(w: torch.Tensor, b: torch.Tensor | None, metric: Metric) -> torch.Tensor:
    """(rows,) float64: every row's squared norm in the metric, w_i M w_i^T, one block of rows at a time."""
    out = torch.empty(w.shape[0], dtype=F64)
    for i in range(0, w.shape[0], BLOCK):
        rows = rows_f64(w, b, i, i + BLOCK, width(metric))
        out[i : i + BLOCK] = (metric.apply(rows) * rows).sum(1)
    return out


def gram(w: torch.Tensor, b: torch.Tensor | None, metric: Metric, dtype: torch.dtype = F64) -> torch.Tensor:
    """W M W^T (symmetrised), computed in float64 row blocks and kept in `dtype`."""
    rows, size = w.shape[0], width(metric)
    out = torch.empty(rows, rows, dtype=dtype)
    for i in range(0, rows, BLOCK):
        left = metric.apply(rows_f64(w, b, i, i + BLOCK, size))  # (block, n')
        for j in range(0, rows, BLOCK):
            out[i : i + BLOCK, j : j + BLOCK] = left @ rows_f64(w, b, j, j + BLOCK, size).T
    return symmetrise_(out)


def symmetrise_(g: torch.Tensor) -> torch.Tensor:
    """(G + G^T) / 2 in place, one block pair at a time (no second n x n copy): a metric stored in float32 or
    accumulated in another order is not exactly symmetric, and only its symmetric part is a metric."""
    size = g.shape[0]
    for i in range(0, size, BLOCK):
        for j in range(i, size, BLOCK):
            upper, lower = g[i : i + BLOCK, j : j + BLOCK], g[j : j + BLOCK, i : i + BLOCK]
            mean = (upper + lower.T) / 2
            upper.copy_(mean)
            lower.copy_(mean.T)
    return g


def factor(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., r, r) PSD Grams -> (Y, Y^+) with Y Y^T = G: coordinates of the r rows in an r-dim space that keeps
    every inner product, and the pseudo-inverse that turns coordinates back into row combinations."""
    lam, u = lapack(torch.linalg.eigh, g)
    top = lam.amax(-1, keepdim=True).clamp_min(1e-300)
    if bool((lam < -PSD_TOLERANCE * top).any()):
        raise IndefiniteMetric("the input metric is not positive semi-definite (is it a second moment?)")
    keep = lam > RANK_TOLERANCE * top
    root = lam.clamp_min(0).sqrt()
    y = u * root[..., None, :]  # (..., r, r): row i's coordinates
    inv = torch.where(keep, 1 / root.clamp_min(1e-300), torch.zeros_like(root))
    return y, inv[..., :, None] * u.transpose(-1, -2)  # Y^+ = S^+ U^T


class KeySide(NamedTuple):
    """Query energy per K/V head and RoPE pair, and per-pair Grams of the key rows."""

    qe: torch.Tensor  # (K, d/2): sum over the query heads reading h of the pair's squared norm in the metric
    pairs: torch.Tensor  # (d/2, 2K, 2K): Gram of key rows (h, c) at pair p, row index 2h + c


def key_side(q_w, q_b, k_w, k_b, metric: Metric, num_heads: int, num_kv_heads: int, head_dim: int) -> KeySide:
    """Everything the key merge needs from q/k and the key metric. Pair p of a head is its rows p and p + d/2
    (transformers' rotate_half); a key merge only ever combines rows of the same pair, so the Grams are
    (d/2) blocks of 2K x 2K, not (K d)^2."""
    half, size = head_dim // 2, 2 * num_kv_heads
    energy = row_energies(q_w, q_b, metric).reshape(num_kv_heads, -1, 2, half)  # (K, r, 2, d/2)
    qe = energy.sum(dim=(1, 2))
    rows = torch.arange(num_kv_heads * head_dim).reshape(num_kv_heads, 2, half)  # (K, 2, d/2): row of (h, c, p)
    pairs = torch.empty(half, size, size, dtype=F64)
    step = max(1, BLOCK // size)  # pairs per application of the metric (each reads all of it)
    for p0 in range(0, half, step):
        idx = rows[:, :, p0 : p0 + step].permute(2, 0, 1).reshape(-1)  # pair-major: (pairs * 2K,)
        block = rows_f64(k_w[idx], None if k_b is None else k_b[idx], 0, len(idx), width(metric))
        applied = metric.apply(block)
        for t in range(len(idx) // size):
            part = slice(t * size, (t + 1) * size)
            pairs[p0 + t] = applied[part] @ block[part].T
    return KeySide(qe, (pairs + pairs.transpose(-1, -2)) / 2)  # only the metric's symmetric part is a metric


class ValueSide(NamedTuple):
    """The value rows' Gram in the value metric and each K/V head's o_proj energy."""

    gram: torch.Tensor  # (K d, K d): float32 for 16-bit weights (their own precision is 8 bits), else float64
    oe: torch.Tensor  # (K, d, d): sum of O_j^T O_j over the query heads j reading h


def value_side(v_w, v_b, o_w, metric: Metric, num_heads: int, num_kv_heads: int, head_dim: int) -> ValueSide:
    r = num_heads // num_kv_heads
    oe = torch.empty(num_kv_heads, head_dim, head_dim, dtype=F64)
    for h in range(num_kv_heads):  # one K/V head's o_proj columns in float64 at a time
        o = o_w[:, h * r * head_dim : (h + 1) * r * head_dim].to(F64).reshape(-1, r, head_dim)  # (n_out, r, d)
        oe[h] = torch.einsum("nrd,nre->de", o, o)
    # The (K d)^2 Gram is the merge's largest array (128 MiB at a 7B's 4096 value rows in float64); of 16-bit
    # weights float32 keeps every bit they have. Group blocks are factored in float64 either way.
    dtype = torch.float32 if v_w.dtype.itemsize <= 2 else F64
    return ValueSide(gram(v_w, v_b, metric, dtype=dtype), oe)
