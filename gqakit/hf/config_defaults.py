"""transformers' config-class defaults for the config.json fields gqakit reads, declared once, so that a plan fills
in what config.json leaves out without building the class (which imports transformers and torch).

One entry per model_type: the fields gqakit reads with the default its class declares (transformers 5.x config
classes are dataclasses), the class's `attribute_map` (GPT-2's hidden_size is n_embd), the keys its __post_init__
consumes, and what it derives (OPT's word_embed_proj_dim, GPT-NeoX's rope_parameters from the legacy rotary keys,
T5's decoder depth, activation and output scaling, GPTBigCode's K/V heads). `filled(config)` is config.json as the
class would hold it. tests/hf/test_config_defaults.py compares every default with the class's own, and every
filled config with the object transformers builds from the same config.json, so the table cannot drift from the
installed transformers unnoticed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gqakit.common.errors import GqakitError


@dataclasses.dataclass(frozen=True)
class ConfigClass:
    defaults: dict  # field -> the class's default
    aliases: tuple[tuple[str, str], ...] = ()  # attribute_map: (the common name, this class's own field)
    consumed: tuple[str, ...] = ()  # config.json keys the class's __post_init__ consumes (not kept as attributes)
    derive: Callable[[dict, dict], None] | None = None  # (filled, config.json): sets what __post_init__ derives


def _opt(out: dict, config: dict) -> None:
    if out["word_embed_proj_dim"] is None:
        out["word_embed_proj_dim"] = out["hidden_size"]


def _neox_rope(out: dict, config: dict) -> None:
    """GPT-NeoX's convert_rope_params_to_dict: rope_scaling, else rope_parameters, gains the legacy keys' values."""
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rotary_emb_base", 10_000.0))
    rope.setdefault("partial_rotary_factor", config.get("rotary_pct", 0.25))
    rope.setdefault("rope_type", rope.get("type", "default"))
    out["rope_parameters"] = rope


def _t5(scales_by_tie: bool) -> Callable[[dict, dict], None]:
    """T5's and mT5's __post_init__: the decoder as deep as the encoder unless told, the activation read off
    feed_forward_proj, embeddings always tied; T5 (not mT5) reads a false tie_word_embeddings as 'do not scale the
    decoder output'. Keys config.json gives outside the class's fields stay as given."""
    def derive(out: dict, config: dict) -> None:
        if out["num_decoder_layers"] is None:
            out["num_decoder_layers"] = out["num_layers"]
        act = str(out["feed_forward_proj"]).split("-")
        derived = {"dense_act_fn": "gelu_new" if out["feed_forward_proj"] == "gated-gelu" else act[-1],
                   "is_gated_act": act[0] == "gated"}
        if scales_by_tie:
            derived["scale_decoder_outputs"] = config.get("tie_word_embeddings") is not False
        out.update({k: v for k, v in derived.items() if k not in config})
        out["tie_word_embeddings"] = True
    return derive


def _bigcode(out: dict, config: dict) -> None:
    if "num_key_value_heads" not in config:
        out["num_key_value_heads"] = 1 if out["multi_query"] else out["n_head"]


def _grouped_bigcode(out: dict, config: dict) -> None:
    out["multi_query"], out["num_key_value_heads"] = False, out["kv_heads"]


def _heads(kv: bool, head_dim: bool) -> Callable[[dict, dict], None]:
    """A decoder's __post_init__: null K/V heads -> every head (`kv`), null head_dim -> hidden_size / heads."""
    def derive(out: dict, config: dict) -> None:
        if kv and out["num_key_value_heads"] is None:
            out["num_key_value_heads"] = out["num_attention_heads"]
        if head_dim and out["head_dim"] is None:
            out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return derive


