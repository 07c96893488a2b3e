"""T5's span corruption (Raffel et al. 2020, sec. 3.1.4): the encoder-decoder objective of pretraining, uptraining
and evaluation on plain text.

A window of L tokens keeps round(L * density) of them as noise (at least 1, at most L - 1), split into
round(noise / mean_span) spans (at least 1); the remaining tokens form as many non-noise spans, and the two
alternate, starting with non-noise. Span lengths are a uniformly random composition of each total (every span at
least one token). The encoder input is the window with each noise span replaced by one sentinel, then EOS; the
target is each sentinel followed by the span it replaced, then EOS:

    window   The  quick  brown  fox  jumps  over  the  lazy  dog
    input    The  <X>  fox  jumps  <Y>  lazy  dog  </s>
    target   <X>  quick  brown  <Y>  over  the  </s>

Both lengths depend on L alone, so a batch of equal windows corrupts into a rectangular batch. A window's
corruption is a function of its tokens and a seed (`corrupt_rows`), so every process, resume and evaluation of
the same window sees the same masks. Pure tensor maths: no model, no tokenizer beyond the sentinel lookup.
"""
from __future__ import annotations

import re
import zlib

import torch

from gqakit.common.errors import GqakitError

DENSITY = 0.15  # T5's noise density
MEAN_SPAN = 3.0  # T5's mean noise span length
SENTINEL = re.compile(r"<extra_id_(\d+)>")


def span_counts(length: int, density: float = DENSITY, mean_span: float = MEAN_SPAN) -> tuple[int, int]:
    """(noise tokens, noise spans) of a window of `length` tokens."""
    if length < 2:
        raise ValueError(f"span corruption needs windows of at least 2 tokens, got {length}")
    noise = min(max(round(length * density), 1), length - 1)
    spans = min(max(round(noise / mean_span), 1), noise, length - noise)
    return noise, spans


def corrupted_lengths(length: int, density: float = DENSITY, mean_span: float = MEAN_SPAN) -> tuple[int, int]:
    """(encoder input, target) lengths of a corrupted window, EOS included."""
    noise, spans = span_counts(length, density, mean_span)
    return length - noise + spans + 1, noise + spans + 1


def _composition(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """`parts` positive integers summing to `total`, uniformly over all such compositions."""
    cuts = (torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).sort().values.tolist()
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def corrupt(tokens: torch.Tensor, sentinels: list[int], eos: int, generator: torch.Generator,
            density: float = DENSITY, mean_span: float = MEAN_SPAN) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoder input, target) of one 1-D window; sentinels[i] marks the i-th noise span."""
    length = tokens.numel()
    noise, spans = span_counts(length, density, mean_span)
    if spans > len(sentinels):
        raise GqakitError(f"a window of {length} tokens has {spans} noise spans but the tokenizer has only "
                          f"{len(sentinels)} sentinel tokens; use shorter windows (seq_len) or a tokenizer with more "
                          "<extra_id_N> tokens")
    noise_lengths = _composition(noise, spans, generator)
    keep_lengths = _composition(length - noise, spans, generator)
    inputs, targets, at = [], [], 0
    for i, (keep, drop) in enumerate(zip(keep_lengths, noise_lengths)):
        inputs += [tokens[at : at + keep], tokens.new_tensor([sentinels[i]])]
        targets += [tokens.new_tensor([sentinels[i]]), tokens[at + keep : at + keep + drop]]
        at += keep + drop
    end = tokens.new_tensor([eos])
    return torch.cat([*inputs, end]), torch.cat([*targets, end])


def corrupt_rows(rows: torch.Tensor, sentinels: list[int], eos: int, seed: int = 0,
                 density: float = DENSITY, mean_span: float = MEAN_SPAN) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt each row of (B, L) tokens, each with a generator seeded by (seed, the row's tokens): (B, Li), (B, Lt)."""
    pairs = []
    for row in rows.cpu():
        key = zlib.crc32(row.numpy().tobytes(), seed & 0xFFFFFFFF)
        pairs.append(corrupt(row, sentinels, eos, torch.Generator().manual_seed(key), density, mean_span))
    inputs = torch.stack([p[0] for p in pairs]).to(rows.device)
    targets = torch.stack([p[1] for p in pairs]).to(rows.device)
    return inputs, targets


def sentinel_ids(tokenizer) -> list[int]:
    """The ids of the tokenizer's `<extra_id_N>` tokens, in order of N (T5's sentinels); a one-line error if none."""
    found = {}
    for token, index in tokenizer.get_vocab().items():
        if m := SENTINEL.fullmatch(token):
            found[int(m[1])] = index
    count = 0
    while count in found:
        count += 1
    if count == 0:
        raise GqakitError("the tokenizer has no <extra_id_0>, <extra_id_1>, ... sentinel tokens, which T5's span "
                          "corruption needs; use the tokenizer the encoder-decoder was pretrained with")
    return [found[i] for i in range(count)]
