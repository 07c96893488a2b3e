"""One layer's aligned or fitted merge (`--method aligned|fit`, and the start of `transfer`): q/k/v/o in, merged
q/k/v/o out, with the errors the model card reports. Pure tensor maths: the weights, the options of the method's
table row, and optionally the calibration statistics and held-out windows, read through callables."""
from __future__ import annotations

import math
from typing import Callable

import torch

from gqakit.common.errors import GqakitError, opt
from gqakit.convert import methods
from gqakit.convert.calibration.moments import logit_error
from gqakit.convert.methods.align import check_merge_options, coordinates, merge_coordinates, permute_kv_heads
from gqakit.convert.methods.grams import IndefiniteMetric, Metric, key_side, moment_metric, value_side
from gqakit.convert.methods.pooling import regroup
from gqakit.convert.plan import Plan


RIDGES = (1e-6, 1e-4, 1e-2)  # a calibrated metric's ridge (times its mean diagonal), tried in turn


def key_metric(key: torch.Tensor | None, n: int, with_bias: bool, ridge: float = RIDGES[0]) -> Metric:
    """Keys are compared in the attention-weighted covariance of the inputs each query sees; a key (or query)
    bias shifts all of a query's logits alike, so its coordinate gets the average weight of an input direction."""
    if key is None:
        return Metric(n, with_bias)
    return moment_metric(key, with_bias, corner=float(key.diagonal().to(torch.float64).mean()), ridge=ridge)


def value_metric(value: torch.Tensor | None = None, value_mean: torch.Tensor | None = None, *, n: int,
                 with_bias: bool, ridge: float = RIDGES[0]) -> Metric:
    """Values are compared in the second moment of the attention-averaged input, (x, 1) with a v_proj bias."""
    if value is None:
        return Metric(n, with_bias)
    return moment_metric(value, with_bias, cross=value_mean, ridge=ridge)


