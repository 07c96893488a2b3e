"""What transformers passes to attention functions beyond q/k/v, honoured by the tiled kernel (issue 11):
soft-capped logits (Gemma2), sink logits s_aux (gpt-oss), bidirectional attention (encoders), a caller's
4-D mask (bool or additive), flash-style cu_seq_lens packing, a value head dim of its own (DeepSeek-V3),
and accurate low-precision gradients.

Kernel tests compare against `eager_reference` run in float64 on the same (rounded) inputs. An error is
the largest absolute difference divided by the largest reference entry (at least 1), so a tolerance
reads as "relative to the scale of the result". The kernel accumulates in fp32, so fp32 inputs meet
1e-5 (outputs) / 1e-4 (gradients); bf16 and fp16 results are rounded to their dtype at the end, so
they meet a few rounding steps: bf16 1e-2 (2^-8 ~ 4e-3 per rounding), fp16 2e-3 (2^-11 ~ 5e-4).
Model tests compare whole tiny models with gqakit 'tiled' against their eager attention in fp32.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import masking_utils
from transformers.masking_utils import (
    and_masks, blockwise_overlay, causal_mask_function, find_packed_sequence_indices, or_masks, sliding_window_overlay,
)

import gqakit.attention as attention
from gqakit.attention.masks import MaskSpec
from gqakit.attention.reference import eager_reference, repeat_kv
from gqakit.attention.hf_masks import TiledMask, gqakit_mask
from gqakit.attention.registration import _make_attention
from gqakit.attention.tiled import _make_tiles, tiled_attention, tiled_attention_backward

NEG_INF = float("-inf")
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / max(1.0, float(ref.abs().max())))


def inputs(B=2, H=4, G=2, tq=23, tk=23, d=16, dv=None, dtype=torch.float32, q_scale=1.0, k_scale=1.0, v_scale=1.0,
           seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, tq, d, generator=gen) * q_scale).to(dtype).requires_grad_()
    k = (torch.randn(B, G, tk, d, generator=gen) * k_scale).to(dtype).requires_grad_()
    v = (torch.randn(B, G, tk, dv or d, generator=gen) * v_scale).to(dtype).requires_grad_()
    return q, k, v


def spec_mask(spec, B, tq, tk, key_padding=None, q_offset=0):
    m = spec.mask(torch.arange(q_offset, q_offset + tq), torch.arange(tk))[None, None]  # (1, 1, Tq, Tk)
    return m & key_padding[:, None, None, :] if key_padding is not None else m


def check(q, k, v, *, scale, ref_mask=None, s_aux=None, softcap=None, seed=1, **kernel):
    """Kernel vs float64 reference: out, lse and the gradients of q, k, v (and s_aux) under a random loss
    that uses both out and lse. Returns the errors; asserts them against TOL[q.dtype]."""
    out_tol, grad_tol = TOL[q.dtype]
    out, lse = tiled_attention(q, k, v, scale=scale, softcap=softcap, s_aux=s_aux, return_lse=True, **kernel)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1]) and lse.dtype == torch.float32
    leaves = [q, k, v] + ([s_aux] if s_aux is not None else [])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_aux = ref_leaves[3] if s_aux is not None else None
    ref, ref_lse = eager_reference(*ref_leaves[:3], scale, ref_mask, softcap=softcap, s_aux=ref_aux)
    dead = ref_lse == NEG_INF
    assert torch.equal(lse == NEG_INF, dead)
    assert (out[dead] == 0).all()
    errors = {"out": rel_err(out, ref), "lse": rel_err(lse[~dead], ref_lse[~dead])}
    gen = torch.Generator().manual_seed(seed)
    g_out, g_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen).masked_fill(dead, 0)
    loss = (out.float() * g_out).sum() + (lse.nan_to_num(neginf=0.0) * g_lse).sum()
    ref_loss = (ref * g_out.double()).sum() + (ref_lse.nan_to_num(neginf=0.0) * g_lse.double()).sum()
    for name, g, r in zip(("dq", "dk", "dv", "ds_aux"), torch.autograd.grad(loss, leaves),
                          torch.autograd.grad(ref_loss, ref_leaves)):
        assert g.dtype == leaves[0].dtype or name == "ds_aux"
        assert torch.isfinite(g).all(), name
        errors[name] = rel_err(g, r)
    for name, err in errors.items():
        assert err <= (out_tol if name in ("out", "lse") else grad_tol), (name, err, errors)
    return errors


def left_padding(B, tk):
    """Row 0 unpadded, row 1 fully padded (its queries see nothing), other rows left-padded."""
    kp = torch.ones(B, tk, dtype=torch.bool)
    kp[1:2] = False
    for b in range(2, B):
        kp[b, : 3 * b] = False
    return kp


# ---- soft-capped logits (Gemma2) -------------------------------------------------------------------

@pytest.mark.parametrize("H, G", [(4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softcap_forward_and_backward(H, G, dtype):
    q, k, v = inputs(B=3, H=H, G=G, dtype=dtype, q_scale=3.0, k_scale=3.0)  # scores ~ 9: the cap at 5 bites
    kp = left_padding(3, 23)
    spec = MaskSpec(window=9)
    mask = spec_mask(spec, 3, 23, 23, kp)
    check(q, k, v, scale=0.25, softcap=5.0, ref_mask=mask, spec=spec, key_padding=kp, block_q=8, block_k=4)
    # The cap matters here: the same attention without it differs by far more than any tolerance.
    capped, _ = eager_reference(q.double(), k.double(), v.double(), 0.25, mask, softcap=5.0)
    plain, _ = eager_reference(q.double(), k.double(), v.double(), 0.25, mask)
    assert (capped - plain).abs().max() > 0.1


def test_softcap_matches_the_gemma2_eager_formula():
    """transformers' Gemma2 eager: w = q k^T * scaling; w = w / softcap; tanh; w * softcap; + mask; softmax."""
    q, k, v = inputs(B=1, H=2, G=1, tq=9, tk=9, d=8, q_scale=4.0, k_scale=4.0)
    w = q @ repeat_kv(k, 2).transpose(-1, -2) * 0.35
    w = torch.tanh(w / 7.0) * 7.0
    ref = torch.softmax(w, dim=-1) @ repeat_kv(v, 2)
    out = tiled_attention(q, k, v, scale=0.35, softcap=7.0, spec=MaskSpec(causal=False), block_q=4, block_k=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---- sink logits s_aux (gpt-oss) -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_sink_logits_forward_and_gradients(dtype, softcap):
    q, k, v = inputs(B=3, H=4, G=2, dtype=dtype, q_scale=2.0)
    s_aux = torch.tensor([-1.0, 0.5, 2.0, 4.0]).requires_grad_()  # fp32, as gpt-oss keeps it
    kp = left_padding(3, 23)
    spec = MaskSpec(window=6, sinks=1)
    errors = check(q, k, v, scale=0.3, s_aux=s_aux, softcap=softcap, ref_mask=spec_mask(spec, 3, 23, 23, kp),
                   spec=spec, key_padding=kp, block_q=4, block_k=8)
    assert "ds_aux" in errors
    # Row 1 sees no key: all its weight is on the sink (value 0): output 0, lse = s_aux[h], as gpt-oss's eager.
    out, lse = tiled_attention(q, k, v, scale=0.3, s_aux=s_aux, key_padding=kp, return_lse=True)
    assert (out[1] == 0).all()
    torch.testing.assert_close(lse[1], s_aux.detach()[:, None].expand(4, 23))


def test_sink_logits_match_the_gpt_oss_eager_formula():
    """transformers' gpt-oss eager: softmax over [scores, sink] (max-shifted), drop the sink column."""
    q, k, v = inputs(B=2, H=4, G=2, tq=11, tk=11, d=8)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2
    w = q @ repeat_kv(k, 4).transpose(-1, -2) * 0.4
    w = w.masked_fill(~torch.ones(11, 11, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    logits = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(2, -1, 11, -1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    ref = torch.softmax(logits, dim=-1)[..., :-1] @ repeat_kv(v, 4)
    out = tiled_attention(q, k, v, scale=0.4, s_aux=sinks, block_q=4, block_k=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---- bidirectional attention -----------------------------------------------------------------------

@pytest.mark.parametrize("tq, tk", [(23, 23), (7, 19)])  # 7 x 19: cross-attention shapes
def test_non_causal_with_padding(tq, tk):
    q, k, v = inputs(B=3, tq=tq, tk=tk)
    kp = left_padding(3, tk)
    spec = MaskSpec(causal=False)
    check(q, k, v, scale=0.25, ref_mask=spec_mask(spec, 3, tq, tk, kp), spec=spec, key_padding=kp,
          block_q=4, block_k=8)


class _Attn(torch.nn.Module):
    """Stands in for a transformers attention module: what the attention functions read from it."""

    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal, self.config = is_causal, types.SimpleNamespace()


def test_attention_function_runs_bidirectionally_when_asked():
    q, k, v = inputs(B=2, tq=13, tk=13)
    fn = _make_attention("tiled")
    ref, _ = eager_reference(q, k, v, 0.25)  # no mask: everyone sees everyone
    for module, kwargs in ((_Attn(is_causal=False), {}), (_Attn(is_causal=True), {"is_causal": False})):
        out, _ = fn(module, q, k, v, None, scaling=0.25, **kwargs)
        torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    # a bidirectional mask from the mask interface wins over a causal module, as in eager
    out, _ = fn(_Attn(), q, k, v, gqakit_mask(2, 13, 13, mask_function=transformers.masking_utils
                                              .bidirectional_mask_function), scaling=0.25)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    # a sliding kind without causality is a symmetric window |q - k| < W (Longformer style)
    module = _Attn(is_causal=False)
    module.config.gqakit_attention = attention.options.normalise_options("sliding", {"window": 3, "block_q": 4,
                                                                                     "block_k": 4})
    out, _ = _make_attention("sliding")(module, q, k, v, None, scaling=0.25)
    ref, _ = eager_reference(q, k, v, 0.25, spec_mask(MaskSpec(causal=False, window=3), 2, 13, 13))
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)


def _packed_causal(position_ids):
    """The causal mask function transformers builds for packed sequences: up to 5.23 one helper, from 5.24 on
    positions remapped per document and-ed with a same-document mask (as create_causal_mask composes them)."""
    docs = find_packed_sequence_indices(position_ids)
    if hasattr(masking_utils, "packed_sequence_compatibility_function"):
        return masking_utils.packed_sequence_compatibility_function(causal_mask_function, position_ids, docs)
    remapped = masking_utils.remap_positions_for_packed_sequence(causal_mask_function, position_ids)
    return and_masks(remapped, masking_utils.packed_sequence_mask_function(docs))


def test_model_mask_functions_pick_the_causal_plan_only_when_it_loses_nothing():
    ids = torch.tensor([[-1, -1, 0, 0, 0, -1, 1, 1, -1, -1, -1, -1, -1]])  # two "image" blocks, bidirectional inside
    overlay = or_masks(causal_mask_function, blockwise_overlay(ids))
    assert gqakit_mask(1, 13, 13, mask_function=overlay).causal is False
    assert gqakit_mask(1, 13, 13, mask_function=and_masks(sliding_window_overlay(4), causal_mask_function)).causal
    assert gqakit_mask(1, 13, 13).causal and gqakit_mask(1, 13, 13).model_mask is None
    position_ids = torch.cat([torch.arange(5), torch.arange(8)])[None]
    assert gqakit_mask(1, 13, 13, mask_function=_packed_causal(position_ids)).causal
    assert not gqakit_mask(1, 13, 13, mask_function=lambda b, h, q, k: k <= q).causal  # unknown: no assumption
    # the or-overlay lets a block's first token see the block's later tokens: exact against the dense mask
    q, k, v = inputs(B=1, tq=13, tk=13)
    out, _ = _make_attention("tiled")(_Attn(), q, k, v, gqakit_mask(1, 13, 13, mask_function=overlay), scaling=0.25)
    pos = torch.arange(13)
    dense = overlay(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                    pos[None, None, :, None], pos[None, None, None, :])  # (1, 1, 13, 13)
    assert dense[0, 0, 2, 4]  # a look-ahead inside the first block
    ref, _ = eager_reference(q, k, v, 0.25, dense)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)


# ---- a caller's dense 4-D mask ---------------------------------------------------------------------

def block_diagonal(docs: torch.Tensor, causal=True) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool: same document (and causal)."""
    T = docs.shape[1]
    m = docs[:, :, None] == docs[:, None, :]
    if causal:
        m = m & torch.ones(T, T, dtype=torch.bool).tril()
    return m[:, None]


DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 9, [0] * 12 + [1] * 11])


@pytest.mark.parametrize("kind", ["bool", "additive", "additive_fp16", "per_head", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_4d_mask(kind, dtype):
    q, k, v = inputs(B=2, H=4, G=2, dtype=dtype)
    allowed = block_diagonal(DOCS)  # (2, 1, 23, 23)
    allowed[1, :, 4] = False  # a query row that sees nothing: output 0, lse -inf
    ref_mask = allowed
    if kind == "bool":
        mask = allowed
    elif kind.startswith("additive"):
        fdt = torch.float16 if kind == "additive_fp16" else torch.float32
        mask = torch.zeros(allowed.shape, dtype=fdt).masked_fill(~allowed, torch.finfo(fdt).min)
        ref_mask = mask
    elif kind == "per_head":  # a different pattern per head: head h also hides the first h keys
        mask = allowed.expand(2, 4, 23, 23).clone()
        for h in range(4):
            mask[:, h, :, :h] = False
        ref_mask = mask
    else:  # additive values that are not masking: they are added to the scores exactly
        bias = torch.linspace(-3, 1, 23)[None, None, None, :].expand(1, 4, 23, 23)  # per-key, broadcast batch
        mask = bias.masked_fill(~allowed, NEG_INF)
        ref_mask = mask
    check(q, k, v, scale=0.25, ref_mask=ref_mask, attn_mask=mask, spec=MaskSpec(causal=False), block_q=4, block_k=4)


def test_dense_mask_skips_blocks_it_empties_and_keeps_memory_small():
    docs = torch.arange(64).div(16, rounding_mode="floor")[None]  # four documents of 16
    mask = block_diagonal(docs)  # (1, 1, 64, 64)
    q, k, v = inputs(B=1, tq=64, tk=64)
    tiles = _make_tiles(q, k, v, MaskSpec(causal=False), 0, 0, None, None, 8, 8, attn_mask=mask)
    visited = sum(len(blocks) for _, _, blocks in tiles.plan)
    assert visited == 4 * 3  # per document of 2 x 2 blocks: the 3 on or below the diagonal
    assert all(needs_mask for _, _, blocks in tiles.plan for _, _, needs_mask in blocks)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in elements) any aten op produces, forward and backward; views of the
    tensors in `given` (expands, slices of the caller's mask) allocate nothing and are not counted."""

    def __init__(self, *given: torch.Tensor):
        super().__init__()
        self.given = {t.untyped_storage().data_ptr() for t in given}
        self.largest = 0

    def __torch_dispatch__(self, func, types=(), args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.given:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_dense_mask_is_read_where_it_lies(dtype):
    """With a caller's (T, T) mask the kernel builds nothing of that size: at most one (block_q, T) band."""
    T, block = 512, 64
    allowed = block_diagonal(torch.arange(T).div(100, rounding_mode="floor")[None])  # (1, 1, T, T)
    mask = allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(~allowed, NEG_INF)
    q, k, v = inputs(B=1, H=2, G=1, tq=T, tk=T, d=16)
    with _LargestAllocation(mask, q, k, v) as probe:
        out = tiled_attention(q, k, v, scale=0.25, attn_mask=mask, spec=MaskSpec(causal=False), block_q=block,
                              block_k=block)
        out.backward(torch.ones_like(out))
    assert probe.largest <= block * T < T * T
    assert k.grad is not None


def test_dense_mask_shape_is_checked():
    q, k, v = inputs(B=2, tq=5, tk=5)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 1, 5, 6\)"):
        tiled_attention(q, k, v, scale=1.0, attn_mask=torch.ones(2, 1, 5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="requires grad"):
        tiled_attention(q, k, v, scale=1.0, attn_mask=torch.zeros(1, 4, 5, 5, requires_grad=True))


# ---- low-precision gradients -----------------------------------------------------------------------

def _plain_torch(q, k, v, scale):
    """What PyTorch itself does in the input dtype (the bar a low-precision kernel is compared with)."""
    H = q.shape[1]
    s = q @ repeat_kv(k, H).transpose(-1, -2) * scale
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), NEG_INF)
    return torch.softmax(s, dim=-1) @ repeat_kv(v, H)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_use_the_fp32_output(dtype):
    """Short rows with large scores: D = rowsum(dO * O) cancels, so an output rounded to bf16 gave dk errors of
    half the largest dk. With the fp32 output kept for the backward the error is a few roundings of the result."""
    worst = {"kernel": 0.0, "rounded_out": 0.0, "torch": 0.0}
    for seed in range(16):
        q, k, v = inputs(B=2, H=4, G=2, tq=2, tk=2, d=16, dtype=dtype, q_scale=5.0, k_scale=3.0, v_scale=3.0,
                         seed=seed)
        d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = eager_reference(*ref_in, 0.25, torch.ones(2, 2, dtype=torch.bool).tril()[None, None])
        ref_grads = torch.autograd.grad(ref, ref_in, d_out.double())
        out, lse = tiled_attention(q, k, v, scale=0.25, return_lse=True)
        grads = {"kernel": torch.autograd.grad(out, (q, k, v), d_out),
                 "rounded_out": tiled_attention_backward(q, k, v, out.detach(), lse.detach(), d_out, scale=0.25),
                 "torch": torch.autograd.grad(_plain_torch(q, k, v, 0.25), (q, k, v), d_out)}
        for name, gs in grads.items():
            worst[name] = max(worst[name], *(rel_err(g, r) for g, r in zip(gs, ref_grads)))
    assert worst["kernel"] <= TOL[dtype][1], worst
    # measured: bf16 kernel 3.1e-3, rounded output 1.6e-1, PyTorch in bf16 1.4e-1; fp16 4.8e-4, 1.8e-2, 7.8e-3
    assert worst["rounded_out"] > 10 * worst["kernel"], worst  # what keeping the fp32 output fixed
    assert worst["kernel"] <= worst["torch"], worst


# ---- a value head dim of its own (DeepSeek-V3) -----------------------------------------------------

@pytest.mark.parametrize("d, dv", [(16, 8), (8, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_head_dim_differs(d, dv, dtype):
    q, k, v = inputs(B=3, H=4, G=2, d=d, dv=dv, dtype=dtype)
    kp = left_padding(3, 23)
    spec = MaskSpec(window=7)
    check(q, k, v, scale=d ** -0.5, ref_mask=spec_mask(spec, 3, 23, 23, kp), spec=spec, key_padding=kp,
          block_q=8, block_k=8)


def test_backward_api_takes_every_feature():
    """tiled_attention_backward (ring attention's entry point) agrees with autograd through tiled_attention."""
    q, k, v = inputs(B=2, H=4, G=2, d=8, dv=6, q_scale=3.0)
    s_aux = torch.tensor([0.0, 1.0, -1.0, 2.0]).requires_grad_()
    kw = dict(scale=0.3, softcap=3.0, attn_mask=block_diagonal(DOCS), spec=MaskSpec(causal=False), block_q=4,
              block_k=8)
    out, lse = tiled_attention(q, k, v, s_aux=s_aux, return_lse=True, **kw)
    g_out, g_lse = torch.randn(out.shape), torch.randn(lse.shape)
    auto = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v, s_aux))
    manual = tiled_attention_backward(q, k, v, out.detach(), lse.detach(), g_out, g_lse, s_aux=s_aux, **kw)
    assert len(manual) == 4
    for a, b in zip(auto, manual):
        torch.testing.assert_close(a, b)
    assert len(tiled_attention_backward(q, k, v, out.detach(), lse.detach(), g_out, **kw)) == 3


# ---- whole models against their eager attention ----------------------------------------------------

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def eager_and_tiled(cfg, init=None, cls=transformers.AutoModelForCausalLM, **options):
    torch.manual_seed(0)
    build = getattr(cls, "from_config", None) or cls._from_config  # Auto classes / a model class
    ref = build(copy.deepcopy(cfg), attn_implementation="eager")
    if init is not None:
        with torch.no_grad():
            init(ref)
    tiled = attention.use(copy.deepcopy(ref), "tiled", **{"block_q": 4, "block_k": 4, **options})
    return ref.eval(), tiled.eval()


def logits_and_grads(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    value = out.logits if hasattr(out, "logits") else out.last_hidden_state
    loss = out.loss if getattr(out, "loss", None) is not None else (value ** 2).mean()
    loss.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(ref, tiled, logits_tol=1e-5, grad_tol=1e-4, **inputs):
    ref_logits, ref_grads = logits_and_grads(ref, **inputs)
    logits, grads = logits_and_grads(tiled, **inputs)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=logits_tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=grad_tol, msg=name)
    return ref_logits, ref_grads


IDS = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(0))


def test_gemma2_softcap_model_matches_eager():
    def big_scores(model):  # q/k weights large enough that attn_logit_softcapping=5 caps real logits
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 1.0)
            elif name.endswith("o_proj.weight"):
                p.normal_(0.0, 0.3)

    cfg = transformers.Gemma2Config(**SMALL, attn_logit_softcapping=5.0, sliding_window=6,
                                    final_logit_softcapping=None)
    ref, tiled = eager_and_tiled(cfg, big_scores)
    logits, _ = assert_same(ref, tiled, input_ids=IDS, labels=IDS)
    uncapped = copy.deepcopy(ref)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        assert (uncapped(input_ids=IDS).logits - logits).abs().max() > 0.1  # the cap matters in this model


def test_gpt_oss_sink_logits_model_matches_eager():
    def spread_sinks(model):
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.linspace(-2.0, 3.0, p.numel()))

    cfg = transformers.GptOssConfig(**{**SMALL, "intermediate_size": 32}, num_local_experts=2, num_experts_per_tok=1,
                                    sliding_window=6)
    ref, tiled = eager_and_tiled(cfg, spread_sinks)
    _, grads = assert_same(ref, tiled, input_ids=IDS, labels=IDS)
    assert grads["model.layers.0.self_attn.sinks"].abs().max() > 1e-5  # the sinks really get gradients


