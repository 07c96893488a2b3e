"""`convert-gqa --method aligned` end to end: a stock checkpoint, exact where the maths says it is
exact, refused in one line where the architecture cannot take the transforms."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_contract import run_refused
from gqakit.cli import convert_main
from gqakit.convert.methods.align import scaled_rotation, transform_keys
from tiny_models import checkpoint_logits, make_disguised_llama, make_tiny_llama


TEXT = Path(__file__).resolve().parents[2] / "gqakit" / "assets" / "pride_and_prejudice.txt"


def test_heads_that_differ_only_by_exact_reparametrisations_merge_exactly(tmp_path):
    src = make_disguised_llama(tmp_path / "src")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    original = checkpoint_logits(src, ids)
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "aligned"), "--method", "aligned", "-q"]) == 0
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "mean"), "-q"]) == 0
    aligned, mean = checkpoint_logits(tmp_path / "aligned", ids), checkpoint_logits(tmp_path / "mean", ids)
    assert (mean - original).abs().max() > 1e-2  # mean-pooling cannot see that the heads are the same
    torch.testing.assert_close(aligned, original, atol=1e-5, rtol=1e-5)
    config = json.loads((tmp_path / "aligned" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    card = (tmp_path / "aligned" / "README.md").read_text()
    assert "| method | aligned |" in card and "Relative error of each query head's attention maps" in card
    rows = [line.split("|")[2:4] for line in card.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2 and all(float(x) < 1e-6 for row in rows for x in row)  # exact: zero error


def test_the_aligned_merge_writes_a_stock_checkpoint_of_the_same_shapes(tmp_path):
    src = make_tiny_llama(tmp_path / "src", heads=4, layers=2, head_dim=8)
    assert convert_main(["--groups", "1", str(src), "-o", str(tmp_path / "mqa"), "--method", "aligned", "-q"]) == 0
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "mqa" / "model.safetensors")
    assert set(before) == set(after)
    for name, t in after.items():
        if "k_proj" in name or "v_proj" in name:
            assert t.shape == (8, 32)
        else:
            assert t.shape == before[name].shape and t.dtype == before[name].dtype
    assert torch.isfinite(checkpoint_logits(tmp_path / "mqa", torch.tensor([[1, 2, 3, 4]]))).all()
    card = (tmp_path / "mqa" / "README.md").read_text()
    rows = [line.split("|")[2:4] for line in card.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 2 and all(0.01 < float(x) < 2 for row in rows for x in row)  # random heads: inexact


def test_unalignable_models_and_groups_are_refused_in_one_line(tmp_path):
    src = make_tiny_llama(tmp_path / "src", heads=4, layers=1, head_dim=8)
    run_refused(tmp_path, "convert-gqa", "--groups", "4", str(src), "-o", str(tmp_path / "o"), "--method", "aligned",
                needles=("--method aligned merges heads, but --groups 4 keeps",))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    run_refused(tmp_path, "convert-gqa", "--groups", "2", str(src), "-o", str(tmp_path / "o"), "--method", "aligned",
                needles=("partial_rotary_factor 0.5", "use --method mean"))


@pytest.mark.parametrize("method", ["aligned", "fit"])
@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_families_whose_keys_cannot_be_rotated_are_refused(tmp_path, family, method):
    from transformers import AutoModelForCausalLM, Phi3Config, Qwen3Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=8)
    cfg = Qwen3Config(**small) if family == "qwen3" else Phi3Config(
        **{k: v for k, v in small.items() if k != "head_dim"}, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    why = "normalises keys" if family == "qwen3" else "fuses Q, K and V"
    calibration = ["--calibration", str(TEXT)] if method == "fit" else []
    run_refused(tmp_path, "convert-gqa", "--groups", "2", str(tmp_path / "src"), "-o", str(tmp_path / "o"),
                "--method", method, *calibration, needles=(f"--method {method} cannot convert", why))


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_refusals_name_the_users_class_and_its_host(tmp_path, family):
    """GPT-2 and OPT are written as GPTBigCode: a refusal named only the host (OPT "fuses Q, K and V", GPT-2 "has no
    encoder" as GPTBigCodeForCausalLM). It names the user's class first, then the stock class it is re-hosted as."""
    from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig

    cfg = (GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32) if family == "gpt2" else
           OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64, vocab_size=64,
                     max_position_embeddings=32, word_embed_proj_dim=32))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    named = {"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM"}[family]
    for extra, why in [(["--method", "aligned"], "cannot convert"), (["--pool-encoder"], "has no encoder")]:
        run_refused(tmp_path, "convert-gqa", "--groups", "2", str(tmp_path / "src"), "-o", str(tmp_path / "o"),
                    *extra, needles=(f"{named} (re-hosted as GPTBigCodeForCausalLM)", why))


@pytest.mark.parametrize("case", ["phi qk_layernorm", "phi default rotary", "nemotron default rotary"])
def test_what_a_config_leaves_to_its_class_is_refused_as_if_written(tmp_path, case):
    """Phi's key LayerNorm (qk_layernorm) and the partial RoPE of Phi and Nemotron by their class's default (no
    partial_rotary_factor in config.json) are refused as when config.json spells them out."""
    from families import make_model

    family = case.split()[0]
    src = make_model(family, tmp_path / "src", **({"qk_layernorm": True} if "qk" in case else {}))
    if "default" in case:
        config = json.loads((src / "config.json").read_text())
        config.pop("partial_rotary_factor", None)
        config.get("rope_parameters", {}).pop("partial_rotary_factor", None)
        (src / "config.json").write_text(json.dumps(config))
    why = "normalises keys" if "qk" in case else "partial_rotary_factor 0.5"
    run_refused(tmp_path, "convert-gqa", "--groups", "2", str(src), "-o", str(tmp_path / "o"), "--method", "aligned",
                needles=("--method aligned cannot convert", why))


