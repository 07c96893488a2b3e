"""The measured key rotation of bounded caches (gqakit/decode/rope_probe.py): which RoPE layout a model's cached keys
follow and which layers carry none, checked against each family's own modelling code, and the caches that use it
against a from-scratch StreamingLLM recompute (float64, one layer: a layer's K/V then depend only on its token and
position, so recomputing [sinks | window | token] at positions 0..n is exactly what a sink cache must show)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gqakit.decode.cache import SinkCache
from gqakit.decode.rope import rope_frequencies
from gqakit.decode.rope_probe import layer_windows, measure_rotation
from gqakit.evaluate.stream import stream_nll
from gqakit.hf.compat import cache_kwargs

VOCAB = 64
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# float64 models, but transformers forms their RoPE angles in float32, at other positions in the reference (about
# 1.4e-7 in logits measured); the wrong layout was 1e-3 (Cohere) to 4e-2 (GLM) off
ATOL = 1e-6


def family(model_type: str, layers: int = 1, dtype=torch.float64, **overrides):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, head_dim=8)
    if model_type == "falcon":
        base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                    new_decoder_architecture=False, multi_query=True, max_position_embeddings=512)
    config = AutoConfig.for_model(model_type, **{**base, **TOKENS, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype).eval()
    with torch.no_grad():  # sharper attention than the default initialisation gives
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model


@pytest.mark.parametrize("model_type, overrides, interleaved, rotary", [
    ("llama", {}, False, (True, True)),
    ("phi3", dict(partial_rotary_factor=0.5), False, (True, True)),
    ("cohere", {}, True, (True, True)),  # rotate_half on x[..., ::2] / x[..., 1::2]
    ("glm", dict(partial_rotary_factor=0.5), True, (True, True)),
    ("smollm3", dict(no_rope_layers=[1, 0]), False, (True, False)),  # 1: the layer uses RoPE
    ("gptj", dict(rotary_dim=4), True, (True, True)),  # a precomputed sin | cos table, rotate_every_two
    ("codegen", dict(rotary_dim=4, n_ctx=512), True, (True, True)),
])
def test_the_probe_reads_each_familys_layout_and_its_nope_layers(model_type, overrides, interleaved, rotary):
    model = family(model_type, layers=2, dtype=torch.float32, **overrides)
    rotation = measure_rotation(model)
    assert (rotation.interleaved, rotation.rotary) == (interleaved, rotary)
    assert model.training is False


def test_a_training_model_is_probed_in_eval_mode_and_left_as_it_was():
    model = family("llama", attention_dropout=0.5).train()
    model.model.layers[0].mlp.eval()  # a part the caller froze
    assert measure_rotation(model).rotary == (True,)
    assert model.training and model.model.layers[0].self_attn.training and not model.model.layers[0].mlp.training


@pytest.mark.parametrize("model_type, overrides, needle", [
    ("falcon", dict(alibi=True), "no layer of FalconForCausalLM rotates its keys"),  # holds a rotary module unused
    ("smollm3", dict(no_rope_layers=[0]), "no layer of SmolLM3ForCausalLM rotates its keys"),
])
def test_keys_that_no_layer_rotates_are_refused(model_type, overrides, needle):
    model = family(model_type, **overrides)
    with pytest.raises(ValueError, match=needle) as err:
        SinkCache(2, 6, rope=model)
    assert "\n" not in str(err.value)


def test_sliding_windows_are_read_per_layer():
    mistral = family("mistral", layers=2, sliding_window=16)
    assert layer_windows(mistral.config) == (16, 16)
    gemma = family("gemma3_text", layers=2, sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=8)
    assert layer_windows(gemma.config) == (16, None)
    assert layer_windows(family("llama").config) == (None,)


def recompute(model, ids: torch.Tensor, t: int, sinks: int, window: int) -> torch.Tensor:
    """Logits after token t under StreamingLLM: the first `sinks` tokens, the `window` before t and t itself, at
    positions 0..n-1, in one plain forward."""
    keep = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window), t + 1)))
    with torch.no_grad():
        return model(input_ids=ids[keep][None], position_ids=torch.arange(len(keep))[None]).logits[0, -1]


def fed_one_at_a_time(model, ids: torch.Tensor, sinks: int = 2, window: int = 6) -> torch.Tensor:
    """Logits after each token of `ids` but the last, through one SinkCache fed a token at a time."""
    cache = SinkCache(sinks, window, rope=model)
    with torch.no_grad():
        return torch.stack([model(input_ids=ids[t:t + 1][None], **cache_kwargs(model, cache), use_cache=True)
                            .logits[0, -1] for t in range(ids.numel() - 1)])


def nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits, dim=-1).gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}),
    ("cohere", {}),
    ("glm", dict(partial_rotary_factor=0.5)),
    ("gptj", dict(rotary_dim=4)),
    ("codegen", dict(rotary_dim=4, n_ctx=512)),
])
@pytest.mark.parametrize("sinks, window", [(3, 6), (0, 5)])
def test_sink_caches_equal_the_recompute_reference_in_either_layout(model_type, overrides, sinks, window):
    """Before the probe an interleaved model (Cohere, GLM) was re-rotated in the rotate-half layout: GLM's NLL 0.04
    off the reference; both caches now follow the layout the model's keys show."""
    model = family(model_type, **overrides)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    want = torch.stack([recompute(model, ids, t, sinks, window) for t in range(ids.numel() - 1)])
    torch.testing.assert_close(fed_one_at_a_time(model, ids, sinks, window), want, atol=ATOL, rtol=0)
    streamed = stream_nll(model, ids, "sinks" if sinks else "window", window=window, sinks=sinks, chunk=5)
    torch.testing.assert_close(streamed.nll, nll(want, ids), atol=ATOL, rtol=0)


