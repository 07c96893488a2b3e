"""T5, Flan-T5 and mT5 (the original google checkpoints' T5WithLMHeadModel too) -> gqakit's
GroupedT5ForConditionalGeneration (gqakit/hf/models/grouped_t5.py).

No stock transformers T5 class holds fewer K/V heads than query heads, so a T5 is re-hosted on gqakit's thin
subclass, which reads the K/V head counts from config.json and is otherwise T5 itself: the same tensors under
the same names. The config is written out in full and gains `num_key_value_heads` (the decoder's self- and
cross-attention), `encoder_num_key_value_heads` (both every head here) and an explicit `num_decoder_layers`.
Exact: mT5 is T5's code with other defaults, which the config carries.
"""
from __future__ import annotations

from gqakit.hf.architectures.rehost.base import Rehost, source_config
from gqakit.hf.headers import TensorInfo
from gqakit.hf.fields import positive_int


def build(config: dict, tensors: dict[str, TensorInfo]) -> tuple[dict, dict[str, TensorInfo]]:
    heads = positive_int(config, "num_heads")
    layers = positive_int(config, "num_layers")
    d_model = positive_int(config, "d_model")
    # every field of T5's config class spelled out: mT5's defaults differ from T5's, and a config.json may leave out
    # the fields at its class's default
    src = vars(source_config(config, "T5", ("t5", "mt5")))
    new = {k: v for k, v in src.items()
           if k not in ("auto_map", "transformers_version", "_name_or_path", "scale_decoder_outputs")}
    # transformers' T5 ties the embeddings always and reads config.json's tie_word_embeddings as "scale the decoder
    # output by d_model ** -0.5" (T5 1.0: true; T5 1.1 / Flan-T5: false); mT5 never scales
    new["tie_word_embeddings"] = bool(src.get("scale_decoder_outputs", False))
    new.update(
        model_type="gqakit_t5", architectures=["GroupedT5ForConditionalGeneration"],
        num_decoder_layers=positive_int(config, "num_decoder_layers", default=layers),
        num_key_value_heads=heads, encoder_num_key_value_heads=heads,
        # T5 has no initializer_range: its K/V projections start at std initializer_factor / sqrt(d_model)
        initializer_range=float(config.get("initializer_factor", 1.0)) * d_model ** -0.5,
    )
    return new, dict(tensors)


# T5WithLMHeadModel: the class name the original google checkpoints (t5-small, ...) still carry in config.json
REHOSTS = (Rehost("T5", ("T5ForConditionalGeneration", "MT5ForConditionalGeneration", "T5WithLMHeadModel"),
                  "GroupedT5ForConditionalGeneration", build,
                  "exact: the same tensors, in gqakit's T5 subclass that holds grouped K/V heads"),)
