"""The supported families. Tensor names were read off transformers' own modules (see the tests)."""
from __future__ import annotations

from gqakit.hf.architectures.spec import ArchSpec, KNorm

FAMILIES: tuple[ArchSpec, ...] = (
    ArchSpec("llama", ("LlamaForCausalLM",)),
    ArchSpec("mistral", ("MistralForCausalLM",)),
    ArchSpec("qwen2", ("Qwen2ForCausalLM",), notes="k/v biases are pooled with their heads"),
    ArchSpec(
        "qwen3", ("Qwen3ForCausalLM",),
        k_norm=KNorm.SHARED_PER_HEAD, k_norm_weight="model.layers.{i}.self_attn.k_norm.weight",
    ),
    ArchSpec("gemma", ("GemmaForCausalLM",)),
    ArchSpec("gemma2", ("Gemma2ForCausalLM",)),
    ArchSpec(
        "gemma3", ("Gemma3ForCausalLM",), model_type="gemma3_text",
        k_norm=KNorm.SHARED_PER_HEAD, k_norm_weight="model.layers.{i}.self_attn.k_norm.weight",
    ),
    ArchSpec(
        "phi3", ("Phi3ForCausalLM",),
        k_proj=None, v_proj=None, qkv_proj="model.layers.{i}.self_attn.qkv_proj",
    ),
    ArchSpec("olmo", ("OlmoForCausalLM",)),
    ArchSpec(
        "olmo2", ("Olmo2ForCausalLM",),
        k_norm=KNorm.SPANS_HEADS, k_norm_weight="model.layers.{i}.self_attn.k_norm.weight",
    ),
    ArchSpec("phi", ("PhiForCausalLM",), o_proj="model.layers.{i}.self_attn.dense",
             k_norm=KNorm.SHARED_PER_HEAD, k_norm_weight="model.layers.{i}.self_attn.k_layernorm.weight",
             k_norm_key="qk_layernorm",
             notes="Phi-1/1.5/2 (and GPT-NeoX / GPT-J re-hosted on it); partial rotary"),
    ArchSpec("starcoder2", ("Starcoder2ForCausalLM",)),
    ArchSpec(
        "gpt_bigcode", ("GPTBigCodeForCausalLM",),
        k_proj=None, v_proj=None, qkv_proj="transformer.h.{i}.attn.c_attn",
        q_proj="transformer.h.{i}.attn.q_attn", o_proj="transformer.h.{i}.attn.c_proj",
        config_names=(("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd")),
        multi_query_key="multi_query",
        grouped_class=("gqakit_gpt_bigcode", "GroupedGPTBigCodeForCausalLM", "kv_heads"),
        notes="stock: MQA or MHA; 1 < G < H: gqakit's GroupedGPTBigCodeForCausalLM (GPT-2 and OPT re-host on it)",
    ),
    ArchSpec(
        "gqakit_gpt_bigcode", ("GroupedGPTBigCodeForCausalLM",),
        k_proj=None, v_proj=None, qkv_proj="transformer.h.{i}.attn.c_attn",
        q_proj="transformer.h.{i}.attn.q_attn", o_proj="transformer.h.{i}.attn.c_proj",
        config_names=(("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd"),
                      ("num_key_value_heads", "kv_heads")),
        grouped_class=("gqakit_gpt_bigcode", "GroupedGPTBigCodeForCausalLM", "kv_heads"),
        notes="gqakit's own grouped GPTBigCode (gqakit/hf/models/grouped_bigcode.py): import gqakit to load it",
    ),
    ArchSpec("granite", ("GraniteForCausalLM",)),
    ArchSpec(
        "falcon", ("FalconForCausalLM",),
        k_proj=None, v_proj=None, qkv_proj="transformer.h.{i}.self_attention.query_key_value",
        q_proj="transformer.h.{i}.self_attention.q_proj", o_proj="transformer.h.{i}.self_attention.dense",
        config_names=(("num_key_value_heads", "num_kv_heads"),), qkv_layout="groups", head_dim_field=False,
        notes="new_decoder_architecture only (refused otherwise, see refused.py)",
        runtime_note=("transformers' Falcon before 5.25 expands K and V to every query head before its cache, so "
                      "there it keeps the MHA cache size; transformers 5.25 and later (and e.g. vLLM) cache the K/V "
                      "heads"),
        cache_holds_every_head_before="5.25",
    ),
    ArchSpec("nemotron", ("NemotronForCausalLM",)),
    ArchSpec(
        "gqakit_t5", ("GroupedT5ForConditionalGeneration",),
        k_proj="decoder.block.{i}.layer.0.SelfAttention.k", v_proj="decoder.block.{i}.layer.0.SelfAttention.v",
        q_proj="decoder.block.{i}.layer.0.SelfAttention.q", o_proj="decoder.block.{i}.layer.0.SelfAttention.o",
        kv_sites=(("cross", "decoder.block.{i}.layer.1.EncDecAttention.k",
                   "decoder.block.{i}.layer.1.EncDecAttention.v"),),
        encoder_kv=("encoder.block.{i}.layer.0.SelfAttention.k", "encoder.block.{i}.layer.0.SelfAttention.v"),
        config_names=(("num_attention_heads", "num_heads"), ("hidden_size", "d_model"), ("head_dim", "d_kv"),
                      ("num_hidden_layers", "num_decoder_layers")),
        grouped_class=("gqakit_t5", "GroupedT5ForConditionalGeneration", "num_key_value_heads"),
        head_dim_field=False,
        not_layerwise="is an encoder-decoder, whose cross-attention the calibration pass does not run",
        notes="T5 / Flan-T5 / mT5 (re-hosted, same tensors): the decoder's self- and cross-attention are grouped, the "
              "encoder only with --pool-encoder, as in the GQA paper; the relative position bias stays per query head",
        runtime_note=("the decoder's cross-attention cache holds G heads per encoder token too, so it shrinks by the "
                      "same factor; the encoder keeps no cache"),
    ),
    ArchSpec(
        "stablelm", ("StableLmForCausalLM",),
        k_norm=KNorm.ONE_PER_HEAD,
        k_norm_weight="model.layers.{i}.self_attn.k_layernorm.norms.{h}.weight",
        k_norm_extra=("model.layers.{i}.self_attn.k_layernorm.norms.{h}.bias",),
        k_norm_key="qk_layernorm",
    ),
)
