"""The config.json fields a conversion reads, validated once, here: nothing else reads them raw.

JSON has one number type, so `8.0`, `"8"` and `true` all reach Python as something other than the
int transformers needs; each is refused with a line that names the field, the value and the fix.
`null` means "the default", as it does for transformers.
"""
from __future__ import annotations

import dataclasses
import json
import math

from gqakit.common.errors import GqakitError
from gqakit.hf.architectures.refused import refusal
from gqakit.hf.config_defaults import class_defaults


# The families whose config.json spells their context n_positions: transformers maps max_position_embeddings onto it
# for GPT-2, GPT-J, CodeGen and GPTBigCode (gqakit's grouped GPTBigCode too). T5's n_positions is no limit (its
# positions are relative buckets), so the key is read for these alone.
N_POSITIONS_TYPES = ("gpt2", "gptj", "codegen", "gpt_bigcode", "gqakit_gpt_bigcode")


def context_length(config: dict) -> int | None:
    """The context length of a config.json dict (a multimodal one's text_config too); None if unknown."""
    for section in (config, config.get("text_config") or {}):
        if section.get("max_position_embeddings"):
            return section["max_position_embeddings"]
        if section.get("model_type") in N_POSITIONS_TYPES and section.get("n_positions"):
            return section["n_positions"]
    return None


@dataclasses.dataclass(frozen=True)
class ModelFields:
    architecture: str  # architectures[0]
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    initializer_range: float


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_int(value) -> int | None:
    """The positive integer a user most likely meant (8.0 or "8" -> 8), or None."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def positive_int(config: dict, key: str, default: int | None = None) -> int:
    """config[key] as a positive int (not bool, float or str); null or absent -> `default` if given."""
    value = config.get(key)
    if value is None:
        if default is not None:
            return default
        raise GqakitError(f"config.json has no '{key}'; add it (a positive integer), or point at the folder of a "
                          "supported decoder's checkpoint")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    meant = _as_int(value)
    fix = f"write {meant}" if meant else "write a positive integer"
    raise GqakitError(f"config.json has {key} {_shown(value)}, which is not a positive integer; {fix} "
                      f"(no quotes, no decimal point) for {key} in config.json")


def architecture_of(config: dict) -> str:
    """config.architectures[0], checked."""
    archs = config.get("architectures")
    if archs is None or archs == []:
        if (why := refusal(None, config)) is not None:  # a family gqakit refuses: its reason, not "add" a class
            raise GqakitError(f"cannot convert: {why}")
        raise GqakitError(
            "config.json names no 'architectures'; add the model class, e.g. \"architectures\": "
            "[\"LlamaForCausalLM\"] (save_pretrained writes it)"
        )
    if isinstance(archs, str):
        raise GqakitError(f"config.json has architectures {_shown(archs)}, a string, where a list is needed; "
                          f"write \"architectures\": [{_shown(archs)}] in config.json")
    if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
        raise GqakitError(f"config.json has architectures {_shown(archs)}, which is not a list of class names; "
                          "write e.g. \"architectures\": [\"LlamaForCausalLM\"] in config.json")
    return archs[0]


def _initializer_range(config: dict) -> float:
    value = config.get("initializer_range")
    if value is None:
        return 0.02  # transformers' default for every supported family
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    raise GqakitError(f"config.json has initializer_range {_shown(value)}, which is not a non-negative number; "
                      "write e.g. 0.02 for initializer_range in config.json")


def config_object(config: dict):
    """transformers' config object for a config.json dict (its model_type picks the class; `auto_map`, remote
    code's entry point, is dropped: gqakit never runs remote code)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**{k: v for k, v in config.items() if k != "auto_map"})


def read_fields(config: dict, names: tuple[tuple[str, str], ...] = (), multi_query_key: str | None = None
                ) -> ModelFields:
    """Every field a conversion reads from config.json, type-checked; raises GqakitError naming the fix.
    `names` maps common field names to a family's own spelling (GPTBigCode's n_head); with `multi_query_key`
    the K/V head count is 1 where that boolean is true (its default) and every head where it is false."""
    spelled = dict(names)
    config = {**config, **{common: config.get(own) for common, own in spelled.items() if own in config}}
    # a field config.json leaves out is the class's default where that is a value (Gemma's head_dim 256, StarCoder2's
    # 2 K/V heads), as transformers reads it; where it is derived, or config.json says null, it is derived below
    static = class_defaults(config.get("model_type"))
    config.update({k: static[k] for k in ("head_dim", "num_key_value_heads")
                   if k not in config and static.get(k) is not None})
    architecture = architecture_of(config)
    heads = positive_int(config, "num_attention_heads")
    if multi_query_key is not None:
        flag = config.get(multi_query_key, True)
        if not isinstance(flag, bool):
            raise GqakitError(f"config.json has {multi_query_key} {_shown(flag)}, which is not true or false; "
                              f"write true or false for {multi_query_key} in config.json")
        kv_heads = 1 if flag else heads
    else:
        kv_heads = positive_int(config, "num_key_value_heads", default=heads)
    layers = positive_int(config, "num_hidden_layers")
    if config.get("head_dim") is not None:
        head_dim = positive_int(config, "head_dim")
    else:  # as transformers derives it
        hidden = positive_int(config, "hidden_size")
        head_dim = hidden // heads
        if head_dim == 0:
            raise GqakitError(f"config.json has hidden_size {hidden} < num_attention_heads {heads} and no head_dim; "
                              "fix them in config.json (head_dim = hidden_size / num_attention_heads)")
    return ModelFields(architecture, layers, heads, kv_heads, head_dim, _initializer_range(config))