def _partial_rope(default: float) -> Callable[[dict, dict], None]:
    """The standardisation of a class whose RoPE turns only part of each head by default (Phi, Nemotron, StableLM):
    rope_parameters, else rope_scaling, gains the top-level rope_theta and partial_rotary_factor, else the class's
    defaults, where it does not say them itself."""
    def derive(out: dict, config: dict) -> None:
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10_000.0))
        rope.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", default))
        rope.setdefault("rope_type", rope.get("type", "default"))
        out["rope_parameters"] = rope
    return derive


_ROPE_KEYS = ("partial_rotary_factor", "rope_theta", "rope_scaling")  # what _partial_rope folds into rope_parameters


_CARRIED = dict(rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                pad_token_id=None, attention_dropout=0.0)


def _lm(vocab: int, hidden: int, heads: int, kv: int | None, layers: int, inter: int, tie: bool, *,
        derives: str = "", partial_rotary: float | None = None, **more) -> ConfigClass:
    """A decoder's count fields (vocab_size, hidden_size, heads, K/V heads, layers, intermediate_size, tied head),
    `more` (head_dim where the class declares it), what it derives from null ones (`derives`: "kv", "head_dim") and
    its rope_parameters where its RoPE is partial by default (`partial_rotary`: the class's fraction)."""
    steps = ([_heads("kv" in derives, "head_dim" in derives)] if derives else []) + \
        ([_partial_rope(partial_rotary)] if partial_rotary is not None else [])

    def derive(out: dict, config: dict) -> None:
        for step in steps:
            step(out, config)
    return ConfigClass(dict(vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                            num_hidden_layers=layers, intermediate_size=inter, tie_word_embeddings=tie, **more),
                       consumed=() if partial_rotary is None else _ROPE_KEYS,
                       derive=derive if steps else None)


_GPT2_NAMES = (("hidden_size", "n_embd"), ("max_position_embeddings", "n_positions"),
               ("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer"))
_T5_NAMES = (("hidden_size", "d_model"), ("num_attention_heads", "num_heads"), ("num_hidden_layers", "num_layers"),
             ("head_dim", "d_kv"))
_T5 = dict(d_model=512, d_kv=64, num_decoder_layers=None, relative_attention_num_buckets=32,
           relative_attention_max_distance=128, dropout_rate=0.1, layer_norm_epsilon=1e-6, initializer_factor=1.0,
           is_encoder_decoder=True, use_cache=True, pad_token_id=0, eos_token_id=1, classifier_dropout=0.0,
           is_decoder=False)
_BIGCODE = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None, multi_query=True,
                tie_word_embeddings=True)

