"""A latent-attention layer fitted to a layer of G K/V heads (`--kv-rank R --rope-dim D`): pure tensor maths.

RoPE part (the D/2 highest-frequency pairs, which DeepseekV3 rotates with one key shared by every head): per pair j
the G heads' keys are complex numbers z_m = k_m[j] + i k_m[j + d/2], and RoPE multiplies each by the same e^{i t w_j},
so any complex mixing across heads commutes with it (TransMLA's RoRoPE, with complex weights: a rotation and a scale
per head). The shared key is the principal component k' = u^H z of their covariance C = W W^H (top eigenvector
u), each head's key is taken as u_m k', and query head h
of group m reads k' through conj(u_m) q_h, exactly where the keys are rank one per pair.

Position-free part: the other d - D dims of each head (its lowest frequencies, which turn least over a context) are the
per-head `nope` keys, read without rotation. Latent: one rank-R factorisation of every group's nope keys and values, Y =
[K_nope; V] ~ B A, weighted where the errors land: nope keys by what their query heads read (sum_h Wq_h Wq_h^T), values
by what o_proj makes of them (sum_h O_h^T O_h), each block scaled to unit energy; the best such factorisation is an SVD
of L Y (B = L^-1 U_R, A = U_R^T L Y). From the weights alone every input direction weighs alike; a calibrated fit
(`inputs`: the metric S of the layer's attention inputs, `input_metric`) weighs them as the calibration text uses them:
the shared key per pair is the top eigenvector of W S W^H, and the latent an SVD of L Y S^1/2 (still B = L^-1 U_R, A =
U_R^T L Y: the best rank-R fit in that metric; the key and value blocks of L then scaled to unit energy on Y S^1/2).
kv_b_proj expands the latent per head; the latent's RMSNorm is cancelled as for the exact form
(`hf.architectures.latent`), its realised scale divided out of kv_b_proj.

Memory (the 7B layer shape: 32 heads of 128, hidden 4096): everything is float64, but held a head or a group at a
time wherever the maths allows: L is kept as its 2G diagonal blocks and applied block by block (never the dense
G(N + d) square), Y is never stacked (L Y is built a block at a time from the stored weights), the queries are
rotated a head at a time into the output dtype, and the errors are summed a group at a time. What stays is L Y
(G(N + d) x n) and the SVD's own working set; calibrated, L Y S^1/2 instead (L Y and S^1/2 freed before the SVD and
L Y made again after it: 418 MiB less at the 7B shape with a latent at half the cache).
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
    (166.3 against 164.5 at --kv-rank 48 --rope-dim 16), so every head weighs alike."""
    half, keep = head_dim // 2, rope_dim // 2
    kept = rope_pairs(head_dim, rope_dim)[0]
    per = k.reshape(groups, head_dim, -1)[:, kept + [half + j for j in kept]].to(F64)  # (G, D, n): the kept pairs
    bias = (k_bias.to(F64) if k_bias is not None else torch.zeros(groups * head_dim, dtype=F64)).reshape(groups, -1)
    rows = torch.zeros(rope_dim, per.shape[-1], dtype=F64)
    row_bias = torch.zeros(rope_dim, dtype=F64)
    weights = torch.zeros(groups, keep, dtype=torch.complex128)
    for j in range(keep):
        z = torch.complex(per[:, j], per[:, keep + j])  # (G, n)
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
               errors: dict | None = None, inputs: torch.Tensor | None = None, turns: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """The target's attention tensors (names under `latent.ATTENTION`) fitted to a layer's q (H*d, n), k and v (G*d, n),
    o (n, H*d) and optional k/v biases: from the weights alone, or with `inputs` (n, n; `input_metric`) in the metric of
    the layer's attention inputs. `errors` gets the relative errors ||W - W'|| / ||W|| of the keys and values the latent
    layer holds (the keys' rotary part as u_m k', their position-free part and the values from the latent), as the card
    reports them, and with `turns` (`offset_means` of the unrotated pairs) the keys' error over relative positions."""
    heads, d, D, N, r = shape.heads, shape.v_dim, shape.rope_dim, shape.nope_dim, shape.rank
    groups, n = k.shape[0] // d, k.shape[1]
    rope_rows, rope_bias, u = shared_rope_key(k, k_bias, groups, d, D, inputs)
    if not shape.bias and (k_bias is not None or v_bias is not None):
        raise ValueError("a bias-free latent holds no k/v biases")
    kb = (k_bias.to(F64) if k_bias is not None else torch.zeros(groups * d, dtype=F64)).reshape(groups, d)
    vb = v_bias.to(F64) if v_bias is not None else torch.zeros(groups * d, dtype=F64)
    y_bias = torch.cat([kb[:, rope_pairs(d, D)[1]].reshape(-1), vb])
    half = None if inputs is None else _sqrt_psd(inputs.to(F64))  # S^1/2: the errors as the inputs see them
    blocks, weighted = _weighted_rows(q, k, v, o, heads, d, D, half)  # L's diagonal blocks, L Y (G(N + d), n)
    if half is None:
        read = weighted
    else:  # L Y S^1/2; L Y is made again after the SVD, so that the SVD's working set is the only other peer
        read = weighted @ half
        del weighted, half
    basis = torch.linalg.svd(read, full_matrices=False)[0][:, :r].clone()  # U_R (G(N + d), R); U freed
    del read
    if inputs is not None:  # L Y again, from L's blocks
        weighted = _weighted_rows(q, k, v, o, heads, d, D, blocks=blocks)[1]
    down = basis.T @ weighted  # A (R, n)
    del weighted
    latent_bias = basis.T @ _apply(blocks, y_bias[:, None])[:, 0]
    up = torch.cat([torch.linalg.solve(block, part) for block, part in zip(blocks, _split(basis, blocks))])  # L^-1 U_R
    if errors is not None:
        errors.update(_held_errors(k, v, rope_rows, u, up, down, N, d, turns))
    q_rows = _rotated_queries(q, u, heads, d, D, dtype)  # after the SVD, whose working set is the peak

    latent, bias = shape.latent, shape.bias
    if not bias:  # the norm stays in the function: its weight is set from data (construct.fitted_norm)
        return {Q: q_rows, KV_A: torch.cat([down, rope_rows]).to(dtype), KV_NORM: torch.ones(r, dtype=dtype),
                KV_B: _expansion(up, heads, groups, N, d, latent, dtype), O: o.to(dtype)}
    norm_weight, realised = latent_norm(r, dtype)
    a_rows = torch.cat([down, torch.zeros(1, n, dtype=F64), rope_rows])
    a_bias = torch.cat([latent_bias, torch.tensor([BIAS_SCALE], dtype=F64), rope_bias])
    return {Q: q_rows, KV_A: a_rows.to(dtype), KV_A_BIAS: a_bias.to(dtype), KV_NORM: norm_weight,
            KV_B: _expansion(up, heads, groups, N, d, latent, dtype, realised), O: o.to(dtype),
            O_BIAS: torch.zeros(o.shape[0], dtype=dtype)}


