"""One MQA layer as a DeepseekV3 latent-attention layer that computes the same function (pure tensor maths).

The latent is [v, B] (the value, then the bias coordinate), the shared RoPE key is the MQA key; see
`gqakit.hf.architectures.latent` for why the latent's RMSNorm then cancels. The norm's weight w and the bias B are
rounded to the output dtype; the scale they realise, w * sqrt(r + 1) / B, is divided out of o_proj (whose rows
round randomly) rather than out of kv_b_proj (an identity that would round it away).

Bias-free (`shape.bias` false) the latent is the value alone and the RMSNorm stays in the function: its weight
starts where it best undoes the norm on calibration latents (`fitted_norm`), and training takes it from there.
"""
from __future__ import annotations

import math

import torch

from gqakit.hf.architectures.latent import BIAS_SCALE, KV_A, KV_A_BIAS, KV_B, KV_NORM, O, O_BIAS, Q, LatentShape


def latent_norm(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(kv_a_layernorm's weight, the scale it realises on the latent at `dtype`). The norm divides the latent [c, B]
    by its RMS, about B / sqrt(r + 1); the weight B / sqrt(r + 1) undoes that on c, and 1 / sqrt(r + 1) on the bias
    coordinate leaves it at about 1 in the cache: a value of order B there would make any update of its kv_b_proj
    column B times too large in training, and dominate a quantized cache's scales."""
    weight = torch.full((rank + 1,), BIAS_SCALE / math.sqrt(rank + 1), dtype=torch.float32)
    weight[rank] = 1 / math.sqrt(rank + 1)
    weight = weight.to(dtype)
    bias = torch.tensor(BIAS_SCALE).to(dtype).double().item()
    return weight, weight[0].double().item() * math.sqrt(rank + 1) / bias


def embed_mqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, shape: LatentShape,
              dtype: torch.dtype, k_bias: torch.Tensor | None = None, v_bias: torch.Tensor | None = None
              ) -> dict[str, torch.Tensor]:
    """The target's attention tensors (names under `latent.ATTENTION`) from an MQA layer's q (H*d, hidden),
    k and v (d, hidden), o (hidden, H*d) and optional k/v biases, at `dtype`."""
    d, hidden = k.shape
    if shape.nope_dim or shape.rank != d or shape.rope_dim != d or shape.v_dim != d:
        raise ValueError(f"embed_mqa holds an MQA layer exactly only as rank = rope_dim = v_dim = {d}, nope_dim 0")
    r = shape.rank
    f32 = torch.float32
    if not shape.bias:
        if k_bias is not None or v_bias is not None:
            raise ValueError("a bias-free latent holds no k/v biases")
        expand = torch.eye(d, dtype=f32).repeat(shape.heads, 1)
        return {Q: q.to(dtype), KV_A: torch.cat([v, k]).to(dtype), KV_NORM: torch.ones(r, dtype=dtype),
                KV_B: expand.to(dtype), O: o.to(dtype)}
    a = torch.zeros(r + 1 + d, hidden, dtype=f32)
    a[:r], a[r + 1:] = v.to(f32), k.to(f32)
    bias = torch.zeros(r + 1 + d, dtype=f32)
    bias[r] = BIAS_SCALE
    if v_bias is not None:
        bias[:r] = v_bias.to(f32)
    if k_bias is not None:
        bias[r + 1:] = k_bias.to(f32)
    weight, realised = latent_norm(r, dtype)
    expand = torch.zeros(shape.heads * d, r + 1, dtype=f32)
    expand[:, :r] = torch.eye(d, dtype=f32).repeat(shape.heads, 1)
    return {Q: q.to(dtype), KV_A: a.to(dtype), KV_A_BIAS: bias.to(dtype), KV_NORM: weight, KV_B: expand.to(dtype),
            O: (o.to(torch.float64) / realised).to(dtype), O_BIAS: torch.zeros(o.shape[0], dtype=dtype)}


def fitted_norm(latent: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm weight w (r,) that best undoes the norm on these latents (N, r): per coordinate j the least-squares
    w_j of c_j ~ w_j c_j / rho, rho = sqrt(mean(c^2) + eps) per latent, i.e. w_j = E[c_j^2 / rho] / E[c_j^2 / rho^2].
    (A coordinate that is zero on every latent gets 1.)"""
    c = latent.to(torch.float64)
    rho = (c.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    num, den = (c.pow(2) / rho).sum(0), (c.pow(2) / rho.pow(2)).sum(0)
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.ones_like(num)).float()


def cast_trained(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A trained latent layer's tensors (float32, names under `latent.ATTENTION`) at `dtype`, computing the same: the
    latent norm's weight rounds, and the ratio of its float32 value to the rounded one goes into kv_b_proj's columns
    (the norm's output is read only through them)."""
    out = {name: t.to(dtype) for name, t in tensors.items()}
    weight = tensors[KV_NORM].to(torch.float64)
    rounded = out[KV_NORM].to(torch.float64)
    ratio = torch.where(rounded != 0, weight / torch.where(rounded != 0, rounded, 1), torch.ones_like(weight))
    out[KV_B] = (tensors[KV_B].to(torch.float64) * ratio).to(dtype)
    return out
