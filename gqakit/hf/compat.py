"""What changed within transformers 5.x, read from the running release: keyword names from its own signatures,
behaviour by its version.

transformers 5.24 renamed a model's `past_key_values` argument to `cache` (the old name warns that it goes in
5.40); earlier 5.x releases know only `past_key_values`. Every call of ours that hands a model a KV cache uses
`cache_kwargs`, so it runs without a deprecation warning on every release in our range. transformers 5.25 renamed
the outputs' `past_key_values` to `cache` too (the old attribute warns): `output_cache` reads either; and it
loads hub kernels by default, which `LOAD_KWARGS` declines.
"""
from __future__ import annotations

import functools
import inspect

# Keywords for every from_pretrained of ours. transformers 5.25 turned hub kernels on by default (`use_kernels`
# None -> True): on a GPU, loading and every train() / eval() switch then fetch RMSNorm, activation and RoPE kernels
# from the Hub and swap them in (no CPU entries, so nothing happens here). gqakit runs without the network and with
# the numerics its tests check, so it keeps transformers' own modules; 5.23 and 5.24 take the same keyword (default
# False there).
LOAD_KWARGS = {"use_kernels": False}


@functools.lru_cache(maxsize=16)
def transformers_before(version: str) -> bool:
    """Is the running transformers older than `version` (e.g. "5.25")?"""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release < Version(version).release


@functools.lru_cache(maxsize=64)
def _cache_keyword(cls: type) -> str:
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def cache_keyword(model) -> str:
    """The keyword `model(...)` and `model.generate(...)` take a KV cache by on this transformers release."""
    return _cache_keyword(type(model))


def cache_kwargs(model, cache) -> dict:
    """{keyword: cache} for `model(...)` and `model.generate(...)` on this transformers release."""
    return {cache_keyword(model): cache}


def output_cache(output):
    """The KV cache a model's forward returned: `output.cache` from transformers 5.25 on, else `past_key_values`."""
    return next((output[key] for key in ("cache", "past_key_values") if key in output), None)
