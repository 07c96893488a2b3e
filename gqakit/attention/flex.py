"""FlexAttention from the same `MaskSpec`s, and the choice between sdpa, flex and the tiled kernel.

On a GPU the tiled kernel's Python loop over blocks is the wrong thing to run. This module lowers a
`MaskSpec` (and key padding, a model's own mask function, a caller's dense mask) to a mask_mod on
ABSOLUTE positions for `torch.nn.attention.flex_attention`:

    mask_mod(b, h, i, j) = spec.mask_function()(b, h, q_offset + i, kv_offset + j)
                           & key_padding[b, j] & extra_mask(b, h, q_offset + i, kv_offset + j) & dense[b, h, i, j]

`create_block_mask` evaluates it to find, per query block, the key blocks to visit and which of them
are full (no mask evaluated there). Only the spec's public calls are used, so a new pattern that
implements `mask_function()` (per-head ones included: `h` is the query head) works unchanged.

Extras, all exact:
- `softcap` c is a score_mod, c * tanh(score / c) (flex applies `scale` first, as the tiled kernel);
- sink logits `s_aux` (H,) (gpt-oss: a key with logit s_aux[h] and value 0 in every softmax) are
  folded in after the kernel from its log-sum-exp:
      out * exp(lse) / (exp(lse) + exp(s_aux)) = out * sigmoid(lse - s_aux),  lse' = logaddexp(lse, s_aux)
  (the sigmoid form is the same number without overflow; it is differentiable in s_aux and lse);
- GQA natively (`enable_gqa`): K/V keep their G heads.

What runs where (torch 2.13; checked on CPU only, no GPU was lent to the session that wrote this):
- CPU: compiled flex runs the FORWARD only and cannot return the lse ("torch.compile on CPU only supports
  inference and return_lse is not supported yet"); eager flex returns the lse but materialises the
  scores; neither has a backward ("FlexAttention does not support backward on CPU"). So on CPU this
  module is a forward-only check of the lowering; training stays on `tiled_attention`. CPU compiles use
  static shapes: with dynamic ones the C++ flex template fails to build (see `_compiled`).
- CUDA (the device check's runs: docs/results/gpu.md): compiled flex (Triton), forward and backward; torch's flex
  backward takes the lse's gradient too, so s_aux trains through `fold_sink`.

`choose_backend` / `attention_forward` route a call: plain causal or bidirectional attention with
nothing else -> `scaled_dot_product_attention` (FlashAttention on CUDA); any other pattern on CUDA ->
flex; everything on CPU (and elsewhere) -> the tiled kernel, the tested training path and reference.
"""
from __future__ import annotations

import collections
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from gqakit.attention.masks import MaskSpec, dense_allowed
from gqakit.attention.patterns import head_mask_function
from gqakit.attention.tiled import check_attn_mask, check_inputs, tiled_attention

Backend = Literal["sdpa", "flex", "tiled"]
Spec = MaskSpec | Sequence[MaskSpec]  # one pattern for all heads, or one per query head (as tiled_attention)

# ---- routing --------------------------------------------------------------------------------------


def is_plain(spec) -> bool:
    """True for plain causal or plain bidirectional attention: no window, sinks, globals or new pattern."""
    return spec == MaskSpec(causal=True) or spec == MaskSpec(causal=False)


