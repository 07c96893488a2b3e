"""Which keys a query may attend to: causal, windows, dilation, chunks, summaries, globals, sinks, unions.

A `MaskSpec` is a pure description on ABSOLUTE positions (a query at position q, a key at position k):

    allowed(q, k) = own(q, k) | any(part.allowed(q, k) for part in parts)
    own(q, k)     = causal_ok & (local_ok | 0 <= k < sinks | k in global_tokens | q in global_tokens)

    causal_ok = k <= q                                   (True when not causal)
    local_ok  = dist < window  and  dist % dilation == 0  (dist = q - k; |q - k| when not causal)
                and q // chunk == k // chunk              (the same chunk of `chunk` positions)
                and k % l >= l - c                        (summary = (l, c): the last c of every l)

(each local condition only when its field is set). So a window W (Mistral) lets a token see itself and
the W - 1 tokens before it, a dilation d (Longformer) keeps every d-th of those, a chunk is Llama 4's
chunked attention and the Sparse Transformer's "fixed" A1, a summary (l, c) its "fixed" A2, global
tokens attend to and are attended by everyone (still causally when causal), and the first `sinks`
positions (StreamingLLM) are always visible. `parts` are OR'ed in: the Sparse Transformer's merged
heads are unions, e.g. strided = MaskSpec(window=l + 1, parts=(MaskSpec(dilation=l),)).
Constructors for the named patterns live in `patterns.py`.

The same rule is offered four ways: `allowed` / `mask` (elementwise; a dense boolean tile for
references and small inputs), `mask_function` (a transformers-style `(batch_idx, head_idx, q_idx,
kv_idx)` function for `sdpa_mask` / `and_masks` / flex_attention), and `kv_block_ranges` /
`block_is_full` / `block_is_empty` (analytic block bounds: a tiled kernel visits exactly the key blocks
that hold an allowed entry, so a window W costs O(T * W) block work and never O(T^2)).

`dense_allowed` reads a caller's own dense mask tensor (bool, or transformers' additive float).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import torch

from gqakit.common.errors import GqakitError


class AttentionOptionError(GqakitError, ValueError):
    """A bad attention kind, option or pattern: the message names the fix on one line."""


def dropout_refusal(module, kernel: str) -> str:
    """The one-line refusal of attention dropout, naming the field this model's config spells it with."""
    config = getattr(module, "config", None)
    fields = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
    name = next((f for f in fields if config is not None and hasattr(config, f)), "attention_dropout")
    return f"{kernel} has no attention dropout; set config.{name} = 0.0 to train with it"


