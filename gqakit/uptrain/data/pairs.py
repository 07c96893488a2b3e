"""Input/target pairs for encoder-decoder uptraining (`target_column:`): each row of a .jsonl / .json / .parquet
file gives the encoder input (`text_column`) and the decoder target (`target_column`).

Both sides are tokenised without special tokens and end in EOS, as in T5; a side longer than `seq_len` is
refused, never cut short. A row is stored as one (2 seq_len) row of a tensor: the input padded with -1, then the
target padded with IGNORE, so the loop's batching, ordering and resume treat pairs as they treat windows
(`uptrain.seq2seq.InputTargetPairs` turns a batch of them into the model's arguments). Without `eval_data`,
`eval_fraction` of the rows (at least one, at most `eval_sequences`) are held out, picked by `seed`. A pair counts
as seq_len tokens of the budget (`alpha`, `tokens`): positions, not its own length.
"""
from __future__ import annotations

import torch

from gqakit.common.errors import GqakitError
from gqakit.common.text import eos_id, load_columns
from gqakit.uptrain.data.batches import PackedData
from gqakit.uptrain.data.sources import resolve_source
from gqakit.uptrain.loss import IGNORE, INPUT_PAD


def read_pairs(entries: tuple[str, ...], input_column: str, target_column: str) -> list[tuple[str, str]]:
    rows = []
    for entry in entries:
        source = resolve_source(entry)
        if source.kind != "rows":
            what = "a text file" if source.kind == "text" else "not a .jsonl/.json/.parquet file or folder"
            raise GqakitError(f"target_column={target_column} reads input/target rows, but data entry {entry} is "
                              f"{what}; list row files, or drop target_column to train on span corruption")
        rows += load_columns(source.path, (input_column, target_column))
    return rows


def encode_pairs(rows: list[tuple[str, str]], tokenizer, seq_len: int, what: str) -> torch.Tensor:
    """(N, 2 seq_len): each row's input ids + EOS padded with INPUT_PAD, then its target ids + EOS padded with
    IGNORE."""
    eos = eos_id(tokenizer)
    out = torch.full((len(rows), 2 * seq_len), IGNORE, dtype=torch.long)
    out[:, :seq_len] = INPUT_PAD
    for i, row in enumerate(rows):
        for side, text in enumerate(row):
            ids = tokenizer(text, add_special_tokens=False).input_ids + [eos]
            if len(ids) > seq_len:
                raise GqakitError(f"row {i} of the {what} has {len(ids):,} {('input', 'target')[side]} tokens (EOS "
                                  f"included), more than seq_len {seq_len:,}; raise seq_len or shorten the row (rows "
                                  "are never cut)")
            out[i, side * seq_len : side * seq_len + len(ids)] = torch.tensor(ids)
    return out


def load_pairs(cfg, tokenizer) -> PackedData:
    """Training and held-out pairs of an UptrainConfig with target_column."""
    train = encode_pairs(read_pairs(cfg.data, cfg.text_column, cfg.target_column), tokenizer, cfg.seq_len, "data")
    if cfg.eval_data:
        held = encode_pairs(read_pairs(cfg.eval_data, cfg.text_column, cfg.target_column), tokenizer, cfg.seq_len,
                            "eval_data")
        return PackedData(train, held[: cfg.eval_sequences], int((train >= 0).sum()), "eval_data")
    count = min(cfg.eval_sequences, max(1, round(cfg.eval_fraction * len(train)))) if cfg.eval_fraction else 0
    if len(train) - count < 1:
        raise GqakitError(f"the data holds {len(train)} row(s), too few to hold {count} out and train on the rest; "
                          "add rows, give eval_data, or set eval_fraction=0")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
    held, kept = order[:count].sort().values, order[count:].sort().values
    return PackedData(train[kept], train[held], int((train[kept] >= 0).sum()), "rows" if count else "none")
