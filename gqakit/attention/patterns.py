"""Named sparse-attention patterns as `MaskSpec`s, per-head families, and per-layer / per-head option values.

Every pattern is an exact elementwise rule on absolute positions (see `masks.py`), so one object serves
the tiled kernel (which visits exactly the key blocks it touches), sdpa / eager (`dense_mask`, for
checking) and flex_attention (`MaskSpec.mask_function`, or `head_mask_function` for a per-head family).

Longformer (Beltagy et al. 2020), in the paper's terms: a window of w attended tokens besides the
query itself, w/2 on each side for an encoder (w before it for a decoder), spread d apart by a
dilation d, plus global tokens that attend to all and are attended by all:

    longformer(w, dilation=d, global_tokens=(0,)) == MaskSpec(causal=False, window=(w // 2) * d + 1,
                                                              dilation=d, global_tokens=(0,))

Sparse Transformer (Child et al. 2019), factorised with stride l (causal, as in the paper):

    strided  A1 = {max(0, i - l), ..., i}          MaskSpec(window=l + 1)
             A2 = {j : (i - j) mod l == 0}         MaskSpec(dilation=l)
    fixed    A1 = {j : j // l == i // l}           MaskSpec(chunk=l)
             A2 = {j : j mod l >= l - c}           MaskSpec(summary=(l, c))

`part="both"` is the merged head (A1 | A2, a union); `factorised(a1, a2, H)` the per-head form (the
first half of the heads A1, the rest A2). A per-head family is a tuple of H MaskSpecs, head h ->
specs[h]; the tiled kernel takes it as `spec=`.

Execution: in the natural layout, A2 of either pattern touches nearly every key block (one diagonal or
c columns per l), so `tiled_attention` runs these patterns (causal, merged or A2) as disjoint `Piece`s in
the paper's own layouts (residue classes mod l for strided, the gathered summary keys for fixed) and
merges them exactly by log-sum-exp: O(T * (l + T / l)) work, O(T sqrt T) for l ~ sqrt(T).

Bad values raise `AttentionOptionError` in one line naming the fix. A window (or stride) larger than the
sequence is not an error: a pattern belongs to the model, not to one input, and on a short input it is
simply dense (Mistral's 4096 window on a 20-token prompt); likewise a global position past the end of an
input is just absent from it (`use()` refuses those past max_position_embeddings, and negative ones).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from gqakit.attention.masks import AttentionOptionError, MaskSpec

PARTS = ("both", "a1", "a2")


def _positive(name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AttentionOptionError(f"{name}={value!r} must be a positive integer ({what})")
    return value


def _part(part: str) -> str:
    if part not in PARTS:
        raise AttentionOptionError(f"part={part!r} is not a part of a factorised pattern; choose 'a1', 'a2' or "
                                   "'both' (the merged head)")
    return part


def longformer(window: int, *, dilation: int = 1, global_tokens: Sequence[int] = (),
               causal: bool = False) -> MaskSpec:
    """Longformer's sliding window in the paper's terms: `window` = w attended tokens besides the query
    (w/2 on each side when not causal, so w must be even; w before it when causal), `dilation` d between
    them, and `global_tokens` that attend to all and are attended by all."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise AttentionOptionError(f"Longformer window w={window!r} must be an integer >= 0 (the number of "
                                   "attended tokens besides the query itself)")
    if not causal and window % 2:
        raise AttentionOptionError(f"Longformer window w={window} must be even for an encoder (w/2 tokens on each "
                                   f"side); use {window - 1} or {window + 1}")
    d = _positive("dilation", dilation, "the gap between attended tokens; 1 = a dense window")
    per_side = window if causal else window // 2
    return MaskSpec(causal=causal, window=per_side * d + 1, dilation=d, global_tokens=tuple(global_tokens))


def strided(stride: int, *, part: str = "both", causal: bool = True) -> MaskSpec:
    """Sparse Transformer strided pattern with stride l: A1 the previous l positions (and itself), A2 every
    l-th position back; `part` 'a1', 'a2' or 'both' (their union, the merged head)."""
    l = _positive("stride", stride, "the Sparse Transformer's l, e.g. about sqrt(sequence length)")
    a1, a2 = MaskSpec(causal=causal, window=l + 1), MaskSpec(causal=causal, dilation=l)
    return {"a1": a1, "a2": a2, "both": MaskSpec(causal=causal, window=l + 1, parts=(a2,))}[_part(part)]


