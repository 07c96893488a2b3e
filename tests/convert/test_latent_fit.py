"""`fit_latent` (`--to mla --kv-rank R --rope-dim D`) holds its float64 maths a head or a group at a time, for memory;
it must equal the fit written out densely (L as one block-diagonal matrix, Y stacked, every head at once) to 1e-10.
A rank the fit cannot reach is refused in one line."""
from __future__ import annotations

import math

import pytest
import torch

from cli_contract import run_refused
from gqakit.convert.latent.construct import latent_norm
from gqakit.convert.latent.fit import fit_latent, input_metric, offset_means
from gqakit.hf.architectures.latent import BIAS_SCALE, KV_A, KV_A_BIAS, KV_B, KV_NORM, O, O_BIAS, Q, LatentShape
from tiny_models import make_tiny_llama

F64 = torch.float64


def _sqrt(m: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh((m + m.T) / 2)
    return vectors @ torch.diag(values.clamp(min=0).sqrt()) @ vectors.T


def dense_fit(q, k, v, o, shape: LatentShape, k_bias=None, v_bias=None, inputs=None, positions=None
              ) -> tuple[dict, dict]:
    """(the target's tensors, the errors) by the docstring of `convert/latent/fit.py`, every matrix whole; with
    `positions` (the RoPE angle per position of each pair, a context C) also the keys' error over relative positions
    0..C-1, each position turned explicitly."""
    heads, d, D, N, r = shape.heads, shape.v_dim, shape.rope_dim, shape.nope_dim, shape.rank
    groups, n = k.shape[0] // d, k.shape[1]
    per, half, keep = heads // groups, d // 2, D // 2
    re, im = list(range(keep)), [half + j for j in range(keep)]
    nope = [*range(keep, half), *range(half + keep, d)]
    kb = torch.zeros(groups * d, dtype=F64) if k_bias is None else k_bias
    vb = torch.zeros(groups * d, dtype=F64) if v_bias is None else v_bias
    kg, vg, qh, oh = k.reshape(groups, d, n), v.reshape(groups, d, n), q.reshape(heads, d, n), o.reshape(n, heads, d)
    kbg = kb.reshape(groups, d)
    z, zb = torch.complex(kg[:, re], kg[:, im]), torch.complex(kbg[:, re], kbg[:, im])  # (G, D/2, n), (G, D/2)
    s = torch.eye(n, dtype=F64) if inputs is None else inputs
    u = torch.stack([torch.linalg.eigh(z[:, j] @ s.to(z.dtype) @ z[:, j].conj().T
                                       + torch.outer(zb[:, j], zb[:, j].conj()))[1][:, -1] for j in range(keep)], 1)
    shared, shared_bias = torch.einsum("gj,gjn->jn", u.conj(), z), torch.einsum("gj,gj->j", u.conj(), zb)
    rope_rows, rope_bias = torch.cat([shared.real, shared.imag]), torch.cat([shared_bias.real, shared_bias.imag])
    alpha = u[torch.arange(heads) // per][..., None]  # (H, D/2, 1)
    q_re, q_im = qh[:, re], qh[:, im]
    new_q = torch.cat([qh[:, nope], alpha.real * q_re + alpha.imag * q_im, alpha.real * q_im - alpha.imag * q_re], 1)

    y = torch.cat([kg[:, nope].reshape(groups * N, n), vg.reshape(groups * d, n)])
    y_bias = torch.cat([kbg[:, nope].reshape(-1), vb])
    reads = [sum(qh[h, nope] @ qh[h, nope].T for h in range(m * per, (m + 1) * per)) for m in range(groups)]
    reads += [sum(oh[:, h].T @ oh[:, h] for h in range(m * per, (m + 1) * per)) for m in range(groups)]
    weight = torch.block_diag(*[_sqrt(m + 1e-6 * m.diagonal().mean() * torch.eye(m.shape[0], dtype=F64))
                                for m in reads if m.numel()])
    half_s = _sqrt(s)
    for part in (slice(0, groups * N), slice(groups * N, None)):
        energy = (weight[part, part] @ y[part] @ half_s).norm()
        weight[part, part] /= energy if energy > 0 else 1
    basis = torch.linalg.svd(weight @ y @ half_s, full_matrices=False)[0][:, :r]
    down, up = basis.T @ weight @ y, torch.linalg.solve(weight, basis)
    latent_bias = basis.T @ weight @ y_bias
    held = up @ down
    rebuilt = kg.clone()
    rebuilt[:, re], rebuilt[:, im] = (u[..., None] * shared).real, (u[..., None] * shared).imag
    rebuilt[:, nope] = held[:groups * N].reshape(groups, N, n)
    errors = {"k": float((kg - rebuilt).norm() / kg.norm()),
              "v": float((vg - held[groups * N:].reshape(groups, d, n)).norm() / vg.norm())}
    if positions is not None:
        frequencies, context = positions
        total = torch.zeros((), dtype=F64)
        for t in range(context):
            turned_true, turned_held = kg.clone(), rebuilt.clone()
            for j in range(half):  # a key t positions back, as a query reads it: times e^{-i t w_j}
                c, s_ = math.cos(t * frequencies[j]), math.sin(t * frequencies[j])
                pairs = [(kg, turned_true)] + ([(rebuilt, turned_held)] if j < keep else [])  # held: kept pairs
                for x, out in pairs:
                    out[:, j], out[:, half + j] = c * x[:, j] + s_ * x[:, half + j], c * x[:, half + j] - s_ * x[:, j]
            total += (turned_true - turned_held).pow(2).sum()
        errors["k_positions"] = float((total / context).sqrt() / kg.norm())

    pick = torch.arange(heads) // per
    expand = torch.cat([up[:groups * N].reshape(groups, N, r)[pick], up[groups * N:].reshape(groups, d, r)[pick]], 1)
    expand = torch.cat([expand, torch.zeros(heads, N + d, shape.latent - r, dtype=F64)], 2).reshape(-1, shape.latent)
    q_rows = new_q.reshape(-1, n)
    if not shape.bias:
        return {Q: q_rows, KV_A: torch.cat([down, rope_rows]), KV_NORM: torch.ones(r, dtype=F64), KV_B: expand,
                O: o}, errors
    norm_weight, realised = latent_norm(r, F64)
    return {Q: q_rows, KV_A: torch.cat([down, torch.zeros(1, n, dtype=F64), rope_rows]),
            KV_A_BIAS: torch.cat([latent_bias, torch.tensor([BIAS_SCALE], dtype=F64), rope_bias]),
            KV_NORM: norm_weight, KV_B: expand / realised, O: o, O_BIAS: torch.zeros(n, dtype=F64)}, errors


@pytest.mark.parametrize("calibrated", [False, True], ids=["weights", "calibrated"])
@pytest.mark.parametrize("heads, groups, d, n, rope_dim, rank, biases, bias", [
    (8, 8, 16, 48, 8, 20, False, True),  # MHA source; L Y taller than wide (G(N + d) = 192 > n)
    (8, 4, 16, 160, 4, 33, True, True),  # GQA source with k/v biases; wider than tall (96 < 160)
    (4, 2, 8, 40, 8, 12, False, True),  # rope_dim = head_dim: no nope keys, values only
    (8, 2, 16, 64, 8, 24, False, False),  # bias-free
], ids=["mha", "gqa-biases", "no-nope", "bias-free"])
def test_the_lean_fit_equals_the_dense_float64_fit(heads, groups, d, n, rope_dim, rank, biases, bias, calibrated):
    gen = torch.Generator().manual_seed(heads * n + rank)
    f64 = dict(generator=gen, dtype=F64)
    q, k = torch.randn(heads * d, n, **f64), torch.randn(groups * d, n, **f64)
    v, o = torch.randn(groups * d, n, **f64), torch.randn(n, heads * d, **f64)
    k_bias, v_bias = (torch.randn(groups * d, **f64), torch.randn(groups * d, **f64)) if biases else (None, None)
    shape = LatentShape(heads=heads, rank=rank, rope_dim=rope_dim, nope_dim=d - rope_dim, v_dim=d, bias=bias)
    x = torch.randn(3 * n, n, **f64) * torch.linspace(0.1, 2, n, dtype=F64)  # inputs of uneven scales
    inputs = input_metric(x.T @ x, x.T @ x / 3 + torch.eye(n, dtype=F64)) if calibrated else None
    errors: dict = {}
    frequencies, context = [1.3 * 10 ** (-2 * j / d) for j in range(d // 2)], 23  # fast: they turn within 23
    made = fit_latent(q, k, v, o, shape, F64, k_bias, v_bias, errors=errors, inputs=inputs,
                      turns=offset_means(frequencies[rope_dim // 2:], context))
    want, want_errors = dense_fit(q, k, v, o, shape, k_bias, v_bias, inputs, (frequencies, context))
    assert made.keys() == want.keys()
    for name, tensor in want.items():
        assert made[name].shape == tensor.shape and made[name].dtype == F64, name
        assert (made[name] - tensor).norm() <= 1e-10 * tensor.norm(), name
    assert errors == pytest.approx(want_errors, rel=1e-10)
    assert 0 < errors["k"] < 1 and 0 < errors["v"] < 1  # a fit, not exact, at these ranks
    if rope_dim < d:  # dims read unrotated cost more than the fit's error at one position shows
        assert errors["k_positions"] > errors["k"] * 1.05


def test_a_rank_above_the_hidden_size_is_refused_in_one_line(tmp_path):
    # 4 MHA heads of 16 with an 8-dim RoPE key hold 4 x (8 + 16) = 96 position-free dims, but the hidden size is 64:
    # L Y (96, 64) has 64 singular directions, so a latent of rank 80 cannot be fitted
    src = make_tiny_llama(tmp_path / "src", heads=4, head_dim=16)
    run_refused(tmp_path, "convert-gqa", "--groups", "1", "--to", "mla", "--kv-rank", "80", "--rope-dim", "8",
                str(src), "-o", str(tmp_path / "o"), needles=("--kv-rank 80 must be from 1 to 64",))
