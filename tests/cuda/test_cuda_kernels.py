"""Every attention pattern gqakit has, on each backend of its registry (`attention_forward`: 'sdpa', which runs
torch sdpa where a plain pattern allows and falls back to flex / tiled otherwise, 'flex', compiled on CUDA, and
'tiled'), forward and backward, in bf16 and fp32, against `eager_reference` in float64 on the same (rounded) inputs.

Tolerance (FlashAttention's test rule): the kernel's largest error against the fp64 reference is at most twice the
largest error of a plain PyTorch implementation in the same dtype (`plain`: scores, softmax and the weighted sum
all in that dtype, as eager attention without upcasting does), plus ATOL[dtype] x (1 + the reference's largest
entry): fp32 1e-5, bf16 1e-3. The same rule holds for dq, dk, dv (and ds_aux) under one random upstream gradient.

CPU cases run in the normal suite: 'tiled' forward and backward, 'flex' forward only (eager flex: no CPU backward),
'sdpa' through its CPU fallback. CUDA cases (`-m cuda`) run every backend forward and backward.
"""
from __future__ import annotations

import types

import pytest
import torch

from devices import DEVICES
from gqakit.attention import patterns
from gqakit.attention.flex import attention_forward
from gqakit.attention.hf_masks import TiledMask
from gqakit.attention.masks import MaskSpec
from gqakit.attention.reference import eager_reference, repeat_kv
from gqakit.attention.registration import _make_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}
H, G = 4, 2
# name -> (spec, extras): extras are softcap, s_aux, padding (left-padded rows, one with fully masked queries),
# decode (a chunk of queries at the end of a longer cache), attn_mask (a caller's additive 4-D mask), shift (the
# padded row's positions start at its first real token: `row_shift`, for patterns anchored at positions)
CASES = {
    "causal": (MaskSpec(), {}),
    "bidirectional": (MaskSpec(causal=False), {}),
    "sliding": (MaskSpec(window=37), {}),
    "dilated": (MaskSpec(window=61, dilation=3), {}),
    "globals": (MaskSpec(window=16, global_tokens=(0, 45)), {}),
    "sinks": (MaskSpec(window=24, sinks=4), {}),
    "longformer": (patterns.longformer(16, dilation=2, global_tokens=(0, 5)), {}),
    "strided": (patterns.strided(16), {}),
    "fixed": (patterns.fixed(16, 4), {}),
    "factorised": (patterns.factorised(patterns.strided(16, part="a1"), patterns.strided(16, part="a2"), H), {}),
    "softcap": (MaskSpec(), {"softcap": 2.0}),
    "s_aux": (MaskSpec(window=24), {"s_aux": True}),
    "padding": (MaskSpec(), {"padding": True}),
    "decode": (MaskSpec(window=24, sinks=2), {"decode": 5}),
    "decode-plain": (MaskSpec(), {"decode": 5}),
    "attn_mask": (MaskSpec(), {"attn_mask": True}),
    "left-padded-sinks": (MaskSpec(window=24, sinks=4), {"padding": True, "shift": True}),
    "left-padded-fixed": (patterns.fixed(16, 4), {"padding": True, "shift": True}),
}
BACKENDS = ("sdpa", "flex", "tiled")


def sizes(device: str) -> dict:
    """Ragged lengths over several blocks: 128-blocks on CUDA (flex's), 16-blocks for the tiled kernel on CPU."""
    return {"B": 2, "T": 300, "d": 64, "block": 128} if device == "cuda" else {"B": 2, "T": 70, "d": 16, "block": 16}


