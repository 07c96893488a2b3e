"""What gqakit attention does not implement is refused, never dropped: each model below gave logits
that differed from eager by more than the logits themselves, with no error, before these checks."""
from __future__ import annotations

import pytest
import torch
import transformers

from gqakit.attention import use
from gqakit.errors import GqakitError

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def _ids():
    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def test_gemma2_softcap_is_refused_at_the_forward():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(**SMALL, attn_logit_softcapping=5.0, sliding_window=16))
    use(model, "tiled")
    with pytest.raises(GqakitError, match="Gemma2Attention passes softcap .*attn_implementation='sdpa'"):
        model(_ids())


def test_gpt_oss_sink_logits_are_refused():
    cfg = transformers.GptOssConfig(**{**SMALL, "intermediate_size": 32}, num_local_experts=2, num_experts_per_tok=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    use(model, "tiled")
    with pytest.raises(GqakitError, match="passes s_aux"):
        model(_ids())


def test_a_callers_4d_mask_is_refused_and_a_2d_padding_mask_is_honoured():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).eval()
    ids = _ids()
    padding = torch.ones(1, 8, dtype=torch.long)
    padding[0, :2] = 0
    eager = model(ids, attention_mask=padding).logits
    use(model, "tiled")
    torch.testing.assert_close(model(ids, attention_mask=padding).logits[0, 2:], eager[0, 2:], atol=1e-5, rtol=1e-5)
    block_diagonal = torch.zeros(1, 1, 8, 8)
    with pytest.raises(GqakitError, match=r"attention mask tensor of shape \(1, 1, 8, 8\)"):
        model(ids, attention_mask=block_diagonal)


def test_encoders_and_alibi_models_are_refused_at_use():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(GqakitError, match="BertModel is an encoder"):
        use(bert, "tiled")
    for cfg in (transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4),
                transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          alibi=True)):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with pytest.raises(GqakitError, match="cannot be plugged in|ALiBi"):
            use(model, "tiled")


def test_generate_after_use_sinks_keeps_a_bounded_sink_cache():
    """StreamingLLM: the KV cache never holds more than sinks + window positions, however long the output."""
    from gqakit.attention.cache import SinkCache

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
    with pytest.raises(GqakitError, match=r"pass past_key_values=SinkCache\(2, 6, rope=model\)"):
        model.generate(_ids(), max_new_tokens=2, past_key_values=transformers.DynamicCache())
