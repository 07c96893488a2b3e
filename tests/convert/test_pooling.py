"""Pooling maths on plain tensors (no models)."""
import pytest
import torch

from gqakit.convert.methods.pooling import expand_heads, pool_heads, random_heads, regroup, relative_error
from gqakit.convert.plan import valid_groups

H, D, IN = 8, 4, 6


@pytest.fixture
def w():
    return torch.randn(H * D, IN, generator=torch.Generator().manual_seed(0))


def heads(t, n):
    return t.reshape(n, -1, *t.shape[1:])


def test_valid_groups():
    assert valid_groups(12) == [1, 2, 3, 4, 6, 12]


@pytest.mark.parametrize("method", ["mean", "first"])
def test_groups_equal_heads_is_identity(w, method):
    assert torch.equal(pool_heads(w, H, H, method), w)
    assert torch.equal(regroup(w, H, H, method), w)


def test_one_group_is_mean_of_all_heads(w):
    pooled = pool_heads(w, H, 1)
    assert pooled.shape == (D, IN)
    torch.testing.assert_close(pooled, heads(w, H).mean(0), rtol=0, atol=1e-6)


def test_mean_matches_explicit_loop(w):
    G = 2
    r = H // G
    pooled = heads(pool_heads(w, H, G), G)
    for g in range(G):
        expected = sum(heads(w, H)[h] for h in range(g * r, (g + 1) * r)) / r
        torch.testing.assert_close(pooled[g], expected, rtol=0, atol=1e-6)


def test_first_keeps_each_groups_first_head(w):
    pooled = heads(pool_heads(w, H, 4, "first"), 4)
    for g in range(4):
        assert torch.equal(pooled[g], heads(w, H)[2 * g])


def test_identical_heads_in_a_group_pool_exactly():
    base = torch.randn(2 * D, IN, dtype=torch.bfloat16)
    repeated = expand_heads(base, 2, H)  # each of 2 heads repeated 4x
    assert torch.equal(pool_heads(repeated, H, 2), base)
    assert relative_error(repeated, pool_heads(repeated, H, 2), H) == 0.0


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_expand_then_pool_returns_input(w, groups):
    small = pool_heads(w, H, groups)
    assert torch.equal(pool_heads(expand_heads(small, groups, H), H, groups), small)


def test_expansion_is_contiguous_like_repeat_kv():
    t = torch.arange(2 * D, dtype=torch.float32)  # a bias: 2 heads of D
    out = heads(expand_heads(t, 2, 8), 8)
    for h in range(8):
        assert torch.equal(out[h], heads(t, 2)[h // 4])


def test_bias_and_dtype_preserved():
    b = torch.randn(H * D, dtype=torch.float16)
    out = regroup(b, H, 2)
    assert out.dtype == torch.float16 and out.shape == (2 * D,)


def test_relative_error_of_mean_is_below_first(w):
    # The mean is the least-squares choice of one head per group, so it beats keeping one head.
    assert relative_error(w, pool_heads(w, H, 2, "mean"), H) < relative_error(w, pool_heads(w, H, 2, "first"), H)


def test_random_heads_seeded():
    a = random_heads((8, 3), 0.02, 7, torch.float32)
    assert torch.equal(a, random_heads((8, 3), 0.02, 7, torch.float32))
    assert not torch.equal(a, random_heads((8, 3), 0.02, 8, torch.float32))
    assert 0.01 < a.std().item() < 0.04


def test_bad_regroup_raises(w):
    with pytest.raises(ValueError):
        regroup(w, H, 3)
    with pytest.raises(ValueError):
        pool_heads(w, H, 2, "median")
