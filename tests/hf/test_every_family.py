"""Issue 21, item 6, per family: one tiny model of each family gqakit converts onto a class other than Llama's
(every re-host, gqakit's own classes, and the natively grouped families added with them) goes through what a user
does with it. `convert-gqa --dry-run` names the target class (and the mapping), the model card records it,
`gqakit eval ppl` scores the converted model, and one `gqakit uptrain` step under `sharding: fsdp` (one process:
FSDP2 wraps each of its blocks) trains it and writes a checkpoint of the same class.

Exactness is tested elsewhere (tests/hf/test_rehost.py, test_architectures.py, test_t5.py); here each family only
has to run end to end, so the models are tiny and the runs a few windows long.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from families import load_exact
from gqakit.cli import convert_main, main
from gqakit.hf.compat import transformers_before
from uptrain_tiny import make_family_model, make_t5_model, make_text, write_recipe

# source -> (target class at G = 2, the re-hosted family the plan and card name, or None for a native family)
FAMILIES = {
    "neox": ("PhiForCausalLM", "GPT-NeoX"),  # parallel residual
    "neox-seq": ("NemotronForCausalLM", "GPT-NeoX"),
    "gptj": ("PhiForCausalLM", "GPT-J"),
    "gpt2": ("GroupedGPTBigCodeForCausalLM", "GPT-2"),  # 1 < G < H: gqakit's own class
    "falcon": ("FalconForCausalLM", None),  # new_decoder_architecture
    "starcoder2": ("Starcoder2ForCausalLM", None),
    "granite": ("GraniteForCausalLM", None),
    "phi": ("PhiForCausalLM", None),
    "t5": ("GroupedT5ForConditionalGeneration", "T5"),
}
GROUPS = 2


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return make_text(tmp_path_factory.mktemp("text") / "text.txt", chars=6_000)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, source folder, converted folder) of a tiny model with a tokenizer."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    source = make_t5_model(root / "mha", kv_heads=None) if name == "t5" else make_family_model(name, root / "mha")
    out = root / f"gqa{GROUPS}"
    assert convert_main([str(source), "--groups", str(GROUPS), "-o", str(out), "--quiet"]) == 0
    return name, source, out


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = json.loads((path / "config.json").read_text()).get("is_encoder_decoder")
    return load_exact(path, AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM)


def test_dry_run_and_card_name_the_target(family, capsys):
    name, source, out = family
    target, rehosted = FAMILIES[name]
    capsys.readouterr()
    assert convert_main([str(source), "--groups", str(GROUPS), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert target in plan and f"| architecture | {target}" in card, (plan, card[:1200])
    if rehosted:
        assert f"re-hosted: {rehosted} (" in plan and f"re-hosted: {rehosted} (" in card, (plan, card[:1200])
    model = _load(out)
    assert type(model).__name__ == target
    kv = next(getattr(model.config, key) for key in ("num_key_value_heads", "kv_heads", "num_kv_heads")
              if getattr(model.config, key, None) is not None)
    assert kv == GROUPS


def test_eval_ppl_scores_the_converted_model(family, text, tmp_path):
    name, _, out = family
    length = 64 if name == "t5" else 32
    assert main(["eval", "ppl", str(out), "--text", str(text), "--max-length", str(length), "--max-tokens", "256",
                 "-o", str(tmp_path / "report"), "-q"]) == 0
    row, = json.loads((tmp_path / "report" / "results.json").read_text())["results"]["rows"]
    assert row["kv_heads"] == GROUPS and row["scored_tokens"] > 0
    # the bytes transformers' own cache keeps per token: Falcon's held K/V expanded to every query head before 5.25
    # (tests/hf/test_architectures.py measures it)
    cached = row["heads"] if name == "falcon" and transformers_before("5.25") else GROUPS
    # of the window's `length` tokens a dense cache keeps all, but Starcoder2's layers (sliding_window 8) keep 7
    kept = 8 - 1 if name == "starcoder2" else length
    assert row["kv_bytes_per_token"] == 2 * row["layers"] * cached * row["head_dim"] * 4 * kept / length, row
    assert 1 < row["perplexity"] < math.inf


def test_one_fsdp_uptrain_step_wraps_and_trains_it(family, text, tmp_path):
    from gqakit.uptrain.fsdp import decoder_layers

    name, _, out = family
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model=str(out), data=[str(text)], steps=1, output_dir=str(run),
                          sharding="fsdp", seq_len=64 if name == "t5" else 32, eval_sequences=1, lr=1e-2)
    assert main(["uptrain", str(recipe), "--quiet"]) == 0
    before, trained = _load(out), _load(run)
    assert type(trained).__name__ == FAMILIES[name][0]
    blocks = 2 * 2 if name == "t5" else 2  # T5: each block of both stacks is a unit
    assert len(decoder_layers(trained)) == blocks
    old = before.state_dict()
    assert any(not torch.equal(t, old[n]) for n, t in trained.state_dict().items())  # the step trained it
