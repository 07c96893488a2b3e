"""What gqakit attention does not implement is refused, never dropped (a model passing any of it gave logits
that differed from eager by more than the logits themselves, with no error, before these checks).

Soft-capping, sink logits, bidirectional attention, a caller's 4-D mask and cu_seq_lens packing used to be
refused here and are now implemented: tests/attention/test_attention_features.py checks them against eager."""
from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers

from gqakit.hf.compat import cache_keyword, cache_kwargs
from gqakit.attention import use
from gqakit.attention.registration import UNSUPPORTED, _make_attention
from gqakit.common.errors import GqakitError

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def _ids():
    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


class _Attn(torch.nn.Module):
    """Stands in for a transformers attention module (what the attention functions read from it)."""

    def __init__(self):
        super().__init__()
        self.is_causal, self.config = True, types.SimpleNamespace()


def _qkv(B=1, T=8):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, 4, T, 8, generator=gen), torch.randn(B, 2, T, 8, generator=gen), \
        torch.randn(B, 2, T, 8, generator=gen)


@pytest.mark.parametrize("key", sorted(UNSUPPORTED))
def test_unimplemented_keywords_are_refused_at_the_forward(key):
    """Position biases (T5's position_bias passes through transformers' attention interface today), ALiBi, head
    masks and per-position sink tensors change the result and are not implemented: one line, naming the fix."""
    with pytest.raises(GqakitError, match=f"_Attn passes {key} .*attn_implementation='sdpa'") as info:
        _make_attention("tiled")(_Attn(), *_qkv(), None, **{key: torch.zeros(1, 4, 8, 8)})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["tiled", "sliding"])
def test_output_attentions_is_refused_through_a_real_model(kind):
    """output_attentions=True came back as an empty tuple, silently (sdpa at least warns): the kernels never form the
    weights, so the request is refused in one line; False or absent runs as before."""
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL))
    use(model, kind, **({"window": 4} if kind == "sliding" else {}))
    assert model(_ids(), output_attentions=False).logits.shape == (1, 8, 64)
    with pytest.raises(GqakitError, match=r"output_attentions=True.*attn_implementation='eager'") as info:
        model(_ids(), output_attentions=True)
    assert "\n" not in str(info.value)


def test_a_callers_4d_mask_that_does_not_fit_is_refused_and_a_2d_padding_mask_is_honoured():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).eval()
    ids = _ids()
    padding = torch.ones(1, 8, dtype=torch.long)
    padding[0, :2] = 0
    eager = model(ids, attention_mask=padding).logits
    use(model, "tiled")
    torch.testing.assert_close(model(ids, attention_mask=padding).logits[0, 2:], eager[0, 2:], atol=1e-5, rtol=1e-5)
    for mask, needle in ((torch.zeros(1, 1, 8, 9), r"attn_mask of shape \(1, 1, 8, 9\)"),
                         (torch.ones(1, 1, 8, 8, dtype=torch.long), "pass a bool .True = attend. or additive float"),
                         (torch.zeros(1, 1, 8, 8, requires_grad=True), "requires grad")):
        with pytest.raises(GqakitError, match=needle) as info:
            model(ids, attention_mask=mask)
        assert "\n" not in str(info.value)


def test_a_mask_object_the_kernel_cannot_read_is_refused():
    with pytest.raises(GqakitError, match="attention mask of type object"):
        _make_attention("tiled")(_Attn(), *_qkv(), object())


def test_packing_boundaries_outside_training_style_packing_are_refused():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(GqakitError, match="cu_seq_lens_q/_k for 2 row.*position_ids that restart at 0"):
        _make_attention("tiled")(_Attn(), *_qkv(B=2), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(GqakitError, match="cu_seq_lens_q/_k"):  # boundaries that do not end at the length
        _make_attention("tiled")(_Attn(), *_qkv(), None, cu_seq_lens_q=cu[:2], cu_seq_lens_k=cu[:2])


def test_sink_logits_of_the_wrong_shape_and_attention_dropout_are_refused():
    with pytest.raises(GqakitError, match=r"s_aux of shape \(2,\).*one sink logit per query head, \(4,\)"):
        _make_attention("tiled")(_Attn(), *_qkv(), None, s_aux=torch.zeros(2))
    module = _Attn().train()
    with pytest.raises(GqakitError, match="no attention dropout"):
        _make_attention("tiled")(module, *_qkv(), None, dropout=0.1)


def test_alibi_models_are_refused_at_use_and_encoders_are_not():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=1, num_attention_heads=4))
    use(bert, "tiled")  # bidirectional attention is implemented (tests/attention/test_attention_features.py)
    for cfg in (transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4),
                transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          alibi=True)):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with pytest.raises(GqakitError, match="cannot be plugged in|ALiBi"):
            use(model, "tiled")


