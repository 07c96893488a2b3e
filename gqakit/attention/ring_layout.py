"""How a sequence is cut across the ranks of a ring (context parallelism), and the model-facing pieces.

The sequence of T tokens is padded at the END to a multiple of 2P (P = ring size) and cut into chunks:

    contiguous  rank i holds chunk i of P                  (best for sliding windows: neighbours only)
    zigzag      rank i holds chunks i and 2P-1-i of 2P     (every rank does the same causal work)

Pad tokens (global positions >= T) are never attended to as keys; as queries they give output 0.
`positions()` are the global positions of the local tokens, to pass as `position_ids` so that RoPE
sees each token where it really is.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from gqakit.attention.masks import MaskSpec
from gqakit.attention.masks import AttentionOptionError

KINDS = ("zigzag", "contiguous")


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Rank `rank` of a ring of `world_size` ranks sharing one sequence of `seq_len` real tokens."""

    world_size: int
    rank: int
    seq_len: int
    kind: str = "zigzag"

    def __post_init__(self) -> None:
        P, T = self.world_size, self.seq_len
        if self.kind not in KINDS:
            raise AttentionOptionError(f"ring layout '{self.kind}' is unknown; choose 'zigzag' or 'contiguous'")
        if P < 1 or not 0 <= self.rank < P:
            raise AttentionOptionError(f"ring rank {self.rank} is outside a ring of {P} ranks; "
                                       f"give 0 <= rank < world_size")
        if T < 2 * P:
            raise AttentionOptionError(f"a sequence of {T} tokens is too short for a ring of {P} ranks: it needs "
                                       f"at least 2P = {2 * P} tokens; use a ring of at most {max(T // 2, 1)} "
                                       "ranks or a longer sequence")

    @classmethod
    def for_spec(cls, world_size: int, rank: int, seq_len: int, spec: MaskSpec = MaskSpec()) -> "RingLayout":
        """Zigzag for causal attention without a window (balances causal work); contiguous otherwise
        (a window or non-causal attention is already balanced, and contiguous keeps windows local)."""
        zig = spec.causal and spec.window is None
        return cls(world_size, rank, seq_len, "zigzag" if zig else "contiguous")

    # ---- sizes and positions -----------------------------------------------------------------

    @property
    def padded_len(self) -> int:
        return math.ceil(self.seq_len / (2 * self.world_size)) * 2 * self.world_size

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world_size

    def chunks(self, rank: int | None = None) -> list[tuple[int, int]]:
        """The (global start, length) of each chunk a rank holds, in local order."""
        r = self.rank if rank is None else rank
        if self.kind == "contiguous":
            return [(r * self.local_len, self.local_len)]
        c = self.padded_len // (2 * self.world_size)
        return [(r * c, c), ((2 * self.world_size - 1 - r) * c, c)]

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """Global positions (local_len,) of a rank's tokens; pad tokens continue past seq_len."""
        return torch.cat([torch.arange(s, s + n) for s, n in self.chunks(rank)])

    def real(self, rank: int | None = None) -> torch.Tensor:
        """Bool (local_len,): True for real tokens, False for end padding."""
        return self.positions(rank) < self.seq_len

    # ---- moving tensors ------------------------------------------------------------------------

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value=0) -> torch.Tensor:
        """This rank's slice along `dim` of a full-sequence tensor (length seq_len), padded with `pad_value`."""
        dim = dim % x.dim()
        if x.shape[dim] != self.seq_len:
            raise AttentionOptionError(f"cannot shard a tensor of length {x.shape[dim]} along dim {dim} with a "
                                       f"ring layout for seq_len={self.seq_len}; build the layout from this length")
        pad_shape = list(x.shape)
        pad_shape[dim] = self.padded_len - self.seq_len
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)  # (..., padded_len, ...)
        return torch.cat([x.narrow(dim, s, n) for s, n in self.chunks()], dim=dim)

    def unshard(self, pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of `shard`: every rank's local tensor, in rank order -> full tensor of length seq_len."""
        if len(pieces) != self.world_size:
            raise ValueError(f"unshard needs one piece per rank ({self.world_size}), got {len(pieces)}")
        dim = dim % pieces[0].dim()
        parts: list[tuple[int, torch.Tensor]] = []
        for r, piece in enumerate(pieces):
            off = 0
            for s, n in self.chunks(r):
                parts.append((s, piece.narrow(dim, off, n)))
                off += n
        full = torch.cat([p for _, p in sorted(parts, key=lambda sp: sp[0])], dim=dim)  # (..., padded_len, ...)
        return full.narrow(dim, 0, self.seq_len)

    def gather(self, x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
        """all_gather every rank's local `x` over the ring `group` and `unshard` it (tests, evaluation)."""
        pieces = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return self.unshard(pieces, dim)


def ring_batch(layout: RingLayout, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
               pad_token_id: int = 0, ignore_index: int = -100) -> dict:
    """Model kwargs for this rank from a full (B, T) batch: local input_ids, global position_ids and,
    with labels, labels shifted BEFORE sharding.

    The shift matters: a causal LM predicts token t+1 from token t, and t+1 may live on another rank,
    so `shift_labels` (which transformers' loss uses as-is) is built on the full sequence. Passing
    `num_items_in_batch` (the global count of predicted tokens) makes each rank's loss a share of the
    global mean: sum the losses and the parameter gradients over the ring to get the full-sequence ones.
    """
    batch = {"input_ids": layout.shard(input_ids, 1, pad_token_id),
             "position_ids": layout.positions().to(input_ids.device)[None].expand(input_ids.shape[0], -1),
             "use_cache": False}  # ring attention runs without a KV cache
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)  # (B, T)
        local = layout.shard(shifted, 1, ignore_index)  # (B, local_len)
        batch.update(labels=local, shift_labels=local, num_items_in_batch=(shifted != ignore_index).sum())
    return batch


@dataclasses.dataclass(frozen=True)
class RingGroups:
    """Process groups for rings of `ring_size` consecutive ranks, data parallel across rings."""

    ring: object  # this rank's ring (context-parallel) group
    data: object  # the ranks holding the same ring position in every ring (all_reduce gradients here / P)
    ring_size: int
    ring_rank: int
    data_rank: int


def check_ring_size(ring_size: int, world_size: int) -> None:
    """One-line AttentionOptionError unless ring_size divides world_size."""
    if ring_size < 1 or world_size % ring_size:
        divisors = [p for p in range(1, world_size + 1) if world_size % p == 0]
        raise AttentionOptionError(f"ring size {ring_size} does not divide the world size {world_size}; choose one "
                                   f"of {', '.join(map(str, divisors))} (the other ranks run data parallel)")


def ring_groups(ring_size: int) -> RingGroups:
    """Build (on every rank, collectively) rings of `ring_size` consecutive ranks and the data-parallel
    groups across them. Raises AttentionOptionError if ring_size does not divide the world size."""
    world = dist.get_world_size()
    check_ring_size(ring_size, world)
    rank = dist.get_rank()
    rings = [dist.new_group(list(range(i, i + ring_size))) for i in range(0, world, ring_size)]
    datas = [dist.new_group(list(range(j, world, ring_size))) for j in range(ring_size)]
    return RingGroups(rings[rank // ring_size], datas[rank % ring_size], ring_size,
                      rank % ring_size, rank // ring_size)
