"""tiled_attention against the eager reference: outputs, lse and gradients, per dtype and mask kind."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import sliding_window_overlay

from gqakit.attention.masks import MaskSpec
from gqakit.attention.reference import eager_reference
from gqakit.attention.tiled import tiled_attention, work

NEG_INF = float("-inf")


def dense_mask(spec, B, tq, tk, q_offset, kv_offset, key_padding=None, extra_mask=None):
    """(B or 1, 1, Tq, Tk) boolean mask for the reference, built the slow, direct way."""
    qpos, kpos = torch.arange(q_offset, q_offset + tq), torch.arange(kv_offset, kv_offset + tk)
    m = spec.mask(qpos, kpos)[None, None]  # (1, 1, Tq, Tk)
    if key_padding is not None:
        m = m & key_padding[:, None, None, :]
    if extra_mask is not None:
        b = torch.arange(B)[:, None, None, None]
        m = m & extra_mask(b, torch.zeros(1, 1, 1, 1, dtype=torch.long), qpos[None, None, :, None],
                           kpos[None, None, None, :])
    return m


def make_inputs(B, H, G, tq, tk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, tq, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, G, tk, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, G, tk, d, generator=gen).to(dtype).requires_grad_()
    return q, k, v


def left_padding(B, tk, seed=0):
    """Row 0: no padding; row 1: fully padded; others: random left padding."""
    gen = torch.Generator().manual_seed(seed)
    kp = torch.ones(B, tk, dtype=torch.bool)
    for b in range(1, B):
        n_pad = tk if b == 1 else int(torch.randint(1, tk, (1,), generator=gen))
        kp[b, :n_pad] = False
    return kp


def compare(q, k, v, *, spec, q_offset=0, kv_offset=0, key_padding=None, extra_mask=None,
            block_q=16, block_k=16, out_tol=1e-5, grad_tol=1e-4, seed=1):
    """Forward (out, lse) and autograd grads of tiled vs reference; reference sees fp32 inputs."""
    B, _, tq, d = q.shape
    tk = k.shape[2]
    scale = d ** -0.5
    out, lse = tiled_attention(q, k, v, scale=scale, spec=spec, q_offset=q_offset, kv_offset=kv_offset,
                               key_padding=key_padding, extra_mask=extra_mask, block_q=block_q,
                               block_k=block_k, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    assert lse.dtype == torch.float32
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    mask = dense_mask(spec, B, tq, tk, q_offset, kv_offset, key_padding, extra_mask)
    ref, ref_lse = eager_reference(q32, k32, v32, scale, mask)
    torch.testing.assert_close(out.float(), ref, atol=out_tol, rtol=out_tol)
    dead = ref_lse == NEG_INF
    assert torch.equal(lse == NEG_INF, dead)
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], atol=out_tol, rtol=out_tol)
    assert (out[dead.expand_as(lse)] == 0).all()

    gen = torch.Generator().manual_seed(seed)
    d_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), d_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == q.dtype and torch.isfinite(g).all(), name
        torch.testing.assert_close(g.float(), r, atol=grad_tol, rtol=grad_tol, msg=lambda m: f"d{name}: {m}")


MASK_KINDS = {
    "causal": MaskSpec(),
    "full": MaskSpec(causal=False),
    "window": MaskSpec(window=7),
    "window_bidir": MaskSpec(causal=False, window=5),
    "dilated": MaskSpec(window=12, dilation=3),
    "global": MaskSpec(window=4, global_tokens=(0, 17)),
    "sinks": MaskSpec(window=6, sinks=3),
    "combo": MaskSpec(causal=False, window=4, dilation=2, sinks=2, global_tokens=(9,)),
}


@pytest.mark.parametrize("kind", list(MASK_KINDS))
@pytest.mark.parametrize("H, G", [(4, 1), (4, 2), (4, 4)])
def test_mask_kinds_and_groups(kind, H, G):
    torch.manual_seed(0)
    q, k, v = make_inputs(2, H, G, 37, 37, 8)  # 37: not a multiple of any block size
    compare(q, k, v, spec=MASK_KINDS[kind], block_q=16, block_k=8)


@pytest.mark.parametrize("kind", ["causal", "window", "combo"])
def test_left_padding_with_fully_padded_row(kind):
    torch.manual_seed(0)
    q, k, v = make_inputs(3, 4, 2, 29, 29, 8)
    compare(q, k, v, spec=MASK_KINDS[kind], key_padding=left_padding(3, 29), block_q=8, block_k=8)


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (5, 3), (8, 32), (64, 64), (128, 128)])
def test_block_sizes(block_q, block_k):
    torch.manual_seed(0)
    q, k, v = make_inputs(2, 4, 2, 33, 33, 8)
    compare(q, k, v, spec=MaskSpec(window=9, sinks=1), key_padding=left_padding(2, 33)[[0, 0]],
            block_q=block_q, block_k=block_k)


@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("kind", ["causal", "window", "sinks", "global"])
def test_decode_offsets(tq, kind):
    """Decode-style: a few new queries at the end of a longer cache (kv_offset > 0 for a rolled cache)."""
    torch.manual_seed(0)
    tk, kv_offset = 40, 5
    q, k, v = make_inputs(2, 4, 2, tq, tk, 8)
    compare(q, k, v, spec=MASK_KINDS[kind], q_offset=kv_offset + tk - tq, kv_offset=kv_offset,
            key_padding=left_padding(2, tk, seed=3)[[0, 0]], block_q=2, block_k=16)


def test_chunked_prefill_offsets():
    """A middle chunk of queries against all keys up to it; queries before any key see nothing."""
    torch.manual_seed(0)
    q, k, v = make_inputs(1, 2, 1, 11, 30, 8)
    compare(q, k, v, spec=MaskSpec(window=5), q_offset=19, block_q=4, block_k=8)
    compare(q, k, v, spec=MaskSpec(), q_offset=0, kv_offset=6, block_q=4, block_k=8)  # rows 0-5 dead


def test_non_contiguous_inputs():
    """transformers hands over q/k/v as transposes of (B, T, heads, d) projections."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 19, 4, 8, generator=gen).requires_grad_()
    k = torch.randn(2, 19, 2, 8, generator=gen).requires_grad_()
    v = torch.randn(2, 19, 2, 8, generator=gen).requires_grad_()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d), not contiguous
    out = tiled_attention(qt, kt, vt, scale=0.3, spec=MaskSpec(window=6), block_q=8, block_k=8)
    ref, _ = eager_reference(qt, kt, vt, 0.3, dense_mask(MaskSpec(window=6), 2, 19, 19, 0, 0))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_extra_mask_is_anded_in():
    """A model's own pattern (here transformers' sliding-window overlay) passed as extra_mask."""
    torch.manual_seed(0)
    q, k, v = make_inputs(2, 4, 2, 26, 26, 8)
    compare(q, k, v, spec=MaskSpec(), extra_mask=sliding_window_overlay(4),
            key_padding=left_padding(2, 26), block_q=8, block_k=8)


