"""The model-running path of the retrieval evaluations (`eval passkey`, `eval niah`): fit a prompt to a token
budget, then decode greedily. Both commands go through these two functions, so an option that changes how a prompt
is run (a KV-cache kind, say) is added once, here, and applies to both. No torch at import: the task generators
(`evaluate/needles.py`, read by the command line) use the prompt fitting."""
from __future__ import annotations

from collections.abc import Callable

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


def greedy_generator(model, tokenizer, new_tokens: int = 10) -> Callable[[str], str]:
    """`generate(prompt) -> continuation`: greedy decoding of `new_tokens` tokens with a DynamicCache."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device

    @torch.no_grad()
    def generate(prompt: str) -> str:
        ids = tokenizer(prompt, return_tensors="pt", verbose=False).input_ids.to(device)  # (1, T)
        cache = DynamicCache()
        logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits[0, -1]
        out: list[int] = []
        for step in range(new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if token == tokenizer.eos_token_id or step == new_tokens - 1:
                break
            step_ids = torch.tensor([[token]], device=device)
            logits = model(input_ids=step_ids, **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
        return tokenizer.decode(out, skip_special_tokens=True)

    return generate
