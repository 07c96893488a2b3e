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


def test_sparse_decoding_equals_its_own_full_forward(model_dir, capsys):
    """--attention sparse decodes with a full cache and the sparse kernel: the text must be what greedy decoding
    gives with one full forward per token under the same pattern (the reference: no cache at all)."""
    import gqakit.attention
    from transformers import AutoTokenizer

    code, out, err = run(capsys, model_dir, "--prompt", "a single man", "--attention", "sparse", "--attention-option",
                         "stride=4", "--max-new-tokens", 20, "--ignore-eos")
    assert code == 0 and "sparse attention" in err, err
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = gqakit.attention.use(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
                                 "sparse", stride=4)
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok("a single man", return_tensors="pt").input_ids
    prompt_length = ids.shape[1]
    with torch.no_grad():
        for _ in range(20):  # greedy, one full forward per token, no cache
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        differs = not torch.allclose(model(ids).logits, dense(ids).logits)
    assert out == tok.decode(ids[0, prompt_length:])
    assert differs  # at this length the pattern is not full attention


@pytest.mark.parametrize("argv, needle", [
    (["--max-new-tokens", "3"], "exactly one of --prompt"),
    (["--prompt", "x", "--attention", "sparse"], "needs a stride"),
    (["--prompt", "x", "--attention", "sinks", "--attention-option", "stride=4"], "--attention-option only applies"),
    (["--prompt", "x", "--attention", "sparse", "--attention-option", "stide=4"], "takes no --attention-option stide"),
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


def test_the_models_own_end_tokens_stop_the_stream_as_generate_does(model_dir, tmp_path, capsys):
    """A generation config listing several end ids (Llama-3 style): `gqakit generate` and the retrieval decoder stop
    where `model.generate` stops, not only at the tokenizer's EOS."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from gqakit.evaluate.generation import GreedyDecoder

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok("a single man", return_tensors="pt").input_ids
    free = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1]:].tolist()
    stop = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i] and t != tok.eos_token_id)
    ends = [tok.eos_token_id, free[stop]]
    listed = tmp_path / "listed"
    shutil.copytree(model_dir, listed)
    GenerationConfig(eos_token_id=ends, pad_token_id=tok.eos_token_id).save_pretrained(listed)
    model.generation_config = GenerationConfig.from_pretrained(listed)
    want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert want.tolist() == free[:stop + 1]  # transformers stops at the listed id
    code, out, err = run(capsys, listed, "--prompt", "a single man", "--attention", "default", "--max-new-tokens", 12)
    assert code == 0 and out == tok.decode(want, skip_special_tokens=True), (out, err)
    assert GreedyDecoder(model, tok, new_tokens=12)("a single man") == tok.decode(want, skip_special_tokens=True)


def test_a_bounded_cache_refuses_a_model_without_rope_in_one_line(tmp_path, capsys):
    from transformers import GPT2Config

    tok = train_bpe([TEXT], vocab_size=300)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=64,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    code, out, err = run(capsys, tmp_path / "gpt2", "--prompt", "a single man", "--max-new-tokens", 4)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "has no rotary embedding" in err and "use --attention default" in err


def test_a_rope_table_model_streams_with_sinks_where_its_positions_reach(tmp_path, capsys):
    """GPT-J holds RoPE as a 64-position table (refused before: no inv_freq): sinks + window re-base within it and
    stream 100 tokens; a window whose re-basing would run past the table is refused in one line."""
    from transformers import GPTJConfig

    tok = train_bpe([TEXT], vocab_size=300)
    cfg = GPTJConfig(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=64,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gptj")
    tok.save_pretrained(tmp_path / "gptj")
    args = (tmp_path / "gptj", "--prompt", "a single man", "--attention", "sinks", "--sinks", 2, "--max-new-tokens",
            100, "--ignore-eos")
    code, out, err = run(capsys, *args, "--window", 14)
    assert code == 0 and "2 sinks + 14 recent tokens" in err, err
    code, out, err = run(capsys, *args, "--window", 40)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "GPTJForCausalLM's positions end at 64; lower --sinks or --window" in err
