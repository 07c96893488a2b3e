"""Which keys a query may attend to: causal, sliding window, dilated, global tokens, sinks.

A `MaskSpec` is a pure description on ABSOLUTE positions (a query at position q, a key at position k):

    allowed(q, k) = causal_ok & (local_ok | k < sinks | k in global_tokens | q in global_tokens)

    causal_ok = k <= q                  (True when not causal)
    local_ok  = dist < window and dist % dilation == 0,  dist = q - k  (|q - k| when not causal)

so a window W (Mistral) lets a token see itself and the W - 1 tokens before it, a dilation d
(Longformer) keeps every d-th of those, global tokens attend to and are attended by everyone (still
causally when causal), and the first `sinks` positions (StreamingLLM) are always visible.

The same rule is offered three ways: `mask` (a dense boolean tile, for references and small
inputs), `mask_function` (a transformers-style `(batch_idx, head_idx, q_idx, kv_idx)` function for
`sdpa_mask` / `and_masks`), and `kv_block_ranges` / `block_is_full` (analytic block bounds that let a
tiled kernel skip empty blocks, so a window W costs O(T * W) block work and never O(T^2)).

`dense_allowed` reads a caller's own dense mask tensor (bool, or transformers' additive float).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """An attention pattern on absolute positions; see the module docstring for the exact rule."""

    causal: bool = True
    window: int | None = None
    dilation: int = 1
    global_tokens: tuple[int, ...] = ()
    sinks: int = 0

    def __post_init__(self) -> None:
        # Accept any iterable of ints, keep a sorted tuple so that specs hash and compare by value.
        object.__setattr__(self, "global_tokens", tuple(sorted({int(g) for g in self.global_tokens})))
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` with a one-line message naming the fix when a field is out of range."""
        if self.window is not None and self.window <= 0:
            raise ValueError(f"mask window={self.window} must be a positive number of tokens "
                             "(window=1 sees only itself); use window=None for no window")
        if self.dilation <= 0:
            raise ValueError(f"mask dilation={self.dilation} must be >= 1; use dilation=1 for a dense window")
        if self.sinks < 0:
            raise ValueError(f"mask sinks={self.sinks} must be >= 0; use sinks=0 for no attention sinks")
        negative = [g for g in self.global_tokens if g < 0]
        if negative:
            raise ValueError(f"mask global_tokens {negative} are negative; give absolute positions >= 0")

    # ---- elementwise rule ---------------------------------------------------------------------

    def _is_global(self, pos: torch.Tensor) -> torch.Tensor:
        # A python loop over the (few) global positions, not over elements; plain comparisons keep
        # this usable under transformers' vmap-based mask construction too.
        hit = torch.zeros_like(pos, dtype=torch.bool)
        for g in self.global_tokens:
            hit = hit | (pos == g)
        return hit

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The rule on broadcastable integer position tensors `q` and `k` -> bool tensor."""
        dist = q - k if self.causal else (q - k).abs()
        local = dist % self.dilation == 0 if self.dilation > 1 else torch.ones_like(dist, dtype=torch.bool)
        if self.window is not None:
            local = local & (dist < self.window)
        if self.sinks:
            local = local | (k < self.sinks)
        if self.global_tokens:
            local = local | self._is_global(k) | self._is_global(q)
        return local & (k <= q) if self.causal else local

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Dense boolean mask (Tq, Tk) for query positions `q_pos` (Tq,) and key positions `k_pos` (Tk,)."""
        return self.allowed(q_pos[:, None], k_pos[None, :])  # (Tq, Tk)

    def mask_function(self) -> Callable:
        """A transformers-style mask function `(batch_idx, head_idx, q_idx, kv_idx) -> bool tensor`.

        Indices are broadcastable tensors of absolute positions (as `sdpa_mask` passes them); the
        result does not depend on batch or head, so it composes with `and_masks` and padding masks.
        """

        def spec_mask(batch_idx, head_idx, q_idx, kv_idx):
            return self.allowed(q_idx, kv_idx)

        return spec_mask

    # ---- analytic block bounds ----------------------------------------------------------------

    def kv_block_ranges(self, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
                        block_k: int) -> list[tuple[int, int]]:
        """Key blocks that may hold an allowed entry for the queries in [q_lo, q_hi).

        Blocks tile the key range [kv_lo, kv_hi) from kv_lo in steps of `block_k` (the last one may be
        short); each is returned as its absolute [start, end), in increasing order. The bounds are
        analytic (causal upper bound, window lower bound, sink and global blocks), so the work is
        proportional to the number of blocks returned. A returned block may still turn out empty
        (e.g. a block holding one global key); an omitted block never holds an allowed entry.
        """
        if q_hi <= q_lo or kv_hi <= kv_lo:
            return []
        top = min(kv_hi, q_hi) if self.causal else kv_hi  # exclusive: causal keys k <= q_hi - 1
        global_query = any(q_lo <= g < q_hi for g in self.global_tokens)
        spans: list[tuple[int, int]] = []  # half-open key intervals that may hold allowed entries
        if self.window is None or global_query:
            spans.append((kv_lo, top))
        else:
            far = q_hi if self.causal else q_hi + self.window - 1  # |q - k| <= window - 1
            spans.append((q_lo - self.window + 1, far))
        if self.sinks:
            spans.append((0, self.sinks))
        spans.extend((g, g + 1) for g in self.global_tokens)

        blocks: set[int] = set()
        for lo, hi in spans:
            lo, hi = max(lo, kv_lo), min(hi, top)
            if lo < hi:
                blocks.update(range((lo - kv_lo) // block_k, (hi - 1 - kv_lo) // block_k + 1))
        return [(kv_lo + j * block_k, min(kv_lo + (j + 1) * block_k, kv_hi)) for j in sorted(blocks)]

    def block_is_full(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """True only if every (q, k) with q in [q_lo, q_hi), k in [k_lo, k_hi) is allowed.

        Conservative: False means "evaluate the elementwise mask", never "the block is empty".
        """
        if q_hi <= q_lo or k_hi <= k_lo:
            return False
        if self.causal and k_hi - 1 > q_lo:  # some key is later than some query
            return False
        if k_hi <= self.sinks:
            return True
        if self.dilation > 1:
            return False
        if self.window is None:
            return True
        far = q_hi - 1 - k_lo if self.causal else max(q_hi - 1 - k_lo, k_hi - 1 - q_lo)
        return far < self.window


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
