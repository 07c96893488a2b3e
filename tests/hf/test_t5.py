"""T5 / Flan-T5 / mT5 grouped as in the GQA paper, end to end, against T5's own class.

At G = H the converted model (gqakit's GroupedT5ForConditionalGeneration) must compute the source's logits exactly.
At G < H it must equal a reference built in the SOURCE's own class (stock T5ForConditionalGeneration /
MT5ForConditionalGeneration): each K/V head of the decoder's self- and cross-attention (and, with --pool-encoder,
the encoder's) replaced by its group's mean, written here from T5's own tensor layout (rows per head of `k` / `v`),
not from gqakit's plan. fp32 within 1e-5, absolute and relative (the means are rounded once in float64 here and
accumulated otherwise by gqakit, and the grouped kernels run G heads where the reference runs H identical ones).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, MT5Config, T5Config
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import gqakit  # noqa: F401  (registers gqakit_t5 with the Auto classes)
from gqakit.cli import convert_main
from families import load_exact, perturb_
from gqakit.hf.compat import cache_kwargs, output_cache

VOCAB, D_MODEL, D_KV, HEADS, LAYERS = 64, 32, 8, 4, 2
INPUTS = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
TARGETS = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
MASK = torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])  # the second input left-padded
COMMON = dict(vocab_size=VOCAB, d_model=D_MODEL, d_kv=D_KV, d_ff=48, num_layers=LAYERS, num_heads=HEADS,
              relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
SOURCES = {
    "t5": lambda: T5Config(**COMMON),  # ReLU, tied embeddings (t5-small's layout)
    "flan-t5": lambda: T5Config(**COMMON, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "mt5": lambda: MT5Config(**COMMON, num_decoder_layers=3),  # a deeper decoder than encoder
}
ATTN = "eager"


def load(path, attn=ATTN):
    return load_exact(path, AutoModelForSeq2SeqLM, attn)


def logits(model):
    with torch.no_grad():
        return model(input_ids=INPUTS, attention_mask=MASK, decoder_input_ids=TARGETS).logits


@pytest.fixture(scope="module", params=sorted(SOURCES))
def source(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(SOURCES[request.param](), attn_implementation=ATTN,
                                              dtype=torch.float32)
    perturb_(model)
    path = tmp_path_factory.mktemp(request.param) / "mha"
    model.save_pretrained(path)
    return request.param, path, model.eval()


def pooled_reference(model, groups: int, encoder: bool, first: bool = False):
    """The source class with every grouped K/V head replaced by its group's mean (an explicit loop over heads), or
    with `first` by the group's first head (--method first)."""
    ref = copy.deepcopy(model)
    stacks = [("decoder", ("layer.0.SelfAttention", "layer.1.EncDecAttention"))]
    if encoder:
        stacks.append(("encoder", ("layer.0.SelfAttention",)))
    r = HEADS // groups
    state = ref.state_dict()
    with torch.no_grad():
        for stack, attentions in stacks:
            for i in range(len(getattr(ref, stack).block)):
                for attention in attentions:
                    for role in "kv":
                        w = state[f"{stack}.block.{i}.{attention}.{role}.weight"].view(HEADS, D_KV, D_MODEL)
                        for g in range(groups):
                            mean = w[g * r].double() if first else sum(
                                w[h].double() for h in range(g * r, (g + 1) * r)) / r
                            for h in range(g * r, (g + 1) * r):
                                w[h] = mean.float()
    return ref.eval()


@pytest.mark.parametrize("groups,encoder", [(4, False), (2, False), (1, False), (2, True), (1, True)])
def test_t5_grouped_like_the_paper(source, groups, encoder, tmp_path):
    name, path, model = source
    out = tmp_path / "out"
    args = [str(path), "--groups", str(groups), "-o", str(out), "--quiet"] + (["--pool-encoder"] if encoder else [])
    assert convert_main(args) == 0
    converted = load(out)
    assert type(converted).__name__ == "GroupedT5ForConditionalGeneration"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gqakit_t5"
    assert config["num_key_value_heads"] == groups
    assert config["encoder_num_key_value_heads"] == (groups if encoder else HEADS)
    got = logits(converted)
    if groups == HEADS:
        assert torch.equal(got, logits(model))
    else:
        torch.testing.assert_close(got, logits(pooled_reference(model, groups, encoder)), rtol=1e-5, atol=1e-5)
        assert (got - logits(model)).abs().max() > 1e-3  # pooling really changed the model
    # the grouped projections hold G heads; the encoder's all H unless pooled
    attention = converted.decoder.block[0].layer[1].EncDecAttention
    assert attention.k.weight.shape == (groups * D_KV, D_MODEL)
    assert converted.encoder.block[0].layer[0].SelfAttention.v.weight.shape[0] == (groups if encoder else HEADS) * D_KV
    # the relative position bias stays per query head
    assert converted.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.shape[1] == HEADS