def test_generate_after_use_sinks_keeps_a_bounded_sink_cache():
    """StreamingLLM: the KV cache never holds more than sinks + window positions, however long the output."""
    from gqakit.decode.cache import SinkCache

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMALL, max_position_embeddings=256, eos_token_id=None, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    use(model, "sinks", sinks=2, window=6)
    seen = []
    original = SinkCache.update

    def spy(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = original(self, key_states, value_states, layer_idx, *args, **kwargs)
        seen.append(self.layers[layer_idx].keys.shape[-2])  # stored positions
        return out

    SinkCache.update = spy
    try:
        out = model.generate(_ids(), max_new_tokens=20, do_sample=False)
    finally:
        SinkCache.update = original
    assert out.shape[1] == 28 and seen and max(seen) <= 2 + 6
    keyword = cache_keyword(model)  # cache from transformers 5.24 on, else past_key_values
    with pytest.raises(GqakitError, match=rf"pass {keyword}=SinkCache\(2, 6, rope=model\)"):
        model.generate(_ids(), max_new_tokens=2, **cache_kwargs(model, transformers.DynamicCache()))


def test_generate_after_use_sinks_equals_plain_attention_over_the_same_sink_cache():
    """The SinkCache holds the policy: past eviction, generate() under use(model, "sinks") must score every step as
    sdpa does over an explicit SinkCache of the same sizes (before the fix the sinks mask, applied again to the
    cache's slots, dropped the sinks: 2e-2 off from step 4 on)."""
    from gqakit.decode.cache import SinkCache

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMALL, max_position_embeddings=256, eos_token_id=None, pad_token_id=0)
    reference = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model = copy.deepcopy(reference)
    use(model, "sinks", sinks=2, window=6)
    ids = _ids()[:, :5]
    run = dict(max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True)
    got = model.generate(ids, **run)
    want = reference.generate(ids, **run, **cache_kwargs(reference, SinkCache(2, 6, rope=reference)))
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-5, rtol=1e-5)
    plain = reference.generate(ids, **run)  # a growing cache: the comparison above saw eviction
    assert (torch.stack(plain.scores) - torch.stack(want.scores)).abs().max() > 1e-3


def test_sparse_indexer_models_and_arguments_are_refused():
    """DeepSeek sparse attention picks keys per query from the mask tensor (`indices`): refused at use(), and the
    argument itself in the kernel."""
    cfg = transformers.DeepseekV32Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=3,
                                         n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1)
    with pytest.raises(GqakitError, match="learned indexer"):
        use(transformers.AutoModelForCausalLM.from_config(cfg), "tiled")
    with pytest.raises(GqakitError, match="passes indices"):
        _make_attention("tiled")(_Attn(), *_qkv(), None, indices=torch.zeros(1, 8, 3, dtype=torch.long))


def test_global_tokens_must_be_integers():
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL))
    with pytest.raises(GqakitError, match="global_tokens=1.7 must be an integer"):
        use(model, "sliding", window=4, global_tokens=[1.7])


@pytest.mark.parametrize("make", [
    lambda: transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4),
    lambda: transformers.MptConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4),
])
def test_alibi_models_loaded_with_gqakit_attention_are_refused_at_the_first_forward(tmp_path, make):
    """from_pretrained(attn_implementation="gqakit_tiled") never calls use(): the mask interface refuses."""
    from gqakit.attention.registration import register_all

    register_all()
    transformers.AutoModelForCausalLM.from_config(make()).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="gqakit_tiled")
    with pytest.raises(GqakitError, match="adds ALiBi position biases"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("kind, grouped", [("tiled", False), ("tiled", True), ("sliding", True)])
def test_t5_is_refused_at_use_for_its_position_bias(kind, grouped):
    """T5 (stock, and gqakit's grouped T5, whose attention does call the AttentionInterface) adds its relative
    position bias to the scores: refused at use() for that reason, naming the alternative, in one line."""
    from gqakit.hf.models.grouped_t5 import GroupedT5Config

    fields = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4, decoder_start_token_id=0)
    config = GroupedT5Config(**fields, num_key_value_heads=2) if grouped else transformers.T5Config(**fields)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    with pytest.raises(GqakitError) as info:
        use(model, kind, **({"window": 4} if kind == "sliding" else {}))
    err = str(info.value)
    assert "\n" not in err and type(model).__name__ in err, err
    assert f"relative position bias to its attention scores, an additive bias that gqakit's {kind} attention does " \
           "not take; use attention=default (T5's own sdpa or eager attention)" in err, err
    assert "AttentionInterface" not in err and "Llama" not in err, err


def test_falcon_under_gqakit_attention_is_pointed_to_its_own(tmp_path, capsys):
    """Falcon's attention bypasses the AttentionInterface: `gqakit eval --attention tiled` says so in one line and
    names the alternative as the command line spells it."""
    from gqakit.cli import main
    from uptrain_tiny import make_family_model, make_text

    model = make_family_model("falcon", tmp_path / "falcon")
    capsys.readouterr()
    assert main(["eval", "ppl", str(model), "--text", str(make_text(tmp_path / "t.txt", chars=2_000)),
                 "--max-length", "32", "--attention", "tiled", "-o", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FalconForCausalLM does not route attention" in err, err
    assert "keep its own attention (--attention default: sdpa or eager)" in err, err
