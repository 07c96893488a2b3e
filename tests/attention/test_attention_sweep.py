"""Every decoder family of transformers that can select gqakit attention, built tiny from a config:
logits and parameter gradients with `gqakit_tiled` equal eager's. Weights are scaled so that logit
caps matter, and windows are shorter than the sequence so that sliding layers matter.

Tolerances (fp32): logits within 1e-5 of eager, relative to their largest magnitude (at least 1);
parameter gradients within 1e-4 relative to the largest gradient of that parameter."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from gqakit.attention import use

T = 24
WINDOW = 8  # sliding layers see 8 positions of 24
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**SMALL, head_dim=8, sliding_window=WINDOW),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1, layer_types=["full_attention", "sliding_attention"]),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
    "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=8),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=8, sliding_window=WINDOW,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=None),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=WINDOW,
                                                    layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: transformers.Phi3Config(**SMALL),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL),
    "phi": lambda: transformers.PhiConfig(**SMALL),  # also GPT-NeoX / GPT-J re-hosted
    "starcoder2": lambda: transformers.Starcoder2Config(**SMALL, sliding_window=WINDOW),
    "granite": lambda: transformers.GraniteConfig(**SMALL, attention_multiplier=0.2),
    "nemotron": lambda: transformers.NemotronConfig(**SMALL, head_dim=8),
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                         multi_query=True, attn_pdrop=0.0, resid_pdrop=0.0,
                                                         embd_pdrop=0.0),  # also GPT-2 / OPT re-hosted at MQA
    "cohere": lambda: transformers.CohereConfig(**SMALL),
    "gpt_oss": lambda: transformers.GptOssConfig(**{**SMALL, "intermediate_size": 32}, head_dim=8,
                                                 num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW),
}


def _build(family: str):
    cfg = FAMILIES[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():  # large scores: caps and sinks change the result, not just rounding
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "qkv_proj", "query_key_value")) and p.dim() == 2:
                p.mul_(4.0)
            if name.endswith("sinks"):
                p.normal_(0, 2.0)
    return model


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids, use_cache=False).logits
    logits.float().pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


# Families that cannot select gqakit attention: refused at use(), in one line.
REFUSED = {
    "stablelm": lambda: transformers.StableLmConfig(**SMALL, qk_layernorm=True),
    "bloom": lambda: transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4),
    "falcon": lambda: transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                                alibi=False),  # its own attention code, not the interface
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_without_the_attention_interface_are_refused_at_use(family):
    from gqakit.common.errors import GqakitError

    model = transformers.AutoModelForCausalLM.from_config(REFUSED[family]())
    with pytest.raises(GqakitError, match="cannot be plugged in|ALiBi"):
        use(model, "tiled")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiled_equals_eager_for_every_family(family):
    eager = _build(family)
    tiled = use(copy.deepcopy(eager), "tiled")
    ids = torch.randint(3, 64, (2, T), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _run(eager, ids)
    logits, grads = _run(tiled, ids)
    scale = max(1.0, ref_logits.abs().max().item())
    assert (logits - ref_logits).abs().max().item() <= 1e-5 * scale, family
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-4 * max(ref.abs().max().item(), 1e-6), (family, name, err)


def test_the_dropout_refusal_names_the_family_s_own_field():
    """GPTBigCode (GPT-2 / OPT re-hosted) spells attention dropout attn_pdrop: the one-line refusal says so."""
    from gqakit.common.errors import GqakitError

    model = transformers.AutoModelForCausalLM.from_config(transformers.GPTBigCodeConfig(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64, attn_pdrop=0.1))
    model = use(model, "tiled").train()
    with pytest.raises(GqakitError, match=r"set config\.attn_pdrop = 0\.0"):
        model(torch.randint(0, 64, (1, 8)))
