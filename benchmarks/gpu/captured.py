"""A decode step as a server runs it: a static KV cache, attention that reads each cached K/V head once, and the
whole step captured once as a CUDA graph and replayed, so no Python runs per token.

transformers' eager decode step is host-bound on the device image (52-92 ms per step at every batch, context and K/V
count on the H200, far above the time to read the cache), so the time a smaller cache saves does not show in it.
Three things change here, each checked against the eager model on CPU (tests/test_captured_decode.py):

- `static_cache`: transformers' `StaticCache` with `context` positions of random keys and values already in it and
  room for `room` more (the contents do not change the cost of reading them).
- `grouped_attention`, registered as `GROUPED` with transformers' own sdpa mask: the H query heads are grouped per
  K/V head, (B, G, H/G x Tq, d) @ (B, G, d, Tk), so each cached K/V head is read once and never repeated to H heads.
  transformers' sdpa path repeats K/V to H heads whenever it is given a mask, and a static cache always gives one.
- `CapturedDecoder`: fixed token and position buffers; one step is the forward, the argmax fed back as the next
  token and the position advanced, all on the device. On CUDA it is captured once (after warm-up on a side stream)
  and each `step()` replays it; on CPU it runs eagerly (dry runs and tests).

A benchmark's machinery, never a product path: gqakit's attention kinds take their offsets as Python integers,
which a graph would freeze.
"""
from __future__ import annotations

GROUPED = "gqakit_bench_grouped"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q (B, H, Tq, d), k / v (B, G, Tk, d | dv), a boolean (B, 1, Tq, Tk) mask
    (True = attend) or an additive float one -> (B, Tq, H, dv). Scores and softmax in float32."""
    import torch

    for name in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{GROUPED} does not implement {name}; benchmark this model with sdpa")
    if dropout and module.training:
        raise ValueError(f"{GROUPED} is for inference; call model.eval()")
    B, H, Tq, d = query.shape
    G, Tk = key.shape[1], key.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads do not group over {G} K/V heads")
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(B, G, (H // G) * Tq, d)  # heads of one group, then positions: contiguous in (B, H, Tq, d)
    scores = (q @ key.transpose(-1, -2)).float().view(B, G, H // G, Tq, Tk) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, None]  # (B, 1, 1, Tq, Tk): one mask for every head
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask.float())
    weights = scores.softmax(-1).to(value.dtype).view(B, G, (H // G) * Tq, Tk)
    out = (weights @ value).view(B, H, Tq, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `grouped_attention` (and transformers' sdpa mask for it) under `GROUPED`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, sdpa_mask)
    return GROUPED


def static_cache(model, batch: int, context: int, room: int, dtype, seed: int = 0, fill=None):
    """A StaticCache of `context + room` positions per layer holding `context` of them: `fill(layer)` -> (keys,
    values) of shape (batch, heads, context, dim) when given (tests copy another cache), else random ones."""
    import torch
    from decode_kv_heads import cached_shapes
    from transformers import StaticCache

    cfg, device = model.config, model.device
    cache = StaticCache(config=cfg, max_cache_len=context + room)
    g = torch.Generator(device).manual_seed(seed)
    shape, second = cached_shapes(cfg, batch, context)
    for i, layer in enumerate(cache.layers):
        keys, values = fill(i) if fill else (torch.randn(shape, generator=g, device=device, dtype=dtype),
                                             torch.randn(second, generator=g, device=device, dtype=dtype))
        layer.lazy_initialization(keys[:, :, :1], values[:, :, :1])
        layer.keys[:, :, :context].copy_(keys)
        layer.values[:, :, :context].copy_(values)
        layer.cumulative_length.fill_(context)
    return cache


class CapturedDecoder:
    """Greedy single-token decode over a static cache, every step the same device work: captured once on CUDA.

    `step()` advances the cache by one position and returns the next tokens (B, 1) (a buffer the next step
    overwrites); `logits` is the last step's (B, 1, vocab). At most `room` steps fit, warm-up included: past them
    the cache would be written out of bounds (a device assert), so a further step is refused here."""

    WARMUP = 2

    def __init__(self, model, cache, batch: int, context: int, room: int, first_token=None):
        import torch

        from gqakit.hf.compat import cache_kwargs

        self.model, self.left = model, room
        self.cache_kwargs = cache_kwargs(model, cache)  # {keyword: cache} on this transformers release
        device = model.device
        self.token = (torch.zeros(batch, 1, dtype=torch.long, device=device) if first_token is None
                      else first_token.clone())
        self.position = torch.full((batch, 1), context, dtype=torch.long, device=device)
        self.logits = None
        self.graph = None
        if device.type == "cuda":
            self._capture()

    def _forward(self) -> None:
        import torch

        with torch.no_grad():
            self.logits = self.model(self.token, **self.cache_kwargs, position_ids=self.position, use_cache=True).logits
            self.token.copy_(self.logits[:, -1:].argmax(-1))
            self.position.add_(1)

    def _capture(self) -> None:
        import torch

        if self.left < self.WARMUP + 1:
            raise ValueError(f"room for {self.left} steps; capturing needs {self.WARMUP} warm-up steps and one more")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
            for _ in range(self.WARMUP):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.left -= self.WARMUP
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: the cache does not advance here
            self._forward()

    def step(self):
        if self.left <= 0:
            raise RuntimeError("the static cache is full: build the decoder with more room")
        self.left -= 1
        if self.graph is None:
            self._forward()
        else:
            self.graph.replay()
        return self.token
