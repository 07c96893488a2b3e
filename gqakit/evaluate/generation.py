"""The model-running path of the retrieval evaluations (`eval passkey`, `eval niah`): fit a prompt to a token
budget, then decode greedily. Both commands go through these two functions, so an option that changes how a prompt
is run (a KV-cache kind, say) is added once, here, and applies to both. No torch at import: the task generators
(`evaluate/needles.py`, read by the command line) use the prompt fitting."""
from __future__ import annotations

from collections.abc import Callable

from gqakit.common.errors import opt
from gqakit.evaluate.cache_kinds import DEFAULT_KV_CHUNK
from gqakit.hf.compat import cache_kwargs


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` with the tokenizer's default special tokens (as the model will see the prompt)."""
    return len(tokenizer(text, verbose=False).input_ids)


def longest_fit(fit: Callable[[int], tuple[str, int]], length: int, fixed: int,
                per_unit: float) -> tuple[int, str, int]:
    """(units, prompt, tokens): the most filler units whose prompt `fit(units) -> (prompt, tokens)` holds at most
    `length` tokens (0 units when even the bare prompt does not fit; the caller refuses that). `fixed` is the bare
    prompt's token count and `per_unit` a first guess of tokens per unit."""
    units = max(0, int((length - fixed) / per_unit))
    prompt, n = fit(units)
    for _ in range(8):  # secant steps at this size's own tokens per unit: a few tokenisations, not thousands
        if units > 0 and n > fixed:
            per_unit = max(1.0, (n - fixed) / units)
        step = int((length - n) / per_unit)
        if step == 0 or units + step < 0:
            break
        units += step
        prompt, n = fit(units)
    while n > length and units > 0:  # the estimate overshot: drop units
        units -= 1
        prompt, n = fit(units)
    while True:  # grow while the next unit still fits
        bigger, m = fit(units + 1)
        if m > length:
            break
        units, prompt, n = units + 1, bigger, m
    return units, prompt, n


class GreedyDecoder:
    """`decoder(prompt, new_tokens=None) -> continuation`: greedy decoding of `new_tokens` tokens (the decoder's own
    count by default), stopping at EOS.

    Without `kv_cache` the prompt is one forward into a DynamicCache. With `kv_cache` (dense, fp8, int4, int2:
    `kvcache.make_cache`) the prompt is prefilled into a fresh cache of that kind in chunks of `kv_chunk` tokens, so
    that every later prompt token and every generated token reads the past back from that (quantized) cache; then
    `held_per_token` is the bytes the cache held after the prompt (`kvcache.held_bytes`) over the prompt's tokens."""

    def __init__(self, model, tokenizer, new_tokens: int = 10, kv_cache: str | None = None,
                 kv_chunk: int | None = None):
        self.model, self.tokenizer, self.new_tokens = model, tokenizer, new_tokens
        self.kv_cache, self.kv_chunk = kv_cache, kv_chunk or DEFAULT_KV_CHUNK
        self.held_per_token: float | None = None  # of the last prompt, with a kv_cache

    def _forward(self, ids, cache, tokens: int):
        """The last position's logits of `ids` (1, t) fed into `cache`, which then holds `tokens` positions."""
        import contextlib

        from gqakit.evaluate.kvcache import whole_groups

        # optimum-quanto quantizes the first piece, then the whole cache each time 128 tokens have gathered at full
        # precision: the prompt is fed in whole groups of tokens (kvcache.feed_pieces), so this guards the rest
        fix = f"use {opt('kv_chunk')} 128 (a multiple of 64) and prompts of at least 64 tokens"
        guard = whole_groups(self.kv_cache, tokens, fix) if self.kv_cache else contextlib.nullcontext()
        with guard:
            return self.model(input_ids=ids, **cache_kwargs(self.model, cache), use_cache=True,
                              logits_to_keep=1).logits[0, -1]

    def __call__(self, prompt: str, new_tokens: int | None = None) -> str:
        import torch
        from transformers import DynamicCache

        from gqakit.evaluate.kvcache import feed_pieces, held_bytes, make_cache
        from gqakit.hf.loading import end_token_ids

        new_tokens = new_tokens or self.new_tokens
        device = next(self.model.parameters()).device
        with torch.no_grad():
            ids = self.tokenizer(prompt, return_tensors="pt", verbose=False).input_ids.to(device)  # (1, T)
            length = ids.shape[1]
            if self.kv_cache is None:
                cache = DynamicCache()
                logits = self._forward(ids, cache, length)
            else:
                cache = make_cache(self.kv_cache, self.model.config)
                for start, end in feed_pieces(length, self.kv_chunk, self.kv_cache):
                    logits = self._forward(ids[:, start:end], cache, end)
                self.held_per_token = held_bytes(cache) / length
            out: list[int] = []
            ends = set(end_token_ids(self.model, self.tokenizer))  # the model's own, as model.generate reads them
            for step in range(new_tokens):
                token = int(logits.argmax())
                out.append(token)
                if token in ends or step == new_tokens - 1:
                    break
                logits = self._forward(torch.tensor([[token]], device=device), cache, length + step + 1)
        return self.tokenizer.decode(out, skip_special_tokens=True)


def held_after(generate) -> dict:
    """{"kv_bytes_held_per_token": ...} of the prompt `generate` last ran, when it measures it (a `GreedyDecoder`
    with a kv_cache); {} otherwise (no cache option, a fake model in tests)."""
    held = getattr(generate, "held_per_token", None)
    return {} if held is None else {"kv_bytes_held_per_token": held}


def mean_held(results: list[dict], key: Callable[[dict], object] = lambda r: None) -> dict:
    """The mean bytes per token held after the prompt per `key(result)` (by default one figure, under None); {}
    when nothing was measured."""
    groups: dict = {}
    for r in results:
        if "kv_bytes_held_per_token" in r:
            groups.setdefault(key(r), []).append(r["kv_bytes_held_per_token"])
    return {k: sum(v) / len(v) for k, v in groups.items()}


def held_heading(kv_cache: str | None) -> str:
    """The table's row name for the bytes held (the wording of `eval ppl`'s column)."""
    return f"KV-cache bytes/token held ({kv_cache} cache, measured)"


def held_note(kv_cache: str, kv_chunk: int | None) -> str:
    """The line under the table that says how the prompts ran and how the bytes held were measured."""

    return (f"(each prompt prefilled into a fresh {kv_cache} cache, {kv_chunk or DEFAULT_KV_CHUNK} tokens per "
            f"forward, then decoded greedily from it; bytes held = every tensor of every cache layer after the prompt "
            f"/ its tokens, mean over the prompts)")


def greedy_generator(model, tokenizer, new_tokens: int = 10, kv_cache: str | None = None,
                     kv_chunk: int | None = None) -> GreedyDecoder:
    """`generate(prompt) -> continuation`: greedy decoding of `new_tokens` tokens (`GreedyDecoder`)."""
    return GreedyDecoder(model, tokenizer, new_tokens, kv_cache, kv_chunk)
