"""gqakit's attention backends, registered the transformers way.

Each kind is registered under `gqakit_<kind>` with BOTH `AttentionInterface` (the kernel) and
`AttentionMaskInterface` (what the model's mask creation returns), so padding reaches the kernel
instead of being silently dropped. The mask function returns a small `TiledMask` description rather
than a dense [B, 1, Tq, Tk] tensor: the tiled kernel evaluates the mask block by block and skips the
blocks it empties.

The attention functions honour what transformers models pass that changes the result: `softcap`
(Gemma2), `s_aux` sink logits (gpt-oss), bidirectional masks (encoders), a caller's own 4-D bool or
additive float mask, and flash-style `cu_seq_lens_q/_k` packing. What they do not implement
(`UNSUPPORTED`: position biases, ALiBi, head masks, per-position sinks) is refused with one line.

A model's own sliding-window layers (Mistral, Gemma2/3, Qwen2 layer_types) reach the kernel as a
windowed MaskSpec: `gqakit_mask` reads the window from how transformers composed the layer's mask
function, so blocks outside it are skipped; the function itself stays as an elementwise check unless it
is exactly transformers' sliding-window mask.

Options (window, sinks, stride, block sizes, ...) live in `config.gqakit_attention`, a plain JSON dict
that `save_pretrained` keeps, so `from_pretrained(..., attn_implementation="gqakit_sliding")` works.
The pattern options (`LAYERED`) may be one value, a list of one per layer, and within a layer a list of
one per query head: e.g. `use(model, "sliding", window=[64, 128, [256] * 6 + [512] * 2],
dilation=[1, 1, [1] * 6 + [2] * 2])`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function

from gqakit.attention import patterns
from gqakit.attention.masks import AttentionOptionError, MaskSpec
from gqakit.attention.flex import attention_forward

KINDS = ("tiled", "sliding", "sinks", "sparse")
OPTIONS = {
    "tiled": {"block_q", "block_k"},
    "sliding": {"window", "dilation", "global_tokens", "block_q", "block_k"},
    "sinks": {"sinks", "window", "block_q", "block_k"},
    "sparse": {"pattern", "stride", "summary", "part", "block_q", "block_k"},
}
# Options that may be given per layer (a list of num_hidden_layers values) and, within a layer, per query
# head (a list of num_attention_heads values); see patterns.check_layered.
LAYERED = {"sliding": ("window", "dilation"), "sparse": ("pattern", "stride", "summary", "part")}
DEFAULTS = {"block_q": 128, "block_k": 128, "dilation": 1, "global_tokens": (), "sinks": 4, "window": None,
            "pattern": "strided", "stride": None, "summary": None, "part": "both"}
SPARSE_PATTERNS = ("strided", "fixed")
CONFIG_KEY = "gqakit_attention"


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


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def normalise_options(kind: str, options: dict, config=None) -> dict:
    """Validate a kind and its options against the model config (layers, heads, positions); fill defaults.
    Raises AttentionOptionError."""
    if kind not in KINDS:
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise AttentionOptionError(f"unknown attention kind '{kind}'{hint} (choose one of {', '.join(KINDS)})")
    unknown = sorted(set(options) - OPTIONS[kind])
    if unknown:
        raise AttentionOptionError(
            f"attention kind '{kind}' has no option '{unknown[0]}'; it takes {', '.join(sorted(OPTIONS[kind]))}")
    merged = {k: DEFAULTS[k] for k in OPTIONS[kind]}
    merged.update(options)
    text = _text_config(config)
    num_layers, num_heads = getattr(text, "num_hidden_layers", None), getattr(text, "num_attention_heads", None)
    for name in LAYERED.get(kind, ()):
        merged[name] = patterns.check_layered(name, merged[name], num_layers, num_heads)
    if kind == "sliding" and merged["window"] is None:
        merged["window"] = getattr(text, "sliding_window", None)
        if merged["window"] is None:
            raise AttentionOptionError("attention kind 'sliding' needs a window; pass window=W (e.g. 512), one per "
                                       "layer, or per layer one per head")
    if kind == "sinks" and merged["window"] is None:
        merged["window"] = 1020
    if kind == "sparse" and merged["stride"] is None:
        raise AttentionOptionError("attention kind 'sparse' needs a stride; pass stride=l (about the square root of "
                                   "the sequence length, e.g. 128 for 16k tokens)")
    if "global_tokens" in merged:
        if isinstance(merged["global_tokens"], (int, str)):
            raise AttentionOptionError(f"global_tokens={merged['global_tokens']!r} must be a list of positions, "
                                       f"e.g. global_tokens=[0]")
        merged["global_tokens"] = tuple(int(g) for g in merged["global_tokens"])
        limit = getattr(text, "max_position_embeddings", None)
        beyond = [g for g in merged["global_tokens"] if limit is not None and g >= limit]
        if beyond:
            raise AttentionOptionError(f"global_tokens {beyond} are beyond the model's max_position_embeddings="
                                       f"{limit}; give positions 0 <= g < {limit}")
    for name in ("block_q", "block_k"):
        if not isinstance(merged[name], int) or merged[name] <= 0:
            raise AttentionOptionError(f"{name} must be a positive integer, got {merged[name]!r}")
    try:  # build every layer's pattern once, so that a bad value fails here and not in the forward
        layered = any(patterns.is_layered(merged[n]) for n in LAYERED.get(kind, ()))
        for layer in range(num_layers) if layered else [None]:
            mask_spec(kind, merged, layer=layer, num_heads=num_heads)
    except ValueError as e:
        raise AttentionOptionError(str(e)) from None
    return {"kind": kind, **merged}


def mask_spec(kind: str, options: dict, causal: bool = True, layer: int | None = None,
              num_heads: int | None = None) -> MaskSpec | tuple[MaskSpec, ...]:
    """The pattern of a kind at one layer: a MaskSpec, or a tuple of one per query head where the options
    differ per head. Not causal, a window is symmetric (|q - k| < window, Longformer style)."""
    if kind == "tiled":
        return MaskSpec(causal=causal)
    if kind == "sinks":
        return MaskSpec(causal=causal, window=options["window"], sinks=options["sinks"])
    names = LAYERED[kind]
    values = {n: options[n] for n in names}
    layered = [n for n in names if patterns.is_layered(values[n])]
    if layered and layer is None:
        raise AttentionOptionError(f"attention kind '{kind}' has per-layer options ({', '.join(layered)}), but this "
                                   "use takes one pattern for the whole model (e.g. ring attention); give single "
                                   "values")
    part = values.get("part")
    if isinstance(part, list):  # 'split' is a value for a whole layer
        part = part[layer] if layer is not None and 0 <= layer < len(part) else None
    split = part == "split"
    per_head = split or any(isinstance(v, list) for n in layered for v in values[n])
    if per_head and num_heads is None:
        raise AttentionOptionError(f"attention kind '{kind}' has per-head options, but this use does not know the "
                                   "number of query heads; give one value per layer")
    if split and num_heads < 2:
        raise AttentionOptionError(f"part='split' halves a layer's heads, but it has {num_heads}; use 'a1', 'a2' or "
                                   "'both'")
    for n in layered:
        sizes = {len(v) for v in values[n] if isinstance(v, list)}
        if sizes - {num_heads}:
            raise AttentionOptionError(f"{n} has {sizes.pop()} values per head, but this layer has {num_heads} query "
                                       "heads; give one value per query head")
    specs = []
    for head in range(num_heads) if per_head else [0]:
        at = {n: patterns.value_at(values[n], layer, head) for n in names}
        if split:  # the paper's factorised heads: first half A1, the rest A2
            at["part"] = "a1" if head < num_heads // 2 else "a2"
        specs.append(_build(kind, causal, tuple(at.items()), tuple(options.get("global_tokens", ()))))
    specs = tuple(specs)
    return specs[0] if len(set(specs)) == 1 else specs


@functools.lru_cache(maxsize=1024)
def _build(kind: str, causal: bool, at: tuple, global_tokens: tuple) -> MaskSpec:
    at = dict(at)
    if kind == "sliding":
        return MaskSpec(causal=causal, window=at["window"], dilation=at["dilation"], global_tokens=global_tokens)
    pattern, part = at["pattern"], at["part"]
    if pattern not in SPARSE_PATTERNS:
        raise AttentionOptionError(f"sparse pattern {pattern!r} is unknown; choose 'strided' or 'fixed' (Sparse "
                                   "Transformer)")
    if part == "split":
        raise AttentionOptionError("part='split' is a per-layer value (it splits a layer's heads); per head, give "
                                   "'a1', 'a2' or 'both'")
    if pattern == "strided":
        if at["summary"] is not None:
            raise AttentionOptionError("pattern 'strided' takes no summary; drop summary=c, or use pattern='fixed'")
        return patterns.strided(at["stride"], part=part, causal=causal)
    if at["summary"] is None:
        raise AttentionOptionError("pattern 'fixed' needs summary=c (the last c positions of every block of stride "
                                   "l, seen by all later tokens; the paper uses 8 to 32 for l = 128)")
    return patterns.fixed(at["stride"], at["summary"], part=part, causal=causal)


def _options_of(config, kind: str) -> dict:
    stored = getattr(config, CONFIG_KEY, None) or {}
    if stored.get("kind") == kind:
        return stored
    options = normalise_options(kind, {}, config)  # defaults for from_pretrained(attn_implementation=...)
    setattr(config, CONFIG_KEY, options)
    return options


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
    key_padding = None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        pad = kv_offset + kv_length - attention_mask.shape[-1]
        padded = torch.nn.functional.pad(attention_mask, (0, pad), value=True) if pad > 0 else attention_mask
        key_padding = padded[:, kv_offset : kv_offset + kv_length].bool()
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
                         window is not None and _window_only(mask_function))
    return TiledMask(int(q_offset), int(kv_offset), key_padding, model_mask, causal)


# Keywords that transformers models pass to attention functions and that change the result, which the
# kernels do not implement: a call that carries one is refused, never run without it.
UNSUPPORTED = {
    "sinks": "per-position sink logits (gpt-oss style s_aux, one logit per head, is supported)",
    "position_bias": "an additive position bias",
    "alibi": "ALiBi position biases",
    "head_mask": "a head mask",
}
_FIX = "load the model with attn_implementation='sdpa' or 'eager' instead of gqakit attention"


def _refuse_unsupported(module: torch.nn.Module, attention_mask, kwargs: dict) -> None:
    """One line naming the model, the argument and the fix, for anything the kernel would otherwise drop."""
    model = type(module).__name__
    for key, what in UNSUPPORTED.items():
        if kwargs.get(key) is not None:
            raise AttentionOptionError(f"{model} passes {key} ({what}), which gqakit attention does not implement; "
                                       f"{_FIX}")
    if attention_mask is not None and not isinstance(attention_mask, (TiledMask, torch.Tensor)):
        raise AttentionOptionError(f"{model} received an attention mask of type {type(attention_mask).__name__}, "
                                   f"which gqakit attention cannot read; pass a 2-D padding mask or a 4-D bool / "
                                   f"additive float tensor, or {_FIX}")


def _document_mask(module, query, key, mask: TiledMask, kwargs: dict) -> Callable | None:
    """Flash-attention style packing (cu_seq_lens_q / _k: cumulative document lengths over one row) as a mask
    function: a query sees only keys of its own document. Refused where it has no such meaning here."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    B, Tq, Tk = query.shape[0], query.shape[-2], key.shape[-2]
    if (B != 1 or Tq != Tk or mask.q_offset != 0 or mask.kv_offset != 0 or cu_q.shape != cu_k.shape
            or not torch.equal(cu_q, cu_k) or int(cu_q[0]) != 0 or int(cu_q[-1]) != Tq):
        raise AttentionOptionError(
            f"{type(module).__name__} passes cu_seq_lens_q/_k for {B} row(s) of {Tq} queries and {Tk} keys; gqakit "
            "attention takes them only for training-style packing (batch 1, the same boundaries for queries and "
            "keys, ending at the sequence length); pass position_ids that restart at 0 per document instead, "
            f"or {_FIX}")
    doc = torch.bucketize(torch.arange(Tq, device=cu_q.device), cu_q[1:].to(torch.long), right=True)  # (Tq,)

    def same_document(batch_idx, head_idx, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return same_document


def _and(a: Callable | None, b: Callable | None) -> Callable | None:
    if a is None or b is None:
        return a if b is None else b
    return lambda *idx: a(*idx) & b(*idx)


def _window_function(window: int, causal: bool) -> Callable:
    def within(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx < window) if causal else ((q_idx - kv_idx).abs() < window)

    return within


def layer_spec(kind: str, options: dict, module, num_heads: int, mask: TiledMask, causal: bool,
               sliding_window: int | None = None) -> tuple[MaskSpec | tuple[MaskSpec, ...], Callable | None]:
    """(spec, elementwise model mask) for one layer's call: the kind's pattern at this layer (per head where
    the options say so), cut to the model's own sliding window where the layer has one (read from its mask
    function, or `sliding_window` for a call that came with no mask at all, as flash attention reads it), so
    the kernel skips the blocks outside it. The model's mask function is kept as an elementwise check unless
    the windowed spec says exactly what it says; where a spec cannot carry the window (sinks and global tokens
    reach past any window), only that check applies it."""
    layer = getattr(module, "layer_idx", None)
    try:
        spec = mask_spec(kind, options, causal, layer=layer, num_heads=num_heads)
    except AttentionOptionError as e:
        raise AttentionOptionError(f"{type(module).__name__} (layer {layer}): {e}") from None
    model_mask, window = mask.model_mask, mask.window
    if sliding_window is not None:
        window = int(sliding_window)
    if window is not None:
        narrowed = patterns.within_window(spec, window)
        if narrowed is not None:
            spec = narrowed
            if mask.window_only:
                model_mask = None  # the narrowed spec is exactly what the model's function said
        elif sliding_window is not None:
            model_mask = _and(model_mask, _window_function(window, causal))
    return spec, model_mask


def _make_attention(kind: str):
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
        """transformers' attention signature: q (B, H, Tq, d), k/v (B, G, Tk, d|dv) -> (B, Tq, H, dv).

        Honours `softcap` (Gemma2), `s_aux` (gpt-oss sink logits), `is_causal` / the module's causality,
        a caller's 4-D bool or additive float mask, and cu_seq_lens packing; refuses the rest."""
        if dropout and module.training:
            raise AttentionOptionError(
                "gqakit attention has no attention dropout; set config.attention_dropout = 0.0 to train with it")
        _refuse_unsupported(module, attention_mask, kwargs)
        options = _options_of(module.config, kind)
        dense = None
        if isinstance(attention_mask, TiledMask):
            mask, causal = attention_mask, attention_mask.causal  # the model's mask decides, as in eager
        else:  # called without our mask interface: decode-style offsets
            causal = kwargs.get("is_causal")
            causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
            mask = TiledMask(key.shape[-2] - query.shape[-2], 0, None, None, causal)
            if attention_mask is not None:  # a caller's 4-D mask: the whole pattern for 'tiled', as in eager
                dense = attention_mask
                causal = causal and kind != "tiled"
        spec, model_mask = layer_spec(kind, options, module, query.shape[1], mask, causal,
                                      kwargs.get("sliding_window") if attention_mask is None else None)
        extra = _and(model_mask, _document_mask(module, query, key, mask, kwargs))
        s_aux = kwargs.get("s_aux")
        if s_aux is not None and tuple(s_aux.shape) != (query.shape[1],):
            raise AttentionOptionError(f"{type(module).__name__} passes s_aux of shape {tuple(s_aux.shape)}; gqakit "
                                       f"attention takes one sink logit per query head, ({query.shape[1]},); {_FIX}")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        try:
            out = attention_forward(  # the tiled kernel on CPU; sdpa or flex_attention on CUDA
                query, key, value, scale=scale, spec=spec, q_offset=mask.q_offset,
                kv_offset=mask.kv_offset, key_padding=mask.key_padding, extra_mask=extra, attn_mask=dense,
                softcap=kwargs.get("softcap"), s_aux=s_aux, block_q=options["block_q"], block_k=options["block_k"],
            )  # (B, H, Tq, dv)
        except ValueError as e:  # shapes that do not fit (e.g. a caller's mask): one line, as for options
            raise AttentionOptionError(f"{type(module).__name__}: {e}") from None
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"gqakit_{kind}_attention"
    return attention


def register_all() -> None:
    """Register every kind under `gqakit_<kind>`; idempotent."""
    for kind in KINDS:
        AttentionInterface.register(f"gqakit_{kind}", _make_attention(kind))
        AttentionMaskInterface.register(f"gqakit_{kind}", gqakit_mask)


def check_model(model) -> None:
    """Refuse, at `use()`, a model that gqakit attention would run wrongly: no AttentionInterface, or ALiBi.
    (Encoders are welcome: their bidirectional mask reaches the kernel, which then runs non-causal.)"""
    name = type(model).__name__
    if not getattr(type(model), "_supports_attention_backend", False):
        raise AttentionOptionError(
            f"{name} does not route attention through transformers' AttentionInterface, so "
            "gqakit attention cannot be plugged in; use a model family that does (Llama, Mistral, Qwen2, ...)")
    config = model.config
    if uses_alibi(config):
        raise AttentionOptionError(f"{name} uses ALiBi position biases, which gqakit attention does not implement; "
                                   "keep its own attention (sdpa or eager)")


def use(model, kind: str, **options):
    """Switch `model` to gqakit attention `kind` ('tiled', 'sliding', 'sinks' or 'sparse') in place; returns it.

    'sliding': window W (itself and the W - 1 before it; |q - k| < W in an encoder), dilation d, global_tokens.
    'sparse': Sparse Transformer pattern='strided' | 'fixed', stride=l, summary=c (fixed), part='both' (merged
    head), 'a1', 'a2' or 'split' (first half of a layer's heads A1, the rest A2). Pattern options take one value,
    one per layer, or per layer one per query head (see `patterns.check_layered`)."""
    check_model(model)
    normalised = normalise_options(kind, options, model.config)
    register_all()
    for cfg in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        setattr(cfg, CONFIG_KEY, normalised)
    model.set_attn_implementation(f"gqakit_{kind}")
    if kind == "sinks" and hasattr(model, "generate"):
        _bound_generate(model, normalised)
    return model


def _bound_generate(model, options: dict) -> None:
    """After `use(model, "sinks")`, `model.generate()` decodes with the bounded `SinkCache` of those
    options (StreamingLLM), not a growing cache: given no cache it makes one per call (passing the
    call's attention_mask, for left padding); another kind of cache is refused."""
    from gqakit.decode.cache import SinkCache

    original = getattr(model.generate, "gqakit_original", model.generate)  # a second use() wraps the stock one

    def generate(*args, past_key_values=None, **kwargs):
        if past_key_values is None:
            past_key_values = SinkCache(options["sinks"], options["window"], rope=model,
                                        attention_mask=kwargs.get("attention_mask"))
        elif not isinstance(past_key_values, SinkCache):
            raise AttentionOptionError(
                f"use(model, 'sinks') decodes with a bounded SinkCache, but generate() got a "
                f"{type(past_key_values).__name__}; pass past_key_values=SinkCache({options['sinks']}, "
                f"{options['window']}, rope=model) or none")
        return original(*args, past_key_values=past_key_values, **kwargs)

    generate.gqakit_original = original
    generate.__doc__ = original.__doc__
    model.generate = generate
