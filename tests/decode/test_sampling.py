"""`decode.sampling`: many rows sampled from a start token through a static cache, against the slow reference.

Tiny random fp32 Llama (hidden 32, 4 heads, vocab 64). The reference runs the model's full forward over the
sequence so far at every step, no cache, and draws with the same per-row generators, so equal tokens mean equal
logits up to the last bits (the draws would part at the first token where they differ).
"""
from __future__ import annotations

import pytest
import torch

from gqakit.decode.sampling import draw, reference_tokens, row_generators, sample_tokens
from gqakit.hf.loading import end_token_ids

START, EOS = 1, 2


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=START, eos_token_id=EOS, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


SETTINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 3}, id="sampled"),
    pytest.param({"temperature": 0.7, "top_p": 0.8, "seed": 5}, id="temperature-top-p"),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("cache, split", [("static", None), ("static", 1), ("static", 3), ("dynamic", 2)])
def test_equals_the_full_forward_reference(model, settings, cache, split):
    fast = sample_tokens(model, START, 5, 24, cache=cache, split=split, **settings)
    slow = reference_tokens(model, START, 5, 24, **settings)
    assert fast.shape == (5, 24) and torch.equal(fast, slow)
    assert not (fast == EOS).any()  # held back, as generate's min_new_tokens holds it


def test_sampling_is_seeded_per_row_and_leaves_the_global_rng(model):
    state = torch.get_rng_state()
    first = sample_tokens(model, START, 6, 16, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(sample_tokens(model, START, 6, 16, seed=1), first)
    assert not torch.equal(sample_tokens(model, START, 6, 16, seed=2), first)
    # a row depends on the seed and its index, not on the rows drawn beside it
    assert torch.equal(sample_tokens(model, START, 2, 16, seed=1, first_row=4), first[4:])
    assert len({tuple(r) for r in first.tolist()}) == 6


def test_the_end_token_is_never_drawn_even_where_likely(model):
    head = model.get_output_embeddings()
    bias = torch.zeros(64)
    bias[EOS] = 50.0
    head.bias = torch.nn.Parameter(bias)
    try:
        ids = sample_tokens(model, START, 3, 12, seed=0)
        assert not (ids == EOS).any()
        assert torch.equal(ids, reference_tokens(model, START, 3, 12, seed=0))
        assert (sample_tokens(model, START, 3, 12, seed=0, banned=[]) == EOS).any()  # without the ban it would be
    finally:
        head.bias = None


def test_end_tokens_read_the_generation_config_first(model):
    assert end_token_ids(model) == [EOS]
    model.generation_config.eos_token_id = [EOS, 7]
    try:
        assert end_token_ids(model) == [EOS, 7]
    finally:
        model.generation_config.eos_token_id = EOS
    import types

    bare = types.SimpleNamespace(generation_config=None, config=types.SimpleNamespace(eos_token_id=None))
    assert end_token_ids(bare, types.SimpleNamespace(eos_token_id=5)) == [5]  # the tokenizer's, when no config says
    assert end_token_ids(bare) == []


def test_top_p_keeps_the_nucleus_and_banned_ids_never():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, 2.0]]).repeat(200, 1)
    before = logits.clone()
    picks = draw(logits, [0], 1.0, 0.6, row_generators(0, range(200)))
    # without token 0, token 1 holds ~0.7 of the mass: top-p 0.6 keeps it alone
    assert set(picks.tolist()) == {1} and torch.equal(logits, before)
    picks = draw(logits, [], 1.0, 1.0, row_generators(0, range(200)))
    assert set(picks.tolist()) >= {0, 1, 4}  # the likely ones all drawn: nothing cut at top-p 1


def test_compile_needs_the_static_cache(model):
    with pytest.raises(ValueError, match="cache='static'"):
        sample_tokens(model, START, 1, 2, cache="dynamic", compile=True)


def test_draws_follow_the_distribution():
    """The inverse-CDF draw samples softmax(logits / T) over the tokens not banned: frequencies of 20,000 rows
    within 5 standard errors of the probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    rows = 20_000
    picks = draw(logits.repeat(rows, 1), [3], 0.8, 1.0, row_generators(7, range(rows)))
    probs = torch.softmax((logits / 0.8).index_fill(-1, torch.tensor([3]), float("-inf")), dim=-1)[0].double()
    freq = torch.bincount(picks, minlength=6).double() / rows
    assert freq[3] == 0
    assert bool(((freq - probs).abs() <= 5 * (probs * (1 - probs) / rows).sqrt() + 1e-12).all()), (freq, probs)
