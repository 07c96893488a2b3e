"""Exact tiled ("flash") attention in pure PyTorch: online softmax forward, recomputing backward.

Works on any device (it is the CPU training path: flex_attention has no CPU backward). Memory is
O(T * d) plus one (block_q x block_k) score tile per (batch, K/V head): nothing of size Tq x Tk is
ever built, forward or backward (a caller's dense mask is read, tile by tile, where it lies).

Layout. GQA is native: the H / G query heads of each K/V group are folded into the query-row axis,
    q (B, H, Tq, d) -> (B*G, Tq*r, d) with r = H / G, rows ordered (position, head in group),
so every tile is one batched matmul over (B*G) against K/V slices (B*G, block_k, d) that are never
repeated, and dK / dV sum over a group's query heads for free (they are rows of the same matmul).
Values may have their own head dim (dv != d, DeepSeek-V3 style); the output has dv.

Logits. score = softcap * tanh(scale * q.k / softcap) with a soft cap (Gemma2), else scale * q.k;
then a caller's additive mask is added and disallowed entries become -inf. Sink logits s_aux (H,)
(gpt-oss) add exp(s_aux[h]) to every softmax denominator of head h, a key with value 0: they start
the online softmax (running max s_aux, running sum 1) and are part of the returned lse.

Masking. A `MaskSpec` decides, analytically, which key blocks a query block visits: exactly those
holding an allowed entry (so a window W costs O(T * W)), and which of those are full (no elementwise
mask needed). Partial blocks evaluate the spec, the key padding, an optional transformers-style
`extra_mask` on absolute positions and an optional dense `attn_mask`; with a dense mask every visited
block is partial, and blocks that it masks entirely are skipped. Fully masked query rows give output
0 and lse -inf (with sinks: 0 and lse = s_aux), the `reference.eager_reference` convention.

Per-head patterns (one MaskSpec per query head, e.g. Longformer's dilated heads or the Sparse
Transformer's factorised heads) are rows of the folded matmul: a call visits the union of its heads'
blocks with a per-row mask, or is split into one call per pattern where that saves work (`_classes`).
Sparse Transformer patterns run, by default, as exact disjoint pieces in the paper's own layouts
(`patterns.factorised_pieces`: residue classes mod l for strided, gathered summary keys for fixed),
merged by log-sum-exp: in the natural layout their A2 part touches nearly every block.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from gqakit.attention import patterns
from gqakit.attention.masks import MaskSpec, dense_allowed
from gqakit.common.cpu_split import deal, first_arg_on_one_thread, one_thread_here, run_split, split_count

_NEG_INF = float("-inf")
# Keys one fused segment may span (see _Tiles.steps): the largest score tile is block_q * r x SPAN_K.
SPAN_K = 2048
# Every call runs its ops on one thread each (`cpu_split.one_thread_here`): an op on torch's threads waits for all
# of them, and beside any other process one descheduled thread stalls it (issue 33: 28x sdpa at T = 1,024 with the
# ops of a call on 2 threads). Calls with at least this many scores deal their query blocks over one-thread workers;
# smaller ones (a millisecond or two of work) run on the calling thread, where a worker's ~30 us hand-off (more
# when it has to be woken on a busy machine) would be felt. A single query block runs there too, unless its keys
# are dealt (SPLIT_MIN_KV_BYTES).
SPLIT_MIN_SCORES = 262_144
# A call of one query block (a decode step) reading at least this many bytes of K/V deals its keys over the
# workers instead, the shares merged by log-sum-exp. A step is memory-bound (a score costs a read of its key and
# value rows), so the threshold is in bytes: 64 MiB is a 16k-token fp32 cache of 8 heads of 64, a ~15 ms step on
# one thread. Beside other work, waking a worker can cost a scheduler slice (ms): at 32 MiB (batch 8, 1k cache)
# the split took 16.5 ms against 2.6 ms on the caller, at 64-128 MiB 15 / 68 ms against 18 / 104 ms.
SPLIT_MIN_KV_BYTES = 64 << 20


def _fuse(blocks: list[tuple[int, int, bool]], span_k: int | None) -> list[tuple[int, int, bool]]:
    """Merge adjacent key blocks (k1 == next k0) that agree on needs_mask, up to span_k keys per segment."""
    out: list[tuple[int, int, bool]] = []
    for k0, k1, masked in blocks:
        if out and out[-1][1] == k0 and out[-1][2] == masked and (span_k is None or k1 - out[-1][0] <= span_k):
            out[-1] = (out[-1][0], k1, masked)
        else:
            out.append((k0, k1, masked))
    return out


class _Tiles:
    """The block plan, the logits and the elementwise mask of partial tiles, shared by forward and backward.

    `row_specs` holds one MaskSpec per query head of a K/V group (the r rows of each position in the
    folded layout), the same for every group of the call; or a single spec for all rows. A query block
    visits the union over its rows' specs of the key blocks they touch; a block is full only where every
    row's spec is full, and partial tiles are masked per row.
    """

    def __init__(self, row_specs: tuple[MaskSpec, ...], B: int, Tq: int, Tk: int, q_offset: int, kv_offset: int,
                 key_padding: torch.Tensor | None, extra_mask: Callable | None,
                 block_q: int, block_k: int, device: torch.device, *,
                 attn_mask: torch.Tensor | None = None, softcap: float | None = None,
                 q_positions: torch.Tensor | None = None, span_k: int | None = SPAN_K,
                 row_shift: torch.Tensor | None = None):
        self.specs = list(dict.fromkeys(row_specs))  # distinct specs, in row order
        # row j of a position uses specs[row_of[j]]; None: one spec for all rows
        self.row_of = [self.specs.index(s) for s in row_specs] if len(self.specs) > 1 else None
        self.B, self.q_offset, self.kv_offset = B, q_offset, kv_offset
        self.key_padding, self.extra_mask, self.device = key_padding, extra_mask, device
        self.attn_mask, self.softcap = attn_mask, softcap  # attn_mask: (B|1, H|1, Tq, Tk) view
        # query i sits at q_offset + i, or at q_positions[i] (non-decreasing: the patterns' gathered layouts)
        self.q_positions = None if q_positions is None else q_positions.to(device)
        qp = None if q_positions is None else q_positions.tolist()
        # batch row b's query / key at column c sits at position c - row_shift[b] for the specs (left padding);
        # a block is visited if it holds an allowed entry for some row, and full only if it is full for every row
        self.row_shift = None if row_shift is None else row_shift.to(device=device, dtype=torch.long)
        shifts = [0] if row_shift is None else sorted(set(self.row_shift.tolist()))
        padded_full = [True] * math.ceil(Tk / block_k)
        if key_padding is not None:  # which key blocks hold no padding at all (one host sync)
            pad = -Tk % block_k
            kp = torch.nn.functional.pad(key_padding, (0, pad), value=True)  # (B, nk * block_k)
            padded_full = kp.view(B, -1, block_k).all(dim=2).all(dim=0).tolist()
        live = self._dense_live(Tq, Tk, block_q, block_k) if attn_mask is not None else None
        # plan: per query block (q0, q1) the visited key blocks (k0, k1, needs_mask); local indices
        self.plan: list[tuple[int, int, list[tuple[int, int, bool]]]] = []
        for q0 in range(0, Tq, block_q):
            q1 = min(q0 + block_q, Tq)
            a_lo, a_hi = (q0 + q_offset, q1 + q_offset) if qp is None else (qp[q0], qp[q1 - 1] + 1)
            starts = sorted({a + t for spec in self.specs for t in shifts
                             for a, _ in spec.kv_block_ranges(a_lo - t, a_hi - t, kv_offset - t, kv_offset + Tk - t,
                                                              block_k)})
            blocks = []
            for a0 in starts:
                k0 = a0 - kv_offset
                k1 = min(k0 + block_k, Tk)
                if live is not None and not live[q0 // block_q][k0 // block_k]:
                    continue  # the caller's mask allows nothing here
                full = (extra_mask is None and attn_mask is None and padded_full[k0 // block_k]
                        and all(spec.block_is_full(a_lo - t, a_hi - t, a0 - t, k1 + kv_offset - t)
                                for spec in self.specs for t in shifts))
                blocks.append((k0, k1, not full))
            self.plan.append((q0, q1, blocks))
        # what the loops run: contiguous visited blocks of the same kind (full / masked) fused into one segment
        # of at most `span_k` keys, so a causal query block is two matmuls (its full run, its diagonal), not one
        # per key block: on CPU each op is a parallel region, and under load many small ones stall.
        self.steps = [(q0, q1, _fuse(blocks, span_k)) for q0, q1, blocks in self.plan]
        self.span_k = span_k

    def parts(self, count: int, rows: int) -> list[list[int]]:
        """The query blocks (indices of `steps`) dealt into at most `count` parts of about equal work; one part
        when the call computes fewer than SPLIT_MIN_SCORES scores (`rows`: score rows per query position). The
        parts run on one-thread workers (`run_split`), one part on the calling thread, itself at one thread."""
        costs = [(q1 - q0) * sum(k1 - k0 for k0, k1, _ in blocks) for q0, q1, blocks in self.steps]
        if sum(costs) * rows < SPLIT_MIN_SCORES:
            count = 1
        return deal(costs, min(count, max(1, sum(c > 0 for c in costs))))

    def key_runs(self, count: int, key_bytes: int) -> list[list[tuple[int, int, bool]]] | None:
        """For a call of one query block (a decode step): its visited key blocks dealt into at most `count`
        contiguous runs of about equal keys, each fused as in `steps`, for the forward to merge by log-sum-exp.
        None (the call runs by query blocks) with more query blocks, one worker, or under SPLIT_MIN_KV_BYTES of
        K/V read (`key_bytes` per key)."""
        if count < 2 or len(self.plan) != 1:
            return None
        blocks = self.plan[0][2]
        keys = sum(k1 - k0 for k0, k1, _ in blocks)
        n = min(count, len(blocks))
        if n < 2 or keys * key_bytes < SPLIT_MIN_KV_BYTES:
            return None
        runs: list[list[tuple[int, int, bool]]] = [[] for _ in range(n)]
        done = 0
        for block in blocks:
            runs[done * n // keys].append(block)  # the run its first key falls in
            done += block[1] - block[0]
        return [_fuse(run, self.span_k) for run in runs if run]

    def _dense_live(self, Tq: int, Tk: int, block_q: int, block_k: int) -> list[list[bool]]:
        """[query block][key block] -> does the dense mask allow any entry there (one host sync)."""
        rows = []
        for q0 in range(0, Tq, block_q):
            ok = dense_allowed(self.attn_mask[:, :, q0 : q0 + block_q])  # (B|1, H|1, bq, Tk): one row band
            per_key = ok.any(dim=2).any(dim=1).any(dim=0)  # (Tk,)
            per_key = torch.nn.functional.pad(per_key, (0, -Tk % block_k))
            rows.append(per_key.view(-1, block_k).any(dim=1))  # (nk,)
        return torch.stack(rows).tolist()

    def scores(self, qb: torch.Tensor, kb: torch.Tensor, keep_tanh: bool = False):
        """Logits of a tile before masking: (s, tanh) with s (B*G, n, bk); tanh only for softcap and keep_tanh."""
        s = torch.bmm(qb, kb.transpose(1, 2))  # (B*G, n, bk), qb carries the scale
        if self.softcap is None:
            return s, None
        if not keep_tanh:
            return s.div_(self.softcap).tanh_().mul_(self.softcap), None
        t = s.div_(self.softcap).tanh_()  # kept: d cap(x) / dx = 1 - tanh^2
        return t * self.softcap, t

    def allowed(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Boolean tile (B or 1, q1 - q0, r or 1, k1 - k0) of the specs, padding and extra mask: True where the
        query (row j of its position) may attend."""
        if self.q_positions is None:
            qpos = torch.arange(q0 + self.q_offset, q1 + self.q_offset, device=self.device)
        else:
            qpos = self.q_positions[q0:q1]
        kpos = torch.arange(k0 + self.kv_offset, k1 + self.kv_offset, device=self.device)
        if self.row_shift is None:
            masks = [spec.mask(qpos, kpos)[None] for spec in self.specs]  # each (1, bq, bk)
        else:  # each row's positions: (B, bq, 1) against (B, 1, bk)
            rq, rk = (pos[None, :] - self.row_shift[:, None] for pos in (qpos, kpos))
            masks = [spec.allowed(rq[:, :, None], rk[:, None, :]) for spec in self.specs]  # each (B, bq, bk)
        if self.row_of is None:
            tile = masks[0][:, :, None]  # (B|1, bq, 1, bk)
        else:
            tile = torch.stack(masks)[self.row_of].permute(1, 2, 0, 3)  # (r, B|1, bq, bk) -> (B|1, bq, r, bk)
        if self.key_padding is not None:
            tile = tile & self.key_padding[:, None, None, k0:k1]  # (B, bq, r|1, bk)
        if self.extra_mask is not None:  # transformers' 4-D index convention, as in sdpa_mask
            b = torch.arange(self.B, device=self.device)[:, None, None, None]
            h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=self.device)
            extra = self.extra_mask(b, h, qpos[None, None, :, None], kpos[None, None, None, :])
            extra = torch.as_tensor(extra, device=self.device).bool()
            extra = extra.expand(torch.broadcast_shapes(extra.shape, (1, 1, q1 - q0, k1 - k0)))
            tile = tile & extra[:, 0, :, None]  # head-independent masks, as transformers' sdpa path assumes
        return tile

    def apply_(self, s: torch.Tensor, r: int, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Add the dense mask's bias and set disallowed scores of a tile s (B*G, (q1-q0)*r, bk) to -inf, in place."""
        bq, bk = q1 - q0, k1 - k0
        sv = s.view(self.B, -1, bq, r, bk)  # (B, G, bq, r, bk)
        blocked = ~self.allowed(q0, q1, k0, k1)[:, None]  # (B|1, 1, bq, r|1, bk)
        if self.attn_mask is not None:
            m = self.attn_mask[:, :, q0:q1, k0:k1]  # (B|1, H|1, bq, bk)
            # per-head masks: head g * r + j is row j of group g -> (B|1, G, bq, r, bk); else (B|1, 1, bq, 1, bk)
            m = m.unflatten(1, (-1, r)).transpose(2, 3) if m.shape[1] > 1 else m[:, :, :, None, :]
            if m.dtype != torch.bool:
                sv.add_(m)  # an additive mask is a bias (its masking values are set to -inf just below)
            blocked = blocked | ~dense_allowed(m)
        sv.masked_fill_(blocked, _NEG_INF)
        return s


_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # online softmax: row max, row sum, unnormalised output


def _merge(states: list[_State]) -> _State:
    """One online-softmax state from states over disjoint keys, summed in list order (the same bits each call)."""
    m = functools.reduce(torch.maximum, [state[0] for state in states])
    m_safe = m.masked_fill(m == _NEG_INF, 0.0)  # rows no state has a key for stay l = 0
    l, acc = torch.zeros_like(m), torch.zeros_like(states[0][2])
    for m_i, l_i, acc_i in states:
        w = (m_i - m_safe).exp_()  # (B*G, n)
        l.add_(l_i * w)
        acc.add_(acc_i * w[:, :, None])
    return m, l, acc


def _fold_q(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, T, ...) -> (B*G, T*r, ...): each group's r query heads become rows of one matrix."""
    B, H, T = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(B, groups, H // groups, T, *rest).transpose(2, 3)  # (B, G, T, r, ...)
    return x.reshape(B * groups, T * (H // groups), *rest)


def _unfold_q(x: torch.Tensor, B: int, H: int, T: int) -> torch.Tensor:
    """Inverse of `_fold_q`: (B*G, T*r, ...) -> (B, H, T, ...)."""
    G = x.shape[0] // B
    rest = x.shape[2:]
    x = x.reshape(B, G, T, H // G, *rest).transpose(2, 3)  # (B, G, r, T, ...)
    return x.reshape(B, H, T, *rest)


def accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """What the kernel computes in: fp32 for fp32 / bf16 / fp16 inputs, float64 for float64 ones (checks and
    gradcheck at float64 get float64 arithmetic, not fp32 returned as float64)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _sink_rows(s_aux: torch.Tensor, B: int, G: int, Tq: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-head sink logits (H,) -> one value per folded query row (B*G, Tq*r), in the accumulation dtype."""
    H = s_aux.shape[0]
    return _fold_q(s_aux.to(dtype).view(1, H, 1).expand(B, H, Tq), G)


def without_autocast(step):
    """An autograd Function's forward or backward run with autocast off (for the device of its first tensor): the
    kernel picks its own dtypes (accumulation in fp32, the output in q's), where autocast would round its matmuls to
    bf16 and mix dtypes in its in-place accumulations (a crash under mixed_precision=bf16)."""
    @functools.wraps(step)
    def run(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return step(ctx, first, *args)
    return run


class _TiledAttention(torch.autograd.Function):
    """Returns (out, lse); both are differentiable (lse feeds ring attention's merge), in q, k, v and s_aux."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, s_aux, scale: float, tiles: _Tiles):
        B, H, Tq, d = q.shape
        G, r, dv = k.shape[1], H // k.shape[1], v.shape[3]
        acc_dtype = accumulation_dtype(q)
        qf = _fold_q(q.to(acc_dtype) * scale, G)  # (B*G, Tq*r, d), pre-scaled
        kf = k.to(acc_dtype).reshape(B * G, -1, d)  # (B*G, Tk, d)
        vf = v.to(acc_dtype).reshape(B * G, -1, dv)  # (B*G, Tk, dv)
        sink = _sink_rows(s_aux, B, G, Tq, acc_dtype) if s_aux is not None else None  # (B*G, Tq*r)
        out = qf.new_zeros(B * G, Tq * r, dv)  # rows no block visits stay 0, lse -inf (or the sink)
        lse = sink.clone() if sink is not None else qf.new_full(qf.shape[:2], _NEG_INF)  # (B*G, Tq*r)

        def start(rows: slice, with_sink: bool = True) -> _State:
            """(running row max, running row sum of exp(s - max), running unnormalised output) before any key; the
            sink is the first "key": max s_aux, sum exp(s_aux - s_aux) = 1, value 0."""
            n = rows.stop - rows.start
            if sink is None or not with_sink:
                return qf.new_full((B * G, n), _NEG_INF), qf.new_zeros(B * G, n), qf.new_zeros(B * G, n, dv)
            return sink[:, rows].clone(), qf.new_ones(B * G, n), qf.new_zeros(B * G, n, dv)

        def attend(q0: int, q1: int, blocks: list[tuple[int, int, bool]], state: _State) -> _State:
            """The online softmax of query block (q0, q1) over `blocks` of keys, from `state`."""
            m, l, acc = state
            qb = qf[:, q0 * r:q1 * r]  # (B*G, n, d), n = (q1 - q0) * r
            for k0, k1, needs_mask in blocks:
                s, _ = tiles.scores(qb, kf[:, k0:k1])  # (B*G, n, bk)
                if needs_mask:
                    tiles.apply_(s, r, q0, q1, k0, k1)
                m_new = torch.maximum(m, s.amax(dim=2))
                # A row with no allowed key yet keeps m = -inf; shift it by 0 so exp gives 0, not NaN.
                m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0) if needs_mask else m_new
                p = s.sub_(m_safe[:, :, None]).exp_()  # (B*G, n, bk), in place of s
                alpha = (m - m_safe).exp_()  # rescales what was accumulated under the old max
                l.mul_(alpha).add_(p.sum(dim=2))
                acc.mul_(alpha[:, :, None]).baddbmm_(p, vf[:, k0:k1])
                m = m_new
            return m, l, acc

        def finish(rows: slice, state: _State) -> None:
            m, l, acc = state
            live = l > 0
            out[:, rows] = acc / torch.where(live, l, 1.0)[:, :, None]
            lse[:, rows] = torch.where(live, m + l.log(), _NEG_INF)

        def run(part: list[int]) -> None:  # query blocks of tiles.steps: disjoint rows of out and lse
            for q0, q1, blocks in (tiles.steps[i] for i in part):
                finish(slice(q0 * r, q1 * r), attend(q0, q1, blocks, start(slice(q0 * r, q1 * r))))

        workers = split_count(q.device)
        runs = tiles.key_runs(workers, B * G * (d + dv) * 4)
        if runs is None:
            run_split(run, tiles.parts(workers, B * H))
        else:  # one query block (a decode step) over many keys: its keys dealt out, the shares merged in order
            q0, q1, _ = tiles.steps[0]
            rows = slice(q0 * r, q1 * r)
            shares = run_split(lambda blocks: attend(q0, q1, blocks, start(rows, with_sink=False)), runs)
            finish(rows, _merge([start(rows)] + shares))
        out32 = _unfold_q(out, B, H, Tq)  # (B, H, Tq, dv) fp32 (float64 for float64 inputs)
        lse_q = _unfold_q(lse, B, H, Tq)  # (B, H, Tq)
        # The backward's D = rowsum(dO * O) cancels when one key dominates; O rounded to bf16 would cost
        # it ~2^-8 relative, so the fp32 output is kept (the returned one is rounded to q's dtype).
        ctx.save_for_backward(q, k, v, out32, lse_q, s_aux)
        ctx.scale, ctx.tiles = scale, tiles
        return out32.to(q.dtype), lse_q

    @staticmethod
    @once_differentiable
    @without_autocast
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, s_aux = ctx.saved_tensors
        with one_thread_here(q.device):
            dq, dk, dv, ds_aux = _backward(q, k, v, out, lse, dout, dlse, ctx.scale, ctx.tiles, s_aux)
        return dq, dk, dv, ds_aux, None, None


def _backward(q, k, v, out, lse, dout, dlse, scale: float, tiles: _Tiles, s_aux=None):
    """(dq, dk, dv, ds_aux or None) from the saved out and lse; with the out / lse of a larger softmax that
    this block is part of (ring attention), the same formulas give this block's exact share of the gradients."""
    B, H, Tq, d = q.shape
    G, r, dv_dim = k.shape[1], H // k.shape[1], v.shape[3]
    acc_dtype = accumulation_dtype(q)
    qf = _fold_q(q.to(acc_dtype) * scale, G)  # (B*G, Tq*r, d)
    kf = k.to(acc_dtype).reshape(B * G, -1, d)  # (B*G, Tk, d)
    vf = v.to(acc_dtype).reshape(B * G, -1, dv_dim)  # (B*G, Tk, dv)
    dof = _fold_q(dout.to(acc_dtype), G)  # (B*G, Tq*r, dv)
    # dS = P * (dP - D) with D = rowsum(dO * O); an lse gradient adds P * dlse to dS.
    delta = (dof * _fold_q(out.to(acc_dtype), G)).sum(dim=2) - _fold_q(dlse.to(acc_dtype), G)  # (B*G, Tq*r)
    lse_f = _fold_q(lse.to(acc_dtype), G)  # (B*G, Tq*r)
    lse_safe = lse_f.masked_fill(lse_f == _NEG_INF, float("inf"))  # dead rows: exp(s - inf) = 0
    dq = torch.zeros_like(qf)

    def run(part: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The query blocks `part` of tiles.steps: their rows of dq, and their share of dk and dv."""
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        for q0, q1, blocks in (tiles.steps[i] for i in part):
            rows = slice(q0 * r, q1 * r)
            qb, dob, dqb = qf[:, rows], dof[:, rows], dq[:, rows]  # (B*G, n, d|dv)
            lb, db = lse_safe[:, rows, None], delta[:, rows, None]  # (B*G, n, 1)
            for k0, k1, needs_mask in blocks:
                kb, vb = kf[:, k0:k1], vf[:, k0:k1]  # (B*G, bk, d|dv)
                s, t = tiles.scores(qb, kb, keep_tanh=True)  # (B*G, n, bk)
                if needs_mask:
                    tiles.apply_(s, r, q0, q1, k0, k1)
                p = s.sub_(lb).exp_()  # recomputed probabilities
                dv[:, k0:k1].baddbmm_(p.transpose(1, 2), dob)
                ds = torch.bmm(dob, vb.transpose(1, 2)).sub_(db).mul_(p)  # (B*G, n, bk): d logits
                if t is not None:  # through the soft cap: d/dx c * tanh(x / c) = 1 - tanh^2
                    ds.mul_(t.mul_(t).neg_().add_(1.0))
                dqb.baddbmm_(ds, kb)
                dk[:, k0:k1].baddbmm_(ds.transpose(1, 2), qb)  # qb carries the scale already
        return dk, dv

    shares = run_split(run, tiles.parts(split_count(q.device), B * H))  # summed in part order: the same bits each call
    dk, dv = shares[0] if shares else (torch.zeros_like(kf), torch.zeros_like(vf))
    for dk_part, dv_part in shares[1:]:
        dk.add_(dk_part)
        dv.add_(dv_part)
    ds_aux = None
    if s_aux is not None:  # the sink's probability exp(s_aux - lse), its dP is 0: dS_sink = -P_sink * D
        sink = _sink_rows(s_aux, B, G, Tq, acc_dtype)  # (B*G, Tq*r)
        ds_rows = (sink - lse_safe).exp_().mul_(delta).neg_()
        ds_aux = _unfold_q(ds_rows, B, H, Tq).sum(dim=(0, 2)).to(s_aux.dtype)  # (H,)
    dq = _unfold_q(dq.mul_(scale), B, H, Tq).to(q.dtype)
    return dq, dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype), ds_aux


Spec = MaskSpec | Sequence[MaskSpec]  # one pattern for every head, or one per query head


@first_arg_on_one_thread
def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    spec: Spec = MaskSpec(), q_offset: int = 0, kv_offset: int = 0,
                    key_padding: torch.Tensor | None = None, extra_mask: Callable | None = None,
                    block_q: int = 128, block_k: int = 128, return_lse: bool = False,
                    attn_mask: torch.Tensor | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, factorised: bool = True, span_k: int | None = SPAN_K,
                    row_shift: torch.Tensor | None = None):
    """Exact attention softmax(cap(q k^T * scale) + mask [, s_aux]) v, computed tile by tile.

    q (B, H, Tq, d); k (B, G, Tk, d); v (B, G, Tk, dv) with G dividing H (never repeated). Query i
    sits at absolute position q_offset + i, key j at kv_offset + j; `spec` says which pairs may attend
    (and which blocks to skip): one MaskSpec for all heads, or a sequence of H, one per query head
    (head h reads K/V head h // (H / G)). Per-head specs: K/V groups whose heads carry the same specs
    run together, each query block visiting the union over those heads of the key blocks they touch,
    masked per head, unless running each distinct spec's heads on their own saves over a quarter of the
    work (see `_classes`). With `factorised` (the default), heads on a causal Sparse Transformer pattern
    (strided / fixed, merged or A2; `patterns.factorised_pieces`) run as disjoint pieces in the paper's
    own layouts, merged exactly by log-sum-exp, so l ~ sqrt(T) costs O(T sqrt(T)) with any block size
    (not with `extra_mask` or `attn_mask`). `key_padding` (B, Tk) marks real keys with True, and
    `extra_mask` is an optional transformers-style `(batch_idx, head_idx, q_idx, kv_idx)` function on absolute positions
    that is ANDed in within visited blocks (it cannot make the kernel skip blocks; put windows in `spec`).
    `attn_mask` is a caller's dense mask broadcastable from (B or 1, H or 1, Tq, Tk) on local indices:
    bool (True = attend) or additive float (see `masks.dense_allowed`); it is ANDed in (a float one is
    also added) and read tile by tile. `softcap` c caps each logit to c * tanh(logit / c) before any
    mask (Gemma2). `s_aux` (H,) are per-head sink logits: a key with value 0 in every softmax (gpt-oss).
    Accumulates in fp32 (float64 for float64 inputs) and returns out (B, H, Tq, dv) in q's dtype, plus with
    `return_lse` the log-sum-exp (B, H, Tq) in that accumulation dtype, sink included. Fully masked query rows
    give 0 and lse -inf (with a sink: 0 and lse = s_aux). Differentiable in q, k, v and s_aux. `span_k` caps
    the keys of one fused step: adjacent visited blocks of the same kind run as one matmul of up to block_q x
    span_k scores (None: no cap; block_k: one block per step); the result does not depend on it beyond rounding.
    `row_shift` (B,) integers put batch row b's query and key at column c at position c - row_shift[b] for `spec`
    (a left-padded row's leading pads: its sinks, global tokens and blocks then sit on its own tokens); `q_offset`,
    `kv_offset`, `extra_mask` and `attn_mask` stay on columns. Distances do not change, so only patterns anchored
    at positions need it.
    """
    check_inputs(q, k, v, key_padding, attn_mask, softcap, s_aux, block_q, block_k, span_k, row_shift)
    Tq, Tk = q.shape[2], k.shape[2]
    # the paper's own layouts need one position per column and nothing but the spec to mask
    factorised = factorised and extra_mask is None and attn_mask is None and row_shift is None
    if key_padding is not None:
        key_padding = key_padding.to(device=q.device, dtype=torch.bool)
    run = functools.partial(_run, scale=float(scale), block_q=block_q, block_k=block_k, softcap=softcap,
                            span_k=span_k)
    outs, lses, order = [], [], []
    for heads, groups, rows in _classes(spec, q.shape[1], k.shape[1], Tq, Tk, q_offset, kv_offset, block_q, block_k,
                                        factorised):
        part = _slice(heads, groups, q=q, k=k, v=v, s_aux=s_aux, attn_mask=attn_mask)
        pieces = patterns.factorised_pieces(rows[0]) if factorised and len(set(rows)) == 1 else None
        if pieces:  # a Sparse Transformer pattern, in its own layouts
            out, lse = patterns.run_pieces(pieces, part["q"], part["k"], part["v"], part["s_aux"], q_offset, kv_offset,
                                           key_padding, run)
        else:
            out, lse = run(part["q"], part["k"], part["v"], rows, q_offset, kv_offset, key_padding, s_aux=part["s_aux"],
                           extra_mask=extra_mask, attn_mask=part["attn_mask"], row_shift=row_shift)
        outs.append(out)
        lses.append(lse)
        order.append(heads)
    out, lse = _gather(outs, order), _gather(lses, order)
    return (out, lse) if return_lse else out


def _run(q, k, v, rows, q_offset, kv_offset, key_padding, *, scale, block_q, block_k, softcap=None, s_aux=None,
         extra_mask=None, attn_mask=None, q_positions=None, span_k=SPAN_K, row_shift=None):
    """One call of the kernel: every query head of q on `rows` (one spec, or one per row of a group)."""
    tiles = _make_tiles(q, k, v, rows, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k,
                        attn_mask=attn_mask, softcap=softcap, q_positions=q_positions, span_k=span_k,
                        row_shift=row_shift)
    return _TiledAttention.apply(q, k, v, s_aux, scale, tiles)


@first_arg_on_one_thread
def tiled_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None, *,
                             scale: float, spec: Spec = MaskSpec(), q_offset: int = 0, kv_offset: int = 0,
                             key_padding: torch.Tensor | None = None, extra_mask: Callable | None = None,
                             block_q: int = 128, block_k: int = 128, attn_mask: torch.Tensor | None = None,
                             softcap: float | None = None, s_aux: torch.Tensor | None = None,
                             span_k: int | None = SPAN_K):
    """(dq, dk, dv) of `tiled_attention` given its out (B, H, Tq, dv), lse (B, H, Tq) and their gradients;
    (dq, dk, dv, ds_aux) when `s_aux` is given.

    `out` and `lse` may belong to a larger softmax that these keys are only one block of (ring
    attention passes the merged out / lse): the result is then this block's exact share of the
    gradients, and no forward is recomputed. Pass `out` in fp32 where you have it: the gradients of
    low-precision inputs lose accuracy through D = rowsum(dO * O) otherwise. Arguments as in
    `tiled_attention`.
    """
    check_inputs(q, k, v, key_padding, attn_mask, softcap, s_aux, block_q, block_k, span_k)
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    grads, order, group_order = [], [], []
    for heads, groups, rows in _classes(spec, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q_offset, kv_offset,
                                        block_q, block_k):
        p = _slice(heads, groups, q=q, k=k, v=v, s_aux=s_aux, attn_mask=attn_mask, out=out, lse=lse, dout=dout,
                   dlse=dlse)
        tiles = _make_tiles(p["q"], p["k"], p["v"], rows, q_offset, kv_offset, key_padding, extra_mask, block_q,
                            block_k, attn_mask=p["attn_mask"], softcap=softcap, span_k=span_k)
        grads.append(_backward(p["q"], p["k"], p["v"], p["out"], p["lse"], p["dout"], p["dlse"], float(scale), tiles,
                               p["s_aux"]))
        order.append(heads)
        group_order.append(groups)
    dq = _gather([g[0] for g in grads], order)
    dk, dv = _gather([g[1] for g in grads], group_order), _gather([g[2] for g in grads], group_order)
    if s_aux is None:
        return dq, dk, dv
    return dq, dk, dv, _gather([g[3] for g in grads], order, dim=0)


# ---- per-head specs: K/V groups that share their heads' specs run as one call ------------------------

def _classes(spec: Spec, H: int, G: int, Tq: int, Tk: int, q_offset: int, kv_offset: int, block_q: int,
             block_k: int, factorised: bool = False) -> list[tuple[list[int] | None, list[int] | None, tuple]]:
    """[(query heads, K/V groups, row specs)]: the calls that per-head specs run as.

    K/V groups whose r = H / G heads carry the same specs form one class (a single class, the common case, is
    returned with heads = groups = None: no slicing). In a class with several distinct specs, one call visits
    the union of their blocks with every head's rows (bigger matmuls, per-row masks); it is split into one call
    per distinct spec (each visiting only its own blocks, K/V read again, never repeated) where that computes
    under 3/4 of the rows x blocks of the union, or (with `factorised`) where one of them is a Sparse
    Transformer pattern, which runs in its own layouts only when alone in a call.
    """
    if isinstance(spec, MaskSpec):
        return [(None, None, (spec,))]
    specs = tuple(spec)
    if not all(isinstance(s, MaskSpec) for s in specs):
        raise ValueError(f"spec must be one MaskSpec or one per query head ({H}); got items that are not all "
                         "MaskSpecs")
    if len(specs) != H:
        raise ValueError(f"spec must be one MaskSpec or one per query head ({H}); got {len(specs)} specs")
    r = H // G
    by_rows: dict[tuple, list[int]] = {}
    for g in range(G):
        by_rows.setdefault(specs[g * r:(g + 1) * r], []).append(g)

    def visited(distinct) -> int:  # blocks one call visits: the union over its specs, per query block
        total = 0
        for q0 in range(0, Tq, block_q):
            lo, hi = q0 + q_offset, min(q0 + block_q, Tq) + q_offset
            total += len({a for s in distinct
                          for a, _ in s.kv_block_ranges(lo, hi, kv_offset, kv_offset + Tk, block_k)})
        return total

    out = []
    for rows, groups in by_rows.items():
        distinct = list(dict.fromkeys(rows))
        if len(distinct) > 1:
            split = factorised and any(patterns.factorised_pieces(s) for s in distinct)
            if split or sum(visited([s]) * rows.count(s) for s in distinct) < 0.75 * visited(distinct) * r:
                for s in distinct:
                    js = [j for j, x in enumerate(rows) if x == s]
                    out.append(([g * r + j for g in groups for j in js], groups, (s,) * len(js)))
                continue
        out.append(([g * r + j for g in groups for j in range(r)], groups, rows))
    if len(out) == 1:
        return [(None, None, out[0][2])]
    return out


def _slice(heads, groups, **tensors) -> dict:
    """The query-head / K/V-group slices of one class (head-indexed tensors on dim 1, s_aux on dim 0)."""
    if heads is None:
        return tensors
    out = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = None
        elif name == "s_aux":
            out[name] = t[heads]
        elif name in ("k", "v"):
            out[name] = t[:, groups]
        elif name == "attn_mask" and t.shape[1] == 1:
            out[name] = t
        else:
            out[name] = t[:, heads]
    return out


def _gather(parts: list[torch.Tensor], order: list, dim: int = 1) -> torch.Tensor:
    """Concatenate per-class slices and put heads (or groups) back in their order."""
    if order[0] is None:
        return parts[0]
    index = [i for idx in order for i in idx]
    inverse = torch.empty(len(index), dtype=torch.long)
    inverse[torch.tensor(index)] = torch.arange(len(index))
    return torch.cat(parts, dim=dim).index_select(dim, inverse.to(parts[0].device))


def block_plan(spec: Spec, num_heads: int, num_kv_heads: int, q_len: int, kv_len: int, *, q_offset: int = 0,
               kv_offset: int = 0, block_q: int = 128, block_k: int = 128) -> list[tuple[list[int], list[int], list]]:
    """The generic kernel's block plan without running it (no padding or caller's mask, `factorised=False`):
    [(query heads, K/V groups, plan)] per call, plan = [(q0, q1, [(k0, k1, needs_mask), ...]), ...] on local
    indices. A visited block costs one (block_q * heads / groups) x block_k tile per group of its call."""
    out = []
    for heads, groups, rows in _classes(spec, num_heads, num_kv_heads, q_len, kv_len, q_offset, kv_offset, block_q,
                                        block_k):
        tiles = _Tiles(rows, 1, q_len, kv_len, q_offset, kv_offset, None, None, block_q, block_k, torch.device("cpu"))
        out.append((list(range(num_heads)) if heads is None else heads,
                    list(range(num_kv_heads)) if groups is None else groups, tiles.plan))
    return out


def work(spec: Spec, num_heads: int, num_kv_heads: int, q_len: int, kv_len: int, *, q_offset: int = 0,
         kv_offset: int = 0, block_q: int = 128, block_k: int = 128, factorised: bool = True,
         span_k: int | None = SPAN_K) -> dict:
    """What `tiled_attention` computes for these shapes (no padding): {'steps': fused steps (python iterations,
    each one batched matmul over up to span_k keys), 'scores': query-head x key score entries computed in visited
    tiles}, counting the factorised layouts where they are used."""
    steps = scores = 0

    def add(rows, n_heads, Tq, Tk, qo, ko, batch=1, q_positions=None):
        nonlocal steps, scores
        tiles = _Tiles(rows, 1, Tq, Tk, qo, ko, None, None, block_q, block_k, torch.device("cpu"),
                       q_positions=q_positions, span_k=span_k)
        steps += sum(len(fused) for _, _, fused in tiles.steps)
        for q0, q1, blocks in tiles.plan:
            scores += batch * n_heads * (q1 - q0) * sum(k1 - k0 for k0, k1, _ in blocks)

    for heads, _, rows in _classes(spec, num_heads, num_kv_heads, q_len, kv_len, q_offset, kv_offset, block_q, block_k,
                                   factorised):
        n = num_heads if heads is None else len(heads)
        pieces = patterns.factorised_pieces(rows[0]) if factorised and len(set(rows)) == 1 else None
        for piece in pieces or [patterns.Piece("natural")]:
            if not pieces:
                add(rows, n, q_len, kv_len, q_offset, kv_offset)
            elif piece.layout == "natural":
                add((piece.spec,), n, q_len, kv_len, q_offset, kv_offset)
            elif piece.layout == "residue":
                l = piece.stride
                _, _, nq, nk = patterns.residue_geometry(l, q_len, kv_len, q_offset, kv_offset)
                add((MaskSpec(),), n, nq, nk, q_offset // l - piece.gap, kv_offset // l, batch=l)
            else:
                index, qpos = patterns.summary_geometry(piece.stride, piece.summary, q_len, kv_len, q_offset, kv_offset)
                if len(index):
                    add((MaskSpec(),), n, q_len, len(index), 0, 0, q_positions=qpos)
    return {"steps": steps, "scores": scores}


def check_inputs(q, k, v, key_padding, attn_mask, softcap, s_aux, block_q, block_k, span_k=SPAN_K,
                 row_shift=None) -> None:
    """Shapes and values, as one-line ValueErrors."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"expected q (B, H, Tq, d), k (B, G, Tk, d) and v (B, G, Tk, dv); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, Tq, d = q.shape
    if k.shape[0] != B or k.shape[3] != d or H % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}: need the same batch and "
                         f"head_dim and num_key_value_heads dividing num_attention_heads={H}")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if span_k is not None and span_k < block_k:
        raise ValueError(f"span_k={span_k} is below block_k={block_k}: a fused step spans whole key blocks; pass "
                         f"span_k >= block_k (span_k=block_k runs one block per step), or None for no cap")
    Tk = k.shape[2]
    if key_padding is not None and tuple(key_padding.shape) != (B, Tk):
        raise ValueError(f"key_padding has shape {tuple(key_padding.shape)}; expected (batch, kv_length) "
                         f"= ({B}, {Tk}) with True for real tokens")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be a positive number (logits are capped to +-softcap); "
                         "use softcap=None for no cap")
    if s_aux is not None and tuple(s_aux.shape) != (H,):
        raise ValueError(f"s_aux has shape {tuple(s_aux.shape)}; expected one sink logit per query head, ({H},)")
    if row_shift is not None and (tuple(row_shift.shape) != (B,) or row_shift.is_floating_point()
                                  or row_shift.dtype == torch.bool or bool((row_shift < 0).any())):
        raise ValueError(f"row_shift has shape {tuple(row_shift.shape)} and dtype {row_shift.dtype}; expected one "
                         f"integer >= 0 per batch row (its leading pads), ({B},)")
    if attn_mask is not None:
        check_attn_mask(attn_mask, B, H, Tq, Tk)
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} requires grad (a learned bias such as "
                             "T5's position_bias), but the kernel treats it as a constant; detach it, or use eager "
                             "attention")


def check_attn_mask(attn_mask: torch.Tensor, B: int, H: int, Tq: int, Tk: int) -> None:
    """A caller's mask must be 4-D bool or float, broadcastable from (B or 1, H or 1, Tq, Tk)."""
    ok = (attn_mask.dim() == 4 and (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())
          and all(n in (1, want) for n, want in zip(attn_mask.shape, (B, H, Tq, Tk))))
    if not ok:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} and dtype {attn_mask.dtype} does not fit "
                         f"(batch or 1, heads or 1, q_length, kv_length) = ({B}, {H}, {Tq}, {Tk}); pass a bool "
                         "(True = attend) or additive float mask of that shape")


def _make_tiles(q, k, v, rows, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k, *,
                attn_mask=None, softcap=None, q_positions=None, span_k=SPAN_K, row_shift=None) -> _Tiles:
    """The block plan of one class of heads (shapes already checked); `rows`: a MaskSpec or r row specs."""
    rows = (rows,) if isinstance(rows, MaskSpec) else tuple(rows)
    B, _, Tq, _ = q.shape
    Tk = k.shape[2]
    if key_padding is not None:
        key_padding = key_padding.to(device=q.device, dtype=torch.bool)
    if attn_mask is not None:
        attn_mask = attn_mask.to(device=q.device).expand(*attn_mask.shape[:2], Tq, Tk)  # a view, no copy
    return _Tiles(rows, B, Tq, Tk, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k, q.device,
                  attn_mask=attn_mask, softcap=None if softcap is None else float(softcap), q_positions=q_positions,
                  span_k=span_k, row_shift=row_shift)
