"""gqakit's attention backends, registered the transformers way.

Each kind of `options.KINDS` is registered under `gqakit_<kind>` with BOTH `AttentionInterface` (the kernel)
and `AttentionMaskInterface` (`hf_masks.gqakit_mask`, what the model's mask creation returns), so padding
reaches the kernel instead of being silently dropped.

The attention functions honour what transformers models pass that changes the result: `softcap`
(Gemma2), `s_aux` sink logits (gpt-oss), bidirectional masks (encoders), a caller's own 4-D bool or
additive float mask, and flash-style `cu_seq_lens_q/_k` packing. What they do not implement
(`UNSUPPORTED`: position biases, ALiBi, head masks, per-position sinks) is refused with one line.
"""
from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from gqakit.attention import patterns
from gqakit.attention.flex import attention_forward
from gqakit.attention.hf_masks import TiledMask, gqakit_mask, uses_alibi
from gqakit.attention.masks import AttentionOptionError, MaskSpec, dense_allowed, dropout_refusal
from gqakit.attention.options import mask_spec, normalise_options, stored_options
from gqakit.attention.kinds import CONFIG_KEY, DEFAULT, KINDS, adds_position_bias, position_bias_refusal
from gqakit.common.errors import opt


# Keywords that transformers models pass to attention functions and that change the result, which the
# kernels do not implement: a call that carries one is refused, never run without it.
UNSUPPORTED = {
    "sinks": "per-position sink logits (gpt-oss style s_aux, one logit per head, is supported)",
    "position_bias": "an additive position bias",
    "alibi": "ALiBi position biases",
    "head_mask": "a head mask",
    "indices": "a sparse indexer's choice of keys per query (DeepSeek sparse attention)",
    "block_indices": "a choice of key blocks per query",
}
_FIX = "load the model with attn_implementation='sdpa' or 'eager' instead of gqakit attention"

# The configs (by id) whose generate() is running under `use(model, "sinks")`: their bounded SinkCache holds the
# policy (the first S real tokens and the W latest, at in-cache positions), so the kernel attends causally over
# what it holds instead of applying the sinks mask again to the cache's slots.
_CACHE_HOLDS_SINKS: ContextVar[frozenset[int]] = ContextVar("gqakit_cache_holds_sinks", default=frozenset())


def _refuse_unsupported(module: torch.nn.Module, attention_mask, kwargs: dict) -> None:
    """One line naming the model, the argument and the fix, for anything the kernel would otherwise drop."""
    model = type(module).__name__
    for key, what in UNSUPPORTED.items():
        if kwargs.get(key) is not None:
            raise AttentionOptionError(f"{model} passes {key} ({what}), which gqakit attention does not implement; "
                                       f"{_FIX}")
    if kwargs.get("output_attentions"):  # sdpa warns and returns none; the caller asked for the weights
        raise AttentionOptionError(f"{model} was called with output_attentions=True, and gqakit attention never forms "
                                   "the attention weights (tiled, online softmax); load the model with "
                                   "attn_implementation='eager' for them")
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
            raise AttentionOptionError(dropout_refusal(module, "gqakit attention"))
        _refuse_unsupported(module, attention_mask, kwargs)
        options = stored_options(module.config, kind)
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
        pattern = "tiled" if kind == "sinks" and id(module.config) in _CACHE_HOLDS_SINKS.get() else kind
        spec, model_mask = layer_spec(pattern, options, module, query.shape[1], mask, causal,
                                      kwargs.get("sliding_window") if attention_mask is None else None)
        anchored = next(filter(None, (one.anchored for one in (spec if isinstance(spec, tuple) else (spec,)))), None)
        if anchored and dense is not None and bool((~dense_allowed(dense[..., :1])).flatten(1).all(dim=1).any()):
            raise AttentionOptionError(
                f"{type(module).__name__}: attention kind '{kind}' places {anchored} at positions, and this call's 4-D "
                "mask hides a row's first column from every query (left padding?), which leaves the row's positions "
                "unknown; pass a 2-D attention_mask (each row's pads then shift its positions)")
        if anchored and mask.gapped_rows:
            raise AttentionOptionError(
                f"{type(module).__name__}: attention kind '{kind}' places {anchored} at positions, but a row of this "
                "batch has padding between its tokens, so its tokens' positions are unknown; pad on the left or the "
                "right only (or run the rows one at a time)")
        packed = mask.packed or kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
        if anchored and packed:
            raise AttentionOptionError(
                f"{type(module).__name__}: attention kind '{kind}' places {anchored} at positions, but this call packs "
                "documents into a row (position_ids restarting, or cu_seq_lens), and they would sit at the row's "
                "start, not each document's; give each document a row of its own (padded)")
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
                row_shift=mask.row_shift if anchored else None,  # distances do not move with a row's shift
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


