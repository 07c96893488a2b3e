"""Attention transfer (`convert-gqa --method transfer`).

* what is trained is the model's own attention: rebuilt from the config and the checkpoint, and called with the
  keyword inputs calibration recorded, it gives the whole model's eager attention output for every alignable
  family and Qwen3 (sliding windows, biases, softcapping, key norms), also through sdpa where transfer uses it,
  and a batch of windows gives each window's output alone (fp32, 1e-5);
* training lowers each layer's held-out error, never ends above its start, and is deterministic for a seed;
* end to end: the output loads with the stock Auto class, the card records each layer's held-out attention error
  before and after, `kv` trains only k_proj / v_proj (q_proj / o_proj stay fit's), `qkvo` all four;
* options that only transfer takes are refused elsewhere, in one line.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_contract import run_refused
from families import make_model
from gqakit.cli import convert_main
from gqakit.convert.calibration.data import make_windows
from gqakit.convert.calibration.runner import LayerInputs, calibrate
from gqakit.convert.calibration.stored import load_layer
from gqakit.convert.methods.transfer import (attend, attention_implementation, build_attention, output_error,
                                             transfer_layer)
from gqakit.convert.options import TransferOptions
from gqakit.hf.architectures import find_family
from gqakit.hf.checkpoint import load_tensor
from gqakit.hf.headers import scan_checkpoint
from tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"
# the families fit (and so transfer) converts, and Qwen3 for its key norms
REBUILT = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "starcoder2", "granite"]
SMALL = ["--calibration-tokens", "512", "--calibration-window", "32"]  # 16 windows, 2 held out


def _with_tokenizer(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, path / name)
    return path


def _attention_outputs(src: Path, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every layer's attention in the whole model's eager forward on ids (1, T)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        (kwargs.get("hidden_states", args[0] if args else None)[0], out[0][0])), with_kwargs=True)
        for layer in model.model.layers]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("family", REBUILT)
def test_rebuilt_attention_is_the_models_own(family, tmp_path):
    src = make_model(family, tmp_path / "src", vocab_size=4096)
    config = __import__("json").loads((src / "config.json").read_text())
    tensors = scan_checkpoint(src)
    spec = find_family(config["architectures"][0])
    windows = make_windows(torch.randint(3, 4096, (96,), generator=torch.Generator().manual_seed(0)), 24, 96)
    whole = _attention_outputs(src, windows[:1])
    stats = tmp_path / "stats"
    stats.mkdir()
    checked = 0
    for item in calibrate(config, spec, tensors, windows, 1, stats, progress=False, with_inputs=True):
        assert isinstance(item, LayerInputs) and item.windows == 3
        x, expected = whole[item.index]
        torch.testing.assert_close(item.read(0), x, atol=1e-5, rtol=1e-5)
        prefix = spec.q_proj.format(i=item.index).rpartition(".")[0] + "."
        weights = {n[len(prefix):]: load_tensor(info, n) for n, info in tensors.items() if n.startswith(prefix)}
        for how in {"eager", attention_implementation(config)}:
            module = build_attention(item.attention_class, config, item.index, weights, how)
            got = attend(module, x[None], item.attention_kwargs)[0]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            other = item.read(1)
            batch = attend(module, torch.stack([x, other]), item.attention_kwargs)
            torch.testing.assert_close(batch[0], got, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(batch[1], attend(module, other[None], item.attention_kwargs)[0],
                                       atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked == config["num_hidden_layers"]


def _student_problem(seed: int = 0):
    """A tiny Llama attention whose 4 K/V heads are one head (the teacher), and a student with one K/V head
    started from that head perturbed."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    cfg = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=64,
               num_hidden_layers=1, vocab_size=64, max_position_embeddings=64, model_type="llama")
    torch.manual_seed(seed)
    teacher_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    teacher_cfg._attn_implementation = "eager"
    teacher = LlamaAttention(teacher_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every K/V head the same: one head can match the teacher exactly
        for proj in (teacher.k_proj, teacher.v_proj):
            proj.weight.copy_(proj.weight[:8].repeat(4, 1))
    weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    # the start: that head, perturbed (what an imperfect merge gives)
    merged = {n: weights[n][:8] + 0.5 * weights[n][:8].std() * torch.randn(8, 32, generator=gen)
              for n in ("k_proj.weight", "v_proj.weight")}
    student = build_attention(LlamaAttention, {**cfg, "num_key_value_heads": 1}, 0, {**weights, **merged}, "sdpa")
    T = 16
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    cos, sin = rotary(torch.zeros(1, T, 32), torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    kwargs = {"position_embeddings": (cos, sin), "attention_mask": mask}
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(10, T, 32, generator=gen)
    with torch.no_grad():
        ys = torch.stack([attend(teacher, x[None], kwargs)[0] for x in xs])
    return student, kwargs, xs, ys


def _train(seed: int, steps: int = 40, scratch: Path | None = None):
    student, kwargs, xs, ys = _student_problem()
    errors = transfer_layer(student, kwargs, 8, lambda w: (xs[w], ys[w]), xs[8:], ys[8:],
                            TransferOptions(params="kv", steps=steps, lr=0.3, eval_every=5, patience=0,
                                            seed=seed, dtype="float32"), 0,
                            progress=False, scratch=scratch)
    return student, errors, (kwargs, xs, ys)


def test_the_best_weights_kept_in_a_scratch_file_are_those_kept_in_memory(tmp_path):
    """With a scratch folder the best-scoring weights wait in a file (not in memory) and come back the same, bit
    for bit; the file is gone afterwards."""
    in_memory, errors, _ = _train(seed=0)
    on_disk, errors_on_disk, _ = _train(seed=0, scratch=tmp_path)
    assert errors_on_disk == errors
    assert all(torch.equal(a, b) for a, b in zip(in_memory.parameters(), on_disk.parameters()))
    assert list(tmp_path.iterdir()) == []
    # every step worse: the start comes back from the file
    student, kwargs, xs, ys = _student_problem()
    start = [p.detach().clone() for p in student.parameters()]
    errors = transfer_layer(student, kwargs, 8, lambda w: (xs[w], ys[w]), xs[8:], ys[8:],
                            TransferOptions(steps=6, lr=50.0, eval_every=2, patience=0), 0, progress=False,
                            scratch=tmp_path)
    assert errors["transfer_after"] == errors["transfer_before"]
    assert all(torch.equal(a, b) for a, b in zip(student.parameters(), start))
    assert list(tmp_path.iterdir()) == []


def test_training_lowers_the_heldout_error_and_is_deterministic():
    student, errors, (kwargs, xs, ys) = _train(seed=0)
    assert errors["transfer_after"] < 0.6 * errors["transfer_before"], errors
    # the kept weights are the ones scored: their held-out error is the one reported
    assert math.isclose(output_error(student, xs[8:], ys[8:], kwargs), errors["transfer_after"], rel_tol=1e-9)
    again, errors_again, _ = _train(seed=0)
    assert errors_again == errors
    assert all(torch.equal(a, b) for a, b in zip(student.parameters(), again.parameters()))
    other, _, _ = _train(seed=1)
    assert not torch.equal(other.k_proj.weight, student.k_proj.weight)
    # params=kv: only K/V are trained
    start, _, _, _ = _student_problem()
    assert torch.equal(student.q_proj.weight, start.q_proj.weight)
    assert torch.equal(student.o_proj.weight, start.o_proj.weight)


def test_stepping_in_backward_is_adamw_after_backward_with_no_gradient_kept():
    """StepInBackward gives the same weights, bit for bit, as one AdamW over per-tensor groups stepped after backward
    (with the same learning-rate schedule), and leaves no gradient behind."""
    from gqakit.convert.methods.transfer import StepInBackward

    def groups(module):
        return [{"params": [p], "lr": 0.01 * (i + 1)} for i, p in enumerate(module.parameters())]

    factor = lambda s: (s + 1) / 3 if s < 3 else 0.5  # noqa: E731
    runs = []
    for in_backward in (False, True):
        student, kwargs, xs, ys = _student_problem()
        if in_backward:
            optimizer = StepInBackward(groups(student), factor, betas=(0.9, 0.99), weight_decay=0.0)
        else:
            optimizer = torch.optim.AdamW(groups(student), betas=(0.9, 0.99), weight_decay=0.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        for step in range(6):
            loss = (attend(student, xs[step % 8][None], kwargs)[0] - ys[step % 8]).pow(2).sum()
            if not in_backward:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if in_backward:
                assert all(p.grad is None for p in student.parameters())
                optimizer.advance()
            else:
                optimizer.step()
                scheduler.step()
        if in_backward:
            optimizer.remove()
        runs.append([p.detach().clone() for p in student.parameters()])
    assert len(runs[0]) == 4 and all(torch.equal(a, b) for a, b in zip(*runs))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], _student_problem()[0].parameters()))  # it trained


