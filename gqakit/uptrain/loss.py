"""Uptraining losses as SUMS over target tokens, so that any split of a batch (micro-batches,
data-parallel ranks, context-parallel shards of one sequence) adds up to the same total.

    cross-entropy    sum_t -log p_student(y_t | x_<t)
    distillation     sum_t tau^2 * KL(p_teacher^tau || p_student^tau)      (Hinton et al. 2015)
    top-k            sum_t tau^2 * sum_{i in top_k(teacher_t)} p_i (log p_i - log p_student^tau(i)),
                     p = softmax over the teacher's k largest logits / tau (the rest of its vocabulary is never
                     kept: memory n k instead of n V); equal to the full KL at k = V

where p^tau = softmax(logits / tau); tau^2 keeps the gradient scale independent of tau. The GQA paper
uptrains with cross-entropy only; distilling from the original MHA model is gqakit's addition.
Targets equal to IGNORE (padding of a context-parallel shard) count nowhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
INPUT_PAD = -1  # an encoder input position past its row's end (`data.pairs`): a mask, not a token


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


def teacher_top_k(teacher: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k largest logits per position, as fp32 probabilities renormalised over those k (at
    `temperature`) and their vocabulary indices: (B, T, k) each."""
    values, indices = teacher.float().topk(k, dim=-1)
    return torch.softmax(values / temperature, dim=-1), indices


def top_k_distillation_sum(student: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, targets: torch.Tensor,
                           temperature: float = 1.0) -> torch.Tensor:
    """Summed tau^2 * sum_i p_i (log p_i - log q_i) over the teacher's top-k entries i (`teacher_top_k`), q the
    student's full-vocabulary softmax at tau, over the positions whose target is not IGNORE (fp32)."""
    keep = (targets != IGNORE).flatten()
    log_q = torch.log_softmax(student.float().flatten(0, 1)[keep] / temperature, dim=-1)  # (N, V)
    p = probs.flatten(0, 1)[keep]  # (N, k)
    log_q_top = log_q.gather(1, indices.flatten(0, 1)[keep])  # (N, k)
    kl = (p * (p.clamp_min(torch.finfo(p.dtype).tiny).log() - log_q_top)).sum()
    return kl * temperature**2
