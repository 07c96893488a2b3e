"""Faults and malformed input from a user sweep, through the real `convert-gqa` console script.

Refusals must follow the CLI contract (tests/support/cli_contract.py): exit 2, one `convert-gqa: error:` line,
no traceback, nothing written. Runs that are stopped must leave nothing behind, and what an earlier
run left after `kill -9` is removed (and reported) by the next run that writes the same output.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_contract import console_script, run_cli, run_refused
from tiny_models import make_tiny_llama

PROG = "convert-gqa"
DROP = object()  # edit_config: remove the key


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("base") / "src")


@pytest.fixture
def src(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "src"))


def edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))


def edit_header(path: Path, change) -> None:
    """Rewrite a safetensors file's JSON header with `change(header, data) -> (header, data)`."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = change(json.loads(raw[8 : 8 + n]), raw[8 + n :])
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def by_offset(header: dict) -> list[dict]:
    return sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda e: e["data_offsets"][0])


def refused(tmp_path: Path, model: Path, *needles: str, extra: tuple = ()) -> str:
    return run_refused(tmp_path, PROG, "--groups", "2", str(model), "-o", str(tmp_path / "out"), "--quiet",
                       *extra, needles=needles)


def converted(model: Path | bytes, out: Path | bytes, *extra: str | bytes, groups: int = 2):
    result = run_cli(PROG, "--groups", str(groups), model, "-o", out, "--quiet", *extra)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    return result


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".gqakit-" in p.name)


def dead_pid() -> int:
    """The id of a process that certainly exited: a child that was spawned and reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------------------
# config.json fields: validated once, before anything is read or written


@pytest.mark.parametrize("changes, needles", [
    ({"num_hidden_layers": 1}, ("num_hidden_layers 1", "hold 2 layers", "model.layers.1.", "fix num_hidden_layers")),
    ({"num_hidden_layers": 3}, ("num_hidden_layers 3", "hold 2 layers", "fix num_hidden_layers")),
    ({"head_dim": 8.0}, ("head_dim 8.0", "not a positive integer", "write 8")),
    ({"head_dim": "8"}, ('head_dim "8"', "not a positive integer", "write 8")),
    ({"head_dim": True}, ("head_dim true", "not a positive integer")),
    ({"head_dim": 0}, ("head_dim 0", "not a positive integer")),
    ({"num_attention_heads": 0, "head_dim": DROP}, ("num_attention_heads 0", "positive integer")),
    ({"num_attention_heads": -4}, ("num_attention_heads -4", "positive integer")),
    ({"num_attention_heads": DROP}, ("no 'num_attention_heads'",)),
    ({"num_key_value_heads": 4.0}, ("num_key_value_heads 4.0", "write 4")),
    ({"num_hidden_layers": "2"}, ('num_hidden_layers "2"', "write 2")),
    ({"hidden_size": 2, "head_dim": DROP}, ("hidden_size 2", "head_dim")),
    ({"hidden_size": 32.0, "head_dim": None}, ("hidden_size 32.0", "write 32")),
    ({"architectures": "LlamaForCausalLM"}, ('architectures "LlamaForCausalLM"', '["LlamaForCausalLM"]')),
    ({"architectures": [7]}, ("architectures [7]", "list of class names")),
    ({"architectures": {"a": "LlamaForCausalLM"}}, ("architectures", "list of class names")),
    ({"architectures": []}, ("names no 'architectures'",)),
    ({"initializer_range": "0.02"}, ('initializer_range "0.02"', "0.02")),
])
def test_bad_config_field_is_one_line(src, tmp_path, changes, needles):
    edit_config(src, **changes)
    line = refused(tmp_path, src, *needles)
    assert "architecture L " not in line and "8888" not in line


def test_null_fields_mean_the_default(src, tmp_path):
    """`null` is transformers' "use the default": head_dim from hidden_size, K/V heads = heads. Where transformers
    refuses a null (initializer_range, a float), so does convert-gqa, in one line: it wrote an output that no
    transformers could load (seen once the output's class is built on the meta device to check its weights)."""
    edit_config(src, head_dim=None, num_key_value_heads=None)
    converted(src, tmp_path / "out", "--method", "random")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["head_dim"] == 8 and cfg["num_key_value_heads"] == 2
    edit_config(src, initializer_range=None)
    run_refused(tmp_path, PROG, "--groups", "2", str(src), "-o", str(tmp_path / "null"), "--method", "random",
                needles=("transformers cannot read the output's config.json", "initializer_range"))


@pytest.mark.parametrize("family", ["gemma", "starcoder2"])
def test_fields_left_to_the_class_read_its_defaults(tmp_path, family):
    """Gemma's head_dim (256) and StarCoder2's K/V head count (2) are their classes' defaults where config.json
    leaves them out, as transformers reads them; gqakit fell back to hidden / heads and heads, and refused the
    weights as not matching the config (a review)."""
    from transformers import AutoModelForCausalLM, GemmaConfig, Starcoder2Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    cfg = GemmaConfig(**small, num_key_value_heads=4) if family == "gemma" else Starcoder2Config(**small)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    left_out = "head_dim" if family == "gemma" else "num_key_value_heads"
    edit_config(tmp_path / "src", **{left_out: None})
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != left_out}))
    converted(tmp_path / "src", tmp_path / "out", groups=1)
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["num_key_value_heads"] == 1 and out.get("head_dim", 256 if family == "gemma" else 8) == (
        256 if family == "gemma" else 8)


