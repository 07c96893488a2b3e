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
    (["--method", "aligned", "--grouping", "contiguous", "--groups", "1"],
     "--grouping picks which of the 4 K/V heads share a group, and at --groups 1 one group holds them all"),
    (["--to", "mla", "--method", "transfer", "--grouping", "similarity", "--groups", "1"], "one group holds them all"),
])
def test_options_the_conversion_would_ignore_are_refused(src, tmp_path, capsys, extra, needle):
    groups = [] if "--groups" in extra else ["--groups", "1" if "mla" in extra else "2"]  # once: twice is refused
    fails(capsys, [*groups, str(src), "-o", str(tmp_path / "out"), *extra], needle)


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


def test_a_model_type_of_another_family_than_the_architecture_is_refused(src, tmp_path, capsys):
    """architectures [LlamaForCausalLM] beside model_type stablelm: gqakit planned Llama's tensors while
    transformers builds StableLM from model_type, and a StableLM's per-head key norms were copied unmerged (a review:
    0.81 off in the logits). Refused in one line; a model_type no supported family has (exaone) still converts."""
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "stablelm"}))
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "o")], "model_type \"stablelm\"",
          "StableLmForCausalLM's", "correct the one that is wrong")
    fails(capsys, ["--groups", "2", str(src), "--dry-run"], "model_type \"stablelm\"")
    assert not (tmp_path / "o").exists()
    (src / "config.json").write_text(json.dumps({**config, "model_type": "exaone"}))
    assert convert_main(["--groups", "2", str(src), "--dry-run", "-q"]) == 0


def test_every_family_names_the_model_type_of_its_config_class():
    """The table's model types are transformers' own: AutoModelForCausalLM builds the family's class from it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from gqakit.hf.architectures import FAMILIES

    for spec in FAMILIES:
        if spec.grouped_class is None or spec.multi_query_key:  # gqakit's own classes register themselves
            assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[spec.config_model_type] == spec.architectures[0], spec.family


def test_a_folder_with_both_a_single_file_and_a_sharded_index_reads_the_single_file(src, tmp_path):
    """gqakit read the index's shards while transformers loads model.safetensors: convert and FSDP uptraining read
    one copy of the weights, eval and DDP the other (a review: perplexity 4,150 against 12,184). gqakit now looks as
    transformers does, the single file first: the output is the single file's conversion, whatever the shards hold."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "alone"), "-q"]) == 0
    save_file({k: v * 3 for k, v in tensors.items()}, str(src / "model-00001-of-00001.safetensors"),
              metadata={"format": "pt"})
    (src / headers.INDEX).write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in tensors}}))
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "both"), "-q"]) == 0
    assert (tmp_path / "both" / "model.safetensors").read_bytes() == (tmp_path / "alone" / "model.safetensors"
                                                                       ).read_bytes()


def test_a_model_given_as_dot_gets_the_default_output_beside_it(src, tmp_path, capsys, monkeypatch):
    """`cd model && convert-gqa --groups 2 .` ended in a traceback (Path('.') has no name to suffix)."""
    monkeypatch.chdir(src)
    assert convert_main(["--groups", "2", ".", "-q"]) == 0
    assert (src.parent / f"{src.name}-gqa2" / "config.json").is_file()
    assert f"# {src.name} converted to GQA-2" in (src.parent / f"{src.name}-gqa2" / "README.md").read_text()


@pytest.mark.parametrize("case", ["quantization_config", "int8 k_proj"])
def test_quantized_weights_are_refused(src, tmp_path, capsys, case):
    """An FP8 k_proj with its per-row weight_scale was averaged as codes (the scale left as it was) and an I8 one
    truncated (a review). Each is refused in one line, nothing written."""
    from safetensors.torch import load_file, save_file
    import torch

    config = json.loads((src / "config.json").read_text())
    if case == "quantization_config":
        config["quantization_config"] = {"quant_method": "fbgemm_fp8"}
    else:
        weights = load_file(src / "model.safetensors")
        name = "model.layers.1.self_attn.k_proj.weight"
        weights[name] = weights[name].mul(100).round().to(torch.int8)
        save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(config))
    needle = {"quantization_config": "holds a quantization_config (fbgemm_fp8)",
              "int8 k_proj": "'model.layers.1.self_attn.k_proj.weight' is stored as I8"}[case]
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "o")], needle)
    assert not (tmp_path / "o").exists()


