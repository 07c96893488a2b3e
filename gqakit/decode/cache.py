"""KV-cache policies for `generate()` and streaming: attention sinks + a recent window (StreamingLLM).

`SinkCache(sinks=S, window=W)` keeps, per layer and per row, the first S real tokens (the attention
sinks of Xiao et al. 2023) and the W most recent ones; `WindowCache(W)` is the S = 0 case. Memory is
constant: the stored K/V never exceed S + W positions. During one forward the cache also returns the
current chunk of q tokens (S + W + q keys are attended), as transformers' own sliding-window layer does.

Positions. Llama-style models rotate K by RoPE *before* `past_key_values.update(...)`, and
`generate()` hands the model absolute, ever-growing position ids. RoPE scores depend only on the
distance between query and key positions, so the cache keeps every kept key at the place it would
have in a contiguous sequence [sinks | window | chunk] that ends at the caller's positions:

* window keys are the latest tokens, already contiguous with the new ones: they are never touched;
* once e tokens have been evicted between the sinks and the window, the sink keys are rotated by
  +e positions (R(a) R(b) = R(a + b)), so they sit just before the window's first token.

The model therefore sees in-cache distances (< S + W + q) however long the stream: the scores are
those of the kept keys placed at StreamingLLM's positions 0, 1, 2, ... The stored sink keys stay as
first written; each forward rotates a copy by the current e (angles in float64, reduced mod 2 pi),
so rounding never accumulates. Absolute positions still grow under `generate()` (fp32 RoPE angles
lose precision as they grow: ~1e-3 rad at position 2e4); a decoding loop that owns its positions
(`gqakit.decode.streaming`) calls `rebase()` now and then, which rotates the window back so that
it starts at position S: positions then stay below about 2 (S + W) + chunk forever.

Padding. Rows are left-padded. Pass the prompt's `attention_mask` so that each row's sinks are its
first S *real* tokens. Per row, the stored keys are right-aligned: [pads | real tokens] until the row
has more than S + W real tokens, then [S sinks | W recent] with no pads. Stored slot j is reported to
the mask builder as absolute column `seen - stored + j` (`get_mask_sizes`), which is exactly where a
left-padded 2D attention mask has its zeros, so `generate()`'s ever-growing mask stays consistent.
`WindowCache` needs neither the mask nor the RoPE frequencies (except for `rebase()`).

Scope: decoder-only models whose cached keys carry RoPE. Built with `rope=model`, the cache measures how (one
two-forward probe, `rope_probe`): the rotate-half or the interleaved (Cohere, GLM) layout, and which layers
carry none (NoPE layers, as SmolLM3's, keep their keys unrotated). Sliding-window layers work (the model builds
their masks from `get_mask_sizes`). Refused in one line: RoPE whose frequencies depend on the position (`dynamic`,
`longrope`), keys that move with the position otherwise, models with no RoPE layer (ALiBi, learned positions)
and layers that are no plain K/V cache (chunked, shared or linear attention). Layers that rotate by frequencies of
their own (Gemma 3's sliding and full layers) are each rotated by theirs. Given `rope` as an `inv_freq` tensor it
trusts the caller: rotate-half, every layer. Beam search and `crop()` (assisted decoding) raise.
`num_return_sequences > 1` works without `attention_mask`; with one, build the cache for the expanded batch (a
mismatch raises).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gqakit.decode.bounded import BoundedCache, BoundedLayer, check_sizes
from gqakit.decode.rope import KeyRotation, Turn

# ---------------------------------------------------------------------------------------------
# Bookkeeping shared by the layers of one cache
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """What one update of q tokens does, the same for every layer (computed once, on CPU)."""
    keep: int                      # stored positions after the update, min(N, S + W)
    kind: str                      # "suffix" (nothing evicted), "steady" (every row full), "gather"
    turns: tuple[Turn, ...] | None  # the sink rotation for this forward, one per frequency set; None: no row evicted
    index: torch.Tensor | None     # (B, keep) slots of [stored | chunk] to keep ("gather" only)
    stored_sinks: torch.Tensor | None  # (B,) rows whose sinks are re-read from storage ("gather")


class _Policy:
    """Sinks, window, per-row left padding and rebase shifts; plans each update for all layers."""

    def __init__(self, sinks: int, window: int, rotation: KeyRotation | None,
                 padding: torch.Tensor | None):
        self.sinks, self.window, self.rotation = sinks, window, rotation
        self.padding = padding  # (B,) int64 on CPU, or None until the batch size is known
        self.shift: torch.Tensor | None = None  # (B,) positions removed by rebase()
        self._memo: tuple | None = None

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def bind(self, batch: int, head_dim: int, freq: int | None) -> None:
        """Take the batch size from a layer's first keys, and check that its frequency set fits its head_dim."""
        if self.padding is None:
            self.padding = torch.zeros(batch, dtype=torch.long)
        elif self.padding.shape[0] != batch:
            raise ValueError(f"the cache was built for batch {self.padding.shape[0]} (attention_mask) but "
                             f"the model fed batch {batch}; build one cache per batch")
        if self.shift is None:
            self.shift = torch.zeros(batch, dtype=torch.long)
        dims = 2 * self.rotation.freqs[freq].numel() if self.rotation is not None and freq is not None else 0
        if dims > head_dim:  # each layer against its own set (Gemma 4's layer types differ in head_dim)
            raise ValueError(f"RoPE has {dims} rotary dims but head_dim is {head_dim}; "
                             "pass the rope of the model whose keys are cached")

    def real_tokens(self, seen: int) -> torch.Tensor:
        """(B,) real (non-padding) tokens among the first `seen` columns."""
        return (seen - self.padding).clamp(min=0)

    def plan(self, seen: int, stored: int, q: int) -> _Plan:
        key = (seen, stored, q)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        S, cap = self.sinks, self.capacity
        n_cached, keep = stored + q, min(stored + q, cap)
        p_min, p_max = int(self.padding.min()), int(self.padding.max())
        if seen + q - p_min <= cap:  # no row holds more than S + W real tokens: keep a suffix
            plan = _Plan(keep, "suffix", None, None, None)
        else:
            was_full = self.real_tokens(seen) > cap  # (B,)
            turns = None
            if S > 0 and seen - p_min > cap:  # some row has evicted: its sinks move up to its window
                evicted = (self.real_tokens(seen) - cap).clamp(min=0)
                turns = self.rotation.rotation(evicted - self.shift)
            if seen - p_max > cap:  # every row was already [S sinks | W recent], chunk all real
                plan = _Plan(keep, "steady", turns, None, None)
            else:
                real_now = self.real_tokens(seen + q)
                in_cache = self.real_tokens(seen).clamp(max=cap) + (real_now - self.real_tokens(seen))
                index = torch.arange(n_cached - keep, n_cached).expand(len(real_now), keep).clone()
                first_real = n_cached - in_cache  # (B,) slot of each row's first real token
                sink_slots = first_real[:, None] + torch.arange(S)[None, :]  # (B, S)
                full_now = (real_now > cap)[:, None]
                index[:, :S] = torch.where(full_now, sink_slots, index[:, :S])
                plan = _Plan(keep, "gather", turns, index, was_full)
        self._memo = (key, plan)
        return plan

    def invalidate(self) -> None:
        self._memo = None


