"""`gqakit generate`: streams past the trained context; greedy text is the same for every kernel."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from gqakit.cli import main
from gqakit.reference.tokenizer import train_bpe

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen")
    tok = train_bpe([TEXT], vocab_size=300)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=48,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run(capsys, *argv):
    capsys.readouterr()
    code = main(["generate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_sinks_stream_far_past_the_trained_context(model_dir, capsys):
    code, out, err = run(capsys, model_dir, "--prompt", "It is a truth", "--attention", "sinks", "--sinks", 2,
                         "--window", 14, "--max-new-tokens", 120, "--ignore-eos")
    assert code == 0, err
    assert len(out) > 100 and "2 sinks + 14 recent tokens" in err  # 120 tokens > 48 positions trained


def test_kernels_agree_within_the_context(model_dir, capsys):
    outs = {}
    for attention in ("default", "tiled", "sinks"):
        window = ["--window", 64] if attention == "sinks" else []  # the full-cache kinds take no --window
        code, out, err = run(capsys, model_dir, "--prompt", "a single man", "--attention", attention, *window,
                             "--max-new-tokens", 20, "--ignore-eos")
        assert code == 0, err
        outs[attention] = out
    assert outs["default"] == outs["tiled"] == outs["sinks"]


@pytest.mark.parametrize("argv, needle", [
    (["--max-new-tokens", "3"], "exactly one of --prompt"),
    (["--prompt", "x", "--window", "0"], "--window must be a positive"),
    (["--prompt", "x", "--sinks", "-1"], "--sinks must be >= 0"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "does not exist"),
    (["--prompt", "x", "--attention", "tiled", "--max-new-tokens", "100"], "use --attention sinks"),
])
def test_bad_input(model_dir, capsys, argv, needle):
    code, out, err = run(capsys, model_dir, *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_missing_model(tmp_path, capsys):
    code, out, err = run(capsys, tmp_path / "nope", "--prompt", "x")
    assert code == 2 and "does not exist" in err