# ---------------------------------------------------------------------------------------------
# config.json against the weights


def drop_tensor(model: Path, name: str) -> None:
    tensors = load_file(model / "model.safetensors")
    del tensors[name]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def test_layer_without_attention_tensor(src, tmp_path):
    drop_tensor(src, "model.layers.0.self_attn.v_proj.weight")
    refused(tmp_path, src, "model.layers.0.self_attn.v_proj.weight", "missing", "do not match")


def test_last_layer_missing_entirely(src, tmp_path):
    for name in [n for n in load_file(src / "model.safetensors") if n.startswith("model.layers.1.")]:
        drop_tensor(src, name)
    refused(tmp_path, src, "num_hidden_layers 2", "hold 1 layer (", "fix num_hidden_layers")


def test_head_tensor_the_config_does_not_account_for(tmp_path):
    """A per-head key norm for a K/V head the config does not declare would be copied unconverted."""
    from transformers import AutoModelForCausalLM, StableLmConfig

    cfg = StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    tensors["model.layers.0.self_attn.k_layernorm.norms.9.weight"] = torch.ones(8)
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    refused(tmp_path, tmp_path / "src", "k_layernorm.norms.9.weight", "4 K/V heads", "does not account for")


# ---------------------------------------------------------------------------------------------
# corrupt safetensors headers and index files


def shift_later(amount: int):
    """Move every tensor after the first by `amount` bytes (negative: overlap; positive: a gap)."""
    def change(header, data):
        for entry in by_offset(header)[1:]:
            entry["data_offsets"] = [o + amount for o in entry["data_offsets"]]
        return header, data + b"\0" * max(amount, 0) if amount > 0 else data[:amount]
    return change


def float_offsets(header: dict, name: str) -> dict:
    entry = header[name]
    return {**header, name: {**entry, "data_offsets": [float(o) for o in entry["data_offsets"]]}}


@pytest.mark.parametrize("change, needles", [
    (lambda h, d: ([1, 2], d), ("not a readable safetensors", "JSON list, not an object")),
    (lambda h, d: (7, d), ("JSON int, not an object",)),
    (lambda h, d: ("text", d), ("JSON str, not an object",)),
    (lambda h, d: (b"[" * 100_000 + b"]" * 100_000, d), ("not a readable safetensors",)),
    (lambda h, d: ({**h, "__metadata__": ["format", "pt"]}, d), ("__metadata__", "mapping of strings")),
    (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), ("__metadata__",)),
    (shift_later(-4), ("overlaps the tensor before it",)),  # two tensors share 4 bytes
    (shift_later(8), ("leaves a gap",)),
    (lambda h, d: ({**h, "lm_head.weight": "F32"}, d), ("lm_head.weight", "corrupt header entry")),
    (lambda h, d: ({**h, "lm_head.weight": {**h["lm_head.weight"], "shape": [-64, -32]}}, d),
     ("lm_head.weight", "corrupt header entry")),
    (lambda h, d: (float_offsets(h, "lm_head.weight"), d), ("lm_head.weight", "corrupt header entry")),
    (lambda h, d: ({**h, "lm_head.weight": {**h["lm_head.weight"], "dtype": "U32"}}, d),
     ("lm_head.weight", "dtype U32")),
])
def test_corrupt_header_is_one_line(src, tmp_path, change, needles):
    edit_header(src / "model.safetensors", change)
    refused(tmp_path, src, *needles)


