"""GPT-NeoX / Pythia with parallel residual -> PhiForCausalLM, without -> NemotronForCausalLM (any number of K/V
heads; the sequential mapping is `build_sequential`).

Both compute x + attn(norm_a(x)) + mlp(norm_b(x)) with partial rotary (rotate_half on the first dims of each
head). NeoX has two LayerNorms, Phi one (`input_layernorm`) feeding both branches: each NeoX norm's scale and
shift are folded into the linears that read it (W diag(gamma), b + W beta), and Phi's norm keeps scale 1, shift
0, the same eps. The fused `query_key_value` holds rows per head in the order q, k, v; it is split into Phi's
q/k/v projections. Exact up to the float rounding of the fold (fp32 logits within 1e-5 of the source in
tests/hf/test_rehost.py).
"""
from __future__ import annotations

from gqakit.common.errors import GqakitError
from gqakit.hf.architectures.spec import ArchSpec
from gqakit.hf.architectures.rehost.base import Rehost, head_dim_of, source_config, token_ids, unused_check
from gqakit.hf.architectures.rehost.tensors import Source, constant, derived, fold_norm
from gqakit.hf.headers import TensorInfo


# old checkpoints store the causal mask and rotary tables as buffers: the target class rebuilds them
BUFFERS = (r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",)


def _rope(src) -> dict:
    rope = dict(src.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise GqakitError(f"GPT-NeoX with rope_type {rope['rope_type']!r} is not re-hosted (only the default "
                          "rotary has been checked exact on the targets); use a checkpoint with default RoPE")
    return rope


def _config(src) -> dict:
    """The Phi config.json of a normalised GPTNeoXConfig."""
    rope = _rope(src)
    return {
        "architectures": ["PhiForCausalLM"], "model_type": "phi",
        "vocab_size": src.vocab_size, "hidden_size": src.hidden_size, "intermediate_size": src.intermediate_size,
        "num_hidden_layers": src.num_hidden_layers, "num_attention_heads": src.num_attention_heads,
        "num_key_value_heads": src.num_attention_heads, "hidden_act": src.hidden_act,
        "max_position_embeddings": src.max_position_embeddings, "initializer_range": src.initializer_range,
        "layer_norm_eps": src.layer_norm_eps, "use_cache": True, "tie_word_embeddings": src.tie_word_embeddings,
        "rope_parameters": rope, "attention_dropout": src.attention_dropout, "resid_pdrop": src.hidden_dropout,
        "embd_pdrop": src.hidden_dropout, "qk_layernorm": False, **token_ids(src),
    }


def _head(s: Source, src, n: int, out: dict) -> None:
    """The untied output head (stored as `lm_head` or, in older checkpoints, `embed_out`); none when tied."""
    head = next((h for h in ("lm_head.weight", "embed_out.weight") if s.has(h)), None)
    if head is not None:
        out["lm_head.weight"] = s.info(head, (src.vocab_size, n))
    elif not src.tie_word_embeddings:
        s.info("lm_head.weight")  # refuses: missing


def build(config: dict, tensors: dict[str, TensorInfo]) -> tuple[dict, dict[str, TensorInfo]]:
    src = source_config(config, "GPT-NeoX", ("gpt_neox",))
    if not src.use_parallel_residual:
        return build_sequential(src, tensors)
    n, H, L = src.hidden_size, src.num_attention_heads, src.num_hidden_layers
    d, inter = head_dim_of("GPT-NeoX", n, H, "hidden_size", "num_attention_heads"), src.intermediate_size
    s = Source("GPT-NeoX", tensors)
    out: dict[str, TensorInfo] = {}
    out["model.embed_tokens.weight"] = s.info("gpt_neox.embed_in.weight", (src.vocab_size, n))
    out["model.final_layernorm.weight"] = s.info("gpt_neox.final_layer_norm.weight", (n,))
    out["model.final_layernorm.bias"] = s.info("gpt_neox.final_layer_norm.bias", (n,))
    _head(s, src, n, out)
    out["lm_head.bias"] = constant(out["model.embed_tokens.weight"], (src.vocab_size,), 0.0)  # Phi's head has one
    for i in range(L):
        a, t = f"gpt_neox.layers.{i}.", f"model.layers.{i}."
        g1, b1 = s.loader(a + "input_layernorm.weight", (n,)), s.loader(a + "input_layernorm.bias", (n,))
        g2 = s.loader(a + "post_attention_layernorm.weight", (n,))
        b2 = s.loader(a + "post_attention_layernorm.bias", (n,))
        qkv_info = s.info(a + "attention.query_key_value.weight", (3 * n, n))
        qkv = s.loader(a + "attention.query_key_value.weight")
        qkv_b = s.loader(a + "attention.query_key_value.bias", (3 * n,)) if src.attention_bias else None
        for j, role in enumerate("qkv"):  # rows per head: [q | k | v] of head_dim each
            def rows(j=j, qkv=qkv):  # bound now: these run when the writer streams the layer
                return qkv().view(H, 3, d, n)[:, j].reshape(H * d, n)

            def bias(j=j, qkv_b=qkv_b):
                return qkv_b().view(H, 3, d)[:, j].reshape(H * d)
            w, b = fold_norm(rows, bias if qkv_b is not None else None, g1, b1)
            out[t + f"self_attn.{role}_proj.weight"] = derived(qkv_info, (H * d, n), w)
            out[t + f"self_attn.{role}_proj.bias"] = derived(qkv_info, (H * d,), b)
        out[t + "self_attn.dense.weight"] = s.info(a + "attention.dense.weight", (n, n))
        if src.attention_bias:
            out[t + "self_attn.dense.bias"] = s.info(a + "attention.dense.bias", (n,))
        else:
            out[t + "self_attn.dense.bias"] = constant(qkv_info, (n,), 0.0)
        fc1_info = s.info(a + "mlp.dense_h_to_4h.weight", (inter, n))
        w, b = fold_norm(s.loader(a + "mlp.dense_h_to_4h.weight"), s.loader(a + "mlp.dense_h_to_4h.bias", (inter,)),
                         g2, b2)
        out[t + "mlp.fc1.weight"] = derived(fc1_info, (inter, n), w)
        out[t + "mlp.fc1.bias"] = derived(fc1_info, (inter,), b)
        out[t + "mlp.fc2.weight"] = s.info(a + "mlp.dense_4h_to_h.weight", (n, inter))
        out[t + "mlp.fc2.bias"] = s.info(a + "mlp.dense_4h_to_h.bias", (n,))
        norm = tensors[a + "input_layernorm.weight"]
        out[t + "input_layernorm.weight"] = constant(norm, (n,), 1.0)
        out[t + "input_layernorm.bias"] = constant(norm, (n,), 0.0)
    unused_check("GPT-NeoX", tensors, s.used, BUFFERS)
    return _config(src), out


def build_sequential(src, tensors: dict[str, TensorInfo]) -> tuple[dict, dict[str, TensorInfo]]:
    """GPT-NeoX without parallel residual -> NemotronForCausalLM: x + attn(ln1(x)), then + mlp(ln2(x)), the same
    blocks; Nemotron's LayerNorm1P stores scale - 1. Exact up to the rounding of that subtraction."""
    n, H, L, inter = src.hidden_size, src.num_attention_heads, src.num_hidden_layers, src.intermediate_size
    d = head_dim_of("GPT-NeoX", n, H, "hidden_size", "num_attention_heads")
    s = Source("GPT-NeoX", tensors)
    out: dict[str, TensorInfo] = {"model.embed_tokens.weight": s.info("gpt_neox.embed_in.weight", (src.vocab_size, n))}

    def norm_1p(source: str, target: str) -> None:  # LayerNorm1P computes (weight + 1) * x_hat + bias
        info, gamma = s.info(source + ".weight", (n,)), s.loader(source + ".weight")
        out[target + ".weight"] = derived(info, (n,), lambda gamma=gamma: gamma() - 1.0)
        out[target + ".bias"] = s.info(source + ".bias", (n,))

    norm_1p("gpt_neox.final_layer_norm", "model.norm")
    _head(s, src, n, out)
    for i in range(L):
        a, t = f"gpt_neox.layers.{i}.", f"model.layers.{i}."
        norm_1p(a + "input_layernorm", t + "input_layernorm")
        norm_1p(a + "post_attention_layernorm", t + "post_attention_layernorm")
        suffixes = ("weight", "bias") if src.attention_bias else ("weight",)
        for suffix in suffixes:
            shape = (3 * n, n) if suffix == "weight" else (3 * n,)
            info, fused = s.info(a + f"attention.query_key_value.{suffix}", shape), \
                s.loader(a + f"attention.query_key_value.{suffix}")
            for j, role in enumerate("qkv"):  # rows per head: [q | k | v] of head_dim each
                out[t + f"self_attn.{role}_proj.{suffix}"] = derived(
                    info, (n, *shape[1:]),
                    lambda j=j, fused=fused, rest=shape[1:]: fused().view(H, 3, d, *rest)[:, j].reshape(n, *rest))
            dense_shape = (n, n) if suffix == "weight" else (n,)
            out[t + f"self_attn.o_proj.{suffix}"] = s.info(a + f"attention.dense.{suffix}", dense_shape)
        for source, target, shape in (("dense_h_to_4h", "up_proj", (inter, n)),
                                      ("dense_4h_to_h", "down_proj", (n, inter))):
            out[t + f"mlp.{target}.weight"] = s.info(a + f"mlp.{source}.weight", shape)
            out[t + f"mlp.{target}.bias"] = s.info(a + f"mlp.{source}.bias", (shape[0],))
    unused_check("GPT-NeoX", tensors, s.used, BUFFERS)
    return {
        "architectures": ["NemotronForCausalLM"], "model_type": "nemotron",
        "vocab_size": src.vocab_size, "hidden_size": n, "intermediate_size": inter, "num_hidden_layers": L,
        "num_attention_heads": H, "num_key_value_heads": H, "head_dim": d, "hidden_act": src.hidden_act,
        "max_position_embeddings": src.max_position_embeddings, "initializer_range": src.initializer_range,
        "norm_eps": src.layer_norm_eps, "use_cache": True, "tie_word_embeddings": src.tie_word_embeddings,
        "rope_parameters": _rope(src), "attention_bias": src.attention_bias, "mlp_bias": True,
        "attention_dropout": src.attention_dropout, **token_ids(src),
    }, out


REHOSTS = (Rehost("GPT-NeoX", ("GPTNeoXForCausalLM",), "PhiForCausalLM (parallel residual) or NemotronForCausalLM",
                  build, "exact up to the rounding of the LayerNorms folded into the linears that read them "
                  "(Phi) or stored as scale - 1 (Nemotron)",
                  ArchSpec("gpt_neox", ("GPTNeoXForCausalLM",), k_proj=None, v_proj=None, q_proj=None,
                           qkv_proj="gpt_neox.layers.{i}.attention.query_key_value",
                           o_proj="gpt_neox.layers.{i}.attention.dense")),)
