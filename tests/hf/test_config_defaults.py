"""gqakit/hf/config_defaults.py against the installed transformers: every default of the table is its config class's
own, every alias is the class's attribute_map, and a config.json filled from the table reads, field for field, as
the object transformers builds from the same config.json (full, as save_pretrained writes it; as a diff against the
class's defaults; as a bare model_type; with legacy and aliased keys)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig, CONFIG_MAPPING, MT5Config, T5Config

import gqakit  # noqa: F401  (registers gqakit_gpt_bigcode, whose defaults the table holds too)
from families import FAMILIES, REHOST_SOURCES, _config
from gqakit.hf.config_defaults import CLASSES, filled

T5_COMMON = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
SOURCES = {
    **{f"rehost {name}": make for name, make in REHOST_SOURCES.items()},
    **{f"family {name}": (lambda name=name: _config(name)) for name in FAMILIES},
    "t5": lambda: T5Config(**T5_COMMON),
    "flan-t5": lambda: T5Config(**T5_COMMON, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "mt5": lambda: MT5Config(**T5_COMMON, num_decoder_layers=3),
}
# config.json shapes that exercise the legacy keys, the aliases and what __post_init__ derives
EDGES = [
    {"model_type": "gpt_neox", "rotary_pct": 0.5, "rotary_emb_base": 500.0},
    {"model_type": "gpt_neox", "rope_scaling": {"type": "default", "rope_theta": 20.0}, "rotary_pct": 1.0},
    {"model_type": "gpt_neox", "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}},
    {"model_type": "gpt2", "hidden_size": 64, "n_embd": 32, "num_attention_heads": 2},
    {"model_type": "gptj", "n_embd": 64, "rotary_dim": 8},
    {"model_type": "opt", "hidden_size": 64},
    {"model_type": "opt", "hidden_size": 64, "word_embed_proj_dim": 32},
    {"model_type": "t5", "tie_word_embeddings": False},
    {"model_type": "t5", "tie_word_embeddings": True, "scale_decoder_outputs": False, "dense_act_fn": "gelu"},
    {"model_type": "t5", "feed_forward_proj": "gated-silu", "num_decoder_layers": 3},
    {"model_type": "mt5", "tie_word_embeddings": False},
    {"model_type": "gpt_bigcode", "multi_query": False, "n_head": 4},
    {"model_type": "gpt_bigcode", "multi_query": False, "n_head": 4, "num_key_value_heads": 2},
    {"model_type": "gqakit_gpt_bigcode", "n_head": 4, "kv_heads": 2, "num_key_value_heads": 4},
    {"model_type": "llama", "num_key_value_heads": None, "head_dim": None},
    {"model_type": "qwen2", "head_dim": 64},
    {"model_type": "falcon", "num_kv_heads": 8, "new_decoder_architecture": True},
    # partial RoPE by default: the fraction where config.json leaves it out, and wherever it says it
    {"model_type": "phi", "partial_rotary_factor": 0.4},
    {"model_type": "phi", "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}},
    {"model_type": "phi", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}, "rope_theta": 3.0},
    {"model_type": "phi", "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.75},
    {"model_type": "nemotron", "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}},
    {"model_type": "stablelm", "rope_theta": 7.0},
    {"model_type": "stablelm", "partial_rotary_factor": 1.0, "qk_layernorm": True},
]
# turned into torch dtypes, rewritten, or integer-keyed by the class: fields gqakit never reads
_NOT_COMPARED = {"dtype", "torch_dtype", "transformers_version", "id2label", "label2id"}


def _json(config) -> dict:
    return json.loads(config.to_json_string(use_diff=False))


def _cases() -> list:
    cases = [pytest.param({"model_type": mt}, id=f"bare {mt}") for mt in sorted(CLASSES)]
    for name, make in sorted(SOURCES.items()):
        cases.append(pytest.param(("full", make), id=f"full {name}"))
        cases.append(pytest.param(("diff", make), id=f"diff {name}"))
    return cases + [pytest.param(c, id=f"edge {i} {c['model_type']}") for i, c in enumerate(EDGES)]


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_every_default_and_alias_is_the_config_classs_own(model_type):
    cls = CONFIG_MAPPING[model_type]
    declared = {f.name: f.default for f in dataclasses.fields(cls)}
    entry = CLASSES[model_type]
    for key, value in entry.defaults.items():
        assert key in declared, f"{cls.__name__} declares no field {key}"
        assert declared[key] is not dataclasses.MISSING and declared[key] == value, (cls.__name__, key, declared[key])
        assert type(declared[key]) is type(value), (cls.__name__, key)  # 0 is not 0.0 in a written config.json
    assert dict(entry.aliases) == dict(cls.attribute_map), cls.__name__


@pytest.mark.parametrize("case", _cases())
def test_a_filled_config_reads_as_transformers_builds_it(case):
    if isinstance(case, tuple):
        how, make = case
        config = json.loads(make().to_json_string(use_diff=how == "diff"))
    else:
        config = dict(case)
    light = filled(config, common_names=True)
    assert light is not None, config.get("model_type")
    real = AutoConfig.for_model(**json.loads(json.dumps(config)))  # its own copy: transformers mutates nested dicts
    for key in sorted(set(light) - _NOT_COMPARED):
        assert getattr(real, key) == light[key], (key, getattr(real, key), light[key])


def test_a_model_type_outside_the_table_is_not_filled():
    assert filled({"model_type": "bloom", "n_head": 8}) is None
    assert filled({"n_embd": 8}) is None
