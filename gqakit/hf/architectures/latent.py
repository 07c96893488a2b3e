"""Latent attention (MLA) in a stock class: which families transformers' `DeepseekV3ForCausalLM` can host, the shape
of the latent, the target's tensor names and its config.json. Torch-free.

DeepseekV3's attention caches, per token and layer, a latent `c` (`kv_lora_rank` values, after an RMSNorm that it
always applies) and one RoPE key shared by every head (`qk_rope_head_dim`); `kv_b_proj` expands the latent into each
head's position-free key part and its value. An MQA layer is one such layer exactly: its one key is the shared RoPE
key (`qk_rope_head_dim = head_dim`, `qk_nope_head_dim = 0`), its one value is the latent (`kv_b_proj` copies it to
every head), and one more latent coordinate, whose projection row is zero and whose bias is a large constant B,
turns the latent's RMSNorm into a constant scale that the norm's weight cancels (`attention_bias: true`). The
norm then scales the value by (1 + |v|^2 / B^2)^-1/2 instead of 1: with B = 2^15 (a power of two, exact in every
float dtype, and below float16's largest value) that is within float32's resolution for |v| up to about 11, and
1 - 5e-7 at |v| = 32. The rest of DeepseekV3's decoder layer (RMSNorms, the SiLU-gated MLP when every layer is
dense, sequential residuals, RoPE in the rotate-half layout with `rope_interleave: false`) is a Llama layer's, so a
family hosts when its layers are Llama's.

Bias-free (`--bias-free`): no bias coordinate and `attention_bias: false`, as serving stacks (vLLM, SGLang) build
DeepSeek's projections. The latent's RMSNorm then acts on the latent itself (each token's latent divided by its own
RMS), which no weight cancels: such a layer is not any MQA's function, and is trained with the norm in the loop.
"""
from __future__ import annotations

import dataclasses

from gqakit.common.errors import opt
from gqakit.hf.config_defaults import filled_or_given, rope_of

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
HOSTS = ("llama", "mistral")  # families (ArchSpec.family) whose decoder layer DeepseekV3's computes with dense MLPs
BIAS_SCALE = 2.0 ** 15  # B, the constant latent coordinate
ROPE_TYPES = (None, "default", "linear", "dynamic", "llama3")  # computed from rope_theta and the RoPE width alone

ATTENTION = "model.layers.{i}.self_attn."  # the target's attention tensors, under this prefix
Q, O, O_BIAS = "q_proj.weight", "o_proj.weight", "o_proj.bias"
KV_A, KV_A_BIAS, KV_NORM, KV_B = ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
                                  "kv_b_proj.weight")
BIASES = (KV_A_BIAS, O_BIAS)  # the tensors a bias-free latent does not have
# convert-gqa --transfer-params (kv | qkvo), read for latent attention: the projections attention transfer trains
LATENT_PARAMS = {"kv": (KV_A, KV_B), "qkvo": (Q, KV_A, KV_B, O)}


@dataclasses.dataclass(frozen=True)
class LatentShape:
    """One layer's latent attention: `rank` latent values (the bias coordinate not counted), a shared RoPE key of
    `rope_dim`, per-head position-free key parts of `nope_dim` and values of `v_dim`; with `bias`, one more latent
    coordinate (the constant that cancels the latent's RMSNorm) and `attention_bias: true`."""

    heads: int
    rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    bias: bool = True

    @property
    def latent(self) -> int:
        """kv_lora_rank: the latent, and its bias coordinate where there is one."""
        return self.rank + (1 if self.bias else 0)

    @property
    def values_per_token(self) -> int:
        """What the stock class caches per token and layer: the latent and the shared RoPE key."""
        return self.latent + self.rope_dim

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """The target's attention tensor shapes, by name under ATTENTION."""
        shapes = {Q: (self.heads * (self.nope_dim + self.rope_dim), hidden),
                  KV_A: (self.latent + self.rope_dim, hidden), KV_A_BIAS: (self.latent + self.rope_dim,),
                  KV_NORM: (self.latent,), KV_B: (self.heads * (self.nope_dim + self.v_dim), self.latent),
                  O: (hidden, self.heads * self.v_dim), O_BIAS: (hidden,)}
        return shapes if self.bias else {name: size for name, size in shapes.items() if name not in BIASES}


def is_latent(config) -> bool:
    """Is this config (a dict or a transformers config) latent attention, which caches a latent and a shared RoPE
    key per token instead of keys and values?"""
    rank = config.get("kv_lora_rank") if isinstance(config, dict) else getattr(config, "kv_lora_rank", None)
    return bool(rank)


def fitted_shape(heads: int, kv_heads: int, head_dim: int, rank: int | None, rope_dim: int | None,
                 bias: bool = True) -> LatentShape:
    """--kv-rank / --rope-dim: the latent fitted to the source's K/V heads. Without --rope-dim it is head_dim (the
    cache holds rank + 1 + head_dim values per token); without --kv-rank it is 2 x head_dim - rope_dim (the cache
    holds MQA's 2 x head_dim + 1)."""
    rope_dim = head_dim if rope_dim is None else rope_dim
    rank = 2 * head_dim - rope_dim if rank is None else rank
    return LatentShape(heads=heads, rank=rank, rope_dim=rope_dim, nope_dim=head_dim - rope_dim, v_dim=head_dim,
                       bias=bias)


