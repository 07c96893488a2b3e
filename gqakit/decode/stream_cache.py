"""A chunk-exact sink/window cache: C tokens per forward, each scored exactly as if fed one at a time.

Why not `gqakit.decode.cache.SinkCache` fed in chunks? Token-by-token, SinkCache shows token t the
S sinks and the W tokens before it, plus itself, with the sinks rotated to sit just before that window.
Fed a chunk of C tokens, it shows every token of the chunk the sinks and the W tokens before the
*chunk* plus the chunk's earlier tokens (up to W + C - 1 recent tokens), with one sink placement for
the whole chunk. That is a different (more generous) policy, so its perplexity is not the token-by-token
number. Two things must be exact per token instead:

* which keys: token t sees V(t) = {k <= t : k < S or k >= t - W} (sinks + the W tokens before it +
  itself), never more: an explicit 4-D additive mask, one row per token of the chunk;
* where the sinks sit: once t > S + W, token t sees sink j at distance S + W - j (just before its own
  window), so different tokens of one chunk need the sinks at different RoPE positions. A single set of
  keys cannot do that, so each forward appends one rotated copy of the S sink keys per distinct sink
  placement (U <= C copies; U = 1 until the first eviction) and the mask lets token t see only its copy.
  Sink keys are rotated from their stored positions with float64 angles (`rope.rope_rotation`).

Keys handed to attention: [U copies of the sinks | the last <= W non-sink tokens | the chunk]
(U*S + W + C keys at most; the sink tokens are seen only through the copies). Stored between forwards:
S sinks + W recent tokens, as in SinkCache. Per token the maths is SinkCache's token-by-token maths:
the same keys, the same relative positions, hence (multi-layer models included) the same hidden states.

Positions: token t is fed at position t - offset. Every `rebase_every` tokens the stored window is
rotated back by the growth (offset moves so the window starts at position S), so positions stay below
S + W + rebase_every + C (2 (S + W) + C by default) whatever the stream length (fp32 RoPE stays precise).

Batch 1 (one stream). The caller must call `prepare(C)` before each forward and pass the returned
position ids and mask to the model (`model(ids, position_ids=..., attention_mask=..., past_key_values=
cache)`); the model's attention must accept a 4-D additive mask (eager and sdpa do; gqakit's tiled
kinds ignore it, so they are refused). That mask replaces the model's own, so a model whose sliding-window layers
would hide part of the S + W + 1 keys a token sees is refused when built with `rope=model`. Which keys rotate, and
how, is measured from the model as for `SinkCache` (`rope_probe`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gqakit.decode.bounded import BoundedCache, BoundedLayer, check_sizes
from gqakit.decode.rope import KeyRotation, Turn


@dataclass(frozen=True)
class _Chunk:
    """The plan of one forward (the same for every layer)."""

    start: int  # stream index of the chunk's first token
    length: int  # C
    sinks_before: int  # sink tokens stored before this chunk
    sinks_after: int  # sink tokens once the chunk is in (the chunk's first sinks_after - sinks_before are sinks)
    recent: int  # non-sink tokens stored before the chunk (the last ones, at most W)
    turns: tuple[Turn, ...] | None  # per frequency set, (U, r/2) rotations, one per sink copy; None: one unrotated copy


class _Frame:
    """Stream state shared by the layers: tokens fed, position offset, the current chunk's plan."""

    def __init__(self, sinks: int, window: int, rotation: KeyRotation | None, rebase_every: int):
        self.sinks, self.window, self.rotation, self.rebase_every = sinks, window, rotation, rebase_every
        self.seen = 0
        self.offset = 0
        self.chunk: _Chunk | None = None

    def rebases(self, start: int) -> bool:
        """Whether the chunk fed from stream index `start` first moves the window back (`_grown`)."""
        return self.rotation is not None and _grown(start, self.sinks, self.window, self.offset, self.rebase_every)


def _grown(start: int, sinks: int, window: int, offset: int, every: int) -> bool:
    """Whether positions have grown by `every` since the window last started at position S (`_rebase`)."""
    return start - sinks - window - offset >= every


