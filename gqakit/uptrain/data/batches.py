"""Training data: token caches, windows read on demand, a held-out split by document, order by seed.

    data = load_training_data(cfg, tokenizer, is_main=accelerator.is_main_process,
                              barrier=accelerator.wait_for_everyone)

Documents (a .txt file is one document; .jsonl / .json / .parquet files and save_to_disk datasets give
one per row) are tokenised once into a token cache (`token_build`, format in `token_cache`): the
ids of every document followed by the tokenizer's EOS, in one flat file on disk. A `data:` entry may
also be a cache made by `gqakit tokenize`, used as it is. The main process builds or checks the caches;
the other ranks wait at `barrier()` and then only open them. Training windows of `seq_len + 1` tokens
that overlap by one (`inputs = seq[:-1]`, `targets = seq[1:]`, shifted here, before any sharding along
time) are read from the file when a batch asks for them (`windows.Windows`); the held-out windows, a
few, are read into memory. Without `eval_data` the held-out windows come from whole held-out documents
(`windows.split_held_out`).

Order is a pure function of (seed, step): epoch e visits the training sequences in
`randperm(n, seed + e)`, and optimizer step s takes the next `global_batch` of that endless stream. A
resumed run therefore needs only the step number to continue exactly where it stopped, and every
rank agrees on the order without talking to the others.

`read_documents`, `tokenize_stream` and `pack` are the in-memory reference that the cache and the
windows are tested against (and what small callers may still use).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from gqakit.common.errors import GqakitError, renamed
from gqakit.common.text import ROW_SUFFIXES, eos_id, load_rows, load_text_file
from gqakit.uptrain.data.sources import CHUNK_BYTES, Source, resolve_source
from gqakit.uptrain.data.token_build import cache_root, ensure_cache, implicit_cache_path
from gqakit.uptrain.data.token_cache import CacheProblem, TokenCache, open_cache, tokenizer_fingerprint
from gqakit.uptrain.data.windows import Corpus, Windows, split_held_out


def read_documents(paths: tuple[str, ...], text_column: str = "text") -> list[str]:
    """The documents of every path, in order: a .txt file is one, row files one per row."""
    docs: list[str] = []
    for path in paths:
        p = Path(path)
        row_file = p.is_dir() or p.suffix.lower() in ROW_SUFFIXES
        with renamed({"text": "data", "dataset": "data"}):  # the loaders' options are this recipe's `data`
            docs.extend(load_rows(p, text_column) if row_file else load_text_file(p))
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


SAMPLED = 256  # training sequences a fingerprint reads (cheap for any corpus: windows are read on demand)


@dataclasses.dataclass
class PackedData:
    train: Windows | torch.Tensor  # (N, seq_len + 1) windows, read on demand
    eval: torch.Tensor  # (M, seq_len + 1) in memory, possibly empty; M <= eval_sequences
    train_tokens: int  # tokens in the stream the training sequences were cut from
    held_out: str = "none"  # documents | tail | eval_data | none (windows.split_held_out) | rows (data.pairs)
    held_out_documents: int = 0

    def fingerprint(self) -> dict:
        """What a resumed run checks it trains on again: the counts, and a hash of every held-out sequence and of
        `SAMPLED` training sequences spread evenly over them (all of them when fewer), read in int64."""
        n = len(self.train)
        picks = sorted({i * n // SAMPLED for i in range(SAMPLED)} | {n - 1}) if n else []
        digest = hashlib.blake2b(digest_size=16)
        for rows in (self.train[picks] if picks else torch.empty(0), self.eval):
            digest.update(torch.as_tensor(rows).to(torch.int64).contiguous().numpy().tobytes())
        return {"train_sequences": n, "eval_sequences": len(self.eval), "train_stream_tokens": self.train_tokens,
                "sample": digest.hexdigest()}

    def describe(self) -> dict:
        """For uptraining.json; `held_out_documents` is null unless whole documents were held out of training."""
        return {"train_sequences": len(self.train), "eval_sequences": len(self.eval),
                "train_stream_tokens": self.train_tokens, "held_out": self.held_out,
                "held_out_documents": self.held_out_documents if self.held_out == "documents" else None}


def _groups(entries: tuple[str, ...]) -> list[Source | list[Source]]:
    """Token caches as they are; each run of consecutive other entries becomes one implicit cache."""
    out: list[Source | list[Source]] = []
    for source in map(resolve_source, entries):
        if source.kind == "cache":
            out.append(source)
        elif out and isinstance(out[-1], list):
            out[-1].append(source)
        else:
            out.append([source])
    return out


def _open_caches(groups: list[Source | list[Source]], tokenizer, *, text_column: str, root: Path, num_proc: int,
                 chunk_bytes: int, progress: bool, is_main: bool, barrier: Callable[[], None]) -> list[TokenCache]:
    """The caches of `groups` (`_groups`), in order: built or checked (checksums) on the main process,
    then opened on every rank."""
    fingerprint, name = tokenizer_fingerprint(tokenizer), str(getattr(tokenizer, "name_or_path", "") or "MODEL")
    folders = [g.path if isinstance(g, Source) else implicit_cache_path(g, fingerprint, root, text_column, chunk_bytes)
               for g in groups]
    if is_main:
        try:
            for group in groups:
                if isinstance(group, Source):
                    open_cache(group.path, fingerprint=fingerprint, tokenizer_name=name, verify=True, progress=progress)
                else:
                    ensure_cache(group, tokenizer, root=root, text_column=text_column, num_proc=num_proc,
                                 chunk_bytes=chunk_bytes, progress=progress)
        except Exception:
            barrier()  # release the other ranks: they find no usable cache and stop too
            raise
    barrier()
    caches = []
    for folder in folders:
        try:
            caches.append(open_cache(folder, fingerprint=fingerprint, tokenizer_name=name))
        except CacheProblem as e:
            if is_main:
                raise
            raise GqakitError(f"the main process did not prepare a usable token cache: {folder} {e.reason}; see the "
                              "main process's error") from None
    return caches


def prepare_data(data: tuple[str, ...], eval_data: tuple[str, ...], tokenizer, *, seq_len: int,
                 eval_fraction: float, eval_sequences: int, seed: int, text_column: str = "text",
                 cache_dir: str | None = None, num_proc: int = 1, progress: bool = False, is_main: bool = True,
                 barrier: Callable[[], None] = lambda: None, chunk_bytes: int = CHUNK_BYTES) -> PackedData:
    """Training windows and held-out sequences from `data` (and `eval_data`), through token caches."""
    options = dict(text_column=text_column, root=cache_root(cache_dir), num_proc=num_proc, chunk_bytes=chunk_bytes,
                   progress=progress, is_main=is_main)
    train_groups, eval_groups = _groups(data), _groups(eval_data)
    caches = _open_caches(train_groups + eval_groups, tokenizer, barrier=barrier, **options)  # one barrier for both
    corpus = Corpus(caches[:len(train_groups)])
    if eval_data:
        held = Corpus(caches[len(train_groups):])
        limit = min(held.tokens, eval_sequences * seq_len + 1)
        if (limit - 1) // seq_len < 1:
            raise GqakitError(f"the eval_data holds {held.tokens} tokens, fewer than one sequence of seq_len+1="
                              f"{seq_len + 1}; add held-out text or lower seq_len")
        train = Windows(corpus.spans(0, corpus.tokens), seq_len)
        if len(train) < 1:
            raise GqakitError(f"the data holds {corpus.tokens} tokens, fewer than one sequence of seq_len+1="
                              f"{seq_len + 1}; add data or lower seq_len")
        return PackedData(train, Windows(held.spans(0, limit), seq_len)[:], corpus.tokens, "eval_data")
    split = split_held_out(corpus, seq_len, eval_fraction, eval_sequences, seed)
    train = Windows([s for a, b in split.train for s in corpus.spans(a, b)], seq_len)
    held = Windows([s for a, b in split.held for s in corpus.spans(a, b)], seq_len)
    return PackedData(train, held[: min(eval_sequences, len(held))], train.tokens, split.kind, split.documents)


def load_training_data(cfg, tokenizer, *, is_main: bool = True, barrier: Callable[[], None] = lambda: None
                       ) -> PackedData:
    """`prepare_data` for an `UptrainConfig` (data, eval_data, seq_len, eval_fraction, eval_sequences,
    seed, text_column, cache_dir, num_proc, progress). Call it on every rank with `is_main` and a
    `barrier` that all ranks reach (accelerator.is_main_process, accelerator.wait_for_everyone)."""
    return prepare_data(cfg.data, cfg.eval_data, tokenizer, seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction,
                        eval_sequences=cfg.eval_sequences, seed=cfg.seed, text_column=cfg.text_column,
                        cache_dir=cfg.cache_dir, num_proc=cfg.num_proc, progress=cfg.progress, is_main=is_main,
                        barrier=barrier)


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
