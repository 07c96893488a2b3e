"""Context parallelism for uptraining: each sequence is sharded along time over a ring of
`context_parallel` consecutive ranks (ring attention, gqakit.attention.ring); rings are data parallel.

Targets come pre-shifted from the packer, so a shard's last target (whose token may live on the next
rank) is already right; pad tokens at the end of the layout get target IGNORE. Position ids are the
tokens' global positions, so RoPE sees the full sequence. The loop's loss scaling (summed token losses
over the global target count, times the world size that DDP averages over) makes the gradients of a
ring's ranks add up to the full-sequence gradient.
"""
from __future__ import annotations

import torch

from gqakit.attention.masks import MaskSpec
from gqakit.attention.options import mask_spec
from gqakit.attention.ring import ring_context, use_ring
from gqakit.attention.ring_layout import RingLayout, ring_groups
from gqakit.uptrain.config import UptrainConfig
from gqakit.uptrain.loss import IGNORE
from gqakit.uptrain.parallel import SequenceParallel


def ring_spec(model) -> MaskSpec:
    """The MaskSpec of the attention the model was switched to: the recipe's sliding window / sinks,
    else the model's own `sliding_window` (Mistral), else full causal attention."""
    from gqakit.attention.options import CONFIG_KEY

    options = dict(getattr(model.config, CONFIG_KEY, None) or {})
    kind = options.pop("kind", "tiled")
    if kind in ("sliding", "sinks"):
        return mask_spec(kind, options)
    window = getattr(model.config, "sliding_window", None)
    return MaskSpec(window=window) if window else MaskSpec()


class RingSequenceParallel(SequenceParallel):
    """`context_parallel` = P > 1: rank r is ring rank r % P of data-parallel replica r // P."""

    def __init__(self, cfg: UptrainConfig, accelerator):
        P = cfg.context_parallel
        self.groups = ring_groups(P)  # run_folder.check_processes has refused a P not dividing the world
        super().__init__(accelerator.num_processes // P, self.groups.data_rank)
        self.context_parallel = P
        self.seq_len = cfg.seq_len
        self.spec = MaskSpec()
        self.layout = RingLayout.for_spec(P, self.groups.ring_rank, cfg.seq_len, self.spec)

    def prepare_model(self, model) -> None:
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
        return ring_context(self.layout, self.groups.ring, self.spec)
