"""Aligned K/V merges: move each head into a common basis with an exact reparametrisation, then pool.

Pure tensor maths (no I/O, no configs); float64 inside, results in the input dtype. Layouts are
Hugging Face's: `q_proj` `[H*d, n]`, `k_proj`/`v_proj` `[K*d, n]`, `o_proj` `[n, H*d]`; query head j
reads K/V head j // (H/K) (contiguous, as `repeat_kv` expects); RoPE is transformers' `rotate_half`
layout, which rotates dimension i together with i + d/2 (frequency index i < d/2) in every head.

Exact freedoms of a trained attention layer (the model's function does not change):

* keys: on each RoPE pair of K/V head h, any *scaled rotation* C = a*I + b*J (J = [[0,-1],[1,0]],
  a complex scalar a + ib) with K_h -> C^-1 K_h and Q_j -> C^T Q_j on the same pair of every query
  head j reading h. C commutes with RoPE's rotations, so q.k is unchanged at every position.
  A reflection or a general 2x2 map does not commute with RoPE and is not allowed.
* values: any invertible d x d map B per K/V head with V_h -> B^-1 V_h and O_j -> O_j B on the
  o_proj columns of every query head j reading h (orthogonal B: O_j B = O_j U^T with U = B^T).
* a permutation of whole K/V heads that moves their query heads (q rows, o columns) with them.

A merge of a group writes one shared head Kg (Vg) and per-head maps: head h then sees C_h Kg in
place of K_h (B_h Vg in place of V_h). The merge is exact whenever each K_h is C_h Kg for some such
C_h (V_h = B_h Vg); plain mean-pooling is the special case C_h = I, B_h = I.

An optional input metric (`input_moment` = E[x x^T] of the projections' input, or `input_scale` =
a per-channel scale such as the input RMSNorm weight) changes the norm in which heads are compared.
Every merge quantity depends on the rows only through their Grams in that metric (`grams.py`): the maths
runs on factor coordinates of the rows, and each merged row is written as the same combination of the
original rows, so every written weight stays exact in the original basis and nothing n x n is inverted.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from gqakit.convert.threads import lapack, one_thread
from gqakit.convert.methods import GROUPINGS
from gqakit.convert.methods.grams import KeySide, ValueSide, factor, key_side, metric_from_matrix, value_side

F64 = torch.float64
KEY_SCALES = ("none", "balance", "match")
REFERENCES = ("first", "mean")
MERGES = ("mean", "pca")
RESTORES = ("none", "norm", "refit")


class MergedAttention(NamedTuple):
    """One layer's attention weights after an aligned merge (biases None where the input had none)."""

    q_w: torch.Tensor
    k_w: torch.Tensor
    v_w: torch.Tensor
    o_w: torch.Tensor
    q_b: torch.Tensor | None
    k_b: torch.Tensor | None
    v_b: torch.Tensor | None
    perm: tuple[int, ...]  # K/V head order used for grouping (identity for contiguous groups)


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------

