"""The models of an uptraining run: the student (with its attention backend and trainable subset),
the optional frozen teacher, and AdamW with a warmup + cosine schedule."""
from __future__ import annotations

import math

import torch

from gqakit.common.errors import GqakitError


def load_lm(path: str):
    """A local checkpoint (decoder or encoder-decoder) in fp32 (master weights; mixed precision is autocast's
    business)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from gqakit.hf.loading import auto_model_class

    hf_logging.disable_progress_bar()
    return auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)


def _family(model):
    from gqakit.hf.architectures.rehost import attention_layout

    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    return arch, attention_layout(arch)


def _layers(model) -> tuple[int, int]:
    """(decoder layers, encoder layers: 0 for a decoder-only model)."""
    from gqakit.hf.loading import cached_layers, is_encoder_decoder

    config = model.config
    return cached_layers(config), (config.num_layers if is_encoder_decoder(config) else 0)


def _sites(spec, model) -> list[tuple[str, str, int]]:
    """(k template, v template, layers) of every attention with K/V projections: the family's own, its other
    sites (T5's cross-attention) and an encoder's self-attention."""
    decoder, encoder = _layers(model)
    sites = [(spec.k_proj, spec.v_proj, decoder), *((k, v, decoder) for _, k, v in spec.kv_sites)]
    return sites + ([(*spec.encoder_kv, encoder)] if encoder else [])


def _kv_names(model) -> list[str]:
    """Parameter-name prefixes of the K/V projections (and key norms) per the architecture table: every grouped
    attention's (an encoder-decoder's encoder only where its K/V heads are grouped)."""
    from gqakit.hf.architectures import KNorm

    arch, spec = _family(model)
    if spec is None:
        raise GqakitError(f"trainable=kv does not know where {arch} keeps its K/V projections; "
                          "use trainable=attention or trainable=all")
    if spec.fused:
        raise GqakitError(f"trainable=kv needs separate K/V projections, but {arch} fuses them in "
                          f"{spec.qkv_proj.format(i='N')}; use trainable=attention")
    sites = _sites(spec, model)
    if spec.encoder_kv is not None and getattr(model.config, "encoder_num_key_value_heads", None) in (
            None, model.config.num_heads):  # stock T5 has no such field: all heads
        sites = sites[:-1]  # an MHA encoder is not what was converted
    prefixes = [t.format(i=i) + "." for k, v, layers in sites for i in range(layers) for t in (k, v)]
    for i in range(_layers(model)[0]):
        if spec.k_norm in (KNorm.SPANS_HEADS, KNorm.SHARED_PER_HEAD) and spec.k_norm_weight:
            prefixes.append(spec.k_norm_weight.format(i=i))
        elif spec.k_norm is KNorm.ONE_PER_HEAD and spec.k_norm_weight:
            prefixes.append(spec.k_norm_weight.format(i=i, h=0).rsplit(".", 2)[0] + ".")
    return prefixes


def _attention_names(model) -> list[str]:
    """Per layer, the prefix of each attention module (the parent of o_proj in the architecture table: `self_attn`,
    GPTBigCode's `attn`, Falcon's `self_attention`; T5's decoder self- and cross-attention and its encoder's
    self-attention); [] for a family outside the tables."""
    arch, spec = _family(model)
    if spec is None:
        return []
    if spec.fused or spec.encoder_kv is None:
        return [spec.o_proj.format(i=i).rsplit(".", 1)[0] + "." for i in range(_layers(model)[0])]
    return [k.format(i=i).rsplit(".", 1)[0] + "." for k, _, layers in _sites(spec, model) for i in range(layers)]


def select_trainable(model, which: str) -> tuple[int, int]:
    """Freeze all but `which` ('all', 'attention' or 'kv'); returns (trainable, total) parameter counts."""
    if which == "kv":
        prefixes = tuple(_kv_names(model))
        train = lambda name: name.startswith(prefixes)  # noqa: E731
    elif which == "attention":
        prefixes = tuple(_attention_names(model))
        if prefixes:
            train = lambda name: name.startswith(prefixes)  # noqa: E731
        else:
            train = lambda name: ".self_attn." in name  # noqa: E731
    else:
        train = lambda name: True  # noqa: E731
    trainable = total = 0
    for name, p in model.named_parameters():
        p.requires_grad_(train(name))
        trainable += p.numel() * p.requires_grad
        total += p.numel()
    if trainable == 0:
        raise GqakitError(f"trainable={which} selects no parameter of {type(model).__name__}; use trainable=all")
    return trainable, total


def make_optimizer(model, lr: float, betas: tuple[float, ...], weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; weight decay on matrices only (not norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas))


def warmup_steps(steps: int, fixed: int, fraction: float) -> int:
    """The recipe's warmup_steps (`fixed`), or its warmup_fraction of the run's steps when that is 0."""
    return fixed or math.ceil(fraction * steps)


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 towards `min_ratio`, reached at step `steps`
    (one past the last step, which runs just above it)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(optimizer, steps: int, warmup: int, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay to min_lr_ratio (`lr_factor`)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, warmup, min_lr_ratio))