def gemma3(layer_types: list[str]):
    return family("gemma3_text", layers=len(layer_types), layer_types=layer_types, sliding_window=64,
                  query_pre_attn_scalar=8, rope_parameters={
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                      "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})


def test_layers_that_rotate_by_frequencies_of_their_own_are_matched_to_them():
    """Gemma 3 rotates sliding and full layers by other frequencies (transformers 5.25 holds them as
    `sliding_attention_inv_freq` / `full_attention_inv_freq`; the caches refused it): each layer is matched to the
    set its keys follow."""
    model = gemma3(["sliding_attention", "full_attention", "sliding_attention"])
    rotation = measure_rotation(model)
    assert len(rotation.freqs) == 2 and not rotation.interleaved
    sliding, full = (rotation.layer_freqs[i] for i in (0, 1))
    assert sliding != full and rotation.layer_freqs == (sliding, full, sliding)
    assert rotation.freqs[full][-1] < rotation.freqs[sliding][-1]  # the full layers' larger base: slower pairs


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_a_gemma3_layer_equals_the_recompute_reference(kind):
    model = gemma3([kind])
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    want = torch.stack([recompute(model, ids, t, 2, 6) for t in range(ids.numel() - 1)])
    torch.testing.assert_close(fed_one_at_a_time(model, ids), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("make", [lambda: gemma3(["sliding_attention", "full_attention"]),
                                  lambda: family("smollm3", layers=2, no_rope_layers=[1, 0])],
                         ids=["gemma3-two-frequencies", "smollm3-nope-layer"])
def test_eval_streams_chunks_equal_the_sink_cache_fed_token_by_token(make):
    """Two layers whose keys rotate differently (other frequencies, or none): eval stream's chunked cache, whose sink
    copies and rebasing follow each layer's own rotation, equals SinkCache fed a token at a time (tested against
    from-scratch references above and in test_sink_cache.py)."""
    model = make()
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4))
    want = nll(fed_one_at_a_time(model, ids), ids)
    for chunk, rebase_every in ((5, None), (7, 3)):
        got = stream_nll(model, ids, "sinks", window=6, sinks=2, chunk=chunk, rebase_every=rebase_every)
        torch.testing.assert_close(got.nll, want, atol=ATOL, rtol=0)


def test_a_wrapped_model_is_measured_and_other_modules_are_refused():
    """torch.compile's wrapper is measured through to its model (it was taken on trust as rotate-half, every layer:
    Cohere's interleaved keys then moved wrongly; a review's finding); any other module is refused in one line."""
    model = family("cohere")
    assert SinkCache(2, 6, rope=torch.compile(model)).policy.rotation.interleaved
    with pytest.raises(ValueError, match="neither a transformers model nor an inv_freq tensor") as err:
        SinkCache(2, 6, rope=model.model.rotary_emb)
    assert "\n" not in str(err.value)
    assert not SinkCache(2, 6, rope=rope_frequencies(model)[0]).policy.rotation.interleaved  # a tensor: taken as said


def test_an_encoder_decoder_is_refused_by_the_probe():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                             num_heads=4)).eval()
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder"):
        measure_rotation(t5)


