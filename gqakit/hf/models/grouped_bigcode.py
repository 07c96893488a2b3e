"""GPTBigCode with G grouped K/V heads (1 <= G <= H): the home of GPT-2 and OPT at a G no stock class holds.

A thin subclass: the config adds `num_key_value_heads`; each block's attention keeps GPTBigCode's maths and
differs only in its fused projection, [q | k | v] with G key and G value heads, and in what the cache holds
(G heads). Registered with transformers' Auto classes when `gqakit` is imported (model_type
`gqakit_gpt_bigcode`); no remote code, nothing copied into checkpoints.
"""
from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
from transformers.configuration_utils import PreTrainedConfig
from transformers.models.gpt_bigcode import modeling_gpt_bigcode as stock


@strict
class GroupedGPTBigCodeConfig(GPTBigCodeConfig):
    model_type = "gqakit_gpt_bigcode"
    kv_heads: int = 1  # the K/V head count (num_key_value_heads reads it)

    def __post_init__(self, **kwargs):
        PreTrainedConfig.__post_init__(self, **kwargs)  # not GPTBigCode's: it derives the K/V heads from multi_query
        self.multi_query = False
        self.num_key_value_heads = self.kv_heads

        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must be a positive divisor of n_head={self.n_head}")


class GroupedGPTBigCodeAttention(stock.GPTBigCodeAttention):
    """GPTBigCode self-attention with G K/V heads: c_attn rows [q (H d) | k (G d) | v (G d)]."""

    def __init__(self, config: GroupedGPTBigCodeConfig, layer_idx=None):
        super().__init__(config, is_cross_attention=False, layer_idx=layer_idx)
        self.kv_heads = config.kv_heads
        self.kv_dim = self.kv_heads * self.head_dim
        self.num_key_value_groups = self.num_heads // self.kv_heads
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, output_attentions=False, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("gqakit's grouped GPTBigCode has no cross-attention")
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)  # (B, T, heads, d)
        query, key, value = self.c_attn(hidden_states).split((self.embed_dim, self.kv_dim, self.kv_dim), dim=-1)
        query, key, value = (x.view(shape).transpose(1, 2) for x in (query, key, value))  # (B, heads, T, d)
        if layer_past is not None:
            cache = getattr(layer_past, "self_attention_cache", layer_past)
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)  # G heads are cached
        interface = stock.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                stock.eager_attention_forward)
        dropout = self.attn_dropout if self.training else 0.0
        out, weights = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                 **kwargs)
        out = self.resid_dropout(self.c_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()))
        return out, weights


class GroupedGPTBigCodeForCausalLM(GPTBigCodeForCausalLM):
    config_class = GroupedGPTBigCodeConfig

    def __init__(self, config: GroupedGPTBigCodeConfig):
        super().__init__(config)
        for i, block in enumerate(self.transformer.h):
            block.attn = GroupedGPTBigCodeAttention(config, layer_idx=i)
        self.post_init()


def register() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(GroupedGPTBigCodeConfig.model_type, GroupedGPTBigCodeConfig, exist_ok=True)
    AutoModelForCausalLM.register(GroupedGPTBigCodeConfig, GroupedGPTBigCodeForCausalLM, exist_ok=True)
