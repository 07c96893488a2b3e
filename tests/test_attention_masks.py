"""MaskSpec: elementwise rule against brute force, analytic block bounds, transformers interop."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.masking_utils import and_masks, padding_mask_function, sdpa_mask

from gqakit.attention.masks import MaskSpec

SPECS = [
    MaskSpec(),
    MaskSpec(causal=False),
    MaskSpec(window=1),
    MaskSpec(window=4),
    MaskSpec(causal=False, window=3),
    MaskSpec(dilation=3),
    MaskSpec(window=7, dilation=2),
    MaskSpec(causal=False, window=5, dilation=2),
    MaskSpec(global_tokens=(0, 6)),
    MaskSpec(causal=False, window=2, global_tokens=(4, 11)),
    MaskSpec(sinks=3),
    MaskSpec(window=3, sinks=2),
    MaskSpec(window=4, dilation=2, sinks=1, global_tokens=(9,)),
    MaskSpec(causal=False, window=3, dilation=2, sinks=2, global_tokens=(1, 13)),
]


def brute_force(spec: MaskSpec, q_pos: list[int], k_pos: list[int]) -> torch.Tensor:
    """The documented semantics, written out pair by pair."""
    out = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
    for i, q in enumerate(q_pos):
        for j, k in enumerate(k_pos):
            if spec.causal and k > q:
                continue
            dist = q - k if spec.causal else abs(q - k)
            in_window = spec.window is None or dist < spec.window
            local = in_window and dist % spec.dilation == 0
            out[i, j] = local or k < spec.sinks or k in spec.global_tokens or q in spec.global_tokens
    return out


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("q_off, tq, kv_off, tk", [(0, 16, 0, 16), (10, 3, 0, 13), (5, 7, 2, 9)])
def test_mask_matches_brute_force(spec, q_off, tq, kv_off, tk):
    q_pos, k_pos = list(range(q_off, q_off + tq)), list(range(kv_off, kv_off + tk))
    got = spec.mask(torch.tensor(q_pos), torch.tensor(k_pos))
    assert got.dtype == torch.bool and got.shape == (tq, tk)
    assert torch.equal(got, brute_force(spec, q_pos, k_pos))


def test_window_semantics_by_example():
    # Mistral: window 3 sees itself and the 2 tokens before it.
    m = MaskSpec(window=3).mask(torch.arange(5), torch.arange(5))
    assert m[4].tolist() == [False, False, True, True, True]
    # dilation 2 within window 5: every other token.
    m = MaskSpec(window=5, dilation=2).mask(torch.arange(5), torch.arange(5))
    assert m[4].tolist() == [True, False, True, False, True]


@pytest.mark.parametrize("kwargs, word", [
    (dict(window=0), "window"), (dict(window=-2), "window"), (dict(dilation=0), "dilation"),
    (dict(sinks=-1), "sinks"), (dict(global_tokens=(3, -1)), "global_tokens"),
])
def test_validate_names_the_fix(kwargs, word):
    with pytest.raises(ValueError, match=word) as info:
        MaskSpec(**kwargs).validate()
    assert "\n" not in str(info.value)


def test_global_tokens_normalised_and_hashable():
    assert MaskSpec(global_tokens=[5, 1, 5]).global_tokens == (1, 5)
    assert hash(MaskSpec(window=4)) == hash(MaskSpec(window=4))


def _random_spec(rng: random.Random) -> MaskSpec:
    return MaskSpec(
        causal=rng.random() < 0.7,
        window=rng.choice([None, 1, 2, 5, 9, 17]),
        dilation=rng.choice([1, 1, 2, 3]),
        global_tokens=tuple(rng.sample(range(40), rng.choice([0, 0, 1, 2]))),
        sinks=rng.choice([0, 0, 1, 4]),
    )


def test_block_ranges_never_drop_an_allowed_entry():
    rng = random.Random(0)
    for _ in range(150):
        spec = _random_spec(rng)
        tq, tk = rng.randint(1, 40), rng.randint(1, 40)
        q_off, kv_off = rng.randint(0, 12), rng.randint(0, 12)
        bq, bk = rng.choice([1, 3, 8, 16]), rng.choice([1, 4, 7, 16])
        dense = spec.mask(torch.arange(q_off, q_off + tq), torch.arange(kv_off, kv_off + tk))
        for q0 in range(0, tq, bq):
            q1 = min(q0 + bq, tq)
            ranges = spec.kv_block_ranges(q0 + q_off, q1 + q_off, kv_off, kv_off + tk, bk)
            visited = torch.zeros(tk, dtype=torch.bool)
            for a, b in ranges:
                assert kv_off <= a < b <= kv_off + tk and (a - kv_off) % bk == 0
                visited[a - kv_off:b - kv_off] = True
                if spec.block_is_full(q0 + q_off, q1 + q_off, a, b):
                    assert dense[q0:q1, a - kv_off:b - kv_off].all(), (spec, q0, a)
            assert not (dense[q0:q1] & ~visited).any(), (spec, tq, tk, q_off, kv_off, bq, bk, q0)
            assert ranges == sorted(set(ranges))


@pytest.mark.parametrize("sinks", [0, 4])
def test_window_skips_blocks(sinks):
    T, W, b = 1024, 64, 32
    nblocks = T // b

    def visits(spec):
        return sum(len(spec.kv_block_ranges(q0, q0 + b, 0, T, b)) for q0 in range(0, T, b))

    full = visits(MaskSpec())
    windowed = visits(MaskSpec(window=W, sinks=sinks))
    assert full == nblocks * (nblocks + 1) // 2  # causal skipping alone
    assert windowed <= nblocks * (W // b + 1 + (sinks > 0))  # O(T * W / b^2)
    assert windowed * 4 < full


def test_block_is_full_cases():
    causal = MaskSpec()
    assert causal.block_is_full(8, 16, 0, 8) and causal.block_is_full(8, 16, 0, 9)
    assert not causal.block_is_full(8, 16, 0, 10)  # key 9 is after query 8
    assert MaskSpec(window=16).block_is_full(16, 24, 8, 16)  # 23 - 8 = 15 < 16
    assert not MaskSpec(window=16).block_is_full(16, 24, 7, 16)  # query 23 cannot see key 7
    assert not MaskSpec(dilation=2).block_is_full(8, 16, 0, 8)
    assert MaskSpec(window=2, sinks=8).block_is_full(100, 110, 0, 8)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("use_vmap", [False, True])
def test_mask_function_agrees_through_sdpa_mask(spec, use_vmap):
    tq, tk, q_off = 6, 15, 9
    got = sdpa_mask(batch_size=1, q_length=tq, kv_length=tk, q_offset=q_off, kv_offset=0,
                    mask_function=spec.mask_function(), allow_is_causal_skip=False, use_vmap=use_vmap)
    want = spec.mask(torch.arange(q_off, q_off + tq), torch.arange(tk))
    assert got.shape == (1, 1, tq, tk)
    assert torch.equal(got[0, 0], want)


def test_mask_function_composes_with_padding():
    spec = MaskSpec(window=3, sinks=1)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    fn = and_masks(spec.mask_function(), padding_mask_function(padding))
    got = sdpa_mask(batch_size=2, q_length=7, kv_length=7, mask_function=fn, allow_is_causal_skip=False)
    want = spec.mask(torch.arange(7), torch.arange(7))[None] & padding[:, None, :]
    assert torch.equal(got[:, 0], want)
    # transformers' own padding path (attention_mask=...) gives the same
    got2 = sdpa_mask(batch_size=2, q_length=7, kv_length=7, mask_function=spec.mask_function(),
                     attention_mask=padding, allow_is_causal_skip=False)
    assert torch.equal(got2[:, 0], want)
