"""`convert-gqa --to mla`: the grouped model written as transformers' stock DeepseekV3 (latent attention), which must
compute what the MQA computes (fp32 logits within 1e-4), load with the Auto classes without remote code, cache what
the card says, and refuse in one line what the stock class cannot host."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cli_contract import run_refused
from families import load_exact, make_model
from gqakit.cli import convert_main
from gqakit.hf.compat import cache_kwargs
from gqakit.hf.loading import kv_bytes_per_token
from tiny_models import make_tiny_llama

ASSETS = Path(__file__).resolve().parents[2] / "gqakit" / "assets"
IDS = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def convert(src, out, *extra: str) -> None:
    assert convert_main(["--groups", "1", str(src), "-o", str(out), "-q", *extra]) == 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("method", ["mean", "aligned"])
def test_mla_computes_what_the_mqa_computes(tmp_path, family, method):
    src = make_model(family, tmp_path / "src", **({"sliding_window": None} if family == "mistral" else {}))
    convert(src, tmp_path / "mqa", "--method", method)
    convert(src, tmp_path / "mla", "--method", method, "--to", "mla")
    mqa, mla = load_exact(tmp_path / "mqa"), load_exact(tmp_path / "mla")  # nothing missing or left unused
    assert type(mla).__name__ == "DeepseekV3ForCausalLM"
    torch.testing.assert_close(logits(mla), logits(mqa), atol=1e-4, rtol=0)  # fp32: the construction is exact
    config = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "auto_map" not in config
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (9, 8, 0)


def test_an_mqa_source_is_kept_exactly_and_generates_the_same_tokens(tmp_path):
    src = make_tiny_llama(tmp_path / "src", heads=4, kv_heads=1, head_dim=16)
    convert(src, tmp_path / "mla", "--to", "mla")
    before = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(after), logits(before), atol=1e-4, rtol=0)
    prompt = IDS[:1, :8]
    same = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(before.generate(prompt, **same), after.generate(prompt, **same))


def test_the_cache_holds_the_latent_and_one_rope_key_as_counted(tmp_path):
    src = make_tiny_llama(tmp_path / "src", heads=4, layers=3, head_dim=16)
    convert(src, tmp_path / "mla", "--to", "mla")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS[:1], **cache_kwargs(model, cache), use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held / IDS.shape[1] == kv_bytes_per_token(model.config, torch.float32) == 3 * (17 + 16) * 4
    # the bias coordinate sits at about 1 in the cache (not at B): an update of its kv_b_proj column in training, or a
    # quantized cache's scale, is then no larger than for any other latent value
    torch.testing.assert_close(cache.layers[0].keys[..., 16], torch.ones(1, 1, IDS.shape[1]), atol=1e-3, rtol=0)
    card = (tmp_path / "mla" / "README.md").read_text()
    assert "DeepseekV3ForCausalLM (stock, from LlamaForCausalLM)" in card and "a latent of 17 values" in card
    assert "not in vLLM/SGLang" in card  # the bias coordinate: transformers-only, and the card says so
    assert "converted to MLA (from MQA)" in card


def test_bfloat16_output_stays_close_to_the_bfloat16_mqa(tmp_path):
    src = make_model("llama", tmp_path / "src")
    convert(src, tmp_path / "mqa", "--dtype", "bfloat16")
    convert(src, tmp_path / "mla", "--dtype", "bfloat16", "--to", "mla")
    mqa = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa", dtype=torch.float32).eval()
    mla = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    a, b = logits(mqa), logits(mla)
    # both hold bf16 weights; the MLA's o_proj is re-rounded after dividing out the norm's realised scale, so the
    # two differ by bf16 rounding of o_proj (relative 2^-9 per weight), not by a systematic scale
    assert (a - b).abs().max() < 0.02 * a.abs().max()


@pytest.mark.parametrize("family, overrides, needle", [
    ("gpt2", {}, "--to mla cannot convert GPT2LMHeadModel (re-hosted as GPTBigCodeForCausalLM)"),
    ("qwen2", {}, "latent attention hosts llama, mistral"),
    ("phi", {}, "cannot compute"),
    ("llama", {"attention_bias": True}, "biases on q/k/v/o"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                   "original_max_position_embeddings": 32}}, "uses yarn RoPE scaling"),
    ("mistral", {}, "sliding window of 8"),
])
def test_models_the_stock_class_cannot_host_are_refused_in_one_line(tmp_path, family, overrides, needle):
    src = make_model(family, tmp_path / "src", **overrides)
    run_refused(tmp_path, "convert-gqa", "--groups", "1", "--to", "mla", str(src), "-o", str(tmp_path / "o"),
                needles=(needle, "drop --to mla"))


def test_a_grouping_the_latent_cannot_hold_is_refused(tmp_path):
    src = make_tiny_llama(tmp_path / "src")
    run_refused(tmp_path, "convert-gqa", "--groups", "2", "--to", "mla", str(src), "-o", str(tmp_path / "o"),
                needles=("--to mla holds one latent and one shared RoPE key", "use --groups 1"))


def test_generate_and_eval_run_on_the_mla_output_and_refuse_key_re_rotation(tmp_path):
    from gqakit.decode.streaming import stream_tokens

    src = make_tiny_llama(tmp_path / "src", heads=4, head_dim=16)
    convert(src, tmp_path / "mla", "--to", "mla")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    prompt = IDS[:1, :8]
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt),
                              pad_token_id=0)[0, 8:]
    # gqakit's decoding loop with a cache that never evicts (generate's full-cache path) reads no RoPE
    got = torch.cat(list(stream_tokens(model, prompt, 12, sinks=0, window=20)))
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="latent attention"):  # sinks would re-rotate the latent as if it were keys
        next(iter(stream_tokens(model, prompt, 12, sinks=2, window=4)))
    embedded = ASSETS / "austen-mha-8h"
    convert(embedded, tmp_path / "austen-mla", "--to", "mla")
    run_refused(tmp_path, "gqakit", "eval", "stream", str(tmp_path / "austen-mla"), "--text",
                str(ASSETS / "heldout_emma.txt"), "--tokens", "64", "--chunk", "16", "-o", str(tmp_path / "r"),
                needles=("--policy sinks keeps a bounded cache whose keys it moves by RoPE, and a latent-attention "
                         "model", "--policy dense"))
    run_refused(tmp_path, "gqakit", "generate", str(tmp_path / "austen-mla"), "--prompt", "It is", "--window", "8",
                needles=("--attention sinks re-rotates", "--attention default"))


def test_a_fitted_latent_holds_an_mqa_and_rank_one_rope_keys_exactly(tmp_path):
    from gqakit.convert.latent.fit import fit_latent
    from gqakit.hf.architectures.latent import LatentShape

    src = make_tiny_llama(tmp_path / "mqa", heads=4, kv_heads=1, head_dim=16)
    convert(src, tmp_path / "fit", "--to", "mla", "--kv-rank", "16")  # rope_dim defaults to head_dim
    before = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    after = load_exact(tmp_path / "fit")
    torch.testing.assert_close(logits(after), logits(before), atol=1e-4, rtol=0)
    card = (tmp_path / "fit" / "README.md").read_text()
    assert "a fitted latent" in card and "the latent is a fit, not the same function" in card
    assert "converted to MLA (a fitted latent)" in card and "(from MQA)" not in card  # the title says what it is
    # two K/V heads whose keys are complex multiples of one another per RoPE pair (a rotation and a scale that RoPE
    # commutes with): one shared RoPE key holds both, and a latent of full rank holds both values
    g, d, n, heads = 2, 8, 32, 4
    gen = torch.Generator().manual_seed(1)
    f64 = dict(generator=gen, dtype=torch.float64)
    k0 = torch.randn(d, n, **f64)
    alpha = torch.complex(torch.randn(d // 2, 1, **f64), torch.randn(d // 2, 1, **f64))
    z = alpha * torch.complex(k0[:d // 2], k0[d // 2:])
    k = torch.cat([k0, z.real, z.imag])
    q, v, o = torch.randn(heads * d, n, **f64), torch.randn(g * d, n, **f64), torch.randn(n, heads * d, **f64)
    shape = LatentShape(heads=heads, rank=g * d, rope_dim=d, nope_dim=0, v_dim=d)
    errors: dict = {}
    made = fit_latent(q, k, v, o, shape, torch.float64, errors=errors)
    assert errors["k"] < 1e-12 and errors["v"] < 1e-12
    x = torch.randn(5, n, generator=gen, dtype=torch.float64)
    for h in range(heads):  # every head's rotation-free logits and values: q_h . k_g and v_g from the latent
        m = h // 2
        latent = x @ made["kv_a_proj_with_mqa.weight"][:g * d].T  # the bias coordinate and RoPE key excluded
        value = latent @ made["kv_b_proj.weight"].reshape(heads, d, -1)[h, :, :g * d].T
        torch.testing.assert_close(value, x @ v[m * d:(m + 1) * d].T)
        rope = x @ made["kv_a_proj_with_mqa.weight"][g * d + 1:].T
        q_new = x @ made["q_proj.weight"].reshape(heads, d, n)[h].T
        torch.testing.assert_close((q_new * rope).sum(-1), (x @ q[h * d:(h + 1) * d].T
                                                           * (x @ k[m * d:(m + 1) * d].T)).sum(-1))


def test_a_partial_rope_key_keeps_the_highest_frequencies_of_the_source(tmp_path):
    src = make_tiny_llama(tmp_path / "src", heads=4, kv_heads=2, head_dim=16)
    convert(src, tmp_path / "fit", "--to", "mla", "--rope-dim", "8")  # kv-rank: 2 x 16 - 8 = 24, MQA's budget
    config = json.loads((tmp_path / "fit" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (25, 8, 8)
    before = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    after = load_exact(tmp_path / "fit")
    source_freqs = before.model.rotary_emb.inv_freq
    torch.testing.assert_close(after.model.rotary_emb.inv_freq, source_freqs[:4], rtol=1e-6, atol=0)
    assert torch.isfinite(logits(after)).all()


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}], ids=["default", "linear"])
def test_the_card_measures_the_dims_a_fitted_latent_reads_unrotated(tmp_path, scaling):
    """A review: an MQA source at a rank that holds its position-free keys exactly, with --rope-dim 8 of 16, showed
    k_proj 0.0000 in every layer, yet the model changed (logits 1.3 off): the dims read without rotation cost nothing
    at one position. The card's next column is that cost over relative positions 0..C-1; here the latent's fit is
    exact, so it is sqrt(mean_t ||(R_t - 1) k_unrotated||^2 / ||k||^2), turned by transformers' own RoPE table."""
    src = make_tiny_llama(tmp_path / "mqa", heads=4, kv_heads=1, head_dim=16)
    if scaling:
        config = json.loads((src / "config.json").read_text())
        config["rope_parameters"] = {**config.get("rope_parameters", {}), **scaling}
        (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "fit", "--to", "mla", "--kv-rank", "24", "--rope-dim", "8")  # 8 unrotated + 16 values
    before = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    context = before.config.max_position_embeddings
    positions = torch.arange(context)[None]
    cos, sin = before.model.rotary_emb(torch.zeros(1, dtype=torch.float64), positions)  # (1, C, 16), halves repeated
    cos, sin = cos[0, :, :8].double(), sin[0, :, :8].double()  # per pair j: cos / sin of t w_j
    rows = [line for line in (tmp_path / "fit" / "README.md").read_text().splitlines() if line.startswith("| 0 |")
            or line.startswith("| 1 |")]
    assert "| layer | k_proj | k_proj over positions 0-127 | v_proj |" in (tmp_path / "fit" / "README.md").read_text()
    for i, row in enumerate(rows):
        k = before.model.layers[i].self_attn.k_proj.weight.detach()  # (16, n): one K/V head
        a = torch.complex(k[4:8], k[12:16])  # the 4 lowest-frequency pairs: read unrotated
        turned = a[None] * torch.complex(cos[:, 4:8], -sin[:, 4:8])[..., None]  # (C, 4, n): times e^{-i t w}
        want = float(((turned - a[None]).abs().pow(2).sum() / context).sqrt() / k.norm())
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) < 5e-5 and float(cells[3]) < 5e-5  # the fit itself is exact at one position
        assert float(cells[2]) == pytest.approx(want, abs=6e-5) and want > 0.05, (cells, want)