CLASSES: dict[str, ConfigClass] = {
    # the re-hosted sources: every field their mappings read
    "gpt2": ConfigClass(dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
        activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
        initializer_range=0.02, scale_attn_weights=True, bos_token_id=50256, eos_token_id=50256, pad_token_id=None,
        scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True), _GPT2_NAMES),
    "opt": ConfigClass(dict(
        vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, max_position_embeddings=2048,
        do_layer_norm_before=True, _remove_final_layer_norm=False, word_embed_proj_dim=None, dropout=0.1,
        attention_dropout=0.0, num_attention_heads=12, activation_function="relu", init_std=0.02, pad_token_id=1,
        bos_token_id=2, eos_token_id=2, enable_bias=True, layer_norm_elementwise_affine=True,
        tie_word_embeddings=True), derive=_opt),
    "gptj": ConfigClass(dict(
        vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_inner=None,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        initializer_range=0.02, bos_token_id=50256, eos_token_id=50256, pad_token_id=None,
        tie_word_embeddings=False), _GPT2_NAMES),
    "gpt_neox": ConfigClass(dict(
        vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576,
        hidden_act="gelu", attention_dropout=0.0, hidden_dropout=0.0, max_position_embeddings=2048,
        initializer_range=0.02, layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=None,
        tie_word_embeddings=False, use_parallel_residual=True, rope_parameters=None, attention_bias=True),
        consumed=("rope_scaling", "rotary_emb_base", "rotary_pct"), derive=_neox_rope),
    "t5": ConfigClass({**_T5, "vocab_size": 32128, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
                       "feed_forward_proj": "relu"}, _T5_NAMES, ("tie_word_embeddings",), _t5(scales_by_tie=True)),
    "mt5": ConfigClass({**_T5, "vocab_size": 250112, "d_ff": 1024, "num_layers": 8, "num_heads": 6,
                        "feed_forward_proj": "gated-gelu", "tie_word_embeddings": True, "bos_token_id": None,
                        "decoder_start_token_id": 0}, _T5_NAMES, derive=_t5(scales_by_tie=False)),
    # the families of the architecture tables: the fields the memory plan's count reads, and those that decide
    # which tensors a layer has (`hf.architectures.shapes`)
    # Llama and Mistral also with what --to mla carries into its DeepseekV3 config (latent_config), and Mistral's window
    "llama": _lm(32000, 4096, 32, None, 32, 11008, False, head_dim=None, attention_bias=False, mlp_bias=False,
                 derives="kv head_dim", max_position_embeddings=2048, **_CARRIED),
    "mistral": _lm(32000, 4096, 32, 8, 32, 14336, False, head_dim=None, derives="kv head_dim",
                   max_position_embeddings=131072, sliding_window=4096, **_CARRIED),
    "qwen2": _lm(151936, 4096, 32, 32, 32, 22016, False, derives="kv"),
    "qwen3": _lm(151936, 4096, 32, 32, 32, 22016, False, head_dim=128, attention_bias=False, derives="kv"),
    "gemma": _lm(256000, 3072, 16, 16, 28, 24576, True, head_dim=256, attention_bias=False),
    "gemma2": _lm(256000, 2304, 8, 4, 26, 9216, True, head_dim=256, attention_bias=False),
    "gemma3_text": _lm(262208, 2304, 8, 4, 26, 9216, True, head_dim=256, attention_bias=False),
    "phi3": _lm(32064, 3072, 32, None, 32, 8192, False, derives="kv"),
    "olmo": _lm(50304, 4096, 32, None, 32, 11008, False, attention_bias=False, derives="kv"),
    "olmo2": _lm(50304, 4096, 32, None, 32, 11008, False, attention_bias=False, derives="kv"),
    "phi": _lm(51200, 2048, 32, None, 24, 8192, False, qk_layernorm=False, derives="kv", partial_rotary=0.5),
    "starcoder2": _lm(49152, 3072, 24, 2, 30, 12288, True, use_bias=True),
    "granite": _lm(32000, 4096, 32, None, 32, 11008, False, attention_bias=False, mlp_bias=False, derives="kv"),
    "nemotron": _lm(256000, 6144, 48, None, 32, 24576, False, head_dim=None, attention_bias=False, mlp_bias=False,
                    derives="head_dim", partial_rotary=0.5),  # its K/V heads may stay null
    "stablelm": _lm(50304, 2560, 32, 32, 32, 6912, False, qk_layernorm=False, use_qkv_bias=False,
                    use_parallel_residual=False, partial_rotary=0.25),
    # Falcon has no num_key_value_heads (its num_kv_heads is read by its modules alone) and derives head_dim
    "falcon": ConfigClass(dict(vocab_size=65024, hidden_size=4544, num_attention_heads=71, num_hidden_layers=32,
                               tie_word_embeddings=True)),
    "gpt_bigcode": ConfigClass(_BIGCODE, _GPT2_NAMES, derive=_bigcode),
    "gqakit_gpt_bigcode": ConfigClass({**_BIGCODE, "kv_heads": 1}, _GPT2_NAMES, derive=_grouped_bigcode),
}


def class_defaults(model_type) -> dict:
    """The defaults of the config class of this model_type ({} outside the table): what a field config.json leaves
    out is, before the class derives anything."""
    entry = CLASSES.get(model_type)
    return dict(entry.defaults) if entry is not None else {}