# ---------------------------------------------------------------------------------------------
# The cache layer and the caches
# ---------------------------------------------------------------------------------------------

class SinkLayer(BoundedLayer):
    """One layer of a `SinkCache`: stores (B, G, <= S + W, d) keys and values."""

    owner = "SinkCache"

    def __init__(self, policy: _Policy, freq: int | None = 0):
        super().__init__()
        self.policy = policy
        self.freq = freq  # the frequency set its keys carry; None: a NoPE layer, whose keys stay where they are
        self.columns = 0  # columns fed so far, padding included (what get_seq_length reports)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :].clone()  # (B, G, 0, d)
        self.values = value_states[..., :0, :].clone()
        self.policy.bind(key_states.shape[0], key_states.shape[-1], self.freq)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append q new (already rotated) K/V; return [sinks | window | chunk] and keep <= S + W."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        S, W = self.policy.sinks, self.policy.window
        stored, q = self.keys.shape[-2], key_states.shape[-2]
        plan = self.policy.plan(self.columns, stored, q)
        n = stored + q
        if plan.turns is not None and self.freq is not None:  # sinks rotated up to sit just before the window
            sinks = self.policy.rotation.rotate(self.keys[..., :S, :], plan.turns[self.freq])
            keys = torch.cat([sinks, self.keys[..., S:, :], key_states], dim=-2)  # (B, G, n, d)
        else:
            keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)

        if plan.kind == "suffix":
            self.keys, self.values = keys[..., n - plan.keep:, :], values[..., n - plan.keep:, :]
        elif plan.kind == "steady":  # stored sinks stay unrotated; the window is the last W
            self.keys = torch.cat([self.keys[..., :S, :], keys[..., n - W:, :]], dim=-2)
            self.values = torch.cat([values[..., :S, :], values[..., n - W:, :]], dim=-2)
        else:
            b, g, _, d = keys.shape
            index = plan.index.to(keys.device)[:, None, :, None].expand(b, g, plan.keep, d)
            new_keys = keys.gather(2, index)
            if plan.turns is not None:  # rows that were already full re-read their unrotated sinks
                was_full = plan.stored_sinks.to(keys.device)[:, None, None, None]
                new_keys[..., :S, :] = torch.where(was_full, self.keys[..., :S, :], new_keys[..., :S, :])
            self.keys, self.values = new_keys, values.gather(2, index)
        self.columns += q
        return keys, values

    def seen(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return self.policy.capacity

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.columns = 0
        self.policy.invalidate()


def _left_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B,) count of leading zeros of a left-padded 2D mask (validated)."""
    if attention_mask is None:
        return None
    mask = attention_mask.detach().to("cpu").bool()
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2D (batch, length), got shape {tuple(mask.shape)}")
    if mask.shape[1] > 1 and (mask[:, 1:].int() < mask[:, :-1].int()).any():
        raise ValueError("attention_mask is not left-padded; tokenize with padding_side='left'")
    return (~mask).sum(dim=-1).long()


class SinkCache(BoundedCache):
    """StreamingLLM cache: the first `sinks` real tokens plus the `window` most recent, per row.

    Args:
        sinks: S >= 0 attention-sink tokens kept forever (the first S real tokens of each row).
        window: W >= 1 most recent tokens kept (the current token attends S + W + itself).
        rope: the model (how its keys rotate is measured: `rope_probe`) or its RoPE `inv_freq` (taken as
            rotate-half on every layer); needed when S > 0
            (to re-rotate the sinks) and for `rebase()`.
        attention_mask: the prompt's left-padded 2D mask, if the batch is padded; tokens fed after
            the prompt are taken as real.

    Use it with `model(..., cache=cache)` or `model.generate(..., cache=cache)` (`past_key_values=` before
    transformers 5.24; `gqakit.hf.compat.cache_kwargs` picks the name)
    (one cache per call; `prefill_chunk_size` bounds memory for prompts longer than S + W).
    """

    def __init__(self, sinks: int, window: int, rope: torch.nn.Module | torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None):
        rotation = check_sizes("SinkCache", sinks, window, rope)
        self.policy = self.state = _Policy(sinks, window, rotation, _left_padding(attention_mask))
        super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> SinkLayer:
        return SinkLayer(self.policy, self.next_layer_freq())

    def _seen(self) -> int:
        return self.layers[0].columns if self.layers else 0

    def position_ids(self, length: int) -> torch.Tensor:
        """(B, length) positions for the next `length` columns: a row's first real token is 0, minus
        what `rebase()` removed; padding columns get 0 (as `generate()` numbers them)."""
        if self.policy.padding is None:
            raise ValueError("position_ids() needs the batch size: feed the first chunk without it, "
                             "or build the cache with attention_mask")
        seen = self._seen()
        real = seen + torch.arange(length)[None, :] - self.policy.padding[:, None]  # (B, length)
        shift = self.policy.shift if self.policy.shift is not None else 0
        return torch.where(real >= 0, real - torch.as_tensor(shift)[..., None], 0)

    def padding_mask(self, length: int) -> torch.Tensor | None:
        """A 2D mask (B, seen + length) for the next forward, or None when no padding can be in view."""
        padding = self.policy.padding
        if padding is None or int(padding.max()) == 0:
            return None
        seen = self._seen()
        stored = self.layers[0].keys.shape[-2] if self.layers and self.layers[0].is_initialized else 0
        if seen - stored >= int(padding.max()):  # every padding column is already out of view
            return None
        return torch.arange(seen + length)[None, :] >= padding[:, None]

    def rebase(self) -> None:
        """Rotate each full row's window back so that it starts at position S (sinks at 0..S-1).

        After this, a row's next token takes position S + W: call it when positions grow large. The
        caller must number later tokens from `position_ids()` (which accounts for the shift).
        """
        pol = self.policy
        if not self.layers or pol.shift is None:
            return
        if pol.rotation is None:
            raise ValueError("rebase() rotates keys and needs the model's RoPE: build the cache with rope=model")
        evicted = (pol.real_tokens(self._seen()) - pol.capacity).clamp(min=0)
        delta = evicted - pol.shift
        if not bool((delta != 0).any()):
            return
        turns = pol.rotation.rotation(-delta)
        S = pol.sinks
        for layer in self.layers:  # rows with delta 0 (not full yet) are rotated by an exact identity
            if layer.freq is not None:
                moved = pol.rotation.rotate(layer.keys[..., S:, :], turns[layer.freq])
                layer.keys = torch.cat([layer.keys[..., :S, :], moved], dim=-2)
        pol.shift = evicted
        pol.invalidate()

    def reset(self) -> None:
        super().reset()
        if self.policy.shift is not None:
            self.policy.shift.zero_()


class WindowCache(SinkCache):
    """The W most recent tokens only (a rolling window, constant memory): `SinkCache` with S = 0.

    Needs no RoPE and no attention mask (padding never needs special handling with S = 0), except
    that `rebase()` needs `rope`.
    """

    def __init__(self, window: int, rope: torch.nn.Module | torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None):
        super().__init__(0, window, rope=rope, attention_mask=attention_mask)
