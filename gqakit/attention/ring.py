"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds its queries and its K/V shard (see `ring_layout`). K/V blocks travel round the ring
(rank r sends to r+1, receives from r-1) with point-to-point `isend`/`irecv`; the transfer of the next
block overlaps the compute of the current one. Per-block results of the tiled kernel are merged with
their log-sum-exps in fp32 (online softmax), so the result is exact.

Backward travels the ring again: K/V move as in the forward, and each rank computes its block's exact
share of dQ, dK, dV with the MERGED out and lse (dS = P * (dP - D) with global P and D, no forward
recompute), keeps dQ and sends the partial dK/dV straight back to the block's owner.

Only the G K/V heads travel (GQA: never repeated). A plan computed from the layout and `MaskSpec`
says which (query chunk, key chunk) pairs hold any allowed entry; ring steps that nobody downstream
needs are skipped and only the needed key rows are sent, so a window W costs O(W) traffic, not O(T).
Attention sinks (the first S tokens) are broadcast once instead of travelling the ring.
Pad keys (positions >= seq_len) are never sent or attended to; pad queries give output 0.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from gqakit.attention.masks import MaskSpec
from gqakit.attention.masks import AttentionOptionError, dropout_refusal
from gqakit.attention.registration import check_model
from gqakit.attention.ring_layout import (  # noqa: F401 (re-exported)
    RingGroups, RingLayout, check_ring_size, ring_batch, ring_groups)
from gqakit.attention.tiled import tiled_attention, tiled_attention_backward, without_autocast

_NEG_INF = float("-inf")
Pair = tuple[int, int, int, int, int, int]  # q rows [qa, qb) at global qpos; src key rows [ka, kb) at kpos


