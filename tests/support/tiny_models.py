"""Tiny random checkpoints for tests (built with from_config; seconds, not minutes)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(path: Path, heads: int = 4, kv_heads: int | None = None, layers: int = 2,
                    head_dim: int = 8, seed: int = 0, dtype=torch.float32, vocab_size: int = 64) -> Path:
    """Save a tiny random Llama (MHA unless kv_heads is given) to `path` and return it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, head_dim=head_dim,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(path)
    return Path(path)


def checkpoint_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the checkpoint at `path` on `ids` (stock from_pretrained)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def make_disguised_llama(path: Path, heads: int = 4, head_dim: int = 8, layers: int = 2, vocab_size: int = 64,
                         pairs: str = "neighbours") -> Path:
    """A tiny Llama whose K/V heads come in pairs that are the SAME head seen through different exact
    reparametrisations (a scaled rotation per RoPE pair for keys, an orthogonal map for values, each
    compensated in q_proj / o_proj): its function is that of a GQA model with heads/2 K/V heads, but no
    two heads are equal. `pairs`: "neighbours" (heads 2i, 2i+1) or "halves" (heads i, i + heads/2: a
    contiguous grouping puts the wrong heads together)."""
    from safetensors.torch import load_file, save_file

    from gqakit.convert.methods.align import rotation, transform_keys, transform_values

    make_tiny_llama(path, heads=heads, layers=layers, head_dim=head_dim, seed=3, vocab_size=vocab_size)
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    half = head_dim // 2
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        q, k, v, o = (weights[p + n + ".weight"].double() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        k = k.reshape(heads, head_dim, -1)
        v = v.reshape(heads, head_dim, -1)
        if pairs == "neighbours":
            k[1::2], v[1::2] = k[0::2], v[0::2]
        else:
            k[heads // 2:], v[heads // 2:] = k[: heads // 2], v[: heads // 2]
        k, v = k.reshape(heads * head_dim, -1), v.reshape(heads * head_dim, -1)
        angle = torch.rand(heads, half, generator=gen, dtype=torch.float64) * 6.28
        scale = 0.5 + torch.rand(heads, half, generator=gen, dtype=torch.float64)
        key_maps = scale[..., None, None] * rotation(angle)
        q, k, _, _ = transform_keys(q, k, key_maps, heads, heads, head_dim)
        value_maps = torch.linalg.qr(torch.randn(heads, head_dim, head_dim, generator=gen, dtype=torch.float64))[0]
        v, o, _ = transform_values(v, o, value_maps, heads, heads, head_dim)
        for n, t in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)):
            weights[p + n + ".weight"] = t.float().contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
