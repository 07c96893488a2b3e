"""Many documents sampled at once from a start token: a hand-written decoding loop over a static KV cache.

`gqakit sample` and data-free calibration draw tens of thousands of tokens from a model, every row the same
length, no prompt but one start token, no row ending early. `generate()` with its growing `DynamicCache` pays,
at every step, a cache that is concatenated anew (a fresh allocation of every layer's keys and values, page
faults included where glibc returns freed memory eagerly, as convert-gqa's console script makes it), a growing
attention mask and its logits processors. This loop preallocates one `StaticCache` of `length` positions, feeds
each step's token at its `cache_position` and samples from the last position's logits alone; the rows are dealt
over one-threaded Python threads (`common.cpu_split`), each decoding its share through its own cache, so on a
shared machine a descheduled core delays its own rows instead of stalling every op's threads. The sampler is
`decode.streaming.sampling_probs` (temperature, then nucleus top-p; one inverse-CDF draw per row from the row's
own generator), with the `banned` tokens (the end of text, held back as `min_new_tokens` holds it back)
masked out first: the same distribution as `generate(do_sample=True, top_k=0, min_new_tokens=length)`.

`reference_tokens` is the slow, obviously-correct loop the tests compare with: the model's full forward over
the sequence so far at every step, no cache, sampled with the same generator draws.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gqakit.common.cpu_split import deal, run_split, split_count
from gqakit.decode.streaming import sampling_probs
from gqakit.hf.compat import cache_kwargs
from gqakit.hf.loading import end_token_ids

CACHES = ("static", "dynamic")
ROW_SEED = 1_000_003  # row r of seed s draws from a generator seeded s * ROW_SEED + r


def row_generators(seed: int, rows: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per row, seeded by the seed and the row's index alone: a row's draws do not depend on
    the batch it is drawn in, nor on how the batch is split over threads."""
    return [torch.Generator().manual_seed(seed * ROW_SEED + r) for r in rows]


def draw(logits: torch.Tensor, banned: Sequence[int], temperature: float, top_p: float,
         generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Next ids (B,) from logits (B, V): `banned` ids never, otherwise a temperature / top-p sample, row i drawn
    with generators[i] (`temperature` 0: argmax)."""
    logits = logits.float()
    if banned:  # out of place: the caller's logits stay as they were
        logits = logits.index_fill(-1, torch.tensor(list(banned), device=logits.device), float("-inf"))
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_p).cpu()  # (B, V)
    # inverse CDF: one uniform per row from its generator. torch.multinomial draws one exponential per token (a
    # 49,152-token vocabulary: 4.6 ms a row, a fifth of a SmolLM2 step on one core); this is a cumsum and a search.
    # In float64 u * total < total, and side="right" never lands on a token of probability 0 (banned, cut by top-p).
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).double()  # (B,)
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], side="right").squeeze(-1)
    return picks.to(logits.device)


def _make_cache(model, kind: str, length: int):
    if kind not in CACHES:
        raise ValueError(f"cache {kind!r} is not one of {', '.join(CACHES)}")
    from transformers import DynamicCache, StaticCache

    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache(config=model.config)


def _step(model, cache, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Logits (B, V) of one column of ids (B, 1) fed at cache position `position` (1,)."""
    out = model(input_ids=ids, position_ids=position.expand(ids.shape[0], 1), cache_position=position,
                **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def _decode(model, start: int, generators: list[torch.Generator], length: int, banned: list[int],
            temperature: float, top_p: float, cache: str, step, on_step) -> torch.Tensor:
    """(len(generators), length) ids: one row per generator, one token per step through one cache."""
    device, count = model.device, len(generators)
    out = torch.empty(count, length, dtype=torch.long, device=device)
    with torch.inference_mode():
        kv = _make_cache(model, cache, length)
        ids = torch.full((count, 1), start, dtype=torch.long, device=device)
        for t in range(length):
            token = draw(step(model, kv, ids, torch.tensor([t], device=device)), banned, temperature, top_p,
                         generators)
            out[:, t] = token
            ids = token[:, None]
            if on_step is not None:
                on_step(count)
    return out


def sample_tokens(model, start: int, count: int, length: int, *, temperature: float = 1.0, top_p: float = 1.0,
                  seed: int = 0, first_row: int = 0, banned: Sequence[int] | None = None, cache: str = "static",
                  compile: bool = False, split: int | None = None,
                  on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """(count, length) ids sampled after the token `start`, on the model's device: `length` steps of one token
    each (no row ends early: `banned`, by default the model's end tokens, are never drawn). Row i draws from
    its own generator (`row_generators(seed, first_row + i)`; the global RNG is untouched). `cache`: "static"
    (one preallocated `StaticCache`) or "dynamic"; `compile`: torch.compile the one-token step (a static cache,
    one thread). `split`: the rows are dealt over that many one-threaded Python threads, each decoding its
    share through its own cache (default: torch's intra-op threads on CPU, so a descheduled core stalls its own
    share only, not every matmul; 1: this thread, torch's threads). `on_step(rows)` after each step of a share,
    for a progress bar."""
    if compile and cache != "static":
        raise ValueError("compile=True needs cache='static' (fixed shapes); pass cache='static'")
    banned = end_token_ids(model) if banned is None else list(banned)
    generators = row_generators(seed, range(first_row, first_row + count))
    step = torch.compile(_step, dynamic=False) if compile else _step
    parts = deal([1.0] * count, 1 if compile else split or split_count(model.device))

    def share(rows: list[int]) -> torch.Tensor:
        return _decode(model, start, [generators[r] for r in rows], length, banned, temperature, top_p, cache,
                       step, on_step)

    out = torch.empty(count, length, dtype=torch.long, device=model.device)
    for rows, ids in zip(parts, run_split(share, parts)):
        out[rows] = ids
    return out


def reference_tokens(model, start: int, count: int, length: int, *, temperature: float = 1.0, top_p: float = 1.0,
                     seed: int = 0, first_row: int = 0, banned: Sequence[int] | None = None) -> torch.Tensor:
    """`sample_tokens` the slow way (for tests): the full forward over the sequence so far at every step."""
    banned = end_token_ids(model) if banned is None else list(banned)
    generators = row_generators(seed, range(first_row, first_row + count))
    seq = torch.full((count, 1), start, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        for _ in range(length):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1]
            seq = torch.cat([seq, draw(logits, banned, temperature, top_p, generators)[:, None]], dim=1)
    return seq[:, 1:]
