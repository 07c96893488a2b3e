"""GPT-2 and OPT -> GPTBigCodeForCausalLM, the stock class that holds their MQA form (G = 1) and MHA (G = H).

GPTBigCode is GPT-2's block (LayerNorm, attention, LayerNorm, MLP, learned positions, tied or own head) with
`multi_query`: true keeps one K/V head with the fused rows [q | k | v], false keeps every head with rows per
head [q_h, k_h, v_h]. Both sources are re-expressed as its MHA form; the conversion then pools to MQA, or to
gqakit's own grouped class for a G between 1 and H (no stock class holds it).

- GPT-2's Conv1D weights are stored (in, out): they are transposed. Its fused c_attn columns [q | k | v] are
  reordered per head.
- OPT's separate q/k/v projections are fused per head; its learned positions are offset by 2 (rows 2.. are
  kept). OPT derives positions from the attention mask, GPTBigCode from the cache position: they agree unless a
  batch is left-padded, where the re-hosted model needs explicit `position_ids` (as any GPT-2-like model).
Exact: transposes, reorders, a slice and renames.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gqakit.common.errors import GqakitError
from gqakit.hf.architectures.spec import ArchSpec
from gqakit.hf.architectures.rehost.base import Rehost, head_dim_of, source_config, token_ids, unused_check
from gqakit.hf.architectures.rehost.tensors import Source, base_prefix, constant, derived
from gqakit.hf.headers import TensorInfo, same_bytes

if TYPE_CHECKING:  # torch only in annotations: the module imports without it
    import torch


def per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (H*d, ...) of q, k and v -> GPTBigCode's MHA c_attn rows, per head [q_h, k_h, v_h]: (3*H*d, ...)."""
    import torch

    d = q.shape[0] // heads
    return torch.stack([t.reshape(heads, d, *t.shape[1:]) for t in (q, k, v)], dim=1).reshape(3 * q.shape[0],
                                                                                            *q.shape[1:])


def _bigcode_config(*, vocab, positions, n, heads, layers, inner, act, eps, init, scale, dropout, tie, tokens) -> dict:
    return {
        "architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "multi_query": False,
        "vocab_size": vocab, "n_positions": positions, "n_embd": n, "n_head": heads, "n_layer": layers,
        "n_inner": inner, "activation_function": act, "layer_norm_epsilon": eps, "initializer_range": init,
        "scale_attn_weights": scale, "resid_pdrop": dropout[0], "embd_pdrop": dropout[1], "attn_pdrop": dropout[2],
        "attention_softmax_in_fp32": True, "scale_attention_softmax_in_fp32": True, "tie_word_embeddings": tie,
        "use_cache": True, **tokens,
    }


def _head(s: Source, tie: bool, vocab: int, n: int, embedding: str, out: dict[str, TensorInfo]) -> bool:
    """The source's output head; returns the target's tie_word_embeddings. A tied source's stored head that is a
    copy of the embedding (`embedding`, compared byte for byte, a block at a time) is the copy transformers may save:
    GPTBigCode re-ties it, not written. An untied source's head, or a stored head of other values (which transformers
    5 uses, untied, whatever tie_word_embeddings says), is written as GPTBigCode's own `lm_head.weight`, untied."""
    if not s.has("lm_head.weight"):
        if not tie:
            raise GqakitError(f"{s.family} with tie_word_embeddings false stores no lm_head.weight, so transformers "
                              "starts its head from random values; add the head, or set tie_word_embeddings true "
                              "if the embeddings are the head")
        return True
    head = s.info("lm_head.weight", (vocab, n))
    stored = head.file is not None and s.tensors[embedding].file is not None  # not a meta plan's headers
    if tie and (not stored or same_bytes(head, s.tensors[embedding])):
        return True
    out["lm_head.weight"] = head
    return False


