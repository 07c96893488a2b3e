"""Every tensor a family's checkpoint holds, by name and shape, from config.json alone: what the memory plan counts
when no weights are at hand (a config.json fetched on its own), without building the model.

One `Layout` per family of the architecture tables: the tensors outside the layers, those of each layer (after
`prefix{i}.`), each with its shape in symbols and the config field that adds it (attention biases, ...; "!field":
added where the field is false). The sizes come from `config_defaults.decoder_sizes`, the fields from the class's
defaults where config.json has none. A config that sets a field in `unsupported` (a variant whose tensors the table
does not describe), or a family without a layout (Falcon), gets None: the caller counts on the meta device.
tests/hf/test_shapes.py compares every layout with the safetensors headers of a tiny model of the family.
"""
from __future__ import annotations

import dataclasses

from gqakit.hf.architectures import find_family
from gqakit.hf.config_defaults import decoder_sizes, filled

# a tensor: (name, shape in symbols, the config field that adds it; True: always)
Entry = tuple[str, tuple[str, ...], "str | bool"]


@dataclasses.dataclass(frozen=True)
class Layout:
    root: tuple[Entry, ...]
    layer: tuple[Entry, ...]
    prefix: str = "model.layers."
    unsupported: tuple[str, ...] = ()


def _attention(qkv_bias: str | bool, o_bias: str | bool, o_name: str = "o_proj") -> tuple[Entry, ...]:
    out: list[Entry] = []
    for role, shape in (("q_proj", ("q", "h")), ("k_proj", ("kv", "h")), ("v_proj", ("kv", "h"))):
        out += [(f"self_attn.{role}.weight", shape, True), (f"self_attn.{role}.bias", shape[:1], qkv_bias)]
    return (*out, (f"self_attn.{o_name}.weight", ("h", "q"), True), (f"self_attn.{o_name}.bias", ("h",), o_bias))


def _mlp(names: tuple[str, ...], bias: str | bool) -> tuple[Entry, ...]:
    """Linear layers of the MLP: the last maps intermediate -> hidden, the others hidden -> intermediate."""
    out: list[Entry] = []
    for n, name in enumerate(names):
        shape = ("h", "i") if n == len(names) - 1 else ("i", "h")
        out += [(f"mlp.{name}.weight", shape, True), (f"mlp.{name}.bias", shape[:1], bias)]
    return tuple(out)


def _norms(*names: str, bias: bool = False, when: str | bool = True) -> tuple[Entry, ...]:
    return tuple(e for n in names for e in ((f"{n}.weight", ("h",), when), (f"{n}.bias", ("h",), bias and when)))


_EMBED: tuple[Entry, ...] = (("model.embed_tokens.weight", ("V", "h"), True), ("lm_head.weight", ("V", "h"), True))
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")
_PAIR = ("input_layernorm", "post_attention_layernorm")
_QK_NORM_D: tuple[Entry, ...] = (("self_attn.q_norm.weight", ("d",), True), ("self_attn.k_norm.weight", ("d",), True))
_GEMMA2 = (*_attention("attention_bias", "attention_bias"), *_mlp(_LLAMA_MLP, False),
           *_norms(*_PAIR, "pre_feedforward_layernorm", "post_feedforward_layernorm"))
_BIGCODE = Layout(
    root=(("transformer.wte.weight", ("V", "h"), True), ("transformer.wpe.weight", ("P", "h"), True),
          *_norms("transformer.ln_f", bias=True), ("lm_head.weight", ("V", "h"), True)),
    layer=(*_norms("ln_1", "ln_2", bias=True), ("attn.c_attn.weight", ("qkv", "h"), True),
           ("attn.c_attn.bias", ("qkv",), True), ("attn.c_proj.weight", ("h", "h"), True),
           ("attn.c_proj.bias", ("h",), True), ("mlp.c_fc.weight", ("i", "h"), True), ("mlp.c_fc.bias", ("i",), True),
           ("mlp.c_proj.weight", ("h", "i"), True), ("mlp.c_proj.bias", ("h",), True)),
    prefix="transformer.h.")