def inputs(case: str, device: str, dtype: torch.dtype) -> dict:
    spec, extras = CASES[case]
    s = sizes(device)
    B, Tk, d = s["B"], s["T"], s["d"]
    Tq = extras.get("decode", Tk)
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = {"q": make(B, H, Tq, d), "k": make(B, G, Tk, d), "v": make(B, G, Tk, d), "dout": make(B, H, Tq, d),
         "spec": spec, "q_offset": Tk - Tq, "scale": d ** -0.5, "softcap": extras.get("softcap"),
         "s_aux": make(H) if extras.get("s_aux") else None, "key_padding": None, "attn_mask": None,
         "row_shift": torch.tensor([0, Tk // 3], device=device) if extras.get("shift") else None}
    if extras.get("padding"):
        pad = torch.ones(B, Tk, dtype=torch.bool)
        pad[1, : Tk // 3] = False  # row 1 left-padded: its first Tk // 3 queries see no key at all
        x["key_padding"] = pad.to(device)
    if extras.get("attn_mask"):
        bias = 0.5 * torch.randn(B, 1, Tq, Tk, generator=g)
        bias[:, :, :, 7] = torch.finfo(torch.float32).min  # key 7 masked by the caller
        x["attn_mask"] = bias.to(device=device, dtype=dtype)
    return x


def allowed(x: dict) -> torch.Tensor:
    """The dense (B, H|1, Tq, Tk) pattern of a case, on its device."""
    q, k = x["q"], x["k"]
    q_pos = torch.arange(x["q_offset"], x["q_offset"] + q.shape[2], device=q.device)
    k_pos = torch.arange(k.shape[2], device=q.device)
    shifts = [0] if x["row_shift"] is None else x["row_shift"].tolist()  # one mask for all rows, or one per row
    mask = torch.stack([patterns.dense_mask(x["spec"], q_pos - t, k_pos - t) for t in shifts])  # (B|1, H|1, Tq, Tk)
    if x["key_padding"] is not None:
        mask = mask & x["key_padding"][:, None, None, :]
    if x["attn_mask"] is not None:
        mask = mask & (x["attn_mask"] > torch.finfo(torch.float32).min / 2)
    return mask


def plain(x: dict, q, k, v, s_aux) -> torch.Tensor:
    """Attention with every step in the inputs' dtype (no upcast): the error scale the kernels are held to."""
    mask = allowed(x)
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # (B, H, Tk, d)
    scores = q @ k.transpose(-1, -2) * x["scale"]  # (B, H, Tq, Tk)
    if x["softcap"] is not None:
        scores = x["softcap"] * torch.tanh(scores / x["softcap"])
    if x["attn_mask"] is not None:
        scores = scores + torch.where(mask, x["attn_mask"], 0)
    scores = scores.masked_fill(~mask, float("-inf"))
    if s_aux is not None:
        scores = torch.cat([scores, s_aux.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    live = torch.isfinite(scores).any(-1, keepdim=True)
    probs = torch.softmax(torch.where(live, scores, torch.zeros_like(scores)), dim=-1) * live
    if s_aux is not None:
        probs = probs[..., :-1]
    return probs @ v


def reference(x: dict, q, k, v, s_aux) -> torch.Tensor:
    mask = allowed(x)
    if x["attn_mask"] is not None:  # additive where allowed, masked elsewhere
        mask = torch.where(mask, x["attn_mask"].to(torch.float64), float("-inf"))
    return eager_reference(q, k, v, x["scale"], mask, softcap=x["softcap"], s_aux=s_aux)[0]


def kernel(x: dict, backend: str, q, k, v, s_aux) -> torch.Tensor:
    return attention_forward(q, k, v, scale=x["scale"], spec=x["spec"], q_offset=x["q_offset"],
                             key_padding=x["key_padding"], attn_mask=x["attn_mask"], softcap=x["softcap"],
                             s_aux=s_aux, block_q=sizes(q.device.type)["block"], block_k=sizes(q.device.type)["block"],
                             backend=backend, row_shift=x["row_shift"])


def run(fn, x: dict, dtype: torch.dtype, grads: bool) -> list[torch.Tensor]:
    """fn's output and, with `grads`, d(q, k, v[, s_aux]) under x's upstream gradient, from leaves of `dtype`."""
    leaves = [x[n].detach().to(dtype).requires_grad_(grads) for n in ("q", "k", "v")]
    s_aux = None if x["s_aux"] is None else x["s_aux"].detach().to(dtype).requires_grad_(grads)
    with torch.set_grad_enabled(grads):
        out = fn(x, *leaves, s_aux)
    if not grads:
        return [out.detach()]
    wrt = leaves + ([s_aux] if s_aux is not None else [])
    return [out.detach(), *torch.autograd.grad(out, wrt, x["dout"].to(out.dtype))]


def check_against_reference(x: dict, backend: str, dtype: torch.dtype, grads: bool) -> None:
    want = run(reference, x, torch.float64, grads)
    base = run(plain, x, dtype, grads)
    got = run(lambda *a: kernel(*a[:1], backend, *a[1:]), x, dtype, grads)
    for name, w, b, o in zip(("out", "dq", "dk", "dv", "ds_aux"), want, base, got):
        err = float((o.double() - w).abs().max())
        bound = 2 * float((b.double() - w).abs().max()) + ATOL[dtype] * (1 + float(w.abs().max()))
        assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g} (2x the plain {dtype} error + atol)"


def params():
    """bf16 first (each case's compile then serves both backends that reach flex), CUDA and CPU cases."""
    out = []
    for device in DEVICES:
        for dtype in (torch.bfloat16, torch.float32):
            for case in CASES:
                for backend in BACKENDS:
                    if device.values[0] == "cpu" and dtype == torch.bfloat16 and backend != "tiled":
                        continue  # CPU bf16: the tiled kernel only (flex and sdpa fall back to it there anyway)
                    out.append(pytest.param(device.values[0], dtype, case, backend, marks=device.marks,
                                            id=f"{device.id}-{str(dtype)[6:]}-{case}-{backend}"))
    return out


@pytest.mark.parametrize("device, dtype, case, backend", params())
def test_kernel_matches_the_fp64_reference(device, dtype, case, backend):
    x = inputs(case, device, dtype)
    grads = not (device == "cpu" and backend == "flex")  # flex has no backward on CPU
    check_against_reference(x, backend, dtype, grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_packed_documents_through_the_registered_function(device, dtype):
    """cu_seq_lens packing as transformers passes it to `gqakit_tiled`: a query sees keys of its own document only;
    on CUDA the registered function routes to flex, on CPU to the tiled kernel."""
    T = sizes(device)["T"]
    cu = torch.tensor([0, T // 3, T // 3 + 5, T], device=device, dtype=torch.int32)
    doc = torch.bucketize(torch.arange(T, device=device), cu[1:].long(), right=True)
    g = torch.Generator().manual_seed(1)
    d = sizes(device)["d"]
    q, k, v, dout = (torch.randn(1, n, T, d, generator=g).to(device=device, dtype=dtype) for n in (H, G, G, H))
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace(), training=False, layer_idx=0)
    attention = _make_attention("tiled")
    mask = TiledMask(0, 0, None, None, True)
    same = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool, device=device).tril()

    def fn(x, q, k, v, s_aux):
        return attention(module, q, k, v, mask, scaling=d ** -0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0]\
            .transpose(1, 2)

    x = {"q": q, "k": k, "v": v, "dout": dout, "s_aux": None, "scale": d ** -0.5, "softcap": None,
         "attn_mask": None, "key_padding": None, "q_offset": 0, "spec": MaskSpec(), "row_shift": None}
    want = run(lambda x, q, k, v, s: eager_reference(q, k, v, x["scale"], same[None, None])[0], x, torch.float64, True)
    got = run(fn, x, dtype, True)
    for name, w, o in zip(("out", "dq", "dk", "dv"), want, got):
        err = float((o.double() - w).abs().max())
        assert err <= {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype] * (1 + float(w.abs().max())), (name, err)