def test_a_layer_that_training_cannot_improve_keeps_its_start():
    student, kwargs, xs, ys = _student_problem()
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    # an absurd learning rate makes every step worse: the start is kept, its score reported
    errors = transfer_layer(student, kwargs, 8, lambda w: (xs[w], ys[w]), xs[8:], ys[8:],
                            TransferOptions(steps=6, lr=50.0, eval_every=2, patience=2), 0, progress=False)
    assert errors["transfer_after"] == errors["transfer_before"]
    assert all(torch.equal(p, start[n]) for n, p in student.named_parameters())
    assert errors["transfer_steps"] == 4.0  # stopped after two scores without improvement
    never = transfer_layer(student, kwargs, 8, lambda w: (xs[w], ys[w]), xs[8:], ys[8:],
                           TransferOptions(steps=6, lr=50.0, eval_every=2, patience=0), 0, progress=False)
    assert never["transfer_steps"] == 6.0 and never["transfer_after"] == never["transfer_before"]  # all steps
    assert all(torch.equal(p, start[n]) for n, p in student.named_parameters())


def _card_rows(path: Path) -> list[list[str]]:
    card = (path / "README.md").read_text()
    return [line.split("|")[1:-1] for line in card.splitlines() if line[:2] == "| " and line[2:3].isdigit()]