@pytest.mark.parametrize("args, needle", [
    (("--to", "mla", "--rope-dim", "7"), "--rope-dim 7 must be an even number"),
    (("--to", "mla", "--kv-rank", "0"), "--kv-rank 0 must be from 1 to"),
    (("--kv-rank", "8"), "add --to mla"),
    (("--to", "mla", "--kv-rank", "8", "--method", "aligned"), "drop --method aligned"),
])
def test_latent_shapes_that_do_not_fit_are_refused_in_one_line(tmp_path, args, needle):
    src = make_tiny_llama(tmp_path / "src", heads=4, kv_heads=2, head_dim=8)
    run_refused(tmp_path, "convert-gqa", "--groups", "1", *args, str(src), "-o", str(tmp_path / "o"),
                needles=(needle,))


def _drop_keys(folder: Path, *keys: str) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key in keys:
        config.pop(key)
    path.write_text(json.dumps(config))


def test_a_mistral_whose_config_json_leaves_its_window_to_the_class_is_refused(tmp_path):
    """config.json without `sliding_window` means Mistral's class default, 4096: converted as if it had none, the
    latent model attended past it (5.5e-4 in logits from position 4096 on, a review measured)."""
    src = make_model("mistral", tmp_path / "src", sliding_window=None, max_position_embeddings=8192)
    _drop_keys(src, "sliding_window")
    run_refused(tmp_path, "convert-gqa", "--groups", "1", "--to", "mla", str(src), "-o", str(tmp_path / "o"),
                needles=("sliding window of 4096", "drop --to mla"))


