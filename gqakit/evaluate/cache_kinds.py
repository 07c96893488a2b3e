"""The KV caches that `gqakit eval ppl | passkey | niah --kv-cache` score under: the vocabulary alone, torch-free, so
that the options (options.py), the caches (kvcache.py) and the decoding loop (generation.py) read it without
importing one another."""
from __future__ import annotations

KV_CACHES = ("dense", "fp8", "int4", "int2")  # kvcache.make_cache builds each through transformers' cache classes
DEFAULT_KV_CHUNK = 128  # tokens per forward while a window or prompt is fed through the cache
