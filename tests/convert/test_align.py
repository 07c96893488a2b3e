"""Aligned K/V merges (gqakit.convert.methods.align): exact transforms on tiny Llamas and plain tensors."""
import copy
import math

import pytest
import torch

from gqakit.convert.methods.align import (align_and_merge_layer, orthogonal_procrustes, pair_rotation_to,
                                  permute_kv_heads, rotation, scaled_rotation, to_pairs,
                                  transform_keys, transform_values)
from gqakit.convert.methods.pooling import pool_heads
from tiny_models import make_tiny_llama

D = 8  # head_dim of the tiny models


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _random_key_maps(k, half, seed):
    """Random per-pair rotations (any angle) times scales in [0.5, 2]."""
    g = _gen(seed)
    theta = (torch.rand(k, half, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
    scale = torch.exp((torch.rand(k, half, generator=g, dtype=torch.float64) * 2 - 1) * math.log(2))
    return scale[..., None, None] * rotation(theta)


def _random_orthogonal(k, d, seed):
    return torch.linalg.qr(torch.randn(k, d, d, generator=_gen(seed), dtype=torch.float64)).Q


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama loader whose attention weights are large enough to give peaked attention."""
    from transformers import AutoModelForCausalLM

    def make(heads=4, kv_heads=None, layers=2, seed=0):
        path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), heads=heads, kv_heads=kv_heads, layers=layers,
                               head_dim=D, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        g = _gen(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                a = layer.self_attn
                for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.25)
        return model
    return make


def _ids():
    return torch.randint(3, 64, (2, 24), generator=_gen(7))


def _logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    return out.logits, out.attentions


def _attn(model, i):
    a = model.model.layers[i].self_attn
    return a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight


def _with_weights(model, new, kv_heads):
    """A copy of `model` with `num_key_value_heads = kv_heads` and layer i's (q, k, v, o) = new[i]."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.num_key_value_heads = kv_heads
    out = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    sd = dict(model.state_dict())
    for i, (q, k, v, o) in enumerate(new):
        p = f"model.layers.{i}.self_attn."
        sd.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v, p + "o_proj.weight": o})
    out.load_state_dict(sd)
    return out


# ------------------------------------------------------------------------------------------------
# closed-form fits
# ------------------------------------------------------------------------------------------------

def test_pair_rotation_to_recovers_a_rotation_not_a_reflection():
    src = torch.randn(5, 2, 30, generator=_gen(0), dtype=torch.float64)
    rot = rotation(torch.tensor([0.3, -2.0, 3.0, 1.2, -0.1], dtype=torch.float64))
    fit = pair_rotation_to(src, rot @ src)
    torch.testing.assert_close(fit, rot, rtol=0, atol=1e-12)
    flip = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    fit = pair_rotation_to(src, flip @ src)
    torch.testing.assert_close(torch.linalg.det(fit), torch.ones(5, dtype=torch.float64))
    assert torch.equal(pair_rotation_to(src, torch.zeros_like(src)), torch.eye(2, dtype=torch.float64).expand(5, 2, 2))