def check_model(model, kind: str = "tiled") -> None:
    """Refuse, at `use()`, a model that gqakit attention `kind` would run wrongly: T5's relative position bias (its
    attention does go through the AttentionInterface), no AttentionInterface, or ALiBi. (Encoders are welcome: their
    bidirectional mask reaches the kernel, which then runs non-causal.)"""
    name = type(model).__name__
    if adds_position_bias(model.config):
        raise AttentionOptionError(position_bias_refusal(name, kind))
    if not getattr(type(model), "_supports_attention_backend", False):
        raise AttentionOptionError(
            f"{name} does not route attention through transformers' AttentionInterface, so gqakit attention cannot "
            f"be plugged in; keep its own attention ({opt('attention', DEFAULT)}: sdpa or eager), or use a model "
            "family that does (Llama, Mistral, Qwen2, ...)")
    config = model.config
    if getattr(getattr(config, "text_config", None) or config, "index_topk", None) is not None:
        raise AttentionOptionError(f"{name} picks each query's keys with a learned indexer (DeepSeek sparse "
                                   "attention), which reads the mask as a tensor and gqakit attention does not "
                                   "implement; keep its own attention (sdpa or eager)")
    if uses_alibi(config):
        raise AttentionOptionError(f"{name} uses ALiBi position biases, which gqakit attention does not implement; "
                                   "keep its own attention (sdpa or eager)")


def use(model, kind: str, **options):
    """Switch `model` to gqakit attention `kind` ('tiled', 'sliding', 'sinks' or 'sparse') in place; returns it.

    'sliding': window W (itself and the W - 1 before it; |q - k| < W in an encoder), dilation d, global_tokens.
    'sparse': Sparse Transformer pattern='strided' | 'fixed', stride=l, summary=c (fixed), part='both' (merged
    head), 'a1', 'a2' or 'split' (first half of a layer's heads A1, the rest A2). Pattern options take one value,
    one per layer, or per layer one per query head (see `patterns.check_layered`)."""
    check_model(model, kind)
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
    call's attention_mask, for left padding); another kind of cache is refused. The cache holds the
    policy, so while it runs the kernel attends causally over the keys the cache returns (the sinks
    mask on the cache's slots would drop the sinks once they move up to the window)."""
    from gqakit.decode.cache import SinkCache
    from gqakit.hf.compat import cache_keyword, cache_kwargs

    original = getattr(model.generate, "gqakit_original", model.generate)  # a second use() wraps the stock one
    configs = frozenset(id(c) for c in (model.config, getattr(model.config, "text_config", None)) if c is not None)

    def generate(*args, past_key_values=None, cache=None, **kwargs):
        past_key_values = cache if cache is not None else past_key_values  # either name, as transformers takes
        if past_key_values is None:
            past_key_values = SinkCache(options["sinks"], options["window"], rope=model,
                                        attention_mask=kwargs.get("attention_mask"))
        elif not isinstance(past_key_values, SinkCache):
            raise AttentionOptionError(
                f"use(model, 'sinks') decodes with a bounded SinkCache, but generate() got a "
                f"{type(past_key_values).__name__}; pass {cache_keyword(model)}=SinkCache({options['sinks']}, "
                f"{options['window']}, rope=model) or none")
        held = _CACHE_HOLDS_SINKS.set(_CACHE_HOLDS_SINKS.get() | configs)
        try:
            return original(*args, **cache_kwargs(model, past_key_values), **kwargs)
        finally:
            _CACHE_HOLDS_SINKS.reset(held)

    generate.gqakit_original = original
    generate.__doc__ = original.__doc__
    model.generate = generate


def apply_attention(model, kind: str | None, options: dict) -> dict:
    """Switch `model` to gqakit attention `kind` in place; returns the options in force ({} for default)."""
    if kind in (None, DEFAULT):
        return {}
    use(model, kind, **options)  # AttentionOptionError is a GqakitError: one line, exit 2
    return dict(getattr(model.config, CONFIG_KEY))
