"""gqakit/hf/architectures/shapes.py: the tensors config.json implies are, name for name and shape for shape, those a
tiny model of the family saves, for every family with a layout, its head tied and untied, and the variants its
config fields select (biases, norms); a family or variant without a layout gets None."""
from __future__ import annotations

import json

import pytest

from families import FAMILIES, make_model
from gqakit.hf.architectures.shapes import LAYOUTS, config_shapes
from gqakit.hf.folder import model_folder

VARIANTS = {
    "llama": [dict(attention_bias=True, mlp_bias=True)],
    "granite": [dict(attention_bias=False, mlp_bias=True)],
    "qwen3": [dict(attention_bias=False)],
    "gemma": [dict(attention_bias=True)],
    "olmo2": [dict(attention_bias=True, num_key_value_heads=2)],
    "starcoder2": [dict(use_bias=False)],
    "nemotron": [dict(attention_bias=False, mlp_bias=True)],
    "stablelm": [dict(qk_layernorm=False, use_parallel_residual=True, use_qkv_bias=False)],
    "gpt_bigcode": [dict(multi_query=True)],
    "gqakit_gpt_bigcode": [dict(kv_heads=2)],
    "phi3": [dict(num_key_value_heads=2)],
}
CASES = [pytest.param(f, dict(tie_word_embeddings=t), id=f"{f} tied={t}") for f in sorted(FAMILIES) for t in (0, 1)]
CASES += [pytest.param(f, v, id=f"{f} {v}") for f, vs in sorted(VARIANTS.items()) for v in vs]


@pytest.mark.parametrize("family, overrides", CASES)
def test_the_tensors_config_json_implies_are_the_saved_ones(family, overrides, tmp_path):
    path = make_model(family, tmp_path / family, **{k: bool(v) if k == "tie_word_embeddings" else v
                                                    for k, v in overrides.items()})
    folder = model_folder(path)
    shapes = config_shapes(folder.config)
    if folder.config["model_type"] in ("falcon",) or folder.config.get("qk_layernorm"):
        assert shapes is None  # no layout: counted on the meta device
        return
    saved = {name: tuple(info.shape) for name, info in folder.tensors.items()}
    if folder.config.get("tie_word_embeddings"):
        saved.setdefault("lm_head.weight", shapes["lm_head.weight"])  # the layouts list the head tied or not
    assert shapes == saved


def test_every_family_of_the_tables_has_a_layout_or_is_named_here():
    from gqakit.hf.architectures import FAMILIES as TABLE

    without = {spec.family for spec in TABLE} - set(LAYOUTS)
    assert without == {"falcon", "gqakit_t5"}  # Falcon's variants: the meta device; T5: not a decoder


def test_a_config_outside_the_layouts_gets_none():
    assert config_shapes({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}) is None
    assert config_shapes({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": "8"}) is None
    assert json.dumps(config_shapes({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                     "num_hidden_layers": 1, "vocab_size": 8, "hidden_size": 4,
                                     "num_attention_heads": 2, "intermediate_size": 6})) is not None
