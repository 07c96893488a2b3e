"""Generate far past a model's trained context with constant memory: a small decoding loop over `SinkCache`.

Why not `model.generate(past_key_values=SinkCache(...))`? That works and is tested, but `generate()`
numbers tokens with absolute, ever-growing positions (fp32 RoPE loses precision far out) and keeps an
ever-growing attention mask, and streaming its tokens needs a streamer thread. This loop owns the
positions instead: it numbers tokens from `SinkCache.position_ids()` and calls `SinkCache.rebase()`
every `rebase_every` tokens, so positions stay below 2 (S + W) + chunk however long the stream; it
passes a 2D mask only while padding can still be in view; it prefills long prompts in chunks; and it
yields each token as soon as it is chosen. Memory: S + W cached positions per layer, plus one chunk.

    for piece in streaming_generate(model, tokenizer, ids, 20_000, sinks=4, window=1020):
        print(piece, end="", flush=True)
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from gqakit.decode.cache import SinkCache
from gqakit.decode.rope import positions_end
from gqakit.hf.compat import cache_kwargs
from gqakit.hf.loading import end_token_ids


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities (B, V) fp32 of a temperature / nucleus (top-p) sample from logits (B, V)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the more likely ones already reach top_p (the most likely always stays)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def sample_next(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): argmax, or a temperature / nucleus (top-p) sample."""
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _check(max_new_tokens: int, chunk_size: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}; e.g. chunk_size=256")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use do_sample=False for greedy")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def positions_needed(prompt: int, max_new_tokens: int, sinks: int, window: int, chunk_size: int = 256,
                     rebase_every: int | None = None) -> int:
    """How many positions (the largest position id + 1) `stream_tokens` feeds a model for an unpadded prompt of
    `prompt` tokens (a padded row is fed lower ones): `_forward`'s rebasing replayed, chunk by chunk, then token by
    token until the first rebase while decoding, after which positions cycle between S + W and the limit."""
    capacity = sinks + window
    limit = capacity + (capacity if rebase_every is None else rebase_every)
    offset = top = 0  # offset: tokens a full row has evicted at its last rebase (SinkCache.rebase)
    for start in range(0, prompt, chunk_size):
        q = min(chunk_size, prompt - start)
        if start + q - 1 - offset >= limit:
            offset = max(offset, start - capacity)
        top = max(top, start + q - offset)
    for step in range(max_new_tokens - 1):  # the last token is not fed
        start = prompt + step
        if start - offset >= limit:  # rebased: this token sits at S + W, each later one a position further
            return max(top, capacity + 1, min(limit, capacity + max_new_tokens - 1 - step))
        top = max(top, start + 1 - offset)
    return top


def position_overrun(model, prompt: int, max_new_tokens: int, sinks: int, window: int, chunk_size: int = 256,
                     rebase_every: int | None = None) -> tuple[int, int] | None:
    """(positions needed, the model's end) where the stream would feed positions past a table's end (learned
    positions, or a precomputed RoPE table as GPT-J's), else None."""
    end = positions_end(model)
    needed = positions_needed(prompt, max_new_tokens, sinks, window, chunk_size, rebase_every)
    return (needed, end) if end is not None and needed > end else None


