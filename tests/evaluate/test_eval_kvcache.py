"""`gqakit eval ppl --kv-cache`: scoring each window through transformers' caches in chunks equals the plain
forward for the dense cache, the bytes held are measured from the cache's tensors, and the refusals are one line
through the console script. int4 / int2 need optimum-quanto (the `kvquant` extra)."""
from __future__ import annotations

import pytest
import torch

from cli_contract import run_cli, run_refused
from eval_tiny import checkpoint, run_eval, text, tiny_llama, tokenizer
from gqakit.common import report
from gqakit.evaluate.kvcache import held_bytes, make_cache
from gqakit.evaluate.perplexity import strided_windows
from gqakit.hf.compat import output_cache
from gqakit.hf.loading import kv_bytes_per_token


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, max_positions=128)


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [1, 7, 16, 48])
@pytest.mark.parametrize("bos,stride", [(None, 48), (None, 20), (1, 47)])
def test_dense_chunks_equal_the_plain_forward(model, chunk, bos, stride):
    x = ids(130, seed=1)
    plain = strided_windows(model, x, 48, stride, progress=False, bos=bos)
    cached = strided_windows(model, x, 48, stride, progress=False, bos=bos, kv_cache="dense", kv_chunk=chunk)
    assert cached.window_tokens == plain.window_tokens and cached.count == plain.count
    assert cached.window_nll == pytest.approx(plain.window_nll, abs=1e-4)
    assert cached.nll == pytest.approx(plain.nll, abs=1e-4)


def test_dense_bytes_held_equal_the_config_figure(model):
    scored = strided_windows(model, ids(100), 48, progress=False, kv_cache="dense", kv_chunk=16)
    assert scored.kv_bytes_held_per_token == kv_bytes_per_token(model.config, torch.float32) == 2 * 2 * 2 * 8 * 4
    assert scored.kv_bytes_held_decoding == (2 * 2 * 2 * 8 * 4, 2 * 2 * 2 * 8 * 4)  # no residual: the same


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_decoding_steps_fit_a_model_with_learned_positions(kind):
    """GPT-2 looks positions up in a table as long as its context: the steps after a window that fills it must not
    ask for a position past it (IndexError before)."""
    if kind == "int4":
        pytest.importorskip("optimum.quanto")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=1, eos_token_id=2)).eval()
    scored = strided_windows(gpt2, ids(256), 128, progress=False, kv_cache=kind, kv_chunk=128)
    dense = 2 * 2 * 32 * 4  # K and V, 2 layers, 32 features, fp32
    mean, most = scored.kv_bytes_held_decoding
    assert (scored.kv_bytes_held_per_token, mean, most) == (dense, dense, dense) if kind == "dense" else (
        scored.kv_bytes_held_per_token < mean < most < dense)


@pytest.mark.parametrize("kind", ["int4", "int2"])
def test_quanto_bytes_while_decoding_count_the_refilling_residual(model, kind):
    """Fed in chunks of 128 (the residual's length), the window leaves the residual empty; decoding on refills it
    with full-precision tokens. Reference: the same cache built by hand, then 128 single tokens, held bytes over
    cached tokens after each, averaged."""
    pytest.importorskip("optimum.quanto")
    x = ids(256, seed=3)
    scored = strided_windows(model, x, 256, progress=False, kv_cache=kind, kv_chunk=128)
    cache, per_step = make_cache(kind, model.config), []
    with torch.no_grad():
        for start in (0, 128):
            model(input_ids=x[None, start:start + 128], cache=cache, use_cache=True)
        after = held_bytes(cache) / 256
        for step in range(128):
            model(input_ids=x[None, -1:], cache=cache, use_cache=True)
            per_step.append(held_bytes(cache) / (257 + step))
    mean, most = sum(per_step) / 128, max(per_step)
    assert scored.kv_bytes_held_per_token == pytest.approx(after, rel=1e-12)
    assert scored.kv_bytes_held_decoding == pytest.approx((mean, most), rel=1e-12)
    dense = kv_bytes_per_token(model.config, torch.float32)
    assert after < mean < most < dense  # 128 residual tokens at fp32 beside 256 quantized ones