def test_lse_gradient_matches_reference():
    """lse is differentiable (ring attention merges partial results through it)."""
    torch.manual_seed(0)
    q, k, v = make_inputs(2, 4, 2, 21, 21, 8)
    kp = left_padding(2, 21)
    out, lse = tiled_attention(q, k, v, scale=0.3, spec=MaskSpec(window=5), key_padding=kp,
                               block_q=8, block_k=8, return_lse=True)
    ref, ref_lse = eager_reference(q, k, v, 0.3, dense_mask(MaskSpec(window=5), 2, 21, 21, 0, 0, kp))
    w = torch.randn(lse.shape)
    loss = (out.sum(-1) * w).sum() + (lse.nan_to_num(neginf=0.0) * w).sum()
    ref_loss = (ref.sum(-1) * w).sum() + (ref_lse.nan_to_num(neginf=0.0) * w).sum()
    for g, r in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(ref_loss, (q, k, v))):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


# bf16 keeps 8 mantissa bits (relative step 2^-8 ~ 4e-3) and fp16 11 bits: the kernel computes in fp32
# (the backward reuses the fp32 output, not the rounded one) and rounds only its output and gradients
# to the input dtype, so we compare against the fp32 reference on the same (rounded) inputs with
# tolerances of a few rounding steps of values ~O(1).
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("kind", ["causal", "combo"])
def test_low_precision(dtype, tol, kind):
    torch.manual_seed(0)
    q, k, v = make_inputs(2, 4, 2, 30, 30, 16, dtype=dtype)
    compare(q, k, v, spec=MASK_KINDS[kind], key_padding=left_padding(2, 30), block_q=8, block_k=16,
            out_tol=tol, grad_tol=tol)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("span_k", [128, 256])
def test_no_tq_by_tk_intermediate(span_k):
    """Forward and backward at T=1024 never build a tensor larger than one fused (block_q x span_k) step: far
    below one head's T x T scores, whatever the length."""
    T, block = 1024, 128
    q, k, v = make_inputs(1, 2, 1, T, T, 16)
    with _LargestOutput() as probe:
        out = tiled_attention(q, k, v, scale=0.25, block_q=block, block_k=block, span_k=span_k)
        out.backward(torch.ones_like(out))
    assert probe.largest <= 2 * block * span_k  # one (B*G, block_q * H/G, span_k) fused tile
    assert q.grad is not None and k.grad.shape == k.shape


