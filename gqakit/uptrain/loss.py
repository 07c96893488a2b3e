"""Uptraining losses as SUMS over target tokens, so that any split of a batch (micro-batches,
data-parallel ranks, context-parallel shards of one sequence) adds up to the same total.

    cross-entropy    sum_t -log p_student(y_t | x_<t)
    distillation     sum_t tau^2 * KL(p_teacher^tau || p_student^tau)      (Hinton et al. 2015)

where p^tau = softmax(logits / tau); tau^2 keeps the gradient scale independent of tau. The GQA paper
uptrains with cross-entropy only; distilling from the original MHA model is gqakit's addition.
Targets equal to IGNORE (padding of a context-parallel shard) count nowhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (fp32) of logits (B, T, V) against targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def distillation_sum(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Summed tau^2 * KL(teacher || student) over the positions whose target is not IGNORE (fp32)."""
    keep = (targets != IGNORE).flatten()  # (B*T,)
    s = student.float().flatten(0, 1)[keep] / temperature  # (N, V)
    t = teacher.float().flatten(0, 1)[keep] / temperature
    log_p_t = torch.log_softmax(t, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - torch.log_softmax(s, dim=-1))).sum()
    return kl * temperature**2
