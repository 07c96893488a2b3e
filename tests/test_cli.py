"""The console scripts, run as a user runs them."""
import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from gqakit.cli import convert_main
from gqakit.hf.headers import read_header
from cli_contract import console_script
from tiny_models import make_tiny_llama


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True)


def test_convert_gqa_and_gqakit_convert_agree(tmp_path):
    src = make_tiny_llama(tmp_path / "src")
    a = run(console_script("convert-gqa"), "--groups", "2", str(src), "-o", str(tmp_path / "a"), "--quiet")
    b = run(sys.executable, "-m", "gqakit.cli", "convert", "--groups", "2", str(src), "-o", str(tmp_path / "b"),
            "--quiet")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "4 -> 2 K/V heads" in a.stdout
    ta, tb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert read_header(tmp_path / "a" / "model.safetensors")[1] == {"format": "pt"}
    card = (tmp_path / "a" / "README.md").read_text()
    assert "--groups 2" in card and "gqakit" in card and "| 0 |" in card


def test_default_output_name_and_side_files(tmp_path):
    src = make_tiny_llama(tmp_path / "model")
    (src / "tokenizer.json").write_text("{}")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "README.md").write_text("the original card")
    assert convert_main(["--groups", "1", str(src), "--quiet"]) == 0
    out = tmp_path / "model-mqa"
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "chat_template.jinja").is_file() and (out / "generation_config.json").is_file()
    assert "MQA" in (out / "README.md").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1 and cfg["head_dim"] == 8


def test_null_kv_heads_means_mha(tmp_path):
    src = make_tiny_llama(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_key_value_heads"] = None
    (src / "config.json").write_text(json.dumps(cfg))
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "o"), "--quiet"]) == 0


def test_dtype_and_small_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama(tmp_path / "src")
    out = tmp_path / "o"
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--dtype", "bfloat16",
                         "--max-shard-size", "20KB", "--quiet"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 2
    original = AutoModelForCausalLM.from_pretrained(src)
    torch.testing.assert_close(model.model.embed_tokens.weight.float(),
                               original.model.embed_tokens.weight.to(torch.bfloat16).float(), rtol=0, atol=0)


# ---- the smaller edges of a new user's first hour, each through the console scripts --------------------

def test_edges_are_one_line_with_the_fix(tmp_path):
    from cli_contract import run_refused

    (tmp_path / "weights.txt").write_text("not a model\n")
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "model.gguf").write_bytes(b"GGUF")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tmp_path / 'gguf'}\noutput_dir: {tmp_path / 'run'}\n"
                      f"data: [{tmp_path / 'weights.txt'}]\nsteps: 1\n")
    assert "is a file, not a model folder" in run_refused(tmp_path, "convert-gqa", "--groups", "2",
                                                           str(tmp_path / "weights.txt"))
    assert "holds a GGUF file but no config.json" in run_refused(tmp_path, "convert-gqa", "--groups", "2",
                                                                 str(tmp_path / "gguf"))
    assert "seq_len=1 must be >= 2" in run_refused(tmp_path, "gqakit", "uptrain", str(recipe), "seq_len=1")
    from gqakit.reference import reference_model_path

    line = run_refused(tmp_path, "gqakit", "eval", "ppl", str(reference_model_path()), "--text",
                       str(tmp_path / "weights.txt"), "--attention", "sliding", "-o", str(tmp_path / "report"))
    assert "pass --window W" in line and "window=W" not in line


def test_help_speaks_to_users():
    done = subprocess.run([console_script("gqakit"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Turn multi-head-attention models into grouped-query ones" in done.stdout
    assert "thin layer" not in done.stdout  # no developer's note


def test_a_rank_other_than_0_says_its_error_after_waiting(tmp_path, monkeypatch, capsys):
    """Under torchrun rank 0 says a shared error; another rank waits (torchrun stops it once rank 0 has exited),
    then says it with its rank, so that an error that only it meets is never silent."""
    import gqakit.cli as cli

    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    assert convert_main(["--groups", "2", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert waits == [cli._OTHER_RANKS_WAIT_S] and len(err) == 1
    assert err[0].startswith("convert-gqa: error (rank 1): ") and "absent" in err[0]
    monkeypatch.setenv("RANK", "0")
    assert convert_main(["--groups", "2", str(tmp_path / "absent")]) == 2
    assert waits == [cli._OTHER_RANKS_WAIT_S]  # rank 0 says it at once
    assert capsys.readouterr().err.startswith("convert-gqa: error: ")


def test_a_flag_a_key_or_a_list_item_given_twice_is_refused(tmp_path):
    """A review: argparse keeps the last of a flag given twice (`--groups 2 --groups 4` converted to 4 without a
    word), as did recipe overrides (`steps=3 steps=4`) and PyYAML for a key written twice; comma lists dropped a
    repeat. Each is refused now; a flag declared repeatable (--attention-option) still repeats."""
    from pathlib import Path

    from cli_contract import run_cli, run_refused

    repo = Path(__file__).resolve().parents[1]
    model, text = repo / "gqakit" / "assets" / "austen-mha-8h", repo / "gqakit" / "assets" / "heldout_emma.txt"
    for args in (("convert-gqa", "--groups", "2", "-g", "4", str(model), "-o", str(tmp_path / "c")),
                 ("convert-gqa", "--groups", "2", "--method", "mean", "--method", "first", str(model)),
                 ("gqakit", "eval", "ppl", str(model), "--text", str(text), "--stride", "64", "--stride", "32")):
        run_refused(tmp_path, *args, cwd=tmp_path, needles=("given twice (argparse would keep the last); give it "
                                                             "once", "--help)"))
        assert not list(tmp_path.iterdir())
    # argparse's own errors are one line too (its usage block came first)
    run_refused(tmp_path, "convert-gqa", str(model), needles=("the following arguments are required: -g/--groups",
                                                              "(see convert-gqa --help)"))
    run_refused(tmp_path, "gqakit", "eval", "ppl", str(model), "--attention", "nosuch",
                needles=("invalid choice: 'nosuch'", "(see gqakit eval ppl --help)"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {model}\ndata: [{repo / 'gqakit' / 'assets' / 'pride_and_prejudice.txt'}]\n"
                      f"output_dir: {tmp_path / 'run'}\nsteps: 3\nsteps: 4\n")
    run_refused(tmp_path, "gqakit", "uptrain", str(recipe),
                needles=("gives the key 'steps' twice (at line 5, column 1); keep one",))
    recipe.write_text(recipe.read_text().replace("steps: 4\n", ""))
    run_refused(tmp_path, "gqakit", "uptrain", str(recipe), "steps=3", "steps=4",
                needles=("steps is overridden twice (steps=3, then steps=4); give it once",))
    run_refused(tmp_path, "gqakit", "eval", "stream", str(model), "--text", str(text), "--policy", "sinks,sinks",
                needles=("lists 'sinks' twice; give each once",))
    run_refused(tmp_path, "gqakit", "eval", "passkey", str(model), "--lengths", "256,256",
                needles=("lists 256 twice; give each once",))
    done = run_cli("gqakit", "eval", "ppl", str(model), "--text", str(text), "--max-tokens", "256", "--max-length",
                   "128", "--attention", "sparse", "--attention-option", "pattern=strided", "--attention-option",
                   "stride=16", "-o", str(tmp_path / "ok"))
    assert done.returncode == 0, done.stderr