def positions_needed(sinks: int, window: int, chunk: int, tokens: int, rebase_every: int | None = None) -> int:
    """How many positions (the largest position id + 1) `ChunkedSinkCache` built with rope= feeds a model over a
    stream of `tokens` tokens, `chunk` per forward (the last token is not fed)."""
    every = sinks + window if rebase_every is None else rebase_every
    offset = top = 0
    for start in range(0, tokens - 1, chunk):
        if _grown(start, sinks, window, offset, every):
            offset = start - window - sinks
        top = max(top, min(start + chunk, tokens - 1) - offset)
    return top


class ChunkLayer(BoundedLayer):
    """One layer: stored sinks (1, G, <= S, d) and recent non-sink tokens (1, G, <= W, d)."""

    owner = "ChunkedSinkCache"

    def __init__(self, frame: _Frame, freq: int | None = 0):
        super().__init__()
        self.frame = frame
        self.freq = freq  # the frequency set its keys carry; None: a NoPE layer, whose keys stay where they are

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(f"ChunkedSinkCache streams one text (batch 1), got batch {key_states.shape[0]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[..., :0, :].clone(), value_states[..., :0, :].clone()
        self.sink_keys, self.sink_values = self.keys.clone(), self.values.clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the chunk's (rotated) K/V; return [sink copies | recent | chunk] and keep S + W."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.frame.chunk
        if plan is None or plan.length != key_states.shape[-2] or self.keys.shape[-2] != plan.recent:
            raise RuntimeError("call ChunkedSinkCache.prepare(length) before each forward and pass its "
                               "position_ids and attention_mask to the model")
        take = plan.sinks_after - plan.sinks_before
        sink_k = torch.cat([self.sink_keys, key_states[..., :take, :]], dim=-2)  # (1, G, s, d)
        sink_v = torch.cat([self.sink_values, value_states[..., :take, :]], dim=-2)
        _, g, s, d = sink_k.shape
        if plan.turns is None or s == 0:
            copies_k, copies_v = sink_k, sink_v
        else:  # a NoPE layer's copies are its unrotated sinks, one per copy (its mask picks one)
            u = plan.turns[0][0].shape[0]
            expanded = sink_k.expand(u, g, s, d)
            rotated = expanded if self.freq is None else self.frame.rotation.rotate(expanded, plan.turns[self.freq])
            copies_k = rotated.transpose(0, 1).reshape(1, g, u * s, d)  # copy-major: slot u * s + j
            copies_v = sink_v.expand(u, g, s, d).transpose(0, 1).reshape(1, g, u * s, d)
        keys = torch.cat([copies_k, self.keys, key_states], dim=-2)  # (1, G, U*s + recent + C, d)
        values = torch.cat([copies_v, self.values, value_states], dim=-2)
        window = self.frame.window
        self.sink_keys, self.sink_values = sink_k, sink_v
        self.keys = torch.cat([self.keys, key_states[..., take:, :]], dim=-2)[..., -window:, :]
        self.values = torch.cat([self.values, value_states[..., take:, :]], dim=-2)[..., -window:, :]
        return keys, values

    def seen(self) -> int:
        return self.frame.seen

    def held(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values, self.sink_keys, self.sink_values

    def get_max_length(self) -> int:
        return self.frame.sinks + self.frame.window

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = self.sink_values = None
        self.is_initialized = False


class ChunkedSinkCache(BoundedCache):
    """StreamingLLM's S sinks + W recent tokens, fed C tokens per forward with token-by-token results.

    Args:
        sinks: S >= 0 (S = 0 is a plain rolling window of W tokens).
        window: W >= 1 recent tokens before the current one.
        rope: the model (how its keys rotate is measured: `rope_probe`) or its RoPE `inv_freq` (taken as
            rotate-half on every layer); required when S > 0;
            without it (S = 0) positions are never rebased.
        rebase_every: re-base positions once they have grown by this many (default S + W).
    """

    def __init__(self, sinks: int, window: int, rope: torch.nn.Module | torch.Tensor | None = None,
                 rebase_every: int | None = None):
        rotation = check_sizes("ChunkedSinkCache", sinks, window, rope)
        rebase_every = sinks + window if rebase_every is None else rebase_every
        if rebase_every < 1:
            raise ValueError(f"rebase_every must be >= 1, got {rebase_every}")
        narrow = rotation.narrowest_window() if rotation is not None else None  # measured with a model
        if narrow is not None and narrow[1] < sinks + window + 1:  # its mask would replace the model's
            raise ValueError(f"layer {narrow[0]} of {type(rope.config).__name__} attends to a sliding window of "
                             f"{narrow[1]} tokens, fewer than the sinks + window + 1 = {sinks + window + 1} keys this "
                             f"cache shows a token; its mask replaces the model's, so keep sinks + window <= "
                             f"{narrow[1] - 1}")
        self.frame = self.state = _Frame(sinks, window, rotation, rebase_every)
        super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> ChunkLayer:
        return ChunkLayer(self.frame, self.next_layer_freq())

    def _rebase(self, start: int) -> None:
        """Rotate the stored window back so that its first token sits at position S (sinks stay at 0..S-1)."""
        f = self.frame
        new_offset = start - f.window - f.sinks  # > f.offset when called
        turns = f.rotation.rotation(torch.tensor([f.offset - new_offset]))
        for layer in self.layers:
            if layer.freq is not None and layer.is_initialized and layer.keys.shape[-2]:
                layer.keys = f.rotation.rotate(layer.keys, turns[layer.freq])
        f.offset = new_offset

    def prepare(self, length: int, dtype: torch.dtype = torch.float32, device=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan the next forward of `length` tokens: its position ids (1, C) and 4-D mask (1, 1, C, K)."""
        f = self.frame
        S, W, a = f.sinks, f.window, f.seen
        if length < 1:
            raise ValueError(f"a chunk needs at least one token, got {length}")
        if f.rebases(a):
            self._rebase(a)
        end = f.rotation.positions if f.rotation is not None else None  # a precomputed RoPE table ends there
        if end is not None and a + length - f.offset > end:
            raise ValueError(f"this chunk would take positions up to {a + length - 1 - f.offset}, past the model's "
                             f"{end}-position RoPE table; feed shorter chunks or keep fewer sinks + window")
        t = torch.arange(a, a + length)  # (C,) stream index of each query
        sinks_before, sinks_after = min(S, a), min(S, a + length)
        recent = max(0, min(a - S, W))
        turns = None
        inverse = torch.zeros(length, dtype=torch.long)
        copies = 1 if sinks_after else 0
        if sinks_after:
            # sink j must sit at position (t - offset) - min(t - j, S + W - j) = j + delta(t)
            delta = (t - S - W).clamp(min=0) - f.offset  # (C,) >= 0
            placements, inverse = torch.unique(delta, return_inverse=True)
            if placements.numel() > 1 or int(placements[0]) != 0:
                turns = f.rotation.rotation(placements)  # per set (U, r/2)
                copies = placements.numel()
        f.chunk = _Chunk(a, length, sinks_before, sinks_after, recent, turns)
        f.seen += length

        # allowed[i, key]: token t_i sees sinks j <= t_i (its own copy only), recent / chunk tokens
        # k with max(S, t_i - W) <= k <= t_i
        q = t[:, None]
        j = torch.arange(sinks_after)
        own = inverse[:, None, None] == torch.arange(copies)[None, :, None]  # (C, U, 1)
        sink_ok = (own & (j[None, None, :] <= t[:, None, None])).reshape(length, copies * sinks_after)
        recent_pos = torch.arange(a - recent, a)[None, :]
        chunk_pos = t[None, :]
        recent_ok = recent_pos >= q - W
        chunk_ok = (chunk_pos <= q) & (chunk_pos >= q - W) & (chunk_pos >= S)
        allowed = torch.cat([sink_ok, recent_ok, chunk_ok], dim=1)  # (C, K)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return (t - f.offset)[None].to(device), mask[None, None].to(device)