def _forward(model, cache: SinkCache, ids: torch.Tensor, limit: int) -> torch.Tensor:
    """Feed ids (B, q) at their cache positions; return the last column's logits (B, V)."""
    q = ids.shape[1]
    positions = cache.position_ids(q)
    if int(positions.max()) >= limit:  # keep RoPE angles small: move the windows back to S
        cache.rebase()
        positions = cache.position_ids(q)
    mask = cache.padding_mask(q)
    out = model(input_ids=ids, attention_mask=None if mask is None else mask.to(ids.device),
                position_ids=positions.to(ids.device), **cache_kwargs(model, cache), use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


@torch.no_grad()
def stream_tokens(model, input_ids: torch.Tensor, max_new_tokens: int, *, sinks: int = 4,
                  window: int = 1020, attention_mask: torch.Tensor | None = None, chunk_size: int = 256,
                  do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                  eos_token_id: int | list[int] | None = None, rebase_every: int | None = None,
                  cache: SinkCache | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B,) one step at a time, with a `SinkCache(sinks, window)`.

    The prompt `input_ids` (B, T) may be left-padded (give `attention_mask`) and longer than
    sinks + window: it is fed `chunk_size` columns at a time. A row that produced an `eos_token_id` (one id or
    a list) keeps yielding it; the loop ends after `max_new_tokens` steps or when every row has ended.
    Sampling is seeded by `seed` (a private generator; the global RNG is untouched). Pass `cache`
    to inspect it (it must be fresh and built for this batch, with rope=model).
    """
    _check(max_new_tokens, chunk_size, temperature, top_p)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, length>0), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if cache is None:  # RoPE is read only where keys are re-rotated: sinks, or a window the sequence outgrows
        rotates = sinks > 0 or input_ids.shape[1] + max_new_tokens > sinks + window
        cache = SinkCache(sinks, window, rope=model if rotates else None, attention_mask=attention_mask)
    capacity = cache.sinks + cache.window
    limit = capacity + (rebase_every if rebase_every is not None else capacity)
    over = position_overrun(model, input_ids.shape[1], max_new_tokens, cache.sinks, cache.window, chunk_size,
                            rebase_every)
    if over is not None:
        raise ValueError(f"streaming feeds positions up to {over[0] - 1} but {type(model).__name__}'s positions end at "
                         f"{over[1]}; keep fewer sinks + window, or a smaller chunk_size or rebase_every")
    generator = torch.Generator().manual_seed(seed)

    for start in range(0, input_ids.shape[1], chunk_size):
        logits = _forward(model, cache, input_ids[:, start:start + chunk_size], limit)
    ended = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    ends = torch.tensor([] if eos_token_id is None else eos_token_id, dtype=torch.long,
                        device=input_ids.device).reshape(-1)
    last = torch.full_like(ended, -1, dtype=torch.long)  # the end id each ended row repeats
    for step in range(max_new_tokens):
        token = sample_next(logits, do_sample, temperature, top_p, generator)
        if ends.numel():
            token = torch.where(ended, last, token)
            newly = ~ended & torch.isin(token, ends)
            last = torch.where(newly, token, last)
            ended |= newly
        yield token
        if bool(ended.all()) or step == max_new_tokens - 1:
            return
        logits = _forward(model, cache, token[:, None], limit)


class _Detokenizer:
    """Incremental decoding: text deltas that never split a multi-byte character or drop a space.

    Decodes a short trailing context with and without the new tokens and emits the difference
    (constant work per token, however long the stream).
    """

    def __init__(self, tokenizer, context: int = 8):
        self.tokenizer, self.context = tokenizer, context
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self.prefix, self.read = max(self.read - self.context, 0), len(self.ids)
        if self.prefix > 4 * self.context:  # forget what can no longer change
            self.ids = self.ids[self.prefix:]
            self.read -= self.prefix
            self.prefix = 0
        return after[len(before):]


def streaming_generate(model, tokenizer, prompt_ids: torch.Tensor, max_new_tokens: int, sinks: int = 4,
                       window: int = 1020, **kwargs) -> Iterator[str]:
    """Yield text pieces of one stream (batch 1) as they are produced; see `stream_tokens` for kwargs.

    Stops at the model's end tokens (`end_token_ids`: the generation config's, as `model.generate` reads them);
    pass `eos_token_id=None` to run all `max_new_tokens`.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None, :]
    if prompt_ids.shape[0] != 1:
        raise ValueError(f"streaming_generate streams one text; got batch {prompt_ids.shape[0]} "
                         "(use stream_tokens for batches)")
    kwargs.setdefault("eos_token_id", end_token_ids(model, tokenizer) or None)
    detok = _Detokenizer(tokenizer)
    for token in stream_tokens(model, prompt_ids, max_new_tokens, sinks=sinks, window=window, **kwargs):
        piece = detok.push(int(token[0]))
        if piece:
            yield piece
