"""gqakit attention inside real transformers models: logits and gradients against sdpa / eager."""
import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig

import gqakit.attention as attention
from gqakit.attention import AttentionOptionError
from gqakit.attention.masks import MaskSpec


def tiny_llama(kv_heads=2, attn="sdpa", seed=0):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def copy_of(model, kind, **options):
    clone = tiny_llama(model.config.num_key_value_heads)
    clone.load_state_dict(model.state_dict())
    return attention.use(clone, kind, **options).eval()


def loss_and_grads(model, ids, mask=None):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_tiled_matches_sdpa_logits_and_gradients(kv_heads):
    ref = tiny_llama(kv_heads)
    tiled = copy_of(ref, "tiled", block_q=16, block_k=16)
    ids = torch.randint(3, 96, (2, 53))
    ref_logits, ref_grads = loss_and_grads(ref, ids)
    logits, grads = loss_and_grads(tiled, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-4, msg=name)


def test_padding_is_honoured():
    ref = tiny_llama()
    tiled = copy_of(ref, "tiled", block_q=8, block_k=8)
    ids = torch.randint(3, 96, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on row 1
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask).logits
        b = tiled(input_ids=ids, attention_mask=mask).logits
        alone = tiled(input_ids=ids[1:, 7:]).logits
    torch.testing.assert_close(b[:, 7:][mask[:, 7:].bool()], a[:, 7:][mask[:, 7:].bool()], rtol=0, atol=1e-5)
    # The padded row equals the same text run alone: the padding really is masked, not dropped.
    torch.testing.assert_close(b[1, 7:], alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind, options, spec", [
    ("sliding", {"window": 8}, MaskSpec(window=8)),
    ("sliding", {"window": 12, "dilation": 2, "global_tokens": (0, 5)},
     MaskSpec(window=12, dilation=2, global_tokens=(0, 5))),
    ("sinks", {"sinks": 3, "window": 9}, MaskSpec(window=9, sinks=3)),
])
def test_masked_kinds_match_eager_with_the_dense_mask(kind, options, spec):
    ref = tiny_llama(attn="eager")
    model = copy_of(ref, kind, block_q=8, block_k=8, **options)
    T = 40
    ids = torch.randint(3, 96, (1, T))
    pos = torch.arange(T)
    dense = spec.mask(pos, pos)  # (T, T) bool
    additive = torch.zeros(1, 1, T, T).masked_fill(~dense, torch.finfo(torch.float32).min)
    ref_logits, ref_grads = loss_and_grads(ref, ids, additive)
    logits, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-4, msg=name)


def test_from_pretrained_attn_implementation(tmp_path):
    ref = tiny_llama()
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="gqakit_tiled").eval()
    assert model.config._attn_implementation == "gqakit_tiled"
    ids = torch.randint(3, 96, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_options_survive_save_and_load(tmp_path):
    model = attention.use(tiny_llama(), "sliding", window=6)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="gqakit_sliding")
    assert again.config.gqakit_attention["window"] == 6


def test_cached_generation_matches_sdpa():
    ref = tiny_llama()
    tiled = copy_of(ref, "tiled", block_q=8, block_k=8)
    ids = torch.randint(3, 96, (1, 12))
    a = ref.generate(ids, max_new_tokens=10, do_sample=False)
    b = tiled.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind, options, needle", [
    ("flash", {}, "unknown attention kind 'flash'"),
    ("tilde", {}, "did you mean 'tiled'"),
    ("tiled", {"window": 4}, "has no option 'window'"),
    ("sliding", {}, "needs a window"),
    ("sliding", {"window": 0}, "window"),
    ("sinks", {"sinks": -1}, "sinks"),
])
def test_bad_options(kind, options, needle):
    with pytest.raises(AttentionOptionError, match=needle) as info:
        attention.use(tiny_llama(), kind, **options)
    assert "\n" not in str(info.value)


def test_architecture_without_attention_interface_is_refused():
    cfg = GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, attention_types=[[["global"], 1]],
                       max_position_embeddings=64)
    with pytest.raises(AttentionOptionError, match="GPTNeoForCausalLM does not route attention"):
        attention.use(GPTNeoForCausalLM(cfg), "tiled")
