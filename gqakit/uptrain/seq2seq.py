"""Encoder-decoder uptraining (T5): each packed window of `seq_len` text tokens becomes T5's span-corruption pair
(`gqakit.common.span_corruption`), the pair its model learns from; the masks depend on the window's tokens and the
recipe's seed only, so every process split, resume and evaluation of a window sees the same ones.

The loop sums losses over targets and divides by `seq_len` per window (`budget.tokens_per_step`); every corrupted
window has the same target length L_t (it depends on seq_len alone), so the sums are scaled by seq_len / L_t here
and the loop's mean is the mean loss per target token, exactly as for a decoder.
"""
from __future__ import annotations

import torch

from gqakit.common.errors import GqakitError
from gqakit.common.span_corruption import corrupt_rows, corrupted_lengths, sentinel_ids


class SpanCorruption:
    """Windows (B, seq_len) -> (encoder input, decoder input, labels) of T5's span corruption."""

    def __init__(self, tokenizer, config: dict, seq_len: int, seed: int):
        self.sentinels = sentinel_ids(tokenizer)
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.get("eos_token_id")
        self.start = config.get("decoder_start_token_id")
        if self.eos is None or self.start is None:
            raise GqakitError("the encoder-decoder's tokenizer and config.json name no EOS token or no "
                              "decoder_start_token_id; add them to config.json")
        self.seed = seed
        self.input_len, self.target_len = corrupted_lengths(seq_len)
        self.scale = seq_len / self.target_len  # target-token sums -> "per window of seq_len" sums

    def pair(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, labels = corrupt_rows(windows, self.sentinels, self.eos, self.seed)
        start = labels.new_full((labels.shape[0], 1), self.start)
        return inputs, torch.cat([start, labels[:, :-1]], dim=1), labels


def check_seq2seq_recipe(cfg, arch: str) -> None:
    """Refuse, in one line each, what encoder-decoder uptraining does not do."""
    if cfg.context_parallel > 1:
        raise GqakitError(f"context_parallel={cfg.context_parallel} splits one decoder sequence over processes, but "
                          f"{arch} is an encoder-decoder; use context_parallel=1")
    if cfg.attention != "default":
        raise GqakitError(f"attention={cfg.attention}: the encoder-decoder {arch} adds T5's relative position bias "
                          "inside attention, which gqakit attention does not implement; use attention=default")
