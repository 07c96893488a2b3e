"""Metric Grams in blocks (gqakit.convert.methods.grams) against explicit whitening, and the merge's stages."""
import pytest
import torch

from gqakit.convert.methods import grams
from gqakit.convert.methods.align import align_and_merge_layer, permute_kv_heads
from gqakit.convert.methods.grams import Metric, factor, gram, metric_from_matrix, row_energies
from gqakit.convert.methods.layer import bilinear_error

F64 = torch.float64


def _psd(n, rank, gen):
    a = torch.randn(n, rank, generator=gen, dtype=F64)
    return a @ a.T / rank


def _explicit(w, b, matrix):
    """The obvious computation: augment the rows, multiply by the full (n+1)^2 metric, symmetrised."""
    rows = w if b is None else torch.cat([w, b[:, None]], 1)
    m = (matrix + matrix.T) / 2
    return rows @ m @ rows.T


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["identity", "moment", "augmented", "scale"])
def test_blocked_gram_equals_the_explicit_product(monkeypatch, bias, kind):
    monkeypatch.setattr(grams, "BLOCK", 3)  # many row and column blocks, ragged at the end
    gen = torch.Generator().manual_seed(0)
    n, rows = 10, 14
    w = torch.randn(rows, n, generator=gen, dtype=F64)
    b = torch.randn(rows, generator=gen, dtype=F64) if bias else None
    size = n + int(bias)
    moment = scale = None
    if kind == "moment":
        moment = _psd(n, 4, gen)  # singular: the ridge matters
        moment[0, 1] += 1e-3  # not exactly symmetric, as a float32 sum is not
    elif kind == "augmented":
        moment = _psd(n + 1, 6, gen)  # for (x, 1): refused when the rows have no bias column
    elif kind == "scale":
        scale = torch.rand(n, generator=gen, dtype=F64) + 0.5
    if kind == "augmented" and not bias:
        with pytest.raises(ValueError, match="shape"):
            metric_from_matrix(n, bias, moment, scale)
        return
    metric = metric_from_matrix(n, bias, moment, scale)
    if kind == "identity":
        full = torch.eye(size, dtype=F64)
    elif kind == "scale":
        full = torch.diag(torch.cat([scale.pow(2), torch.ones(int(bias), dtype=F64)]))
    elif moment.shape[0] == size:
        full = moment.clone()
    else:
        full = torch.block_diag(moment, torch.ones(int(bias), int(bias), dtype=F64))
    if kind != "identity":  # the ridge: 1e-6 of the symmetrised metric's mean diagonal
        full = full + 1e-6 * full.diagonal().mean() * torch.eye(size, dtype=F64)
    expected = _explicit(w, b, full)
    torch.testing.assert_close(gram(w, b, metric), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(row_energies(w, b, metric), expected.diagonal(), rtol=1e-12, atol=1e-12)


def test_float32_statistic_gives_the_float64_gram_of_its_values():
    """A statistic stored in float32 is converted block by block, not rounded again: same Gram as its float64."""
    gen = torch.Generator().manual_seed(1)
    n = 12
    moment = _psd(n, 20, gen).float()
    w = torch.randn(8, n, generator=gen).to(torch.bfloat16)
    g32 = gram(w, None, metric_from_matrix(n, False, moment, None))
    g64 = gram(w, None, metric_from_matrix(n, False, moment.double(), None))
    torch.testing.assert_close(g32, g64, rtol=1e-13, atol=1e-13)


def test_factor_keeps_inner_products_and_maps_coordinates_back_to_rows():
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(6, 9, generator=gen, dtype=F64)
    rows[4] = rows[0] - 2 * rows[1]  # rank-deficient, as identical heads are
    g = rows @ rows.T
    y, back = factor(g)
    torch.testing.assert_close(y @ y.T, g, rtol=0, atol=1e-12)
    combo = torch.randn(2, 6, generator=gen, dtype=F64)
    coef = (combo @ y) @ back  # coordinates of two combinations -> coefficients over the rows
    torch.testing.assert_close(coef @ rows, combo @ rows, rtol=0, atol=1e-10)


def test_factor_refuses_an_indefinite_metric():
    with pytest.raises(ValueError, match="positive semi-definite"):
        factor(torch.diag(torch.tensor([1.0, -0.5], dtype=F64)))
    with pytest.raises(ValueError, match="positive semi-definite"):
        align_and_merge_layer(*(torch.randn(4 * 8, 6, dtype=F64) for _ in range(3)), torch.randn(6, 32, dtype=F64),
                              None, None, None, 4, 4, 2, 8, input_moment=-torch.eye(6, dtype=F64))


def test_identity_metric_is_not_copied():
    w = torch.randn(3, 4, dtype=F64)
    assert Metric(4, False).apply(w) is w


def test_bilinear_error_in_merge_order_equals_permuted_copies():
    """`order` compares merged head j with original head order[j]: the same number as permuting the originals."""
    gen = torch.Generator().manual_seed(3)
    heads, kv, groups, d, n = 8, 4, 2, 8, 16
    q, k, v = (torch.randn(x * d, n, generator=gen, dtype=F64) for x in (heads, kv, kv))
    o = torch.randn(n, heads * d, generator=gen, dtype=F64)
    out = align_and_merge_layer(q, k, v, o, None, None, None, heads, kv, groups, d, grouping="similarity")
    assert out.perm != tuple(range(kv))  # the case that needs the order
    r = heads // kv
    order = [out.perm[j // r] * r + j % r for j in range(heads)]
    qp, kp, vp, op, *_ = permute_kv_heads(q, k, v, o, out.perm, heads, kv, d)
    for a, b, a2, b2 in ((q.reshape(heads, d, n), k.reshape(kv, d, n), out.q_w.reshape(heads, d, n),
                          out.k_w.reshape(groups, d, n)),):
        copied = bilinear_error(qp.reshape(heads, d, n), kp.reshape(kv, d, n), a2, b2)
        assert bilinear_error(a, b, a2, b2, order) == pytest.approx(copied, rel=1e-12)
    o_view = o.reshape(n, heads, d).permute(1, 2, 0)
    o2 = out.o_w.reshape(n, heads, d).permute(1, 2, 0)
    copied = bilinear_error(op.reshape(n, heads, d).permute(1, 2, 0), vp.reshape(kv, d, n), o2,
                            out.v_w.reshape(groups, d, n))
    assert bilinear_error(o_view, v.reshape(kv, d, n), o2, out.v_w.reshape(groups, d, n), order) == \
        pytest.approx(copied, rel=1e-12)


@pytest.mark.parametrize("cfg", [{}, {"merge": "pca", "restore": "refit"}])
def test_sixteen_bit_weights_merge_to_the_float64_merge_rounded(cfg):
    """Of 16-bit weights the value Gram is kept in float32: the result is the float64 merge of the same weights
    rounded to bf16 (the difference is below 1e-4 relative, where bf16's own rounding is about 2e-3)."""
    gen = torch.Generator().manual_seed(7)
    heads, kv, groups, d, n = 8, 8, 2, 16, 64
    q, k, v = (torch.randn(x * d, n, generator=gen).to(torch.bfloat16) for x in (heads, kv, kv))
    o = torch.randn(n, heads * d, generator=gen).to(torch.bfloat16)
    x = torch.randn(200, n, generator=gen)
    moment = x.T @ x / 200
    got = align_and_merge_layer(q, k, v, o, None, None, None, heads, kv, groups, d, grouping="similarity",
                                input_moment=moment, **cfg)
    want = align_and_merge_layer(q.double(), k.double(), v.double(), o.double(), None, None, None, heads, kv, groups,
                                 d, grouping="similarity", input_moment=moment.double(), **cfg)
    assert got.perm == want.perm
    for field in ("q_w", "k_w", "v_w", "o_w"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == torch.bfloat16
        assert (a.double() - b.to(torch.bfloat16).double()).norm() <= 1e-4 * b.norm(), field
