"""Architecture families as small declarative tables, picked by `config.architectures[0]`.

A table names, per decoder layer, the attention tensors that carry K/V heads: the K and V
projections (or the fused QKV projection and its layout), their optional biases, and the norms that
act on K. Everything else in a checkpoint passes through untouched.
"""
from __future__ import annotations

from gqakit.hf.architectures.spec import ArchSpec, KNorm
from gqakit.hf.architectures.table import FAMILIES
from gqakit.hf.config_defaults import filled_or_given

__all__ = ["ArchSpec", "KNorm", "FAMILIES", "family_of_model_type", "find_family", "supported_architectures"]


def supported_architectures() -> list[str]:
    return sorted(a for spec in FAMILIES for a in spec.architectures)


def find_family(architecture: str, config: dict | None = None) -> ArchSpec | None:
    """The table for a `config.architectures[0]` value, or None when gqakit does not support it; with `config`
    (config.json), as that model has it (a key norm its config switches off is gone: `ArchSpec.for_config`)."""
    for spec in FAMILIES:
        if architecture in spec.architectures:
            return spec if config is None or spec.k_norm_key is None else spec.for_config(filled_or_given(config))
    return None


def family_of_model_type(model_type) -> ArchSpec | None:
    """The supported family whose config class has this model_type (what transformers builds from), if any."""
    return next((spec for spec in FAMILIES if spec.config_model_type == model_type), None)
