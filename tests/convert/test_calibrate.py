"""Calibration (`convert-gqa --calibration`) and the calibrated merges (`--method fit`, `--method aligned`).

* the statistics equal an explicit loop over heads and queries (float64 reference; 1e-5);
* a decoder layer whose linears are streamed from the checkpoint in row blocks gives the materialised
  layer's output (fp32, 1e-5 of its largest value), and no weight matrix of it is ever real;
* the hidden states wait in a scratch file that is removed at the end, on an error and when the caller
  stops early; the held-out logit error, one head at a time, is the all-heads-at-once formula's (1e-12);
* the layer-by-layer pass (meta-device model, one decoder layer materialised at a time) sees exactly the
  attention inputs and probabilities of the whole model's eager forward, for every alignable family,
  with sliding windows and biases (1e-5, fp32);
* end to end: heads that are the same head in disguise merge exactly (logits 1e-5, card errors 0), also
  when the matching heads are not neighbours (grouping from data);
* every bad calibration input is one line, and nothing is written.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cli_contract import run_cli, run_refused
from gqakit.cli import convert_main
from gqakit.common import fitted
from gqakit.convert.calibration import runner as runner_module
from gqakit.convert.calibration import streamed as streamed_module
from gqakit.hf.architectures import find_family
from gqakit.convert.calibration.moments import (STATS, attention_terms, logit_error, reference_moments, rope,
                                                sum_moments)
from gqakit.convert.calibration.runner import LayerwiseModel, calibrate
from gqakit.convert.calibration.stored import layer_path, load_layer, save_layer
from gqakit.hf.headers import read_header, scan_checkpoint
from gqakit.convert.calibration.streamed import StreamedLinear
from families import make_model
from tiny_models import checkpoint_logits, make_disguised_llama, make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"
ALIGNABLE = ["llama", "mistral", "qwen2", "gemma", "gemma2", "olmo", "starcoder2", "granite"]
SMALL = ["--calibration-tokens", "256", "--calibration-window", "32"]  # 8 windows, 1 held out


def _with_tokenizer(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, path / name)
    return path


def _card_errors(path) -> list[list[float]]:
    card = (path / "README.md").read_text()
    rows = [line.split("|")[2:-1] for line in card.splitlines() if line[:2] == "| " and line[2:3].isdigit()]
    return [[float(x) for x in row] for row in rows]


def test_moment_sums_match_an_explicit_loop():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=gen, dtype=torch.float64)
    scores = torch.randn(2, 3, 6, 6, generator=gen, dtype=torch.float64)
    probs = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    got, order = {}, []

    def keep(name, value):
        order.append(name)
        got[name] = value.clone()

    sum_moments(2, lambda w: (x[w], attention_terms(probs[w])), 3, keep)
    assert order == ["key", "value", "input", "mean", "value_mean"]  # one n x n sum at a time, in this order
    want = reference_moments(x, probs)
    assert got.keys() == want.keys()
    for key, ref in want.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("family", ALIGNABLE)
def test_layer_by_layer_pass_sees_what_the_whole_model_sees(family, tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_model(family, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    windows = torch.randint(3, 64, (5, 16), generator=torch.Generator().manual_seed(1))  # 16 > sliding window 8
    folder = tmp_path / "stats"
    folder.mkdir()
    done = list(calibrate(config, find_family(config["architectures"][0]), scan_checkpoint(src), windows, 2, folder,
                          progress=False))

    model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32).eval()
    xs: dict[int, list] = {}
    probs: dict[int, list] = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_pre_hook(lambda _m, a, i=i: xs.setdefault(i, []).append(a[0]))
    with torch.no_grad():
        for w in windows:
            for i, a in enumerate(model(input_ids=w[None], output_attentions=True).attentions):
                probs.setdefault(i, []).append(a)
    assert done == list(range(len(model.model.layers)))
    assert sorted(p.name for p in folder.iterdir()) == [layer_path(folder, i).name for i in done]  # no scratch left
    for i in done:
        moments, held = load_layer(folder, i, dtype=torch.float32)
        x, p = torch.cat(xs[i]), torch.cat(probs[i])
        want = reference_moments(x[:3], p[:3])
        stored = read_header(layer_path(folder, i))[0]
        assert moments.keys() == want.keys() and all(stored[k].dtype == "F32" for k in STATS)
        for key, ref in want.items():  # summed in float64, yielded in the float32 they are stored in
            torch.testing.assert_close(moments[key].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        torch.testing.assert_close(held["x"], x[3:], rtol=1e-5, atol=1e-5)
        assert held["allowed"].shape == (16, 16) and not held["allowed"].triu(1).any()
        assert p[:, :, ~held["allowed"]].abs().max() == 0  # every key a query attends to is allowed
        assert held["allowed"].sum() == (p[0, 0] > 0).sum()  # ... and no other (eager probs are positive)


# plain, biased MLP (its biases read under the MLP's own names, not the chunked wrapper's), biased k/v, scaled
# embedding and softcaps, fused qkv_proj / gate_up_proj, per-head qk norms
@pytest.mark.parametrize("family, overrides", [("llama", {}), ("llama", {"mlp_bias": True}), ("qwen2", {}),
                                               ("gemma2", {}), ("phi3", {}), ("stablelm", {})])
def test_streamed_layer_gives_the_materialised_layers_output(family, overrides, tmp_path, monkeypatch):
    monkeypatch.setattr(streamed_module, "BLOCK_BYTES", 3 * 32 * 4)  # 3 rows of 32: 11 blocks, the last of 2 rows
    monkeypatch.setattr(runner_module, "MLP_TOKENS", 5)  # the MLP over 4 chunks of the window, the last of 1
    src = make_model(family, tmp_path / "src", **overrides)
    config = json.loads((src / "config.json").read_text())
    lm = LayerwiseModel(config, find_family(config["architectures"][0]), scan_checkpoint(src))
    hidden, kwargs = lm.layer_inputs(torch.randint(3, 64, (16,), generator=torch.Generator().manual_seed(3)))
    for i in range(len(lm.real)):
        plain = sum(type(m) is nn.Linear for m in lm.real[i].modules())
        with torch.no_grad():
            layer = lm.load_layer(i)
            streamed = sum(isinstance(m, StreamedLinear) for m in layer.modules())
            assert plain >= 4 and streamed == plain and not any(type(m) is nn.Linear for m in layer.modules())
            assert type(layer.mlp).__name__ == "_TokenChunks" and layer.mlp.tokens == 5
            assert all(p.dim() == 1 for p in layer.parameters())  # norms and biases only: no weight matrix is real
            got = layer(hidden, **kwargs[i])
            lm.free_layer(i)
            assert all(p.is_meta for p in lm.real[i].parameters())
            assert sum(type(m) is nn.Linear for m in lm.real[i].modules()) == plain  # the originals are back
            assert type(lm.real[i].mlp).__name__ != "_TokenChunks"
            want = lm.load_layer(i, stream=False)(hidden, **kwargs[i])
            lm.free_layer(i)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())  # blocks: fp32 rounding
        hidden = want


def test_hidden_states_wait_in_a_scratch_file_that_is_always_removed(tmp_path):
    src = make_model("llama", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    n = config["hidden_size"]
    args = (config, find_family(config["architectures"][0]), scan_checkpoint(src),
            torch.randint(3, 64, (5, 16), generator=torch.Generator().manual_seed(1)), 2)
    scratch = tmp_path / "stats"
    scratch.mkdir()
    run = calibrate(*args, scratch, progress=False)
    assert next(run) == 0
    inputs, terms, states, layer = sorted(scratch.iterdir())
    assert states.name.startswith("hidden-states-") and inputs.name.startswith("attention-inputs-")
    assert states.stat().st_size == 5 * 16 * n * 4  # (N, T, n) float32, one record per window
    assert inputs.stat().st_size == 3 * 16 * n * 4  # the 3 fitting windows' attention inputs
    assert terms.name.startswith("attention-terms-") and terms.stat().st_size == 3 * 17 * 16 * 4  # (T + 1, T) each
    assert layer == layer_path(scratch, 0)  # written as each statistic is final; the caller's to keep
    moments, held = load_layer(scratch, 0, dtype=torch.float32)
    held = {k: held[k] for k in ("x", "cos", "sin", "allowed")}  # the order calibration writes them in
    save_layer(tmp_path, 0, moments, held)  # the same file, written whole from memory
    assert layer.read_bytes() == layer_path(tmp_path, 0).read_bytes()
    assert load_layer(scratch, 0)[0]["key"].dtype == torch.float64
    assert list(run) == [1] and sorted(p.name for p in scratch.iterdir()) == [layer.name, layer_path(scratch, 1).name]
    for p in scratch.iterdir():
        p.unlink()
    run = calibrate(*args, scratch, progress=False)
    next(run)
    with pytest.raises(RuntimeError, match="the caller failed"):
        run.throw(RuntimeError("the caller failed"))
    assert [p.name for p in scratch.iterdir()] == [layer.name]  # scratch removed on an error too
    layer.unlink()
    run = calibrate(*args, scratch, progress=False)
    next(run)
    run.close()  # the caller stops early
    assert [p.name for p in scratch.iterdir()] == [layer.name]


def test_logit_error_one_head_at_a_time_is_the_all_heads_formula():
    gen = torch.Generator().manual_seed(4)
    H, d, n, T = 4, 4, 8, 6
    held = {"x": torch.randn(2, T, n, generator=gen), "cos": torch.randn(T, d, generator=gen),
            "sin": torch.randn(T, d, generator=gen), "allowed": torch.ones(T, T, dtype=torch.bool).tril()}
    before = (torch.randn(H * d, n, generator=gen), torch.randn(H * d, n, generator=gen),
              torch.randn(H * d, generator=gen), torch.randn(H * d, generator=gen))
    after = (before[0], torch.randn(2 * d, n, generator=gen), before[2], torch.randn(2 * d, generator=gen))

    def logits(x, q_w, k_w, q_b, k_b, kv):  # every head at once, as one (H, T, T) tensor
        q = rope((x @ q_w.double().T + q_b.double()).reshape(T, H, d).transpose(0, 1), *cos_sin)  # (H, T, d)
        k = rope((x @ k_w.double().T + k_b.double()).reshape(T, kv, d).transpose(0, 1), *cos_sin)  # (kv, T, d)
        return q @ k.repeat_interleave(H // kv, dim=0).transpose(1, 2) * held["allowed"]

    cos_sin = held["cos"].double(), held["sin"].double()
    num = den = 0.0
    for x in held["x"].double():
        s0, s1 = logits(x, *before, H), logits(x, *after, 2)
        num += float((s1 - s0).pow(2).sum())
        den += float(s0.pow(2).sum())
    got = logit_error(held, before, after, H, H, 2, d)
    assert got > 0.1 and math.isclose(got, math.sqrt(num / den), rel_tol=1e-12)


@pytest.mark.parametrize("method", ["fit", "aligned"])
@pytest.mark.parametrize("pairs", ["neighbours", "halves"])
def test_disguised_heads_merge_exactly_with_calibration(tmp_path, method, pairs):
    src = _with_tokenizer(make_disguised_llama(tmp_path / "src", vocab_size=4096, pairs=pairs))
    ids = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "out"
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--method", method, "--calibration", str(TEXT),
                         *SMALL, "-q"]) == 0
    torch.testing.assert_close(checkpoint_logits(out, ids), checkpoint_logits(src, ids), atol=1e-5, rtol=1e-5)
    errors = _card_errors(out)
    # k, v, held-out logits (exact), and mean-pooling's held-out logits, which the exact merge beats
    assert len(errors) == 2 and all(len(row) == 4 and max(row[:3]) < 1e-5 < row[3] for row in errors)
    card = (out / "README.md").read_text()
    assert f"| method | {method} |" in card and "| grouping | similarity" in card
    assert f"`{TEXT}`" in card and "256: 7 windows of 32 fitted, 1 held out" in card
    assert not (out / ".calibration").exists()
    if pairs == "halves":  # neighbours are the wrong partners: a contiguous grouping cannot be exact
        bad = tmp_path / "contiguous"
        assert convert_main(["--groups", "2", str(src), "-o", str(bad), "--method", method, "--grouping",
                             "contiguous", "--calibration", str(TEXT), *SMALL, "-q"]) == 0
        assert min(row[0] for row in _card_errors(bad)) > 1e-2


@pytest.mark.parametrize("family", ALIGNABLE)
def test_fit_pools_identical_heads_exactly_in_every_alignable_family(family, tmp_path):
    src = make_model(family, tmp_path / "src", vocab_size=4096)
    weights = load_file(src / "model.safetensors")
    for name, t in weights.items():  # heads 2i+1 := heads 2i: a GQA-2 model in MHA form
        if ".k_proj." in name or ".v_proj." in name:
            heads = t.reshape(4, -1, *t.shape[1:]).clone()
            heads[1::2] = heads[0::2]
            weights[name] = heads.reshape(t.shape).contiguous()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    _with_tokenizer(src)
    out = tmp_path / "out"
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--method", "fit", "--calibration", str(TEXT),
                         *SMALL, "-q"]) == 0
    ids = torch.randint(3, 4096, (2, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(checkpoint_logits(out, ids), checkpoint_logits(src, ids), atol=1e-4, rtol=1e-4)
    assert all(max(row) < 1e-5 for row in _card_errors(out))
    assert [(e["role"], e["path"]) for e in fitted.read(out)] == [("calibration", str(TEXT))]  # for eval to refuse


def test_bad_calibration_input_is_refused_in_one_line(tmp_path):
    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", vocab_size=4096))
    small_vocab = _with_tokenizer(make_tiny_llama(tmp_path / "small", vocab_size=64))
    bare = make_tiny_llama(tmp_path / "bare", vocab_size=4096)
    short = tmp_path / "short.txt"
    short.write_text("It is a truth universally acknowledged.")
    out = str(tmp_path / "out")
    cases = [
        ((str(src), "--method", "fit", "--text-column", "body"), ("--text-column needs --calibration",)),
        ((str(src), "--method", "fit", "--calibration", str(TEXT), "--text-column", "body"),
         ("is a text file; drop --text-column",)),
        ((str(src), "--method", "mean", "--calibration", str(TEXT)), ("--calibration is used only by",)),
        ((str(src), "--method", "aligned", "--calibration-tokens", "4096"),
         ("--calibration-tokens needs --calibration",)),
        ((str(src), "--method", "mean", "--grouping", "similarity"), ("--grouping is used only by",)),
        ((str(src), "--method", "fit", "--calibration", str(tmp_path / "missing.txt")), ("does not exist",)),
        ((str(src), "--method", "fit", "--calibration", str(short)), ("less than two", "--calibration-window")),
        ((str(src), "--method", "fit", "--calibration", str(TEXT), "--calibration-tokens", "40",
          "--calibration-window", "32"), ("less than two 32-token windows",)),
        ((str(src), "--method", "fit", "--calibration", str(TEXT), "--calibration-window", "4096"),
         ("exceeds the model's 128-token context",)),
        ((str(small_vocab), "--method", "fit", "--calibration", str(TEXT)), ("outside the model's vocabulary of 64",)),
        ((str(bare), "--method", "fit", "--calibration", str(TEXT)), ("needs the model's tokenizer",)),
        ((str(src), "--method", "fit", "--calibration", str(TEXT), "--calibration-device", "nonsense"),
         ("unknown --calibration-device 'nonsense'",)),
    ]
    if not torch.cuda.is_available():  # more devices: tests/common/test_devices.py
        cases.append(((str(src), "--method", "fit", "--calibration", str(TEXT), "--calibration-device", "cuda"),
                      ("--calibration-device cuda: no CUDA device",)))
    for args, needles in cases:
        line = run_refused(tmp_path, "convert-gqa", "--groups", "2", *args, "-o", out, needles=needles)
        if args[0] != str(bare):  # a dry run, without torch or transformers, refuses it alike
            assert run_refused(tmp_path, "convert-gqa", "--groups", "2", *args, "-o", out, "--dry-run") == line
    # no tokenizer: the dry run cannot count the text, and says that the conversion will
    done = run_cli("convert-gqa", "--groups", "2", str(bare), "--method", "fit", "--calibration", str(TEXT), "-o", out,
                   "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"calibration: {TEXT} read (1 document); its length and token ids are checked when converting: " \
           f"{bare} has no tokenizer.json" in done.stdout


def test_a_layer_file_left_partial_is_removed(tmp_path):
    """Its header is complete from the start, so a partial file would read as zeros: an error inside the `with`
    block, or a tensor never written, removes it."""
    from gqakit.convert.calibration.stored import LayerFile

    path = tmp_path / "layer.safetensors"
    with pytest.raises(OSError, match="disk full"):
        with LayerFile(path, {"key": (3, 3), "mean": (3,)}) as f:
            f.write("mean", torch.ones(3))
            raise OSError("disk full")
    assert not path.exists()
    with pytest.raises(RuntimeError, match=r"\['key'\] never written"):
        with LayerFile(path, {"key": (3, 3), "mean": (3,)}) as f:
            f.write("mean", torch.ones(3))
    assert not path.exists()
    with LayerFile(path, {"key": (3, 3), "mean": (3,)}) as f:
        f.write("key", torch.eye(3, dtype=torch.float64))
        f.write("mean", torch.ones(3))
    assert torch.equal(load_file(path)["key"], torch.eye(3))


def test_a_slightly_indefinite_statistic_gets_the_next_ridge_and_a_broken_one_a_one_line_error(monkeypatch):
    """A calibrated metric whose negative directions (float32 rounding) the smallest ridge does not cover is
    merged with the next ridge that does: the same merge as asking for that ridge alone. One that no ridge
    makes positive semi-definite is a GqakitError."""
    import types

    from gqakit.convert.methods import layer as layer_module
    from gqakit.common.errors import GqakitError

    gen = torch.Generator().manual_seed(7)
    n, heads, d = 16, 4, 4
    rotation = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0].float()
    weights = {"q_w": torch.randn(n, n, generator=gen), "k_w": torch.randn(n, n, generator=gen),
               "v_w": rotation, "o_w": torch.randn(n, n, generator=gen)}
    plan = types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=heads, groups=2, head_dim=d,
                                 method="fit")
    x = torch.randn(4, n, generator=gen)  # 4 samples: a rank-4 moment, 12 directions at eigenvalue 0
    moment = x.T @ x / 4
    slightly = moment - 3e-3 * moment.diagonal().mean() * torch.eye(n)  # those 12 at -3e-3 x the mean diagonal

    def stats(m):
        return lambda names: {k: {"key": m, "value": m, "value_mean": x.mean(0)}[k] for k in names}

    got, _ = layer_module.merge_layer(plan, weights, "contiguous", stats(slightly))
    monkeypatch.setattr(layer_module, "RIDGES", (1e-6,))
    with pytest.raises(GqakitError, match="not positive semi-definite even with a ridge of 1e-06"):
        layer_module.merge_layer(plan, weights, "contiguous", stats(slightly))  # the smallest alone does not do
    monkeypatch.setattr(layer_module, "RIDGES", (1e-2,))
    want, _ = layer_module.merge_layer(plan, weights, "contiguous", stats(slightly))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    monkeypatch.undo()
    with pytest.raises(GqakitError, match="recalibrate"):
        layer_module.merge_layer(plan, weights, "contiguous", stats(-moment - torch.eye(n)))


def test_stored_moment_is_read_in_row_blocks_and_gives_the_same_gram(tmp_path, monkeypatch):
    """The merge reads an n x n statistic from the layer file one block of rows at a time; blocks of 3 rows,
    the last one ragged, give the stored matrix, its diagonal, and the Gram of the in-memory metric."""
    from gqakit.convert.methods import grams
    from gqakit.convert.calibration.stored import StoredMoment

    monkeypatch.setattr(grams, "BLOCK", 3)
    gen = torch.Generator().manual_seed(5)
    n = 10
    a = torch.randn(n, 40, generator=gen)
    moments = {"key": a @ a.T / 40, "value": torch.eye(n), "value_mean": torch.randn(n, generator=gen)}
    held = {"x": torch.zeros(1, 2, n), "cos": torch.ones(2, 4), "sin": torch.zeros(2, 4),
            "allowed": torch.ones(2, 2, dtype=torch.bool)}
    save_layer(tmp_path, 3, moments, held)
    stored = StoredMoment(tmp_path, 3, "key")
    assert stored.shape == (n, n)
    assert torch.equal(stored.rows(2, 7), moments["key"][2:7]) and torch.equal(stored.rows(8, 11), moments["key"][8:])
    assert torch.equal(stored.diagonal(), moments["key"].diagonal())
    w = torch.randn(7, n, generator=gen, dtype=torch.float64)
    from_file = grams.gram(w, None, grams.moment_metric(stored, False))
    in_memory = grams.gram(w, None, grams.moment_metric(moments["key"], False))
    torch.testing.assert_close(from_file, in_memory, rtol=1e-12, atol=1e-12)
