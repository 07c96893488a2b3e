"""Longformer and Sparse Transformer patterns, per head and per layer: exact against the eager reference with the
dense mask built from `mask()`, block plans that visit exactly the touched blocks, and one-line errors."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.masking_utils import AttentionMaskInterface, and_masks, sdpa_mask, sliding_window_overlay

import gqakit.attention as attention
from gqakit.attention import hf_masks, options as attention_options, patterns, registration
from gqakit.attention.masks import AttentionOptionError, MaskSpec
from gqakit.attention.reference import eager_reference
from gqakit.attention.tiled import block_plan, tiled_attention, work
from gqakit.common.errors import GqakitError
from test_tiled import left_padding, make_inputs

NEG_INF = float("-inf")

# ---- the patterns against the papers' definitions, pair by pair -------------------------------------


def paper_strided(l, part, i, j):
    a1 = max(0, i - l) <= j <= i
    a2 = j <= i and (i - j) % l == 0
    return {"a1": a1, "a2": a2, "both": a1 or a2}[part]


def paper_fixed(l, c, part, i, j):
    a1 = j <= i and j // l == i // l
    a2 = j <= i and j % l >= l - c
    return {"a1": a1, "a2": a2, "both": a1 or a2}[part]


def paper_longformer(w, d, globals_, causal, i, j):
    if causal and j > i:
        return False
    if i in globals_ or j in globals_:
        return True
    per_side = w if causal else w // 2
    return (i - j) % d == 0 and abs(i - j) // d <= per_side


def brute(fn, T):
    return torch.tensor([[fn(i, j) for j in range(T)] for i in range(T)])


@pytest.mark.parametrize("part", patterns.PARTS)
@pytest.mark.parametrize("l", [1, 3, 5])
def test_strided_is_the_paper_definition(part, l):
    T = 23
    got = patterns.strided(l, part=part).mask(torch.arange(T), torch.arange(T))
    assert torch.equal(got, brute(lambda i, j: paper_strided(l, part, i, j), T))


@pytest.mark.parametrize("part", patterns.PARTS)
@pytest.mark.parametrize("l, c", [(4, 1), (5, 2), (3, 3)])
def test_fixed_is_the_paper_definition(part, l, c):
    T = 23
    got = patterns.fixed(l, c, part=part).mask(torch.arange(T), torch.arange(T))
    assert torch.equal(got, brute(lambda i, j: paper_fixed(l, c, part, i, j), T))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w, d", [(0, 1), (4, 1), (6, 2), (2, 3)])
def test_longformer_is_the_paper_definition(causal, w, d):
    T, globals_ = 25, (0, 11)
    spec = patterns.longformer(w, dilation=d, global_tokens=globals_, causal=causal)
    got = spec.mask(torch.arange(T), torch.arange(T))
    assert torch.equal(got, brute(lambda i, j: paper_longformer(w, d, globals_, causal, i, j), T))
    if not causal:  # symmetric: w/2 tokens each side, d apart
        assert got[12].nonzero().flatten().tolist() == sorted(
            {0, 11} | {12 + s * d * m for s in (-1, 1) for m in range(w // 2 + 1)})


def test_factorised_heads_and_head_mask_function():
    a1, a2 = patterns.strided(4, part="a1"), patterns.strided(4, part="a2")
    specs = patterns.factorised(a1, a2, 6)
    assert specs == (a1,) * 3 + (a2,) * 3
    T = 13
    pos = torch.arange(T)
    dense = patterns.dense_mask(specs, pos, pos)  # (H, T, T)
    assert dense.shape == (6, T, T)
    assert torch.equal(dense[0], a1.mask(pos, pos)) and torch.equal(dense[5], a2.mask(pos, pos))
    fn = patterns.head_mask_function(specs)
    h = torch.arange(6)[:, None, None]
    assert torch.equal(fn(0, h, pos[None, :, None], pos[None, None, :]), dense)
    # the per-head function also runs under vmap, as transformers and flex_attention evaluate mask functions
    vm = torch.vmap(torch.vmap(torch.vmap(fn, in_dims=(None, None, None, 0)), in_dims=(None, None, 0, None)),
                    in_dims=(None, 0, None, None))
    assert torch.equal(vm(0, torch.arange(6), pos, pos), dense)


@pytest.mark.parametrize("spec", [
    patterns.strided(4), patterns.fixed(5, 2), patterns.longformer(4, dilation=2, global_tokens=(3,)),
    patterns.longformer(4, global_tokens=(0,), causal=True)], ids=repr)
@pytest.mark.parametrize("use_vmap", [False, True])
def test_mask_function_through_sdpa_mask(spec, use_vmap):
    tq, tk, q_off = 7, 19, 12
    got = sdpa_mask(batch_size=1, q_length=tq, kv_length=tk, q_offset=q_off, kv_offset=0,
                    mask_function=spec.mask_function(), allow_is_causal_skip=False, use_vmap=use_vmap)
    assert torch.equal(got[0, 0], spec.mask(torch.arange(q_off, q_off + tq), torch.arange(tk)))


# ---- the kernel against the eager reference -----------------------------------------------------------

H = 4
PATTERNS = {
    "longformer_enc": patterns.longformer(6, global_tokens=(0, 20)),
    "longformer_enc_dilated": patterns.longformer(4, dilation=3, global_tokens=(5,)),
    "longformer_dec": patterns.longformer(5, dilation=2, global_tokens=(2,), causal=True),
    "strided": patterns.strided(6),
    "strided_a1": patterns.strided(6, part="a1"),
    "strided_a2": patterns.strided(6, part="a2"),
    "fixed": patterns.fixed(6, 2),
    "fixed_a2": patterns.fixed(6, 2, part="a2"),
    "strided_heads": patterns.factorised(patterns.strided(6, part="a1"), patterns.strided(6, part="a2"), H),
    "fixed_heads": patterns.factorised(patterns.fixed(5, 1, part="a1"), patterns.fixed(5, 1, part="a2"), H),
    # Longformer per head: dilation on the last 2 heads (same token count, d times the reach), a global token
    "longformer_heads": (patterns.longformer(4, global_tokens=(1,)),) * 2 + (patterns.longformer(
        4, dilation=3, global_tokens=(1,)),) * 2,
    "mixed_heads": (patterns.strided(4), patterns.fixed(4, 1), patterns.strided(4, part="a2"), MaskSpec(window=3)),
    # heads whose patterns touch the same blocks: one call over the union, masked per row
    "union_heads": (MaskSpec(window=9), MaskSpec(window=9, dilation=2), MaskSpec(window=9, global_tokens=(4,)),
                    MaskSpec(window=9, dilation=3)),
}


def compare(q, k, v, spec, *, q_offset=0, kv_offset=0, key_padding=None, block_q=8, block_k=8, out_tol=1e-5,
            grad_tol=1e-4, factorised=True):
    """Output, lse and q/k/v gradients of the kernel against eager_reference with the dense mask from `mask()`."""
    B, _, tq, d = q.shape
    tk = k.shape[2]
    scale = d ** -0.5
    out, lse = tiled_attention(q, k, v, scale=scale, spec=spec, q_offset=q_offset, kv_offset=kv_offset,
                               key_padding=key_padding, block_q=block_q, block_k=block_k, return_lse=True,
                               factorised=factorised)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    mask = patterns.dense_mask(spec, torch.arange(q_offset, q_offset + tq), torch.arange(kv_offset, kv_offset + tk))
    mask = mask[None]  # (1, H|1, Tq, Tk)
    if key_padding is not None:
        mask = mask & key_padding[:, None, None, :]
    ref, ref_lse = eager_reference(q32, k32, v32, scale, mask)
    torch.testing.assert_close(out.float(), ref, atol=out_tol, rtol=out_tol)
    dead = ref_lse == NEG_INF
    assert torch.equal(lse == NEG_INF, dead)
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], atol=out_tol, rtol=out_tol)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), d_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.float(), r, atol=grad_tol, rtol=grad_tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("factorised", [True, False], ids=["layouts", "generic"])
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("G", [1, 2, H])
def test_patterns_match_reference(name, G, factorised):
    """fp32: outputs and lse within 1e-5, gradients within 1e-4; the Sparse Transformer patterns both in their
    factorised layouts and on the generic block plan."""
    q, k, v = make_inputs(2, H, G, 37, 37, 7)  # T = 37: not a multiple of the blocks; odd head dim
    compare(q, k, v, PATTERNS[name], block_q=8, block_k=5, factorised=factorised)


@pytest.mark.parametrize("name", ["longformer_enc", "strided", "fixed_heads", "longformer_heads"])
def test_patterns_with_left_padding_and_a_fully_padded_row(name):
    q, k, v = make_inputs(3, H, 2, 29, 29, 8)
    compare(q, k, v, PATTERNS[name], key_padding=left_padding(3, 29), block_q=8, block_k=8)


@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("name", ["longformer_dec", "strided", "fixed", "strided_heads", "mixed_heads"])
def test_patterns_decode_offsets(tq, name):
    """A few new queries at the end of a longer cache (bottom-right aligned; kv_offset > 0 for a rolled cache)."""
    tk, kv_offset = 40, 5
    q, k, v = make_inputs(2, H, 2, tq, tk, 8)
    compare(q, k, v, PATTERNS[name], q_offset=kv_offset + tk - tq, kv_offset=kv_offset,
            key_padding=left_padding(2, tk, seed=3)[[0, 0]], block_q=2, block_k=16)


# bf16 / fp16: the kernel computes in fp32 and rounds its outputs and gradients; tolerances as in test_tiled.
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("name", ["mixed_heads", "union_heads"])
def test_per_head_patterns_in_low_precision(dtype, tol, name):
    q, k, v = make_inputs(2, H, 2, 30, 30, 16, dtype=dtype)
    compare(q, k, v, PATTERNS[name], key_padding=left_padding(2, 30), block_q=8, block_k=16,
            out_tol=tol, grad_tol=tol)


def test_per_head_spec_count_is_checked():
    q, k, v = make_inputs(1, H, 2, 5, 5, 8)
    with pytest.raises(ValueError, match=r"one per query head \(4\); got 3"):
        tiled_attention(q, k, v, scale=1.0, spec=(MaskSpec(),) * 3)


# ---- the block plan visits exactly the blocks the reference mask touches ---------------------------------

def plan_matches_reference(spec, num_heads, G, tq, tk, q_offset, kv_offset, bq, bk):
    """Per call of the plan and per K/V group: the visited blocks are exactly those where one of the call's
    heads in that group has an allowed entry, and a block is skipped-as-full only where all of them allow all."""
    dense = patterns.dense_mask(patterns.as_heads(spec, num_heads), torch.arange(q_offset, q_offset + tq),
                                torch.arange(kv_offset, kv_offset + tk))  # (H, Tq, Tk)
    touched = patterns.touched_blocks(dense, bq, bk)  # (H, nq, nk)
    holes = patterns.touched_blocks(~dense, bq, bk)  # (H, nq, nk): a disallowed entry
    r = num_heads // G
    visited = expected = 0
    covered = set()
    for heads, groups, plan in block_plan(spec, num_heads, G, tq, tk, q_offset=q_offset, kv_offset=kv_offset,
                                          block_q=bq, block_k=bk):
        for g in groups:
            mine = [h for h in heads if h // r == g]
            covered.update(mine)
            seen = torch.zeros_like(touched[0])
            for q0, _, blocks in plan:
                for k0, _, needs_mask in blocks:
                    seen[q0 // bq, k0 // bk] = True
                    visited += 1
                    if not needs_mask:  # a full block: every head of the call allows every entry
                        assert not holes[mine, q0 // bq, k0 // bk].any()
            want = touched[mine].any(dim=0)
            assert torch.equal(seen, want), (spec, g, mine, tq, tk, q_offset, kv_offset, bq, bk)
            expected += int(want.sum())
    assert covered == set(range(num_heads))
    return visited, expected


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("G", [1, 2, H])
@pytest.mark.parametrize("tq, tk, q_offset, kv_offset, bq, bk", [
    (37, 37, 0, 0, 8, 5), (64, 64, 0, 0, 4, 4), (3, 40, 42, 5, 2, 16), (11, 30, 19, 0, 4, 8), (50, 50, 0, 0, 16, 3)])
def test_visited_blocks_equal_touched_blocks(name, G, tq, tk, q_offset, kv_offset, bq, bk):
    visited, touched = plan_matches_reference(PATTERNS[name], H, G, tq, tk, q_offset, kv_offset, bq, bk)
    assert visited == touched


def test_per_head_calls_union_or_split():
    """Heads on different patterns: K/V groups whose heads differ are split when that saves work (strided A1 vs
    A2 touch different blocks: each head visits only its own); heads whose patterns touch the same blocks
    (a window with and without dilation) run as one call over the union, with per-row masks."""
    T, l, b = 256, 16, 8
    a1, a2 = patterns.strided(l, part="a1"), patterns.strided(l, part="a2")

    def calls(spec, G):
        return [(heads, groups, sum(len(bl) for _, _, bl in plan))
                for heads, groups, plan in block_plan(spec, H, G, T, T, block_q=b, block_k=b)]

    alone = {s: calls(s, 1)[0][2] for s in (a1, a2)}
    for G in (1, 2, H):
        got = calls(patterns.factorised(a1, a2, H), G)
        assert sorted(h for heads, _, _ in got for h in heads) == list(range(H))
        assert {n for _, _, n in got} == {alone[a1], alone[a2]}  # each head visits only its own pattern's blocks
    (heads, groups, n), = calls(PATTERNS["union_heads"], 1)  # one call: same blocks, bigger matmuls
    assert heads == list(range(H)) and n == calls(MaskSpec(window=9, global_tokens=(4,)), 1)[0][2]
    # the kernel runs that call with a per-row mask (exact: test_patterns_match_reference[union_heads])


def test_factorised_layouts_match_the_generic_kernel():
    """The paper's layouts (residue classes for strided, gathered summaries for fixed) against the generic block
    plan, with padding, offsets, GQA and sink logits (counted once across the pieces): outputs, lse and the
    gradients of q, k, v and the sink logits."""
    s_aux = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    for spec in (PATTERNS["strided"], PATTERNS["strided_a2"], PATTERNS["fixed"], PATTERNS["fixed_a2"],
                 MaskSpec(window=4, parts=(MaskSpec(dilation=3),))):
        assert patterns.factorised_pieces(spec) is not None
        for tq, tk, q_off, kv_off in ((37, 37, 0, 0), (5, 41, 39, 3), (13, 13, 7, 7)):
            q, k, v = make_inputs(2, H, 2, tq, tk, 8)
            kp = left_padding(2, tk, seed=5)
            outs = [tiled_attention(q, k, v, scale=0.4, spec=spec, q_offset=q_off, kv_offset=kv_off, key_padding=kp,
                                    block_q=4, block_k=8, s_aux=s_aux, return_lse=True, factorised=f)
                    for f in (True, False)]
            torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
            g = torch.randn(outs[0][0].shape)
            g = (g, torch.randn(outs[0][1].shape))  # through the output and the lse (as ring attention merges)
            grads = [torch.autograd.grad((out, lse.nan_to_num(neginf=0.0)), (q, k, v, s_aux), g) for out, lse in outs]
            for name, a, b in zip(("q", "k", "v", "s_aux"), *grads):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")
    assert patterns.factorised_pieces(patterns.strided(4, causal=False)) is None
    assert patterns.factorised_pieces(MaskSpec(window=4, parts=(MaskSpec(dilation=3, sinks=1),))) is None


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_sparse_patterns_visit_o_t_sqrt_t_blocks(pattern):
    """With l = sqrt(T) and a fixed block, visited blocks grow like T^1.5 (x8 for T x4); causal grows like T^2."""
    b = 16

    def count(T):
        l = int(math.isqrt(T))
        spec = patterns.strided(l) if pattern == "strided" else patterns.fixed(l, 1)
        return sum(len(blocks) for _, _, plan in block_plan(spec, 1, 1, T, T, block_q=b, block_k=b)
                   for _, _, blocks in plan)

    small, big = count(1024), count(4096)
    causal_small, causal_big = (sum(len(bl) for _, _, p in block_plan(MaskSpec(), 1, 1, T, T, block_q=b, block_k=b)
                                    for _, _, bl in p) for T in (1024, 4096))
    assert causal_big / causal_small > 15
    assert 6 < big / small < 10
    per_query_block = big / (4096 // b)
    assert per_query_block <= 4096 / 64 + 64 / b + 3  # O(T / l + l / block)
    # the factorised layouts compute O(T sqrt T) scores whatever the block size (here 64 >= l at T = 1024)
    scores = [work(patterns.strided(32) if pattern == "strided" else patterns.fixed(32, 4), 1, 1, 1024, 1024,
                   block_q=64, block_k=64)["scores"],
              work(patterns.strided(64) if pattern == "strided" else patterns.fixed(64, 8), 1, 1, 4096, 4096,
                   block_q=64, block_k=64)["scores"]]
    causal = [work(MaskSpec(), 1, 1, T, T, block_q=64, block_k=64)["scores"] for T in (1024, 4096)]
    # x4 tokens: causal x16; these ~x8 (under: block-granular A1 overhead, O(T * block), shrinks with T)
    assert 4 < scores[1] / scores[0] < 10 and causal[1] / causal[0] > 15
    assert scores[1] < 0.4 * causal[1]


# ---- per-layer and per-head options through use(), in a tiny Llama and a tiny BERT ------------------------

def _reference_attention(specs_by_layer):
    """eager_reference with, per layer, the dense per-head mask from `mask()` AND transformers' own mask."""

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        tq, tk = query.shape[2], key.shape[2]
        allowed = patterns.dense_mask(specs_by_layer[module.layer_idx], torch.arange(tk - tq, tk), torch.arange(tk))
        mask = allowed[None]  # (1, H|1, Tq, Tk)
        if attention_mask is not None:
            mask = mask & attention_mask.bool()
        out, _ = eager_reference(query, key, value, scaling, mask)
        return out.transpose(1, 2), None

    return fn


