"""Latent attention trained by attention transfer (`convert-gqa --to mla --method transfer` with `--kv-rank` /
`--rope-dim`, or `--bias-free`): the trained module is the written checkpoint's own attention (fp32, 1e-5), training
brings each layer's attention closer to the original's than its start, the bias-free output has no bias anywhere,
and what cannot be combined is refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cli_contract import run_refused
from families import load_exact
from gqakit.cli import convert_main
from gqakit.convert.latent.construct import cast_trained, fitted_norm
from gqakit.convert.latent.student import latent_student
from gqakit.hf.architectures.latent import ATTENTION, KV_B, KV_NORM, LATENT_PARAMS, fitted_shape
from gqakit.convert.options import PARAMS
from tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"
SMALL = ["--calibration-tokens", "512", "--calibration-window", "32", "--transfer-steps", "30",
         "--transfer-dtype", "float32"]
IDS = torch.randint(0, 4096, (1, 48), generator=torch.Generator().manual_seed(0))


def _source(tmp_path: Path) -> Path:
    src = make_tiny_llama(tmp_path / "src", heads=4, kv_heads=2, layers=2, head_dim=16, vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, src / name)
    return src


def _convert(src: Path, out: Path, *extra: str) -> None:
    assert convert_main(["--groups", "1", str(src), "--to", "mla", "-o", str(out), "-q", *extra]) == 0


def _attention_io(model, ids=IDS) -> list[tuple[torch.Tensor, dict, torch.Tensor]]:
    """(input, keyword inputs, output) of every layer's attention in the model's forward on ids."""
    seen = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((kwargs["hidden_states"], {k: v for k, v in kwargs.items()
                                                                           if k != "hidden_states"}, out[0])),
        with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_student_on_the_sources_inputs_is_the_written_layers_attention(tmp_path):
    """The trained module takes the source's RoPE tables (sliced to the kept frequencies) and computes what the
    stock class computes with its own: checked on a weights-only fit with a partial RoPE key."""
    src = _source(tmp_path)
    _convert(src, tmp_path / "fit", "--kv-rank", "20", "--rope-dim", "8")
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    target = load_exact(tmp_path / "fit")
    config = json.loads((src / "config.json").read_text())
    shape = fitted_shape(4, 2, 16, 20, 8)
    written = load_file(tmp_path / "fit" / "model.safetensors")
    for i, ((x, kwargs, _), (x_t, kwargs_t, y_t)) in enumerate(zip(_attention_io(source), _attention_io(target))):
        prefix = ATTENTION.format(i=i)
        student = latent_student(config, shape, 2, i, {n[len(prefix):]: t for n, t in written.items()
                                                       if n.startswith(prefix)})
        with torch.no_grad():
            y = student(x_t, **kwargs)[0]  # the source's RoPE tables and mask, the target's layer input
        torch.testing.assert_close(y, y_t, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", [("--kv-rank", "20", "--rope-dim", "8"), ("--bias-free",)],
                         ids=["kv-rank", "bias-free"])
def test_trained_latent_layers_are_closer_to_the_original_than_their_start(tmp_path, extra):
    src = _source(tmp_path)
    start_method = ("--method", "mean") if "--kv-rank" in extra else ("--method", "aligned")
    _convert(src, tmp_path / "start", *(a for a in extra if a != "--bias-free"), *start_method)
    _convert(src, tmp_path / "trained", *extra, "--method", "transfer", "--calibration", str(TEXT), *SMALL)
    card = (tmp_path / "trained" / "README.md").read_text()
    rows = [line.split("|")[1:-1] for line in card.splitlines() if line[:2] == "| " and line[2:3].isdigit()]
    assert len(rows) == 2 and all(float(r[-2]) <= float(r[-3]) for r in rows)  # held-out: never worse than the start
    assert any(float(r[-2]) < float(r[-3]) for r in rows)
    from transformers import AutoTokenizer

    text = (ROOT / "gqakit" / "assets" / "heldout_emma.txt").read_text(encoding="utf-8")[:4000]  # not calibrated on
    ids = AutoTokenizer.from_pretrained(src)(text, return_tensors="pt").input_ids[:, :256]
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    original = _attention_io(source, ids)
    errors = {}
    for name in ("start", "trained"):  # each layer's attention on the original's inputs, against the original's
        model = load_exact(tmp_path / name)
        assert type(model).__name__ == "DeepseekV3ForCausalLM"
        target = _attention_io(model, ids)
        errors[name] = []
        for layer, (x, _, y), (_, kwargs, _) in zip(model.model.layers, original, target):
            with torch.no_grad():
                errors[name].append(_error(layer.self_attn(x, **kwargs)[0], y))
    # the bias-free start is the aligned MQA with its norm: compare training against its fitted-norm start only
    # through the card (above); here against the exact aligned MQA as latent attention, which it must approach
    assert all(t < s for t, s in zip(errors["trained"], errors["start"])), errors


def test_a_bias_free_checkpoint_has_no_bias_and_says_it_is_servable(tmp_path):
    src = _source(tmp_path)
    _convert(src, tmp_path / "out", "--bias-free", "--method", "transfer", "--calibration", str(TEXT), *SMALL)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["attention_bias"] is False and config["kv_lora_rank"] == 16 and "auto_map" not in config
    assert not [name for name in load_file(tmp_path / "out" / "model.safetensors") if name.endswith(".bias")]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "bias-free (attention_bias false), as vLLM and SGLang's DeepSeek classes build it" in card
    assert "kv_a_layernorm" in card  # the norm's weight is trained
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    prompt = IDS[:, :8]
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt),
                         pad_token_id=0)
    assert out.shape == (1, 16)


def test_fitted_norm_undoes_the_norm_where_it_can():
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(1, 6, generator=gen, dtype=torch.float64)
    latents = direction * torch.full((50, 1), 3.0, dtype=torch.float64)  # one RMS: the norm is a fixed scale
    rms = latents.pow(2).mean(-1).sqrt()[0]
    torch.testing.assert_close(fitted_norm(latents, 0.0).double(), torch.full((6,), float(rms), dtype=torch.float64))
    varied = torch.randn(200, 6, generator=gen, dtype=torch.float64) * torch.rand(200, 1, generator=gen,
                                                                                   dtype=torch.float64)
    w = fitted_norm(varied, 1e-6).double()
    rho = (varied.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    best = ((varied - w * varied / rho).pow(2)).sum()
    for bump in (0.99, 1.01):  # the least-squares weight: any other scale of a coordinate does worse
        other = w.clone()
        other[2] *= bump
        assert ((varied - other * varied / rho).pow(2)).sum() > best


def test_cast_trained_rounds_the_norm_once_into_kv_b():
    gen = torch.Generator().manual_seed(0)
    tensors = {KV_NORM: 1 + torch.rand(8, generator=gen) * 0.01, KV_B: torch.randn(12, 8, generator=gen)}
    made = cast_trained(tensors, torch.bfloat16)
    exact = tensors[KV_B].double() * tensors[KV_NORM].double()
    held = made[KV_B].double() * made[KV_NORM].double()
    naive = tensors[KV_B].bfloat16().double() * tensors[KV_NORM].bfloat16().double()
    # bf16 keeps 8 significant bits: folding the norm's rounding into kv_b leaves about one rounding of the
    # product (within 2^-8 relative, with slack for the product's own rounding); casting each alone does not
    assert float(((held - exact) / exact).abs().max()) < 2 ** -8 * 1.05
    assert float(((naive - exact) / exact).abs().max()) > float(((held - exact) / exact).abs().max())


def test_latent_params_name_every_transfer_params_choice():
    assert LATENT_PARAMS.keys() == PARAMS.keys()


@pytest.mark.parametrize("args, needle", [
    (("--bias-free",), "--bias-free shapes latent attention; add --to mla"),
    (("--to", "mla", "--bias-free"), "--bias-free leaves the latent's RMSNorm in the function, which only training"),
    (("--to", "mla", "--kv-rank", "8", "--method", "transfer", "--transfer-start", "fit"),
     "drop --transfer-start"),
    (("--to", "mla", "--kv-rank", "8", "--method", "first"), "drop --method first"),
])
def test_latent_training_options_that_cannot_combine_are_refused_in_one_line(tmp_path, args, needle):
    src = make_tiny_llama(tmp_path / "src", heads=4, kv_heads=2, head_dim=8)
    run_refused(tmp_path, "convert-gqa", "--groups", "1", *args, str(src), "-o", str(tmp_path / "o"),
                needles=(needle,))


def test_a_calibrated_fit_is_exact_on_the_inputs_it_was_calibrated_on():
    """Inputs that live in a 4-dim subspace make the two K/V heads' values rank 4 there: a rank-4 latent fitted in
    their metric reproduces every value on them exactly; fitted from the weights alone it cannot. The identity
    metric is the weights-only fit."""
    from gqakit.convert.latent.fit import fit_latent, input_metric

    g, d, n, heads, rank = 2, 8, 32, 4, 4
    gen = torch.Generator().manual_seed(2)
    f64 = dict(generator=gen, dtype=torch.float64)
    q, k, v, o = (torch.randn(heads * d, n, **f64), torch.randn(g * d, n, **f64), torch.randn(g * d, n, **f64),
                  torch.randn(n, heads * d, **f64))
    basis = torch.randn(n, 4, **f64)
    metric = input_metric(basis @ basis.T, basis @ basis.T)
    shape = fitted_shape(heads, g, d, rank, d)
    x = torch.randn(6, 4, **f64) @ basis.T  # inputs in the calibrated subspace
    errors = {}
    for name, inputs in (("calibrated", metric), ("weights", None)):
        made = fit_latent(q, k, v, o, shape, torch.float64, inputs=inputs)
        latent = x @ made["kv_a_proj_with_mqa.weight"][:rank].T
        held = torch.stack([latent @ made["kv_b_proj.weight"].reshape(heads, d, -1)[h, :, :rank].T
                            for h in range(0, heads, 2)])  # one query head per K/V head
        exact = torch.stack([x @ v[m * d:(m + 1) * d].T for m in range(g)])
        errors[name] = _error(held, exact)
    # 1e-6: the metric's square root turns its round-off zero eigenvalues (~1e-16) into ~1e-8
    assert errors["calibrated"] < 1e-6 and errors["weights"] > 0.1, errors
    plain = fit_latent(q, k, v, o, shape, torch.float64)
    same = fit_latent(q, k, v, o, shape, torch.float64, inputs=torch.eye(n, dtype=torch.float64))
    for name in plain:
        torch.testing.assert_close(same[name], plain[name], atol=1e-10, rtol=1e-10)


def test_fit_with_a_kv_rank_is_a_calibrated_latent_fit(tmp_path):
    src = _source(tmp_path)
    _convert(src, tmp_path / "fit", "--kv-rank", "20", "--rope-dim", "8", "--method", "fit", "--calibration",
             str(TEXT), "--calibration-tokens", "512", "--calibration-window", "32")
    card = (tmp_path / "fit" / "README.md").read_text()
    assert "in the metric of the layer's attention inputs on the calibration text" in card
    assert "**Warning:**" not in card  # no heads merged: nothing to hold against mean-pooling
    weights = load_file(tmp_path / "fit" / "model.safetensors")
    _convert(src, tmp_path / "plain", "--kv-rank", "20", "--rope-dim", "8")
    kv_b = ATTENTION.format(i=0) + "kv_b_proj.weight"
    assert not torch.equal(weights[kv_b], load_file(tmp_path / "plain" / "model.safetensors")[kv_b])
    assert type(load_exact(tmp_path / "fit")).__name__ == "DeepseekV3ForCausalLM"