LAYOUTS: dict[str, Layout] = {
    "llama": Layout((*_EMBED, *_norms("model.norm")), (*_attention("attention_bias", "attention_bias"),
                                                         *_mlp(_LLAMA_MLP, "mlp_bias"), *_norms(*_PAIR))),
    "mistral": Layout((*_EMBED, *_norms("model.norm")), (*_attention(False, False), *_mlp(_LLAMA_MLP, False),
                                                           *_norms(*_PAIR))),
    "qwen2": Layout((*_EMBED, *_norms("model.norm")), (*_attention(True, False), *_mlp(_LLAMA_MLP, False),
                                                         *_norms(*_PAIR))),
    "qwen3": Layout((*_EMBED, *_norms("model.norm")), (*_attention("attention_bias", "attention_bias"), *_QK_NORM_D,
                                                         *_mlp(_LLAMA_MLP, False), *_norms(*_PAIR))),
    "gemma": Layout((*_EMBED, *_norms("model.norm")), (*_attention("attention_bias", "attention_bias"),
                                                         *_mlp(_LLAMA_MLP, False), *_norms(*_PAIR))),
    "gemma2": Layout((*_EMBED, *_norms("model.norm")), _GEMMA2),
    "gemma3": Layout((*_EMBED, *_norms("model.norm")), (*_GEMMA2, *_QK_NORM_D)),
    "phi3": Layout((*_EMBED, *_norms("model.norm")), (
        ("self_attn.qkv_proj.weight", ("qkv", "h"), True), ("self_attn.o_proj.weight", ("h", "q"), True),
        ("mlp.gate_up_proj.weight", ("2i", "h"), True), ("mlp.down_proj.weight", ("h", "i"), True), *_norms(*_PAIR))),
    "olmo": Layout(_EMBED, (*_attention("attention_bias", "attention_bias"), *_mlp(_LLAMA_MLP, False))),  # no affine
    "olmo2": Layout((*_EMBED, *_norms("model.norm")), (
        *_attention("attention_bias", "attention_bias"), ("self_attn.q_norm.weight", ("q",), True),
        ("self_attn.k_norm.weight", ("kv",), True), *_mlp(_LLAMA_MLP, False),
        *_norms("post_attention_layernorm", "post_feedforward_layernorm"))),
    "phi": Layout((*_EMBED, ("lm_head.bias", ("V",), True), *_norms("model.final_layernorm", bias=True)),
                  (*_attention(True, True, o_name="dense"), *_mlp(("fc1", "fc2"), True),
                   *_norms("input_layernorm", bias=True)), unsupported=("qk_layernorm",)),
    "starcoder2": Layout((*_EMBED, *_norms("model.norm", bias=True)), (
        *_attention("use_bias", "use_bias"), *_mlp(("c_fc", "c_proj"), "use_bias"), *_norms(*_PAIR, bias=True))),
    "granite": Layout((*_EMBED, *_norms("model.norm")), (*_attention("attention_bias", "attention_bias"),
                                                           *_mlp(_LLAMA_MLP, "mlp_bias"), *_norms(*_PAIR))),
    "nemotron": Layout((*_EMBED, *_norms("model.norm", bias=True)), (
        *_attention("attention_bias", "attention_bias"), *_mlp(("up_proj", "down_proj"), "mlp_bias"),
        *_norms(*_PAIR, bias=True))),
    "stablelm": Layout((*_EMBED, *_norms("model.norm", bias=True)), (
        *_attention("use_qkv_bias", False), *_mlp(_LLAMA_MLP, False), *_norms("input_layernorm", bias=True),
        *_norms("post_attention_layernorm", bias=True, when="!use_parallel_residual")), unsupported=("qk_layernorm",)),
    "gpt_bigcode": _BIGCODE,
    "gqakit_gpt_bigcode": _BIGCODE,
}


def _holds(known: dict, when: str | bool) -> bool:
    if isinstance(when, bool):
        return when
    return not known.get(when[1:]) if when.startswith("!") else bool(known.get(when))


def config_shapes(config: dict) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of every tensor a checkpoint of config.json's model holds (its head too, tied or not), or None
    where the layouts do not describe it."""
    archs = config.get("architectures")
    spec = find_family(archs[0]) if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    layout = LAYOUTS.get(spec.family) if spec is not None else None
    sizes = decoder_sizes(config)  # None for a config.json whose fields do not read
    known = filled(config, common_names=True) if sizes is not None else None
    if layout is None or known is None or sizes is None or any(known.get(f) for f in layout.unsupported):
        return None
    h, d, i = sizes["hidden_size"], sizes["head_dim"], sizes["intermediate_size"]
    q, kv = sizes["num_attention_heads"] * d, sizes["num_key_value_heads"] * d
    symbols = {"V": sizes["vocab_size"], "h": h, "d": d, "q": q, "kv": kv, "qkv": q + 2 * kv, "i": i, "2i": 2 * i,
               "P": known.get("max_position_embeddings")}
    shapes = {name: tuple(symbols[s] for s in shape) for name, shape, when in layout.root if _holds(known, when)}
    for n in range(sizes["num_hidden_layers"]):
        shapes.update({f"{layout.prefix}{n}.{name}": tuple(symbols[s] for s in shape)
                       for name, shape, when in layout.layer if _holds(known, when)})
    return shapes
