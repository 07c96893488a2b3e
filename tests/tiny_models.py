"""Tiny random checkpoints for tests (built with from_config; seconds, not minutes)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(path: Path, heads: int = 4, kv_heads: int | None = None, layers: int = 2,
                    head_dim: int = 8, seed: int = 0, dtype=torch.float32) -> Path:
    """Save a tiny random Llama (MHA unless kv_heads is given) to `path` and return it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, head_dim=head_dim,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(path)
    return Path(path)