def test_layer_types_with_their_own_head_dim_are_checked_each_against_its_set():
    """Gemma 4's sliding layers (head_dim 8, full rotary) and full layers (head_dim 16, partial rotary) carry sets of
    other sizes: SinkCache checked every layer against the largest set and refused the sliding ones mid-generation
    (a review's finding); each layer is checked against its own set, and a full Gemma 4 layer equals the recompute."""
    pytest.importorskip("transformers.models.gemma4", reason="Gemma 4 arrived after this transformers")
    base = dict(head_dim=8, global_head_dim=16, sliding_window=64)
    two = family("gemma4_text", layers=2, layer_types=["sliding_attention", "full_attention"], **base)
    rotation = measure_rotation(two)
    assert sorted(f.numel() for f in rotation.freqs) == [4, 8] and None not in rotation.layer_freqs
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    want = nll(fed_one_at_a_time(two, ids), ids)
    torch.testing.assert_close(stream_nll(two, ids, "sinks", window=6, sinks=2, chunk=5).nll, want, atol=ATOL, rtol=0)
    one = family("gemma4_text", layers=1, layer_types=["full_attention"], **base)
    torch.testing.assert_close(fed_one_at_a_time(one, ids),
                               torch.stack([recompute(one, ids, t, 2, 6) for t in range(ids.numel() - 1)]),
                               atol=ATOL, rtol=0)


def test_a_layer_takes_the_set_that_fits_it_best():
    """Two sets within tolerance of a layer's keys: the closer one (it took the first that fitted: 1.7e-4 off where
    the other was 1e-6, in a review's Gemma 3 with nearly equal bases)."""
    model = gemma3(["sliding_attention", "full_attention"])
    rotation = measure_rotation(model)
    sliding, full = rotation.layer_freqs
    rope = model.model.rotary_emb
    exact = rope._buffers.pop("full_attention_inv_freq")
    near = exact.double() * (1 + 5e-7)  # within tolerance of the full layer's keys (5e-4 rad at 1,021), yet worse
    rope.register_buffer("near_full_attention_inv_freq", near.float(), persistent=False)  # listed before the real one
    rope.register_buffer("full_attention_inv_freq", exact, persistent=False)
    again = measure_rotation(model)
    assert len(again.freqs) == 3 and torch.equal(again.freqs[1], near.float().double())  # the near set comes first
    assert torch.equal(again.freqs[again.layer_freqs[1]], rotation.freqs[full])  # yet the exact one is chosen


def test_the_chunked_cache_refuses_a_sliding_window_narrower_than_what_it_shows():
    """Its 4-D mask replaces the model's, so a layer sliding over fewer than sinks + window + 1 keys is refused (the
    window the probe read with the model); one that fits is taken."""
    from gqakit.decode.stream_cache import ChunkedSinkCache

    model = family("mistral", layers=2, sliding_window=8)
    assert measure_rotation(model).narrowest_window() == (0, 8)
    with pytest.raises(ValueError, match="layer 0 of MistralConfig attends to a sliding window of 8 tokens") as err:
        ChunkedSinkCache(2, 6, rope=model)
    assert "keep sinks + window <= 7" in str(err.value) and "\n" not in str(err.value)
    assert ChunkedSinkCache(2, 5, rope=model).frame.rotation.windows == (8, 8)