def test_orthogonal_procrustes_recovers_an_orthogonal_map():
    src = torch.randn(3, 8, 40, generator=_gen(1), dtype=torch.float64)
    u = _random_orthogonal(3, 8, 2)
    torch.testing.assert_close(orthogonal_procrustes(src, u @ src), u, rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# exact transforms on a real tiny Llama forward (RoPE included)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_rope_commuting_key_transform_keeps_logits_and_attention(tiny, heads, kv_heads):
    model = tiny(heads, kv_heads)
    ids = _ids()
    logits, attn = _logits(model, ids)
    new = []
    for i in range(2):
        q, k, v, o = _attn(model, i)
        maps = _random_key_maps(kv_heads, D // 2, seed=10 + i)
        q2, k2, _, _ = transform_keys(q, k, maps, heads, kv_heads, D)
        assert (k2 - k).abs().max() > 0.1  # the weights really changed
        new.append((q2, k2, v, o))
    logits2, attn2 = _logits(_with_weights(model, new, kv_heads), ids)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=1e-5)
    for a, b in zip(attn2, attn):  # every head's attention weights
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_key_transform_refuses_maps_that_do_not_commute_with_rope(tiny):
    model = tiny()
    q, k, _, _ = _attn(model, 0)
    flip = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64).expand(4, D // 2, 2, 2)
    with pytest.raises(ValueError, match="scaled rotations"):
        transform_keys(q, k, flip, 4, 4, D)


@pytest.mark.parametrize("kind", ["orthogonal", "invertible"])
def test_value_transform_with_o_proj_compensation_keeps_logits(tiny, kind):
    model = tiny(4, 2)
    ids = _ids()
    logits, _ = _logits(model, ids)
    new = []
    for i in range(2):
        q, k, v, o = _attn(model, i)
        u = _random_orthogonal(2, D, 20 + i)
        if kind == "invertible":
            u = u * torch.linspace(0.5, 2.0, D, dtype=torch.float64)
        v2, o2, _ = transform_values(v, o, u, 4, 2, D)
        new.append((q, k, v2, o2))
    logits2, _ = _logits(_with_weights(model, new, 2), ids)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=1e-5)


def test_grouping_permutation_with_g_equal_k_keeps_logits(tiny):
    model = tiny(6, 3)
    ids = _ids()
    logits, _ = _logits(model, ids)
    new = []
    for i, perm in enumerate([(2, 0, 1), (1, 2, 0)]):
        q, k, v, o = _attn(model, i)
        q2, k2, v2, o2, *_ = permute_kv_heads(q, k, v, o, perm, 6, 3, D)
        new.append((q2, k2, v2, o2))
    logits2, _ = _logits(_with_weights(model, new, 3), ids)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=1e-5)
    # The merge's own grouping at G = K changes nothing either.
    q, k, v, o = _attn(model, 0)
    out = align_and_merge_layer(q, k, v, o, None, None, None, 6, 3, 3, D, grouping="similarity")
    assert out.perm == (0, 1, 2)
    for a, b in zip(out[:4], (q, k, v, o)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_similarity_grouping_pairs_related_heads_and_keeps_logits(tiny):
    """Heads 0 and 2 (1 and 3) are transforms of each other: the grouping puts them together, and the
    permutation it chooses, applied without merging (G = K), leaves the model unchanged."""
    model = tiny(4, 4, layers=1)
    q, k, v, o = _attn(model, 0)
    k, v = k.detach().clone(), v.detach().clone()
    kp, vh = to_pairs(k, 4, D), v.reshape(4, D, -1)
    maps = _random_key_maps(2, D // 2, 3).to(k.dtype)
    kp[2], kp[3] = maps[0] @ kp[0], maps[1] @ kp[1]
    u = _random_orthogonal(2, D, 4).to(v.dtype)
    vh[2], vh[3] = u[0] @ vh[0], u[1] @ vh[1]
    k = kp.transpose(1, 2).reshape(4 * D, -1)
    ids = _ids()
    base = _with_weights(model, [(q, k, v, o)], 4)
    logits, _ = _logits(base, ids)
    out = align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 2, D, grouping="similarity",
                                merge="pca", restore="refit")
    assert {frozenset(out.perm[:2]), frozenset(out.perm[2:])} == {frozenset({0, 2}), frozenset({1, 3})}
    q2, k2, v2, o2, *_ = permute_kv_heads(q, k, v, o, out.perm, 4, 4, D)
    logits2, _ = _logits(_with_weights(model, [(q2, k2, v2, o2)], 4), ids)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=1e-5)
    merged, _ = _logits(_with_weights(model, [out[:4]], 2), ids)  # and the merge is exact
    torch.testing.assert_close(merged, logits, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# merges
# ------------------------------------------------------------------------------------------------

CONFIGS = [dict(key_scale=s, reference=r, restore=rs) for s in ("none", "balance", "match")
           for r in ("first", "mean") for rs in ("none", "norm", "refit") if s != "balance" or rs == "refit"]
CONFIGS += [dict(merge="pca", restore="refit"), dict(align="no", restore="refit")]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(c.values()))
def test_identical_heads_pool_exactly(cfg):
    g = _gen(0)
    n, heads, kv = 24, 8, 4
    k1, v1 = torch.randn(D, n, generator=g), torch.randn(D, n, generator=g)
    q, o = torch.randn(heads * D, n, generator=g), torch.randn(n, heads * D, generator=g)
    k, v = k1.repeat(kv, 1), v1.repeat(kv, 1)
    cfg = {**cfg, "align": cfg.get("align") != "no"}
    out = align_and_merge_layer(q, k, v, o, None, None, None, heads, kv, 1, D, **cfg)
    tol = dict(rtol=0, atol=1e-5)
    if cfg.get("merge") == "pca":  # the shared head is a rescaled basis of the copies: compare what heads see
        torch.testing.assert_close(_scores(out.q_w, out.k_w, heads, 1), _scores(q, k, heads, kv), **tol)
        torch.testing.assert_close(_values(out.o_w, out.v_w, heads, 1), _values(o, v, heads, kv), **tol)
        return
    torch.testing.assert_close(out.k_w, k1, **tol)
    torch.testing.assert_close(out.v_w, v1, **tol)
    torch.testing.assert_close(out.q_w, q, **tol)
    torch.testing.assert_close(out.o_w, o, **tol)


