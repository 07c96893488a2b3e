"""Attention backends registered with transformers' AttentionInterface.

    import gqakit.attention
    gqakit.attention.use(model, "sliding", window=512)
    AutoModelForCausalLM.from_pretrained(path, attn_implementation="gqakit_tiled")

Importing this package registers `gqakit_tiled`, `gqakit_sliding` and `gqakit_sinks`.
"""
from .registry import KINDS, AttentionOptionError, register_all, use

register_all()

__all__ = ["KINDS", "AttentionOptionError", "use"]
