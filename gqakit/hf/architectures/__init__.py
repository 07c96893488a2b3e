"""Architecture families as small declarative tables, picked by `config.architectures[0]`.

A table names, per decoder layer, the attention tensors that carry K/V heads: the K and V
projections (or the fused QKV projection and its layout), their optional biases, and the norms that
act on K. Everything else in a checkpoint passes through untouched.
"""
from __future__ import annotations

from gqakit.hf.architectures.spec import ArchSpec, KNorm
from gqakit.hf.architectures.table import FAMILIES

__all__ = ["ArchSpec", "KNorm", "FAMILIES", "find_family", "supported_architectures"]


def supported_architectures() -> list[str]:
    return sorted(a for spec in FAMILIES for a in spec.architectures)


def find_family(architecture: str) -> ArchSpec | None:
    """The table for a `config.architectures[0]` value, or None when gqakit does not support it."""
    for spec in FAMILIES:
        if architecture in spec.architectures:
            return spec
    return None