def build_gpt2(config: dict, tensors: dict[str, TensorInfo]) -> tuple[dict, dict[str, TensorInfo]]:
    src = source_config(config, "GPT-2", ("gpt2",))
    for flag, why in (("scale_attn_by_inverse_layer_idx", "scales each layer's scores by 1/(layer+1)"),
                      ("add_cross_attention", "has cross-attention")):
        if getattr(src, flag):
            raise GqakitError(f"GPT-2 with {flag} true {why}, which GPTBigCodeForCausalLM does not; gqakit "
                              f"re-hosts GPT-2 without it")
    n, H, L = src.n_embd, src.n_head, src.n_layer
    head_dim_of("GPT-2", n, H, "n_embd", "n_head")
    inner = src.n_inner if src.n_inner is not None else 4 * n
    s = Source("GPT-2", tensors)
    b = base_prefix("GPT-2", tensors, "wte.weight", ("transformer.", ""))  # the hub's gpt2 weights have none
    out: dict[str, TensorInfo] = {
        "transformer.wte.weight": s.info(b + "wte.weight", (src.vocab_size, n)),
        "transformer.wpe.weight": s.info(b + "wpe.weight", (src.n_positions, n)),
        "transformer.ln_f.weight": s.info(b + "ln_f.weight", (n,)),
        "transformer.ln_f.bias": s.info(b + "ln_f.bias", (n,)),
    }
    tie = _head(s, src.tie_word_embeddings, src.vocab_size, n, b + "wte.weight", out)
    for i in range(L):
        p, a = f"transformer.h.{i}.", f"{b}h.{i}."  # target, source
        for norm in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                out[p + f"{norm}.{kind}"] = s.info(a + f"{norm}.{kind}", (n,))
        w_info, w = s.info(a + "attn.c_attn.weight", (n, 3 * n)), s.loader(a + "attn.c_attn.weight")
        bias_info, bias = s.info(a + "attn.c_attn.bias", (3 * n,)), s.loader(a + "attn.c_attn.bias")
        out[p + "attn.c_attn.weight"] = derived(w_info, (3 * n, n), lambda w=w: per_head(*w().T.split(n), H))
        out[p + "attn.c_attn.bias"] = derived(bias_info, (3 * n,), lambda bias=bias: per_head(*bias().split(n), H))
        for name, shape in (("attn.c_proj", (n, n)), ("mlp.c_fc", (n, inner)), ("mlp.c_proj", (inner, n))):
            info, load = s.info(a + name + ".weight", shape), s.loader(a + name + ".weight")
            out[p + name + ".weight"] = derived(info, shape[::-1], lambda load=load: load().T)  # Conv1D: (in, out)
            out[p + name + ".bias"] = s.info(a + name + ".bias", (shape[1],))
    unused_check("GPT-2", tensors, s.used, (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",))
    return _bigcode_config(vocab=src.vocab_size, positions=src.n_positions, n=n, heads=H, layers=L, inner=inner,
                           act=src.activation_function, eps=src.layer_norm_epsilon, init=src.initializer_range,
                           scale=src.scale_attn_weights, dropout=(src.resid_pdrop, src.embd_pdrop, src.attn_pdrop),
                           tie=tie, tokens=token_ids(src)), out


def build_opt(config: dict, tensors: dict[str, TensorInfo]) -> tuple[dict, dict[str, TensorInfo]]:
    src = source_config(config, "OPT", ("opt",))
    n, H, L = src.hidden_size, src.num_attention_heads, src.num_hidden_layers
    if not src.do_layer_norm_before:
        raise GqakitError("OPT with do_layer_norm_before false (OPT-350m) normalises after each block, which "
                          "GPTBigCodeForCausalLM does not; gqakit re-hosts the pre-norm OPT models")
    if src.word_embed_proj_dim != n:
        raise GqakitError(f"OPT with word_embed_proj_dim {src.word_embed_proj_dim} != hidden_size {n} projects its "
                          "embeddings in and out, which GPTBigCodeForCausalLM cannot hold; gqakit re-hosts OPT "
                          "models without project_in / project_out")
    if src._remove_final_layer_norm:
        raise GqakitError("OPT with _remove_final_layer_norm true has no final LayerNorm, which "
                          "GPTBigCodeForCausalLM always applies; gqakit re-hosts OPT with its final norm")
    head_dim_of("OPT", n, H, "hidden_size", "num_attention_heads")
    inner, P = src.ffn_dim, src.max_position_embeddings
    s = Source("OPT", tensors)
    d = base_prefix("OPT", tensors, "embed_tokens.weight", ("model.decoder.", "decoder."))
    pos_info, pos = s.info(d + "embed_positions.weight", (P + 2, n)), s.loader(d + "embed_positions.weight")
    out: dict[str, TensorInfo] = {
        "transformer.wte.weight": s.info(d + "embed_tokens.weight", (src.vocab_size, n)),
        "transformer.wpe.weight": derived(pos_info, (P, n), lambda: pos()[2:]),  # OPT's positions start at 2
    }

    def norm(source: str, target: str, like: TensorInfo) -> None:
        if src.layer_norm_elementwise_affine:
            out[target + ".weight"] = s.info(source + ".weight", (n,))
            out[target + ".bias"] = s.info(source + ".bias", (n,))
        else:
            out[target + ".weight"], out[target + ".bias"] = constant(like, (n,), 1.0), constant(like, (n,), 0.0)

    def linear(source: str, target: str, shape: tuple[int, int]) -> None:
        out[target + ".weight"] = s.info(source + ".weight", shape)
        out[target + ".bias"] = (s.info(source + ".bias", (shape[0],)) if src.enable_bias
                                 else constant(out[target + ".weight"], (shape[0],), 0.0))

    like = out["transformer.wte.weight"]
    norm(d + "final_layer_norm", "transformer.ln_f", like)
    tie = _head(s, src.tie_word_embeddings, src.vocab_size, n, d + "embed_tokens.weight", out)
    for i in range(L):
        a, t = f"{d}layers.{i}.", f"transformer.h.{i}."
        norm(a + "self_attn_layer_norm", t + "ln_1", like)
        norm(a + "final_layer_norm", t + "ln_2", like)
        ws = [s.loader(a + f"self_attn.{r}_proj.weight", (n, n)) for r in "qkv"]
        w_info = s.info(a + "self_attn.q_proj.weight")
        out[t + "attn.c_attn.weight"] = derived(w_info, (3 * n, n), lambda ws=ws: per_head(*(f() for f in ws), H))
        if src.enable_bias:
            bs = [s.loader(a + f"self_attn.{r}_proj.bias", (n,)) for r in "qkv"]
            out[t + "attn.c_attn.bias"] = derived(w_info, (3 * n,), lambda bs=bs: per_head(*(f() for f in bs), H))
        else:
            out[t + "attn.c_attn.bias"] = constant(w_info, (3 * n,), 0.0)
        linear(a + "self_attn.out_proj", t + "attn.c_proj", (n, n))
        linear(a + "fc1", t + "mlp.c_fc", (inner, n))
        linear(a + "fc2", t + "mlp.c_proj", (n, inner))
    unused_check("OPT", tensors, s.used)
    return _bigcode_config(vocab=src.vocab_size, positions=P, n=n, heads=H, layers=L, inner=inner,
                           act=src.activation_function, eps=1e-5, init=src.init_std, scale=True,
                           dropout=(src.dropout, src.dropout, src.attention_dropout), tie=tie,
                           tokens=token_ids(src)), out


REHOSTS = (
    Rehost("GPT-2", ("GPT2LMHeadModel",), "GPTBigCodeForCausalLM", build_gpt2,
           "exact: Conv1D weights transposed, c_attn reordered per head; 1 < G < H goes on to gqakit's "
           "GroupedGPTBigCodeForCausalLM",
           ArchSpec("gpt2", ("GPT2LMHeadModel",), k_proj=None, v_proj=None, q_proj=None,
                    qkv_proj="transformer.h.{i}.attn.c_attn", o_proj="transformer.h.{i}.attn.c_proj")),
    Rehost("OPT", ("OPTForCausalLM",), "GPTBigCodeForCausalLM", build_opt,
           "exact: q/k/v fused per head, positions offset by 2 dropped; 1 < G < H goes on to gqakit's "
           "GroupedGPTBigCodeForCausalLM; left-padded batches need explicit position_ids",
           ArchSpec("opt", ("OPTForCausalLM",), **{f"{r}_proj": f"model.decoder.layers.{{i}}.self_attn.{r}_proj"
                                                    for r in "qkv"},
                    o_proj="model.decoder.layers.{i}.self_attn.out_proj")),
)
