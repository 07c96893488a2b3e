"""A user's fault sweep over `gqakit generate` and `gqakit eval`: broken model folders, bad generate options,
passkey lengths far past the context, and one definition of KV-cache bytes per token (demo = eval).

Refusals go through the real console script (tests/support/cli_contract.py): exit 2, one `gqakit: error:` line,
no traceback, nothing written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_contract import run_cli, run_refused
from eval_tiny import checkpoint, run_eval, text, tiny_llama, tokenizer
from gqakit.common.errors import GqakitError, spelled
from gqakit.common.options import flags


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def root(tmp_path_factory, tok):
    """A good tiny model (128-token context) with its tokenizer, a text, and broken copies of the model."""
    root = tmp_path_factory.mktemp("faults")
    good = checkpoint(root / "good", tok, max_positions=128)
    checkpoint(root / "wide", tok, max_positions=512)
    (root / "text.txt").write_text(text(400, seed=2), encoding="utf-8")

    def broken(name: str) -> Path:
        folder = root / name
        shutil.copytree(good, folder)
        return folder

    for f in broken("noweights").glob("*.safetensors"):
        f.unlink()
    pickled = broken("pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    truncated = broken("truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    (broken("badjson") / "config.json").write_text("{", encoding="utf-8")
    config = json.loads((good / "config.json").read_text())
    (broken("notype") / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    weights = load_file(good / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1." not in k}, broken("partial") / "model.safetensors",
              metadata={"format": "pt"})
    (broken("resized") / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    notes = root / "notes"
    notes.mkdir()
    (notes / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (notes / "blank.txt").write_text(" \n\n", encoding="utf-8")
    return root


# 1. A model folder without weights: one line from every command that loads a model, before any work.

@pytest.mark.parametrize("command", [
    ["generate", "{m}", "--prompt", "It is a truth"],
    ["eval", "ppl", "{m}", "--text", "{t}", "-q"],
    ["eval", "stream", "{m}", "--text", "{t}", "--tokens", "64", "-q"],
    ["eval", "passkey", "{m}", "--lengths", "256", "-q"],
    ["eval", "niah", "{m}", "--lengths", "256", "-q"],
], ids=["generate", "ppl", "stream", "passkey", "niah"])
def test_no_weights_is_one_line_everywhere(root, tmp_path, command):
    argv = [a.format(m=root / "noweights", t=root / "text.txt") for a in command]
    run_refused([root, tmp_path], "gqakit", *argv, cwd=tmp_path, needles=("noweights", "model.safetensors"))


@pytest.mark.parametrize("folder, needles", [
    ("noweights", ("has no model.safetensors",)),
    ("pickled", ("only pickled weights", "pytorch_model.bin")),
    ("truncated", ("not a readable safetensors file",)),
    ("badjson", ("config.json is not valid JSON",)),
    ("notype", ("cannot read the config", "model_type")),
    ("partial", ("the weights lack model.layers.1.", "incomplete")),
    ("resized", ("mlp.down_proj.weight is [32, 64] in the weights but config.json implies [32, 96]",)),
])
def test_broken_checkpoints_are_refused_before_use(root, folder, needles):
    from gqakit.hf.loading import load_model

    with pytest.raises(GqakitError) as e:
        load_model(str(root / folder), device="cpu")
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_half_random_model_is_refused_by_the_console_script(root, tmp_path):
    """Before: transformers initialised the missing layer at random and generate printed text."""
    run_refused([root, tmp_path], "gqakit", "generate", str(root / "partial"), "--prompt", "It is", cwd=tmp_path,
                needles=("would be left random",))


def test_ppl_checks_every_model_before_scoring_the_first(root, tmp_path):
    code, out, err = run_eval("ppl", root / "good", root / "noweights", "--text", root / "text.txt",
                              "--max-length", 32, "-q", "-o", tmp_path / "r")
    assert code == 2 and err.count("\n") == 1 and "noweights" in err and out == "", err
    assert not (tmp_path / "r").exists()


# 2. `gqakit generate`: every option is checked up front, one line naming the flag, the value, the range.

BAD_GENERATE = [
    (["--prompt", ""], ("--prompt is empty",)),
    (["--prompt", "  \n "], ("--prompt is empty",)),
    (["--prompt", b"caf\xe9"], ("--prompt is not valid UTF-8",)),
    (["--prompt-file", "{n}/latin1.txt"], ("latin1.txt is not UTF-8", "byte 0xe9 at offset 3")),
    (["--prompt-file", "{n}/blank.txt"], ("blank.txt is empty",)),
    (["--prompt-file", "{n}"], ("is not a file",)),
    (["--prompt-file", "{n}/absent.txt"], ("does not exist",)),
    (["--prompt", "x", "--prompt-file", "{n}/blank.txt"], ("exactly one of --prompt",)),
    (["--prompt", "x", "--sample", "--temperature", "0"], ("--temperature must be a finite number > 0, got 0.0",)),
    (["--prompt", "x", "--sample", "--temperature", "-1"], ("--temperature", "got -1.0")),
    (["--prompt", "x", "--sample", "--temperature", "nan"], ("--temperature", "got nan")),
    (["--prompt", "x", "--sample", "--temperature", "inf"], ("--temperature", "got inf")),
    (["--prompt", "x", "--sample", "--top-p", "0"], ("--top-p must be in (0, 1], got 0.0",)),
    (["--prompt", "x", "--sample", "--top-p", "1.5"], ("--top-p must be in (0, 1], got 1.5",)),
    (["--prompt", "x", "--sample", "--top-p", "nan"], ("--top-p", "got nan")),
    (["--prompt", "x", "--max-new-tokens", "0"], ("--max-new-tokens must be >= 1", "got 0")),
    (["--prompt", "x", "--max-new-tokens", "-5"], ("--max-new-tokens must be >= 1", "got -5")),
    (["--prompt", "x", "--sinks", "-1"], ("--sinks must be >= 0, got -1",)),
    (["--prompt", "x", "--window", "-3"], ("--window must be a positive", "got -3")),
    (["--prompt", "x", "--window", "0"], ("--window must be a positive", "got 0")),
    (["--prompt", "x", "--sample", "--seed", str(2 ** 64)], ("--seed must be an integer in",)),
    # options that this configuration would not honour are refused, never ignored
    (["--prompt", "x", "--temperature", "0.7"], ("--temperature only applies with --sample",)),
    (["--prompt", "x", "--temperature", "0"], ("--temperature must be a finite number > 0",)),
    (["--prompt", "x", "--top-p", "0.9"], ("--top-p only applies with --sample",)),
    (["--prompt", "x", "--seed", "7"], ("--seed only applies with --sample",)),
    (["--prompt", "x", "--attention", "default", "--window", "64"], ("--window only applies with --attention sinks",)),
    (["--prompt", "x", "--attention", "tiled", "--sinks", "2"], ("--sinks only applies with --attention sinks",)),
    (["--prompt", "x", "--attention", "sliding", "--sinks", "2"], ("--sinks only applies with --attention sinks",)),
    # typed at their default values they are still options this run would ignore
    (["--prompt", "x", "--attention", "default", "--window", "1020"], ("--window only applies with --attention",)),
    (["--prompt", "x", "--seed", "0"], ("--seed only applies with --sample",)),
    (["--prompt", "x", "--attention", "sliding", "--sinks", "4"], ("--sinks only applies with --attention sinks",)),
]


@pytest.mark.parametrize("argv, needles", BAD_GENERATE, ids=[str(i) for i in range(len(BAD_GENERATE))])
def test_generate_options_are_one_line(root, tmp_path, argv, needles):
    argv = [a.format(n=root / "notes") if isinstance(a, str) else a for a in argv]
    run_refused([root, tmp_path], "gqakit", "generate", str(root / "good"), *argv, cwd=tmp_path, needles=needles)


def test_generate_config_checks_on_construction():
    from gqakit.generate import GenerateConfig

    GenerateConfig(model="m", prompt="x")  # the defaults are valid
    GenerateConfig(model="m", prompt="x", do_sample=True, temperature=0.5, top_p=0.9, seed=-3)
    GenerateConfig(model="m", prompt="x", attention="sliding", sinks=0)
    with pytest.raises(GqakitError, match=r"^top_p must be in \(0, 1\]"):  # the library names the field
        GenerateConfig(model="m", prompt="x", do_sample=True, top_p=0.0)
    with spelled(flags(GenerateConfig)), pytest.raises(GqakitError, match=r"^--top-p must be in"):  # the command line
        GenerateConfig(model="m", prompt="x", do_sample=True, top_p=0.0)


def test_generate_defaults_and_sampling_still_run(root, capsys):
    from gqakit.cli import main

    def run(*argv):
        capsys.readouterr()
        code = main(["generate", str(root / "good"), "--prompt", "the sky is", "--max-new-tokens", "6", *argv])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return captured.out

    run()
    run("--attention", "sliding", "--sinks", "0", "--window", "8")
    sampled = [run("--sample", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--ignore-eos")
               for _ in range(2)]
    assert sampled[0] == sampled[1] != ""  # seeded


# 4. Passkey lengths past the model's context (or the attention's window): a warning first, then progress.

def test_passkey_far_past_the_context_warns_then_shows_progress(root, tmp_path):
    result = run_cli("gqakit", "eval", "passkey", str(root / "good"), "--lengths", "256", "--depths", "0",
                     "--trials", "1", "--new-tokens", "2", "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stderr.replace("\r", "\n").splitlines() if ln.strip()]
    assert lines[0].startswith("gqakit: warning: --lengths 256 is 2.0x the model's 128-token context"), lines[0]
    assert "expected to fail" in lines[0] and "time grows with length (1 prompt, 256 tokens in all)" in lines[0]
    assert any(ln.startswith("passkey prompts:") for ln in lines) and any(ln.startswith("passkey:") for ln in lines)
    assert "Traceback" not in result.stderr


def test_passkey_quiet_within_reach_prints_nothing_on_stderr(root, tmp_path):
    code, out, err = run_eval("passkey", root / "wide", "--lengths", "256", "--depths", "0,1", "--trials", 1,
                              "--new-tokens", 2, "-q", "-o", tmp_path / "r")
    assert code == 0 and err == "", err


def test_passkey_past_the_window_warns(root, tmp_path):
    code, out, err = run_eval("passkey", root / "wide", "--lengths", "256", "--depths", "0", "--trials", 1,
                              "--new-tokens", 2, "--attention", "sliding", "--window", 64, "-q", "-o", tmp_path / "r")
    assert code == 0, err
    assert err.splitlines() == [err.strip()] and "4.0x the 64 tokens that --attention sliding keeps in view" in err


def test_too_short_lengths_are_refused_before_any_warning(root, tmp_path):
    code, out, err = run_eval("passkey", root / "good", "--lengths", "64,1k", "-q", "-o", tmp_path / "r")
    assert code == 2 and err.splitlines() == [err.strip()] and "--lengths 64 is too short" in err, err


def test_reach_warning():
    from gqakit.evaluate.passkey import reach_warning

    assert reach_warning([1024, 2048], 4096, {}, 25) is None
    assert reach_warning([1024], 4096, {"kind": "sinks", "sinks": 4, "window": 1020}, 5) is None
    far = reach_warning([1024, 1_024_000], 1024, {}, 25)
    assert "--lengths 1,024,000 is 1,000x the model's 1,024-token context" in far
    assert "without --attention sinks or sliding, retrieval beyond the context is expected to fail" in far
    assert "(50 prompts, 25,625,600 tokens in all)" in far
    sinks = reach_warning([8192], 4096, {"kind": "sinks", "sinks": 4, "window": 1020}, 1)
    assert "2.0x the model's 4,096-token context" in sinks and "more than 1,020 tokens before" in sinks
    window = reach_warning([2048], 4096, {"kind": "sinks", "sinks": 4, "window": 1020}, 1)
    assert "2.0x the 1,024 tokens that --attention sinks keeps in view" in window


# 5. KV-cache bytes per token: one definition, the dtype the cache is held in at run time.

def test_demo_and_eval_count_kv_bytes_alike(tmp_path, tok):
    """A bf16-stored model scored in fp32: before, demo said 2 bytes per value (stored), eval 4 (compute)."""
    from gqakit import demo
    from gqakit.hf.loading import describe, kv_bytes_per_token, kv_heading, load_model
    from gqakit.evaluate.perplexity import perplexity_table

    folder = tmp_path / "bf16"
    model = tiny_llama(len(tok), kv_heads=2, bos=tok.eos_token_id, eos=tok.eos_token_id)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    ids = torch.tensor(tok(text(200, seed=4)).input_ids)
    from_demo = demo.evaluate_folder(folder, ids, 32)["kv_bytes_per_token"]
    model, _ = load_model(str(folder), "float32", device="cpu")
    from_eval = describe(model)["kv_bytes_per_token"]
    assert from_demo == from_eval == 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 K/V heads of 8, fp32
    assert kv_bytes_per_token(model.config, "bfloat16") == from_eval // 2

    code, out, err = run_eval("ppl", folder, "--text", _text_file(tmp_path), "--max-length", 32, "-q",
                              "-o", tmp_path / "r")
    assert code == 0, err
    row = next(ln for ln in out.splitlines() if ln.startswith("| bf16 |"))
    assert row.split(" | ")[2] == f"{from_demo:,}"
    heading = kv_heading("float32")
    assert heading == "KV-cache bytes/token (float32)"
    assert heading in demo.demo_table([{"model": "m", "kv_heads": 2, "method": "-", "kv_bytes_per_token": 1,
                                         "perplexity": 1.0}]).splitlines()[0]
    assert heading in perplexity_table([], "float32") and heading in out


def _text_file(folder: Path) -> Path:
    path = folder / "t.txt"
    path.write_text(text(300, seed=5), encoding="utf-8")
    return path


@pytest.mark.parametrize("command, where", [(c, w) for c in ("ppl", "stream", "passkey", "niah")
                                            for w in ("model", "inside the model", "the text")
                                            if (c, w) != ("passkey", "the text")])  # passkey reads no text file
def test_a_report_never_replaces_or_enters_what_it_reads(root, tmp_path, tok, command, where):
    """`eval ... MODEL -o MODEL --force` deleted a converted model (gqakit's mark made it replaceable) and wrote the
    report in its place; -o MODEL/sub wrote into it (a review). Both are refused before any work, as is the text."""
    model = checkpoint(tmp_path / "converted", tok, max_positions=128)
    (model / "README.md").write_text("---\ntags: [gqakit]\n---\nMade by gqakit\n")
    text_file = tmp_path / "text.txt"
    shutil.copy(root / "text.txt", text_file)
    output = {"model": model, "inside the model": model / "report", "the text": text_file}[where]
    argv = {"ppl": ["--text", str(text_file), "--max-length", "64"],
            "stream": ["--text", str(text_file), "--tokens", "64", "--policy", "dense"],
            "passkey": ["--lengths", "100", "--depths", "0", "--trials", "1"],
            "niah": ["--lengths", "100", "--depths", "0", "--samples", "1", "--haystack-text", str(text_file)]}
    if command == "niah":
        argv[command] += ["--haystack", "text"]
    run_refused([tmp_path], "gqakit", "eval", command, str(model), *argv[command], "-o", str(output), "--force",
                "-q", cwd=tmp_path, needles=("--output", "overlaps", "choose an --output outside it"))


@pytest.mark.parametrize("command", ["ppl", "passkey"])
def test_the_default_report_folder_is_not_written_into_the_model(root, tmp_path, tok, command):
    """Without --output the report goes to runs/eval-... under the current folder; started in the model's folder,
    that wrote runs/ into the model (the overlap check covered --output only). Refused before any work, like -o."""
    model = checkpoint(tmp_path / "converted", tok, max_positions=128)
    text_file = tmp_path / "text.txt"
    shutil.copy(root / "text.txt", text_file)
    argv = {"ppl": ["--text", str(text_file), "--max-length", "64"],
            "passkey": ["--lengths", "100", "--depths", "0", "--trials", "1"]}[command]
    run_refused([tmp_path], "gqakit", "eval", command, ".", *argv, "-q", cwd=model,
                needles=("default report folder", "overlaps MODEL", "choose an --output outside it"))
    assert not (model / "runs").exists()