def test_a_rope_tables_frequencies_are_read_back_exactly():
    """GPT-J / CodeGen hold RoPE as a sin | cos table (no inv_freq; the bounded caches refused them): the frequencies
    are read back from it to the float32 inv_freq the table was made from, for a table shorter than the probe's
    shift too; a table of anything else is not taken for RoPE."""
    from gqakit.decode.rope import table_frequencies

    for positions in (512, 32):
        model = family("gptj", rotary_dim=8, max_position_embeddings=positions)
        (freqs,) = rope_frequencies(model)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.int64) / 8))  # GPT-J's, in float32
        torch.testing.assert_close(freqs, inv_freq.double(), atol=1e-8, rtol=0)
        assert measure_rotation(model).positions == positions
    assert table_frequencies(torch.randn(32, 8, generator=torch.Generator().manual_seed(0))) is None


def test_a_short_rope_table_streams_past_its_end_through_eval_streams_rebasing():
    """A GPT-J of 32 positions over a 60-token stream: eval stream's chunks re-base within the table and equal the
    recompute; a cache fed past the table is refused in one line (it was an IndexError)."""
    from gqakit.decode.stream_cache import ChunkedSinkCache

    model = family("gptj", rotary_dim=8, max_position_embeddings=32)
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(5))
    want = torch.stack([recompute(model, ids, t, 3, 6) for t in range(ids.numel() - 1)])
    streamed = stream_nll(model, ids, "sinks", window=6, sinks=3, chunk=5)
    torch.testing.assert_close(streamed.nll, nll(want, ids), atol=ATOL, rtol=0)
    cache = ChunkedSinkCache(3, 6, rope=model, rebase_every=100)
    for _ in range(6):
        cache.prepare(5)
    with pytest.raises(ValueError, match="past the model's 32-position RoPE table") as err:
        cache.prepare(5)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("prompt, new, chunk, rebase_every", [(10, 30, 4, None), (13, 3, 16, None), (5, 30, 1, 2)])
def test_stream_tokens_runs_a_rope_table_as_far_as_its_positions_reach(prompt, new, chunk, rebase_every):
    """`positions_needed` replays the loop's re-basing: a table exactly that long decodes (past its end in tokens),
    one position shorter is refused in one line before any forward (it was an IndexError mid-stream)."""
    from gqakit.decode.streaming import positions_needed, stream_tokens

    needed = positions_needed(prompt, new, 2, 4, chunk, rebase_every)
    ids = torch.randint(3, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(6))
    kwargs = dict(sinks=2, window=4, chunk_size=chunk, rebase_every=rebase_every)
    fits = family("gptj", rotary_dim=8, max_position_embeddings=needed)
    assert len(list(stream_tokens(fits, ids, new, **kwargs))) == new
    short = family("gptj", rotary_dim=8, max_position_embeddings=needed - 1)
    with pytest.raises(ValueError, match=f"streaming feeds positions up to {needed - 1} but GPTJForCausalLM's "
                                         f"positions end at {needed - 1}") as err:
        next(stream_tokens(short, ids, new, **kwargs))
    assert "\n" not in str(err.value)


def test_a_model_on_the_meta_device_is_refused_in_one_line():
    """It raised torch's own multi-line error from the probe's forward."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=32,
                                                                      intermediate_size=64, num_hidden_layers=1,
                                                                      num_attention_heads=4))
    with pytest.raises(ValueError, match="LlamaForCausalLM is on the meta device") as err:
        SinkCache(2, 6, rope=model)
    assert "\n" not in str(err.value)



def test_an_offloaded_model_is_measured_through_its_hooks(tmp_path):
    """A model loaded with part of it offloaded to disk holds those weights on the meta device and loads them at
    forward time: it is measured as any model (the meta refusal stopped it, a review)."""
    model = family("llama", layers=2, dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                     offload_folder=str(tmp_path / "off"))
    assert any(p.is_meta for p in offloaded.parameters())
    assert measure_rotation(offloaded).rotary == (True, True)
