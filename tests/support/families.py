"""Tiny random models of every family in gqakit's architecture tables, for the per-family tests
(tests/hf/test_architectures.py) and the calibration tests that run on each family."""
from __future__ import annotations

import math

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    FalconConfig,
    GemmaConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    NemotronConfig,
    Olmo2Config,
    OlmoConfig,
    OPTConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
    Starcoder2Config,
)

from gqakit.hf.models.grouped_bigcode import GroupedGPTBigCodeConfig  # noqa: E402  (gqakit's own class)

HIDDEN, HEADS, HEAD_DIM, LAYERS, VOCAB = 32, 4, 8, 2, 64
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64, **TOKENS,
)

# family -> (config class, extra config kwargs, how the family stores its K/V heads). The layout
# keys below are this test's own description of transformers' modules, independent of gqakit's table.
#   fused:      the K and V rows live in `qkv_proj` as [q | k | v]
#   knorm_rows: `k_norm.weight` has one block of head_dim entries per K/V head (OLMo2)
#   knorm_mods: one norm module per K/V head in `k_layernorm.norms.{h}` (StableLM)
FAMILIES = {
    "llama": (LlamaConfig, dict(head_dim=HEAD_DIM), {}),
    "mistral": (MistralConfig, dict(head_dim=HEAD_DIM, sliding_window=8), {}),
    "qwen2": (Qwen2Config, dict(), {}),  # q/k/v biases on by default
    "qwen3": (Qwen3Config, dict(head_dim=HEAD_DIM, attention_bias=True), {}),
    "gemma": (GemmaConfig, dict(head_dim=HEAD_DIM), {}),
    "gemma2": (Gemma2Config, dict(head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=8,
                                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0), {}),
    "gemma3": (Gemma3TextConfig, dict(head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=8,
                                      sliding_window_pattern=2), {}),
    "phi3": (Phi3Config, dict(original_max_position_embeddings=64), {"fused": True}),
    "olmo": (OlmoConfig, dict(), {}),
    "olmo2": (Olmo2Config, dict(), {"knorm_rows": True}),
    "stablelm": (StableLmConfig, dict(qk_layernorm=True, use_qkv_bias=True), {"knorm_mods": True}),
    "phi": (PhiConfig, dict(), {}),  # partial rotary 0.5, q/k/v/dense biases, one LayerNorm for both branches
    "starcoder2": (Starcoder2Config, dict(sliding_window=8), {}),  # biases on by default
    "granite": (GraniteConfig, dict(attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5,
                                    logits_scaling=2.0, attention_bias=True), {}),
    "nemotron": (NemotronConfig, dict(head_dim=HEAD_DIM, attention_bias=True), {}),  # partial rotary, LayerNorm1P
    # MHA form (multi_query false): fused c_attn rows per head [q_h, k_h, v_h]; converts to G = 1 or H only
    # gqakit's own grouped GPTBigCode, here with every K/V head: fused c_attn rows [q | k | v]
    "gqakit_gpt_bigcode": (GroupedGPTBigCodeConfig, dict(kv_heads=HEADS, n_embd=HIDDEN, n_head=HEADS,
                                                         n_layer=LAYERS, n_positions=64, n_inner=48),
                           {"grouped_bigcode": True}),
    # new_decoder_architecture: fused rows per K/V head [its query heads, k, v]; parallel attention, two norms
    "falcon": (FalconConfig, dict(new_decoder_architecture=True, num_kv_heads=HEADS, bias=True, alibi=False),
               {"falcon": True}),
    "gpt_bigcode": (GPTBigCodeConfig, dict(multi_query=False, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS,
                                           n_positions=64, n_inner=48), {"bigcode": True}),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo": "OlmoForCausalLM",
    "olmo2": "Olmo2ForCausalLM", "stablelm": "StableLmForCausalLM", "phi": "PhiForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM", "granite": "GraniteForCausalLM", "nemotron": "NemotronForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM", "falcon": "FalconForCausalLM",
    "gqakit_gpt_bigcode": "GroupedGPTBigCodeForCausalLM",
}

# MHA families without a grouped-K/V field, re-hosted (tests/hf/test_rehost.py): name -> config, fields overridable
_NEOX = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             intermediate_size=48, rotary_pct=0.5, max_position_embeddings=64)
REHOST_SOURCES = {
    "neox": lambda **kw: GPTNeoXConfig(**{**_NEOX, **kw}),
    "neox-nobias": lambda **kw: GPTNeoXConfig(**{**_NEOX, "rotary_pct": 1.0, "attention_bias": False, **kw}),
    "neox-seq": lambda **kw: GPTNeoXConfig(**{**_NEOX, "use_parallel_residual": False, **kw}),
    "gptj": lambda **kw: GPTJConfig(**{**dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                              rotary_dim=4, n_positions=64), **kw}),
    "gpt2": lambda **kw: GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                              n_positions=64, bos_token_id=1, eos_token_id=2), **kw}),
    "opt": lambda **kw: OPTConfig(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                            num_attention_heads=HEADS, ffn_dim=48, word_embed_proj_dim=HIDDEN,
                                            max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2), **kw}),
}

# encoder-decoder families, tested end to end in tests/hf/test_t5.py (their own fixtures)
SEQ2SEQ_ARCHITECTURES = {"gqakit_t5": "GroupedT5ForConditionalGeneration"}


def _config(family: str, **overrides):
    cls, extra, layout = FAMILIES[family]
    own_names = layout.get("bigcode") or layout.get("grouped_bigcode")
    common = {k: v for k, v in COMMON.items() if not own_names or k in ("vocab_size",) or "token" in k}
    return cls(**{**common, **extra, **overrides})


def perturb_(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every weight a scale that makes head differences visible and move every norm/bias off 1/0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:  # norm weights and biases
                p.add_(0.3 * noise)
            else:  # matrices and embeddings: unit-scale activations
                p.copy_(noise / math.sqrt(p.shape[-1]))


def load_exact(path, auto=AutoModelForCausalLM, attn: str = "eager"):
    """Load in fp32 with `attn` attention; the checkpoint must hold exactly the tensors the model needs
    (nothing missing and silently re-initialised, nothing unexpected, no shape mismatch)."""
    model, info = auto.from_pretrained(path, attn_implementation=attn, dtype=torch.float32, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    return model.eval()


def make_model(family: str, path, seed: int = 0, **overrides):
    """Build, perturb and save a tiny random model (a family of FAMILIES or REHOST_SOURCES); returns the folder."""
    torch.manual_seed(seed)
    config = REHOST_SOURCES[family](**overrides) if family in REHOST_SOURCES else _config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    assert family in REHOST_SOURCES or type(model).__name__ == ARCHITECTURES[family]
    perturb_(model, seed + 1)
    model.save_pretrained(path)
    return path
