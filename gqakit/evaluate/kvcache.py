"""Perplexity under a quantized KV cache, through transformers' own cache classes (`eval ppl --kv-cache`).

Each window is fed through a fresh cache in chunks of `chunk` tokens, so that every token after the first chunk
attends to keys and values read back from the cache (quantized, for fp8 / int4 / int2), as in decoding:

- dense: `DynamicCache` (K and V at the compute dtype); scores equal one plain forward per window;
- fp8: `QuantizedCache(backend="fp8")`, float8_e4m3fn with one scale per tensor, frozen at the first update;
- int4 / int2: `QuantizedCache(backend="quanto")` (optimum-quanto), KIVI-style: keys per channel, values per token,
  group-wise (q_group_size 64) integers, the most recent tokens (up to residual_length 128) at full precision.

`held_bytes(cache)` counts what a cache actually holds (see its docstring); the report's bytes per token is that
total over every layer divided by the tokens in the cache, measured on the first full-length window. Fed in chunks
of the residual's length (128, the default chunk), int4 / int2 quantize everything at each chunk, so after the
window (a multiple of 128 tokens, as the defaults' 1,024 and 2,048 are) their residual is empty: that figure is
the quantized cache alone. Decoding refills the residual with up to 127 full-precision tokens before it is
quantized again, so the first window is also followed by one residual's length of single-token steps
(`decoding_bytes`): the mean and the most it holds per token over them, the bytes a decoding user holds (for dense
and fp8, which keep no residual, the same figure).
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

from gqakit.common.errors import GqakitError, opt
from gqakit.evaluate.cache_kinds import DEFAULT_KV_CHUNK as DEFAULT_CHUNK, KV_CACHES  # noqa: F401 (one declaration)
from gqakit.hf.compat import cache_kwargs

# KIVI (arXiv 2402.02750): keys quantized per channel (quanto's axis -1: each group is 64 tokens of one channel),
# values per token (axis 0: each group is 64 consecutive values of one head's cache, one token at head_dim 64 but
# two at head_dim 32: quanto groups the flattened tensor); groups of 64, the last 128 tokens kept whole.
# transformers' defaults quantize keys per token too (axis 0), which an outlier channel ruins (checked here: 20x the
# error on the other channels of a key with one channel 100x larger).
QUANTO = {"axis_key": -1, "axis_value": 0, "q_group_size": 64, "residual_length": 128}
# A latent (DeepseekV3) cache holds the latent in the key slot and the RoPE key in the value slot: both per channel
# (the RoPE key is a key, with a key's outlier channels; per token, its 16-value rows would share groups of 4 tokens).
LATENT_AXIS_VALUE = -1
GROUP = QUANTO["q_group_size"]
EXTRA = 'pip install "gqakit[kvquant]"'


def quanto_available() -> bool:
    try:
        return importlib.util.find_spec("optimum.quanto") is not None
    except ModuleNotFoundError:  # no `optimum` at all
        return False


def check_backend(kind: str) -> None:
    """One line when `kind` needs a backend that is not installed."""
    if kind in ("int4", "int2") and not quanto_available():
        raise GqakitError(f"{opt('kv_cache', kind)} quantizes with optimum-quanto, which is not installed; "
                          f"{EXTRA}")


def check_options(kind: str | None, chunk: int | None, attention: str | None) -> None:
    """The one-line refusals of `--kv-cache` / `--kv-chunk` shared by `eval ppl | passkey | niah`: a chunk without a
    cache or below 1, a bounded attention window (whose tokens a full cache would hold but never read), a backend
    that is not installed."""
    from gqakit.attention.kinds import LONG_CONTEXT

    if chunk is not None and kind is None:
        raise GqakitError(f"{opt('kv_chunk')} only applies with {opt('kv_cache')}; drop it or choose a cache")
    if chunk is not None and chunk < 1:
        raise GqakitError(f"{opt('kv_chunk')} must be a positive number of tokens, got {chunk}")
    if chunk is not None and kind in ("int4", "int2") and chunk % GROUP:
        raise GqakitError(f"{opt('kv_chunk', chunk)}: {opt('kv_cache', kind)} quantizes each channel's keys in groups "
                          f"of {GROUP} tokens, which chunks of {chunk} would mix across heads; use a multiple of "
                          f"{GROUP} (the default, 128, is the full-precision residual's length)")
    if kind is None:
        return
    if attention in LONG_CONTEXT:
        raise GqakitError(f"{opt('kv_cache', kind)} keeps every token in a full transformers cache, which "
                          f"{opt('attention', attention)}'s bounded window does not read; drop one of them")
    check_backend(kind)


@contextlib.contextmanager
def whole_groups(kind: str, tokens: int, fix: str):
    """Turn optimum-quanto's refusal of K/V that its groups do not tile (`tokens` positions in the cache when it
    quantized) into one line that ends with `fix`, the caller's options to change."""
    try:
        yield
    except ValueError as e:
        if "Group size" not in str(e):
            raise
        raise GqakitError(f"{opt('kv_cache', kind)}: optimum-quanto quantizes K/V in groups of "
                          f"{QUANTO['q_group_size']} values, which {tokens} tokens of this model's K/V do not "
                          f"fill ({e}); {fix}") from None


