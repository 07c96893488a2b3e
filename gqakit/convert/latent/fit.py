"""A latent-attention layer fitted to a layer of G K/V heads (`--kv-rank R --rope-dim D`): pure tensor maths.

RoPE part (the D/2 highest-frequency pairs, which DeepseekV3 rotates with one key shared by every head): per pair j
the G heads' keys are complex numbers z_m = k_m[j] + i k_m[j + d/2], and RoPE multiplies each by the same e^{i t w_j},
so any complex mixing across heads commutes with it (TransMLA's RoRoPE, with complex weights: a rotation and a scale
per head). The shared key is the principal component k' = u^H z of their covariance C = W W^H (top eigenvector
u), each head's key is taken as u_m k', and query head h
of group m reads k' through conj(u_m) q_h, exactly where the keys are rank one per pair.

Position-free part: the other d - D dims of each head (its lowest frequencies, which turn least over a context) are
the per-head `nope` keys, read without rotation. Latent: one rank-R factorisation of every group's nope keys and
values, Y = [K_nope; V] ~ B A, weighted where the errors land: nope keys by what their query heads read
(sum_h Wq_h Wq_h^T), values by what o_proj makes of them (sum_h O_h^T O_h), each block scaled to unit energy; the
best such factorisation is an SVD of L Y (B = L^-1 U_R, A = U_R^T L Y). From the weights alone every input direction
weighs alike; a calibrated fit (`inputs`: the metric S of the layer's attention inputs, `input_metric`) weighs
them as the calibration text uses them: the shared key per pair is the top eigenvector of W S W^H, and the latent
an SVD of L Y S^1/2 (still B = L^-1 U_R, A = U_R^T L Y: the best rank-R fit in that metric). kv_b_proj expands the
latent per head;
the latent's RMSNorm is cancelled as for the exact form (`hf.architectures.latent`), its realised scale divided out
of kv_b_proj.
"""
from __future__ import annotations

import torch

from gqakit.convert.latent.construct import latent_norm
from gqakit.hf.architectures.latent import BIAS_SCALE, KV_A, KV_A_BIAS, KV_B, KV_NORM, O, O_BIAS, Q, LatentShape

F64 = torch.float64


def _sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh((m + m.T) / 2)
    return (vectors * values.clamp(min=0).sqrt()) @ vectors.T


def rope_pairs(head_dim: int, rope_dim: int) -> tuple[list[int], list[int]]:
    """(the rotary pairs kept, the dims of the rest) of a rotate-half head: pair j is dims (j, j + d/2); the D/2
    highest frequencies are j < D/2."""
    half, keep = head_dim // 2, rope_dim // 2
    nope = [*range(keep, half), *range(half + keep, head_dim)]
    return list(range(keep)), nope


