"""Bad input: a one-line error naming the problem and the fix, a non-zero exit, nothing written."""
import json
from pathlib import Path

import pytest

from gqakit.cli import convert_main
from gqakit.hf import checkpoint as ckpt
from gqakit.hf import headers
from gqakit.convert import run as run_mod
from tiny_models import make_tiny_llama


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path):
    return make_tiny_llama(tmp_path / "src")


def fails(capsys, argv, *needles):
    """Run convert-gqa, expect exit 2 and a single stderr line containing every needle."""
    capsys.readouterr()  # drop what the fixtures printed (save_pretrained's progress bars)
    code = convert_main([*argv, "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".gqakit-" in p.name]


def test_missing_folder(tmp_path, capsys):
    fails(capsys, ["--groups", "2", str(tmp_path / "nope")], "does not exist")


def test_missing_config(src, tmp_path, capsys):
    (src / "config.json").unlink()
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "no config.json")
    assert not (tmp_path / "out").exists()


def test_missing_weights(src, tmp_path, capsys):
    (src / "model.safetensors").unlink()
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "model.safetensors")


def test_pickled_weights_are_refused(src, tmp_path, capsys):
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")],
          "pytorch_model.bin", "will not unpickle", "save_pretrained")


@pytest.mark.parametrize("groups, needle", [
    (3, "choose a divisor of 4 (1, 2, 4)"),
    (0, "positive"),
    (-2, "positive"),
    (8, "exceeds the 4 attention heads"),
])
def test_bad_groups(src, tmp_path, capsys, groups, needle):
    fails(capsys, ["--groups", str(groups), str(src), "-o", str(tmp_path / "out")], needle)
    assert not (tmp_path / "out").exists()


def test_groups_incompatible_with_existing_kv_heads(tmp_path, capsys):
    src = make_tiny_llama(tmp_path / "gqa", heads=12, kv_heads=4)
    fails(capsys, ["--groups", "6", str(src), "-o", str(tmp_path / "out")], "4 K/V heads", "1, 2, 4, 12")


def test_unsupported_architecture(src, tmp_path, capsys):
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]  # known-but-refused families: tests/hf/test_rehost.py
    (src / "config.json").write_text(json.dumps(cfg))
    err = fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "MadeUpForCausalLM", "not supported")
    assert "LlamaForCausalLM" in err and "Phi3ForCausalLM" in err and "GPTNeoXForCausalLM" in err


def test_truncated_safetensors(src, tmp_path, capsys):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "truncated")


def test_corrupt_safetensors_header(src, tmp_path, capsys):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "not a readable safetensors")


def test_garbage_file(src, tmp_path, capsys):
    (src / "model.safetensors").write_bytes(b"abc")
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "safetensors")


def test_index_naming_missing_shard(src, tmp_path, capsys):
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    tensors, _ = headers.read_header(src / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (src / headers.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")],
          "model-00002-of-00002.safetensors", "missing")


def test_shape_disagrees_with_config(src, tmp_path, capsys):
    cfg = json.loads((src / "config.json").read_text())
    cfg["head_dim"] = 4  # weights have head_dim 8
    cfg["num_attention_heads"] = 4
    (src / "config.json").write_text(json.dumps(cfg))
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "out")], "k_proj.weight", "do not match")


def test_existing_output_needs_force(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    fails(capsys, ["--groups", "2", str(src), "-o", str(out)], "already exists", "--force")
    assert (out / "keep.txt").read_text() == "user file"
    fails(capsys, ["--groups", "2", str(src), "-o", str(out), "--force"], "--force will not replace it")
    assert (out / "keep.txt").read_text() == "user file"  # a user's folder is never replaced
    (out / "keep.txt").unlink()
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--force", "--quiet"]) == 0  # empty: fine
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--force", "--quiet"]) == 0  # ours: replaced
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("where", ["same", "inside"])
def test_output_equal_to_or_inside_model_dir(src, capsys, where):
    before = snapshot(src)
    out = src if where == "same" else src / "sub"
    fails(capsys, ["--groups", "2", str(src), "-o", str(out), "--force"], "choose an -o outside it")
    assert snapshot(src) == before


def test_output_containing_model_dir_is_refused(tmp_path, capsys):
    src = make_tiny_llama(tmp_path / "parent" / "src")
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "parent"), "--force"], "contains the model folder")
    assert (src / "model.safetensors").is_file()


