"""Training windows read on demand from token caches, and the held-out split by document.

Window i of a stream is tokens [i * seq_len, i * seq_len + seq_len + 1): windows overlap by one token
so that each of the seq_len inputs has its target inside the window, and the ragged tail is dropped
(exactly `data.pack`). A `Windows` indexes the windows of the concatenation of a list of spans (cache,
start, stop) and reads only the windows asked for; it holds O(number of spans) memory.

The held-out split (without eval_data) is by whole documents: a seeded selection of documents is held
out and training windows are cut from the other documents' stream only, so no window of one shares a
token, or a document, with the other. How many: k = min(eval_sequences, round(eval_fraction * windows)),
at least 1 when eval_fraction > 0 (no held-out window goes unused), i.e. k * seq_len + 1 tokens. The
documents are visited in a seeded affine order d_i = (a * i + b) mod D (a coprime to D: a permutation in
O(1) memory, spread over the corpus) and taken while they fit under a cap (twice the tokens needed, or
eval_fraction of the corpus if larger, so that one huge document is not held out) until they hold
enough. With one document (a single .txt file), or none small enough, there is nothing to split by
document: the last k * seq_len + 1 tokens of the stream are held out instead (a tail span, which
shares its document but no token with training); `describe()` says which ("documents" or "tail").
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import random

import numpy as np
import torch

from gqakit.common.errors import GqakitError
from gqakit.uptrain.data.token_cache import TokenCache

Span = tuple[TokenCache, int, int]  # tokens [start, stop) of one cache
MAX_SCAN = 200_000  # documents visited looking for held-out ones before falling back to the tail


class Corpus:
    """Several token caches as one stream, in order, with global token and document numbers."""

    def __init__(self, caches: list[TokenCache]):
        self.caches = caches
        self._tokens, self._docs = [0], [0]
        for cache in caches:
            self._tokens.append(self._tokens[-1] + cache.tokens)
            self._docs.append(self._docs[-1] + cache.documents)
        self.tokens, self.documents = self._tokens[-1], self._docs[-1]

    def document(self, d: int) -> tuple[int, int]:
        """Global (start, stop) of document d."""
        k = bisect.bisect_right(self._docs, d) - 1
        start, stop = self.caches[k].document(d - self._docs[k])
        return start + self._tokens[k], stop + self._tokens[k]

    def spans(self, start: int, stop: int) -> list[Span]:
        """Global tokens [start, stop) as spans of the caches."""
        out = []
        k = bisect.bisect_right(self._tokens, start) - 1
        while start < stop:
            end = min(stop, self._tokens[k + 1])
            if end > start:
                out.append((self.caches[k], start - self._tokens[k], end - self._tokens[k]))
            start, k = end, k + 1
        return out


class Windows:
    """The (seq_len + 1)-token windows, stride seq_len, of the concatenation of `spans`, read on demand.

    `windows[[i, j, ...]]` is a LongTensor (B, seq_len + 1); `windows[i]` one window (seq_len + 1,)."""

    def __init__(self, spans: list[Span], seq_len: int):
        self.spans = [s for s in spans if s[2] > s[1]]
        self.seq_len = seq_len
        self._starts = [0]
        for _, start, stop in self.spans:
            self._starts.append(self._starts[-1] + stop - start)
        self.tokens = self._starts[-1]
        self._n = (self.tokens - 1) // seq_len if self.tokens > seq_len else 0

    def __len__(self) -> int:
        return self._n

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, as int64."""
        out = np.empty(stop - start, dtype=np.int64)
        k, filled = bisect.bisect_right(self._starts, start) - 1, 0
        while start < stop:
            cache, first, last = self.spans[k]
            offset = first + start - self._starts[k]
            take = min(stop - start, last - offset)
            out[filled:filled + take] = cache.read(offset, offset + take)
            start, filled, k = start + take, filled + take, k + 1
        return out

    def _window(self, i: int) -> np.ndarray:
        if not -self._n <= i < self._n:
            raise IndexError(f"window {i} is out of range for {self._n} windows")
        i %= self._n
        return self.read(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            return torch.from_numpy(self._window(int(index)))
        if isinstance(index, slice):
            index = range(*index.indices(self._n))
        rows = [self._window(int(i)) for i in index]
        if not rows:
            return torch.empty(0, self.seq_len + 1, dtype=torch.long)
        return torch.from_numpy(np.stack(rows))  # (B, seq_len + 1)


@dataclasses.dataclass(frozen=True)
class Split:
    train: list[tuple[int, int]]  # global token ranges the training windows are cut from
    held: list[tuple[int, int]]  # and the held-out windows
    kind: str  # documents | tail | none
    documents: int = 0  # held-out documents


def _complement(ranges: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for start, stop in ranges:
        if start > at:
            out.append((at, start))
        at = stop
    return out + ([(at, total)] if at < total else [])


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


def _pick_documents(corpus: Corpus, need: int, cap: int, seed: int) -> list[tuple[int, int]] | None:
    """Documents of at most `cap` tokens, in a seeded affine order, until they hold `need` tokens."""
    rng, n = random.Random(seed + 7919), corpus.documents
    a = rng.randrange(1, n)
    while math.gcd(a, n) != 1:
        a = rng.randrange(1, n)
    b, picked, total = rng.randrange(n), [], 0
    for i in range(min(n, MAX_SCAN)):
        start, stop = corpus.document((a * i + b) % n)
        if stop - start <= cap:
            picked.append((start, stop))
            total += stop - start
            if total >= need:
                return picked
    return None


def split_held_out(corpus: Corpus, seq_len: int, eval_fraction: float, eval_sequences: int, seed: int) -> Split:
    """Which tokens train and which are held out (module docstring)."""
    n_tokens = corpus.tokens
    n_windows = (n_tokens - 1) // seq_len
    if n_windows < 1:
        raise GqakitError(f"the data holds {n_tokens} tokens, fewer than one sequence of seq_len+1={seq_len + 1}; "
                          "add data or lower seq_len")
    k = min(eval_sequences, max(1, round(eval_fraction * n_windows))) if eval_fraction > 0 else 0
    while k and n_tokens - (k * seq_len + 1) < seq_len + 1:  # keep at least one training window
        k -= 1
    if not k:
        return Split([(0, n_tokens)], [], "none")
    need = k * seq_len + 1
    if corpus.documents > 1:
        picked = _pick_documents(corpus, need, max(2 * need, round(eval_fraction * n_tokens)), seed)
        if picked is not None and n_tokens - sum(b - a for a, b in picked) >= seq_len + 1:
            held = _merge(picked)
            return Split(_complement(held, n_tokens), held, "documents", len(picked))
    return Split([(0, n_tokens - need)], [(n_tokens - need, n_tokens)], "tail")
