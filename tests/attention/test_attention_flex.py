"""flex_attention lowered from MaskSpecs (gqakit/attention/flex.py) against the tiled kernel, on CPU.

What runs here (torch 2.13 CPU build): flex FORWARD only. Eager flex (`compiled=False`, which also returns
the lse) for the whole matrix, and torch.compile'd flex (which uses the BlockMask's block lists) for three
cases: each new compile costs 5-25 s on CPU. Flex has no CPU backward and compiled CPU flex returns no lse,
so gradients through flex and the compiled lse / s_aux path need CUDA and are not exercised here (the s_aux
fold's own gradient is checked around the reference). Everything is fp32 and compared within 1e-5.

Adding a pattern: put it in SPECS below (or in tests/attention/test_attention_masks.py's SPECS, which is merged
in); a per-head family (one MaskSpec per query head) goes in PER_HEAD. Every test picks them up.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gqakit.attention import flex as fx
from gqakit.attention.masks import MaskSpec
from gqakit.attention.tiled import tiled_attention

try:  # the mask tests' list of patterns, so that a pattern added there is checked here too
    from test_attention_masks import SPECS as MASK_TEST_SPECS
except ImportError:  # renamed: the patterns below still run
    MASK_TEST_SPECS = []

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ATOL = 1e-5
H, D, BLOCK = 4, 8, 8

# ---- the parametrisation hook: every MaskSpec kind, then whatever test_attention_masks lists --------
KINDS = [
    MaskSpec(),  # causal
    MaskSpec(causal=False),
    MaskSpec(window=5),  # sliding window
    MaskSpec(window=9, dilation=2),  # dilated window
    MaskSpec(dilation=3),
    MaskSpec(global_tokens=(0, 17)),
    MaskSpec(window=4, sinks=3),  # StreamingLLM
    MaskSpec(causal=False, window=4),  # symmetric window (encoders)
    MaskSpec(causal=False, window=5, dilation=2, sinks=2, global_tokens=(1, 40)),
]
SPECS = list(dict.fromkeys(KINDS + list(MASK_TEST_SPECS)))
PER_HEAD = [
    (MaskSpec(window=5),) * 2 + (MaskSpec(dilation=3),) * 2,  # a factorised head split, H = 4
    (MaskSpec(), MaskSpec(window=3, sinks=1), MaskSpec(window=3, sinks=1), MaskSpec(global_tokens=(5,))),
]


def spec_id(spec) -> str:
    if not isinstance(spec, MaskSpec):
        return "heads[" + ",".join(spec_id(s) for s in spec) + "]"
    default = MaskSpec()
    fields = [f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec)
              if f.name != "parts" and getattr(spec, f.name) != getattr(default, f.name)]
    fields += [f"|{spec_id(p)}" for p in getattr(spec, "parts", ())]
    return "MaskSpec(" + ",".join(fields) + ")"


# (name, G, Tq, Tk, q_offset, kv_offset): ragged lengths (not multiples of BLOCK), MHA / GQA / MQA, decoding.
CASES = [
    ("prefill-G=H", H, 37, 37, 0, 0),
    ("decode-chunk-G=2", 2, 6, 43, 37, 0),
    ("decode-1-G=1", 1, 1, 30, 29, 0),
    ("kv-offset-G=1", 1, 13, 29, 40, 20),
]


def inputs(G, Tq, Tk, B=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=gen)
    k = torch.randn(B, G, Tk, D, generator=gen)
    v = torch.randn(B, G, Tk, D, generator=gen)
    pad = torch.ones(B, Tk, dtype=torch.bool)  # row 0 real, row 1 left-padded, row 2 mostly padding
    pad[1:, : Tk // 3] = False
    pad[2:, : Tk - 2] = False
    return q, k, v, pad


def close(got, want):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def per_head_supported() -> bool:
    try:
        q, k, v, _ = inputs(2, 3, 3, B=1)
        tiled_attention(q, k, v, scale=0.3, spec=PER_HEAD[0])
        return True
    except (AttributeError, TypeError, ValueError):
        return False


# ---- forward: flex == tiled ----------------------------------------------------------------------

@pytest.fixture
def eager_flex_without_dynamo(monkeypatch):
    """Eager flex traces its kernel with dynamo on every new mask_mod (~0.4 s a call here); torch's debug
    switch runs the same math implementation directly, which keeps the big matrix below fast."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("spec", SPECS + PER_HEAD, ids=spec_id)