def input_metric(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One metric of a layer's attention inputs for a fit of its keys and values together: the calibration's key
    statistic (the covariance of the inputs each query attends to) and value statistic (the second moment of the
    attention-averaged input), each scaled to unit trace, summed (n, n), float64."""
    key, value = key.to(F64), value.to(F64)
    return (key / key.trace().clamp(min=1e-300) + value / value.trace().clamp(min=1e-300)) / 2


def shared_rope_key(k: torch.Tensor, k_bias: torch.Tensor | None, groups: int, head_dim: int, rope_dim: int,
                    inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the shared key's rows (D, n), its bias (D,), the complex weights u (G, D/2) with z_m ~ u_m k'). Weighting
    each head's key errors by how much its query heads read the pair measured no better on the embedded model
    (166.3 against 164.5 at --kv-rank 48 --rope-dim 16), so every head weighs alike. `inputs` (n, n): the input
    metric the keys' errors are measured in (None: the identity)."""
    half, keep = head_dim // 2, rope_dim // 2
    per = k.to(F64).reshape(groups, head_dim, -1)
    bias = (k_bias.to(F64) if k_bias is not None else torch.zeros(groups * head_dim, dtype=F64)).reshape(groups, -1)
    rows = torch.zeros(rope_dim, per.shape[-1], dtype=F64)
    row_bias = torch.zeros(rope_dim, dtype=F64)
    weights = torch.zeros(groups, keep, dtype=torch.complex128)
    for j in range(keep):
        z = torch.complex(per[:, j], per[:, half + j])  # (G, n)
        zb = torch.complex(bias[:, j], bias[:, half + j])
        zs = z if inputs is None else z @ inputs.to(z.dtype)
        cov = zs @ z.conj().T + torch.outer(zb, zb.conj())  # (G, G) Hermitian
        u = torch.linalg.eigh(cov)[1][:, -1]  # the top eigenvector
        shared, shared_bias = u.conj() @ z, u.conj() @ zb
        rows[j], rows[keep + j] = shared.real, shared.imag
        row_bias[j], row_bias[keep + j] = shared_bias.real, shared_bias.imag
        weights[:, j] = u
    return rows, row_bias, weights


def fit_latent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, shape: LatentShape,
               dtype: torch.dtype, k_bias: torch.Tensor | None = None, v_bias: torch.Tensor | None = None,
               errors: dict | None = None, inputs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The target's attention tensors (names under `latent.ATTENTION`) fitted to a layer's q (H*d, n), k and v
    (G*d, n), o (n, H*d) and optional k/v biases: from the weights alone, or with `inputs` (n, n; `input_metric`)
    in the metric of the layer's attention inputs.
    `errors` gets the relative errors ||W - W'|| / ||W|| of the keys and values the latent layer holds (the keys'
    rotary part as u_m k', their position-free part and the values from the latent), as the card reports them."""
    heads, d, D, N, r = shape.heads, shape.v_dim, shape.rope_dim, shape.nope_dim, shape.rank
    groups, n = k.shape[0] // d, k.shape[1]
    per_group = heads // groups
    half, keep = d // 2, D // 2
    kept, nope = rope_pairs(d, D)
    qh = q.to(F64).reshape(heads, d, n)
    rope_rows, rope_bias, u = shared_rope_key(k, k_bias, groups, d, D, inputs)

    new_q = torch.zeros(heads, N + D, n, dtype=F64)
    for h in range(heads):
        alpha = u[h // per_group]  # (D/2,) complex: this head's group's weights
        a, b = alpha.real[:, None], alpha.imag[:, None]
        q_re, q_im = qh[h, kept], qh[h, [half + j for j in kept]]
        new_q[h, :N] = qh[h, nope]
        new_q[h, N:N + keep], new_q[h, N + keep:] = a * q_re + b * q_im, a * q_im - b * q_re

    kg, vg = k.to(F64).reshape(groups, d, n), v.to(F64).reshape(groups, d, n)
    y = torch.cat([kg[:, nope].reshape(groups * N, n), vg.reshape(groups * d, n)])  # (G(N + d), n)
    kb = (k_bias.to(F64) if k_bias is not None else torch.zeros(groups * d, dtype=F64)).reshape(groups, d)
    vb = v_bias.to(F64) if v_bias is not None else torch.zeros(groups * d, dtype=F64)
    y_bias = torch.cat([kb[:, nope].reshape(-1), vb])
    y_read = y if inputs is None else y @ _sqrt_psd(inputs.to(F64))  # Y S^1/2: the errors as the inputs see them
    weight = _output_weights(qh[:, nope], o.to(F64).reshape(n, heads, d), groups, y_read)
    basis = torch.linalg.svd(weight @ y_read, full_matrices=False)[0][:, :r]  # U_R (G(N + d), R)
    del y_read
    down, up = basis.T @ weight @ y, torch.linalg.solve(weight, basis)  # A (R, n), B = L^-1 U_R
    latent_bias = basis.T @ weight @ y_bias
    if errors is not None:
        errors.update(_held_errors(kg, vg, rope_rows, u, up @ down, N, d))

    up_k, up_v = up[:groups * N].reshape(groups, N, r), up[groups * N:].reshape(groups, d, r)
    expand = torch.zeros(heads, N + d, shape.latent, dtype=F64)
    for h in range(heads):
        m = h // per_group
        expand[h, :N, :r], expand[h, N:, :r] = up_k[m], up_v[m]
    expand = expand.reshape(heads * (N + d), shape.latent)
    q_rows = new_q.reshape(heads * (N + D), n).to(dtype)
    if not shape.bias:  # the norm stays in the function: its weight is set from data (construct.fitted_norm)
        if k_bias is not None or v_bias is not None:
            raise ValueError("a bias-free latent holds no k/v biases")
        return {Q: q_rows, KV_A: torch.cat([down, rope_rows]).to(dtype), KV_NORM: torch.ones(r, dtype=dtype),
                KV_B: expand.to(dtype), O: o.to(dtype)}
    norm_weight, realised = latent_norm(r, dtype)
    a_rows = torch.cat([down, torch.zeros(1, n, dtype=F64), rope_rows])
    a_bias = torch.cat([latent_bias, torch.tensor([BIAS_SCALE], dtype=F64), rope_bias])
    return {Q: q_rows, KV_A: a_rows.to(dtype), KV_A_BIAS: a_bias.to(dtype), KV_NORM: norm_weight,
            KV_B: (expand / realised).to(dtype), O: o.to(dtype), O_BIAS: torch.zeros(o.shape[0], dtype=dtype)}


def _held_errors(kg: torch.Tensor, vg: torch.Tensor, rope_rows: torch.Tensor, u: torch.Tensor, held: torch.Tensor,
                 N: int, d: int) -> dict[str, float]:
    """{"k": ..., "v": ...}: relative errors of the keys and values as the fitted layer holds them."""
    groups, _, n = kg.shape
    keep = rope_rows.shape[0] // 2
    kept, nope = rope_pairs(d, 2 * keep)
    shared = torch.complex(rope_rows[:keep], rope_rows[keep:])  # (D/2, n)
    rebuilt = torch.zeros_like(kg)
    for m in range(groups):
        z = u[m][:, None] * shared
        rebuilt[m, kept], rebuilt[m, [d // 2 + j for j in kept]] = z.real, z.imag
    held_k, held_v = held[:groups * N].reshape(groups, N, n), held[groups * N:].reshape(groups, d, n)
    rebuilt[:, nope] = held_k
    return {"k": float((kg - rebuilt).norm() / kg.norm()), "v": float((vg - held_v).norm() / vg.norm())}


def _output_weights(q_nope: torch.Tensor, o: torch.Tensor, groups: int, y: torch.Tensor) -> torch.Tensor:
    """L (G(N + d), G(N + d)), block-diagonal: per group, the square root of what its query heads read of the nope
    keys (sum_h Wq_h Wq_h^T) and of what o_proj makes of its values (sum_h O_h^T O_h); the key blocks together and
    the value blocks together scaled to unit energy on Y."""
    heads, N, n = q_nope.shape
    d = o.shape[-1]
    per_group = heads // groups
    blocks = []
    for kind in ("k", "v"):
        for m in range(groups):
            members = range(m * per_group, (m + 1) * per_group)
            if kind == "k":
                read = sum(q_nope[h] @ q_nope[h].T for h in members)
            else:
                read = sum(o[:, h].T @ o[:, h] for h in members)
            ridge = 1e-6 * read.diagonal().mean() if read.numel() else 0.0  # directions nothing reads stay finite
            blocks.append(_sqrt_psd(read + ridge * torch.eye(read.shape[0], dtype=F64)))
    weight = torch.block_diag(*blocks) if blocks else torch.zeros(0, 0, dtype=F64)
    split = groups * N
    for part in (slice(0, split), slice(split, weight.shape[0])):
        energy = (weight[part, part] @ y[part]).norm()
        if energy > 0:
            weight[part, part] /= energy
    return weight