def _rope(x, d):
    """transformers' rotate_half RoPE on (..., T, d) at positions 0..T-1 (theta 10000)."""
    t = x.shape[-2]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv  # (T, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _scores(q_w, k_w, heads, kv, q_b=None, k_b=None, x=None):
    """Pre-softmax RoPE scores (H, T, T) of every query head on fixed inputs x."""
    x = torch.randn(10, q_w.shape[1], generator=_gen(99), dtype=torch.float64) if x is None else x
    q = x @ q_w.double().T + (0 if q_b is None else q_b.double())
    k = x @ k_w.double().T + (0 if k_b is None else k_b.double())
    q = _rope(q.reshape(10, heads, D).transpose(0, 1), D)  # (H, T, d)
    k = _rope(k.reshape(10, kv, D).transpose(0, 1), D).repeat_interleave(heads // kv, 0)
    return q @ k.transpose(-1, -2)


def _values(o_w, v_w, heads, kv, v_b=None):
    """Each query head's value-output map O_j V_h(j) (H, n_out, n), bias column appended when present."""
    v = v_w.double() if v_b is None else torch.cat([v_w.double(), v_b.double()[:, None]], 1)
    v = v.reshape(kv, D, -1).repeat_interleave(heads // kv, 0)
    o = o_w.double().reshape(o_w.shape[0], heads, D).transpose(0, 1)
    return o @ v


EXACT = [dict(key_scale="match", restore="none"), dict(key_scale="match", restore="norm"),
         dict(key_scale="match", reference="first"), dict(key_scale="balance", restore="refit"),
         dict(key_scale="none", restore="refit"), dict(merge="pca", restore="refit")]


def _related(k, v, kv, groups, seed):
    """Make each group's heads transforms of its first head: K_h = A K_0 (per-pair scaled rotation),
    V_h = U V_0 (orthogonal); their queries and outputs stay as they were."""
    m = kv // groups
    kp, vh = to_pairs(k.clone(), kv, D), v.clone().reshape(kv, D, -1)
    maps = _random_key_maps(kv, D // 2, seed).to(k.dtype)
    us = _random_orthogonal(kv, D, seed + 1).to(v.dtype)
    for h in range(kv):
        if h % m:
            kp[h] = maps[h] @ kp[h - h % m]
            vh[h] = us[h] @ vh[h - h % m]
    return kp.transpose(1, 2).reshape(k.shape), vh.reshape(v.shape)


@pytest.mark.parametrize("cfg", EXACT, ids=lambda c: "-".join(c.values()))
@pytest.mark.parametrize("groups", [2, 1])
def test_heads_related_by_exact_transforms_merge_exactly(tiny, cfg, groups):
    model = tiny(4, 4)
    ids = _ids()
    layers = []
    for i in range(2):
        q, k, v, o = _attn(model, i)
        k, v = _related(k.detach(), v.detach(), 4, groups, seed=30 + i)
        layers.append((q, k, v, o))
    original = _with_weights(model, layers, 4)
    logits, _ = _logits(original, ids)
    aligned = [align_and_merge_layer(*w, None, None, None, 4, 4, groups, D, **cfg)[:4] for w in layers]
    logits_aligned, _ = _logits(_with_weights(model, aligned, groups), ids)
    torch.testing.assert_close(logits_aligned, logits, rtol=0, atol=1e-5)
    pooled = [(q, pool_heads(k, 4, groups), pool_heads(v, 4, groups), o) for q, k, v, o in layers]
    logits_mean, _ = _logits(_with_weights(model, pooled, groups), ids)
    assert (logits_mean - logits).abs().max() > 1e-2  # plain mean-pooling is not exact here


@pytest.mark.parametrize("metric", [None, "moment", "scale"])
def test_biases_and_metrics_keep_exact_merges_exact(metric):
    """Qwen2-style q/k/v biases get the same row maps; an input metric changes the fit, not exactness."""
    g = _gen(5)
    n, heads, kv, groups = 20, 6, 3, 1
    q, o = torch.randn(heads * D, n, generator=g, dtype=torch.float64), torch.randn(n, heads * D, generator=g,
                                                                                     dtype=torch.float64)
    k, v = torch.randn(kv * D, n + 1, generator=g, dtype=torch.float64), torch.randn(kv * D, n + 1, generator=g,
                                                                                     dtype=torch.float64)
    k, v = _related(k, v, kv, groups, seed=6)  # the bias column is transformed with the rows
    (k, k_b), (v, v_b) = (k[:, :-1], k[:, -1]), (v[:, :-1], v[:, -1])
    q_b = torch.randn(heads * D, generator=g, dtype=torch.float64)
    extra = {}
    if metric == "moment":
        a = torch.randn(n, n, generator=g, dtype=torch.float64)
        extra["input_moment"] = a @ a.T / n + torch.eye(n, dtype=torch.float64)
    elif metric == "scale":
        extra["input_scale"] = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    for cfg in (dict(key_scale="match"), dict(merge="pca", restore="refit")):
        out = align_and_merge_layer(q, k, v, o, q_b, k_b, v_b, heads, kv, groups, D, **cfg, **extra)
        assert out.k_w.shape == (groups * D, n) and out.k_b.shape == (groups * D,)
        torch.testing.assert_close(_scores(out.q_w, out.k_w, heads, groups, out.q_b, out.k_b),
                                   _scores(q, k, heads, kv, q_b, k_b), rtol=1e-7, atol=1e-7)
        torch.testing.assert_close(_values(out.o_w, out.v_w, heads, groups, out.v_b),
                                   _values(o, v, heads, kv, v_b), rtol=1e-7, atol=1e-7)


def test_mean_pooling_without_alignment_is_pool_heads():
    g = _gen(8)
    q, k, v, o = (torch.randn(8 * D, 16, generator=g), torch.randn(4 * D, 16, generator=g),
                  torch.randn(4 * D, 16, generator=g), torch.randn(16, 8 * D, generator=g))
    out = align_and_merge_layer(q, k, v, o, None, None, None, 8, 4, 2, D, align=False, restore="none")
    torch.testing.assert_close(out.k_w, pool_heads(k, 4, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.v_w, pool_heads(v, 4, 2), rtol=0, atol=1e-6)
    assert torch.equal(out.q_w, q) and torch.equal(out.o_w, o)


def test_aligned_merge_lowers_the_weighted_score_error():
    """On unrelated random heads no merge is exact, but the optimal (pca) one beats plain mean-pooling."""
    g = _gen(9)
    q, k, v, o = (torch.randn(4 * D, 32, generator=g, dtype=torch.float64),
                  torch.randn(4 * D, 32, generator=g, dtype=torch.float64),
                  torch.randn(4 * D, 32, generator=g, dtype=torch.float64),
                  torch.randn(32, 4 * D, generator=g, dtype=torch.float64))
    ref_s, ref_v = _scores(q, k, 4, 4), _values(o, v, 4, 4)

    def err(out):
        return ((_scores(out.q_w, out.k_w, 4, 1) - ref_s).norm() / ref_s.norm(),
                (_values(out.o_w, out.v_w, 4, 1) - ref_v).norm() / ref_v.norm())

    mean = err(align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 1, D, align=False, restore="none"))
    pca = err(align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 1, D, merge="pca", restore="refit"))
    assert pca[0] < mean[0] and pca[1] < mean[1]


def test_refusals():
    q, k, v, o = torch.zeros(4 * D, 8), torch.zeros(4 * D, 8), torch.zeros(4 * D, 8), torch.zeros(8, 4 * D)
    with pytest.raises(ValueError, match="k_norm"):
        align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 2, D, k_norm=torch.ones(D))
    with pytest.raises(ValueError, match="restore='refit'"):
        align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 2, D, merge="pca", restore="norm")
    with pytest.raises(ValueError, match="restore='refit'"):
        align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 2, D, key_scale="balance", restore="norm")
    with pytest.raises(ValueError, match="key_scale"):
        align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 2, D, key_scale="big")
    with pytest.raises(ValueError, match="divide"):
        align_and_merge_layer(q, k, v, o, None, None, None, 4, 4, 3, D)
    with pytest.raises(ValueError, match="permutation"):
        permute_kv_heads(q, k, v, o, (0, 0, 1, 2), 4, 4, D)
    assert torch.equal(scaled_rotation(torch.tensor(1.0), torch.tensor(0.0)), torch.eye(2))