def test_flex_forward_equals_tiled(spec, case, eager_flex_without_dynamo):
    if not isinstance(spec, MaskSpec) and not per_head_supported():
        pytest.skip("tiled_attention in this tree takes no per-head spec")
    _, G, Tq, Tk, qo, ko = case
    q, k, v, pad = inputs(G, Tq, Tk)
    kw = dict(scale=0.3, spec=spec, q_offset=qo, kv_offset=ko, key_padding=pad)
    want = tiled_attention(q, k, v, block_q=BLOCK, block_k=BLOCK, **kw)
    got = fx.flex_attention_forward(q, k, v, block_size=BLOCK, compiled=False, **kw)
    assert got.shape == want.shape == (3, H, Tq, D)
    close(got, want)


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec(window=4, sinks=3), MaskSpec(causal=False, window=4)],
                         ids=spec_id)
@pytest.mark.parametrize("extras", ["softcap", "s_aux", "both"])
def test_softcap_and_sink_logits_equal_tiled(spec, extras):
    q, k, v, pad = inputs(2, 6, 43)
    q = q * 4  # large logits, so that the cap matters
    s_aux = torch.tensor([0.5, -1.0, 2.0, 8.0])  # 8.0 dominates its head's softmax
    kw = dict(scale=0.3, spec=spec, q_offset=37, key_padding=pad, return_lse=True,
              softcap=2.5 if extras in ("softcap", "both") else None, s_aux=s_aux if extras != "softcap" else None)
    want, want_lse = tiled_attention(q, k, v, block_q=BLOCK, block_k=BLOCK, **kw)
    got, got_lse = fx.flex_attention_forward(q, k, v, block_size=BLOCK, compiled=False, **kw)
    close(got, want)
    close(got_lse, want_lse)  # -inf where a row sees no key and has no sink; = s_aux where it sees only the sink


def test_dense_masks_and_model_mask_functions_equal_tiled():
    q, k, v, pad = inputs(2, 11, 11)
    gen = torch.Generator().manual_seed(1)
    per_head_bool = torch.rand(3, H, 11, 11, generator=gen) > 0.3
    additive = torch.where(torch.rand(1, 1, 11, 11, generator=gen) > 0.2, torch.randn(1, 1, 11, 11, generator=gen),
                           torch.finfo(torch.float32).min)
    doc = torch.tensor([0] * 4 + [1] * 7)

    def same_document(b, h, q_idx, kv_idx):  # as registry._document_mask builds for cu_seq_lens packing
        return doc[q_idx] == doc[kv_idx]

    for kw in (dict(attn_mask=per_head_bool), dict(attn_mask=additive, softcap=3.0), dict(extra_mask=same_document)):
        kw = dict(scale=0.3, spec=MaskSpec(causal=False, window=6), key_padding=pad, **kw)
        want = tiled_attention(q, k, v, block_q=4, block_k=4, **kw)
        close(fx.flex_attention_forward(q, k, v, block_size=4, compiled=False, **kw), want)


# ---- the BlockMask visits exactly the tiled plan's blocks ------------------------------------------

def flex_blocks(bm, b=0, h=0):
    """{query block: (visited key blocks, full key blocks)} of one batch row and head of a BlockMask."""
    n, idx, fn, fidx = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices
    out = {}
    for i in range(n.shape[-1]):
        partial = set(idx[b, h, i, : n[b, h, i]].tolist())
        full = set(fidx[b, h, i, : fn[b, h, i]].tolist()) if fn is not None else set()
        assert not partial & full
        out[i] = (partial | full, full)
    return out


