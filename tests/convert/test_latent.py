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
        model(IDS[:1], past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held / IDS.shape[1] == kv_bytes_per_token(model.config, torch.float32) == 3 * (17 + 16) * 4
    card = (tmp_path / "mla" / "README.md").read_text()
    assert "DeepseekV3ForCausalLM (stock, from LlamaForCausalLM)" in card and "a latent of 17 values" in card
    assert "not in vLLM/SGLang" in card  # the bias coordinate: transformers-only, and the card says so


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
    ("gpt2", {}, "--to mla cannot convert GPTBigCodeForCausalLM"),
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
                needles=("--to mla holds one key and one value", "use --groups 1"))


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
                needles=("--policy sinks re-rotates", "--policy dense"))
    run_refused(tmp_path, "gqakit", "generate", str(tmp_path / "austen-mla"), "--prompt", "It is", "--window", "8",
                needles=("--attention sinks re-rotates", "--attention default"))
