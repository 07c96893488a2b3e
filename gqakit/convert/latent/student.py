"""One layer's latent attention as a trainable module, for attention transfer (`--to mla --method transfer` with
`--kv-rank` / `--rope-dim`, or `--bias-free`): transformers' own `DeepseekV3Attention`, built from the target's
config, fed exactly the keyword inputs the source model's attention took during calibration.

RoPE: the source's tables (cos, sin: (..., T, d), rotate-half layout, frequency j at dims j and j + d/2) hold the
target's. The target's rope_theta is theta^(D/d) (`hf.architectures.latent.latent_config`), so its D/2 frequencies
are the source's D/2 highest, dims j < D/2 of each half: `KeptPairs` slices them out of each call's tables, so the
module is a drop-in for the source's attention (teacher-forced, and inside the source's layer with
`--transfer-inputs converted`). The tests check it against the written checkpoint's own attention.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gqakit.convert.latent.construct import fitted_norm
from gqakit.convert.methods.transfer import build_attention
from gqakit.hf.architectures.latent import KV_NORM, LATENT_PARAMS, LatentShape, latent_config


def kept_dims(head_dim: int, rope_dim: int) -> list[int]:
    """The source's RoPE-table dims the target's shared key uses: pairs j < D/2, both halves."""
    return [*range(rope_dim // 2), *range(head_dim // 2, head_dim // 2 + rope_dim // 2)]


def kept_pairs(cls: type, head_dim: int, rope_dim: int) -> type:
    """`cls` (DeepseekV3Attention) taking the source's RoPE tables: each call's cos / sin sliced to `kept_dims`."""
    kept = torch.tensor(kept_dims(head_dim, rope_dim))

    class KeptPairs(cls):
        def forward(self, hidden_states, position_embeddings, *args, **kwargs):
            cos, sin = position_embeddings
            index = kept.to(cos.device)
            return super().forward(hidden_states, (cos.index_select(-1, index), sin.index_select(-1, index)),
                                   *args, **kwargs)

    KeptPairs.__name__ = KeptPairs.__qualname__ = f"KeptPairs{cls.__name__}"
    return KeptPairs


def latent_student(grouped_config: dict, shape: LatentShape, layers: int, layer: int,
                   tensors: dict[str, torch.Tensor], device="cpu") -> nn.Module:
    """Layer `layer` of the target as `DeepseekV3Attention` taking the source's inputs, its parameters `tensors`
    (names as `shape.shapes` gives them) in float32."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cls = kept_pairs(DeepseekV3Attention, shape.v_dim, shape.rope_dim)
    return build_attention(cls, latent_config(grouped_config, shape, layers), layer, tensors, "sdpa", device)


def set_norm_from(student: nn.Module, xs: torch.Tensor) -> None:
    """Bias-free: the latent RMSNorm's weight where it best undoes the norm on the latents of inputs xs (N, T, n)
    (`construct.fitted_norm`), so that training starts from the fit it was given."""
    rank = student.kv_a_layernorm.weight.shape[0]
    with torch.no_grad():
        latent = student.kv_a_proj_with_mqa(xs.to(student.kv_a_proj_with_mqa.weight))[..., :rank]
        weight = fitted_norm(latent.reshape(-1, rank), student.kv_a_layernorm.variance_epsilon)
        student.kv_a_layernorm.weight.copy_(weight)


def trained(params: str, shape: LatentShape) -> Callable[[str], bool]:
    """Which of the student's parameters (by name) attention transfer trains, for --transfer-params `params`: with
    the bias coordinate its biases and the norm weight that cancels it stay fixed; bias-free, the norm's weight is
    trained too."""
    names = (*LATENT_PARAMS[params], *(() if shape.bias else (KV_NORM,)))
    return lambda name: name in names