@dataclasses.dataclass
class RingStats:
    """Bytes and messages this process sent (p2p, plus its logical share of the sink collectives)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_messages: int = 0
    backward_messages: int = 0

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.forward_messages = self.backward_messages = 0


STATS = RingStats()  # module-level counter that benchmarks and tests read and reset


# ---- the plan: which blocks each rank needs, for every rank (all ranks compute the same tables) ------

@dataclasses.dataclass(frozen=True)
class _Plan:
    P: int
    sinks: int  # broadcast sink length (0: sinks, if any, travel the ring like other keys)
    ring_spec: MaskSpec  # the spec for ring blocks (sinks removed when they are broadcast)
    pairs: tuple  # pairs[r][t]: tuple of Pair, rank r's queries against rank t's keys
    sink_pairs: tuple  # sink_pairs[r]: tuple of Pair against the broadcast sink keys [0, sinks)
    use: tuple  # use[r][t]: hull (lo, hi) of src-local key rows r uses from t, or None
    need: tuple  # need[r][s]: rows of block (r - s) that r must receive at step s (for itself or downstream)


def _hull(a, b):
    if a is None or b is None:
        return a if b is None else b
    return (min(a[0], b[0]), max(a[1], b[1]))


def _pairs(layout: RingLayout, spec: MaskSpec, r: int, t: int, k_lo: int, k_hi: int | None) -> tuple:
    """Non-empty (query chunk of r) x (key chunk of t, clipped to [k_lo, k_hi) and real keys) pairs."""
    T, out = layout.seq_len, []
    qo = 0
    for qs, qn in layout.chunks(r):
        q_hi = min(qs + qn, T)  # pad queries are not computed
        ko = 0
        for ks, kn in layout.chunks(t):
            lo, hi = max(ks, k_lo), min(ks + kn, T, k_hi if k_hi is not None else T)
            # Probe in <= 64 steps: the hull of the hit blocks bounds the rows to send to ~1/64 of a chunk.
            blocks = spec.kv_block_ranges(qs, q_hi, lo, hi, -(-(hi - lo) // 64)) if q_hi > qs and hi > lo else []
            if blocks:
                lo, hi = blocks[0][0], blocks[-1][1]
                out.append((qo, qo + q_hi - qs, qs, ko + lo - ks, ko + hi - ks, lo))
            ko += kn
        qo += qn
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _plan(P: int, seq_len: int, kind: str, spec: MaskSpec) -> _Plan:
    layouts = [RingLayout(P, r, seq_len, kind) for r in range(P)]
    first = layouts[0].chunks(0)[0]  # (0, length): the chunk that holds positions 0 .. length-1
    sinks = min(spec.sinks, seq_len) if spec.sinks and spec.sinks <= first[1] else 0
    ring_spec = dataclasses.replace(spec, sinks=0) if sinks else spec
    pairs = tuple(tuple(_pairs(layouts[r], ring_spec, r, t, sinks, None) for t in range(P)) for r in range(P))
    sink_pairs = tuple(_pairs(layouts[r], spec, r, 0, 0, sinks) if sinks else () for r in range(P))
    use = tuple(tuple(functools.reduce(_hull, [(p[3], p[4]) for p in pairs[r][t]], None) for t in range(P))
                for r in range(P))
    need = [[None] * P for _ in range(P)]
    for s in range(P - 1, 0, -1):  # a block is received if used here or forwarded to someone who needs it
        for r in range(P):
            downstream = need[(r + 1) % P][s + 1] if s + 1 < P else None
            need[r][s] = _hull(use[r][(r - s) % P], downstream)
    return _Plan(P, sinks, ring_spec, pairs, sink_pairs, use, tuple(map(tuple, need)))


# ---- communication ----------------------------------------------------------------------------------

class _Comm:
    """Point-to-point and collective helpers on group ranks, with byte accounting into STATS."""

    def __init__(self, group, layout: RingLayout, phase: str):
        self.group, self.P, self.rank, self.phase = group, layout.world_size, layout.rank, phase

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _count(self, nbytes: int, messages: int = 1) -> None:
        setattr(STATS, f"{self.phase}_bytes", getattr(STATS, f"{self.phase}_bytes") + nbytes)
        setattr(STATS, f"{self.phase}_messages", getattr(STATS, f"{self.phase}_messages") + messages)

    def send(self, t: torch.Tensor, to: int, tag: int):
        """-> (work, t, None): the caller keeps t alive until the work is waited for."""
        self._count(t.numel() * t.element_size())
        return dist.isend(t, self._peer(to % self.P), group=self.group, tag=tag), t, None

    def recv(self, t: torch.Tensor, frm: int, tag: int, rows: tuple[int, int] | None = None):
        """-> (work, t, rows): `rows` says where `_wait` adds a received dK/dV partial."""
        return dist.irecv(t, self._peer(frm % self.P), group=self.group, tag=tag), t, rows

    def broadcast(self, t: torch.Tensor) -> None:  # from group rank 0
        if self.P == 1:
            return
        if self.rank == 0:
            self._count(t.numel() * t.element_size() * (self.P - 1), self.P - 1)  # logical: one copy per peer
        dist.broadcast(t, self._peer(0), group=self.group)

    def reduce(self, t: torch.Tensor) -> None:  # sum onto group rank 0
        if self.P == 1:
            return
        if self.rank != 0:
            self._count(t.numel() * t.element_size())
        dist.reduce(t, self._peer(0), op=dist.ReduceOp.SUM, group=self.group)


def _shift(comm: _Comm, plan: _Plan, s: int, cur: torch.Tensor | None, cur_lo: int, tag: int, like: torch.Tensor):
    """Post the transfer for step s + 1: forward the needed rows of `cur` to r + 1, receive from r - 1.

    `cur` is None on a step this rank skipped; it may still have to receive the next block (`like`
    gives the shape and dtype) and never has to forward one (the plan's `need` nests)."""
    r, P, works, nxt, nxt_lo = comm.rank, comm.P, [], None, 0
    if s + 1 < P:
        rows = plan.need[(r + 1) % P][s + 1]
        if rows is not None:  # a row range of a row-major buffer is contiguous: sent without a copy
            works.append(comm.send(cur[rows[0] - cur_lo : rows[1] - cur_lo], r + 1, tag + s))
        rows = plan.need[r][s + 1]
        if rows is not None:
            nxt, nxt_lo = like.new_empty(rows[1] - rows[0], *like.shape[1:]), rows[0]
            works.append(comm.recv(nxt, r - 1, tag + s))
    return works, nxt, nxt_lo


def _wait(works, into: torch.Tensor | None = None) -> None:
    """Wait for (work, buffer, rows) messages; received dK/dV partials (rows set) are added into `into`."""
    for work, buf, rows in works:
        work.wait()
        if rows is not None:
            into[rows[0] : rows[1]] += buf


# ---- forward and backward ---------------------------------------------------------------------------

def _rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, G, T, d) x 2 -> (T, 2, B, G, d): K and V of a token are one contiguous row, so a block and
    any row range of it travel as one message without a copy."""
    return torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)


def _kv(buf: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [a, b) of a (T, 2, B, G, d) buffer as k, v views (B, G, b - a, d)."""
    return buf[a:b, 0].permute(1, 2, 0, 3), buf[a:b, 1].permute(1, 2, 0, 3)