def settings(kind: str) -> dict:
    """What the report records about the cache: its class, backend and quantization settings."""
    if kind == "dense":
        return {"class": "DynamicCache"}
    if kind == "fp8":
        return {"class": "QuantizedCache", "backend": "fp8", "dtype": "float8_e4m3fn", "scale": "per tensor"}
    return {"class": "QuantizedCache", "backend": "quanto", "nbits": int(kind[3:]), **QUANTO,
            "latent_axis_value": LATENT_AXIS_VALUE, "fed": "in whole groups of tokens (kvcache.feed_pieces)"}


def feed_pieces(length: int, chunk: int, kind: str) -> list[tuple[int, int]]:
    """The [start, end) pieces a `length`-token window or prompt is fed in: chunks of `chunk`, except that for int4 /
    int2 every quantization covers whole groups of tokens. transformers' QuantizedCache quantizes the first piece,
    then everything cached each time its full-precision residual reaches 128 tokens, and optimum-quanto groups each
    channel's keys over the flattened (head, token) axis: a count of tokens that is not a multiple of 64 mixes two
    heads' keys in one group. So the first piece is a multiple of 64 tokens, and a piece that fills the residual is
    cut back to leave whole groups (the rest, under 64 tokens, follows into the residual). Decoding one token at a
    time then quantizes 128 tokens at each flush. Raises GqakitError for a window of fewer than 64 tokens."""
    if kind not in ("int4", "int2"):
        return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]
    if length < GROUP:
        raise GqakitError(f"{opt('kv_cache', kind)} quantizes a window's first tokens at once, in groups of {GROUP} "
                          f"tokens, and this window or prompt holds {length}; use longer windows or prompts")
    residual_cap = QUANTO["residual_length"]
    first = min(chunk, length // GROUP * GROUP)
    pieces, at, residual = [(0, first)], first, 0
    while at < length:
        n = min(chunk, length - at)
        if residual + n >= residual_cap and (residual + n) % GROUP:  # this piece would quantize a partial group
            n = (residual + n) // GROUP * GROUP - residual
        pieces.append((at, at + n))
        at, residual = at + n, 0 if residual + n >= residual_cap else residual + n
    return pieces


def report_fields(kind: str | None, chunk: int | None) -> dict:
    """The report's cache fields, the same in `eval ppl | passkey | niah`: kv_cache ("none" without one), its
    settings (JSON only) and kv_chunk (None without one)."""
    return {"kv_cache": kind or "none", "kv_cache_settings": settings(kind) if kind else {},
            "kv_chunk": (chunk or DEFAULT_CHUNK) if kind else None}


def make_cache(kind: str, config):
    """A fresh, empty cache of `kind` for a model with `config`."""
    from transformers import DynamicCache, QuantizedCache

    if kind == "dense":
        return DynamicCache(config=config)
    check_backend(kind)
    try:
        if kind == "fp8":
            return QuantizedCache(backend="fp8", config=config)
        from gqakit.hf.architectures.latent import is_latent

        axes = {"axis_value": LATENT_AXIS_VALUE} if is_latent(config) else {}
        return QuantizedCache(backend="quanto", config=config, nbits=int(kind[3:]), **{**QUANTO, **axes})
    except ValueError as e:  # e.g. sliding-window layers: QuantizedCache holds full attention only
        raise GqakitError(f"{opt('kv_cache', kind)}: transformers' QuantizedCache refuses this model: "
                          f"{str(e).splitlines()[0]}; use {opt('kv_cache', 'dense')}") from None


def _tensors(obj, seen: set) -> int:
    """Bytes of every tensor reachable from `obj` (tensor subclasses by their inner tensors, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):  # e.g. quanto's packed tensors
            names, _ = obj.__tensor_flatten__()
            return sum(_tensors(getattr(obj, name), seen) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensors(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensors(x, seen) for x in obj.values())
    return 0


def held_bytes(cache) -> int:
    """Bytes held by every layer of `cache`: each tensor attribute of a layer, quantized data, scales, zero points
    (shifts) and the full-precision residual included; for a dense cache, its K and V tensors."""
    seen: set = set()
    return sum(_tensors(vars(layer), seen) for layer in cache.layers)


def residual_length(kind: str) -> int:
    """Tokens a `kind` cache keeps at full precision before quantizing them (0: none kept)."""
    return QUANTO["residual_length"] if kind in ("int4", "int2") else 0


@torch.no_grad()
def decoding_bytes(model, cache, length: int, kind: str, token: torch.Tensor) -> tuple[float, float]:
    """(mean, max) bytes per token `cache` holds over the next residual_length(kind) single-token steps after
    `length` cached positions (at least one step), as decoding adds them; `token` (1, 1) is fed at each, at the
    window's last position (bytes depend on neither, and a model with learned positions, GPT-2 or OPT, has none past
    a window that fills its context)."""
    held, position = [], torch.full_like(token, length - 1)
    for step in range(max(1, residual_length(kind))):
        with whole_groups(kind, length + step + 1, "choose the window length as for the window itself"):
            model(input_ids=token, position_ids=position, **cache_kwargs(model, cache), use_cache=True,
                  logits_to_keep=1)
        held.append(held_bytes(cache) / (length + step + 1))
    return sum(held) / len(held), max(held)


@torch.no_grad()
def chunked_window_nll(model, window: torch.Tensor, targets_from: int, chunk: int, kind: str,
                       decoding: bool = False) -> tuple[float, int, float, tuple[float, float] | None]:
    """(summed NLL of window[0, targets_from:], its token count, bytes held per token after it, and with
    `decoding` the (mean, max) bytes per token over the decoding steps that follow it, `decoding_bytes`) of a
    (1, L) window fed through a fresh `kind` cache in chunks of `chunk` tokens; column j is predicted by column
    j - 1's logits."""
    length = window.shape[1]
    cache = make_cache(kind, model.config)
    total = 0.0
    for start, end in feed_pieces(length, chunk, kind):
        first = max(start, targets_from - 1)  # the first column whose logits this chunk must keep
        keep = end - first if first < min(end, length - 1) else 1
        fix = (f"choose {opt('max_length')}, {opt('max_tokens')} and {opt('kv_chunk')} so that every chunk and "
               f"window ends on a multiple")
        with whole_groups(kind, end, fix):
            logits = model(input_ids=window[:, start:end], **cache_kwargs(model, cache), use_cache=True,
                           logits_to_keep=keep).logits[0].float()  # (keep, V)
        if first < min(end, length - 1):
            last = min(end, length - 1)  # the window's last column predicts nothing inside it
            logp = torch.log_softmax(logits[: last - first], dim=-1)
            total -= logp.gather(-1, window[0, first + 1 : last + 1, None]).sum().item()
    after = held_bytes(cache) / length
    return (total, length - targets_from, after,
            decoding_bytes(model, cache, length, kind, window[:, -1:]) if decoding else None)
