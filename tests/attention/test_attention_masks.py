"""MaskSpec: elementwise rule against brute force, exact analytic block bounds, transformers interop."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.masking_utils import and_masks, padding_mask_function, sdpa_mask

from gqakit.attention.masks import AttentionOptionError, MaskSpec
from gqakit.common.errors import GqakitError

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
    MaskSpec(chunk=4),
    MaskSpec(causal=False, chunk=5),
    MaskSpec(summary=(5, 2)),
    MaskSpec(causal=False, summary=(4, 1), window=9),
    MaskSpec(window=5, parts=(MaskSpec(dilation=4),)),  # Sparse Transformer strided, l = 4
    MaskSpec(chunk=4, parts=(MaskSpec(summary=(4, 1)),)),  # fixed, l = 4, c = 1
    MaskSpec(causal=False, window=2, global_tokens=(3,), parts=(MaskSpec(causal=False, chunk=6, sinks=1),)),
]


def brute_force(spec: MaskSpec, q_pos: list[int], k_pos: list[int]) -> torch.Tensor:
    """The documented semantics, written out pair by pair."""
    out = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
    for i, q in enumerate(q_pos):
        for j, k in enumerate(k_pos):
            for atom in (spec, *spec.parts):
                if atom.causal and k > q:
                    continue
                dist = q - k if atom.causal else abs(q - k)
                in_window = atom.window is None or dist < atom.window
                local = in_window and dist % atom.dilation == 0
                local = local and (atom.chunk is None or q // atom.chunk == k // atom.chunk)
                local = local and (atom.summary is None or k % atom.summary[0] >= atom.summary[0] - atom.summary[1])
                out[i, j] |= local or k < atom.sinks or k in atom.global_tokens or q in atom.global_tokens
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
    (dict(chunk=0), "chunk"), (dict(summary=(0, 1)), "stride l=0"), (dict(summary=(4, 5)), "between 1 and"),
    (dict(summary=(4, 0)), "between 1 and"), (dict(summary=(4,)), "pair"), (dict(window=2.5), "integer"),
    (dict(parts=(MaskSpec(causal=False),)), "share causal"), (dict(parts=("window",)), "must be MaskSpecs"),
])
def test_validate_names_the_fix(kwargs, word):
    with pytest.raises(AttentionOptionError, match=word) as info:
        MaskSpec(**kwargs).validate()
    assert "\n" not in str(info.value) and isinstance(info.value, (ValueError, GqakitError))


def test_parts_are_flattened_and_compare_by_value():
    inner = MaskSpec(dilation=3, parts=(MaskSpec(chunk=2),))
    spec = MaskSpec(window=4, parts=(inner,))
    assert spec.parts == (MaskSpec(dilation=3), MaskSpec(chunk=2))
    assert spec == MaskSpec(window=4, parts=[MaskSpec(dilation=3), MaskSpec(chunk=2)])
    assert spec.atoms() == (MaskSpec(window=4), MaskSpec(dilation=3), MaskSpec(chunk=2))


def test_global_tokens_normalised_and_hashable():
    assert MaskSpec(global_tokens=[5, 1, 5]).global_tokens == (1, 5)
    assert hash(MaskSpec(window=4)) == hash(MaskSpec(window=4))


def _random_spec(rng: random.Random, causal: bool | None = None) -> MaskSpec:
    causal = rng.random() < 0.7 if causal is None else causal
    spec = MaskSpec(
        causal=causal,
        window=rng.choice([None, 1, 2, 5, 9, 17]),
        dilation=rng.choice([1, 1, 2, 3, 7, 13]),
        global_tokens=tuple(rng.sample(range(40), rng.choice([0, 0, 1, 2]))),
        sinks=rng.choice([0, 0, 1, 4]),
        chunk=rng.choice([None, None, 1, 3, 8]),
        summary=rng.choice([None, None, (5, 2), (8, 1), (3, 3), (16, 4)]),
    )
    if rng.random() < 0.3:  # a union
        spec = MaskSpec(**{f: getattr(spec, f) for f in ("causal", "window", "dilation", "global_tokens", "sinks",
                                                         "chunk", "summary")}, parts=(_random_spec(rng, causal),))
    return spec


def test_block_ranges_are_exactly_the_touched_blocks():
    """kv_block_ranges returns exactly the blocks with an allowed entry; block_is_empty is exact and
    block_is_full never claims a block that has a disallowed entry."""
    rng = random.Random(0)
    for _ in range(400):
        spec = _random_spec(rng)
        tq, tk = rng.randint(1, 40), rng.randint(1, 40)
        q_off, kv_off = rng.randint(0, 12), rng.randint(0, 12)
        bq, bk = rng.choice([1, 3, 8, 16]), rng.choice([1, 4, 7, 16])
        dense = spec.mask(torch.arange(q_off, q_off + tq), torch.arange(kv_off, kv_off + tk))
        for q0 in range(0, tq, bq):
            q1 = min(q0 + bq, tq)
            ranges = spec.kv_block_ranges(q0 + q_off, q1 + q_off, kv_off, kv_off + tk, bk)
            touched = [(kv_off + a, kv_off + min(a + bk, tk)) for a in range(0, tk, bk) if dense[q0:q1, a:a + bk].any()]
            assert ranges == touched, (spec, tq, tk, q_off, kv_off, bq, bk, q0)
            for a in range(0, tk, bk):
                block = dense[q0:q1, a:a + bk]
                lo, hi = kv_off + a, kv_off + min(a + bk, tk)
                assert spec.block_is_empty(q0 + q_off, q1 + q_off, lo, hi) == (not block.any()), (spec, q0, a)
                if spec.block_is_full(q0 + q_off, q1 + q_off, lo, hi):
                    assert block.all(), (spec, q0, a)


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
