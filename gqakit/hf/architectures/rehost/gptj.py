"""GPT-J -> PhiForCausalLM (any number of K/V heads).

Both run attention and MLP in parallel from ONE LayerNorm, with partial rotary. GPT-J rotates interleaved pairs
(dims 2p, 2p+1 of the rotary part), Phi rotates halves (dims p, p + rotary_dim/2) with the same frequency for
pair p: permuting the rotary rows of each head's q and k projection (even rows first, then odd) makes the two
compute the same scores. Phi's q/k/v and output projections have biases: GPT-J's have none, so they are zeros.
Exact (a permutation and renames).
"""
from __future__ import annotations

import math

from gqakit.common.errors import GqakitError
from gqakit.hf.architectures.spec import ArchSpec
from gqakit.hf.architectures.rehost.base import Rehost, head_dim_of, source_config, token_ids, unused_check
from gqakit.hf.architectures.rehost.tensors import Source, constant, derived
from gqakit.hf.headers import TensorInfo


def rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """Row order of one head that turns interleaved rotary pairs into halves: [0, 2, .., 1, 3, .., rest]."""
    return [*range(0, rotary_dim, 2), *range(1, rotary_dim, 2), *range(rotary_dim, head_dim)]


def rotary_fraction(rotary_dim: int, head_dim: int) -> float:
    """The partial_rotary_factor from which Phi's int(head_dim * factor) gives back `rotary_dim`: rotary_dim /
    head_dim rounds below it for some pairs (30 / 44 gives 29), so the next float up where it does."""
    factor = rotary_dim / head_dim
    while int(head_dim * factor) < rotary_dim:
        factor = math.nextafter(factor, math.inf)
    return factor


def build(config: dict, tensors: dict[str, TensorInfo]) -> tuple[dict, dict[str, TensorInfo]]:
    src = source_config(config, "GPT-J", ("gptj",))
    n, H, L = src.n_embd, src.n_head, src.n_layer
    d = head_dim_of("GPT-J", n, H, "n_embd", "n_head")
    rot = src.rotary_dim  # an int: transformers' GPTJConfig refuses null, and so does source_config
    if rot % 2 or not 0 < rot <= d:
        raise GqakitError(f"GPT-J rotary_dim {rot} must be even and at most the head_dim {d}; fix config.json")
    inter = src.n_inner if src.n_inner is not None else 4 * n
    order = rotary_order(d, rot)
    s = Source("GPT-J", tensors)
    out: dict[str, TensorInfo] = {}
    out["model.embed_tokens.weight"] = s.info("transformer.wte.weight", (src.vocab_size, n))
    out["model.final_layernorm.weight"] = s.info("transformer.ln_f.weight", (n,))
    out["model.final_layernorm.bias"] = s.info("transformer.ln_f.bias", (n,))
    if s.has("lm_head.weight") or not src.tie_word_embeddings:
        out["lm_head.weight"] = s.info("lm_head.weight", (src.vocab_size, n))
    if s.has("lm_head.bias"):
        out["lm_head.bias"] = s.info("lm_head.bias", (src.vocab_size,))
    else:
        out["lm_head.bias"] = constant(out["model.embed_tokens.weight"], (src.vocab_size,), 0.0)
    for i in range(L):
        a, t = f"transformer.h.{i}.", f"model.layers.{i}."
        out[t + "input_layernorm.weight"] = s.info(a + "ln_1.weight", (n,))
        out[t + "input_layernorm.bias"] = s.info(a + "ln_1.bias", (n,))
        for role in "qk":
            info = s.info(a + f"attn.{role}_proj.weight", (n, n))
            load = s.loader(a + f"attn.{role}_proj.weight")
            out[t + f"self_attn.{role}_proj.weight"] = derived(
                info, (n, n), lambda load=load: load().view(H, d, n)[:, order].reshape(n, n))
        out[t + "self_attn.v_proj.weight"] = s.info(a + "attn.v_proj.weight", (n, n))
        out[t + "self_attn.dense.weight"] = s.info(a + "attn.out_proj.weight", (n, n))
        like = tensors[a + "attn.q_proj.weight"]
        for role in ("q_proj", "k_proj", "v_proj", "dense"):
            out[t + f"self_attn.{role}.bias"] = constant(like, (n,), 0.0)
        out[t + "mlp.fc1.weight"] = s.info(a + "mlp.fc_in.weight", (inter, n))
        out[t + "mlp.fc1.bias"] = s.info(a + "mlp.fc_in.bias", (inter,))
        out[t + "mlp.fc2.weight"] = s.info(a + "mlp.fc_out.weight", (n, inter))
        out[t + "mlp.fc2.bias"] = s.info(a + "mlp.fc_out.bias", (n,))
    unused_check("GPT-J", tensors, s.used, (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",))
    new = {
        "architectures": ["PhiForCausalLM"], "model_type": "phi",
        "vocab_size": src.vocab_size, "hidden_size": n, "intermediate_size": inter, "num_hidden_layers": L,
        "num_attention_heads": H, "num_key_value_heads": H, "hidden_act": src.activation_function,
        "max_position_embeddings": src.n_positions, "initializer_range": src.initializer_range,
        "layer_norm_eps": src.layer_norm_epsilon, "use_cache": True, "tie_word_embeddings": src.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": rotary_fraction(rot, d)},
        "attention_dropout": src.attn_pdrop, "resid_pdrop": src.resid_pdrop, "embd_pdrop": src.embd_pdrop,
        "qk_layernorm": False, **token_ids(src),
    }
    return new, out


REHOSTS = (Rehost("GPT-J", ("GPTJForCausalLM",), "PhiForCausalLM", build,
                  "exact: renames, zero biases and a permutation of the rotary rows of q and k",
                  ArchSpec("gptj", ("GPTJForCausalLM",),
                           **{f"{r}_proj": f"transformer.h.{{i}}.attn.{r}_proj" for r in "qkv"},
                           o_proj="transformer.h.{i}.attn.out_proj")),)
