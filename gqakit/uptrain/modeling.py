"""The models of an uptraining run: the student (with its attention backend and trainable subset),
the optional frozen teacher, and AdamW with a warmup + cosine schedule."""
from __future__ import annotations

import math

import torch

from gqakit.common.errors import GqakitError
from gqakit.uptrain.trainable import trains


def load_lm(path: str):
    """A local checkpoint (decoder or encoder-decoder) in fp32 (master weights; mixed precision is autocast's
    business)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from gqakit.hf.compat import LOAD_KWARGS
    from gqakit.hf.loading import auto_model_class, check_loading, quiet_transformers

    hf_logging.disable_progress_bar()
    with quiet_transformers():  # check_loading says in one line what its report would say in many
        model, info = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(
            path, dtype=torch.float32, ignore_mismatched_sizes=True, output_loading_info=True, **LOAD_KWARGS)
    check_loading(path, info)  # absent or resized weights: one line, never a half-random model trained
    return model


def _layers(model) -> tuple[int, int]:
    """(decoder layers, encoder layers: 0 for a decoder-only model)."""
    from gqakit.hf.loading import cached_layers, is_encoder_decoder

    config = model.config
    return cached_layers(config), (config.num_layers if is_encoder_decoder(config) else 0)


def select_trainable(model, which: str) -> tuple[int, int]:
    """Freeze all but `which` ('all', 'attention' or 'kv'); returns (trainable, total) parameter counts."""
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    grouped = getattr(model.config, "encoder_num_key_value_heads", None) not in (  # stock T5 has no such field
        None, getattr(model.config, "num_heads", None))
    train = trains(which, arch, *_layers(model), encoder_grouped=grouped)  # by name: `trainable.py`
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
