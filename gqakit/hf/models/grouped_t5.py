"""T5 with grouped K/V heads, as in the GQA paper (Ainslie et al. 2023): the decoder's self-attention and
cross-attention hold G key/value heads; the encoder keeps all H (or, optionally, G as well).

A thin subclass of transformers' T5: the config adds the two K/V head counts; each grouped attention keeps T5's
maths (no 1/sqrt(d) scaling, the relative position bias per query head, T5's cache handling) and differs only in
its K/V projections (G heads of d_kv rows) and in what the cache holds (G heads). The attention kernels see G
heads and `num_key_value_groups` (sdpa and flex group natively); T5's eager kernel broadcasts heads, so it gets
each K/V head repeated for its group. Registered with transformers' Auto classes when `gqakit` is imported
(model_type `gqakit_t5`); no remote code, nothing copied into checkpoints.
"""
from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache
from transformers.models.t5 import modeling_t5 as stock


@strict
class GroupedT5Config(T5Config):
    model_type = "gqakit_t5"
    num_key_value_heads: int | None = None  # the decoder's K/V heads (self- and cross-attention); None: num_heads
    encoder_num_key_value_heads: int | None = None  # the encoder's; None: num_heads (the paper keeps it MHA)

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        for key in ("num_key_value_heads", "encoder_num_key_value_heads"):
            value = getattr(self, key)
            if value is None:
                setattr(self, key, self.num_heads)
            elif value < 1 or self.num_heads % value:
                raise ValueError(f"{key}={value} must be a positive divisor of num_heads={self.num_heads}")


class GroupedT5Attention(stock.T5Attention):
    """T5 attention (self or cross) with `kv_heads` K/V heads: k and v project to kv_heads * d_kv rows."""

    def __init__(self, config: T5Config, kv_heads: int, has_relative_attention_bias=False, layer_idx=None,
                 is_causal=False):
        super().__init__(config, has_relative_attention_bias=has_relative_attention_bias, layer_idx=layer_idx,
                         is_causal=is_causal)
        self.kv_heads = kv_heads
        self.num_key_value_groups = self.n_heads // kv_heads
        self.k = nn.Linear(self.d_model, kv_heads * self.key_value_proj_dim, bias=False)
        self.v = nn.Linear(self.d_model, kv_heads * self.key_value_proj_dim, bias=False)

    def _keys_and_values(self, hidden_states, key_value_states, cache, kwargs):
        """(key, value) with G heads, from the cache where T5 reuses it (cross-attention after the first step)."""
        cross = key_value_states is not None
        layers = cache
        if isinstance(cache, EncoderDecoderCache):
            layers = cache.cross_attention_cache if cross else cache.self_attention_cache
            if cross and cache.is_updated.get(self.layer_idx):
                held = layers.layers[self.layer_idx]
                return held.keys, held.values
        source = key_value_states if cross else hidden_states
        shape = (*source.shape[:-1], self.kv_heads, self.key_value_proj_dim)
        key, value = (proj(source).view(shape).transpose(1, 2) for proj in (self.k, self.v))
        if cache is not None:
            key, value = layers.update(key, value, self.layer_idx, kwargs=kwargs)
            if cross and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True
        return key, value

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        rows = hidden_states.shape[:-1]
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if isinstance(past, torch.Tensor):  # a static cache's length is a tensor that the update below moves on
            past = past.clone()
        query = self.q(hidden_states).view(*rows, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        key, value = self._keys_and_values(hidden_states, key_value_states, cache, kwargs)
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(rows[1], key.shape[-2], device=query.device, past_seen_tokens=past)
            else:
                position_bias = query.new_zeros(1, self.n_heads, rows[1], key.shape[-2])
                if self.gradient_checkpointing and self.training:
                    position_bias.requires_grad = True
        attention = stock.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                stock.eager_attention_forward)
        if attention is stock.eager_attention_forward and self.num_key_value_groups > 1:
            key, value = (x.repeat_interleave(self.num_key_value_groups, dim=1) for x in (key, value))
        out, weights = attention(self, query, key, value, mask, dropout=self.dropout if self.training else 0.0,
                                 scaling=self.scaling, position_bias=position_bias, **kwargs)
        return self.o(out.reshape(*rows, -1).contiguous()), position_bias, weights


def _group(stack: stock.T5Stack, kv_heads: int, cross: bool) -> None:
    """Replace a stack's self-attention (and cross-attention) modules with grouped ones of `kv_heads` heads."""
    config = stack.config
    if kv_heads == config.num_heads:
        return
    for i, block in enumerate(stack.block):
        own = block.layer[0].SelfAttention
        block.layer[0].SelfAttention = GroupedT5Attention(
            config, kv_heads, has_relative_attention_bias=own.has_relative_attention_bias, layer_idx=i,
            is_causal=own.is_causal)
        if cross:
            block.layer[1].EncDecAttention = GroupedT5Attention(config, kv_heads, layer_idx=i)


class GroupedT5ForConditionalGeneration(T5ForConditionalGeneration):
    config_class = GroupedT5Config

    def __init__(self, config: GroupedT5Config):
        super().__init__(config)
        _group(self.encoder, config.encoder_num_key_value_heads, cross=False)
        _group(self.decoder, config.num_key_value_heads, cross=True)
        self.post_init()


def register() -> None:
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    AutoConfig.register(GroupedT5Config.model_type, GroupedT5Config, exist_ok=True)
    AutoModelForSeq2SeqLM.register(GroupedT5Config, GroupedT5ForConditionalGeneration, exist_ok=True)