def _merge_(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: acc, acc_lse <- the softmax over both key sets (fp32; rows dead in both stay 0 / -inf)."""
    new = torch.logaddexp(acc_lse, lse)  # (B, H, n)
    safe = new.masked_fill(new == _NEG_INF, 0.0)
    acc.mul_((acc_lse - safe).exp_()[..., None]).add_(out * (lse - safe).exp_()[..., None])
    acc_lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, scale: float, layout: RingLayout, group, spec: MaskSpec, block_q: int, block_k: int):
        plan = _plan(layout.world_size, layout.seq_len, layout.kind, spec)
        comm, r, P = _Comm(group, layout, "forward"), layout.rank, layout.world_size
        opts = dict(scale=scale, block_q=block_q, block_k=block_k, return_lse=True)
        qf = q.float()  # fp32 queries, so per-block outputs come back in fp32 for the merge
        acc = qf.new_zeros(qf.shape)  # (B, H, Tl, d)
        acc_lse = qf.new_full(qf.shape[:3], _NEG_INF)  # (B, H, Tl)

        def attend(pairs, buf, lo, spec_):
            for qa, qb, qpos, ka, kb, kpos in pairs:
                o, l = tiled_attention(qf[:, :, qa:qb], *_kv(buf, ka - lo, kb - lo), spec=spec_, q_offset=qpos,
                                       kv_offset=kpos, **opts)
                _merge_(acc[:, :, qa:qb], acc_lse[:, :, qa:qb], o, l)

        sink = None
        if plan.sinks:  # the first S keys are visible to everyone: one broadcast instead of a ring trip
            sink = _rows(k[:, :, : plan.sinks], v[:, :, : plan.sinks])  # (S, 2, B, G, d)
            comm.broadcast(sink)
            attend(plan.sink_pairs[r], sink, 0, spec)
        cur = _rows(k, v)  # (Tl, 2, B, G, d), in the input dtype: half the bytes for bf16
        like, lo = cur.new_empty(0, *cur.shape[1:]), 0  # shape template; lo: owner's row of cur[0]
        for s in range(P):
            works, nxt, nxt_lo = _shift(comm, plan, s, cur, lo, 1, like)
            attend(plan.pairs[r][(r - s) % P], cur, lo, plan.ring_spec)  # overlaps the transfer above
            _wait(works)
            cur, lo = nxt, nxt_lo
        ctx.save_for_backward(q, k, v, acc, acc_lse, sink if sink is not None else q.new_empty(0))
        ctx.args = (scale, layout, group, spec, block_q, block_k)
        return acc.to(q.dtype), acc_lse

    @staticmethod
    @without_autocast
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        scale, layout, group, spec, block_q, block_k = ctx.args
        plan = _plan(layout.world_size, layout.seq_len, layout.kind, spec)
        comm, r, P = _Comm(group, layout, "backward"), layout.rank, layout.world_size
        qf, dof, dlf = q.float(), dout.float(), dlse.float()
        dq = torch.zeros_like(qf)  # (B, H, Tl, d)
        dkv = qf.new_zeros(k.shape[2], 2, *k.shape[:2], k.shape[3])  # (Tl, 2, B, G, d): our own dK, dV

        def grads(pairs, buf, lo, spec_, part, part_lo):
            """Add each pair's dQ into dq and its dK, dV into part (a row-major buffer from row part_lo)."""
            for qa, qb, qpos, ka, kb, kpos in pairs:
                g = tiled_attention_backward(qf[:, :, qa:qb], *_kv(buf, ka - lo, kb - lo), out[:, :, qa:qb],
                                             lse[:, :, qa:qb], dof[:, :, qa:qb], dlf[:, :, qa:qb], scale=scale,
                                             spec=spec_, q_offset=qpos, kv_offset=kpos, block_q=block_q,
                                             block_k=block_k)
                dq[:, :, qa:qb] += g[0]
                dk, dv = _kv(part, ka - part_lo, kb - part_lo)
                dk += g[1]
                dv += g[2]

        cur = _rows(k, v)  # (Tl, 2, B, G, d)
        like, lo = cur.new_empty(0, *cur.shape[1:]), 0  # a template, so the step-0 buffer can be freed
        for s in range(P):
            t = (r - s) % P
            works, nxt, nxt_lo = _shift(comm, plan, s, cur, lo, 1 + P, like)
            if plan.use[r][t] is not None:
                a, b = (0, dkv.shape[0]) if s == 0 else plan.use[r][t]
                part = dkv if s == 0 else dkv.new_zeros(b - a, *dkv.shape[1:])
                grads(plan.pairs[r][t], cur.float(), lo, plan.ring_spec, part, a)
                if s:  # straight back to the owner, finished within this step: one partial alive at a time
                    works.append(comm.send(part, t, 1 + 2 * P + s))
            giver = (r + s) % P  # the rank that used our block at step s sends its dK/dV partial now
            if s and plan.use[giver][r] is not None:  # posted after our compute: its buffer misses the peak
                a, b = plan.use[giver][r]
                works.append(comm.recv(dkv.new_empty(b - a, *dkv.shape[1:]), giver, 1 + 2 * P + s, rows=(a, b)))
            _wait(works, into=dkv)
            cur, lo = nxt, nxt_lo
        if plan.sinks:  # sink keys' gradients from every rank are summed onto their owner, rank 0
            part = dkv.new_zeros(plan.sinks, *dkv.shape[1:])
            grads(plan.sink_pairs[r], sink.float(), 0, spec, part, 0)
            comm.reduce(part)
            if r == 0:
                dkv[: plan.sinks] += part
        dk, dv = _kv(dkv, 0, dkv.shape[0])  # (B, G, Tl, d) views
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 6


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, layout: RingLayout,
                   group=None, spec: MaskSpec = MaskSpec(), block_q: int = 128, block_k: int = 128,
                   return_lse: bool = False):
    """Exact attention over the whole sequence, from this rank's shard (a collective over `group`).

    q (B, H, Tl, d), k, v (B, G, Tl, d): this rank's tokens in `layout` order (Tl = layout.local_len,
    positions `layout.positions()`). Returns this rank's out (B, H, Tl, d) (and with `return_lse` the
    fp32 lse (B, H, Tl)); pad rows give 0 and -inf. Differentiable in q, k, v; every rank of the ring
    must call forward and backward together.
    """
    check_ring(layout, group, spec)
    B, H, Tl, d = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != B or k.shape[2:] != (Tl, d) or H % k.shape[1]:
        raise AttentionOptionError(f"ring attention expects q (B, H, Tl, d) and k, v (B, G, Tl, d) with G dividing H; "
                                   f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Tl != layout.local_len:
        raise AttentionOptionError(f"ring attention got {Tl} local tokens but the layout holds {layout.local_len} per "
                                   f"rank (T={layout.seq_len} padded to {layout.padded_len}, P={layout.world_size}); "
                                   "shard the inputs with layout.shard or ring_batch")
    out, lse = _RingAttention.apply(q, k, v, float(scale), layout, group, spec, block_q, block_k)
    return (out, lse) if return_lse else out


def check_ring(layout: RingLayout, group, spec: MaskSpec) -> None:
    """One-line AttentionOptionErrors for a group that does not match the layout."""
    if not isinstance(spec, MaskSpec):
        raise AttentionOptionError(f"ring attention takes a MaskSpec, got {type(spec).__name__}")
    if layout.world_size == 1 and not dist.is_initialized():
        return  # a ring of one needs no process group
    if not dist.is_initialized():
        raise AttentionOptionError("ring attention needs torch.distributed: call dist.init_process_group first "
                                   "(e.g. under torchrun)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != layout.world_size:
        raise AttentionOptionError(f"the ring layout is for {layout.world_size} ranks but the process group has "
                                   f"{size}; build rings of {layout.world_size} with ring_groups({layout.world_size}) "
                                   f"or use RingLayout(world_size={size}, ...)")
    if rank != layout.rank:
        raise AttentionOptionError(f"the ring layout is for rank {layout.rank} but this process is rank {rank} of "
                                   "its ring group; build the layout with rank=dist.get_rank(group)")


# ---- transformers integration: `gqakit_ring` reads the ring from a context manager -------------------

@dataclasses.dataclass(frozen=True)
class RingConfig:
    """What `gqakit_ring` attention uses while a `ring_context` is active."""

    layout: RingLayout
    group: object = None
    spec: MaskSpec = MaskSpec()
    block_q: int = 128
    block_k: int = 128
    positions_checked: list = dataclasses.field(default_factory=list)  # the position_ids last found right


_ACTIVE: contextvars.ContextVar[RingConfig | None] = contextvars.ContextVar("gqakit_ring", default=None)


@contextlib.contextmanager
def ring_context(layout: RingLayout, group=None, spec: MaskSpec = MaskSpec(), block_q: int = 128,
                 block_k: int = 128):
    """Run a model with `attn_implementation="gqakit_ring"` on this rank's shard:

        batch = ring_batch(layout, input_ids, labels)        # local ids, global position_ids, labels
        with ring_context(layout, group, spec=MaskSpec()):
            loss = model(**batch).loss                        # this rank's share of the global mean
        loss.backward()                                       # then all_reduce(SUM) grads over `group`

    (Keep backward inside the context when gradient checkpointing re-runs the forward.)
    """
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or value <= 0:
            raise AttentionOptionError(f"{name} must be a positive integer, got {value!r}")
    check_ring(layout, group, spec)
    token = _ACTIVE.set(RingConfig(layout, group, spec, block_q, block_k))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


# Keywords of transformers' attention call that change the result and that the ring does not apply.
RING_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "alibi", "head_mask", "cu_seq_lens_q",
                    "cu_seq_lens_k")


def ring_attention_function(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: q (B, H, Tl, d), k/v (B, G, Tl, d) -> ((B, Tl, H, d), None)."""
    cfg = _ACTIVE.get()
    if cfg is None:
        raise AttentionOptionError("attention 'gqakit_ring' runs only inside `with ring_context(layout, group, "
                                   "spec):`; wrap the forward (and the backward when using gradient checkpointing)")
    if dropout and module.training:
        raise AttentionOptionError(dropout_refusal(module, "gqakit_ring"))
    for name in RING_UNSUPPORTED:  # what the tiled kernel implements but the ring's merge by lse does not (yet)
        if kwargs.get(name) is not None:
            raise AttentionOptionError(f"{type(module).__name__} passes {name}, which ring attention does not "
                                       "implement; train this model with context_parallel=1")
    if isinstance(attention_mask, torch.Tensor):
        raise AttentionOptionError(f"{type(module).__name__} received an attention mask tensor, which ring "
                                   "attention builds from its layout and MaskSpec instead; drop the mask or use "
                                   "context_parallel=1")
    if key.shape[-2] != query.shape[-2]:
        raise AttentionOptionError(f"gqakit_ring got {query.shape[-2]} queries but {key.shape[-2]} keys: it runs "
                                   "training / prefill over a sharded sequence without a KV cache; "
                                   "pass use_cache=False")
    _check_positions(cfg, kwargs.get("position_ids"))
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window and cfg.spec.window != window:
        raise AttentionOptionError(f"this layer uses sliding_window={window} but the ring MaskSpec has window="
                                   f"{cfg.spec.window}; pass spec=MaskSpec(window={window}) to ring_context if every "
                                   "layer slides by it (one ring cannot run a model that mixes full and sliding "
                                   "layers)")
    if getattr(module, "is_causal", True) != cfg.spec.causal:
        raise AttentionOptionError(f"this layer is {'' if module.is_causal else 'not '}causal but the ring MaskSpec "
                                   f"has causal={cfg.spec.causal}; pass a MaskSpec with causal={module.is_causal}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query, key, value, scale=scale, layout=cfg.layout, group=cfg.group, spec=cfg.spec,
                         block_q=cfg.block_q, block_k=cfg.block_k)  # (B, H, Tl, d)
    return out.transpose(1, 2).contiguous(), None


def _check_positions(cfg: RingConfig, positions: torch.Tensor | None) -> None:
    """The ring masks by its layout's positions; position_ids that differ (packed documents restarting them) would
    rotate by one numbering and mask by another: 4.5 in logits off for a second document, a review measured.
    Checked once per tensor (every layer of a forward gets the same one)."""
    if positions is None or any(positions is seen for seen in cfg.positions_checked):
        return
    want = cfg.layout.positions().to(positions.device)
    if positions.shape[-1] != want.numel() or not torch.equal(positions, want.expand_as(positions)):
        raise AttentionOptionError("position_ids differ from the ring layout's global positions (e.g. packed "
                                   "documents that restart them), and ring attention masks by the layout's; pass "
                                   "ring_batch's position_ids, or use context_parallel=1 for packed documents")
    cfg.positions_checked[:] = [positions]


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
              attention_mask: torch.Tensor | None = None, **kwargs):
    """The AttentionMaskInterface function: the ring builds its mask from the layout and MaskSpec, so no
    tensor is made; padded batches are refused rather than silently attended to."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise AttentionOptionError("gqakit_ring does not take padded batches (attention_mask has zeros); pack "
                                   "full-length sequences (the ring layout pads the end itself) or use gqakit_tiled")
    return None


def register_ring() -> None:
    """Register `gqakit_ring` with AttentionInterface and AttentionMaskInterface; idempotent."""
    AttentionInterface.register("gqakit_ring", ring_attention_function)
    AttentionMaskInterface.register("gqakit_ring", ring_mask)


def use_ring(model):
    """Switch `model` to ring attention in place (run it inside `ring_context`); returns it."""
    check_model(model, "ring")
    register_ring()
    model.set_attn_implementation("gqakit_ring")
    return model


register_ring()