def test_fields_config_json_leaves_to_the_class_keep_the_sources_defaults(tmp_path):
    """The DeepseekV3 config took DeepseekV3's own defaults for what the source's config.json left out (a 4096-token
    context where Llama's is 2048: dynamic RoPE scaling then started elsewhere; token ids 0 / 1 for 1 / 2)."""
    src = make_tiny_llama(tmp_path / "src")
    _drop_keys(src, "max_position_embeddings", "bos_token_id", "eos_token_id", "rms_norm_eps")
    convert(src, tmp_path / "mla", "--to", "mla")
    config = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"],
            config["rms_norm_eps"]) == (2048, 1, 2, 1e-6)


def test_a_pruned_head_is_fitted_without_a_singular_solve(tmp_path):
    """A head whose queries (or output columns) are all zero reads nothing from its group: the fit's weight for
    that group was singular and the command crashed with a traceback; its keys now take any finite value."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_llama(tmp_path / "src", heads=4, head_dim=16)
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"][16:32] = 0  # head 1 asks nothing
    weights["model.layers.1.self_attn.o_proj.weight"][:, 32:48] = 0  # head 2 writes nothing
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    convert(src, tmp_path / "mla", "--to", "mla", "--kv-rank", "16")
    model = load_exact(tmp_path / "mla")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(logits(model)).all()


def test_the_latent_config_reads_rope_scaling_over_rope_parameters_as_transformers_does():
    """A Llama 2 fine-tune saved by transformers 5 holds a default rope_parameters beside its dynamic rope_scaling,
    which transformers applies: the latent config read its own copy of the two dicts the other way round and wrote
    default RoPE (now `rope_of`, the one reading)."""
    from gqakit.hf.architectures.latent import latent_config, mqa_shape

    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    rope = latent_config(config, mqa_shape(4, 8, True), 2)["rope_parameters"]
    assert rope == {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
