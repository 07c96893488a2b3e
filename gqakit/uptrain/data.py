"""Training data: read with `datasets`, tokenise, pack into fixed-length sequences, order by seed.

Documents (a .txt file is one document; .jsonl / .json / .parquet files give one per row) are
tokenised without special tokens and concatenated with the tokenizer's EOS after each one. The
stream is cut into sequences of `seq_len + 1` tokens that overlap by one, so that every one of the
`seq_len` inputs has its target inside the sequence: `inputs = seq[:-1]`, `targets = seq[1:]`. The
targets are shifted here, before any sharding along time (context parallelism needs that).

Order is a pure function of (seed, step): epoch e visits the training sequences in
`randperm(n, seed + e)`, and optimizer step s takes the next `global_batch` of that endless stream. A
resumed run therefore needs only the step number to continue exactly where it stopped, and every
rank agrees on the order without talking to the others.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..errors import GqakitError
from ..evaluate.data import ROW_SUFFIXES, eos_id, load_rows, load_text_file


def read_documents(paths: tuple[str, ...], text_column: str = "text") -> list[str]:
    """The documents of every path, in order: a .txt file is one, row files one per row."""
    docs: list[str] = []
    for path in paths:
        p = Path(path)
        row_file = p.is_dir() or p.suffix.lower() in ROW_SUFFIXES
        try:
            docs.extend(load_rows(p, text_column) if row_file else load_text_file(p))
        except GqakitError as e:  # the evaluation loaders name CLI flags; a recipe has keys
            message = str(e).replace("--text-column", "text_column=").replace("= NAME", "=NAME")
            raise GqakitError(message.replace("--dataset", "data:").replace("--text", "data:")) from None
    return docs


def tokenize_stream(documents: list[str], tokenizer) -> torch.Tensor:
    """1-D ids of all documents, each followed by EOS (tokenised with `datasets.map`, batched)."""
    import datasets

    eos = eos_id(tokenizer)
    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict({"text": documents})
    table = table.map(lambda batch: {"ids": tokenizer(batch["text"], add_special_tokens=False).input_ids},
                      batched=True, remove_columns=["text"], keep_in_memory=True)
    ids = [t for doc in table["ids"] for t in (*doc, eos)]
    return torch.tensor(ids, dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, seq_len + 1) windows of the stream with stride seq_len; the ragged tail is dropped."""
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        raise GqakitError(f"the data holds {stream.numel()} tokens, fewer than one sequence of seq_len+1="
                          f"{seq_len + 1}; add data or lower seq_len")
    return stream.unfold(0, seq_len + 1, seq_len)[:n].clone()  # (N, seq_len + 1)


@dataclasses.dataclass
class PackedData:
    train: torch.Tensor  # (N, seq_len + 1)
    eval: torch.Tensor  # (M, seq_len + 1), possibly empty
    train_tokens: int  # tokens in the stream the training sequences were cut from

    def describe(self) -> dict:
        return {"train_sequences": len(self.train), "eval_sequences": len(self.eval),
                "train_stream_tokens": self.train_tokens}


def load_packed(data: tuple[str, ...], eval_data: tuple[str, ...], tokenizer, seq_len: int,
                eval_fraction: float, eval_sequences: int, seed: int, text_column: str = "text") -> PackedData:
    """Training and held-out sequences. Without `eval_data`, a seeded `eval_fraction` of the packed
    sequences is held out (at least one when the fraction is positive)."""
    stream = tokenize_stream(read_documents(data, text_column), tokenizer)
    packed = pack(stream, seq_len)
    if eval_data:
        held = pack(tokenize_stream(read_documents(eval_data, text_column), tokenizer), seq_len)
        train = packed
    else:
        wanted = min(eval_sequences, round(eval_fraction * len(packed)))  # no held-out sequence goes unused
        n_eval = min(len(packed) - 1, max(1 if eval_fraction > 0 else 0, wanted))
        perm = torch.randperm(len(packed), generator=torch.Generator().manual_seed(seed + 7919))
        held, train = packed[perm[:n_eval].sort().values], packed[perm[n_eval:].sort().values]
    return PackedData(train, held[:eval_sequences], stream.numel())


class BatchOrder:
    """Which training sequences each (step, micro-step, data-parallel rank) gets; see module docstring."""

    def __init__(self, n_sequences: int, batch_size: int, accumulation: int, data_parallel: int, seed: int):
        self.n, self.batch_size, self.accumulation = n_sequences, batch_size, accumulation
        self.data_parallel, self.seed = data_parallel, seed
        self.global_batch = batch_size * accumulation * data_parallel
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        return self._perm

    def indices(self, step: int, micro: int, dp_rank: int) -> list[int]:
        """Sequence indices of one micro-batch: slot (micro, dp_rank) of step `step`'s global batch."""
        first = step * self.global_batch + (micro * self.data_parallel + dp_rank) * self.batch_size
        out = []
        for flat in range(first, first + self.batch_size):
            epoch, i = divmod(flat, self.n)
            out.append(int(self._permutation(epoch)[i]))
        return out

    def position(self, step: int) -> dict:
        """Where the data stream stands after `step` optimizer steps (recorded in checkpoints)."""
        consumed = step * self.global_batch
        return {"sequences_consumed": consumed, "epoch": consumed // self.n, "index_in_epoch": consumed % self.n}
