"""The skeleton every bounded KV cache of gqakit shares: S attention sinks + W recent tokens per layer.

`SinkCache` (cache.py: generate() and the decoding loop, any batch, token by token or in chunks) and
`ChunkedSinkCache` (stream_cache.py: one stream, chunk-exact perplexity) differ in what one forward sees; what
they have in common is here: the size checks, the transformers `CacheLayerMixin` contract (mask sizes, sequence
length, the operations a bounded cache cannot do) and the byte count.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from gqakit.decode.rope import KeyRotation, rope_frequencies


def check_sizes(owner: str, sinks: int, window: int, rope) -> KeyRotation | None:
    """Refuse impossible sizes; how the cache rotates keys (None without `rope`): measured from the model when `rope`
    is one (`rope_probe`), else rotate-half by the given frequencies on every layer."""
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}; pass sinks=0 for a plain "
                         "sliding window or e.g. sinks=4")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be an int >= 1, got {window!r}; pass the number of recent "
                         "tokens to keep, e.g. window=1020")
    if sinks > 0 and rope is None:
        raise ValueError(f"{owner}(sinks={sinks}) re-rotates the sink keys and needs the model's "
                         "RoPE: pass rope=model (or use sinks=0)")
    if rope is None:
        return None
    if isinstance(rope, torch.Tensor):
        return KeyRotation(rope_frequencies(rope))
    model = getattr(rope, "_orig_mod", rope)  # torch.compile's wrapper: measure the model it runs
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"rope={type(rope).__name__} is neither a transformers model nor an inv_freq tensor; pass "
                         "rope=model (how its keys rotate is measured) or the inv_freq of its layers")
    from gqakit.decode.rope_probe import measure_rotation

    return measure_rotation(model)


class BoundedLayer(CacheLayerMixin):
    """One layer of a bounded cache. Subclasses store `keys` / `values` (and may hold more tensors: `held`), say
    how many columns the stream has fed (`seen`), and implement `update`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    owner = "this cache"  # the cache's class name, for messages

    def seen(self) -> int:
        raise NotImplementedError

    def stored(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def held(self) -> tuple[torch.Tensor, ...]:
        """The tensors this layer keeps between forwards (what `cache_bytes` counts)."""
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): stored slot j stands for absolute column seen - stored + j."""
        stored = self.stored()
        return stored + query_length, self.seen() - stored

    def get_seq_length(self) -> int:
        """Columns seen so far (padding included), as for a DynamicCache: the next query's offset."""
        return self.seen()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{self.owner} cannot be cropped (evicted tokens are gone); "
                                  "do not use assisted decoding with it")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{self.owner} does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{self.owner} does not support batch expansion; build it for the "
                                  "expanded batch (num_return_sequences=1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{self.owner} does not support batch selection")


class BoundedCache(Cache):
    """A transformers `Cache` of `BoundedLayer`s whose shared state (`self.state`) has `sinks`, `window` and
    `rotation` (a measured `KeyRotation`, or None)."""

    state = None

    @property
    def sinks(self) -> int:
        return self.state.sinks

    @property
    def window(self) -> int:
        return self.state.window

    def next_layer_freq(self) -> int | None:
        """The frequency set of the layer transformers appends next (layer `len(self.layers)`: layers are appended in
        order); set 0 where no rotation was measured."""
        rotation = self.state.rotation
        return 0 if rotation is None else rotation.freq_of(len(self.layers))

    def cache_bytes(self) -> int:
        """Bytes held between forwards by every layer (keys, values and whatever else a layer keeps)."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in layer.held())