def int_field(name: str, value, allow_none: bool = False):
    """An int field (numpy / torch ints accepted), or a one-line error naming it."""
    if value is None and allow_none:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise AttentionOptionError(f"mask {name}={value!r} must be an integer") from None


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """An attention pattern on absolute positions; see the module docstring for the exact rule."""

    causal: bool = True
    window: int | None = None
    dilation: int = 1
    global_tokens: tuple[int, ...] = ()
    sinks: int = 0
    chunk: int | None = None
    summary: tuple[int, int] | None = None
    parts: tuple["MaskSpec", ...] = ()

    def __post_init__(self) -> None:
        # Normalise so that specs hash and compare by value: ints, a sorted tuple of globals, flat parts.
        object.__setattr__(self, "window", int_field("window", self.window, allow_none=True))
        object.__setattr__(self, "dilation", int_field("dilation", self.dilation))
        object.__setattr__(self, "sinks", int_field("sinks", self.sinks))
        object.__setattr__(self, "chunk", int_field("chunk", self.chunk, allow_none=True))
        object.__setattr__(self, "global_tokens",
                           tuple(sorted({int_field("global_tokens", g) for g in self.global_tokens})))
        if self.summary is not None:
            if len(tuple(self.summary)) != 2:
                raise AttentionOptionError(f"mask summary={self.summary!r} must be a pair (l, c): the last c positions "
                                           "of every l")
            object.__setattr__(self, "summary", tuple(int_field("summary", x) for x in self.summary))
        flat: list[MaskSpec] = []
        for p in self.parts:
            if not isinstance(p, MaskSpec):
                raise AttentionOptionError(f"mask parts must be MaskSpecs, got {type(p).__name__}")
            flat += [dataclasses.replace(p, parts=()), *p.parts]
        object.__setattr__(self, "parts", tuple(flat))
        self.validate()

    def validate(self) -> None:
        """Raise `AttentionOptionError` (a ValueError) with a one-line message naming the fix when a field
        is out of range."""
        if self.window is not None and self.window <= 0:
            raise AttentionOptionError(f"mask window={self.window} must be a positive number of tokens "
                                       "(window=1 sees only itself); use window=None for no window")
        if self.dilation <= 0:
            raise AttentionOptionError(f"mask dilation={self.dilation} must be >= 1; use dilation=1 for a dense "
                                       "window (a Sparse Transformer stride l is dilation=l)")
        if self.sinks < 0:
            raise AttentionOptionError(f"mask sinks={self.sinks} must be >= 0; use sinks=0 for no attention sinks")
        negative = [g for g in self.global_tokens if g < 0]
        if negative:
            raise AttentionOptionError(f"mask global_tokens {negative} are negative; give absolute positions >= 0")
        if self.chunk is not None and self.chunk <= 0:
            raise AttentionOptionError(f"mask chunk={self.chunk} must be a positive number of tokens; use "
                                       "chunk=None for no chunking")
        if self.summary is not None:
            l, c = self.summary
            if l <= 0:
                raise AttentionOptionError(f"mask summary stride l={l} must be >= 1 (summary=(l, c): the last c of "
                                           "every l positions)")
            if not 0 < c <= l:
                raise AttentionOptionError(f"mask summary c={c} must be between 1 and the stride l={l} (the last c "
                                           f"of every l positions); use 1 <= c <= {l}")
        for p in self.parts:
            if p.causal != self.causal:
                raise AttentionOptionError(f"mask parts must share causal={self.causal}, got a part with "
                                           f"causal={p.causal}; build every part with the same causal flag")

    @property
    def anchored(self) -> str | None:
        """What of the pattern sits at absolute positions rather than distances (sinks, global tokens, chunk or
        summary blocks), for a message; None where it is all distances (causal, window, dilation)."""
        for atom in (self, *self.parts):  # each atom's own fields (no copies: this runs at every layer call)
            if atom.sinks:
                return f"its {atom.sinks} attention sinks"
            if atom.global_tokens:
                return f"global tokens {list(atom.global_tokens)}"
            if atom.chunk is not None or atom.summary is not None:
                return "blocks that start at position 0"
        return None

    def atoms(self) -> tuple["MaskSpec", ...]:
        """The OR'ed pieces: this spec without its parts, then each part."""
        return (dataclasses.replace(self, parts=()), *self.parts) if self.parts else (self,)

    # ---- elementwise rule ---------------------------------------------------------------------

    def _is_global(self, pos: torch.Tensor) -> torch.Tensor:
        # A python loop over the (few) global positions, not over elements; plain comparisons keep
        # this usable under transformers' vmap-based mask construction too.
        hit = torch.zeros_like(pos, dtype=torch.bool)
        for g in self.global_tokens:
            hit = hit | (pos == g)
        return hit

    def _own(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        dist = q - k if self.causal else (q - k).abs()
        local = torch.ones_like(dist, dtype=torch.bool)
        if self.dilation > 1:
            local = local & (dist % self.dilation == 0)
        if self.window is not None:
            local = local & (dist < self.window)
        if self.chunk is not None:
            local = local & (torch.div(q, self.chunk, rounding_mode="floor")
                             == torch.div(k, self.chunk, rounding_mode="floor"))
        if self.summary is not None:
            l, c = self.summary
            local = local & (k % l >= l - c)
        if self.sinks:  # the first `sinks` positions (a left-padded row's pads, at negative positions, are none)
            local = local | ((k >= 0) & (k < self.sinks))
        if self.global_tokens:
            local = local | self._is_global(k) | self._is_global(q)
        return local & (k <= q) if self.causal else local

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The rule on broadcastable integer position tensors `q` and `k` -> bool tensor."""
        out = self._own(q, k)
        for p in self.parts:
            out = out | p._own(q, k)
        return out

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Dense boolean mask (Tq, Tk) for query positions `q_pos` (Tq,) and key positions `k_pos` (Tk,)."""
        return self.allowed(q_pos[:, None], k_pos[None, :])  # (Tq, Tk)

    def mask_function(self) -> Callable:
        """A transformers-style mask function `(batch_idx, head_idx, q_idx, kv_idx) -> bool tensor`.

        Indices are broadcastable tensors of absolute positions (as `sdpa_mask` passes them); the
        result does not depend on batch or head, so it composes with `and_masks` and padding masks.
        (Per-head patterns: `patterns.head_mask_function`.)
        """

        def spec_mask(batch_idx, head_idx, q_idx, kv_idx):
            return self.allowed(q_idx, kv_idx)

        return spec_mask

    # ---- analytic block bounds ----------------------------------------------------------------

    def kv_block_ranges(self, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
                        block_k: int) -> list[tuple[int, int]]:
        """Exactly the key blocks that hold an allowed entry for some query in [q_lo, q_hi).

        Blocks tile the key range [kv_lo, kv_hi) from kv_lo in steps of `block_k` (the last one may be
        short); each is returned as its absolute [start, end), in increasing order. Candidates come from
        analytic key intervals (causal upper bound, window and chunk bounds, dilation and summary runs,
        sink and global keys) and each is confirmed by `block_is_empty`, in O(1) python work per block,
        so the work is proportional to the number of blocks returned (plus the runs of a sparse
        dilation or summary). No returned block is empty; no omitted block holds an allowed entry.
        """
        if q_hi <= q_lo or kv_hi <= kv_lo:
            return []
        top = min(kv_hi, q_hi) if self.causal else kv_hi  # exclusive: causal keys k <= q_hi - 1
        hit: set[int] = set()
        for atom in (self, *self.parts):  # the _-methods read an atom's own fields, never its parts
            for lo, hi in atom._spans(q_lo, q_hi, kv_lo, top, block_k):
                lo, hi = max(lo, kv_lo), min(hi, top)
                if lo >= hi:
                    continue
                for j in range((lo - kv_lo) // block_k, (hi - 1 - kv_lo) // block_k + 1):
                    if j not in hit:
                        a = kv_lo + j * block_k
                        if atom._touches(q_lo, q_hi, a, min(a + block_k, kv_hi)):
                            hit.add(j)
        return [(kv_lo + j * block_k, min(kv_lo + (j + 1) * block_k, kv_hi)) for j in sorted(hit)]

    def block_is_full(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """True only if every (q, k) with q in [q_lo, q_hi), k in [k_lo, k_hi) is allowed.

        Conservative: False means "evaluate the elementwise mask", never "the block is empty" (a union
        counts as full only where one of its pieces is full on its own).
        """
        if q_hi <= q_lo or k_hi <= k_lo:
            return False
        return any(atom._full(q_lo, q_hi, k_lo, k_hi) for atom in (self, *self.parts))

    def block_is_empty(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Exact: True iff no (q, k) with q in [q_lo, q_hi), k in [k_lo, k_hi) is allowed."""
        if q_hi <= q_lo or k_hi <= k_lo:
            return True
        return not any(atom._touches(q_lo, q_hi, k_lo, k_hi) for atom in (self, *self.parts))

    # -- one atom (parts ignored) --

    def _spans(self, q_lo: int, q_hi: int, kv_lo: int, top: int, block_k: int) -> list[tuple[int, int]]:
        """Half-open key intervals that hold every key this atom allows the queries [q_lo, q_hi) (a superset)."""
        spans = [(0, self.sinks)] if self.sinks else []
        spans += [(g, g + 1) for g in self.global_tokens]
        if any(q_lo <= g < q_hi for g in self.global_tokens):
            return spans + [(kv_lo, top)]  # a global query sees every key
        lo, hi = kv_lo, top
        if self.window is not None:
            lo = max(lo, q_lo - self.window + 1)
            hi = hi if self.causal else min(hi, q_hi + self.window - 1)  # |q - k| <= window - 1
        if self.chunk is not None:
            lo = max(lo, q_lo // self.chunk * self.chunk)
            hi = min(hi, ((q_hi - 1) // self.chunk + 1) * self.chunk)
        local = [(lo, hi)] if lo < hi else []
        # Periodic runs, only where they are sparser than the blocks (else every block in [lo, hi) holds one).
        d, n = self.dilation, q_hi - q_lo
        if local and d > 1 and d > block_k and n < d:  # keys q -+ j*d: runs [q_lo + j*d, q_hi + j*d)
            first = (lo - q_hi) // d + 1
            local = _intersect(local, [(q_lo + j * d, q_hi + j * d) for j in range(first, (hi - q_lo - 1) // d + 1)])
        if local and self.summary is not None and self.summary[0] > block_k:
            l, c = self.summary
            runs = [(m * l + l - c, m * l + l) for m in range(lo // l, (hi - 1) // l + 1)]
            local = _intersect(local, runs)
        return spans + local

    def _touches(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Exact: does this atom allow some (q, k) in [q0, q1) x [k0, k1)? (non-empty ranges)"""
        if self.sinks and k0 < self.sinks and k1 > 0 and (not self.causal or max(k0, 0) <= q1 - 1):
            return True  # sinks are keys 0 <= k < sinks
        for g in self.global_tokens:
            if k0 <= g < k1 and (not self.causal or g <= q1 - 1):
                return True
            if q0 <= g < q1 and (not self.causal or k0 <= g):
                return True
        rects = [(q0, q1, k0, k1)]
        if self.chunk is not None:  # split into the chunks both ranges share
            c = self.chunk
            rects = [(max(q0, m * c), min(q1, m * c + c), max(k0, m * c), min(k1, m * c + c))
                     for m in range(max(q0 // c, k0 // c), min((q1 - 1) // c, (k1 - 1) // c) + 1)]
        if self.summary is not None:  # keep only the summary columns
            l, c = self.summary
            rects = [(qa, qb, max(ka, m * l + l - c), min(kb, m * l + l))
                     for qa, qb, ka, kb in rects for m in range(ka // l, (kb - 1) // l + 1)]
        return any(self._dist_hits(qa, qb, ka, kb) for qa, qb, ka, kb in rects if qa < qb and ka < kb)

    def _dist_hits(self, qa: int, qb: int, ka: int, kb: int) -> bool:
        """Does some q - k, over the rectangle (every integer in [qa - kb + 1, qb - 1 - ka]), pass the
        causal, window and dilation conditions?"""
        lo, hi = qa - kb + 1, qb - 1 - ka
        if self.causal:
            lo = max(lo, 0)
        if self.window is not None:
            hi = min(hi, self.window - 1)
            if not self.causal:
                lo = max(lo, 1 - self.window)
        if lo > hi:
            return False
        return self.dilation == 1 or hi // self.dilation * self.dilation >= lo  # a multiple of d in [lo, hi]

    def _full(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        if self.causal and k1 - 1 > q0:  # some key is later than some query
            return False
        if self.sinks and k0 >= 0 and k1 <= self.sinks:
            return True
        n = len(self.global_tokens)  # every query (or every key) of the block global: all allowed
        if (q1 - q0 <= n and all(q in self.global_tokens for q in range(q0, q1))) or \
                (k1 - k0 <= n and all(k in self.global_tokens for k in range(k0, k1))):
            return True
        lo, hi = q0 - (k1 - 1), q1 - 1 - k0
        if self.window is not None and (hi if self.causal else max(hi, -lo)) >= self.window:
            return False
        if self.dilation > 1 and not (lo == hi and lo % self.dilation == 0):
            return False
        if self.chunk is not None and not (q0 // self.chunk == (q1 - 1) // self.chunk == k0 // self.chunk
                                           == (k1 - 1) // self.chunk):
            return False
        if self.summary is not None:
            l, c = self.summary
            if c < l and not (k0 // l == (k1 - 1) // l and k0 % l >= l - c):
                return False
        return True


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intersection of two sorted lists of disjoint half-open intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


# ---- a caller's dense mask tensor ------------------------------------------------------------------

def dense_allowed(mask: torch.Tensor) -> torch.Tensor:
    """Which entries of a caller's dense mask let the query attend: True = may attend.

    A bool mask is taken as it is (True = attend, torch sdpa's convention). A float mask is additive
    (transformers' eager convention: 0 to attend, the dtype's most negative finite value to mask); an
    entry counts as masked when it is -inf or at most half that most negative value, where adding it to
    any score leaves exp() exactly 0. Other values (a bias such as -1e4) are added, not masked.
    """
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2