@pytest.mark.parametrize("limit", [5000, 0])  # exact search, greedy
def test_similarity_groups_finds_related_heads(limit):
    from gqakit.convert.methods.align import similarity_groups

    g = _gen(11)
    kv, n = 6, 16
    k, v = torch.randn(kv * D, n, generator=g, dtype=torch.float64), torch.randn(kv * D, n, generator=g,
                                                                                 dtype=torch.float64)
    kp, vh = to_pairs(k, kv, D).clone(), v.reshape(kv, D, n).clone()
    maps, us = _random_key_maps(kv, D // 2, 12), _random_orthogonal(kv, D, 13)
    for a, b in ((0, 3), (1, 5), (2, 4)):  # b is an exact transform of a
        kp[b], vh[b] = maps[b] @ kp[a], us[b] @ vh[a]
    qe = torch.rand(kv, D // 2, generator=g, dtype=torch.float64) + 0.5
    oe = torch.eye(D, dtype=torch.float64).expand(kv, D, D)
    perm = similarity_groups(kp, qe, vh, oe, 3, exhaustive_limit=limit)
    assert sorted(perm) == list(range(kv))
    assert {frozenset(perm[i:i + 2]) for i in (0, 2, 4)} == {frozenset(p) for p in ((0, 3), (1, 5), (2, 4))}


@pytest.mark.parametrize("reference", ["first", "mean"])
def test_generalized_procrustes_on_grams_equals_the_direct_iteration(reference):
    """The Gram-space iteration must give the maps of the obvious one: re-align every head to the mean of
    the aligned heads (computed on the blocks themselves) until the mean stops moving."""
    from gqakit.convert.methods.align import generalized_procrustes, orthogonal_from_cross, rotation_from_cross

    gen = torch.Generator().manual_seed(5)
    for blocks, fit, direct_fit in (
        (torch.randn(2, 3, 4, 2, 9, generator=gen, dtype=torch.float64), rotation_from_cross, pair_rotation_to),
        (torch.randn(2, 3, 4, 9, generator=gen, dtype=torch.float64), orthogonal_from_cross, orthogonal_procrustes),
    ):
        ref = blocks[:, :1]
        maps = direct_fit(blocks, ref)
        if reference == "mean":
            for _ in range(20):
                new_ref = (maps @ blocks).mean(dim=1, keepdim=True)
                moved = (new_ref - ref).norm() / new_ref.norm()
                ref = new_ref
                maps = direct_fit(blocks, ref)
                if moved < 1e-12:
                    break
        torch.testing.assert_close(generalized_procrustes(blocks, fit, reference), maps, rtol=0, atol=1e-9)