def shape_refusal(shape: LatentShape, kv_heads: int, config: dict) -> str | None:
    """Why the source cannot take this latent (a sentence naming the option and the values that fit), or None."""
    d = shape.v_dim
    if shape.rope_dim < 2 or shape.rope_dim > d or shape.rope_dim % 2:
        return f"{opt('rope_dim', shape.rope_dim)} must be an even number of dims from 2 to the head_dim {d}"
    held = kv_heads * (shape.nope_dim + d)
    most = min(held, config.get("hidden_size") or held)  # the fit's SVD has no more directions than its input's
    if not 1 <= shape.rank <= most:
        return (f"{opt('kv_rank', shape.rank)} must be from 1 to {most} (at most the {held} position-free key and "
                f"value dims of the {kv_heads} K/V heads that the latent holds, and at most the hidden size)")
    kind = rope_of(config).get("rope_type")
    if shape.rope_dim < d and kind not in (None, "default", "linear"):
        return (f"{opt('rope_dim', shape.rope_dim)} keeps the highest RoPE frequencies by a new rope_theta, "
                f"which {kind} scaling does not allow; use {opt('rope_dim', d)}")
    return None


def mqa_shape(heads: int, head_dim: int, bias: bool = True) -> LatentShape:
    """The latent that holds an MQA layer: its value as the latent, its key as the shared RoPE key (exactly with
    the bias coordinate; bias-free, up to the latent's RMSNorm)."""
    return LatentShape(heads=heads, rank=head_dim, rope_dim=head_dim, nope_dim=0, v_dim=head_dim, bias=bias)


def host_refusal(family: str, config: dict) -> str | None:
    """Why DeepseekV3 cannot compute this model's layers (a clause after "it"), or None when it can."""
    if config.get("is_encoder_decoder"):
        return "is an encoder-decoder, and the stock latent-attention class (DeepseekV3) is a decoder only"
    if family not in HOSTS:
        return (f"is a {family} model, whose layers the stock DeepseekV3 class cannot compute (it has RMSNorms, a "
                f"SiLU-gated MLP and sequential residuals); latent attention hosts {', '.join(HOSTS)}")
    rope, config = rope_of(config), filled_or_given(config)  # the class's defaults where config.json is silent
    if rope.get("rope_type") not in ROPE_TYPES:
        return f"uses {rope.get('rope_type')} RoPE scaling, which DeepseekV3 applies differently"
    factor = rope.get("partial_rotary_factor")
    if factor not in (None, 1, 1.0):
        return f"rotates only part of each head (partial_rotary_factor {factor})"
    for key, what in (("attention_bias", "biases on q/k/v/o"), ("mlp_bias", "MLP biases")):
        if config.get(key):
            return f"has {what} ({key}: true), which DeepseekV3's q_proj and MLP do not take"
    window = config.get("sliding_window")
    if window is not None and config.get("use_sliding_window", True) and window < config.get(
            "max_position_embeddings", window + 1):
        return f"attends within a sliding window of {window}, which DeepseekV3 does not"
    return None


def pair_frequencies(config: dict, head_dim: int) -> tuple[float, ...]:
    """The source's RoPE angle per position of each rotate-half pair j (dims j, j + d/2), highest first, for the kinds
    a fitted latent may leave dims of unrotated (default and linear: `shape_refusal`)."""
    rope = rope_of(config)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    factor = rope.get("factor", 1.0) if rope.get("rope_type") == "linear" else 1.0
    return tuple(theta ** (-2 * j / head_dim) / factor for j in range(head_dim // 2))


def latent_config(config: dict, shape: LatentShape, layers: int) -> dict:
    """The target's config.json from the (grouped) source's, with its class's defaults where it is silent (DeepseekV3's
    differ: a 4096-token context, token ids 0 / 1): every layer dense, no MoE, no multi-token prediction."""
    config = filled_or_given(config)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings", "rms_norm_eps",
            "hidden_act", "initializer_range", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "attention_dropout", "dtype", "torch_dtype", "use_cache")
    new = {key: config[key] for key in keep if key in config}
    rope = {k: v for k, v in rope_of(config).items() if k != "type"}  # its kind is in rope_type
    if "rope_theta" in config:
        rope.setdefault("rope_theta", config["rope_theta"])
    rope.setdefault("rope_type", "default")
    if shape.rope_dim < shape.v_dim:  # the stock class's D/2 frequencies are the source's D/2 highest
        rope["rope_theta"] = rope.get("rope_theta", 10000.0) ** (shape.rope_dim / shape.v_dim)
    new.update(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, num_hidden_layers=layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        kv_lora_rank=shape.latent, q_lora_rank=None, qk_rope_head_dim=shape.rope_dim,
        qk_nope_head_dim=shape.nope_dim, v_head_dim=shape.v_dim, rope_interleave=False, attention_bias=shape.bias,
        rope_parameters=rope, first_k_dense_replace=layers, n_routed_experts=1, n_shared_experts=1,
        num_experts_per_tok=1, n_group=1, topk_group=1, num_nextn_predict_layers=0,
    )
    return new
