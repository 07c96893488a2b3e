"""Attention backends registered with transformers' AttentionInterface.

    import gqakit.attention
    gqakit.attention.use(model, "sliding", window=512)
    AutoModelForCausalLM.from_pretrained(path, attn_implementation="gqakit_tiled")

Importing this package registers `gqakit_tiled`, `gqakit_sliding` and `gqakit_sinks`, and
`gqakit_ring` (context-parallel ring attention; run it inside `ring.ring_context`, see ring.py).
"""
from gqakit.attention import ring  # registers gqakit_ring
from gqakit.attention.options import KINDS
from gqakit.attention.masks import AttentionOptionError
from gqakit.attention.registration import register_all, use

register_all()

__all__ = ["KINDS", "AttentionOptionError", "use"]