def _tiny(cls_config, attn, **extra):
    torch.manual_seed(0)
    cfg = cls_config(**extra)
    build = AutoModelForCausalLM.from_config if cls_config is LlamaConfig else transformers.BertModel._from_config
    return build(copy.deepcopy(cfg), attn_implementation=attn).eval()


def _grads(model, ids, mask):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask)
    value = out.logits if hasattr(out, "logits") else out.last_hidden_state
    # loss over real positions only: eager gives a padded query row a uniform average over masked keys
    (value[mask.bool()] if mask is not None else value).pow(2).mean().backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_against_reference(model, options, kind, ids, mask, real):
    """use(model, kind, **options) equals the reference attention with the per-layer dense masks."""
    L, nh = model.config.num_hidden_layers, model.config.num_attention_heads
    causal = isinstance(model.config, LlamaConfig)
    stored = attention_options.normalise_options(kind, options, model.config)
    specs = {i: attention_options.mask_spec(kind, stored, causal, layer=i, num_heads=nh) for i in range(L)}
    name = f"patterns_reference_{id(specs)}"
    AttentionInterface.register(name, _reference_attention(specs))
    AttentionMaskInterface.register(name, sdpa_mask)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(name)
    tiled = attention.use(copy.deepcopy(model), kind, block_q=4, block_k=4, **options)
    ref_out, ref_grads = _grads(ref, ids, mask)
    out, grads = _grads(tiled, ids, mask)
    torch.testing.assert_close(out[real], ref_out[real], rtol=0, atol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-4, msg=n)
    return specs, tiled


LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def test_per_layer_windows_and_per_head_dilation_in_a_llama():
    """Longformer-style decoder: small windows low, larger high; dilation on the last 2 heads of the top layer."""
    model = _tiny(LlamaConfig, "sdpa", **LLAMA)
    ids = torch.randint(3, 64, (2, 27), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding: a global token at position 0 is each row's first token
    options = dict(window=[3, 6, [9, 9, 9, 9]], dilation=[1, 1, [1, 1, 2, 2]], global_tokens=[0])
    specs, tiled = _check_against_reference(model, options, "sliding", ids, mask, mask.bool())
    assert specs[0] == MaskSpec(window=3, global_tokens=(0,))
    assert specs[2] == (MaskSpec(window=9, global_tokens=(0,)),) * 2 + (MaskSpec(window=9, dilation=2,
                                                                                 global_tokens=(0,)),) * 2
    assert tiled.config.gqakit_attention["window"] == [3, 6, [9, 9, 9, 9]]


@pytest.mark.parametrize("options", [
    dict(pattern="strided", stride=4, part="split"),
    dict(pattern="fixed", stride=5, summary=2, part=["both", "a1", ["a1", "a2", "a2", "both"]]),
    dict(pattern=["strided", "fixed", "strided"], stride=[3, 4, 5], summary=[None, 1, None],
         part=["a2", "both", "split"]),
])
def test_sparse_kind_per_layer_and_per_head_in_a_llama(options):
    model = _tiny(LlamaConfig, "sdpa", **LLAMA)
    ids = torch.randint(3, 64, (1, 26), generator=torch.Generator().manual_seed(1))
    _check_against_reference(model, options, "sparse", ids, None, slice(None))


def test_longformer_encoder_per_layer_in_bert():
    """Non-causal: symmetric windows (one per layer), dilation on two heads, a global [CLS] token, padding."""
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = _tiny(transformers.BertConfig, "eager", **cfg)
    ids = torch.randint(3, 64, (2, 25), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, -6:] = 0
    w = patterns.longformer(4).window  # Longformer w = 4: 2 tokens each side -> window 3
    wd = patterns.longformer(4, dilation=2).window  # the same 2 tokens each side, 2 apart -> window 5
    options = dict(window=[w, [w, w, wd, wd]], dilation=[1, [1, 1, 2, 2]], global_tokens=[0])
    specs, _ = _check_against_reference(model, options, "sliding", ids, mask, mask.bool())
    assert specs[0] == patterns.longformer(4, global_tokens=(0,))
    assert specs[1][2] == patterns.longformer(4, dilation=2, global_tokens=(0,))


def test_layered_options_survive_save_and_load(tmp_path):
    model = attention.use(_tiny(LlamaConfig, "sdpa", **LLAMA), "sparse", pattern="fixed", stride=4, summary=1,
                          part=["a1", "split", ["both", "a2", "a1", "a1"]])
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="gqakit_sparse").eval()
    assert again.config.gqakit_attention == model.config.gqakit_attention
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_ring_refuses_per_layer_patterns():
    stored = attention_options.normalise_options("sliding", {"window": [2, 3, 4]}, LlamaConfig(**LLAMA))
    with pytest.raises(AttentionOptionError, match="one pattern for the whole model") as info:
        attention_options.mask_spec("sliding", stored)
    assert "\n" not in str(info.value)