def test_fused_steps_equal_one_block_per_step():
    """Fusing adjacent key blocks into one matmul changes only rounding: forward and gradients against the
    one-block-per-step kernel (span_k = block_k), with a window, padding and GQA; and causal T = 1024 runs
    2 steps per query block (its full run, its diagonal) instead of up to 8."""
    q, k, v = make_inputs(2, 4, 2, 200, 200, 16)
    pad = torch.ones(2, 200, dtype=torch.bool)
    pad[1, :37] = False
    spec = MaskSpec(window=90)
    results = []
    for span in (16, None):
        for t in (q, k, v):
            t.grad = None
        out = tiled_attention(q, k, v, scale=0.25, spec=spec, key_padding=pad, block_q=16, block_k=16, span_k=span)
        out.backward(torch.cos(out))
        results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32: reassociated sums only
    fused, single = (work(MaskSpec(), 1, 1, 1024, 1024, span_k=s)["steps"] for s in (None, 128))
    assert (fused, single) == (8 + 7, 36)  # 8 query blocks: the first has only its diagonal
    with pytest.raises(ValueError, match="span_k=64 is below block_k=128"):
        tiled_attention(q, k, v, scale=0.25, span_k=64)


def test_long_forward_matches_reference_rows():
    # A 4k causal forward (what a timed test used to guard) checked for what it computes: rows at the start,
    # the middle and the end against a direct softmax over their own row of keys, in float64.
    T = 4096
    q, k, v = make_inputs(1, 2, 2, T, T, 16)
    with torch.no_grad():
        out = tiled_attention(q, k, v, scale=0.25, block_q=128, block_k=128)
    rows = torch.tensor([0, 1, 127, 128, 2047, 2048, T - 129, T - 1])
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    scores = qd[:, :, rows] @ kd.transpose(-1, -2) * 0.25                       # (1, 2, rows, T)
    scores = scores.masked_fill(torch.arange(T)[None, :] > rows[:, None], NEG_INF)
    expected = torch.softmax(scores, dim=-1) @ vd
    torch.testing.assert_close(out[:, :, rows].double(), expected, rtol=1e-5, atol=1e-6)  # fp32 sums


def test_bad_shapes_are_named():
    q, k, v = make_inputs(1, 6, 4, 5, 5, 8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiled_attention(q, k, v, scale=1.0)
    q, k, v = make_inputs(1, 4, 2, 5, 5, 8)
    with pytest.raises(ValueError, match=r"v \(B, G, Tk, dv\)"):
        tiled_attention(q, k, v[:, :, :4], scale=1.0)
    with pytest.raises(ValueError, match="one sink logit per query head"):
        tiled_attention(q, k, v, scale=1.0, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="softcap=0"):
        tiled_attention(q, k, v, scale=1.0, softcap=0)
    with pytest.raises(ValueError, match="key_padding"):
        tiled_attention(q, k, v, scale=1.0, key_padding=torch.ones(1, 4, dtype=torch.bool))


def test_float64_inputs_are_computed_in_float64_and_pass_gradcheck():
    """float64 in, float64 arithmetic (fp32 returned as float64 was 3e-7 off and failed gradcheck): forward and
    backward of a grouped, windowed, sink-token, soft-capped pattern with sink logits and a padded key, checked by
    finite differences."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    s_aux = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    padding = torch.ones(1, 9, dtype=torch.bool)
    padding[0, 2] = False

    def attend(q, k, v, s_aux):
        return tiled_attention(q, k, v, scale=0.3, spec=MaskSpec(window=4, sinks=1), key_padding=padding,
                               block_q=4, block_k=4, softcap=5.0, s_aux=s_aux)

    assert attend(q, k, v, s_aux).dtype == torch.float64
    assert torch.autograd.gradcheck(attend, (q, k, v, s_aux))


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_factorised_sparse_patterns_keep_float64_too(pattern):
    """The Sparse Transformer layouts run as pieces merged by log-sum-exp; the pieces were merged in float32 even
    for float64 inputs (1.9e-7 off the unfactorised kernel, gradcheck failed; a review's finding)."""
    from gqakit.attention import patterns

    spec = patterns.strided(3) if pattern == "strided" else patterns.fixed(4, 2)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def attend(q, k, v, factorised=True):
        return tiled_attention(q, k, v, scale=0.5, spec=spec, block_q=4, block_k=4, factorised=factorised)

    torch.testing.assert_close(attend(q, k, v), attend(q, k, v, factorised=False), atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(attend, (q, k, v))