def test_fp8_holds_a_quarter_plus_its_scales(model):
    scored = strided_windows(model, ids(100), 48, progress=False, kv_cache="fp8", kv_chunk=16)
    # one byte per value, plus one fp32 scale per K and V tensor of each layer, over the window's 48 positions
    assert scored.kv_bytes_held_per_token == pytest.approx(2 * 2 * 2 * 8 + 2 * 2 * 4 / 48)


@pytest.mark.parametrize("kind", ["int4", "int2"])
def test_quanto_holds_fewer_bytes(model, kind):
    pytest.importorskip("optimum.quanto")
    x = ids(300)
    scored = strided_windows(model, x, 300, progress=False, kv_cache=kind, kv_chunk=128)
    dense = kv_bytes_per_token(model.config, torch.float32)
    assert scored.kv_bytes_held_per_token < dense
    cache = make_cache(kind, model.config)
    with torch.no_grad():  # 256 positions of 2 K/V heads: whole groups of 64 for keys grouped along tokens
        model(input_ids=x[None, :256], cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert held_bytes(cache) > 0 and type(layer._quantized_keys).__name__ == "WeightQBitsTensor"
    assert (layer.axis_key, layer.axis_value) == (-1, 0)  # KIVI: keys per channel, values per token


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tok = tokenizer()
    root = tmp_path_factory.mktemp("kv")
    (root / "text.txt").write_text(text(400, seed=2), encoding="utf-8")
    return {"root": root, "text": root / "text.txt", "model": checkpoint(root / "m", tok)}


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_report_states_the_bytes_held(files, kind):
    if kind == "int4":
        pytest.importorskip("optimum.quanto")
    out_dir = files["root"] / kind
    # 256 tokens = 4 full windows of 64 in chunks of 64: keys quantized per channel are grouped along tokens, 64 at a
    # time (whole groups: a chunk of int4 must be a multiple of 64)
    code, out, err = run_eval("ppl", files["model"], "--text", files["text"], "--max-length", 64, "--max-tokens", 256,
                              "--kv-cache", kind, "--kv-chunk", 64, "-o", out_dir, "-q")
    assert code == 0, err
    row = report.read_report(out_dir)["results"]["rows"][0]
    assert row["kv_cache"] == kind and row["kv_chunk"] == 64
    assert row["kv_cache_settings"]["class"] == ("DynamicCache" if kind == "dense" else "QuantizedCache")
    if kind == "dense":
        assert row["kv_bytes_held_per_token"] == row["kv_bytes_per_token"]
    else:
        assert row["kv_cache_settings"] == {"class": "QuantizedCache", "backend": "quanto", "nbits": 4, "axis_key": -1,
                                            "axis_value": 0, "q_group_size": 64, "residual_length": 128,
                                            "latent_axis_value": -1,
                                            "fed": "in whole groups of tokens (kvcache.feed_pieces)"}
        assert row["kv_bytes_held_per_token"] < row["kv_bytes_per_token"]
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert f"| KV-cache bytes/token held ({kind} cache, measured) | held while decoding (mean / max) |" in table[0]
    assert table[1].split(" | ")[2] == f"{row['kv_bytes_held_per_token']:,.1f}"
    mean, most = row["kv_bytes_held_decoding_mean"], row["kv_bytes_held_decoding_max"]
    assert table[1].split(" | ")[3] == f"{mean:,.1f} / {most:,.1f}"
    assert (mean == most == row["kv_bytes_per_token"]) if kind == "dense" else (
        row["kv_bytes_held_per_token"] < mean < most)


def test_unknown_cache_is_argparses_error_in_one_line(files, tmp_path):
    result = run_cli("gqakit", "eval", "ppl", str(files["model"]), "--text", str(files["text"]), "--kv-cache", "int3",
                     "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("gqakit: error: argument --kv-cache: invalid choice: 'int3' (choose from 'dense', "
                                     "'fp8', 'int4', 'int2') (see gqakit eval ppl --help)")
    assert not (tmp_path / "r").exists()


REFUSED = [
    (["--kv-cache", "int4", "--kv-chunk", "32"], ("--kv-chunk 32: --kv-cache int4 quantizes each channel's keys in "
                                                 "groups of 64 tokens", "use a multiple of 64")),
    (["--kv-cache", "dense", "--kv-chunk", "0"], ("--kv-chunk must be a positive number of tokens, got 0",)),
    (["--kv-cache", "dense", "--kv-chunk", "65"], ("--kv-chunk 65 is longer than a window of 64 positions",)),
    (["--kv-chunk", "16"], ("--kv-chunk only applies with --kv-cache",)),
    (["--kv-cache", "fp8", "--attention", "sinks"], ("--kv-cache fp8", "--attention sinks", "drop one")),
    (["--kv-cache", "dense", "--attention", "sliding", "--window", "8"], ("--attention sliding",)),
]


@pytest.mark.parametrize("argv, needles", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refusals_are_one_line(files, tmp_path, argv, needles):
    run_refused([files["root"], tmp_path], "gqakit", "eval", "ppl", str(files["model"]), "--text",
                str(files["text"]), "--max-length", "64", "-q", "-o", str(tmp_path / "r"), *argv, cwd=tmp_path,
                needles=needles)


def test_missing_backend_names_the_extra(files, tmp_path):
    """A regular package `optimum` first on the path hides optimum.quanto, as if it were not installed."""
    import os

    shadow = tmp_path / "shadow"
    (shadow / "optimum").mkdir(parents=True)
    (shadow / "optimum" / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    run_refused([files["root"]], "gqakit", "eval", "ppl", str(files["model"]), "--text", str(files["text"]),
                "--kv-cache", "int2", "-q", "-o", str(tmp_path / "r"), cwd=tmp_path, env={"PYTHONPATH": path},
                needles=("--kv-cache int2 quantizes with optimum-quanto, which is not installed",
                         'pip install "gqakit[kvquant]"'))
    assert not (tmp_path / "r").exists()


def test_encoder_decoder_is_refused(tmp_path):
    from uptrain_tiny import make_t5_model, make_text

    t5, txt = make_t5_model(tmp_path / "t5", kv_heads=2), make_text(tmp_path / "t.txt", chars=2_000)
    run_refused([tmp_path], "gqakit", "eval", "ppl", str(t5), "--text", str(txt), "--kv-cache", "dense", "-q",
                "-o", str(tmp_path / "r"), cwd=tmp_path, needles=("encoder-decoders", "drop --kv-cache"))


def test_quanto_groups_that_do_not_fill_are_one_line(model):
    pytest.importorskip("optimum.quanto")
    from gqakit.common.errors import GqakitError

    with pytest.raises(GqakitError, match=r"^kv_cache=int4 quantizes a window's first tokens at once, in groups of "
                                          r"64 tokens, and the text's last window holds 30; choose max_length"):
        strided_windows(model, ids(30), 30, progress=False, kv_cache="int4", kv_chunk=30)  # refused before scoring


def _sliding_configs():
    import transformers

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    return {
        "mistral": transformers.MistralConfig(**base, num_hidden_layers=2, sliding_window=16),
        "gemma2": transformers.Gemma2Config(**base, num_hidden_layers=4, head_dim=8, sliding_window=16),
        "gemma3": transformers.Gemma3TextConfig(**base, num_hidden_layers=6, head_dim=8, sliding_window=16),
        "qwen2": transformers.Qwen2Config(**base, num_hidden_layers=4, sliding_window=16, use_sliding_window=True,
                                          max_window_layers=2),
        "llama": transformers.LlamaConfig(**base, num_hidden_layers=2),
    }


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "qwen2", "llama"])
def test_bytes_per_token_at_a_length_are_what_the_dense_cache_holds(family):
    """Sliding-window layers keep at most their window: at 64 tokens (window 16) the figure is the real cache's, not
    every layer at every token (this Gemma3: 768 before, 278 held). A model without them: the plain figure."""
    import transformers

    config = _sliding_configs()[family]
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        out = model(input_ids=ids(64)[None], use_cache=True)
    cache = output_cache(out)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / 64
    assert kv_bytes_per_token(model.config, torch.float32, 64) == pytest.approx(held, rel=1e-12)
    full = kv_bytes_per_token(model.config, torch.float32)
    assert (held == full) if family == "llama" else (held < full)


def test_a_sliding_window_report_states_what_its_dense_cache_holds(tmp_path):
    """eval ppl without a cache reports the bytes a dense cache holds at its window length, the same figure its
    --kv-cache dense run measures from the cache it fills."""
    import transformers

    tok = tokenizer()
    config = _sliding_configs()["mistral"]
    config.vocab_size, config.bos_token_id, config.eos_token_id = len(tok), tok.eos_token_id, tok.eos_token_id
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text(text(400, seed=4), encoding="utf-8")
    rows = {}
    for kind in ("none", "dense"):
        more = () if kind == "none" else ("--kv-cache", "dense", "--kv-chunk", 16)
        code, _, err = run_eval("ppl", tmp_path / "m", "--text", tmp_path / "t.txt", "--max-length", 64,
                                "--max-tokens", 128, *more, "-o", tmp_path / kind, "-q")
        assert code == 0, err
        rows[kind] = report.read_report(tmp_path / kind)["results"]["rows"][0]
    # held_bytes also counts each sliding layer's bookkeeping tensor (one int64): 16 bytes in all, 0.25 per token
    assert rows["none"]["kv_bytes_per_token"] == pytest.approx(rows["dense"]["kv_bytes_held_per_token"], abs=0.25)
    assert rows["none"]["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4 * 15 / 64  # 15 of 64 tokens kept per layer
    assert rows["none"]["kv_bytes_per_token"] < 2 * 2 * 2 * 8 * 4  # every layer at every token


def test_a_cache_with_state_layers_is_refused_rather_than_counted_as_kv():
    """A hybrid (Jamba: Mamba layers beside attention) caches states the K/V figure does not describe."""
    import transformers

    from gqakit.common.errors import GqakitError

    config = transformers.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                      attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)
    with pytest.raises(GqakitError, match="cannot count the KV cache of JambaConfig"):
        kv_bytes_per_token(config, torch.float32, 64)


@pytest.mark.parametrize("length, chunk", [(96, 128), (480, 256), (100, 128), (600, 128), (700, 256), (1024, 64),
                                           (130, 64), (448, 192)])
def test_int4_groups_never_mix_heads(length, chunk):
    """Each head's dequantized keys and values, fed through an int4 cache of two K/V heads (the second 100x the
    first) in `feed_pieces`, equal those of the same head fed alone: no group holds two heads' values. Fed in plain
    chunks, a window of 100 tokens put head 1's outliers in head 0's groups (a review: key error 15.8 against 0.19)."""
    pytest.importorskip("optimum.quanto")
    from transformers import LlamaConfig

    from gqakit.evaluate.kvcache import feed_pieces

    def config(heads):
        return LlamaConfig(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=heads,
                           head_dim=32, num_hidden_layers=1)

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, length, 32, generator=g), torch.randn(1, 2, length, 32, generator=g)
    k[:, 1] *= 100
    v[:, 1] *= 100
    both, alone = make_cache("int4", config(2)).layers[0], make_cache("int4", config(1)).layers[0]
    for start, end in feed_pieces(length, chunk, "int4"):
        seen_both = both.update(k[:, :, start:end], v[:, :, start:end])
        seen_alone = alone.update(k[:, :1, start:end], v[:, :1, start:end])
    for a, b in zip(seen_both, seen_alone):
        assert torch.equal(a[:, :1], b), (length, chunk)


def test_a_latent_cache_quantizes_its_rope_key_per_channel():
    """DeepseekV3 caches the latent where keys go and the RoPE key where values go: per token, the 16-value RoPE
    rows shared groups of 4 tokens, and the MLA rows were quantized unlike the MQA rows' keys (a review)."""
    pytest.importorskip("optimum.quanto")
    from transformers import DeepseekV3Config, LlamaConfig

    latent = DeepseekV3Config(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                              num_hidden_layers=1, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
                              qk_nope_head_dim=16, v_head_dim=32, first_k_dense_replace=1)
    layer = make_cache("int4", latent).layers[0]
    assert (layer.axis_key, layer.axis_value) == (-1, -1)
    plain = make_cache("int4", LlamaConfig(vocab_size=64, hidden_size=64, num_attention_heads=2,
                                           num_key_value_heads=2, num_hidden_layers=1)).layers[0]
    assert (plain.axis_key, plain.axis_value) == (-1, 0)