def test_first_and_random_merges(source, tmp_path):
    """--method first equals the source class with each group's K/V heads replaced by its first head; --method
    random is a function of --seed."""
    name, path, model = source
    out = tmp_path / "first"
    assert convert_main([str(path), "--groups", "2", "--method", "first", "-o", str(out), "--quiet"]) == 0
    torch.testing.assert_close(logits(load(out)), logits(pooled_reference(model, 2, False, first=True)),
                               rtol=1e-5, atol=1e-5)
    seeded = {}
    for run, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = tmp_path / run
        assert convert_main([str(path), "--groups", "2", "--method", "random", "--seed", str(seed), "-o", str(out),
                             "--quiet"]) == 0
        seeded[run] = load(out).decoder.block[0].layer[1].EncDecAttention.k.weight
    assert torch.equal(seeded["a"], seeded["b"]) and not torch.equal(seeded["a"], seeded["c"])
    assert not torch.equal(seeded["a"], model.decoder.block[0].layer[1].EncDecAttention.k.weight[:2 * D_KV])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generation_caches_grouped_heads(source, attn, tmp_path):
    """Greedy generation of the converted model equals the pooled reference's, and both caches (decoder
    self-attention per generated token, cross-attention per input token) hold G heads: G/H of the MHA bytes."""
    name, path, model = source
    out = tmp_path / "mqa"
    assert convert_main([str(path), "--groups", "1", "-o", str(out), "--quiet"]) == 0
    converted = load(out, attn)
    reference = pooled_reference(model, 1, False)
    kwargs = dict(attention_mask=MASK, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)

    def cache():  # given, since generate() sizes its own by the encoder's depth (mT5 here has a deeper decoder)
        return EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        got = converted.generate(INPUTS, **cache_kwargs(converted, cache()), **kwargs)
        want = reference.generate(INPUTS, **cache_kwargs(reference, cache()), **kwargs)
    assert torch.equal(got.sequences, want.sequences)

    def cache_bytes(cache):
        return sum(t.numel() * t.element_size() for part in (cache.self_attention_cache, cache.cross_attention_cache)
                   for layer in part.layers for t in (layer.keys, layer.values))
    self_keys = output_cache(got).self_attention_cache.layers[0].keys
    cross_keys = output_cache(got).cross_attention_cache.layers[0].keys
    assert self_keys.shape[1] == cross_keys.shape[1] == 1
    assert cross_keys.shape[2] == INPUTS.shape[1]
    assert cache_bytes(output_cache(got)) * HEADS == cache_bytes(output_cache(want))


def test_a_static_cache_scores_as_the_dynamic_one(source, tmp_path):
    """A static cache's sequence length is a tensor that moves when the cache is updated: read before the update and
    not copied, it put the relative position bias one position off (logits 0.07-2.0 off, a review)."""
    name, path, model = source
    if model.config.num_decoder_layers != model.config.num_layers:
        pytest.skip("generate() sizes a static cache by num_layers (the encoder's depth): this decoder is deeper")
    out = tmp_path / "gqa2"
    assert convert_main([str(path), "--groups", "2", "-o", str(out), "--quiet"]) == 0
    converted = load(out, "eager")
    kwargs = dict(attention_mask=MASK, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    with torch.no_grad():
        static = converted.generate(INPUTS, cache_implementation="static", **kwargs)
        dynamic = converted.generate(INPUTS, **cache_kwargs(converted, EncoderDecoderCache(DynamicCache(),
                                                                                         DynamicCache())), **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=0)


def test_a_grouped_t5_converts_again(source, tmp_path):
    """gqakit's own T5 is itself a family: GQA-2 -> MQA pools the pooled heads (the same as MHA -> MQA)."""
    name, path, model = source
    assert convert_main([str(path), "-g", "2", "-o", str(tmp_path / "g2"), "-q"]) == 0
    assert convert_main([str(tmp_path / "g2"), "-g", "1", "-o", str(tmp_path / "g1"), "-q"]) == 0
    assert convert_main([str(path), "-g", "1", "-o", str(tmp_path / "direct"), "-q"]) == 0
    torch.testing.assert_close(logits(load(tmp_path / "g1")), logits(load(tmp_path / "direct")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["aligned", "fit", "transfer"])
def test_layerwise_methods_refused_for_t5(source, method, tmp_path, capsys):
    name, path, _ = source
    args = [str(path), "-g", "2", "-o", str(tmp_path / "x"), "--method", method]
    if method != "aligned":
        args += ["--calibration", str(tmp_path / "text.txt")]
        (tmp_path / "text.txt").write_text("some text\n" * 50)
    assert convert_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "encoder-decoder" in err and "--method mean" in err
    assert not (tmp_path / "x").exists()


def test_pool_encoder_refused_where_it_means_nothing(tmp_path, capsys):
    from families import make_model

    src = make_model("llama", tmp_path / "llama")
    capsys.readouterr()
    assert convert_main([str(src), "-g", "2", "--pool-encoder", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--pool-encoder" in err and "no encoder" in err
    assert not (tmp_path / "x").exists()


def test_pool_encoder_refused_when_encoder_and_decoder_differ(source, tmp_path, capsys):
    """A grouped T5 whose decoder has 2 K/V heads and encoder 4: one G cannot regroup both."""
    name, path, _ = source
    assert convert_main([str(path), "-g", "2", "-o", str(tmp_path / "g2"), "-q"]) == 0
    assert convert_main([str(tmp_path / "g2"), "-g", "1", "--pool-encoder", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "encoder_num_key_value_heads" in err
    assert not (tmp_path / "x").exists()


def test_original_google_class_name_converts_like_t5(source, tmp_path):
    """The original google T5 checkpoints (t5-small, t5-base, ...) name their class T5WithLMHeadModel in config.json:
    the same layout as T5ForConditionalGeneration, so the same conversion (MQA equals the pooled reference)."""
    name, path, model = source
    if name == "mt5":
        pytest.skip("T5's legacy name")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for item in path.iterdir():
        (legacy / item.name).write_bytes(item.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (legacy / "config.json").write_text(json.dumps({**config, "architectures": ["T5WithLMHeadModel"]}))
    out = tmp_path / "out"
    assert convert_main([str(legacy), "--groups", "1", "-o", str(out), "--quiet"]) == 0
    converted = load(out)
    assert type(converted).__name__ == "GroupedT5ForConditionalGeneration"
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    torch.testing.assert_close(logits(converted), logits(pooled_reference(model, 1, False)), rtol=1e-5, atol=1e-5)
    card = (out / "README.md").read_text()
    assert "re-hosted" in card and "T5 (" in card