def _augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[rows, n] weight and [rows] bias as one float64 [rows, n(+1)] affine map of (x, 1)."""
    w = w.to(F64)
    return w if b is None else torch.cat([w, b.to(F64)[:, None]], dim=1)


def _split(a: torch.Tensor, b: torch.Tensor | None, like_w: torch.Tensor, like_b: torch.Tensor | None):
    if like_b is None:
        return a.to(like_w.dtype), None
    return a[:, :-1].to(like_w.dtype).contiguous(), a[:, -1].to(like_b.dtype).contiguous()


def to_pairs(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[heads*d, n] rows -> (heads, d/2, 2, n): pair i of a head holds its rows i and i + d/2."""
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd; RoPE pairs need an even head_dim")
    return w.reshape(num_heads, 2, head_dim // 2, -1).transpose(1, 2)  # (heads, d/2, 2, n)


def from_pairs(p: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_pairs`: (heads, d/2, 2, n) -> [heads*d, n]."""
    heads, half, _, n = p.shape
    return p.transpose(1, 2).reshape(heads * 2 * half, n)


def _j(x: torch.Tensor) -> torch.Tensor:
    """J @ x on the pair axis (-2) for J = [[0, -1], [1, 0]]: a 90-degree rotation."""
    return torch.stack([-x[..., 1, :], x[..., 0, :]], dim=-2)


def scaled_rotation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., 2, 2) matrices a*I + b*J: the maps of a RoPE pair that commute with RoPE."""
    return torch.stack([torch.stack([a, -b], -1), torch.stack([b, a], -1)], -2)


def rotation(theta: torch.Tensor) -> torch.Tensor:
    """(..., 2, 2) rotation matrices by `theta` (det +1)."""
    return scaled_rotation(torch.cos(theta), torch.sin(theta))


def is_scaled_rotation(m: torch.Tensor, tol: float = 1e-9) -> bool:
    """Whether every (..., 2, 2) matrix is a*I + b*J (up to `tol` relative to its size)."""
    err = (m[..., 0, 0] - m[..., 1, 1]).abs() + (m[..., 0, 1] + m[..., 1, 0]).abs()
    return bool((err <= tol * (1 + m.abs().amax(dim=(-1, -2)))).all())


# ------------------------------------------------------------------------------------------------
# closed-form fits
# ------------------------------------------------------------------------------------------------

def rotation_from_cross(m: torch.Tensor) -> torch.Tensor:
    """The rotation R (det +1) maximising tr(R^T M) for (..., 2, 2) M: theta = atan2(M10 - M01, M00 + M11).
    A zero M gives the identity."""
    return rotation(torch.atan2(m[..., 1, 0] - m[..., 0, 1], m[..., 0, 0] + m[..., 1, 1]))


def orthogonal_from_cross(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal U maximising tr(U^T M) for (..., d, d) M = W S Z^T: U = W Z^T (reflections allowed:
    values may use any orthogonal map)."""
    w, _, zt = lapack(torch.linalg.svd, m)
    return w @ zt


def pair_rotation_to(src: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The rotation R (det +1) minimising ||R src - ref||_F for (..., 2, n) blocks, batched."""
    return rotation_from_cross(ref @ src.transpose(-1, -2))


def orthogonal_procrustes(src: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The orthogonal U minimising ||U src - ref||_F for (..., d, n) blocks."""
    return orthogonal_from_cross(ref @ src.transpose(-1, -2))


def generalized_procrustes(blocks: torch.Tensor, fit, reference: str = "mean", iterations: int = 20,
                           tol: float = 1e-12) -> torch.Tensor:
    """Maps T (one per block) that align `blocks` (G, m, [L,] r, n) within each group: T @ block ~ reference.

    `fit(M)` returns the map of the allowed kind that maximises tr(T^T M) for the cross matrix
    M = reference @ block^T (`rotation_from_cross`, `orthogonal_from_cross`). `reference="first"` aligns
    every head to the group's first head; `"mean"` starts there and re-aligns to the mean of the aligned
    heads until the mean stops moving (generalised Procrustes analysis).

    Works on the heads' cross Gram matrices B_h B_j^T, computed once: each iteration then costs
    O(m^2 r^3) per group instead of touching the input dimension n (a 7B layer: seconds, not minutes).
    """
    if reference not in REFERENCES:
        raise ValueError(f"unknown reference {reference!r}; choose one of {', '.join(REFERENCES)}")
    flat = blocks.dim() == 4  # (G, m, r, n): give it a unit L axis
    b = blocks[:, :, None] if flat else blocks  # (G, m, L, r, n)
    cross = torch.einsum("ghlrn,gjlsn->ghjlrs", b, b)  # (G, m, m, L, r, r): B_h B_j^T
    m = b.shape[1]
    maps = fit(cross[:, 0])  # every head to the first: M_j = B_0 B_j^T
    if reference == "mean":
        coef = torch.zeros_like(maps)  # the reference as sum_h A_h B_h: the first head
        coef[:, 0] = torch.eye(b.shape[-2], dtype=b.dtype)
        for _ in range(iterations):
            new = maps / m  # the mean of the aligned heads
            diff = new - coef
            moved = torch.einsum("ghlrs,ghjlst,gjlrt->", diff, cross, diff)
            size = torch.einsum("ghlrs,ghjlst,gjlrt->", new, cross, new)
            coef = new
            maps = fit(torch.einsum("ghlrs,ghjlst->gjlrt", coef, cross))  # M_j = ref B_j^T
            if moved.clamp_min(0).sqrt() < tol * size.clamp_min(1e-300).sqrt():
                break
    return maps[:, :, 0] if flat else maps


# ------------------------------------------------------------------------------------------------
# exact transforms (used by the merge, and in tests on their own)
# ------------------------------------------------------------------------------------------------

def transform_keys(q_w, k_w, maps, num_heads: int, num_kv_heads: int, head_dim: int, q_b=None, k_b=None):
    """Apply scaled rotations A (K, d/2, 2, 2) to the key pairs (K_h -> A K_h) and A^-T to the pairs of
    every query head reading h. Returns (q_w, k_w, q_b, k_b); q.k is unchanged at every position."""
    maps = maps.to(F64)
    if not is_scaled_rotation(maps):
        raise ValueError("key maps must be scaled rotations a*I + b*J; other 2x2 maps do not commute with RoPE")
    r = num_heads // num_kv_heads
    kp = to_pairs(_augment(k_w, k_b), num_kv_heads, head_dim)  # (K, d/2, 2, n)
    qp = to_pairs(_augment(q_w, q_b), num_heads, head_dim).reshape(num_kv_heads, r, head_dim // 2, 2, -1)
    q_maps = lapack(torch.linalg.inv, maps).transpose(-1, -2)  # A^-T, again a scaled rotation
    k_new = from_pairs(maps @ kp)
    q_new = from_pairs((q_maps[:, None] @ qp).reshape(num_heads, head_dim // 2, 2, -1))
    (q_out, qb_out), (k_out, kb_out) = _split(q_new, q_b, q_w, q_b), _split(k_new, k_b, k_w, k_b)
    return q_out, k_out, qb_out, kb_out


def transform_values(v_w, o_w, maps, num_heads: int, num_kv_heads: int, head_dim: int, v_b=None):
    """Apply invertible d x d maps U (K, d, d) to the value heads (V_h -> U V_h) and U^-1 on the right of
    the o_proj columns of every query head reading h. Returns (v_w, o_w, v_b); the output is unchanged."""
    maps = maps.to(F64)
    r = num_heads // num_kv_heads
    v = _augment(v_w, v_b).reshape(num_kv_heads, head_dim, -1)  # (K, d, n)
    o = o_w.to(F64).reshape(o_w.shape[0], num_kv_heads, r, head_dim)  # (n, K, r, d)
    v_new = (maps @ v).reshape(num_kv_heads * head_dim, -1)
    o_new = torch.einsum("nkrd,kde->nkre", o, lapack(torch.linalg.inv, maps)).reshape(o_w.shape)
    v_out, vb_out = _split(v_new, v_b, v_w, v_b)
    return v_out, o_new.to(o_w.dtype), vb_out


def permute_kv_heads(q_w, k_w, v_w, o_w, perm, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_b=None, k_b=None, v_b=None):
    """Reorder whole K/V heads (new head a = old head perm[a]) with their query heads' q rows and o
    columns, so contiguous `repeat_kv` still pairs them. The model's function is unchanged."""
    perm = torch.as_tensor(list(perm))
    if sorted(perm.tolist()) != list(range(num_kv_heads)):
        raise ValueError(f"{perm.tolist()} is not a permutation of {num_kv_heads} K/V heads")
    r = num_heads // num_kv_heads

    def rows(t, heads_per):  # permute blocks of heads_per*d entries along axis 0
        return None if t is None else t.reshape(num_kv_heads, heads_per * head_dim, *t.shape[1:])[perm].reshape(t.shape)

    o_new = o_w.reshape(o_w.shape[0], num_kv_heads, r * head_dim)[:, perm].reshape(o_w.shape)
    return rows(q_w, r), rows(k_w, 1), rows(v_w, 1), o_new, rows(q_b, r), rows(k_b, 1), rows(v_b, 1)


# ------------------------------------------------------------------------------------------------
# merges of one layer (all in the metric's coordinates; maps are coordinate-free)
# ------------------------------------------------------------------------------------------------

def _merge_keys(kp, qe, groups, scale, reference, merge, restore, iterations):
    """kp: (K, d/2, 2, n) key pairs, qe: (K, d/2) query energy per pair (summed over query heads).
    Returns Kg (G, d/2, 2, n) and C (K, d/2, 2, 2) with K_h ~ C_h Kg."""
    num_kv, half, _, n = kp.shape
    m = num_kv // groups
    kn = kp.norm(dim=(-1, -2))  # (K, d/2)
    safe = kn.clamp_min(1e-300)
    if merge == "pca":  # weighted complex rank-1 fit; invariant to every scaled rotation of the heads
        z = torch.complex(kp[..., 0, :], kp[..., 1, :]).reshape(groups, m, half, n)
        a = (qe.reshape(groups, m, half, 1).sqrt() * z).transpose(1, 2)  # (G, d/2, m, n)
        v = lapack(torch.linalg.svd, a, full_matrices=False).Vh[..., 0, :]  # (G, d/2, n), unit norm
        v = v * z.abs().pow(2).sum(-1).mean(1).sqrt()[..., None]  # the group's rms key norm per pair
        phase = (v.conj() * z[:, 0]).sum(-1)  # face the group's first head (cosmetic)
        v = v * torch.where(phase.abs() > 0, phase / phase.abs().clamp_min(1e-300), torch.ones_like(phase))[..., None]
        kg = torch.stack([v.real, v.imag], dim=-2)  # (G, d/2, 2, n)
        return kg, _refit_keys(kp, kg, m)
    if scale == "none":
        s = torch.ones_like(kn)
    elif scale == "balance":  # |s K| = |Q / s| (all query heads reading h): each side carries sqrt(|Q||K|)
        s = torch.where(kn > 0, (qe / safe.pow(2)).pow(0.25), torch.ones_like(kn))
    else:  # "match": every head's pair gets the group's mean key norm
        target = kn.reshape(groups, m, half).mean(1, keepdim=True).expand(groups, m, half).reshape(num_kv, half)
        s = torch.where(kn > 0, target / safe, torch.ones_like(kn))
    blocks = (s[..., None, None] * kp).reshape(groups, m, half, 2, n)
    rot = generalized_procrustes(blocks, rotation_from_cross, reference, iterations)  # (G, m, d/2, 2, 2)
    aligned = rot @ blocks
    kg = aligned.mean(dim=1)  # (G, d/2, 2, n)
    if restore == "norm":  # give the merged pair the mean norm of the aligned pairs it replaces
        target = aligned.norm(dim=(-1, -2)).mean(1)
        kg = kg * (target / kg.norm(dim=(-1, -2)).clamp_min(1e-300))[..., None, None]
    if restore == "refit":  # C_h absorbs any scale: give Kg the group's rms key norm (copies stay copies)
        rms = kn.pow(2).reshape(groups, m, half).mean(1).sqrt()
        kg = kg * (rms / kg.norm(dim=(-1, -2)).clamp_min(1e-300))[..., None, None]
        return kg, _refit_keys(kp, kg, m)
    c = rot.reshape(num_kv, half, 2, 2).transpose(-1, -2) / s[..., None, None]  # (s R)^-1 = R^T / s
    return kg, c


def _refit_keys(kp, kg, m):
    """Least-squares scaled rotation C_h per pair with K_h ~ C_h Kg (exact when K_h is in its span)."""
    g = kg.repeat_interleave(m, dim=0)  # (K, d/2, 2, n)
    den = g.pow(2).sum(dim=(-1, -2)).clamp_min(1e-300)
    a = (g * kp).sum(dim=(-1, -2)) / den
    b = (_j(g) * kp).sum(dim=(-1, -2)) / den
    return scaled_rotation(a, b)


def _merge_values(v, oe, groups, reference, merge, restore, iterations):
    """v: (K, d, n) value heads, oe: (K, d, d) sum of O_j^T O_j over the query heads reading each head.
    Returns Vg (G, d, n) and B (K, d, d) with V_h ~ B_h Vg."""
    num_kv, d, n = v.shape
    m = num_kv // groups
    vg_heads = v.reshape(groups, m, d, n)
    rms = vg_heads.pow(2).sum(dim=(-1, -2)).mean(1).sqrt()  # (G,)
    if merge == "pca":  # shared row space that keeps the most of sum_h ||O_h V_h||^2
        # = the top-d right singular vectors of the stacked sqrt(O_h^T O_h) V_h: an (m d) x n SVD, never n x n
        b = (_sqrt_psd(oe) @ v).reshape(groups, m * d, n)
        w = lapack(torch.linalg.svd, b, full_matrices=False).Vh[..., :d, :]  # (G, d, n) orthonormal rows
        # Rotate the basis to face the first head (cosmetic; B absorbs any d x d map).
        first = vg_heads[:, 0] / vg_heads[:, 0].norm(dim=(-1, -2), keepdim=True).clamp_min(1e-300)
        w = orthogonal_procrustes(w, first) @ w
        vg = w * (rms / math.sqrt(d))[:, None, None]
        return vg, _refit_values(v, vg, m)
    u = generalized_procrustes(vg_heads, orthogonal_from_cross, reference, iterations)  # (G, m, d, d)
    aligned = u @ vg_heads
    vg = aligned.mean(dim=1)
    if restore == "norm":
        vg = vg * (aligned.norm(dim=(-1, -2)).mean(1) / vg.norm(dim=(-1, -2)).clamp_min(1e-300))[:, None, None]
    if restore == "refit":
        return vg, _refit_values(v, vg, m)
    return vg, u.reshape(num_kv, d, d).transpose(-1, -2)


def _refit_values(v, vg, m):
    """Least-squares B_h with V_h ~ B_h Vg (B_h = V_h Vg^+)."""
    return v @ lapack(torch.linalg.pinv, vg).repeat_interleave(m, dim=0)  # (K, d, d)


def _sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of (..., d, d) positive semi-definite matrices."""
    w, u = lapack(torch.linalg.eigh, m)
    return (u * w.clamp_min(0).sqrt()[..., None, :]) @ u.transpose(-1, -2)


def _key_gram(kp, qe) -> torch.Tensor:
    """(d/2, K, K) complex inner products of the query-weighted key pairs of every two heads."""
    z = torch.complex(kp[..., 0, :], kp[..., 1, :]) * qe.sqrt()[..., None]  # (K, d/2, n)
    return torch.einsum("apn,bpn->pab", z, z.conj())


def _value_blocks(gram4: torch.Tensor, root_oe: torch.Tensor):
    """value_block(heads) -> the o_proj-weighted value Gram sqrt(oe_a) G_ab sqrt(oe_b) of those heads,
    (m d, m d), from the value rows' Gram (K, d, K, d) and sqrt(oe) (K, d, d): built per candidate group, so
    no second (K d)^2 matrix is held."""
    def block(heads) -> torch.Tensor:
        t = torch.tensor(list(heads))
        w = torch.einsum("aij,ajbk,blk->aibl", root_oe[t], gram4[t][:, :, t].to(F64), root_oe[t])  # (m, d, m, d)
        return w.reshape(len(t) * gram4.shape[1], -1)
    return block


def _group_cost(key_gram, value_block, heads, head_dim: int) -> tuple[float, float]:
    idx = torch.tensor(list(heads))
    # (d/2, m): the weighted rank-1 fit keeps the top one
    ev = lapack(torch.linalg.eigvalsh, key_gram[:, idx][:, :, idx])
    key = (ev.sum(-1) - ev[:, -1]).sum().item()
    ev = lapack(torch.linalg.eigvalsh, value_block(heads))  # the rank-d fit keeps the top d
    return key, (ev.sum() - ev[-head_dim:].sum()).item()


def _explicit_grams(kp, qe, v, oe):
    """Key Gram, value-block function and totals from explicit (metric-coordinate) rows."""
    key_total = (qe * kp.pow(2).sum(dim=(-1, -2))).sum().item()
    val_total = torch.einsum("kdn,kde,ken->", v, oe, v).item()
    return _key_gram(kp, qe), _value_blocks(torch.einsum("adn,ben->adbe", v, v), _sqrt_psd(oe)), key_total, val_total


def similarity_groups(kp, qe, v, oe, groups: int, exhaustive_limit: int = 5000) -> tuple[int, ...]:
    """A K/V head order whose contiguous groups minimise the summed relative merge cost (keys + values), from
    explicit rows: kp (K, d/2, 2, n) key pairs, qe (K, d/2), v (K, d, n) value rows, oe (K, d, d)."""
    return group_order(*_explicit_grams(kp, qe, v, oe), kp.shape[0], groups, v.shape[1], exhaustive_limit)


def group_order(key_gram, value_block, key_total: float, val_total: float, num_kv: int, groups: int,
                head_dim: int, exhaustive_limit: int = 5000) -> tuple[int, ...]:
    """`similarity_groups` from Grams: exact (dynamic programming over subsets) when there are few candidate
    groups, else greedy. Each candidate costs O((m d)^3), never O(n^3)."""
    m = num_kv // groups
    if groups in (1, num_kv):
        return tuple(range(num_kv))
    with one_thread():  # thousands of small eigvalsh calls: see convert/threads.py
        return _search(key_gram, value_block, key_total, val_total, num_kv, m, head_dim, exhaustive_limit)


def _search(key_gram, value_block, key_total: float, val_total: float, num_kv: int, m: int, head_dim: int,
            exhaustive_limit: int) -> tuple[int, ...]:
    """`group_order`'s search for groups of m heads."""
    cache: dict[tuple[int, ...], float] = {}

    def cost(s):
        if s not in cache:
            key, val = _group_cost(key_gram, value_block, s, head_dim)
            cache[s] = key / max(key_total, 1e-300) + val / max(val_total, 1e-300)
        return cache[s]

    if math.comb(num_kv, m) <= exhaustive_limit:
        best: dict[tuple[int, ...], tuple[float, list]] = {}

        def solve(rest: tuple[int, ...]):
            if not rest:
                return 0.0, []
            if rest not in best:
                first, others = rest[0], rest[1:]
                options = []
                for mates in itertools.combinations(others, m - 1):
                    s = (first, *mates)
                    sub, parts = solve(tuple(h for h in others if h not in mates))
                    options.append((cost(s) + sub, [s, *parts]))
                best[rest] = min(options, key=lambda t: t[0])
            return best[rest]

        parts = solve(tuple(range(num_kv)))[1]
    else:
        left, parts = list(range(num_kv)), []
        while left:
            s = (left.pop(0),)
            while len(s) < m:
                pick = min(left, key=lambda h: cost(tuple(sorted((*s, h)))))
                left.remove(pick)
                s = tuple(sorted((*s, pick)))
            parts.append(s)
    return tuple(h for s in parts for h in s)


def check_merge_options(num_heads: int, num_kv_heads: int, groups: int, *, align: bool = True,
                        key_scale: str = "none", reference: str = "mean", merge: str = "mean",
                        restore: str = "refit", grouping: str = "contiguous", k_norm=None) -> None:
    """ValueError for options `align_and_merge_layer` does not take (before any work)."""
    if k_norm is not None:
        raise ValueError("a per-head key norm (k_norm) acts between k_proj and RoPE and does not commute with "
                         "the key alignment's rotations and scales; use --method mean for this model")
    for name, value, allowed in (("key_scale", key_scale, KEY_SCALES), ("reference", reference, REFERENCES),
                                 ("merge", merge, MERGES), ("restore", restore, RESTORES),
                                 ("grouping", grouping, GROUPINGS)):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
    if merge == "pca" and restore != "refit":
        raise ValueError("merge='pca' defines each head's map by a least-squares refit; use restore='refit'")
    if align and merge == "mean" and key_scale == "balance" and restore != "refit":
        raise ValueError("key_scale='balance' weights each head by its queries, so the merged key no longer "
                         "matches any head's scale; use restore='refit' (or key_scale='match' / 'none')")
    if num_heads % num_kv_heads or num_kv_heads % groups:
        raise ValueError(f"{num_heads} query heads, {num_kv_heads} K/V heads, {groups} groups: each must divide "
                         "the one before")


def align_and_merge_layer(q_w, k_w, v_w, o_w, q_b, k_b, v_b, num_heads: int, num_kv_heads: int, groups: int,
                          head_dim: int, *, align: bool = True, key_scale: str = "none",
                          reference: str = "mean", merge: str = "mean", restore: str = "refit",
                          grouping: str = "contiguous", iterations: int = 20, k_norm=None,
                          input_moment=None, input_scale=None, value_moment=None) -> MergedAttention:
    """Merge one layer's K/V heads into `groups` heads after aligning them with exact reparametrisations.

    Returns q/o with their shapes (their heads transformed), k/v (and biases) with `groups` heads, in
    the input dtypes. Guarantees (tested): identical heads merge to that head with q/o unchanged
    (`merge="pca"`: the same function, another basis); heads that differ only by exact freedoms
    (per-pair scaled rotations of keys, orthogonal maps of values) merge without changing the
    model's function with restore="refit", with merge="pca", and with key_scale="match" for any
    restore (key_scale="none" without refit: only when the key maps are pure rotations); G = K
    returns the layer unchanged up to rounding. Exactness is float64 inside, then the input dtype.

    Keys, per RoPE pair: `key_scale` ("none"; "match" = the group's mean key norm; "balance" = key
    norm equal to the query heads' norm) then a rotation, closed-form 2x2 Procrustes to the group's
    first head (`reference="first"`) or generalised Procrustes to the mean (`"mean"`). Values:
    orthogonal Procrustes the same way. `merge="mean"` averages the aligned heads; `restore`:
    "none" keeps each head's inverse alignment map, "norm" also rescales each merged key pair / value
    head to the mean norm of the aligned heads, "refit" (default) replaces each head's map by the
    least-squares one (key: a scaled rotation per pair; value: B_h = V_h Vg^+), which is never worse
    in weight space and is exact for heads related by any exact freedom. "balance" needs "refit".
    `merge="pca"` instead writes the shared head that minimises the query-weighted score error (a
    complex rank-1 fit per pair) and the o_proj-weighted value error (top-d subspace) in the metric,
    with "refit" maps. `align=False` is plain mean-pooling (`restore` still applies).
    `grouping="similarity"` first permutes whole K/V heads (with their query heads) so that the
    heads with the smallest joint merge cost share a group (exact search when small, else greedy).
    `input_moment` (E[x x^T] of the projections' input, [n, n], or [n+1, n+1] for (x, 1) with biases)
    or `input_scale` ([n]) sets the metric in which heads are compared (plus a ridge of 1e-6 of its
    mean diagonal); `value_moment` overrides it for values. Raises ValueError for per-head key norms
    (`k_norm`: Qwen3/Gemma3), which do not commute with the key maps, and for invalid options.

    Computed from the rows' Grams in the metric (`grams.py`), in blocks: `key_side`, `value_side`,
    `coordinates` and `merge_coordinates`, which a caller may also run one statistic at a time.
    """
    options = dict(align=align, key_scale=key_scale, reference=reference, merge=merge, restore=restore)
    check_merge_options(num_heads, num_kv_heads, groups, k_norm=k_norm, grouping=grouping, **options)
    n = k_w.shape[1]
    key_metric = metric_from_matrix(n, k_b is not None or q_b is not None, input_moment, input_scale)
    value_metric = metric_from_matrix(n, v_b is not None, input_moment if value_moment is None else value_moment,
                                      input_scale)
    keys = key_side(q_w, q_b, k_w, k_b, key_metric, num_heads, num_kv_heads, head_dim)
    values = value_side(v_w, v_b, o_w, value_metric, num_heads, num_kv_heads, head_dim)
    coords = coordinates(keys, values, num_kv_heads, groups, head_dim, grouping)
    del keys, values
    return merge_coordinates(q_w, k_w, v_w, o_w, q_b, k_b, v_b, coords, num_heads, num_kv_heads, groups, head_dim,
                             iterations=iterations, **options)


class Coordinates(NamedTuple):
    """A layer's K/V rows in factor coordinates (every inner product in the metric kept), in the merge's head
    order, with what turns merged coordinates back into combinations of the original rows."""

    kp: torch.Tensor  # (K, d/2, 2, 2K): key rows per pair
    key_back: torch.Tensor  # (d/2, 2K, 2K): coordinates -> coefficients over key rows (h, c) of pair p
    qe: torch.Tensor  # (K, d/2)
    v: torch.Tensor  # (K, d, m d): value rows in their group's coordinates
    value_back: torch.Tensor  # (G, m d, m d)
    value_rows: torch.Tensor  # (G, m d): each group's original value rows
    oe: torch.Tensor  # (K, d, d)
    perm: tuple[int, ...]


def coordinates(keys: KeySide, values: ValueSide, num_kv_heads: int, groups: int, head_dim: int,
                grouping: str = "contiguous") -> Coordinates:
    """Factor the key (per pair, all heads: width 2K) and value (per group: width m d) Grams, choosing the
    grouping first when it is by similarity. Holds nothing of size n: the caller may drop the sides after."""
    K, G, d, half = num_kv_heads, groups, head_dim, head_dim // 2
    m = K // G
    ky, key_back = factor(keys.pairs)  # (d/2, 2K, 2K)
    kp = ky.reshape(half, K, 2, 2 * K).permute(1, 0, 2, 3)  # (K, d/2, 2, 2K)
    qe, oe = keys.qe, values.oe
    gram4 = values.gram.view(K, d, K, d)
    perm = tuple(range(K))
    if grouping == "similarity" and G not in (1, K):
        key_total = (qe * kp.pow(2).sum(dim=(-1, -2))).sum().item()
        val_total = sum((oe[h] * gram4[h, :, h].to(F64)).sum().item() for h in range(K))
        perm = group_order(_key_gram(kp, qe), _value_blocks(gram4, _sqrt_psd(oe)), key_total, val_total, K, G, d)
    p = torch.tensor(perm)
    value_rows = (p.reshape(G, m)[:, :, None] * d + torch.arange(d)).reshape(G, m * d)
    vy, value_back = factor(torch.stack([values.gram[rows][:, rows].to(F64) for rows in value_rows]))  # (G, m d, m d)
    return Coordinates(kp[p], key_back, qe[p], vy.reshape(K, d, m * d), value_back, value_rows, oe[p], perm)


def merge_coordinates(q_w, k_w, v_w, o_w, q_b, k_b, v_b, coords: Coordinates, num_heads: int, num_kv_heads: int,
                      groups: int, head_dim: int, *, align: bool = True, key_scale: str = "none",
                      reference: str = "mean", merge: str = "mean", restore: str = "refit",
                      iterations: int = 20) -> MergedAttention:
    """The merge on factor coordinates (see `align_and_merge_layer` for the options); each merged row is
    written as the same combination of the original rows as of their coordinates, so no metric is inverted
    and no whitened weight exists. One K/V head's rows are float64 at a time."""
    K, G, d, half = num_kv_heads, groups, head_dim, head_dim // 2
    r, m = num_heads // K, K // G
    kp, qe, v, oe, perm = coords.kp, coords.qe, coords.v, coords.oe, coords.perm
    if align:
        kg, c = _merge_keys(kp, qe, G, key_scale, reference, merge, restore, iterations)
        vg, bmaps = _merge_values(v, oe, G, reference, merge, restore, iterations)
    else:  # mean-pooling, optionally with a norm restore or a refit of each head's maps
        kg = kp.reshape(G, m, half, 2, -1).mean(1)
        vg = v.reshape(G, m, d, -1).mean(1)
        if restore == "norm":
            kt = kp.norm(dim=(-1, -2)).reshape(G, m, half).mean(1)
            kg = kg * (kt / kg.norm(dim=(-1, -2)).clamp_min(1e-300))[..., None, None]
            vt = v.norm(dim=(-1, -2)).reshape(G, m).mean(1)
            vg = vg * (vt / vg.norm(dim=(-1, -2)).clamp_min(1e-300))[:, None, None]
        if restore == "refit":
            c, bmaps = _refit_keys(kp, kg, m), _refit_values(v, vg, m)
        else:
            c = torch.eye(2, dtype=F64).expand(K, half, 2, 2)
            bmaps = torch.eye(d, dtype=F64).expand(K, d, d)

    # Back to the original basis: a merged row is the same combination of original rows as of their coordinates.
    # (d/2, 2G, 2K): each merged pair row as coefficients over the original key rows (h, c) of that pair
    k_coef = kg.permute(1, 0, 2, 3).reshape(half, 2 * G, 2 * K) @ coords.key_back
    key_rows = torch.arange(K * d).reshape(K, 2, half)
    k_out = k_w.new_empty(G, 2, half, k_w.shape[1])
    kb_out = None if k_b is None else k_b.new_empty(G, 2, half)
    for i in range(half):  # written straight into the output dtype, one pair at a time
        sel = key_rows[:, :, i].reshape(-1)
        row = (k_coef[i] @ _augment(k_w[sel], None if k_b is None else k_b[sel])).reshape(G, 2, -1)
        k_out[:, :, i] = row[..., : k_w.shape[1]]
        if k_b is not None:
            kb_out[:, :, i] = row[..., -1]
    v_out = v_w.new_empty(G, d, v_w.shape[1])
    vb_out = None if v_b is None else v_b.new_empty(G, d)
    for g in range(G):
        rows = coords.value_rows[g]
        new = vg[g] @ coords.value_back[g] @ _augment(v_w[rows], None if v_b is None else v_b[rows])  # (d, n')
        v_out[g] = new[:, : v_w.shape[1]]
        if v_b is not None:
            vb_out[g] = new[:, -1]
    q_out, o_out = torch.empty_like(q_w), torch.empty_like(o_w)
    qb_out = None if q_b is None else torch.empty_like(q_b)
    ct = c.transpose(-1, -2)  # (K, d/2, 2, 2): query pairs get C^T
    n_q = q_w.shape[1]
    for a, h in enumerate(perm):  # one K/V head's query rows and o_proj columns in float64 at a time
        src, dst = slice(h * r * d, (h + 1) * r * d), slice(a * r * d, (a + 1) * r * d)
        pairs = to_pairs(_augment(q_w[src], None if q_b is None else q_b[src]), r, d)  # (r, d/2, 2, n')
        new = from_pairs(ct[a] @ pairs)
        q_out[dst] = new[:, :n_q].to(q_w.dtype)
        if q_b is not None:
            qb_out[dst] = new[:, n_q].to(q_b.dtype)
        o = o_w[:, src].to(F64).reshape(o_w.shape[0], r, d)  # (n_out, r, d)
        o_out[:, dst] = (o @ bmaps[a]).reshape(o_w.shape[0], r * d).to(o_w.dtype)  # O B
    k_out, v_out = k_out.reshape(G * d, -1), v_out.reshape(G * d, -1)  # (G, 2, d/2, n), (G, d, n) -> rows
    kb_out, vb_out = (None if t is None else t.reshape(-1) for t in (kb_out, vb_out))
    return MergedAttention(q_out, k_out, v_out, o_out, qb_out, kb_out, vb_out, perm)
