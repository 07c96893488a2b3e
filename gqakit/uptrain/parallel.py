"""How a batch of packed sequences meets the processes: data parallel, and optionally context parallel (ring
attention, gqakit.attention.ring), where `context_parallel` = P consecutive ranks share each sequence, sharded
along time; rings are data parallel.

Rank r is context-parallel rank r % P of data-parallel replica r // P. Targets are shifted before sharding (the
data module packs seq_len + 1 tokens), so a shard's last target (whose token may live on the next rank) is
already right; a shard's padding carries target IGNORE so it counts nowhere. Position ids are the tokens' global
positions, so RoPE sees the full sequence. The loop's loss scaling (summed token losses over the global target
count, times the world size that DDP averages over) makes the gradients of a ring's ranks add up to the
full-sequence gradient.
"""
from __future__ import annotations

import contextlib

import torch

from gqakit.attention.masks import MaskSpec
from gqakit.attention.options import mask_spec
from gqakit.attention.ring import ring_context, use_ring
from gqakit.attention.ring_layout import RingLayout, ring_groups
from gqakit.attention.kinds import CONFIG_KEY
from gqakit.uptrain.loss import IGNORE

class SequenceParallel:
    """Data parallel only (P = 1): every rank sees whole sequences."""

    context_parallel = 1

    def __init__(self, data_parallel: int, dp_rank: int):
        self.data_parallel, self.dp_rank = data_parallel, dp_rank

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


def ring_spec(model) -> MaskSpec:
    """The MaskSpec of the attention the model was switched to: the recipe's sliding window / sinks,
    else the model's own `sliding_window` (Mistral), else full causal attention."""
    options = dict(getattr(model.config, CONFIG_KEY, None) or {})
    kind = options.pop("kind", "tiled")
    if kind in ("sliding", "sinks"):
        return mask_spec(kind, options)
    window = getattr(model.config, "sliding_window", None)
    return MaskSpec(window=window) if window else MaskSpec()


class RingSequenceParallel(SequenceParallel):
    """`context_parallel` = P > 1: rank r is ring rank r % P of data-parallel replica r // P."""

    def __init__(self, context_parallel: int, seq_len: int, num_processes: int):
        P = context_parallel
        self.groups = ring_groups(P)  # run.folder.check_processes has refused a P not dividing the world
        super().__init__(num_processes // P, self.groups.data_rank)
        self.context_parallel = P
        self.seq_len = seq_len
        self.spec = MaskSpec()
        self.layout = RingLayout.for_spec(P, self.groups.ring_rank, seq_len, self.spec)
        self.blocks = {"block_q": 128, "block_k": 128}  # the ring kernel's tiles: the recipe's, once the model says

    def prepare_model(self, model) -> None:
        options = getattr(model.config, CONFIG_KEY, None) or {}
        self.blocks = {name: options.get(name, default) for name, default in self.blocks.items()}
        spec = ring_spec(model)
        if spec != self.spec:  # the recipe's sliding window / sinks, inside the ring
            self.spec = spec
            self.layout = RingLayout.for_spec(self.context_parallel, self.groups.ring_rank, self.seq_len, spec)
        use_ring(model)

    def prepare_teacher(self, teacher) -> None:
        use_ring(teacher)  # under the student's ring spec: full causal (config.check refuses windows + teacher)

    def shard(self, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, targets = seqs[:, :-1], seqs[:, 1:]  # shifted on the full sequence, then sharded
        positions = self.layout.positions().to(seqs.device)[None].expand(seqs.shape[0], -1)  # (B, T_local)
        return self.layout.shard(inputs, 1, 0), self.layout.shard(targets, 1, IGNORE), positions

    def attention(self):
        return ring_context(self.layout, self.groups.ring, self.spec, **self.blocks)


def sequence_parallel(context_parallel: int, seq_len: int, accelerator) -> SequenceParallel:
    """Data parallel for `context_parallel` = 1, else rings of that many ranks."""
    if context_parallel == 1:
        return SequenceParallel(accelerator.num_processes, accelerator.process_index)
    return RingSequenceParallel(context_parallel, seq_len, accelerator.num_processes)