def to_index(model: Path, index) -> None:
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("index, needles", [
    ([{"weight_map": {}}], ("has no 'weight_map' object",)),
    ({"weight_map": ["model-00001-of-00001.safetensors"]}, ("has no 'weight_map' object",)),
    ({"weight_map": {"lm_head.weight": 1}}, ("has no 'weight_map' object",)),
    ({"metadata": {}}, ("has no 'weight_map' object",)),
    ({"weight_map": {}}, ("lists no tensors",)),
    ({"weight_map": {"lm_head.weight": "../src/model-00001-of-00001.safetensors"}}, ("not a file name",)),
    ("not an object", ("has no 'weight_map' object",)),
])
def test_bad_index_is_one_line(src, tmp_path, index, needles):
    to_index(src, index)
    refused(tmp_path, src, *needles)


def test_index_json_that_is_not_json(src, tmp_path):
    to_index(src, {})
    (src / "model.safetensors.index.json").write_bytes(b"{\xff")
    refused(tmp_path, src, "not valid JSON")


def test_tensor_in_two_shards(src, tmp_path):
    to_index(src, {})
    shutil.copy(src / "model-00001-of-00001.safetensors", src / "model-00002-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00001-of-00001.safetensors",
                  "model.norm.weight": "model-00002-of-00002.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(tmp_path, src, "is in both", "model-00002-of-00002.safetensors")


# ---------------------------------------------------------------------------------------------
# paths: names that are not UTF-8, symlinks at -o, `-o .`


def test_model_path_that_is_not_utf8(base, tmp_path):
    model = os.fsencode(tmp_path) + b"/m\xff"
    os.mkdir(model)
    shutil.copytree(base, os.fsdecode(model), dirs_exist_ok=True)
    converted(model, model + b"-out")
    out = Path(os.fsdecode(model + b"-out"))
    card = (out / "README.md").read_bytes().decode("utf-8")  # valid UTF-8: the odd byte is shown escaped
    assert "m\\xff" in card
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert (out / "model.safetensors").stat().st_size > 0  # (safetensors' reader refuses such paths)
    assert not leftovers(tmp_path)
    # refusals name the path escaped, on one line
    run_refused(tmp_path, PROG, "--groups", "2", model, "-o", model + b"-out", "--quiet",
                needles=("-out already exists",))  # the path escaped, whichever way the CLI escapes


def test_model_path_that_is_not_utf8_with_strict_stdout(base, tmp_path):
    model = os.fsencode(tmp_path) + b"/m\xff"
    shutil.copytree(base, os.fsdecode(model))
    result = run_cli(PROG, "--groups", "2", model, "--quiet", env={"PYTHONIOENCODING": "utf-8:strict"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_symlink_output_is_replaced_not_followed(src, tmp_path):
    target = tmp_path / "user-folder"
    target.mkdir()
    (target / "notes.txt").write_text("not ours")
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    refused(tmp_path, src, "already exists", "symlink", "--force")
    converted(src, link, "--force")
    assert link.is_dir() and not link.is_symlink() and (link / "model.safetensors").is_file()
    assert (target / "notes.txt").read_text() == "not ours" and sorted(os.listdir(target)) == ["notes.txt"]
    assert not leftovers(tmp_path)


def test_dangling_symlink_output(src, tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    refused(tmp_path, src, "already exists", "symlink")
    converted(src, link, "--force")
    assert link.is_dir() and not link.is_symlink() and not (tmp_path / "nowhere").exists()
    assert not leftovers(tmp_path)


def test_symlink_output_pointing_at_the_model(src, tmp_path):
    """The link is replaced; the model folder it points to is not the output and is left alone."""
    before = sorted(os.listdir(src))
    link = tmp_path / "out"
    link.symlink_to(src, target_is_directory=True)
    converted(src, link, "--force")
    assert not link.is_symlink() and (link / "README.md").is_file()
    assert sorted(os.listdir(src)) == before
    assert not leftovers(tmp_path)


def test_output_dot_is_an_existing_folder(src, tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    run_refused(tmp_path, PROG, "--groups", "2", str(src), "-o", ".", "--quiet", cwd=here,
                needles=("already exists", "--force"))


def test_pipe_in_model_folder_is_not_copied(src, tmp_path):
    os.mkfifo(src / "a-fifo")
    converted(src, tmp_path / "out")
    assert not (tmp_path / "out" / "a-fifo").exists()


# ---------------------------------------------------------------------------------------------
# leftovers of stopped runs


def test_leftovers_of_dead_runs_are_removed_and_reported(src, tmp_path):
    pid = dead_pid()
    out = tmp_path / "out"
    dead_tmp, dead_old = tmp_path / f".out.gqakit-tmp-{pid}", tmp_path / f".out.gqakit-old-{pid}"
    for folder in (dead_tmp, dead_old):
        folder.mkdir()
        (folder / "model-00001-of-00009.safetensors").write_bytes(b"\0" * 1000)
    user = tmp_path / "user-folder"
    user.mkdir()
    live = tmp_path / f".out.gqakit-tmp-{os.getpid()}"  # this test's own process: alive
    live.mkdir()
    other = tmp_path / f".other.gqakit-tmp-{pid}"  # another output's: not ours to judge
    other.mkdir()

    # with nothing to write, nothing is cleaned either
    out.mkdir()
    refused(tmp_path, src, "already exists")

    result = converted(src, out, "--force")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert f"convert-gqa: removed .out.gqakit-tmp-{pid} left by a stopped run (pid {pid})" in lines
    assert f"convert-gqa: removed .out.gqakit-old-{pid} left by a stopped run (pid {pid})" in lines
    assert len(lines) == 2, result.stderr
    assert not dead_tmp.exists() and not dead_old.exists()
    assert live.is_dir() and other.is_dir() and user.is_dir()
    assert (out / "model.safetensors").is_file()


def test_leftover_symlink_is_unlinked_not_followed(src, tmp_path):
    pid = dead_pid()
    user = tmp_path / "user-folder"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    link = tmp_path / f".out.gqakit-old-{pid}"
    link.symlink_to(user, target_is_directory=True)
    result = converted(src, tmp_path / "out")
    assert f"removed .out.gqakit-old-{pid}" in result.stderr
    assert not os.path.lexists(link) and (user / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# SIGTERM behaves like Ctrl-C


def test_sigterm_mid_write_leaves_nothing(tmp_path):
    """A real SIGTERM from outside while shards are being written: exit 143 (128 + SIGTERM), no temporary folder."""
    model = make_tiny_llama(tmp_path / "many", heads=2, head_dim=4, layers=24)  # ~220 tensors, one shard each
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([console_script(PROG), "--groups", "1", str(model), "-o", str(out), "--quiet",
                             "--max-shard-size", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        tmp = None
        while proc.poll() is None and time.monotonic() < deadline:
            found = [p for p in tmp_path.iterdir() if p.name.startswith(".out.gqakit-tmp-")]
            if found and any(found[0].glob("*.safetensors")):
                tmp = found[0]
                break
            time.sleep(0.001)
        assert tmp is not None, f"the write never started or ended too soon: {proc.poll()}"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode(errors="replace")
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "convert-gqa: terminated; nothing was written" in err, err
    assert not out.exists() and not leftovers(tmp_path)


def test_sigterm_handler_only_during_the_write(src, tmp_path, monkeypatch, capsys):
    """In-process: SIGTERM raised by the writer itself interrupts cleanly; the old handler comes back."""
    from gqakit.cli import convert_main
    from gqakit.hf import checkpoint as ckpt

    seen = []
    real = ckpt.ShardWriter.copy_tensor

    def signalling(self, name, info):
        seen.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs here, or at the latest on return
        return real(self, name, info)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(ckpt.ShardWriter, "copy_tensor", signalling)
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "out"), "--quiet"]) == 143
    assert "terminated" in capsys.readouterr().err
    assert seen and seen[0] is not before
    assert signal.getsignal(signal.SIGTERM) is before
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_stopped_run_removes_the_parent_folders_it_made(src, tmp_path, monkeypatch, capsys):
    """-o new/deeper/out: the run makes new/ and deeper/ for its working folder; stopped, it leaves neither (empty
    parents were left behind, a review) but never removes a folder that was there before or holds something."""
    from gqakit.cli import convert_main
    from gqakit.hf import checkpoint as ckpt

    def stopping(self, name, info):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.ShardWriter, "copy_tensor", stopping)
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "new" / "deeper" / "out"), "--quiet"]) != 0
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "kept" / "a" / "out"), "--quiet"]) != 0
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]
    capsys.readouterr()


