"""RoPE maths for caches that move keys: the inverse frequencies of a model, and exact re-rotation of stored keys.

Keys are rotated in the rotate-half layout (Llama, Mistral, Qwen, OLMo, Phi3's partial rotary); angles are formed
in float64 and reduced mod 2 pi, so a large shift costs no precision. Pure tensor functions.
"""
from __future__ import annotations

import math

import torch

from gqakit.hf.architectures.latent import is_latent

_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_inv_freq(rope: torch.nn.Module | torch.Tensor) -> torch.Tensor:
    """The RoPE inverse frequencies (r/2,) of a model (its one rotary embedding) or of a tensor."""
    if isinstance(rope, torch.Tensor):
        return rope.detach().to("cpu", torch.float64).reshape(-1)
    if is_latent(getattr(rope, "config", None) or {}):
        raise ValueError(f"{type(rope).__name__} is latent attention: its cache holds a position-free latent beside "
                         "one shared RoPE key, which re-rotating keys would mistake for the latent; keep no sinks "
                         "(a plain window) for this model")
    found = [m for m in rope.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(rope).__name__} has no rotary embedding (no `inv_freq` buffer); "
                         "SinkCache re-rotates RoPE keys: use WindowCache (sinks=0) for this model")
    freqs = [m.inv_freq.detach().to("cpu", torch.float64).reshape(-1) for m in found]
    if any(f.shape != freqs[0].shape or not torch.equal(f, freqs[0]) for f in freqs[1:]):
        raise ValueError(f"{type(rope).__name__} has {len(found)} different rotary embeddings; pass the "
                         "inv_freq tensor of the layers you cache as rope=...")
    rope_type = getattr(found[0], "rope_type", "default")
    if rope_type in _POSITION_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the position; SinkCache "
                         "needs fixed frequencies (default, linear, llama3, yarn)")
    return freqs[0]


def rope_rotation(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, r) of a rotation by `delta` (B,) positions, in the rotate-half layout.

    Angles are formed in float64 and reduced mod 2 pi before the cast to float32, so a large delta
    costs no precision; delta = 0 gives exactly cos = 1, sin = 0 (an exact identity).
    """
    angle = torch.remainder(delta.to(torch.float64)[:, None] * inv_freq[None, :], 2 * math.pi)  # (B, r/2)
    angle = torch.cat([angle, angle], dim=-1)  # (B, r)
    return angle.cos().float(), angle.sin().float()


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate keys (B, G, L, d) by per-row angles (B, r), r <= d (the first r dims are rotary)."""
    r = cos.shape[-1]
    k = keys[..., :r].float()
    c, s = cos[:, None, None, :].to(k.device), sin[:, None, None, :].to(k.device)  # (B, 1, 1, r)
    half = r // 2
    k_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)  # rotate_half
    out = (k * c + k_half * s).to(keys.dtype)
    return out if r == keys.shape[-1] else torch.cat([out, keys[..., r:]], dim=-1)
