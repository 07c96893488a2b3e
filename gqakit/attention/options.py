"""The attention kinds' options checked against a model (`normalise_options`) and turned into mask patterns
(`mask_spec`). The kinds themselves, and which options each takes, are declared once in
`gqakit.attention.kinds` (torch-free, so that the command line reads them without loading torch).

Options live in `config.gqakit_attention`, a plain JSON dict that `save_pretrained` keeps, so
`from_pretrained(..., attn_implementation="gqakit_sliding")` works. The pattern options (`LAYERED`) may be one
value, a list of one per layer, and within a layer a list of one per query head: e.g.
`use(model, "sliding", window=[64, 128, [256] * 6 + [512] * 2], dilation=[1, 1, [1] * 6 + [2] * 2])`.
"""
from __future__ import annotations

import difflib
import functools

from gqakit.attention import patterns
from gqakit.attention.masks import AttentionOptionError, MaskSpec, int_field
from gqakit.attention.kinds import CONFIG_KEY, DEFAULTS, KINDS, LAYERED, OPTIONS, SPARSE_PATTERNS
from gqakit.common.errors import opt


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
            raise AttentionOptionError(f"attention kind 'sliding' needs a window; pass {opt('window', 'W')} (e.g. "
                                       "512; in Python also one per layer, or per layer one per head)")
    if kind == "sinks" and merged["window"] is None:
        merged["window"] = 1020
    if kind == "sparse" and merged["stride"] is None:
        raise AttentionOptionError("attention kind 'sparse' needs a stride; pass stride=l (about the square root of "
                                   "the sequence length, e.g. 128 for 16k tokens)")
    if "global_tokens" in merged:
        if isinstance(merged["global_tokens"], (int, str)):
            raise AttentionOptionError(f"global_tokens={merged['global_tokens']!r} must be a list of positions, "
                                       f"e.g. global_tokens=[0]")
        merged["global_tokens"] = tuple(int_field("global_tokens", g) for g in merged["global_tokens"])
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


def stored_options(config, kind: str) -> dict:
    """The options `use()` stored on the config, or the kind's defaults (stored) for a model loaded with
    `from_pretrained(..., attn_implementation="gqakit_<kind>")`."""
    stored = getattr(config, CONFIG_KEY, None) or {}
    if stored.get("kind") == kind:
        return stored
    options = normalise_options(kind, {}, config)  # defaults for from_pretrained(attn_implementation=...)
    setattr(config, CONFIG_KEY, options)
    return options