def fixed(stride: int, summary: int, *, part: str = "both", causal: bool = True) -> MaskSpec:
    """Sparse Transformer fixed pattern with stride l and summary c: A1 the same block of l positions, A2
    the last c positions of every block; `part` 'a1', 'a2' or 'both' (their union, the merged head)."""
    l = _positive("stride", stride, "the Sparse Transformer's l, e.g. about sqrt(sequence length)")
    c = _positive("summary", summary, f"c, the last c positions of every block of {l} that all later tokens see")
    if c > l:
        raise AttentionOptionError(f"summary c={c} is larger than the stride l={l}; give 1 <= c <= {l} (the paper "
                                   "uses c = 8 to 32 for l = 128)")
    a1, a2 = MaskSpec(causal=causal, chunk=l), MaskSpec(causal=causal, summary=(l, c))
    return {"a1": a1, "a2": a2, "both": MaskSpec(causal=causal, chunk=l, parts=(a2,))}[_part(part)]


def factorised(a1: MaskSpec, a2: MaskSpec, num_heads: int) -> tuple[MaskSpec, ...]:
    """The per-head form of a factorised pattern: heads 0 .. H/2 - 1 use `a1`, the rest `a2` (with GQA, an
    even number of K/V heads keeps every group on one pattern, so no group pays for both)."""
    n = _positive("num_heads", num_heads, "the number of query heads")
    if n < 2:
        raise AttentionOptionError("a factorised pattern splits the heads in two halves; it needs at least 2 "
                                   "query heads (use part='both' for a single head)")
    return (a1,) * (n // 2) + (a2,) * (n - n // 2)


def within_window(spec: MaskSpec | Sequence[MaskSpec], window: int) -> MaskSpec | tuple[MaskSpec, ...] | None:
    """`spec` AND dist < window (a model's own sliding-window layer), as a spec (per head: a tuple), or None
    where that is not one: sinks and global tokens reach past any window, which a MaskSpec cannot cut."""
    if not isinstance(spec, MaskSpec):
        out = tuple(within_window(s, window) for s in spec)
        return None if any(s is None for s in out) else out
    atoms = spec.atoms()
    if any(a.sinks or a.global_tokens for a in atoms):
        return None
    cut = [dataclasses.replace(a, window=window if a.window is None else min(a.window, window)) for a in atoms]
    return dataclasses.replace(cut[0], parts=tuple(cut[1:]))


# ---- per-head families ------------------------------------------------------------------------------

def as_heads(spec: MaskSpec | Sequence[MaskSpec], num_heads: int) -> tuple[MaskSpec, ...]:
    """One MaskSpec per query head: a single spec repeated, or a sequence of exactly `num_heads`."""
    if isinstance(spec, MaskSpec):
        return (spec,) * num_heads
    specs = tuple(spec)
    if len(specs) != num_heads or not all(isinstance(s, MaskSpec) for s in specs):
        raise AttentionOptionError(f"a per-head pattern needs one MaskSpec per query head: got {len(specs)} items for "
                                   f"{num_heads} heads")
    return specs


def dense_mask(spec: MaskSpec | Sequence[MaskSpec], q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Dense boolean mask (H or 1, Tq, Tk) of one spec (1) or of one spec per head (H), for references."""
    if isinstance(spec, MaskSpec):
        return spec.mask(q_pos, k_pos)[None]
    specs = tuple(spec)
    distinct = {s: s.mask(q_pos, k_pos) for s in dict.fromkeys(specs)}
    return torch.stack([distinct[s] for s in specs])  # (H, Tq, Tk)


def head_mask_function(specs: Sequence[MaskSpec]) -> Callable:
    """A transformers / flex_attention mask function `(batch_idx, head_idx, q_idx, kv_idx)` for a per-head
    family: head h follows specs[h] (comparisons only, so it also runs under vmap)."""
    specs = tuple(specs)
    by_spec: dict[MaskSpec, list[tuple[int, int]]] = {}
    for h, s in enumerate(specs):  # runs of consecutive heads per distinct spec
        runs = by_spec.setdefault(s, [])
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1)
        else:
            runs.append((h, h + 1))

    def per_head_mask(batch_idx, head_idx, q_idx, kv_idx):
        out = None
        for s, runs in by_spec.items():
            sel = None
            for lo, hi in runs:
                hit = (head_idx >= lo) & (head_idx < hi)
                sel = hit if sel is None else sel | hit
            term = sel & s.allowed(q_idx, kv_idx)
            out = term if out is None else out | term
        return out

    return per_head_mask


def touched_blocks(mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """(..., Tq, Tk) bool -> (..., nq, nk): which (query block, key block) tiles hold an allowed entry."""
    Tq, Tk = mask.shape[-2:]
    m = torch.nn.functional.pad(mask, (0, -Tk % block_k, 0, -Tq % block_q))
    m = m.unflatten(-1, (-1, block_k)).unflatten(-3, (-1, block_q))  # (..., nq, bq, nk, bk)
    return m.any(dim=-1).any(dim=-2)


# ---- option values per layer and per head -----------------------------------------------------------

def check_layered(name: str, value, num_layers: int | None, num_heads: int | None):
    """Validate an option given as a value, a list of one value per layer, or per layer a list of one value per
    query head; returns it as plain lists (JSON, for config.gqakit_attention)."""
    if not isinstance(value, (list, tuple)):
        return value
    if num_layers is None:
        raise AttentionOptionError(f"{name} is a per-layer list, but the model config has no num_hidden_layers; "
                                   "give a single value")
    if len(value) != num_layers:
        raise AttentionOptionError(f"{name} has {len(value)} entries, one per layer, but the model has {num_layers} "
                                   f"layers (num_hidden_layers); give {num_layers} values, or a single value for all")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, (list, tuple)):
            if num_heads is None:
                raise AttentionOptionError(f"{name} for layer {i} is a per-head list, but the model config has no "
                                           "num_attention_heads; give one value per layer")
            if len(v) != num_heads:
                raise AttentionOptionError(f"{name} for layer {i} has {len(v)} entries, one per query head, but the "
                                           f"model has {num_heads} heads (num_attention_heads); give {num_heads} "
                                           "values, or a single value for the layer")
            if any(isinstance(x, (list, tuple)) for x in v):
                raise AttentionOptionError(f"{name} for layer {i} nests lists deeper than per layer, per head")
            v = list(v)
        out.append(v)
    return out


def value_at(value, layer: int | None, head: int):
    """The value of an option (as `check_layered` returns it) at a layer and query head."""
    if isinstance(value, list):
        if layer is None or not 0 <= layer < len(value):
            raise AttentionOptionError(f"a per-layer option has {len(value)} entries but was asked for layer {layer}; "
                                       "the module needs a layer_idx within the model's layers")
        value = value[layer]
        if isinstance(value, list):
            value = value[head]
    return value


def is_layered(value) -> bool:
    return isinstance(value, (list, tuple))


# ---- the Sparse Transformer's own layouts: exact pieces, O(T sqrt T) work for l ~ sqrt(T) -----------------

@dataclasses.dataclass(frozen=True)
class Piece:
    """One of the disjoint pieces a factorised pattern runs as, each dense in its own layout:

    natural  positions as they are, under `spec` (A1: a window or a block of l: O(T * l));
    residue  strided A2 beyond A1: the sequence cut by position mod l, so that (q - k) mod l == 0 becomes
             causal attention inside each of the l residue classes (T / l long), keys at least `gap`
             rows back: O(T^2 / l);
    summary  fixed A2 beyond A1: the summary keys (k mod l >= l - c) of earlier blocks, gathered, are a
             causal prefix for every query: O(T^2 c / l).
    """

    layout: str
    spec: MaskSpec = MaskSpec()
    stride: int = 0
    summary: int = 0
    gap: int = 0


def factorised_pieces(spec: MaskSpec) -> tuple[Piece, ...] | None:
    """Disjoint pieces whose union is exactly `spec`, for a causal strided / fixed pattern (merged, or its A2
    alone, as `strided` / `fixed` build them; a union window W | dilation l in general); None for any other."""
    if not isinstance(spec, MaskSpec) or not spec.causal:
        return None
    atoms = spec.atoms()
    if len(atoms) == 1:
        a = atoms[0]
        if a.dilation > 1 and a == MaskSpec(dilation=a.dilation):  # strided A2
            return (Piece("residue", stride=a.dilation, gap=0),)
        if a.summary and a.summary[1] < a.summary[0] and a == MaskSpec(summary=a.summary):  # fixed A2
            l, c = a.summary  # the summary keys of its own block (causally), then those of earlier blocks
            return (Piece("natural", MaskSpec(chunk=l, summary=(l, c))), Piece("summary", stride=l, summary=c))
        return None
    if len(atoms) != 2:
        return None
    for a, b in (atoms, atoms[::-1]):
        if a.window and b.dilation > 1 and a == MaskSpec(window=a.window) and b == MaskSpec(dilation=b.dilation):
            l = b.dilation  # A1 = q - k < W; A2 beyond it: q - k = m * l with m >= ceil(W / l)
            return (Piece("natural", a), Piece("residue", stride=l, gap=-(-a.window // l)))
        if (a.chunk and b.summary and b.summary[0] == a.chunk and b.summary[1] < a.chunk
                and a == MaskSpec(chunk=a.chunk) and b == MaskSpec(summary=b.summary)):
            return (Piece("natural", a), Piece("summary", stride=a.chunk, summary=b.summary[1]))
    return None


def residue_geometry(l: int, Tq: int, Tk: int, q_offset: int, kv_offset: int) -> tuple[int, int, int, int]:
    """(front pad of q, of k, rows per residue class of q, of k): positions are padded to whole rows of l."""
    fq, fk = q_offset % l, kv_offset % l
    return fq, fk, -(-(fq + Tq) // l), -(-(fk + Tk) // l)


def summary_geometry(l: int, c: int, Tq: int, Tk: int, q_offset: int, kv_offset: int, device=None):
    """(indices of the summary keys among the Tk keys, query positions in the gathered layout): query q sees
    the gathered keys of blocks before its own, a prefix, so it sits just before the first key of its block."""
    kpos = torch.arange(kv_offset, kv_offset + Tk, device=device)
    index = (kpos % l >= l - c).nonzero().flatten()  # (n,)
    starts = torch.arange(q_offset, q_offset + Tq, device=device).div(l, rounding_mode="floor") * l
    return index, torch.searchsorted(kpos[index].contiguous(), starts) - 1  # (Tq,) non-decreasing


def run_pieces(pieces: Sequence[Piece], q, k, v, s_aux, q_offset: int, kv_offset: int, key_padding, run):
    """out (B, H, Tq, dv) and lse (B, H, Tq) of the union of the pieces, merged exactly by log-sum-exp.
    `run(q, k, v, rows, q_offset, kv_offset, key_padding, s_aux=..., q_positions=...)` is one kernel call."""
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # pieces merge in fp32 (fp64 for fp64)
    q, k, v = q.to(compute), k.to(compute), v.to(compute)  # the result is rounded once
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    results = []
    for piece in pieces:
        sink = s_aux if not results else None  # a sink logit joins one softmax denominator, once
        if piece.layout == "natural":
            results.append(run(q, k, v, (piece.spec,), q_offset, kv_offset, key_padding, s_aux=sink))
        elif piece.layout == "residue":
            results.append(_run_residue(piece, q, k, v, sink, q_offset, kv_offset, key_padding, run))
        else:
            index, qpos = summary_geometry(piece.stride, piece.summary, Tq, Tk, q_offset, kv_offset, q.device)
            if len(index):
                kp = None if key_padding is None else key_padding[:, index]
                results.append(run(q, k[:, :, index], v[:, :, index], (MaskSpec(),), 0, 0, kp, s_aux=sink,
                                   q_positions=qpos))
    out, lse = results[0]
    for o, l in results[1:]:
        out, lse = _merge(out, lse, o, l)
    return out.to(dtype), lse


def _run_residue(piece: Piece, q, k, v, s_aux, q_offset, kv_offset, key_padding, run):
    l = piece.stride
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    fq, fk, nq, nk = residue_geometry(l, Tq, Tk, q_offset, kv_offset)

    def fold(x, front, n):  # (B, h, T, e) -> (B * l, h, n, e): row i of class j is position (base + i) * l + j
        x = torch.nn.functional.pad(x, (0, 0, front, n * l - front - x.shape[2]))
        return x.unflatten(2, (n, l)).permute(0, 3, 1, 2, 4).flatten(0, 1)

    kp = key_padding
    if kp is not None or fk or (fk + Tk) % l:  # the pad keys never attend
        kp = torch.ones(B, Tk, dtype=torch.bool, device=q.device) if kp is None else kp
        kp = torch.nn.functional.pad(kp, (fk, nk * l - fk - Tk), value=False)
        kp = kp.view(B, nk, l).transpose(1, 2).reshape(B * l, nk)  # (B * l, nk)
    out, lse = run(fold(q, fq, nq), fold(k, fk, nk), fold(v, fk, nk), (MaskSpec(),), q_offset // l - piece.gap,
                   kv_offset // l, kp, s_aux=s_aux)  # (B * l, H, nq, dv), (B * l, H, nq)
    out = out.unflatten(0, (B, l)).permute(0, 2, 3, 1, 4).flatten(2, 3)[:, :, fq:fq + Tq]  # (B, H, Tq, dv)
    lse = lse.unflatten(0, (B, l)).permute(0, 2, 3, 1).flatten(2, 3)[:, :, fq:fq + Tq]  # (B, H, Tq)
    return out, lse


def _merge(o1, l1, o2, l2):
    """Two softmaxes over disjoint keys -> the one over their union (rows that see no key stay 0, lse -inf)."""
    m = torch.maximum(l1, l2).detach()  # any shift gives the same result: no gradient through it
    m = m.masked_fill(m == float("-inf"), 0.0)
    w1, w2 = (l1 - m).exp(), (l2 - m).exp()  # (B, H, Tq)
    total = w1 + w2
    live = total > 0
    safe = torch.where(live, total, torch.ones_like(total))
    out = (w1[..., None] * o1 + w2[..., None] * o2) / safe[..., None]
    return out, torch.where(live, m + safe.log(), torch.full_like(m, float("-inf")))