def plan_blocks(spec, Tq, Tk, qo, ko, bq, bk):
    """The same from the spec's analytic plan: kv_block_ranges and block_is_full, as tiled.py uses them."""
    out = {}
    for i, q0 in enumerate(range(0, Tq, bq)):
        q1 = min(q0 + bq, Tq)
        ranges = spec.kv_block_ranges(q0 + qo, q1 + qo, ko, ko + Tk, bk)
        out[i] = ({(a - ko) // bk for a, _ in ranges},
                  {(a - ko) // bk for a, e in ranges if spec.block_is_full(q0 + qo, q1 + qo, a, e)})
    return out


def assert_same_plan(flex, plan, Tq, Tk, bq, bk, exact_full: bool):
    assert flex.keys() == plan.keys()
    for i in plan:
        assert flex[i][0] == plan[i][0], f"query block {i}: flex visits {sorted(flex[i][0])}, plan {sorted(plan[i][0])}"
        # flex counts a block cut by the sequence end as partial; the plan may call it full: compare inside
        inner = {j for j in plan[i][1] if (i + 1) * bq <= Tq and (j + 1) * bk <= Tk}
        assert inner <= flex[i][1], f"query block {i}: the plan calls {sorted(inner - flex[i][1])} full, flex does not"
        if exact_full:
            assert inner == flex[i][1], f"query block {i}: full blocks flex {sorted(flex[i][1])}, plan {sorted(inner)}"


GEOMETRIES = [(37, 37, 0, 0, 8, 8), (6, 43, 37, 0, 4, 8), (13, 29, 40, 20, 4, 4), (45, 45, 0, 0, 16, 4)]


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_block_mask_visits_exactly_the_tiled_plan(spec):
    for Tq, Tk, qo, ko, bq, bk in GEOMETRIES:
        bm = fx.block_mask_for(spec, 2, H, Tq, Tk, qo, ko, None, (bq, bk), "cpu", cache=False)
        assert tuple(bm.kv_num_blocks.shape[:2]) == (1, 1)  # one mask shared by rows and heads
        # block_is_full is exact for a single pattern; a union counts as full only where one piece is
        assert_same_plan(flex_blocks(bm), plan_blocks(spec, Tq, Tk, qo, ko, bq, bk), Tq, Tk, bq, bk,
                         exact_full=not getattr(spec, "parts", ()))


@pytest.mark.parametrize("spec", PER_HEAD, ids=spec_id)
def test_per_head_block_mask_follows_each_heads_plan(spec):
    Tq, Tk, qo, ko, bq, bk = GEOMETRIES[0]
    bm = fx.block_mask_for(spec, 2, H, Tq, Tk, qo, ko, None, (bq, bk), "cpu", cache=False)
    assert tuple(bm.kv_num_blocks.shape[:2]) == (1, H)
    for h, s in enumerate(spec):
        assert_same_plan(flex_blocks(bm, h=h), plan_blocks(s, Tq, Tk, qo, ko, bq, bk), Tq, Tk, bq, bk,
                         exact_full=True)


@pytest.mark.parametrize("spec", KINDS, ids=spec_id)
def test_block_mask_with_padding_drops_only_blocks_without_a_real_key(spec):
    Tq, Tk, qo, ko, bq, bk = 6, 43, 37, 0, 4, 8
    _, _, _, pad = inputs(1, Tq, Tk)
    bm = fx.block_mask_for(spec, 3, H, Tq, Tk, qo, ko, pad, (bq, bk), "cpu", cache=False)
    assert tuple(bm.kv_num_blocks.shape[:2]) == (3, 1)
    plan = plan_blocks(spec, Tq, Tk, qo, ko, bq, bk)
    dense = spec.mask(torch.arange(qo, qo + Tq), torch.arange(ko, ko + Tk))  # (Tq, Tk)
    for b in range(3):
        flex = flex_blocks(bm, b=b)
        live = dense & pad[b]
        for i, (visited, full) in plan.items():
            q_rows = live[i * bq : (i + 1) * bq]
            want = {j for j in visited if q_rows[:, j * bk : (j + 1) * bk].any()}
            assert flex[i][0] == want, (b, i)
            assert all(q_rows[:, j * bk : (j + 1) * bk].all() for j in flex[i][1])


# ---- compiled flex on CPU (forward only): a few cases, each compile costs seconds ------------------

COMPILED = [
    ("window+sinks,G=2,decode,padding", MaskSpec(window=5, sinks=2), CASES[1], {}),
    ("symmetric+dilation+globals,G=1,softcap", MaskSpec(causal=False, window=5, dilation=2, global_tokens=(1, 40)),
     ("prefill-G=1", 1, 45, 45, 0, 0), dict(softcap=2.0)),
    ("per-head,G=2", PER_HEAD[0], ("prefill-G=2", 2, 37, 37, 0, 0), {}),
]


@pytest.mark.parametrize("name, spec, case, extra", COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_flex_forward_equals_tiled(name, spec, case, extra):
    if not isinstance(spec, MaskSpec) and not per_head_supported():
        pytest.skip("tiled_attention in this tree takes no per-head spec")
    if fx.cpu_compiled_problem() is not None:  # test_compiled_flex_is_refused_where_it_is_wrong covers this CPU
        pytest.skip(f"compiled flex is refused on this CPU: {fx.cpu_compiled_problem()}")
    _, G, Tq, Tk, qo, ko = case
    q, k, v, pad = inputs(G, Tq, Tk)
    kw = dict(scale=0.3, spec=spec, q_offset=qo, kv_offset=ko, key_padding=pad, **extra)
    want = tiled_attention(q, k, v, block_q=BLOCK, block_k=BLOCK, **kw)
    with torch.no_grad():
        got = fx.flex_attention_forward(q, k, v, block_size=BLOCK, compiled=True, **kw)
    close(got, want)


def test_compiled_flex_is_refused_where_it_is_wrong():
    """On a CPU where the self-check finds compiled flex wrong, compiled=True is refused in one line and the default
    (eager flex) still equals the tiled kernel; where it is right, compiled flex equals tiled (the test above)."""
    q, k, v, pad = inputs(2, 6, 43)
    kw = dict(scale=0.3, spec=MaskSpec(window=5, sinks=2), q_offset=37, key_padding=pad)
    want = tiled_attention(q, k, v, block_q=BLOCK, block_k=BLOCK, **kw)
    with torch.no_grad():
        close(fx.flex_attention_forward(q, k, v, block_size=BLOCK, **kw), want)  # CPU default: eager flex
        problem = fx.cpu_compiled_problem()
        if problem is None:
            close(fx.flex_attention_forward(q, k, v, block_size=BLOCK, compiled=True, **kw), want)
        else:
            with pytest.raises(ValueError, match="gives wrong results on this CPU") as info:
                fx.flex_attention_forward(q, k, v, block_size=BLOCK, compiled=True, **kw)
            assert "\n" not in str(info.value)


def test_the_self_check_sees_a_wrong_kernel(monkeypatch):
    """The check itself: a compiled kernel that returns wrong numbers is reported."""
    monkeypatch.setattr(fx, "_CPU_CHECK", [])
    real = fx._compiled

    def wrong(fn, device):
        kernel = real(fn, device)
        return lambda *a, **kw: kernel(*a, **kw) * 1.01 if fn is fx.flex_attention else kernel(*a, **kw)

    monkeypatch.setattr(fx, "_compiled", wrong)
    assert "off the tiled kernel" in fx.cpu_compiled_problem()


# ---- what CPU cannot do is refused in one line ---------------------------------------------------

def test_cpu_refusals_name_the_fix():
    q, k, v, pad = inputs(2, 5, 5)
    with pytest.raises(ValueError, match="no backward on CPU") as info:
        fx.flex_attention_forward(q.requires_grad_(), k, v, scale=0.3)
    assert "\n" not in str(info.value)
    with torch.no_grad(), pytest.raises(ValueError, match="log-sum-exp"):
        fx.flex_attention_forward(q, k, v, scale=0.3, s_aux=torch.zeros(H), compiled=True)
    with torch.no_grad(), pytest.raises(ValueError, match="one MaskSpec per query head"):
        fx.flex_attention_forward(q, k, v, scale=0.3, spec=(MaskSpec(),) * 3)
    with pytest.raises(ValueError, match="key_padding has shape"):
        fx.block_mask_for(MaskSpec(), 3, H, 5, 5, key_padding=pad[:, :4])


# ---- routing ----------------------------------------------------------------------------------------

def test_choose_backend(monkeypatch):
    monkeypatch.setattr(fx, "flex_supported", lambda device: torch.device(device).type == "cuda")
    assert fx.choose_backend("cpu", MaskSpec(), False) == "tiled"
    assert fx.choose_backend("cpu", MaskSpec(window=4), True) == "tiled"
    assert fx.choose_backend("cuda", MaskSpec(), False) == "sdpa"
    assert fx.choose_backend("cuda", MaskSpec(causal=False), False) == "sdpa"
    assert fx.choose_backend("cuda", MaskSpec(), True) == "flex"
    assert fx.choose_backend("cuda", MaskSpec(window=4), False) == "flex"
    assert fx.choose_backend(torch.device("cuda", 0), PER_HEAD[0], False) == "flex"
    monkeypatch.setattr(fx, "flex_supported", lambda device: False)  # CUDA without Triton
    assert fx.choose_backend("cuda", MaskSpec(window=4), False) == "tiled"


@pytest.mark.parametrize("Tq, Tk, qo, ko, mode", [
    (9, 9, 0, 0, "upper_left"), (4, 9, 5, 0, "lower_right"), (1, 9, 8, 0, "none"), (4, 9, 2, 0, None),
    (4, 9, 7, 2, "lower_right"), (9, 4, 0, 0, "upper_left"),
])
def test_sdpa_path_equals_tiled_where_it_applies(Tq, Tk, qo, ko, mode):
    assert fx.sdpa_causal_mode(MaskSpec(), Tq, Tk, qo, ko) == mode
    assert fx.sdpa_causal_mode(MaskSpec(window=3), Tq, Tk, qo, ko) is None
    q, k, v, _ = inputs(2, Tq, Tk)
    kw = dict(scale=0.3, spec=MaskSpec(), q_offset=qo, kv_offset=ko)
    want = tiled_attention(q, k, v, **kw)
    close(fx.attention_forward(q, k, v, backend="sdpa", **kw), want)  # not expressible: tiled on CPU


def test_attention_forward_routes_cpu_to_tiled_and_runs_flex_when_asked():
    q, k, v, pad = inputs(2, 6, 43)
    kw = dict(scale=0.3, spec=MaskSpec(window=4, sinks=3), q_offset=37, key_padding=pad, softcap=2.0,
              s_aux=torch.tensor([0.5, -1.0, 2.0, 8.0]))
    want = tiled_attention(q, k, v, **kw)
    assert torch.equal(fx.attention_forward(q, k, v, **kw), want)
    with torch.no_grad():
        close(fx.attention_forward(q, k, v, backend="flex", **kw), want)


def test_block_masks_are_cached_per_forward_and_rebuilt_on_change():
    _, _, _, pad = inputs(1, 6, 43)
    args = (MaskSpec(), 3, H, 6, 43, 37, 0)
    first = fx.block_mask_for(*args, pad, 8, "cpu")
    assert fx.block_mask_for(*args, pad, 8, "cpu") is first  # the next layer of the same forward
    assert fx.block_mask_for(*args, pad.clone(), 8, "cpu") is not first  # another tensor
    pad[0, :20] = False  # in place: a stale mask would keep these keys
    rebuilt = fx.block_mask_for(*args, pad, 8, "cpu")
    assert rebuilt is not first
    assert flex_blocks(rebuilt, b=0) != flex_blocks(first, b=0)


def test_sink_fold_is_exact_and_differentiable():
    """The s_aux step on its own, in float64 around the differentiable reference (flex has no CPU backward, so
    this is the CPU check of the gradient that CUDA training takes through flex's out and lse)."""
    from gqakit.attention.reference import eager_reference

    q, k, v, pad = (t.double() if t.is_floating_point() else t for t in inputs(2, 6, 13))
    mask = MaskSpec(window=4).mask(torch.arange(7, 13), torch.arange(13))[None, None] & pad[:, None, None, :]
    s_aux = torch.tensor([0.5, -1.0, 2.0, 30.0], dtype=torch.float64)  # 30: exp() alone would dwarf the row
    for t in (q, k, v, s_aux):
        t.requires_grad_()
    out, lse = fx.fold_sink(*eager_reference(q, k, v, 0.3, mask), s_aux)
    want, want_lse = eager_reference(q, k, v, 0.3, mask, s_aux=s_aux)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    grads = torch.autograd.grad((out * want.detach().cos()).sum(), (q, k, v, s_aux))
    want_grads = torch.autograd.grad((want * want.detach().cos()).sum(), (q, k, v, s_aux))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind, options", [("sliding", dict(window=5, dilation=2)), ("tiled", {})])
def test_registry_attention_runs_on_flex_and_sdpa_in_a_tiny_llama(kind, options, monkeypatch,
                                                                     eager_flex_without_dynamo):
    """What the registry change does on CUDA, forced on CPU (no grad): the model's own arguments (offsets, key
    padding of a left-padded batch, its mask function) reach flex / sdpa, and the logits match the tiled kernel."""
    import copy
    import functools

    from transformers import AutoModelForCausalLM, LlamaConfig

    import gqakit.attention as ga
    from gqakit.attention import registration as registry

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = ga.use(AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).eval(), kind, **options)
    ids = torch.randint(3, 64, (2, 21))
    padding = torch.ones(2, 21, dtype=torch.long)
    padding[1, :7] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=padding).logits
        want_plain = model(ids).logits

    def via_flex(q, k, v, *, block_q=None, block_k=None, **kw):  # the eager kernel: no compile time on CPU
        return fx.flex_attention_forward(q, k, v, compiled=False, **kw)

    name = "attention_forward"
    with torch.no_grad():
        monkeypatch.setattr(registry, name, via_flex)
        close(model(ids, attention_mask=padding).logits[padding.bool()], want[padding.bool()])
        monkeypatch.setattr(registry, name, functools.partial(fx.attention_forward, backend="sdpa"))
        calls = []
        sdpa = fx.sdpa_attention
        monkeypatch.setattr(fx, "sdpa_attention", lambda *a, **kw: calls.append(kw["mode"]) or sdpa(*a, **kw))
        close(model(ids).logits, want_plain)
    # 'tiled' unpadded is plain causal attention: sdpa in both layers; 'sliding' is not: the tiled kernel on CPU
    assert calls == (["upper_left"] * 2 if kind == "tiled" else [])


H200_REFUSAL = ("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
                "Required: 278528 Hardware limit:232448 Reducing block sizes or `num_stages` may help.")


def test_a_shared_memory_refusal_on_cuda_compiles_again_with_small_tiles():
    """The failure the H200 gave for a bf16 bias (torch 2.11): retried once with SMALL_TILES and one warning;
    any other error, and the same one on CPU, is raised unchanged."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs.get("kernel_options"))
        if len(calls) == 1:
            raise RuntimeError(H200_REFUSAL)
        return "out"

    with pytest.warns(UserWarning, match="more GPU shared memory"):
        assert fx.run_with_small_tiles_on_failure(kernel, "cuda", 1, scale=2.0) == "out"
    assert calls == [None, fx.SMALL_TILES]

    calls.clear()
    with pytest.raises(RuntimeError, match="out of resource"):
        fx.run_with_small_tiles_on_failure(kernel, "cpu", 1)
    assert calls == [None]

    def broken(*args, **kwargs):
        calls.append(kwargs.get("kernel_options"))
        raise ValueError("a shape error")

    calls.clear()
    with pytest.raises(ValueError, match="a shape error"):
        fx.run_with_small_tiles_on_failure(broken, "cuda", 1)
    assert calls == [None]


def test_a_bf16_bias_gives_the_tiled_result():
    """A bf16 additive mask, passed to the score_mod in its own dtype (no fp32 copy), gives the tiled kernel's
    result on fp32 inputs."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 20, 8, generator=g) for n in (4, 2, 2))
    bias = (0.5 * torch.randn(1, 1, 20, 20, generator=g)).to(torch.bfloat16)
    bias[..., 3] = torch.finfo(torch.bfloat16).min
    got = fx.flex_attention_forward(q, k, v, scale=8 ** -0.5, attn_mask=bias, block_size=16)
    want = tiled_attention(q, k, v, scale=8 ** -0.5, attn_mask=bias.float(), block_q=16, block_k=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiling_flex_raises_dynamos_recompile_limit(monkeypatch):
    """Each mask pattern's numbers, padding, batch and prefill / decode are a compiled variant of their own; past
    dynamo's default of 8 the next ran as eager flex, silently (a review: 9 in one short Gemma 2 session). A higher
    limit the user set is kept."""
    import torch._dynamo

    from gqakit.attention import flex

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(flex, "_COMPILED", {})
    kept = getattr(config, name)  # restored by hand: monkeypatch's undo deletes a config module's key, which hides it
    try:
        for before, after in ((8, flex.RECOMPILE_LIMIT), (1_000, 1_000)):
            setattr(config, name, before)
            flex._COMPILED.clear()
            flex._compiled(lambda x: x, torch.device("cpu"))
            assert getattr(config, name) == after
    finally:
        setattr(config, name, kept)
