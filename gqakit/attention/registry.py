"""gqakit's attention backends, registered the transformers way.

Each kind is registered under `gqakit_<kind>` with BOTH `AttentionInterface` (the kernel) and
`AttentionMaskInterface` (what the model's mask creation returns), so padding reaches the kernel
instead of being silently dropped. The mask function returns a small `TiledMask` description rather
than a dense [B, 1, Tq, Tk] tensor: the tiled kernel evaluates the mask block by block and skips the
blocks it empties.

Options (window, sinks, block sizes, ...) live in `config.gqakit_attention`, a plain dict that
`save_pretrained` keeps, so `from_pretrained(..., attn_implementation="gqakit_sliding")` works.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from ..errors import GqakitError
from .masks import MaskSpec
from .tiled import tiled_attention

KINDS = ("tiled", "sliding", "sinks")
OPTIONS = {
    "tiled": {"block_q", "block_k"},
    "sliding": {"window", "dilation", "global_tokens", "block_q", "block_k"},
    "sinks": {"sinks", "window", "block_q", "block_k"},
}
DEFAULTS = {"block_q": 128, "block_k": 128, "dilation": 1, "global_tokens": (), "sinks": 4, "window": None}
CONFIG_KEY = "gqakit_attention"


class AttentionOptionError(GqakitError, ValueError):
    """A bad kind or option: the message names the fix on one line."""


@dataclasses.dataclass(frozen=True)
class TiledMask:
    """What the mask interface hands the kernel: offsets, key padding and the model's own pattern."""

    q_offset: int
    kv_offset: int
    key_padding: torch.Tensor | None  # (B, Tk) bool, True = real token
    model_mask: Callable | None  # the model's mask function when it is more than plain causal


def normalise_options(kind: str, options: dict, config=None) -> dict:
    """Validate a kind and its options; fill defaults. Raises AttentionOptionError."""
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
    if kind == "sliding" and merged["window"] is None:
        merged["window"] = getattr(config, "sliding_window", None)
        if merged["window"] is None:
            raise AttentionOptionError("attention kind 'sliding' needs a window; pass window=W (e.g. 512)")
    if kind == "sinks" and merged["window"] is None:
        merged["window"] = 1020
    if "global_tokens" in merged:
        merged["global_tokens"] = tuple(int(g) for g in merged["global_tokens"])
    for name in ("block_q", "block_k"):
        if not isinstance(merged[name], int) or merged[name] <= 0:
            raise AttentionOptionError(f"{name} must be a positive integer, got {merged[name]!r}")
    try:
        mask_spec(kind, merged).validate()
    except ValueError as e:
        raise AttentionOptionError(str(e)) from None
    return {"kind": kind, **merged}


def mask_spec(kind: str, options: dict) -> MaskSpec:
    if kind == "tiled":
        return MaskSpec(causal=True)
    if kind == "sliding":
        return MaskSpec(causal=True, window=options["window"], dilation=options["dilation"],
                        global_tokens=tuple(options["global_tokens"]))
    return MaskSpec(causal=True, window=options["window"], sinks=options["sinks"])


def _options_of(config, kind: str) -> dict:
    stored = getattr(config, CONFIG_KEY, None) or {}
    if stored.get("kind") == kind:
        return stored
    options = normalise_options(kind, {}, config)  # defaults for from_pretrained(attn_implementation=...)
    setattr(config, CONFIG_KEY, options)
    return options


def gqakit_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
                **kwargs) -> TiledMask:
    """The AttentionMaskInterface function: describe the mask instead of materialising it."""
    key_padding = None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        pad = kv_offset + kv_length - attention_mask.shape[-1]
        padded = torch.nn.functional.pad(attention_mask, (0, pad), value=True) if pad > 0 else attention_mask
        key_padding = padded[:, kv_offset : kv_offset + kv_length].bool()
    model_mask = None if mask_function is causal_mask_function else mask_function
    return TiledMask(int(q_offset), int(kv_offset), key_padding, model_mask)


