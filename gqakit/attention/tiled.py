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

Masking. A `MaskSpec` decides, analytically, which key blocks a query block visits (so a window W
costs O(T * W)) and which of those are full (no elementwise mask needed). Partial blocks evaluate
the spec, the key padding, an optional transformers-style `extra_mask` on absolute positions and an
optional dense `attn_mask`; with a dense mask every visited block is partial, and blocks that it
masks entirely are skipped. Fully masked query rows give output 0 and lse -inf (with sinks: 0 and
lse = s_aux), the `reference.eager_reference` convention.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from .masks import MaskSpec, dense_allowed

_NEG_INF = float("-inf")


class _Tiles:
    """The block plan, the logits and the elementwise mask of partial tiles, shared by forward and backward."""

    def __init__(self, spec: MaskSpec, B: int, Tq: int, Tk: int, q_offset: int, kv_offset: int,
                 key_padding: torch.Tensor | None, extra_mask: Callable | None,
                 block_q: int, block_k: int, device: torch.device, *,
                 attn_mask: torch.Tensor | None = None, softcap: float | None = None):
        self.spec, self.B, self.q_offset, self.kv_offset = spec, B, q_offset, kv_offset
        self.key_padding, self.extra_mask, self.device = key_padding, extra_mask, device
        self.attn_mask, self.softcap = attn_mask, softcap  # attn_mask: (B|1, H|1, Tq, Tk) view
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
            blocks = []
            for a0, a1 in spec.kv_block_ranges(q0 + q_offset, q1 + q_offset, kv_offset, kv_offset + Tk, block_k):
                k0, k1 = a0 - kv_offset, a1 - kv_offset
                if live is not None and not live[q0 // block_q][k0 // block_k]:
                    continue  # the caller's mask allows nothing here
                full = (extra_mask is None and attn_mask is None and padded_full[k0 // block_k]
                        and spec.block_is_full(q0 + q_offset, q1 + q_offset, a0, a1))
                blocks.append((k0, k1, not full))
            self.plan.append((q0, q1, blocks))

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
        """Boolean tile (B or 1, q1 - q0, k1 - k0) of the head-independent rules: True where query may attend."""
        qpos = torch.arange(q0 + self.q_offset, q1 + self.q_offset, device=self.device)
        kpos = torch.arange(k0 + self.kv_offset, k1 + self.kv_offset, device=self.device)
        tile = self.spec.mask(qpos, kpos)[None]  # (1, bq, bk)
        if self.key_padding is not None:
            tile = tile & self.key_padding[:, None, k0:k1]  # (B, bq, bk)
        if self.extra_mask is not None:  # transformers' 4-D index convention, as in sdpa_mask
            b = torch.arange(self.B, device=self.device)[:, None, None, None]
            h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=self.device)
            extra = self.extra_mask(b, h, qpos[None, None, :, None], kpos[None, None, None, :])
            extra = torch.as_tensor(extra, device=self.device).bool()
            extra = extra.expand(torch.broadcast_shapes(extra.shape, (1, 1, q1 - q0, k1 - k0)))
            tile = tile & extra[:, 0]  # head-independent masks, as transformers' sdpa path assumes
        return tile

    def apply_(self, s: torch.Tensor, r: int, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Add the dense mask's bias and set disallowed scores of a tile s (B*G, (q1-q0)*r, bk) to -inf, in place."""
        bq, bk = q1 - q0, k1 - k0
        sv = s.view(self.B, -1, bq, r, bk)  # (B, G, bq, r, bk)
        blocked = ~self.allowed(q0, q1, k0, k1)[:, None, :, None, :]  # (B|1, 1, bq, 1, bk)
        if self.attn_mask is not None:
            m = self.attn_mask[:, :, q0:q1, k0:k1]  # (B|1, H|1, bq, bk)
            # per-head masks: head g * r + j is row j of group g -> (B|1, G, bq, r, bk); else (B|1, 1, bq, 1, bk)
            m = m.unflatten(1, (-1, r)).transpose(2, 3) if m.shape[1] > 1 else m[:, :, :, None, :]
            if m.dtype != torch.bool:
                sv.add_(m)  # an additive mask is a bias (its masking values are set to -inf just below)
            blocked = blocked | ~dense_allowed(m)
        sv.masked_fill_(blocked, _NEG_INF)
        return s


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


def _sink_rows(s_aux: torch.Tensor, B: int, G: int, Tq: int) -> torch.Tensor:
    """Per-head sink logits (H,) -> one fp32 value per folded query row (B*G, Tq*r)."""
    H = s_aux.shape[0]
    return _fold_q(s_aux.float().view(1, H, 1).expand(B, H, Tq), G)


class _TiledAttention(torch.autograd.Function):
    """Returns (out, lse); both are differentiable (lse feeds ring attention's merge), in q, k, v and s_aux."""

    @staticmethod
    def forward(ctx, q, k, v, s_aux, scale: float, tiles: _Tiles):
        B, H, Tq, d = q.shape
        G, r, dv = k.shape[1], H // k.shape[1], v.shape[3]
        qf = _fold_q(q.float() * scale, G)  # (B*G, Tq*r, d), pre-scaled
        kf = k.float().reshape(B * G, -1, d)  # (B*G, Tk, d)
        vf = v.float().reshape(B * G, -1, dv)  # (B*G, Tk, dv)
        sink = _sink_rows(s_aux, B, G, Tq) if s_aux is not None else None  # (B*G, Tq*r)
        out = qf.new_zeros(B * G, Tq * r, dv)  # rows no block visits stay 0, lse -inf (or the sink)
        lse = sink.clone() if sink is not None else qf.new_full(qf.shape[:2], _NEG_INF)  # (B*G, Tq*r)
        for q0, q1, blocks in tiles.plan:
            if not blocks:
                continue
            rows = slice(q0 * r, q1 * r)
            qb = qf[:, rows]  # (B*G, n, d), n = (q1 - q0) * r
            if sink is None:
                m = qb.new_full(qb.shape[:2], _NEG_INF)  # running row max
                l = qb.new_zeros(qb.shape[:2])  # running row sum of exp(s - m)
            else:  # the sink is the first "key": max s_aux, sum exp(s_aux - s_aux) = 1, value 0
                m, l = sink[:, rows].clone(), qb.new_ones(qb.shape[:2])
            acc = qb.new_zeros(*qb.shape[:2], dv)  # running unnormalised output
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
            live = l > 0
            out[:, rows] = acc / torch.where(live, l, 1.0)[:, :, None]
            lse[:, rows] = torch.where(live, m + l.log(), _NEG_INF)
        out32 = _unfold_q(out, B, H, Tq)  # (B, H, Tq, dv) fp32
        lse_q = _unfold_q(lse, B, H, Tq)  # (B, H, Tq)
        # The backward's D = rowsum(dO * O) cancels when one key dominates; O rounded to bf16 would cost
        # it ~2^-8 relative, so the fp32 output is kept (the returned one is rounded to q's dtype).
        ctx.save_for_backward(q, k, v, out32, lse_q, s_aux)
        ctx.scale, ctx.tiles = scale, tiles
        return out32.to(q.dtype), lse_q

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, s_aux = ctx.saved_tensors
        dq, dk, dv, ds_aux = _backward(q, k, v, out, lse, dout, dlse, ctx.scale, ctx.tiles, s_aux)
        return dq, dk, dv, ds_aux, None, None


def _backward(q, k, v, out, lse, dout, dlse, scale: float, tiles: _Tiles, s_aux=None):
    """(dq, dk, dv, ds_aux or None) from the saved out and lse; with the out / lse of a larger softmax that
    this block is part of (ring attention), the same formulas give this block's exact share of the gradients."""
    B, H, Tq, d = q.shape
    G, r, dv_dim = k.shape[1], H // k.shape[1], v.shape[3]
    qf = _fold_q(q.float() * scale, G)  # (B*G, Tq*r, d)
    kf = k.float().reshape(B * G, -1, d)  # (B*G, Tk, d)
    vf = v.float().reshape(B * G, -1, dv_dim)  # (B*G, Tk, dv)
    dof = _fold_q(dout.float(), G)  # (B*G, Tq*r, dv)
    # dS = P * (dP - D) with D = rowsum(dO * O); an lse gradient adds P * dlse to dS.
    delta = (dof * _fold_q(out.float(), G)).sum(dim=2) - _fold_q(dlse.float(), G)  # (B*G, Tq*r)
    lse_f = _fold_q(lse, G)  # (B*G, Tq*r)
    lse_safe = lse_f.masked_fill(lse_f == _NEG_INF, float("inf"))  # dead rows: exp(s - inf) = 0
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for q0, q1, blocks in tiles.plan:
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
    ds_aux = None
    if s_aux is not None:  # the sink's probability exp(s_aux - lse), its dP is 0: dS_sink = -P_sink * D
        sink = _sink_rows(s_aux, B, G, Tq)  # (B*G, Tq*r)
        ds_rows = (sink - lse_safe).exp_().mul_(delta).neg_()
        ds_aux = _unfold_q(ds_rows, B, H, Tq).sum(dim=(0, 2)).to(s_aux.dtype)  # (H,)
    dq = _unfold_q(dq.mul_(scale), B, H, Tq).to(q.dtype)
    return dq, dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype), ds_aux


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    spec: MaskSpec = MaskSpec(), q_offset: int = 0, kv_offset: int = 0,
                    key_padding: torch.Tensor | None = None, extra_mask: Callable | None = None,
                    block_q: int = 128, block_k: int = 128, return_lse: bool = False,
                    attn_mask: torch.Tensor | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None):
    """Exact attention softmax(cap(q k^T * scale) + mask [, s_aux]) v, computed tile by tile.

    q (B, H, Tq, d); k (B, G, Tk, d); v (B, G, Tk, dv) with G dividing H (never repeated). Query i
    sits at absolute position q_offset + i, key j at kv_offset + j; `spec` says which pairs may attend
    (and which blocks to skip), `key_padding` (B, Tk) marks real keys with True, and `extra_mask` is an
    optional transformers-style `(batch_idx, head_idx, q_idx, kv_idx)` function on absolute positions
    that is ANDed in within visited blocks (it cannot make the kernel skip blocks; put windows in `spec`).
    `attn_mask` is a caller's dense mask broadcastable from (B or 1, H or 1, Tq, Tk) on local indices:
    bool (True = attend) or additive float (see `masks.dense_allowed`); it is ANDed in (a float one is
    also added) and read tile by tile. `softcap` c caps each logit to c * tanh(logit / c) before any
    mask (Gemma2). `s_aux` (H,) are per-head sink logits: a key with value 0 in every softmax (gpt-oss).
    Accumulates in fp32 and returns out (B, H, Tq, dv) in q's dtype, plus with `return_lse` the fp32
    log-sum-exp (B, H, Tq), sink included. Fully masked query rows give 0 and lse -inf (with a sink:
    0 and lse = s_aux). Differentiable in q, k, v and s_aux.
    """
    tiles = _make_tiles(q, k, v, spec, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k,
                        attn_mask=attn_mask, softcap=softcap, s_aux=s_aux)
    out, lse = _TiledAttention.apply(q, k, v, s_aux, float(scale), tiles)
    return (out, lse) if return_lse else out