@pytest.mark.parametrize("params", ["kv", "qkvo"])
def test_transfer_end_to_end(tmp_path, params):
    from transformers import AutoModelForCausalLM

    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", heads=4, layers=2, head_dim=8, vocab_size=4096))
    fit, out = tmp_path / "fit", tmp_path / "transfer"
    common = ["--groups", "1", str(src), "--calibration", str(TEXT), *SMALL, "-q"]
    assert convert_main([*common, "--method", "fit", "-o", str(fit)]) == 0
    assert convert_main([*common, "--method", "transfer", "--transfer-params", params, "--transfer-steps", "30",
                         "--transfer-start", "fit", "-o", str(out)]) == 0  # from fit's merge: compared with it below
    rows = _card_rows(out)
    assert len(rows) == 2
    for row in rows:  # layer, k, v, logits, logits (mean), before, after, steps
        before, after, steps = float(row[5]), float(row[6]), int(row[7])
        assert after <= before and 0 < steps <= 30
    assert any(float(row[6]) < float(row[5]) for row in rows)
    card = (out / "README.md").read_text()
    assert "| method | transfer (seed 0) |" in card and "at most 30 steps per layer" in card
    a, b = load_file(fit / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        trained = any(f".{p}." in name for p in ({"kv": ("k_proj", "v_proj")}.get(params) or
                                                 ("q_proj", "k_proj", "v_proj", "o_proj")))
        if ".self_attn." not in name or not trained:
            assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], b[n]) for n in a if ".k_proj." in n)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_key_value_heads == 1 and not (out / ".calibration").exists()