# Keywords that transformers models pass to attention functions and that change the result, which the
# kernels do not implement yet: a call that carries one is refused, never run without it.
UNSUPPORTED = {
    "softcap": "attention logit soft-capping",
    "s_aux": "learned per-head sink logits",
    "sinks": "learned per-head sink logits",
    "position_bias": "an additive position bias",
    "alibi": "ALiBi position biases",
    "cu_seq_lens_q": "packed-sequence boundaries",
    "cu_seq_lens_k": "packed-sequence boundaries",
    "head_mask": "a head mask",
}


def _refuse_unsupported(module: torch.nn.Module, attention_mask, kwargs: dict) -> None:
    """One line naming the model, the argument and the fix, for anything the kernel would otherwise drop."""
    model = type(module).__name__
    fix = "load the model with attn_implementation='sdpa' or 'eager' instead of gqakit attention"
    for key, what in UNSUPPORTED.items():
        if kwargs.get(key) is not None:
            raise AttentionOptionError(f"{model} passes {key} ({what}), which gqakit attention does not implement; "
                                       f"{fix}")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise AttentionOptionError(f"{model} attends bidirectionally (is_causal=False), and gqakit attention is "
                                   f"causal; {fix}")
    if attention_mask is not None and not isinstance(attention_mask, TiledMask):
        raise AttentionOptionError(f"{model} received an attention mask tensor of shape "
                                   f"{tuple(getattr(attention_mask, 'shape', ()))} (a caller's custom or 4-D mask), "
                                   f"which gqakit attention cannot honour; pass a 2-D padding mask, or {fix}")


def _make_attention(kind: str):
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
        """transformers' attention signature: q (B, H, Tq, d), k/v (B, G, Tk, d) -> (B, Tq, H, d)."""
        if dropout and module.training:
            raise AttentionOptionError(
                "gqakit attention has no attention dropout; set config.attention_dropout = 0.0 to train with it")
        _refuse_unsupported(module, attention_mask, kwargs)
        options = _options_of(module.config, kind)
        if isinstance(attention_mask, TiledMask):
            mask = attention_mask
        else:  # called without our mask interface and without a mask: decode-style offsets
            mask = TiledMask(key.shape[-2] - query.shape[-2], 0, None, None)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = tiled_attention(
            query, key, value, scale=scale, spec=mask_spec(kind, options), q_offset=mask.q_offset,
            kv_offset=mask.kv_offset, key_padding=mask.key_padding, extra_mask=mask.model_mask,
            block_q=options["block_q"], block_k=options["block_k"],
        )  # (B, H, Tq, d)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"gqakit_{kind}_attention"
    return attention


def register_all() -> None:
    """Register every kind under `gqakit_<kind>`; idempotent."""
    for kind in KINDS:
        AttentionInterface.register(f"gqakit_{kind}", _make_attention(kind))
        AttentionMaskInterface.register(f"gqakit_{kind}", gqakit_mask)


def check_model(model) -> None:
    """Refuse, at `use()`, a model that gqakit attention would run wrongly: no AttentionInterface, ALiBi,
    or an encoder (bidirectional attention)."""
    name = type(model).__name__
    if not getattr(type(model), "_supports_attention_backend", False):
        raise AttentionOptionError(
            f"{name} does not route attention through transformers' AttentionInterface, so "
            "gqakit attention cannot be plugged in; use a model family that does (Llama, Mistral, Qwen2, ...)")
    config = model.config
    attn_config = getattr(config, "attn_config", None)
    if config.model_type in ("bloom", "mpt") or getattr(config, "alibi", False) or getattr(attn_config, "alibi", False):
        raise AttentionOptionError(f"{name} uses ALiBi position biases, which gqakit attention does not implement; "
                                   "keep its own attention (sdpa or eager)")
    if any(getattr(m, "is_causal", True) is False for m in model.modules()):
        raise AttentionOptionError(f"{name} is an encoder (bidirectional attention), and gqakit attention is "
                                   "causal; keep its own attention (sdpa or eager)")


def use(model, kind: str, **options):
    """Switch `model` to gqakit attention `kind` ('tiled', 'sliding' or 'sinks') in place; returns it."""
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
    from .cache import SinkCache

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
