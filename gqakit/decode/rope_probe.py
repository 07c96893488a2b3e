"""What a bounded cache must know about a model's cached keys, measured from the model itself.

A cache that evicts tokens moves the keys it keeps to new positions by rotating them (`rope.rotate_keys`). That is
exact only if every layer's cached key at position p + d is its key at p rotated by d with the model's RoPE
frequencies, in the layout the cache rotates by. Nothing in a config says so reliably: RoPE pairs dims in two
layouts (rotate-half; interleaved in Cohere, GLM), some layers apply none (SmolLM3's and Llama 4's NoPE
layers), and some models hold a rotary module they never apply (Falcon with ALiBi). So it is measured: one forward
of three one-token rows at position 0 and one at position `SHIFT` (the last one of a precomputed RoPE table that ends
before it), through transformers' own cache. A one-token
forward attends only to itself, so every layer's input is the same at both positions and only the positional
encoding of its keys can differ: each layer's keys must equal the first forward's rotated by `SHIFT` with one of the
model's frequency sets (a RoPE layer; Gemma 3's sliding and full layers carry sets of their own) or be unchanged (a
NoPE layer). Anything else is refused in one line, and so is a model without a RoPE layer, whose
positions enter elsewhere (ALiBi, learned embeddings) where re-basing would break them.

`layer_windows` reads the model's own per-layer sliding windows from transformers' cache layout for the config; the
measured rotation carries them, for caches that replace the model's masks with their own
(`stream_cache.ChunkedSinkCache`).
"""
from __future__ import annotations

import torch

from gqakit.decode.rope import KeyRotation, positions_end, rope_frequencies, rope_rotation, rotate_keys
from gqakit.hf.compat import cache_kwargs

SHIFT = 1021  # positions between the two probes: most rotary pairs turn by many radians
# Largest relative difference (Frobenius norm) between the keys at SHIFT and the rotated keys at 0 that still counts
# as equal: the model forms its RoPE angles in float32 (about 6e-5 rad off at SHIFT) and rounds its keys to its dtype.
# A wrong layout or a rotated NoPE layer is off by order 1.
TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@torch.no_grad()
def _probe_keys(model, position: int) -> list[torch.Tensor]:
    """Every cache layer's keys (B, G, 1, d) after a forward of three one-token rows at `position`."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = (torch.arange(1, 4, device=device) % vocab)[:, None]  # (3, 1)
    cache = DynamicCache()
    model(input_ids=ids, position_ids=torch.full_like(ids, position), use_cache=True, **cache_kwargs(model, cache))
    return [layer.keys for layer in cache.layers]


def measure_rotation(model) -> KeyRotation:
    """How `model` rotates its cached keys (see the module docstring): for each layer, the frequency set and layout
    its keys follow, or none (NoPE); ValueError in one line if a cache cannot re-rotate them exactly."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder; the bounded caches hold a decoder's self-attention keys of a "
                         "decoder-only model: use a full cache")
    if not getattr(model, "hf_device_map", None) and any(p.is_meta for p in model.parameters()):  # offloaded: hooks
        raise ValueError(f"{name} is on the meta device (no weights to run); load its weights before building a "
                         "cache that measures it")
    freqs = rope_frequencies(model)
    windows = layer_windows(model.config)  # refuses layers that are no plain K/V cache
    end = positions_end(model)  # a precomputed table (GPT-J) ends there
    shift = SHIFT if end is None else min(SHIFT, end - 1)
    modes = [(module, module.training) for module in model.modules()]  # restored one by one, as the caller set them
    model.eval()
    try:
        before, after = _probe_keys(model, 0), _probe_keys(model, shift)
    finally:
        for module, training in modes:
            module.training = training
    tolerance = TOLERANCE.get(before[0].dtype, 1e-3)
    turns = [rope_rotation(torch.full((before[0].shape[0],), shift), f) for f in freqs]
    layouts, layer_freqs = set(), []
    for index, (k0, k1) in enumerate(zip(before, after)):
        errors = sorted((_relative(rotate_keys(k0, *turn, interleaved), k1), i, interleaved)
                        for i, (f, turn) in enumerate(zip(freqs, turns)) if 2 * f.numel() <= k0.shape[-1]
                        for interleaved in (False, True))
        fits = [(i, interleaved) for error, i, interleaved in errors if error <= tolerance]  # the best first
        if fits:
            layouts |= {fits[0][1]} if len({layout for _, layout in fits}) == 1 else set()
            layer_freqs.append(fits[0][0])
        elif _relative(k0, k1) <= tolerance:
            layer_freqs.append(None)  # a NoPE layer: its keys never move
        else:
            raise ValueError(f"{name}'s layer {index} caches keys that move with the position in a way other than "
                             f"rotation by its RoPE frequencies, so a cache that re-rotates keys would change its "
                             "attention; use a full cache")
    if all(f is None for f in layer_freqs):
        raise ValueError(f"no layer of {name} rotates its keys by RoPE (its positions enter elsewhere, e.g. ALiBi or "
                         "learned embeddings), so a cache that moves keys would change its attention; use a full "
                         "cache")
    if len(layouts) > 1:
        raise ValueError(f"{name}'s layers rotate their keys in two RoPE layouts (rotate-half and interleaved), and a "
                         "cache rotates by one; use a full cache")
    return KeyRotation(freqs, interleaved=layouts == {True}, layer_freqs=tuple(layer_freqs), windows=windows,
                       positions=end)


def layer_windows(config) -> tuple[int | None, ...]:
    """Each cache layer's sliding window under `config` (None: full attention), from transformers' own cache layout
    (Mistral's `sliding_window`, Qwen2 / Gemma's `layer_types`); ValueError for a layer that is neither (chunked
    attention, shared or linear-attention layers)."""
    from transformers import DynamicCache

    text = config.get_text_config(decoder=True)
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        raise ValueError(f"{type(config).__name__} has chunked-attention layers, whose chunks sit at absolute "
                         "positions that a cache which moves keys would shift; use a full cache")
    windows = []
    for index, layer in enumerate(DynamicCache(config=config).layers):
        kind = type(layer).__name__
        if kind not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
            raise ValueError(f"{type(config).__name__}'s layer {index} is a {kind}, not a plain K/V cache layer as a "
                             "bounded cache holds; use a full cache")
        windows.append(getattr(layer, "sliding_window", None) if kind == "DynamicSlidingWindowLayer" else None)
    return tuple(windows)