def flex_supported(device) -> bool:
    """Whether compiled flex_attention (forward and backward) is available on `device`: CUDA with Triton."""
    device = torch.device(device)
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def choose_backend(device, spec, has_extras: bool) -> Backend:
    """'sdpa' for plain causal / bidirectional attention with no extras on CUDA, 'flex' for anything else on
    CUDA, 'tiled' elsewhere (the CPU training path: flex has no CPU backward).

    `has_extras`: softcap, s_aux, key padding, a model mask function or a dense mask comes with the call.
    `attention_forward` also falls back from 'sdpa' to 'flex' when the query/key offsets are not a
    causal alignment that sdpa can express (see `sdpa_causal_mode`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "tiled"
    if is_plain(spec) and not has_extras:
        return "sdpa"
    return "flex" if flex_supported(device) else "tiled"


def sdpa_causal_mode(spec, Tq: int, Tk: int, q_offset: int, kv_offset: int) -> str | None:
    """How sdpa expresses a plain spec at these offsets: 'none' (every query sees every key), 'upper_left'
    (is_causal=True: query i sees keys j <= i), 'lower_right' (torch's causal_lower_right bias, decode with
    a chunk of queries at the end), or None when it cannot (then use flex or the tiled kernel)."""
    if not is_plain(spec):
        return None
    if not spec.causal or q_offset >= kv_offset + Tk - 1:
        return "none"
    if q_offset == kv_offset:
        return "upper_left"
    if q_offset + Tq == kv_offset + Tk and Tq <= Tk:
        return "lower_right"
    return None


def sdpa_attention(q, k, v, *, scale: float, mode: str):
    """torch sdpa for a plain spec, `mode` from `sdpa_causal_mode`; K/V are not repeated (enable_gqa)."""
    gqa = q.shape[1] != k.shape[1]
    if mode == "lower_right":
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=mode == "upper_left", scale=scale, enable_gqa=gqa)


def attention_forward(q, k, v, *, scale: float, spec: Spec = MaskSpec(), q_offset: int = 0,
                      kv_offset: int = 0, key_padding=None, extra_mask: Callable | None = None,
                      attn_mask=None, softcap: float | None = None, s_aux=None, block_q: int = 128,
                      block_k: int = 128, backend: Backend | None = None, row_shift=None):
    """The registry's one call: `tiled_attention`'s arguments and result (B, H, Tq, dv), on the backend
    that `choose_backend` picks for q's device (or `backend` when given). `block_q` / `block_k` are the
    tiled kernel's; flex uses its own 128-blocks, which its CUDA kernels are tuned for."""
    extras = (key_padding, extra_mask, attn_mask, softcap, s_aux, row_shift)
    backend = backend or choose_backend(q.device, spec, any(x is not None for x in extras))
    if backend == "sdpa":
        mode = sdpa_causal_mode(spec, q.shape[2], k.shape[2], q_offset, kv_offset)
        if mode is not None and all(x is None for x in extras):
            return sdpa_attention(q, k, v, scale=scale, mode=mode)
        backend = "flex" if flex_supported(q.device) else "tiled"
    if backend == "flex":
        return flex_attention_forward(q, k, v, scale=scale, spec=spec, q_offset=q_offset, kv_offset=kv_offset,
                                      key_padding=key_padding, extra_mask=extra_mask, attn_mask=attn_mask,
                                      softcap=softcap, s_aux=s_aux, row_shift=row_shift)
    if backend != "tiled":
        raise ValueError(f"unknown attention backend '{backend}'; choose 'sdpa', 'flex' or 'tiled'")
    return tiled_attention(q, k, v, scale=scale, spec=spec, q_offset=q_offset, kv_offset=kv_offset,
                           key_padding=key_padding, extra_mask=extra_mask, attn_mask=attn_mask, softcap=softcap,
                           s_aux=s_aux, block_q=block_q, block_k=block_k, row_shift=row_shift)


# ---- the mask -------------------------------------------------------------------------------------


def _mask_function(spec) -> Callable:
    """The spec's transformers-style mask function; for a per-head family (a sequence of H MaskSpecs, head h
    -> spec[h], as `tiled_attention` takes it) one that selects each head's rule with comparisons only."""
    if hasattr(spec, "mask_function"):
        return spec.mask_function()
    return head_mask_function(spec)


def _broadcast_index(t: torch.Tensor, dim: int, idx):
    """Index a broadcastable dim: the index itself where the tensor has the full size, 0 where it has 1."""
    return idx if t.shape[dim] > 1 else 0