# ---- a model's own sliding-window layers reach the kernel as a windowed MaskSpec --------------------------

def _spy(monkeypatch):
    """Records each layer call's (spec, elementwise model mask), whichever kernel the registry then calls."""
    calls = []
    real = registration.layer_spec

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(registration, "layer_spec", spy)
    return calls


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_model_sliding_window_becomes_a_windowed_spec(monkeypatch, family):
    cfg = {"mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=5),
           "qwen2": lambda: transformers.Qwen2Config(**SMALL, sliding_window=5, use_sliding_window=True,
                                                     layer_types=["sliding_attention", "full_attention"]),
           "gemma2": lambda: transformers.Gemma2Config(**SMALL, sliding_window=5, final_logit_softcapping=None,
                                                       query_pre_attn_scalar=8)}[family]()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    tiled = attention.use(copy.deepcopy(ref), "tiled", block_q=4, block_k=4)
    ids = torch.randint(3, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    calls = _spy(monkeypatch)
    ref_logits, ref_grads = _grads(ref, ids, mask)
    logits, grads = _grads(tiled, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=0, atol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-4, msg=n)
    windowed = [spec for spec, extra in calls if spec == MaskSpec(window=5) and extra is None]
    sliding_layers = {"mistral": 2, "qwen2": 1, "gemma2": 1}[family]  # Gemma2 alternates sliding / full
    assert len(windowed) == sliding_layers  # the elementwise model mask is gone: interior blocks are full
    assert all(spec in (MaskSpec(), MaskSpec(window=5)) for spec, _ in calls)
    # and the plan skips the blocks outside the window: T = 30, window 5, blocks of 4
    visited = sum(len(bl) for _, _, plan in block_plan(MaskSpec(window=5), 4, 2, 30, 30, block_q=4, block_k=4)
                  for _, _, bl in plan)
    assert visited < sum(len(bl) for _, _, plan in block_plan(MaskSpec(), 4, 2, 30, 30, block_q=4, block_k=4)
                         for _, _, bl in plan) / 2


def test_window_bounds_read_from_mask_functions():
    from transformers.masking_utils import (causal_mask_function, or_masks, sliding_window_bidirectional_mask_function,
                                            sliding_window_causal_mask_function)
    m = hf_masks.gqakit_mask(1, 10, 10, mask_function=sliding_window_causal_mask_function(7))
    assert (m.causal, m.window, m.window_only) == (True, 7, True)
    m = hf_masks.gqakit_mask(1, 10, 10, mask_function=sliding_window_bidirectional_mask_function(3))
    assert (m.causal, m.window, m.window_only) == (False, 4, True)  # |q - k| <= 3
    extra = and_masks(sliding_window_causal_mask_function(7), lambda b, h, q, k: q >= 0)
    m = hf_masks.gqakit_mask(1, 10, 10, mask_function=extra)
    assert (m.window, m.window_only) == (7, False)  # bounded, but the function is more than a window: kept
    m = hf_masks.gqakit_mask(1, 10, 10, mask_function=or_masks(sliding_window_causal_mask_function(7),
                                                               lambda b, h, q, k: q == 9))
    assert m.window is None  # an or-overlay may reach past the window
    m = hf_masks.gqakit_mask(1, 10, 10, mask_function=and_masks(sliding_window_overlay(4), causal_mask_function))
    assert (m.window, m.window_only) == (4, True)


def test_sliding_kind_on_a_windowed_model_keeps_the_model_window_for_globals(monkeypatch):
    """Global tokens cannot be cut by a MaskSpec window: the model's function stays as the elementwise check."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**SMALL, sliding_window=6)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    model = attention.use(copy.deepcopy(ref), "sliding", window=4, global_tokens=[0], block_q=4, block_k=4)
    calls = _spy(monkeypatch)
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20)
    dense = MaskSpec(window=4, global_tokens=(0,)).mask(pos, pos) & MaskSpec(window=6).mask(pos, pos)
    additive = torch.zeros(1, 1, 20, 20).masked_fill(~dense, torch.finfo(torch.float32).min)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids, attention_mask=additive).logits,
                                   rtol=0, atol=1e-5)
    assert all(extra is not None and spec == MaskSpec(window=4, global_tokens=(0,)) for spec, extra in calls)


# ---- bad input: one line naming the fix ------------------------------------------------------------------

@pytest.mark.parametrize("build, needle", [
    (lambda: patterns.strided(0), "stride=0 must be a positive integer"),
    (lambda: patterns.strided(-3, part="a1"), "stride=-3"),
    (lambda: patterns.fixed(4, 5), "summary c=5 is larger than the stride l=4"),
    (lambda: patterns.fixed(4, 0), "summary=0 must be a positive integer"),
    (lambda: patterns.fixed(0, 1), "stride=0"),
    (lambda: patterns.strided(4, part="a3"), "choose 'a1', 'a2' or 'both'"),
    (lambda: patterns.longformer(5), "must be even"),
    (lambda: patterns.longformer(4, global_tokens=(-1,)), "negative"),
    (lambda: patterns.longformer(4, dilation=0), "dilation=0"),
    (lambda: patterns.factorised(MaskSpec(), MaskSpec(), 1), "at least 2"),
    (lambda: patterns.as_heads((MaskSpec(),) * 3, 4), "3 items for 4 heads"),
])
def test_pattern_errors_are_one_line(build, needle):
    with pytest.raises(AttentionOptionError, match=needle) as info:
        build()
    assert "\n" not in str(info.value) and isinstance(info.value, GqakitError)


@pytest.mark.parametrize("kind, options, needle", [
    ("sparse", {}, "needs a stride"),
    ("sparse", {"stride": 0}, "stride=0 must be a positive integer"),
    ("sparse", {"stride": 4, "pattern": "fixed"}, "needs summary=c"),
    ("sparse", {"stride": 4, "pattern": "fixed", "summary": 5}, "larger than the stride"),
    ("sparse", {"stride": 4, "pattern": "fixed", "summary": -1}, "summary=-1"),
    ("sparse", {"stride": 4, "summary": 2}, "takes no summary"),
    ("sparse", {"stride": 4, "pattern": "dilated"}, "choose 'strided' or 'fixed'"),
    ("sparse", {"stride": 4, "part": ["a1", "a2", ["split"] * 4]}, "per-layer value"),
    ("sparse", {"stride": [4, 4]}, "stride has 2 entries, one per layer, but the model has 3 layers"),
    ("sliding", {"window": [3, 3, 3, 3]}, "window has 4 entries, one per layer, but the model has 3 layers"),
    ("sliding", {"window": 4, "dilation": [1, 1, [1, 2]]}, "dilation for layer 2 has 2 entries, one per query head, "
                                                            "but the model has 4 heads"),
    ("sliding", {"window": [3, [3, 3, 3, [3]], 3]}, "nests lists"),
    ("sliding", {"window": 4, "global_tokens": [0, 500]}, r"global_tokens \[500\] are beyond the model's "
                                                          "max_position_embeddings=128"),
    ("sliding", {"window": 4, "global_tokens": [-2]}, "negative"),
    ("sliding", {"window": 4, "global_tokens": 3}, "must be a list of positions"),
    ("sliding", {"window": [4, 0, 4]}, "window=0 must be a positive number"),
    ("sparse", {"stride": 4, "window": 3}, "has no option 'window'"),
])
def test_use_errors_are_one_line(kind, options, needle):
    with pytest.raises(AttentionOptionError, match=needle) as info:
        attention.use(_tiny(LlamaConfig, "sdpa", **LLAMA), kind, **options)
    assert "\n" not in str(info.value)


def test_a_window_larger_than_the_sequence_is_dense_not_an_error():
    q, k, v = make_inputs(1, 2, 1, 9, 9, 8)
    big = tiled_attention(q, k, v, scale=0.3, spec=MaskSpec(window=1000), block_q=4, block_k=4)
    torch.testing.assert_close(big, tiled_attention(q, k, v, scale=0.3, spec=MaskSpec(), block_q=4, block_k=4))


def test_a_bare_call_applies_the_layers_sliding_window():
    """No mask at all (not through the mask interface): the layer's sliding_window kwarg is its window, as flash
    attention reads it; where the pattern cannot carry it (global tokens), it is applied elementwise."""
    class _Attn(torch.nn.Module):
        def __init__(self, options=None):
            super().__init__()
            self.is_causal, self.layer_idx = True, 0
            self.config = transformers.PretrainedConfig()
            if options is not None:
                self.config.gqakit_attention = options

    q, k, v = make_inputs(1, H, 2, 19, 19, 8)
    pos = torch.arange(19)
    for kind, options, want in (
            ("tiled", None, MaskSpec(window=4).mask(pos, pos)),
            ("sliding", attention_options.normalise_options("sliding", {"window": 6, "global_tokens": [0], "block_q": 4,
                                                               "block_k": 4}),
             MaskSpec(window=6, global_tokens=(0,)).mask(pos, pos) & MaskSpec(window=4).mask(pos, pos))):
        out, _ = registration._make_attention(kind)(_Attn(options), q, k, v, None, scaling=0.3, sliding_window=4)
        ref, _ = eager_reference(q, k, v, 0.3, want[None, None])
        torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)


def test_packed_sequences_on_a_sliding_window_model(monkeypatch):
    """position_ids that restart per document: transformers wraps the sliding mask for packing; the window still
    bounds every document (indices and positions differ by a constant inside one), the wrapper stays as a check."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**SMALL, sliding_window=4)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    tiled = attention.use(copy.deepcopy(ref), "tiled", block_q=4, block_k=4)
    ids = torch.randint(3, 64, (1, 21), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(9), torch.arange(12)])[None]
    calls = _spy(monkeypatch)
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=position_ids, use_cache=False).logits  # no cache: packing is detected
        got = tiled(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        alone = tiled(input_ids=ids[:, 9:], use_cache=False).logits  # the second document on its own
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[:, 9:], alone, rtol=0, atol=1e-5)
    assert all(spec == MaskSpec(window=4) for spec, _ in calls)
    assert [extra is not None for _, extra in calls] == [True, True, False, False]  # packed: the check stays


def test_within_window_is_the_intersection():
    pos = torch.arange(40)
    for spec in (MaskSpec(), patterns.strided(6), patterns.fixed(5, 2), MaskSpec(window=3, dilation=2),
                 patterns.factorised(patterns.strided(6, part="a1"), patterns.strided(6, part="a2"), 4)):
        cut = patterns.within_window(spec, 7)
        assert torch.equal(patterns.dense_mask(cut, pos, pos),
                           patterns.dense_mask(spec, pos, pos) & MaskSpec(window=7).mask(pos, pos))
    assert patterns.within_window(MaskSpec(window=3, global_tokens=(0,)), 7) is None  # globals reach past it
    assert patterns.within_window((MaskSpec(), MaskSpec(sinks=2)), 7) is None