def merge_layer(plan: Plan, weights: dict[str, torch.Tensor], grouping: str = "similarity",
                stats: Callable[[tuple[str, ...]], dict[str, torch.Tensor]] | None = None,
                heldout: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A merge of one layer by plan.method ("aligned" or "fit"): {'q_w', 'k_w', 'v_w', 'o_w', optional
    biases} -> the same keys, and for the card the relative error of the maps each query head computes
    (`bilinear_error`) and, with held-out calibration windows, of its attention logits.

    `stats(names)` reads calibration statistics ('key', 'value', 'value_mean'), one metric at a time, dropped
    once its Grams exist; from the calibration folder an n x n statistic is read in row blocks as the metric
    is applied, never whole."""
    H, K, G, d = plan.num_attention_heads, plan.num_key_value_heads, plan.groups, plan.head_dim
    check_merge_options(H, K, G, grouping=grouping, **methods.get(plan.method).merge)
    q_w, k_w, v_w, o_w = (weights[key] for key in ("q_w", "k_w", "v_w", "o_w"))
    q_b, k_b, v_b = (weights.get(key) for key in ("q_b", "k_b", "v_b"))
    n = k_w.shape[1]
    read = stats if stats is not None else (lambda names: {})
    # Each statistic lives only while its Grams are computed; the (K d)^2 value Gram only until the factors exist.
    # A calibrated metric whose float32 rounding the smallest ridge does not cover gets the next one.
    ridges = RIDGES if stats is not None else RIDGES[:1]  # weights alone: the identity metric, no ridge to raise
    for ridge in ridges:
        try:
            keys = key_side(q_w, q_b, k_w, k_b, key_metric(read(("key",)).get("key"), n, q_b is not None or
                                                           k_b is not None, ridge), H, K, d)
            values = value_side(v_w, v_b, o_w, value_metric(**read(("value", "value_mean")), n=n,
                                                            with_bias=v_b is not None, ridge=ridge), H, K, d)
            coords = coordinates(keys, values, K, G, d, grouping)
            break
        except IndefiniteMetric:
            keys = values = None
            if ridge == ridges[-1]:
                raise GqakitError(f"the merge's metric is not positive semi-definite even with a ridge of {ridge:g} x "
                                  f"its mean diagonal; recalibrate ({opt('calibration_tokens')}) or use "
                                  f"{opt('method', 'aligned')} without {opt('calibration')}") from None
    del keys, values
    merged = merge_coordinates(q_w, k_w, v_w, o_w, q_b, k_b, v_b, coords, H, K, G, d, **methods.get(plan.method).merge)
    del coords
    out = {key: getattr(merged, key) for key in weights}
    # query head j of the merged layer is the original head order[j] (grouping by similarity permutes whole
    # K/V heads with their query heads): compare through views, never a permuted copy of the weights
    r = H // K
    order = [merged.perm[j // r] * r + j % r for j in range(H)]
    errors = {
        "k": bilinear_error(q_w.reshape(H, d, -1), k_w.reshape(K, d, -1), out["q_w"].reshape(H, d, -1),
                            out["k_w"].reshape(G, d, -1), order),
        "v": bilinear_error(o_w.reshape(-1, H, d).permute(1, 2, 0), v_w.reshape(K, d, -1),
                            out["o_w"].reshape(-1, H, d).permute(1, 2, 0), out["v_w"].reshape(G, d, -1), order),
    }
    if heldout is not None:  # the same measure for mean-pooling, which a merge sold as better must not lose to
        pooled = (q_w, regroup(k_w, K, G, "mean"), q_b, None if k_b is None else regroup(k_b, K, G, "mean"))
        errors["logits_mean"] = logit_error(heldout, (q_w, k_w, q_b, k_b), pooled, H, K, G, d)
        del pooled
        q_w, k_w, _, _, q_b, k_b, _ = permute_kv_heads(q_w, k_w, v_w, o_w, merged.perm, H, K, d, q_b, k_b, v_b)
        errors["logits"] = logit_error(heldout, (q_w, k_w, q_b, k_b),
                                       (out["q_w"], out["k_w"], out.get("q_b"), out.get("k_b")), H, K, G, d)
    return out, errors


def bilinear_error(a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
                   order: list[int] | None = None) -> float:
    """sqrt(sum_j ||A_j^T B_h(j) - A2_j^T B2_g(j)||^2 / sum_j ||A_j^T B_h(j)||^2) over query heads j, with
    A (H, d, m) and B (K, d, n): the error of each head's key map q^T k (A = q rows, B = k rows) or value
    map O V (A = o columns transposed). `order[j]`: the head of A (and its K/V head of B) that merged head j
    replaces (identity when None). From d x d Gram products, one head in float64 at a time, never an m x n
    matrix (views of the stored weights in, no whole float64 copy)."""
    H, K, G = a.shape[0], b.shape[0], b2.shape[0]
    order = list(range(H)) if order is None else order

    def f64(t):
        return t.to(torch.float64)

    bb = [f64(x) @ f64(x).T for x in b]  # (d, d) per K/V head
    bb2 = [f64(x) @ f64(x).T for x in b2]
    bb_cross: dict[tuple[int, int], torch.Tensor] = {}  # B_h B2_g^T, once per (original, merged) K/V head pair
    ref = diff = 0.0
    for j in range(H):
        i = order[j]
        h, g = i // (H // K), j // (H // G)
        if (h, g) not in bb_cross:
            bb_cross[h, g] = f64(b[h]) @ f64(b2[g]).T
        aj, a2j = f64(a[i]), f64(a2[j])
        own = float(((aj @ aj.T) * bb[h]).sum())
        cross = float(((aj @ a2j.T) * bb_cross[h, g]).sum())  # tr(B^T A A2^T B2)
        ref += own
        diff += own + float(((a2j @ a2j.T) * bb2[g]).sum()) - 2 * cross
    return math.sqrt(max(diff, 0.0) / max(ref, 1e-300))