def test_failed_publish_puts_the_previous_output_back(src, tmp_path, monkeypatch, capsys):
    """If the final rename fails after the previous output was moved aside, the previous output returns."""
    import errno

    from gqakit.cli import convert_main

    out = tmp_path / "out"
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--quiet"]) == 0
    previous = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    real = os.replace

    def failing(a, b):
        if Path(a).name.startswith(".out.gqakit-tmp-"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(a, b)

    monkeypatch.setattr(os, "replace", failing)
    capsys.readouterr()
    assert convert_main(["--groups", "1", str(src), "-o", str(out), "--force", "--quiet"]) == 2
    assert "cross-device" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == previous
    assert not leftovers(tmp_path)


def test_force_replaces_only_what_gqakit_wrote(tmp_path):
    """--force replaces an earlier conversion, but never a user's folder or file, for convert-gqa and
    for eval's report folders alike (the shared rule: convert.publish.check_replaceable)."""
    model = make_tiny_llama(tmp_path / "m")
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("\\documentclass{article}")
    run_refused(tmp_path, "convert-gqa", "--groups", "2", str(model), "-o", str(thesis), "--force",
                needles=("a folder gqakit did not write, so --force will not replace it",))
    (tmp_path / "notes.txt").write_text("mine")
    run_refused(tmp_path, "convert-gqa", "--groups", "2", str(model), "-o", str(tmp_path / "notes.txt"), "--force",
                needles=("is a file, so --force will not replace it",))
    out = tmp_path / "out"
    for _ in range(2):  # the second run replaces the first's output: gqakit wrote it
        done = run_cli("convert-gqa", "--groups", "2", str(model), "-o", str(out), "--force", "-q")
        assert done.returncode == 0, done.stderr
    run_refused(tmp_path, "gqakit", "eval", "ppl", str(out), "--text", str(tmp_path / "notes.txt"), "-o", str(thesis),
                "--force", needles=("--force will not replace it",))


def test_force_keeps_files_added_to_an_output(tmp_path):
    """A conversion or a report records what it wrote (.gqakit-written.json); --force refuses the folder once a user
    has added a file to it or changed one (notes in a converted folder were deleted before), and replaces it
    again when only gqakit's files are there. Nothing is touched by the refusal."""
    model = Path(__file__).resolve().parents[2] / "gqakit" / "assets" / "austen-mha-8h"  # it has a tokenizer
    text = tmp_path / "text.txt"
    text.write_text("one two three four five six seven eight nine ten. " * 40)
    out, report = tmp_path / "out", tmp_path / "report"
    assert run_cli("convert-gqa", "--groups", "2", str(model), "-o", str(out), "-q").returncode == 0
    assert run_cli("gqakit", "eval", "ppl", str(out), "--text", str(text), "-o", str(report),
                   "--max-tokens", "64", "--max-length", "32").returncode == 0
    listed = json.loads((out / ".gqakit-written.json").read_text())["files"]
    assert {"config.json", "model.safetensors", "README.md"} <= set(listed)
    assert {"results.json", "results.csv"} <= set(json.loads((report / ".gqakit-written.json").read_text())["files"])
    for folder, again in ((out, ("convert-gqa", "--groups", "2", str(model), "-o", str(out), "--force", "-q")),
                          (report, ("gqakit", "eval", "ppl", str(out), "--text", str(text), "-o", str(report),
                                    "--max-tokens", "64", "--max-length", "32", "--force"))):
        (folder / "sub").mkdir()
        (folder / "sub" / "notes.md").write_text("mine")
        before = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
        run_refused(tmp_path, *again, needles=("holds sub/notes.md, which gqakit did not write",
                                               "will not replace the folder"))
        assert (folder / "sub" / "notes.md").read_text() == "mine"
        assert sorted((p.name, p.stat().st_size) for p in folder.iterdir()) == before
        shutil.rmtree(folder / "sub")
        with open(folder / "results.csv" if folder == report else folder / "README.md", "a") as f:
            f.write("my edit\n")  # a file gqakit wrote, changed since
        run_refused(tmp_path, *again, needles=("which gqakit did not write (or it changed since)",))
    for folder, again in ((out, ("convert-gqa", "--groups", "2", str(model), "-o", str(out), "--force", "-q")),):
        (folder / "README.md").unlink()  # deleting one of gqakit's files leaves nothing of the user's
        done = run_cli(*again)
        assert done.returncode == 0, done.stderr
        assert (folder / "README.md").is_file() and not leftovers(tmp_path)
    shutil.rmtree(report / "sub", ignore_errors=True)
    (report / "results.csv").unlink()  # gqakit's files only, so each folder is replaceable by its own kind
    # a review: a report written with --force over a converted model replaced the model, and the other way round
    run_refused(tmp_path, "gqakit", "eval", "ppl", str(out), "--text", str(text), "-o", str(out), "--force",
                "--max-tokens", "64", "--max-length", "32", needles=("overlaps",))
    run_refused(tmp_path, "gqakit", "eval", "ppl", str(model), "--text", str(text), "-o", str(out), "--force",
                "--max-tokens", "64", "--max-length", "32",
                needles=(f"{out} holds a model (config.json), and --force replaces a report only",))
    run_refused(tmp_path, "convert-gqa", "--groups", "2", str(model), "-o", str(report), "--force",
                needles=(f"{report} holds a report (results.json), and --force replaces a model only",))