def test_transfer_options_are_refused_elsewhere(tmp_path):
    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", vocab_size=4096))
    out = str(tmp_path / "out")
    for args, needle in (
            (["--transfer-steps", "10"], "--transfer-steps is used only by --method transfer"),
            (["--method", "fit", "--calibration", str(TEXT), "--transfer-params", "qkvo"],
             "--transfer-params is used only by --method transfer"),
            (["--method", "transfer", "--calibration", str(TEXT), "--transfer-steps", "0"],
             "--transfer-steps 0 must be at least 1"),
            (["--transfer-patience", "0"], "--transfer-patience is used only by --method transfer"),
            (["--method", "transfer", "--calibration", str(TEXT), "--transfer-patience", "-1"],
             "--transfer-patience -1 must be 0 (never stop early) or more"),
            # scored only at its last step, a layer could never be stopped early (the CLI audit: accepted)
            (["--method", "transfer", "--calibration", str(TEXT), "--transfer-patience", "5", "--transfer-steps",
              "10"], "--transfer-steps 10 scores 0 time(s) before its last step"),
            (["--method", "transfer", "--text-column", "body"], "--text-column needs --calibration")):
        run_refused(tmp_path, "convert-gqa", "--groups", "2", str(src), "-o", out, *args, needles=(needle,))


