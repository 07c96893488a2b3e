"""The mask side of gqakit attention: what transformers' mask creation hands the kernel (`gqakit_mask`, registered
with `AttentionMaskInterface`), and the readers of transformers' mask internals it needs.

The mask function returns a small `TiledMask` description rather than a dense [B, 1, Tq, Tk] tensor: the tiled
kernel evaluates the mask block by block and skips the blocks it empties. A model's own sliding-window layers
(Mistral, Gemma2/3, Qwen2 layer_types) reach the kernel as a window read from how transformers composed the
layer's mask function, so blocks outside it are skipped.

FRAGILE: this is the one module that reads transformers' private mask composition. It recognises the closures
that `transformers.masking_utils` builds (`and_masks`, `sliding_window_overlay`,
`sliding_window_bidirectional_overlay`, `packed_sequence_mask_function`, `remap_positions_for_packed_sequence`) by
their `__qualname__` and reads their closure cells. Checked against transformers 5.23 and 5.24. Every reader
answers "unsure" (no bound, not causal-bounded) for a function it does not recognise, and the kernel then visits
every block and lets the model's function decide: a change upstream costs speed, never correctness
(tests/attention/test_attention_patterns.py pins the recognised shapes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

from gqakit.attention.masks import AttentionOptionError


@dataclasses.dataclass(frozen=True)
class TiledMask:
    """What the mask interface hands the kernel: offsets, key padding and the model's own pattern."""

    q_offset: int
    kv_offset: int
    key_padding: torch.Tensor | None  # (B, Tk) bool, True = real token
    model_mask: Callable | None  # the model's mask function when it is more than plain causal / bidirectional
    causal: bool = True  # False: the model's mask may let a query see later keys (encoders, or_masks overlays)
    window: int | None = None  # the model's mask provably allows only dist < window (its sliding_window layers)
    window_only: bool = False  # the model's mask is exactly causal (or bidirectional) & dist < window
    # (B,) leading pads per row where some row is left-padded: its token at column c sits at position c - shift,
    # where a pattern anchored at positions (sinks, global tokens, fixed blocks) must be placed (not on its pads)
    row_shift: torch.Tensor | None = None
    # some row has padding between two of its real tokens: no one shift gives its tokens' positions
    gapped_rows: bool = False
    # the model's mask packs documents into a row (position_ids restarting at 0): positions restart mid-row
    packed: bool = False


def _causal_bounded(fn: Callable, depth: int = 0) -> bool:
    """Whether a transformers mask function provably allows only keys at or before their query (k <= q), so that
    the kernel's causal block plan loses nothing. Reads how transformers composed it (and_masks of a causal
    function, the packed-sequence wrapper); False when unsure, and the kernel then visits every block and lets
    the function decide (exact, slower): e.g. an `or_masks` overlay that lets image tokens see ahead."""
    if fn is causal_mask_function:
        return True
    if depth > 8 or not callable(fn):
        return False
    cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return False
    parts = [f for c in cells if isinstance(c, tuple) for f in c]
    if any(_causal_bounded(f, depth + 1) for f in parts):
        return True
    # packed_sequence_compatibility_function: same document AND causal on per-document positions, which grow by
    # exactly one inside a document (that is how transformers finds the documents), so causal on indices too.
    names = {getattr(f, "__qualname__", "") for f in parts}
    if "packed_sequence_mask_function.<locals>.inner_mask" in names:
        for f in parts:
            if getattr(f, "__qualname__", "") == "remap_positions_for_packed_sequence.<locals>.inner_mask":
                inner = [c.cell_contents for c in f.__closure__ or ()]
                if any(callable(c) and _causal_bounded(c, depth + 1) for c in inner):
                    return True
    return False


