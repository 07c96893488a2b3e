"""RoPE maths for caches that move keys: the inverse frequencies of a model, and exact re-rotation of stored keys.

Two layouts pair a key's rotary dims: rotate-half (Llama, Mistral, Qwen, OLMo, Phi3's partial rotary) pairs dim i
with i + r/2; interleaved (Cohere, GLM; GPT-J's too, whose precomputed table is not read) pairs 2i with 2i + 1.
Which one a model uses, and which of its layers rotate at all, is measured from its keys (`rope_probe`). Angles are
formed in float64 and reduced mod 2 pi, so a large shift costs no precision. Pure tensor functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gqakit.hf.architectures.latent import is_latent

_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class KeyRotation:
    """How a cache re-rotates a model's stored keys: its RoPE inverse frequencies (r/2,) in float64, the layout, and
    per cache layer whether that layer's keys carry RoPE (False: a NoPE layer, whose keys never move; None: every
    layer rotates)."""

    inv_freq: torch.Tensor
    interleaved: bool = False
    rotary: tuple[bool, ...] | None = None

    def rotates(self, layer: int) -> bool:
        if self.rotary is None:
            return True
        if layer >= len(self.rotary):
            raise ValueError(f"the cache was measured with {len(self.rotary)} layers but the model fed layer {layer}; "
                             "build the cache with rope= the model whose keys it holds")
        return self.rotary[layer]

    def rotation(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_rotation(delta, self.inv_freq)

    def rotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_keys(keys, cos, sin, self.interleaved)


def rope_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every RoPE inverse-frequency buffer of a module: `inv_freq`, or a per-layer-type one such as Gemma 3's
    `sliding_attention_inv_freq` (transformers 5.25); not the `original_inv_freq` copies dynamic scaling restores."""
    return [(name, b) for name, b in model.named_buffers()
            if name.endswith("inv_freq") and not name.endswith("original_inv_freq")]


def rope_inv_freq(rope: torch.nn.Module | torch.Tensor) -> torch.Tensor:
    """The RoPE inverse frequencies (r/2,) of a model (its one rotary embedding) or of a tensor."""
    if isinstance(rope, torch.Tensor):
        return rope.detach().to("cpu", torch.float64).reshape(-1)
    if is_latent(getattr(rope, "config", None) or {}):
        raise ValueError(f"{type(rope).__name__} is latent attention: its cache holds a position-free latent beside "
                         "one shared RoPE key, which re-rotating keys would mistake for the latent; keep no sinks "
                         "(a plain window) for this model")
    found = rope_buffers(rope)
    if not found:
        raise ValueError(f"{type(rope).__name__} has no rotary embedding with an `inv_freq` buffer (none at all, or "
                         "a precomputed table as GPT-J's); a cache that moves keys (sinks, or a window the stream "
                         "outgrows) re-rotates them by RoPE: use a full cache")
    freqs = [b.detach().to("cpu", torch.float64).reshape(-1) for _, b in found]
    if any(f.shape != freqs[0].shape or not torch.equal(f, freqs[0]) for f in freqs[1:]):
        raise ValueError(f"{type(rope).__name__} has {len(found)} different rotary embeddings "
                         f"({', '.join(name for name, _ in found)}) and a cache re-rotates by one; pass the "
                         "inv_freq tensor of the layers you cache as rope=...")
    owner = next(m for m in rope.modules() if any(b is found[0][1] for b in m.buffers(recurse=False)))
    rope_type = getattr(owner, "rope_type", "default")
    if rope_type in _POSITION_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the position; SinkCache "
                         "needs fixed frequencies (default, linear, llama3, yarn)")
    return freqs[0]


def rope_rotation(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, r/2) of a rotation by `delta` (B,) positions, one per rotary pair, in float64.

    Angles are formed in float64 and reduced mod 2 pi, so a large delta costs no precision; delta = 0 gives exactly
    cos = 1, sin = 0 (an exact identity).
    """
    angle = torch.remainder(delta.to(torch.float64)[:, None] * inv_freq[None, :], 2 * math.pi)  # (B, r/2)
    return angle.cos(), angle.sin()


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate keys (B, G, L, d) by per-row angles (cos, sin: (B, r/2)), r <= d (the first r dims are rotary), in the
    rotate-half layout (pairs i, i + r/2) or the interleaved one (pairs 2i, 2i + 1). Computed in float32 (float64 for
    float64 keys) and returned in the keys' dtype."""
    half = cos.shape[-1]
    r = 2 * half
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    k = keys[..., :r].to(compute)
    c = cos[:, None, None, :].to(k.device, compute)  # (B, 1, 1, r/2)
    s = sin[:, None, None, :].to(k.device, compute)
    if interleaved:
        pairs = k.unflatten(-1, (half, 2))
        first, second = pairs[..., 0], pairs[..., 1]
        out = torch.stack([first * c - second * s, second * c + first * s], dim=-1).flatten(-2)
    else:
        first, second = k[..., :half], k[..., half:]
        out = torch.cat([first * c - second * s, second * c + first * s], dim=-1)
    out = out.to(keys.dtype)
    return out if r == keys.shape[-1] else torch.cat([out, keys[..., r:]], dim=-1)