def test_dry_run_writes_nothing(src, tmp_path, capsys):
    before = snapshot(src)
    assert convert_main(["--groups", "1", str(src), "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 -> 1" in out and "model.safetensors" in out and "KV cache per token" in out
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    assert snapshot(src) == before


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_interrupted_or_failing_write_leaves_nothing(src, tmp_path, capsys, monkeypatch, exc):
    before = snapshot(src)
    calls = {"n": 0}
    real = ckpt.ShardWriter.write_tensor

    def flaky(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 2:
            raise exc
        return real(self, name, tensor)

    monkeypatch.setattr(ckpt.ShardWriter, "write_tensor", flaky)
    capsys.readouterr()
    code = convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == (130 if isinstance(exc, KeyboardInterrupt) else 2)
    assert len(err.splitlines()) == 1 and ("interrupted" in err or "No space left" in err), err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    assert snapshot(src) == before


def test_failed_force_keeps_previous_output(src, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--quiet"]) == 0
    previous = snapshot(out)
    monkeypatch.setattr(run_mod, "write_card", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error")))
    assert convert_main(["--groups", "1", str(src), "-o", str(out), "--force", "--quiet"]) == 2
    assert snapshot(out) == previous and not leftovers(tmp_path)


def test_unknown_dtype_and_bad_shard_size(src, tmp_path, capsys):
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "o"), "--max-shard-size", "lots"], "not a size")


def test_a_value_beyond_the_output_dtypes_range_is_refused_not_written_as_inf(src, tmp_path, capsys):
    """--dtype float16 of a weight above 65,504 would write inf (a bf16 source's range is fp32's): one line naming the
    tensor and its value, and no output."""
    from safetensors.torch import load_file, save_file

    weights = load_file(src / "model.safetensors")
    name = next(n for n in weights if n.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = 1e5
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    fails(capsys, ["--groups", "2", str(src), "-o", str(out), "--dtype", "float16"],
          f"{name} holds 1e+05, beyond float16's range", "use --dtype bfloat16")
    assert not out.exists() and not leftovers(tmp_path)
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--dtype", "bfloat16", "--quiet"]) == 0


@pytest.mark.parametrize("extra, needle", [
    (["--seed", "5"], "--seed seeds --method random, --method transfer and the model's own calibration samples; "
                      "--method mean draws nothing at random"),
    (["--method", "aligned", "--seed", "5"], "--method aligned draws nothing at random"),
    (["--to", "mla", "--kv-rank", "8", "--grouping", "contiguous", "--method", "fit"],
     "--grouping picks which heads merge, and the latent fit (--kv-rank) merges none"),
    (["--method", "aligned", "--grouping", "contiguous", "--groups", "1"],  # (the last --groups is the one read)
     "--grouping picks which of the 4 K/V heads share a group, and at --groups 1 one group holds them all"),
    (["--to", "mla", "--method", "transfer", "--grouping", "similarity", "--groups", "1"], "one group holds them all"),
])
def test_options_the_conversion_would_ignore_are_refused(src, tmp_path, capsys, extra, needle):
    groups = "1" if "mla" in extra else "2"
    fails(capsys, ["--groups", groups, str(src), "-o", str(tmp_path / "out"), *extra], needle)


def test_a_dry_run_refuses_the_output_the_run_would_refuse(src, tmp_path, capsys):
    """It printed 'would write' for an existing -o, the model folder, a folder inside it and a file under --force,
    all of which the run refuses (a review's finding); it checks the paths as the run does, writing nothing."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "afile").write_text("mine")
    for out, force, needle in ((tmp_path / "taken", False, "already exists"), (src, False, "choose an -o outside it"),
                               (src / "sub", False, "inside the model folder"),
                               (tmp_path / "afile", True, "is a file")):
        fails(capsys, ["--groups", "1", str(src), "-o", str(out), "--dry-run", *(["--force"] if force else [])],
              needle)
    assert (tmp_path / "afile").read_text() == "mine" and not (src / "sub").exists()