_SLIDING = "sliding_window_overlay.<locals>.inner_mask"  # q - k < W
_SLIDING_BIDIR = "sliding_window_bidirectional_overlay.<locals>.inner_mask"  # |q - k| <= W


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _window_bounds(fn: Callable, depth: int = 0) -> tuple[int | None, int | None]:
    """(back, both): the model's mask function provably allows only q - k < back, and only |q - k| < both (None:
    no such bound known). Read from how transformers composed it, like `_causal_bounded`: its sliding-window
    overlays, under and_masks and the packed-sequence wrapper (positions and indices differ by a constant inside
    a document). An or_masks overlay bounds nothing."""
    name = getattr(fn, "__qualname__", "")
    if depth > 8 or not callable(fn) or not hasattr(fn, "__code__"):
        return None, None
    if name == _SLIDING:
        return int(_closure(fn)["sliding_window"]), None
    if name == _SLIDING_BIDIR:
        w = int(_closure(fn)["sliding_window"]) + 1
        return w, w
    if name != "and_masks.<locals>.and_mask":
        return None, None
    parts = [f for c in _closure(fn).values() if isinstance(c, tuple) for f in c]
    guarded = any(getattr(f, "__qualname__", "") == "packed_sequence_mask_function.<locals>.inner_mask" for f in parts)
    back, both = [], []
    for f in parts:
        if getattr(f, "__qualname__", "") == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            inner = [c for c in _closure(f).values() if callable(c)]
            if not guarded or len(inner) != 1:
                continue  # per-document positions carry distances only inside one document
            f = inner[0]
        b, w = _window_bounds(f, depth + 1)
        back += [b] if b is not None else []
        both += [w] if w is not None else []
    return min(back, default=None), min(both, default=None)


def _packed(fn: Callable, depth: int = 0) -> bool:
    """Whether transformers composed the mask for documents packed into a row (position_ids that restart)."""
    name = getattr(fn, "__qualname__", "")
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return True
    if depth > 8 or name not in ("and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"):
        return False
    return any(_packed(f, depth + 1) for c in _closure(fn).values() if isinstance(c, tuple) for f in c)


def _window_only(fn: Callable) -> bool:
    """Whether the mask function is exactly transformers' sliding-window mask: causal & q - k < W, or
    bidirectional & |q - k| <= W, and nothing else (so a windowed MaskSpec says all of it)."""
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return False
    parts = [f for c in _closure(fn).values() if isinstance(c, tuple) for f in c]
    names = sorted(getattr(f, "__qualname__", "") for f in parts)
    return len(parts) == 2 and ((causal_mask_function in parts and _SLIDING in names)
                                or (bidirectional_mask_function in parts and _SLIDING_BIDIR in names))


def uses_alibi(config) -> bool:
    """Does this config add ALiBi position biases to the scores (Bloom, MPT, Falcon with alibi)?"""
    attn_config = getattr(config, "attn_config", None)
    return (getattr(config, "model_type", None) in ("bloom", "mpt") or bool(getattr(config, "alibi", False))
            or bool(getattr(attn_config, "alibi", False)))


def gqakit_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
                **kwargs) -> TiledMask:
    """The AttentionMaskInterface function: describe the mask instead of materialising it."""
    config = kwargs.get("config")
    if config is not None and uses_alibi(config):  # from_pretrained(attn_implementation="gqakit_*") skips use()
        raise AttentionOptionError(f"{config.model_type} adds ALiBi position biases, which gqakit attention does not "
                                   "implement; load it with attn_implementation='sdpa' or 'eager'")
    key_padding, shift, gapped = None, None, False
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        pad = kv_offset + kv_length - attention_mask.shape[-1]
        padded = torch.nn.functional.pad(attention_mask, (0, pad), value=True) if pad > 0 else attention_mask
        key_padding = padded[:, kv_offset : kv_offset + kv_length].bool()
        shift, gapped = _row_shift(attention_mask.bool())
    if mask_function is causal_mask_function:
        causal, model_mask = True, None
    elif mask_function is bidirectional_mask_function:  # encoders (BERT), or config.is_causal=False
        causal, model_mask = False, None
    else:  # the model's own pattern is ANDed in; a causal plan only where that provably loses nothing
        causal, model_mask = _causal_bounded(mask_function), mask_function
        # its sliding window (Mistral, Gemma2/3, Qwen2 layer_types): the kernel skips the blocks outside it
        back, both = _window_bounds(mask_function)
        window = back if causal else both
        return TiledMask(int(q_offset), int(kv_offset), key_padding, model_mask, causal, window,
                         window is not None and _window_only(mask_function), shift, gapped, _packed(mask_function))
    return TiledMask(int(q_offset), int(kv_offset), key_padding, model_mask, causal, row_shift=shift,
                     gapped_rows=gapped)


def _row_shift(real: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(row_shift, gapped) of a 2-D padding mask (B, L), True = real token: each row's leading pads where some row
    has any (else None), and whether some row has pads between real tokens (one host sync)."""
    starts = real & ~torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)  # first column of a run of reals
    leading = torch.where(real.any(dim=1), real.int().argmax(dim=1), 0)  # a row of pads only: 0 (it sees nothing)
    gapped, shifted = (bool(x) for x in torch.stack([(starts.sum(dim=1) > 1).any(), (leading > 0).any()]).tolist())
    return (leading if shifted else None), gapped