def filled(config: dict, common_names: bool = False) -> dict | None:
    """config.json as its class holds it: every field of the table (the class's default where config.json has none;
    with `common_names` also under the common name its class maps to it), the keys the class derives, and
    config.json's other keys as given; None for a model_type outside the table. A field of the wrong type for what
    the class derives from it is refused (GqakitError), as transformers refuses it."""
    entry = CLASSES.get(config.get("model_type"))
    if entry is None:
        return None
    out = {**entry.defaults, **{k: v for k, v in config.items() if k not in entry.consumed}}
    for common, own in entry.aliases:
        if common in config:  # set after the fields, as transformers sets them: the common name wins
            out[own] = config[common]
    if entry.derive is not None:
        try:
            entry.derive(out, config)
        except (TypeError, ValueError, ArithmeticError, AttributeError) as e:  # a field of the wrong type
            raise GqakitError(f"config.json does not read as a {config['model_type']} config ({type(e).__name__}: "
                              f"{e}); fix its fields") from None
    for common, own in entry.aliases:
        if common_names:
            out[common] = out[own]
        else:
            out.pop(common, None)
    return out


def filled_or_given(config: dict) -> dict:
    """`filled(config)` where the table holds its class and its fields read, else config.json as given (a field of
    the wrong type is then left to the checks that name it in their own words)."""
    try:
        return filled(config) or config
    except GqakitError:
        return config


def rope_of(config: dict) -> dict:
    """config.json's RoPE parameters as its class holds them: rope_scaling's and rope_parameters' keys, with the
    class's defaults where config.json leaves them out (Phi turns half of each head unless told), and the top-level
    partial_rotary_factor where neither dict says it. Where both dicts are given, rope_scaling's keys win, as
    transformers reads them: a config saved by 5.x holds a default rope_parameters beside the rope_scaling a Llama 2
    fine-tune wrote. `rope_type` holds the kind however it was spelt (the legacy `type` too)."""
    known = filled_or_given(config)
    scaling, parameters = known.get("rope_scaling") or {}, known.get("rope_parameters") or {}
    rope = {**parameters, **scaling}
    kind = next((d[k] for d in (scaling, parameters) for k in ("rope_type", "type") if d.get(k)), None)
    if kind is not None:
        rope["rope_type"] = kind
    if "partial_rotary_factor" in known:
        rope.setdefault("partial_rotary_factor", known["partial_rotary_factor"])
    return rope


SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
         "intermediate_size", "vocab_size")  # a decoder's sizes, by transformers' common names


def decoder_sizes(config: dict) -> dict | None:
    """A decoder's `SIZES` as transformers' config object says them (its class's defaults filled in): the K/V heads
    every head and head_dim hidden / heads where the class leaves them null or has none, the intermediate size
    n_inner or 4 x hidden where it has no intermediate_size; and its tie_word_embeddings (None: config.json of a
    class outside the table does not say). None where they are not all positive integers, or where config.json
    leaves one to a class the table does not hold."""
    try:
        known = filled(config, common_names=True)
    except GqakitError:
        return None
    if known is None:  # no defaults known: config.json must say every size itself
        if not all(_positive(config.get(key)) for key in SIZES):
            return None
        known = config
    h, a = known.get("hidden_size"), known.get("num_attention_heads")
    if not (_positive(h) and _positive(a)):
        return None
    sizes = {key: known.get(key) for key in SIZES}
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or a
    sizes["head_dim"] = sizes["head_dim"] or h // a
    sizes["intermediate_size"] = sizes["intermediate_size"] or known.get("n_inner") or 4 * h
    if not all(_positive(v) for v in sizes.values()):
        return None
    tie = known.get("tie_word_embeddings")
    return {**sizes, "tie_word_embeddings": tie if isinstance(tie, bool) else None}


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