def test_an_uptraining_runs_records_are_not_carried_into_a_conversion(src, tmp_path):
    """Converting an uptrain run folder copied uptraining.json, uptrain-recipe.json, metrics.csv and loss.png,
    which describe the run, not the converted model (and made the output look like a run folder)."""
    from gqakit.hf.folder import RUN_RECORDS
    from gqakit.uptrain.run.folder import RUN_ENTRIES

    # the records among a run folder's entries (the others: its lock, checkpoints, tensorboard, the final's temp)
    assert set(RUN_RECORDS) == set(RUN_ENTRIES) - {"uptrain.lock", "checkpoints", "tensorboard", ".final.tmp"}
    for name in RUN_RECORDS:
        (src / name).write_text("{}")
    (src / "notes.txt").write_text("kept")
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "o"), "-q"]) == 0
    assert not any((tmp_path / "o" / name).exists() for name in RUN_RECORDS)
    assert (tmp_path / "o" / "notes.txt").read_text() == "kept"


def test_weights_saved_from_the_base_class_are_named_as_such(src, tmp_path, capsys):
    """A LlamaModel checkpoint (no 'model.' prefix) was refused as "the weights hold 0 layers; fix
    num_hidden_layers", which sent the user to the wrong file."""
    from safetensors.torch import load_file, save_file

    weights = load_file(src / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head")},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    fails(capsys, ["--groups", "2", str(src), "--dry-run"], "without the 'model.' prefix", "base model class")


def test_the_sources_licence_is_kept_in_the_card(src, tmp_path):
    """The new card's front matter carries the source card's license / license_name / license_link (the
    converted weights are under the source's terms); the rest of the source card is not repeated."""
    import yaml

    (src / "README.md").write_text("---\nlicense: other\nlicense_name: llama2\nlicense_link: LICENSE\n"
                                   "datasets: [x]\n---\n# Source model\n")
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "o"), "-q"]) == 0
    card = (tmp_path / "o" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "other" and meta["license_name"] == "llama2" and meta["license_link"] == "LICENSE"
    assert "gqakit" in meta["tags"] and "datasets" not in meta


@pytest.mark.parametrize("dropped", ["model.norm.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_a_checkpoint_missing_a_weight_the_class_needs_is_refused(tmp_path, capsys, dropped):
    """convert-gqa planned only what the checkpoint held: a missing final norm, MLP weight or untied head converted
    with exit 0, and transformers then loaded the output with that weight random (a review). The output's class is
    built on the meta device and every parameter must be written; a dry run (no torch) still plans it."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_llama(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    weights = load_file(src / "model.safetensors")
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"].clone())
    del weights[dropped]
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    fails(capsys, ["--groups", "2", str(src), "-o", str(tmp_path / "o")], f"lacks {dropped}", "left random")
    assert not (tmp_path / "o").exists()


def test_custom_code_is_not_carried_into_the_output(src, tmp_path, capsys):
    """A config whose auto_map names custom code converts as the stock class of its model_type (what transformers
    builds without trust_remote_code); the output kept auto_map and the copied .py, so trust_remote_code=True later
    ran that code on GQA weights (a review). auto_map and .py files are dropped now, and a line says so."""
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "modeling_custom.py").write_text("raise RuntimeError('never run')\n")
    capsys.readouterr()
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "o"), "-q"]) == 0
    assert "maps AutoModelForCausalLM to custom code (auto_map)" in capsys.readouterr().err
    assert "auto_map" not in json.loads((tmp_path / "o" / "config.json").read_text())
    assert not (tmp_path / "o" / "modeling_custom.py").exists()


def test_a_config_naming_an_attention_kernel_not_installed_converts(src, tmp_path):
    """The output's class is built on the meta device to check its weights; a config.json that names
    flash_attention_2 (not installed here) made that a traceback (a review). The weights do not depend on it."""
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "attn_implementation": "flash_attention_2"}))
    assert convert_main(["--groups", "2", str(src), "-o", str(tmp_path / "o"), "-q"]) == 0