def spec_mask_mod(spec, q_offset: int = 0, kv_offset: int = 0, key_padding: torch.Tensor | None = None,
                  extra_mask: Callable | None = None, allowed: torch.Tensor | None = None,
                  device=None, row_shift: torch.Tensor | None = None) -> Callable:
    """A flex mask_mod `(b, h, q_idx, kv_idx) -> bool` on LOCAL indices for a spec on absolute positions
    (a MaskSpec, anything with `mask_function()`, or a per-head sequence of H MaskSpecs).

    `key_padding` (B, Tk) bool marks real keys; `extra_mask` is a transformers-style mask function on
    absolute positions; `allowed` a dense bool mask (B|1, H|1, Tq, Tk) on local indices; `row_shift` (B,) moves
    row b's positions for the spec alone (`tiled_attention`'s). The offsets are captured as 0-d tensors, so that
    where shapes are dynamic (CUDA) decoding step after step need not recompile; CPU compiles use static shapes and
    do (see `_compiled`)."""
    fn = _mask_function(spec)
    qo = torch.tensor(int(q_offset), dtype=torch.int32, device=device)
    ko = torch.tensor(int(kv_offset), dtype=torch.int32, device=device)
    shift = None if row_shift is None else row_shift.to(device=device, dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        qa, ka = q_idx + qo, kv_idx + ko
        ok = fn(b, h, qa, ka) if shift is None else fn(b, h, qa - shift[b], ka - shift[b])
        if key_padding is not None:
            ok = ok & key_padding[b, kv_idx]
        if extra_mask is not None:
            ok = ok & extra_mask(b, h, qa, ka)
        if allowed is not None:
            ok = ok & allowed[_broadcast_index(allowed, 0, b), _broadcast_index(allowed, 1, h), q_idx, kv_idx]
        return ok

    return mask_mod


def _mask_extent(mask_mod: Callable, B: int, H: int, device) -> tuple[int | None, int | None]:
    """(B or None, H or None): whether the mask varies over batch rows / heads, read from the broadcast
    shape of one evaluation (a function that never touches `b` or `h` cannot produce those dims). None
    lets create_block_mask build one mask shared by all rows or heads (B or H times less work)."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    try:
        shape = torch.broadcast_shapes(torch.as_tensor(mask_mod(b, h, zero, zero)).shape, (1, 1, 1, 1))
    except Exception:  # not broadcast-friendly: assume it depends on both
        return B, H
    return (B if shape[0] > 1 else None), (H if shape[1] > 1 else None)


_COMPILED: dict[tuple[str, str], Callable] = {}
# Compiled variants one wrapper may hold: dynamo guards on each pattern's numbers (a window of 8 and of 12 are two),
# on padding or none, batch, prefill or decode. Past torch's default of 8 it ran the next ones as eager flex,
# silently: the whole score matrix in memory (about 128 GiB at 32k tokens of a 1B shape), a review measured 9
# variants in one short Gemma 2 session. Raised process-wide, never lowered.
RECOMPILE_LIMIT = 256


def _compiled(fn: Callable, device: torch.device) -> Callable:
    """One torch.compile wrapper per function and device type for the process. Static shapes on CPU: with
    dynamic shapes (which torch turns on after a recompile whose BlockMask sizes differ) its C++ flex
    template fails to compile ("cur_kvSplitSize3 was not declared", torch 2.13)."""
    key = (fn.__name__, device.type)
    if key not in _COMPILED:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _COMPILED[key] = torch.compile(fn, dynamic=False if device.type == "cpu" else None)
    return _COMPILED[key]


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 8  # a few forwards' worth; each entry keeps its key padding / mask function alive


def _cache_key(*parts, tensors=()):
    """Key on values and on the identity + in-place version of tensors/callables (the entry keeps them
    alive, so an id cannot be reused while it is cached)."""
    return parts + tuple((id(t), getattr(t, "_version", None)) if t is not None else None for t in tensors)


def block_mask_for(spec, B: int, H: int, Tq: int, Tk: int, q_offset: int = 0, kv_offset: int = 0,
                   key_padding: torch.Tensor | None = None, block_size: int | tuple[int, int] = 128,
                   device=None, *, extra_mask: Callable | None = None, attn_mask: torch.Tensor | None = None,
                   compile: bool | None = None, cache: bool = True, row_shift: torch.Tensor | None = None
                   ) -> BlockMask:
    """The flex `BlockMask` of `spec` for queries at absolute positions q_offset .. q_offset + Tq - 1 and
    keys at kv_offset .. kv_offset + Tk - 1, with key padding (B, Tk) per batch row (True = real key).

    `block_size` is (query block, key block) or one int for both; `extra_mask` a transformers-style mask
    function on absolute positions; `attn_mask` a dense bool or additive float mask (B|1, H|1, Tq, Tk)
    (masking entries as in `masks.dense_allowed`; a float mask's bias is applied by `flex_attention_forward`);
    `row_shift` (B,) as in `tiled_attention`.
    The mask is built for B / H only where it varies over them. `compile` (default: on CUDA) compiles
    create_block_mask, which otherwise evaluates the mask densely (B x H x Tq x Tk booleans). The last few
    masks are cached, so the layers of one forward share one BlockMask.
    """
    device = torch.device(device) if device is not None else (
        key_padding.device if key_padding is not None else torch.device("cpu"))
    if key_padding is not None:
        if tuple(key_padding.shape) != (B, Tk):
            raise ValueError(f"key_padding has shape {tuple(key_padding.shape)}; expected (batch, kv_length) "
                             f"= ({B}, {Tk}) with True for real tokens")
        key_padding = key_padding.to(device=device, dtype=torch.bool)
    allowed = None
    if attn_mask is not None:
        allowed = dense_allowed(_check_dense(attn_mask, B, H, Tq, Tk)).to(device)
    blocks = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    compile = device.type == "cuda" if compile is None else compile
    key = None
    if cache and attn_mask is None:
        try:
            key = _cache_key(spec, B, H, Tq, Tk, int(q_offset), int(kv_offset), blocks, str(device), compile,
                             tensors=(key_padding, extra_mask, row_shift))
            hash(key)
        except TypeError:  # an unhashable spec: no caching
            key = None
        if key is not None and key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key][0]
    mask_mod = spec_mask_mod(spec, q_offset, kv_offset, key_padding, extra_mask, allowed, device, row_shift)
    mb, mh = _mask_extent(mask_mod, B, H, device)
    make = _compiled(create_block_mask, device) if compile else create_block_mask
    block_mask = make(mask_mod, mb, mh, Tq, Tk, device=device, BLOCK_SIZE=blocks)
    if key is not None:
        _CACHE[key] = (block_mask, key_padding, extra_mask, row_shift)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return block_mask


def _check_dense(attn_mask: torch.Tensor, B: int, H: int, Tq: int, Tk: int) -> torch.Tensor:
    check_attn_mask(attn_mask, B, H, Tq, Tk)  # the tiled kernel's rule
    return attn_mask.expand(*attn_mask.shape[:2], Tq, Tk)  # a view, no copy


# ---- the kernel call ------------------------------------------------------------------------------


def _score_mod(softcap: float | None, bias: torch.Tensor | None) -> Callable | None:
    """score -> softcap * tanh(score / softcap) (+ a dense additive bias), as the tiled kernel orders them."""
    if softcap is None and bias is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[_broadcast_index(bias, 0, b), _broadcast_index(bias, 1, h), q_idx, kv_idx]
        return score

    return score_mod


def flex_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                           spec: Spec = MaskSpec(), q_offset: int = 0, kv_offset: int = 0,
                           key_padding: torch.Tensor | None = None, softcap: float | None = None,
                           s_aux: torch.Tensor | None = None, enable_gqa: bool = True,
                           extra_mask: Callable | None = None, attn_mask: torch.Tensor | None = None,
                           block_mask: BlockMask | None = None, block_size: int | tuple[int, int] = 128,
                           return_lse: bool = False, compiled: bool | None = None, row_shift=None):
    """`tiled_attention`'s contract on flex_attention: q (B, H, Tq, d), k (B, G, Tk, d), v (B, G, Tk, dv)
    -> out (B, H, Tq, dv) in q's dtype (and with `return_lse` the fp32 log-sum-exp (B, H, Tq), sink
    included). Fully masked rows give 0 and lse -inf (with a sink: 0 and lse = s_aux).

    `block_mask` reuses a BlockMask from `block_mask_for` (else one is built, or taken from the cache).
    `enable_gqa=False` repeats K/V to H heads first (for kernels without GQA). `compiled`: None runs
    torch.compile(flex_attention) on CUDA and eager flex on CPU. On CPU, `compiled=True` runs only where
    `cpu_compiled_problem()` found compiled flex right on this processor (compiled CPU flex has given wrong
    results on some processors, torch 2.13); else, and where the lse is needed (s_aux or return_lse: compiled
    CPU flex cannot return it), it is refused with one line. Flex has no backward on CPU: a call there that
    needs gradients is refused with one line. `row_shift` (B,) as in `tiled_attention`."""
    blocks = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    check_inputs(q, k, v, key_padding, attn_mask, softcap, s_aux, *blocks, row_shift=row_shift)  # the tiled kernel's
    H = q.shape[1]
    if not hasattr(spec, "mask_function") and len(spec) != H:
        raise ValueError(f"a per-head pattern needs one MaskSpec per query head: got {len(spec)} for {H} heads")
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, s_aux))
    if grads and q.device.type == "cpu":
        raise ValueError(f"flex_attention has no backward on CPU (torch {torch.__version__}); train on CPU with "
                         "tiled_attention (attention_forward routes CPU there), or call this under torch.no_grad()")
    need_lse = return_lse or s_aux is not None
    if compiled is None:
        compiled = q.device.type != "cpu"
    elif compiled and need_lse and q.device.type == "cpu":
        raise ValueError("compiled flex_attention on CPU cannot return the log-sum-exp that s_aux / return_lse "
                         "need (torch 2.13); pass compiled=None to run eager flex for this call")
    elif compiled and q.device.type == "cpu":
        problem = cpu_compiled_problem()
        if problem is not None:
            raise ValueError(f"compiled flex_attention gives wrong results on this CPU ({problem}); pass "
                             "compiled=None (eager flex) or use tiled_attention")
    return _flex(q, k, v, scale, spec, q_offset, kv_offset, key_padding, softcap, s_aux, enable_gqa, extra_mask,
                 attn_mask, block_mask, block_size, return_lse, bool(compiled), row_shift)


def _flex(q, k, v, scale, spec, q_offset, kv_offset, key_padding, softcap, s_aux, enable_gqa, extra_mask, attn_mask,
          block_mask, block_size, return_lse, compiled: bool, row_shift=None):
    """`flex_attention_forward` once its inputs are checked and the kernel chosen."""
    B, H, Tq, _ = q.shape
    G, Tk = k.shape[1], k.shape[2]
    need_lse = return_lse or s_aux is not None
    bias = None
    if attn_mask is not None:
        attn_mask = _check_dense(attn_mask.to(q.device), B, H, Tq, Tk)
        if attn_mask.dtype != torch.bool:  # masked entries are dropped by the mask_mod; the rest is a bias,
            # kept in its own dtype (exact; a bf16 bias tile takes half an fp32 one's shared memory on the GPU)
            bias = torch.where(dense_allowed(attn_mask), attn_mask, 0)
    if block_mask is None:
        block_mask = block_mask_for(spec, B, H, Tq, Tk, q_offset, kv_offset, key_padding, block_size, q.device,
                                    extra_mask=extra_mask, attn_mask=attn_mask, row_shift=row_shift)
    if not enable_gqa and G != H:
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, Tk, d|dv)
    kernel = _compiled(flex_attention, q.device) if compiled else flex_attention
    out = run_with_small_tiles_on_failure(
        kernel, q.device.type, q, k, v, score_mod=_score_mod(None if softcap is None else float(softcap), bias),
        block_mask=block_mask, scale=float(scale), enable_gqa=k.shape[1] != H,
        return_aux=AuxRequest(lse=True) if need_lse else None)
    if not need_lse:
        return out
    out, lse = out[0], out[1].lse.float()  # lse (B, H, Tq), natural log
    if s_aux is not None:
        out, lse = fold_sink(out, lse, s_aux)
    return (out, lse) if return_lse else out


# Tiles for a second compile when the default ones need more shared memory than the GPU has: seen on an H200
# (torch 2.11) for bf16 inputs with a dense additive bias in the score_mod ("out of resource: ... Required: 278528
# Hardware limit: 232448"). One stage of 64 x 64 tiles holds under a quarter of the default's tiles.
SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}


def out_of_resource(error: BaseException) -> bool:
    """Whether `error` is Triton's refusal of a kernel configuration for its shared memory or registers."""
    text = f"{type(error).__name__}: {error}"
    return "out of resource" in text or "No valid triton configs" in text or "OutOfResources" in text


def run_with_small_tiles_on_failure(kernel: Callable, device_type: str, *args, **kwargs):
    """kernel(*args, **kwargs); on CUDA, when compiling its default tiles fails for lack of shared memory, once
    more with SMALL_TILES (one warning line). Any other error, and every error on CPU, is raised as it is."""
    try:
        return kernel(*args, **kwargs)
    except Exception as error:  # noqa: BLE001  re-raised unless it is the one failure handled here
        if device_type != "cuda" or not out_of_resource(error):
            raise
    warnings.warn(f"flex_attention: the default tiles need more GPU shared memory than this card has; compiled "
                  f"again with {SMALL_TILES} (slower, same result)", stacklevel=3)
    return kernel(*args, kernel_options=dict(SMALL_TILES), **kwargs)


_CPU_CHECK: list = []  # [None] or [what went wrong], once per process


def cpu_compiled_problem() -> str | None:
    """None where compiled flex_attention on this CPU gives the tiled kernel's results, else what differs.

    Checked once per process, on small inputs with the mask features whose compiled CPU lowering has given wrong
    results on some processors (reported in issue 22 on an AMD EPYC, torch 2.13, while eager flex was
    right): a window with sinks, key padding and a decode offset under GQA; a symmetric dilated window with global
    tokens and softcap; one pattern per head."""
    if not _CPU_CHECK:
        _CPU_CHECK.append(_check_cpu_compiled())
    return _CPU_CHECK[0]


def _check_cpu_compiled() -> str | None:
    gen = torch.Generator().manual_seed(0)
    H, d = 4, 8
    cases = (  # (spec, G, Tq, Tk, q_offset, extra)
        (MaskSpec(window=5, sinks=2), 2, 6, 43, 37, {}),
        (MaskSpec(causal=False, window=5, dilation=2, global_tokens=(1, 40)), 1, 45, 45, 0, {"softcap": 2.0}),
        ((MaskSpec(window=3), MaskSpec(), MaskSpec(window=5, sinks=1), MaskSpec(dilation=2)), 2, 37, 37, 0, {}),
    )
    worst = 0.0
    for spec, G, Tq, Tk, q_offset, extra in cases:
        q = torch.randn(3, H, Tq, d, generator=gen)
        k, v = torch.randn(3, G, Tk, d, generator=gen), torch.randn(3, G, Tk, d, generator=gen)
        padding = torch.ones(3, Tk, dtype=torch.bool)
        padding[1:, : Tk // 3] = False
        softcap = extra.get("softcap")
        want = tiled_attention(q, k, v, scale=0.3, spec=spec, q_offset=q_offset, key_padding=padding, softcap=softcap,
                               block_q=8, block_k=8)
        try:
            with torch.no_grad():
                got = _flex(q, k, v, 0.3, spec, q_offset, 0, padding, softcap, None, True, None, None, None, 8, False,
                            compiled=True)
        except Exception as e:  # a lowering that does not build here is as unusable as a wrong one
            return f"it does not compile: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        worst = max(worst, float((got - want).abs().max()))
    return None if worst <= 1e-4 else f"up to {worst:.3g} off the tiled kernel in a self-check"


def fold_sink(out: torch.Tensor, lse: torch.Tensor, s_aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add per-head sink logits s_aux (H,) to a finished softmax: out (B, H, Tq, dv), lse (B, H, Tq) ->
    out * exp(lse) / (exp(lse) + exp(s_aux)) and logaddexp(lse, s_aux), exactly (written as a sigmoid so that
    nothing overflows); a row that saw no key (out 0, lse -inf) gives 0 and s_aux. Differentiable in all three."""
    work = torch.promote_types(torch.promote_types(out.dtype, lse.dtype), torch.float32)  # fp32, or fp64
    lse = lse.to(work)
    sink = s_aux.to(work).view(1, -1, 1)  # (1, H, 1)
    scaled = (out.to(work) * torch.sigmoid(lse - sink)[..., None]).to(out.dtype)
    return scaled, torch.logaddexp(lse, sink.expand_as(lse))