def test_scaled_rotations_are_what_the_transforms_accept():
    a, b = torch.tensor([2.0]), torch.tensor([0.5])
    assert torch.equal(scaled_rotation(a, b)[0], torch.tensor([[2.0, -0.5], [0.5, 2.0]]))
    with pytest.raises(ValueError, match="scaled rotations"):
        reflection = torch.tensor([[[[1.0, 0.0], [0.0, -1.0]]]])
        transform_keys(torch.zeros(16, 4), torch.zeros(8, 4), reflection.expand(1, 4, 2, 2), 2, 1, 8)


def test_a_layer_merge_says_when_it_is_not_known_to_beat_the_mean(tmp_path):
    """Weights-only aligned is not checked against mean-pooling on held-out text: one warning line and a card note.
    Calibrated, the card shows mean-pooling's held-out logit error beside the merge's for every layer."""
    from cli_contract import run_cli

    import shutil

    src = make_tiny_llama(tmp_path / "src", heads=4, head_dim=8, layers=2, vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # calibration tokenises with the model's tokenizer
        shutil.copy(TEXT.parent / "austen-mha-8h" / name, src / name)
    done = run_cli("convert-gqa", "--groups", "2", "--method", "aligned", str(src), "-o", str(tmp_path / "a"),
                   "--quiet")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert-gqa: warning: --method aligned without --calibration"), \
        done.stderr
    assert "**Warning:** --method aligned without --calibration" in (tmp_path / "a" / "README.md").read_text()

    done = run_cli("convert-gqa", "--groups", "2", "--method", "fit", "--calibration", str(TEXT),
                   "--calibration-tokens", "1024", "--calibration-window", "128", str(src), "-o", str(tmp_path / "f"),
                   "--quiet")
    assert done.returncode == 0, done.stderr
    card = (tmp_path / "f" / "README.md").read_text()
    assert "| held-out logits | held-out logits, mean-pooled |" in card
    rows = [line.split("|") for line in card.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2 and all(float(r[5]) > 0 for r in rows)  # mean-pooling's error, measured per layer
    worse = [r for r in rows if float(r[4]) > float(r[5])]
    assert ("larger held-out logit error than mean-pooling" in done.stderr) is bool(worse), done.stderr


def test_worse_than_mean_names_the_layers():
    from gqakit.convert.card import worse_than_mean

    errors = {0: {"logits": 0.2, "logits_mean": 0.5}, 1: {"logits": 0.7, "logits_mean": 0.5}, 2: {"k": 0.1}}
    assert worse_than_mean(errors) == [1]


@pytest.mark.parametrize("method", ["mean", "aligned"])
def test_a_wider_output_dtype_is_merged_at_its_precision(tmp_path, method):
    """--dtype float32 from a bf16 checkpoint merges at float32: the same bytes as converting a float32 copy of it
    (before, every merged tensor was rounded to bf16 first and only then widened: 1.7e-3 off the mean)."""
    from safetensors.torch import save_file

    src = make_tiny_llama(tmp_path / "bf16", heads=4, layers=2, head_dim=8)
    weights = {name: t.bfloat16() for name, t in load_file(src / "model.safetensors").items()}
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    wide = tmp_path / "f32"
    wide.mkdir()
    for name in ("config.json",):
        (wide / name).write_text((src / name).read_text())
    save_file({name: t.float() for name, t in weights.items()}, str(wide / "model.safetensors"),
              metadata={"format": "pt"})
    for folder, extra in ((src, ["--dtype", "float32"]), (wide, [])):
        assert convert_main(["--groups", "1", str(folder), "-o", str(tmp_path / f"out-{folder.name}"), "--method",
                             method, "-q", *extra]) == 0
    got, want = load_file(tmp_path / "out-bf16" / "model.safetensors"), load_file(tmp_path / "out-f32" /
                                                                                   "model.safetensors")
    assert all(t.dtype == torch.float32 for t in got.values())
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    k = got["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(k, k.bfloat16().float())  # not bf16 values widened


@pytest.mark.parametrize("source, output", [(torch.bfloat16, "float16"), (torch.float16, "bfloat16")])
def test_a_16_bit_output_of_the_other_format_is_rounded_once(tmp_path, source, output):
    """bf16 -> --dtype float16 (and back) merges in float32 and rounds once to the output: the mean pooled in
    float64 and cast to the output dtype (before, it was rounded to the source's format first: 2,745 of 4,096
    values off by up to 9.8e-4, a review)."""
    from safetensors.torch import save_file

    src = make_tiny_llama(tmp_path / "src", heads=4, layers=1, head_dim=16)
    weights = {name: t.to(source) for name, t in load_file(src / "model.safetensors").items()}
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert convert_main(["--groups", "1", str(src), "-o", str(tmp_path / "out"), "--dtype", output, "-q"]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    for proj in ("k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        heads = weights[name].double().reshape(4, 16, -1)
        assert torch.equal(got[name], heads.mean(0).to(getattr(torch, output))), name