def _rotated_queries(q: torch.Tensor, u: torch.Tensor, heads: int, d: int, rope_dim: int, dtype: torch.dtype
                     ) -> torch.Tensor:
    """q_proj's rows (H (N + D), n) at `dtype`: per head its nope dims, then conj(u_m) q_h on the kept pairs (the
    real parts, then the imaginary ones), each head made in float64 alone."""
    half, keep, N = d // 2, rope_dim // 2, d - rope_dim
    kept, nope = rope_pairs(d, rope_dim)
    per_group = heads // u.shape[0]
    out = torch.empty(heads, N + rope_dim, q.shape[1], dtype=dtype)
    for h in range(heads):
        head = q[h * d:(h + 1) * d].to(F64)  # (d, n)
        alpha = u[h // per_group]  # (D/2,) complex: this head's group's weights
        a, b = alpha.real[:, None], alpha.imag[:, None]
        q_re, q_im = head[kept], head[[half + j for j in kept]]
        out[h, :N] = head[nope]
        out[h, N:N + keep], out[h, N + keep:] = a * q_re + b * q_im, a * q_im - b * q_re
    return out.reshape(heads * (N + rope_dim), -1)


def _expansion(up: torch.Tensor, heads: int, groups: int, N: int, d: int, latent: int, dtype: torch.dtype,
               realised: float | None = None) -> torch.Tensor:
    """kv_b_proj (H (N + d), latent) at `dtype`: head h's nope-key and value rows of B = L^-1 U_R (its group's),
    divided by the norm's realised scale where there is one; the bias coordinate's column stays zero."""
    r, per_group = up.shape[1], heads // groups
    up_k, up_v = up[:groups * N].reshape(groups, N, r), up[groups * N:].reshape(groups, d, r)
    out = torch.zeros(heads, N + d, latent, dtype=dtype)
    for h in range(heads):
        m = h // per_group
        rows = torch.cat([up_k[m], up_v[m]])
        out[h, :, :r] = rows if realised is None else rows / realised
    return out.reshape(heads * (N + d), latent)


def offset_means(frequencies, context: int) -> torch.Tensor:
    """mean over t = 0 .. context-1 of e^{-i t w} per frequency w (complex128): what rotating a key by each relative
    position t averages to, (1 - e^{-i C w}) / (C (1 - e^{-i w}))."""
    w = torch.tensor(list(frequencies), dtype=F64)
    one = torch.ones_like(w)
    return (1 - torch.polar(one, -context * w)) / (context * (1 - torch.polar(one, -w)))


def _unrotated_error(key: torch.Tensor, held: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Over the pairs read without rotation, the mean over relative positions t of ||R_t a - b||^2, where a is the true
    key (turned by t, as the source's attention reads it) and b the held one (read unturned): per pair
    ||a||^2 + ||b||^2 - 2 Re(mean_t e^{-i t w} <b, a>). `key` and `held` are those dims, the real parts then the
    imaginary ones, as `rope_pairs` lists them."""
    half = key.shape[0] // 2
    a, b = torch.complex(key[:half], key[half:]), torch.complex(held[:half], held[half:])
    cross = (b.conj() * a).sum(dim=1)
    return a.abs().pow(2).sum() + b.abs().pow(2).sum() - 2 * (turns * cross).real.sum()


def _held_errors(k: torch.Tensor, v: torch.Tensor, rope_rows: torch.Tensor, u: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, N: int, d: int, turns: torch.Tensor | None = None) -> dict[str, float]:
    """{"k": ..., "v": ...}: relative errors of the keys and values as the fitted layer holds them (u_m k' on the
    kept pairs, B A on the rest), summed a group at a time; with `turns`, also "k_positions": the keys' error as the
    queries read it, root-mean-square over relative positions (the kept pairs turn as the source's do; the rest are
    read unturned, which "k", at one position, does not show)."""
    groups, keep = u.shape[0], rope_rows.shape[0] // 2
    kept, nope = rope_pairs(d, 2 * keep)
    rotary = kept + [d // 2 + j for j in kept]
    shared = torch.complex(rope_rows[:keep], rope_rows[keep:])  # (D/2, n)
    sums = torch.zeros(4, dtype=F64)  # ||k - k'||^2, ||k||^2, ||v - v'||^2, ||v||^2
    moved = torch.zeros((), dtype=F64)  # the key error over relative positions
    for m in range(groups):
        key, value = k[m * d:(m + 1) * d].to(F64), v[m * d:(m + 1) * d].to(F64)
        rebuilt = torch.empty_like(key)
        z = u[m][:, None] * shared
        rebuilt[kept], rebuilt[[d // 2 + j for j in kept]] = z.real, z.imag
        rebuilt[nope] = up[m * N:(m + 1) * N] @ down
        held_v = up[groups * N + m * d:groups * N + (m + 1) * d] @ down
        sums += torch.stack([(key - rebuilt).pow(2).sum(), key.pow(2).sum(), (value - held_v).pow(2).sum(),
                             value.pow(2).sum()])
        if turns is not None:
            moved += (key[rotary] - rebuilt[rotary]).pow(2).sum() + _unrotated_error(key[nope], rebuilt[nope], turns)
    errors = {"k": float((sums[0] / sums[1]).sqrt()), "v": float((sums[2] / sums[3]).sqrt())}
    if turns is not None:
        errors["k_positions"] = float((moved.clamp(min=0) / sums[1]).sqrt())
    return errors


def _weighted_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, heads: int, d: int,
                   rope_dim: int, half: torch.Tensor | None = None, blocks: list[torch.Tensor] | None = None
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(L's diagonal blocks, L Y (G(N + d), n)). Y stacks every group's nope keys, then every group's values; L is
    block-diagonal: per group, the square root of what its query heads read of the nope keys (sum_h Wq_h Wq_h^T) and
    of what o_proj makes of its values (sum_h O_h^T O_h); the key blocks together and the value blocks together
    scaled to unit energy on Y (on Y S^1/2 with `half` = S^1/2). Made a block at a time from the stored weights
    (float64 a head at a time). Given `blocks` (a first call's), L Y is made again with them."""
    n, (groups, nope) = q.shape[1], (k.shape[0] // d, rope_pairs(d, rope_dim)[1])
    per_group, N = heads // groups, d - rope_dim
    weighted = torch.empty(groups * (N + d), n, dtype=F64)
    given, blocks = blocks, []
    for kind, size in (("k", N), ("v", d)):
        if size == 0:
            continue
        first = len(blocks)
        for m in range(groups):
            members = range(m * per_group, (m + 1) * per_group)
            rows = (k[m * d:(m + 1) * d][nope] if kind == "k" else v[m * d:(m + 1) * d]).to(F64)  # (N or d, n)
            if given is not None:
                blocks.append(given[len(blocks)])
            else:
                read = (sum(x @ x.T for x in (_q_nope(q, h, d, nope) for h in members)) if kind == "k"
                        else sum(x.T @ x for x in (_o_head(o, h, d) for h in members)))
                # directions nothing reads stay finite; a group no query or output reads at all (pruned heads)
                # takes a tiny identity: its keys or values never reach the output, whatever they hold
                ridge = max(1e-6 * float(read.diagonal().mean()), 1e-12)
                blocks.append(_sqrt_psd(read + ridge * torch.eye(size, dtype=F64)))
            start = (0 if kind == "k" else groups * N) + m * size
            weighted[start:start + size] = blocks[-1] @ rows
        if given is not None:
            continue
        part = slice(0 if kind == "k" else groups * N, groups * N if kind == "k" else weighted.shape[0])
        energy = (weighted[part] if half is None else weighted[part] @ half).norm()
        if energy > 0:
            weighted[part] /= energy
            blocks[first:] = [block / energy for block in blocks[first:]]
    return blocks, weighted


def _q_nope(q: torch.Tensor, h: int, d: int, nope: list[int]) -> torch.Tensor:
    return q[h * d:(h + 1) * d][nope].to(F64)  # (N, n)


def _o_head(o: torch.Tensor, h: int, d: int) -> torch.Tensor:
    return o[:, h * d:(h + 1) * d].to(F64)  # (n, d)


def _split(rows: torch.Tensor, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`rows` cut into the row ranges of L's diagonal blocks."""
    return rows.split([block.shape[0] for block in blocks])


def _apply(blocks: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """L @ rows, L given by its diagonal blocks."""
    return torch.cat([block @ part for block, part in zip(blocks, _split(rows, blocks))])