def test_an_interrupted_transfer_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Ctrl-C while a layer trains: exit 130, one line, no output folder, no scratch or temporary files."""
    from gqakit.convert.methods import transfer

    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", vocab_size=4096))
    real, calls = transfer.transfer_layer, []

    def stopped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer, "transfer_layer", stopped)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    code = convert_main(["--groups", "1", str(src), "-o", str(tmp_path / "out"), "--method", "transfer",
                         "--calibration", str(TEXT), *SMALL, "--transfer-steps", "5", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 130 and len(calls) == 2 and len(err.splitlines()) == 1 and "interrupted" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _perturbed(module: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy of an attention module with o_proj scaled: another attention, of the same class and heads."""
    import copy

    other = copy.deepcopy(module)
    with torch.no_grad():
        other.o_proj.weight.mul_(scale)
    return other


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_converted_inputs_follow_the_converted_model(family, tmp_path):
    """calibrate(converted_inputs=True): each layer's inputs are those of the whole model whose earlier layers have
    the attention the consumer set (reference: the stock model with those weights, one eager forward), and the
    targets are the original model's attention outputs on its own inputs (fp32, 1e-5)."""
    src = make_model(family, tmp_path / "src", vocab_size=4096)
    config = __import__("json").loads((src / "config.json").read_text())
    tensors = scan_checkpoint(src)
    spec = find_family(config["architectures"][0])
    windows = make_windows(torch.randint(3, 4096, (96,), generator=torch.Generator().manual_seed(0)), 24, 96)
    original = [_attention_outputs(src, windows[w:w + 1]) for w in range(4)]  # per window, per layer (x, y)
    scales = [0.5 + 0.25 * i for i in range(config["num_hidden_layers"])]
    changed = tmp_path / "changed"  # the reference: the same model with every layer's o_proj scaled so
    shutil.copytree(src, changed)
    state = load_file(changed / "model.safetensors")
    for i, scale in enumerate(scales):
        state[f"model.layers.{i}.self_attn.o_proj.weight"] = state[f"model.layers.{i}.self_attn.o_proj.weight"] * scale
    from safetensors.torch import save_file

    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    converted = [_attention_outputs(changed, windows[w:w + 1]) for w in range(4)]
    stats = tmp_path / "stats"
    stats.mkdir()
    seen = 0
    for item in calibrate(config, spec, tensors, windows, 1, stats, progress=False, with_inputs=True,
                          converted_inputs=True):
        i = item.index
        for w in range(3):  # fitting windows: the converted model's inputs, the original's outputs
            torch.testing.assert_close(item.read(w), converted[w][i][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(item.read_target(w), original[w][i][1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(item.held_targets[0], original[3][i][1], atol=1e-5, rtol=1e-5)
        held_x = load_layer(stats, i, ())[1]["x"]  # what a merge is scored on: the converted model's inputs
        torch.testing.assert_close(held_x[0], converted[3][i][0], atol=1e-5, rtol=1e-5)
        prefix = spec.q_proj.format(i=i).rpartition(".")[0] + "."
        weights = {n[len(prefix):]: load_tensor(info, n) for n, info in tensors.items() if n.startswith(prefix)}
        module = build_attention(item.attention_class, config, i, weights, "eager")
        item.trained_attention = _perturbed(module, scales[i])
        seen += 1
    assert seen == config["num_hidden_layers"] and not any(stats.glob("*.f32"))


def test_converted_inputs_need_the_trained_attention(tmp_path):
    src = make_tiny_llama(tmp_path / "src", vocab_size=4096)
    config = __import__("json").loads((src / "config.json").read_text())
    windows = make_windows(torch.randint(3, 4096, (64,), generator=torch.Generator().manual_seed(0)), 16, 64)
    stats = tmp_path / "stats"
    stats.mkdir()
    run = calibrate(config, find_family(config["architectures"][0]), scan_checkpoint(src), windows, 1, stats,
                    progress=False, with_inputs=True, converted_inputs=True)
    next(run)
    with pytest.raises(ValueError, match="trained_attention"):
        next(run)
    assert not any(stats.glob("*.f32"))  # the scratch files went with the error
    with pytest.raises(ValueError, match="with_inputs"):
        next(calibrate(config, find_family(config["architectures"][0]), scan_checkpoint(src), windows, 1, stats,
                       progress=False, converted_inputs=True))


def test_transfer_on_converted_inputs_end_to_end(tmp_path):
    """--transfer-inputs converted: every layer trained, the card says on what; refused without --method transfer
    in one line."""
    from transformers import AutoModelForCausalLM

    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", heads=4, layers=3, head_dim=8, vocab_size=4096))
    out = tmp_path / "transfer"
    assert convert_main(["--groups", "1", str(src), "--calibration", str(TEXT), *SMALL, "-q", "--method",
                         "transfer", "--transfer-steps", "20", "--transfer-inputs", "converted", "-o", str(out)]) == 0
    rows = _card_rows(out)
    assert len(rows) == 3 and all(float(r[6]) <= float(r[5]) for r in rows)
    assert "inputs of the model converted so far" in (out / "README.md").read_text()
    assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 1
    run_refused(tmp_path, "convert-gqa", "--groups", "1", str(src), "-o", str(tmp_path / "x"), "--transfer-inputs",
                "converted", needles=("--transfer-inputs is used only by --method transfer",))


def test_transfer_can_start_from_aligned(tmp_path):
    """--transfer-start aligned: each layer's start (the card's 'before' error) is the calibrated aligned merge's,
    not fit's; the card says which; refused without --method transfer."""
    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", heads=4, layers=2, head_dim=8, vocab_size=4096))
    common = ["--groups", "1", str(src), "--calibration", str(TEXT), *SMALL, "-q", "--method", "transfer",
              "--transfer-steps", "5"]
    cards = {}
    for start in ("fit", "aligned"):
        out = tmp_path / start
        assert convert_main([*common, "--transfer-start", start, "-o", str(out)]) == 0
        cards[start] = _card_rows(out)
        card = (out / "README.md").read_text()
        assert f"from the calibrated `{start}` merge" in card
        assert f"measure the calibrated `{start}` merge, where training started" in card
        assert "| held-out attention output at the start | after transfer |" in card
    assert [r[5] for r in cards["fit"]] != [r[5] for r in cards["aligned"]]  # other starts
    run_refused(tmp_path, "convert-gqa", "--groups", "1", str(src), "-o", str(tmp_path / "x"), "--transfer-start",
                "aligned", needles=("--transfer-start is used only by --method transfer",))


def test_bfloat16_training_lowers_the_error_scored_in_float32():
    """--transfer-dtype bfloat16: the forward and backward run under bfloat16 autocast, yet the weights stay float32
    and the reported held-out error is the float32 score of the kept weights; deterministic for a seed."""
    def train():
        student, kwargs, xs, ys = _student_problem()
        errors = transfer_layer(student, kwargs, 8, lambda w: (xs[w], ys[w]), xs[8:], ys[8:],
                                TransferOptions(params="kv", steps=40, lr=0.3, eval_every=5, patience=0,
                                                dtype="bfloat16"), 0, progress=False)
        return student, errors, kwargs, xs, ys

    student, errors, kwargs, xs, ys = train()
    assert all(p.dtype == torch.float32 for p in student.parameters())
    assert errors["transfer_after"] < 0.6 * errors["transfer_before"], errors
    assert math.isclose(output_error(student, xs[8:], ys[8:], kwargs), errors["transfer_after"], rel_tol=1e-9)
    again, errors_again, *_ = train()
    assert errors_again == errors and torch.equal(again.k_proj.weight, student.k_proj.weight)
    float32, _, _ = _train(seed=0)
    assert not torch.equal(float32.k_proj.weight, student.k_proj.weight)  # autocast really ran


def test_each_step_reads_about_step_tokens():
    """Windows per step: max(1, step_tokens // window), at most the fitting windows (2 of 512 by default)."""
    student, kwargs, xs, ys = _student_problem()  # windows of 16 tokens
    read = []
    for step_tokens, per_step in ((64, 4), (16, 1), (8, 1), (1024, 8)):
        read.clear()
        transfer_layer(student, kwargs, 8, lambda w: (read.append(w), (xs[w], ys[w]))[1], xs[8:], ys[8:],
                       TransferOptions(steps=3, eval_every=5, step_tokens=step_tokens), 0, progress=False)
        assert len(read) == 3 * per_step, (step_tokens, len(read))


def test_transfer_dtype_is_refused_elsewhere_and_recorded(tmp_path):
    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", heads=4, layers=2, head_dim=8, vocab_size=4096))
    run_refused(tmp_path, "convert-gqa", "--groups", "1", str(src), "-o", str(tmp_path / "x"), "--transfer-dtype",
                "bfloat16", needles=("--transfer-dtype is used only by --method transfer",))
    out = tmp_path / "bf16"
    assert convert_main(["--groups", "1", str(src), "--calibration", str(TEXT), *SMALL, "-q", "--method", "transfer",
                         "--transfer-steps", "3", "--transfer-dtype", "bfloat16", "-o", str(out)]) == 0
    assert "bfloat16 autocast" in (out / "README.md").read_text()


def test_bfloat16_transfer_warns_on_a_cpu_without_fast_bfloat16(tmp_path, monkeypatch, capsys):
    from gqakit.common import precision

    src = _with_tokenizer(make_tiny_llama(tmp_path / "src", heads=4, layers=2, head_dim=8, vocab_size=4096))
    args = ["--groups", "1", str(src), "--calibration", str(TEXT), *SMALL, "-q", "--method", "transfer",
            "--transfer-steps", "2", "--transfer-dtype", "bfloat16"]
    for slowdown, warned in ((4.0, True), (0.4, False)):
        monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda slowdown=slowdown: slowdown)
        capsys.readouterr()
        assert convert_main([*args, "-o", str(tmp_path / f"out-{slowdown}")]) == 0
        err = capsys.readouterr().err
        assert ("--transfer-dtype bfloat16 on this CPU: a bf16 matmul takes 4.0x" in err) == warned, err
        assert ("--transfer-dtype float32 runs faster" in err) == warned


def test_auto_dtype_follows_the_hardware_not_a_timing(monkeypatch):
    """--transfer-dtype auto (the default) is bfloat16 exactly where the device has bf16 units: read from the CPU's
    flags, the same on every run of a machine, so a conversion's output never depends on how loaded it was."""
    from gqakit.common import precision
    from gqakit.common.precision import auto_dtype
    from gqakit.convert.options import ConvertConfig, transfer_options

    defaults = TransferOptions()
    assert defaults.dtype == "auto" and defaults.start == "aligned" and defaults.patience == 0
    for flags, want in ((frozenset({"avx2", "avx512_bf16"}), "bfloat16"), (frozenset({"amx_bf16"}), "bfloat16"),
                        (frozenset({"avx2", "avx512f"}), "float32"), (frozenset(), "float32")):
        monkeypatch.setattr(precision, "_cpu_flags", lambda flags=flags: flags)
        assert auto_dtype("auto", "cpu") == want
        assert auto_dtype("float32", "cpu") == "float32" and auto_dtype("bfloat16", "cpu") == "bfloat16"
        cfg = ConvertConfig(model_dir="m", groups=1, method="transfer")
        assert transfer_options(cfg).dtype == want  # what the run trains in and the card records
