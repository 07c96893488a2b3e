"""`trainable: attention` / `kv` on the stock (unconverted) sources of gqakit's re-hosts (GPT-2, GPT-NeoX, GPT-J,
OPT, T5): the subset is read from the re-host's description of the source's own layout, and checked here against
the model's own modules (every parameter of an innermost module whose class is an `...Attention`, or its k / v
projections)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, T5Config

from families import REHOST_SOURCES
from gqakit.common.errors import GqakitError
from gqakit.uptrain.modeling import select_trainable

T5 = lambda: T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,  # noqa: E731
                      decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"])
MODELS = {"gpt2": REHOST_SOURCES["gpt2"], "neox": REHOST_SOURCES["neox"], "gptj": REHOST_SOURCES["gptj"],
          "opt": REHOST_SOURCES["opt"], "t5": T5}
# the K/V projections of each family's own attention modules (None: fused with Q, so trainable=kv is refused)
KV = {"gpt2": None, "neox": None, "gptj": ("attn.k_proj.", "attn.v_proj."),
      "opt": ("self_attn.k_proj.", "self_attn.v_proj."),
      "t5": ("SelfAttention.k.", "SelfAttention.v.", "EncDecAttention.k.", "EncDecAttention.v.")}


def _model(name: str):
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if name == "t5" else AutoModelForCausalLM
    return auto.from_config(MODELS[name]())


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainable_attention_is_every_attention_module(name):
    model = _model(name)
    def attention(module):  # the innermost: T5's T5LayerSelfAttention wraps a layer norm and its T5Attention
        return type(module).__name__.endswith("Attention")
    want = {f"{m}.{p}" for m, module in model.named_modules()
            if attention(module) and not any(attention(c) for c in list(module.modules())[1:])
            for p, _ in module.named_parameters()}
    select_trainable(model, "attention")
    assert _trainable(model) == want and want


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainable_kv_is_the_kv_projections_or_refused_where_fused(name):
    model = _model(name)
    if KV[name] is None:
        with pytest.raises(GqakitError, match=f"trainable=kv needs separate K/V projections, but {type(model).__name__}"
                                              " fuses them in .*; use trainable=attention"):
            select_trainable(model, "kv")
        return
    select_trainable(model, "kv")
    # stock T5's encoder keeps every head (what gqakit converts is the decoder), so its k / v stay frozen
    want = {n for n, _ in model.named_parameters() if any(s in n for s in KV[name]) and not n.startswith("encoder.")}
    assert _trainable(model) == want and want
