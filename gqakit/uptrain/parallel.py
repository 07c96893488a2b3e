"""How a batch of packed sequences meets the processes: data parallel, and optionally context
parallel (ring attention), where `context_parallel` consecutive ranks share each sequence.

Rank r is context-parallel rank r % P of data-parallel replica r // P. Targets are shifted before
sharding (the data module packs seq_len + 1 tokens), position ids stay global, and a shard's padding
carries target IGNORE so it counts nowhere.
"""
from __future__ import annotations

import contextlib

import torch

from gqakit.uptrain.config import UptrainConfig


class SequenceParallel:
    """Data parallel only (P = 1): every rank sees whole sequences."""

    context_parallel = 1

    def __init__(self, data_parallel: int, dp_rank: int):
        self.data_parallel, self.dp_rank = data_parallel, dp_rank

    @staticmethod
    def create(cfg: UptrainConfig, accelerator) -> "SequenceParallel":
        if cfg.context_parallel == 1:
            return SequenceParallel(accelerator.num_processes, accelerator.process_index)
        from gqakit.uptrain.context_parallel import RingSequenceParallel

        return RingSequenceParallel(cfg, accelerator)

    def shard(self, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, targets, position_ids) of this rank from packed sequences (B, T + 1)."""
        inputs, targets = seqs[:, :-1], seqs[:, 1:]
        positions = torch.arange(inputs.shape[1], device=seqs.device).expand_as(inputs)
        return inputs, targets, positions

    def attention(self):
        return contextlib.nullcontext()

    def prepare_model(self, model) -> None:
        """Switch a model to the attention this parallelism needs (nothing for data parallel)."""

    def prepare_teacher(self, teacher) -> None:
        """Switch the distillation teacher to this parallelism's attention (nothing for data parallel)."""
