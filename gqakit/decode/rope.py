"""RoPE maths for caches that move keys: the inverse frequencies of a model, and exact re-rotation of stored keys.

Two layouts pair a key's rotary dims: rotate-half (Llama, Mistral, Qwen, OLMo, Phi3's partial rotary) pairs dim i
with i + r/2; interleaved (Cohere, GLM, GPT-J, CodeGen) pairs 2i with 2i + 1. Frequencies come from a model's
`inv_freq` buffers, or are read back from a precomputed sin | cos table (GPT-J's and CodeGen's `embed_positions`).
Which layout a model uses, and which of its layers rotate at all, is measured from its keys (`rope_probe`). Angles
are formed in float64 and reduced mod 2 pi, so a large shift costs no precision. Pure tensor functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gqakit.hf.architectures.latent import is_latent

_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


Turn = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of one rotation per row, (B, r/2) each


@dataclass(frozen=True)
class KeyRotation:
    """How a cache re-rotates a model's stored keys: the RoPE inverse-frequency sets (each (r/2,), float64; several
    where layer types rotate by their own, as Gemma 3's sliding and full layers), the layout, and per cache layer
    which set its keys carry (None: a NoPE layer, whose keys never move). `layer_freqs` None: every layer, set 0.
    `windows`: per cache layer, the model's own sliding window (None: full attention), as measured with the model;
    None where no model was measured (an inv_freq tensor given). `positions`: how many positions the model has where
    a precomputed RoPE table ends (GPT-J), else None."""

    freqs: tuple[torch.Tensor, ...]
    interleaved: bool = False
    layer_freqs: tuple[int | None, ...] | None = None
    windows: tuple[int | None, ...] | None = None
    positions: int | None = None

    @property
    def rotary(self) -> tuple[bool, ...] | None:
        """Per cache layer, whether its keys carry RoPE (None: every layer)."""
        return None if self.layer_freqs is None else tuple(f is not None for f in self.layer_freqs)

    def narrowest_window(self) -> tuple[int, int] | None:
        """(layer, width) of the narrowest sliding window among the model's layers, or None (none, or unknown)."""
        slides = [(width, layer) for layer, width in enumerate(self.windows or ()) if width is not None]
        return None if not slides else min(slides)[::-1]

    def freq_of(self, layer: int) -> int | None:
        """The frequency set layer `layer`'s keys carry (None: a NoPE layer)."""
        if self.layer_freqs is None:
            return 0
        if layer >= len(self.layer_freqs):
            raise ValueError(f"the cache was measured with {len(self.layer_freqs)} layers but the model fed layer "
                             f"{layer}; build the cache with rope= the model whose keys it holds")
        return self.layer_freqs[layer]

    def rotation(self, delta: torch.Tensor) -> tuple[Turn, ...]:
        """One rotation by `delta` (B,) positions per frequency set."""
        return tuple(rope_rotation(delta, f) for f in self.freqs)

    def rotate(self, keys: torch.Tensor, turn: Turn) -> torch.Tensor:
        return rotate_keys(keys, *turn, self.interleaved)


def rope_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every RoPE inverse-frequency buffer of a module: `inv_freq`, or a per-layer-type one such as Gemma 3's
    `sliding_attention_inv_freq` (transformers 5.25); not the `original_inv_freq` copies dynamic scaling restores."""
    return [(name, b) for name, b in model.named_buffers()
            if name.endswith("inv_freq") and not name.endswith("original_inv_freq")]


def rope_tables(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every precomputed RoPE table of a module: a buffer `embed_positions` (P, r) whose row p is sin(p f) | cos(p f)
    (GPT-J, CodeGen; a learned position table is a parameter, not a buffer)."""
    return [(name, b) for name, b in model.named_buffers()
            if name.split(".")[-1] == "embed_positions" and b.dim() == 2 and b.shape[0] >= 2 and b.shape[1] % 2 == 0]


TABLE_TOLERANCE = 2e-2  # |sin, cos - the table| of a true RoPE table: float32 angles at 32k positions are ~2e-3 off,
# a bfloat16 table's entries 4e-3; anything else (not sin | cos of p f) is off by order 1


def table_frequencies(table: torch.Tensor) -> torch.Tensor | None:
    """The inverse frequencies f (r/2,) float64 of a sin | cos RoPE table (P, r), or None if it is no such table.

    Row 1 gives f mod 2 pi; rows 2, 4, 8, ... refine it, the turns each adds counted from the estimate so far (so the
    table's rounding costs at most about 1 / P of one entry's error); then every row is checked against sin | cos of
    p f."""
    t = table.detach().to("cpu", torch.float64)
    half, last = t.shape[1] // 2, t.shape[0] - 1
    sin, cos = t[:, :half], t[:, half:]
    f = torch.atan2(sin[1], cos[1])
    row = 1
    while row < last:
        row = min(2 * row, last)
        angle = torch.atan2(sin[row], cos[row])
        f = (angle + 2 * math.pi * torch.round((row * f - angle) / (2 * math.pi))) / row
    p = torch.arange(t.shape[0], dtype=torch.float64)[:, None] * f[None, :]
    if (f < 0).any() or float((torch.cat([p.sin(), p.cos()], dim=1) - t).abs().max()) > TABLE_TOLERANCE:
        return None
    return f


def positions_end(model: torch.nn.Module) -> int | None:
    """The context past which a model has no positions to give (a learned table or a precomputed RoPE table ends
    there), or None: a model whose RoPE is computed at any position, or whose context is unknown."""
    from gqakit.hf.fields import context_length

    if rope_buffers(model):
        return None
    tables = [b.shape[0] for _, b in rope_tables(model)]
    return min(tables) if tables else context_length(model.config.to_dict())


def rope_frequencies(rope: torch.nn.Module | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The distinct RoPE inverse-frequency sets (r/2,) of a model (one per rotary embedding or layer type), or the
    one tensor given; float64 on the CPU."""
    if isinstance(rope, torch.Tensor):
        return (rope.detach().to("cpu", torch.float64).reshape(-1),)
    if is_latent(getattr(rope, "config", None) or {}):
        raise ValueError(f"{type(rope).__name__} is latent attention: its cache holds a position-free latent beside "
                         "one shared RoPE key, which re-rotating keys would mistake for the latent; keep no sinks "
                         "(a plain window) for this model")
    found = rope_buffers(rope)
    if not found:
        tables = [table_frequencies(b) for _, b in rope_tables(rope)]
        if tables and all(f is not None for f in tables):
            return _distinct(tables)
        raise ValueError(f"{type(rope).__name__} has no rotary embedding with an `inv_freq` buffer or a sin | cos "
                         "table; a cache that moves keys (sinks, or a window the stream outgrows) re-rotates them by "
                         "RoPE: use a full cache")
    for module in rope.modules():
        kinds = getattr(module, "rope_type", None)
        for kind in (kinds.values() if isinstance(kinds, dict) else (kinds,)):  # Gemma 3: one per layer type
            if kind in _POSITION_DEPENDENT_ROPE:
                raise ValueError(f"rope_type {kind!r} changes its frequencies with the position; SinkCache needs "
                                 "fixed frequencies (default, linear, llama3, yarn)")
    return _distinct([buffer.detach().to("cpu", torch.float64).reshape(-1) for _, buffer in found])


def _distinct(sets: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    freqs: list[torch.Tensor] = []
    for f in sets:
        if not any(f.shape == g.shape and torch.equal(f, g) for g in freqs):
            freqs.append(f)
    return tuple(freqs)


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