def test_deepseek_v3_value_head_dim_model_matches_eager():
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64)
    ref, tiled = eager_and_tiled(cfg)
    assert_same(ref, tiled, input_ids=IDS, labels=IDS)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_llama_with_a_block_diagonal_4d_mask_matches_eager(mask_dtype):
    ref, tiled = eager_and_tiled(transformers.LlamaConfig(**SMALL))
    allowed = block_diagonal(DOCS)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    positions = torch.cat([torch.arange(n) for n in (5, 9, 9)]), torch.cat([torch.arange(n) for n in (12, 11)])
    position_ids = torch.stack(positions)
    ref_logits, ref_grads = logits_and_grads(ref, input_ids=IDS, attention_mask=additive, position_ids=position_ids,
                                             labels=IDS)
    logits, grads = logits_and_grads(tiled, input_ids=IDS, position_ids=position_ids, labels=IDS,
                                     attention_mask=additive if mask_dtype == torch.float32 else allowed)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-4, msg=name)
    # and the documents really are separate: the second document of row 0 alone gives the same logits
    with torch.no_grad():
        alone = tiled(input_ids=IDS[:1, 5:14]).logits
    torch.testing.assert_close(logits[0, 5:14], alone[0], rtol=0, atol=1e-5)


def test_llama_packed_by_position_ids_or_cu_seq_lens_matches_eager():
    """transformers turns restarting position_ids into a packed mask function (kept on the causal plan);
    flash-style cu_seq_lens_q/_k are honoured as document boundaries of their own."""
    ref, tiled = eager_and_tiled(transformers.LlamaConfig(**SMALL))
    ids = IDS[:1]
    allowed = block_diagonal(DOCS[:1])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    restart = torch.cat([torch.arange(n) for n in (5, 9, 9)])[None]
    ref_logits, _ = logits_and_grads(ref, input_ids=ids, attention_mask=additive, position_ids=restart, labels=ids)
    logits, _ = assert_same(ref, tiled, input_ids=ids, position_ids=restart, labels=ids, use_cache=False)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)  # packing really was on
    cu = torch.tensor([0, 5, 14, 23], dtype=torch.int32)
    straight = torch.arange(23)[None]
    ref_logits, ref_grads = logits_and_grads(ref, input_ids=ids, attention_mask=additive, position_ids=straight,
                                             labels=ids)
    logits, grads = logits_and_grads(tiled, input_ids=ids, position_ids=straight, labels=ids, use_cache=False,
                                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-4, msg=name)


def test_bert_encoder_matches_eager():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    ref, tiled = eager_and_tiled(cfg, cls=transformers.BertModel)
    padding = torch.ones_like(IDS)
    padding[1, :6] = 0
    padding[0, -4:] = 0
    assert_same(ref, tiled, input_ids=IDS, attention_mask=padding)
    assert_same(ref, tiled, input_ids=IDS)
    # a symmetric sliding window on the encoder equals eager with that dense mask
    window = attention.use(copy.deepcopy(ref), "sliding", window=3, block_q=4, block_k=4)
    pos = torch.arange(23)
    dense = MaskSpec(causal=False, window=3).mask(pos, pos)
    additive = torch.zeros(1, 1, 23, 23).masked_fill(~dense, torch.finfo(torch.float32).min)
    with torch.no_grad():
        torch.testing.assert_close(window(input_ids=IDS).last_hidden_state,
                                   ref(input_ids=IDS, attention_mask=additive).last_hidden_state, rtol=0, atol=1e-5)


def test_tiled_mask_default_is_causal():
    """Older constructions of TiledMask (four fields) keep meaning a causal pattern."""
    assert TiledMask(0, 0, None, None).causal is True