def tiled_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None, *,
                             scale: float, spec: MaskSpec = MaskSpec(), q_offset: int = 0, kv_offset: int = 0,
                             key_padding: torch.Tensor | None = None, extra_mask: Callable | None = None,
                             block_q: int = 128, block_k: int = 128, attn_mask: torch.Tensor | None = None,
                             softcap: float | None = None, s_aux: torch.Tensor | None = None):
    """(dq, dk, dv) of `tiled_attention` given its out (B, H, Tq, dv), lse (B, H, Tq) and their gradients;
    (dq, dk, dv, ds_aux) when `s_aux` is given.

    `out` and `lse` may belong to a larger softmax that these keys are only one block of (ring
    attention passes the merged out / lse): the result is then this block's exact share of the
    gradients, and no forward is recomputed. Pass `out` in fp32 where you have it: the gradients of
    low-precision inputs lose accuracy through D = rowsum(dO * O) otherwise. Arguments as in
    `tiled_attention`.
    """
    tiles = _make_tiles(q, k, v, spec, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k,
                        attn_mask=attn_mask, softcap=softcap, s_aux=s_aux)
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    grads = _backward(q, k, v, out, lse, dout, dlse, float(scale), tiles, s_aux)
    return grads if s_aux is not None else grads[:3]


def _make_tiles(q, k, v, spec, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k, *,
                attn_mask=None, softcap=None, s_aux=None) -> _Tiles:
    """Check shapes (one-line ValueErrors) and build the block plan."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"expected q (B, H, Tq, d), k (B, G, Tk, d) and v (B, G, Tk, dv); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, Tq, d = q.shape
    if k.shape[0] != B or k.shape[3] != d or H % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}: need the same batch and "
                         f"head_dim and num_key_value_heads dividing num_attention_heads={H}")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    Tk = k.shape[2]
    if key_padding is not None:
        if tuple(key_padding.shape) != (B, Tk):
            raise ValueError(f"key_padding has shape {tuple(key_padding.shape)}; expected (batch, kv_length) "
                             f"= ({B}, {Tk}) with True for real tokens")
        key_padding = key_padding.to(device=q.device, dtype=torch.bool)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be a positive number (logits are capped to +-softcap); "
                         "use softcap=None for no cap")
    if s_aux is not None and tuple(s_aux.shape) != (H,):
        raise ValueError(f"s_aux has shape {tuple(s_aux.shape)}; expected one sink logit per query head, ({H},)")
    if attn_mask is not None:
        ok = (attn_mask.dim() == 4 and (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())
              and all(n in (1, want) for n, want in zip(attn_mask.shape, (B, H, Tq, Tk))))
        if not ok:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} and dtype {attn_mask.dtype} does not fit "
                             f"(batch or 1, heads or 1, q_length, kv_length) = ({B}, {H}, {Tq}, {Tk}); pass a bool "
                             "(True = attend) or additive float mask of that shape")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} requires grad (a learned bias such as "
                             "T5's position_bias), but the kernel treats it as a constant; detach it, or use eager "
                             "attention")
        attn_mask = attn_mask.to(device=q.device).expand(*attn_mask.shape[:2], Tq, Tk)  # a view, no copy
    return _Tiles(spec, B, Tq, Tk, q_offset, kv_offset, key_padding, extra_mask, block_q, block_k, q.device,
                  attn_mask=attn_mask, softcap=None if softcap is None else float(softcap))
