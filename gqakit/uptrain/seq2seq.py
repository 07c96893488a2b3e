"""Encoder-decoder uptraining (T5): what a batch of rows becomes for the model, as (keyword arguments, targets).

- `SpanCorruption`: each packed window of `seq_len` text tokens becomes T5's span-corruption pair
  (`gqakit.common.span_corruption`); the masks depend on the window's tokens and the recipe's seed only, so every
  process split, resume and evaluation of a window sees the same ones. The loop divides its loss sums by `seq_len`
  per window (`budget.tokens_per_step`); every corrupted window has the same target length L_t (it depends on
  seq_len alone), so the sums are scaled by seq_len / L_t and the loop's mean is the mean per target token.
- `InputTargetPairs` (`target_column:`): rows of `data.pairs`, an input and a target each; the loop divides by the
  step's real target-token count across every process (`targets`, a function of the rows each rank gets), so the
  mean is again per target token.
"""
from __future__ import annotations

import copy

import torch

from gqakit.common.errors import GqakitError
from gqakit.common.span_corruption import corrupt_rows, corrupted_lengths, sentinel_ids
from gqakit.uptrain.loss import IGNORE, INPUT_PAD


class SpanCorruption:
    """Windows (B, seq_len) -> (encoder input, decoder input, labels) of T5's span corruption."""

    counts_targets = False  # a constant per window: the loop's budget.tokens_per_step, the sums scaled to it

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

    def held_out(self) -> SpanCorruption:
        """The objective for held-out windows: their masks seeded 0 whatever the recipe's seed, as `gqakit eval
        ppl` seeds them, so runs with other seeds are scored on the same targets and eval ppl reproduces them."""
        scored = copy.copy(self)
        scored.seed = 0
        return scored

    def batch(self, seqs: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Packed sequences (B, seq_len + 1) -> (model keyword arguments, labels (B, L_t))."""
        inputs, labels = corrupt_rows(seqs[:, :-1], self.sentinels, self.eos, self.seed)
        start = labels.new_full((labels.shape[0], 1), self.start)
        return {"input_ids": inputs, "decoder_input_ids": torch.cat([start, labels[:, :-1]], dim=1)}, labels



class InputTargetPairs:
    """Rows (B, 2 seq_len) of `data.pairs` -> (model keyword arguments with the input's attention mask, labels)."""

    scale = 1.0
    counts_targets = True  # rows differ: the loop divides by `targets` of the step's rows

    def __init__(self, tokenizer, config: dict, seq_len: int):
        self.seq_len = seq_len
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.get("pad_token_id")
        self.start = config.get("decoder_start_token_id")
        if self.pad is None or self.start is None:
            raise GqakitError("the encoder-decoder's tokenizer and config.json name no pad token or no "
                              "decoder_start_token_id; add them to config.json")

    def batch(self, rows: torch.Tensor) -> tuple[dict, torch.Tensor]:
        inputs, labels = rows[:, : self.seq_len], rows[:, self.seq_len :]
        longest_input = int((inputs != INPUT_PAD).sum(1).max())
        longest_target = int((labels != IGNORE).sum(1).max())
        inputs, labels = inputs[:, :longest_input], labels[:, :longest_target]
        mask = inputs != INPUT_PAD
        start = labels.new_full((labels.shape[0], 1), self.start)
        decoder = torch.cat([start, labels[:, :-1]], dim=1)
        return {"input_ids": inputs.masked_fill(~mask, self.pad), "attention_mask": mask.long(),
                "decoder_input_ids": decoder.masked_fill(decoder == IGNORE, self.pad)}, labels

    def held_out(self) -> InputTargetPairs:
        """The objective for held-out rows: the same (nothing random)."""
        return self

    def targets(self, rows: torch.Tensor) -> int:
        """Target tokens of these rows (what their loss sums count)."""
        return int((rows[:, self.seq_len :] != IGNORE).sum())


Seq2SeqObjective = SpanCorruption | InputTargetPairs


def objective(tokenizer, config: dict, cfg) -> Seq2SeqObjective:
    """What an encoder-decoder's run trains on: the recipe's input/target rows, or span corruption."""
    if cfg.target_column is not None:
        return InputTargetPairs(tokenizer, config, cfg.seq_len)
    return SpanCorruption(tokenizer, config, cfg.seq_len, cfg.seed)
