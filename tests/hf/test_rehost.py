"""Re-hosted families (GPT-NeoX / Pythia and GPT-J on Phi or Nemotron, GPT-2 and OPT on GPTBigCode), end to end,
against their own classes.

At G = H the re-hosted model must compute the source's logits (fp32, within 1e-5: the NeoX fold rounds). At
G < H it must equal a reference built in the SOURCE's own class: each K/V head of the source replaced by its
group's mean, written here from the source's own tensor layout (NeoX's per-head fused rows, GPT-J's and OPT's
separate k/v projections, GPT-2's Conv1D columns), not from gqakit's mapping code.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.cli import convert_main
from families import REHOST_SOURCES, load_exact, perturb_

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2
D = HIDDEN // HEADS
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))

SOURCES = REHOST_SOURCES
TARGETS = {"neox": "PhiForCausalLM", "neox-nobias": "PhiForCausalLM", "neox-seq": "NemotronForCausalLM",
           "gptj": "PhiForCausalLM",
           "gpt2": "GPTBigCodeForCausalLM", "opt": "GPTBigCodeForCausalLM"}
FAMILY = {"neox": "GPT-NeoX", "neox-nobias": "GPT-NeoX", "neox-seq": "GPT-NeoX", "gptj": "GPT-J", "gpt2": "GPT-2",
          "opt": "OPT"}
MQA_ONLY = {"gpt2", "opt"}  # stock GPTBigCode holds G = 1 or G = H; gqakit's grouped class the Gs between


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module", params=sorted(SOURCES))
def source(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(SOURCES[request.param](), attn_implementation="eager",
                                             dtype=torch.float32)
    perturb_(model)
    path = tmp_path_factory.mktemp(request.param) / "mha"
    model.save_pretrained(path)
    return request.param, path, model.eval()


def _mean_heads(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """(H, d, ...) head blocks -> each replaced by the mean of its contiguous group, as an explicit loop."""
    r = HEADS // groups
    out = rows.clone()
    for g in range(groups):
        members = [rows[h].double() for h in range(g * r, (g + 1) * r)]
        mean = (sum(members) / r).to(rows.dtype)
        for h in range(g * r, (g + 1) * r):
            out[h] = mean
    return out


def pooled_reference(name: str, model, groups: int):
    """The source class with every K/V head replaced by its group's mean, from the source's own layout."""
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    with torch.no_grad():
        for i in range(LAYERS):
            if name.startswith("neox"):
                for suffix in ("weight", "bias"):
                    key = f"gpt_neox.layers.{i}.attention.query_key_value.{suffix}"
                    if key not in state:
                        continue
                    t = state[key].view(HEADS, 3, D, *state[key].shape[1:])  # rows per head: q, k, v
                    for j in (1, 2):
                        t[:, j] = _mean_heads(t[:, j].clone(), groups)
            elif name == "gpt2":  # Conv1D c_attn: (in, out) with output columns [q | k | v]
                for suffix in ("weight", "bias"):
                    t = state[f"transformer.h.{i}.attn.c_attn.{suffix}"]
                    cols = t.T if suffix == "weight" else t[:, None]  # (3n, in)
                    for j in (1, 2):
                        block = cols[j * HIDDEN:(j + 1) * HIDDEN]
                        block.copy_(_mean_heads(block.reshape(HEADS, D, -1).clone(), groups).reshape(HIDDEN, -1))
            else:
                prefix = "model.decoder.layers" if name == "opt" else "transformer.h"
                attn = "self_attn" if name == "opt" else "attn"
                for role in ("k_proj", "v_proj"):
                    for suffix in ("weight", "bias"):
                        key = f"{prefix}.{i}.{attn}.{role}.{suffix}"
                        if key in state:
                            t = state[key]
                            t.copy_(_mean_heads(t.view(HEADS, D, *t.shape[1:]).clone(), groups).view(t.shape))
    return ref.eval()


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_rehosted_conversion(source, groups, tmp_path):
    name, path, model = source
    out = tmp_path / "out"
    assert convert_main([str(path), "--groups", str(groups), "-o", str(out), "--quiet"]) == 0
    converted = load_exact(out)
    own = name in MQA_ONLY and 1 < groups < HEADS  # gqakit's GroupedGPTBigCodeForCausalLM
    assert type(converted).__name__ == ("GroupedGPTBigCodeForCausalLM" if own else TARGETS[name])
    assert converted.config.num_key_value_heads == groups
    if name in MQA_ONLY:
        assert converted.config.multi_query == (groups == 1)
        for block in converted.transformer.h:
            assert block.attn.c_attn.weight.shape == (HIDDEN + 2 * groups * D, HIDDEN)
    else:
        for layer in converted.model.layers:
            assert layer.self_attn.k_proj.weight.shape == (groups * D, HIDDEN)
    got, want_mha = logits(converted), logits(model)
    if groups == HEADS:
        torch.testing.assert_close(got, want_mha, atol=1e-5, rtol=0)
        return
    want = logits(pooled_reference(name, model, groups))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - want_mha).abs().max() > 1e-3  # pooling changed the function: the comparison is not vacuous
    card = (out / "README.md").read_text()
    assert "re-hosted" in card and FAMILY[name] in card


def test_every_gptj_rotary_width_survives_phis_rounding(tmp_path):
    """Phi turns int(head_dim * partial_rotary_factor) dims; rotary_dim / head_dim rounds below rotary_dim for some
    pairs (30 of 44): the factor written must give it back for every even width, and a GPT-J of such a pair
    converts to the very same logits."""
    from gqakit.hf.architectures.rehost.gptj import rotary_fraction

    assert all(int(d * rotary_fraction(r, d)) == r for d in range(2, 513) for r in range(2, d + 1, 2))
    assert int(44 * (30 / 44)) == 29  # the rounding this guards against
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(SOURCES["gptj"](n_embd=88, n_head=2, n_layer=1, rotary_dim=30),
                                             attn_implementation="eager", dtype=torch.float32)
    perturb_(model)
    model.save_pretrained(tmp_path / "mha")
    assert convert_main([str(tmp_path / "mha"), "--groups", "2", "-o", str(tmp_path / "out"), "--quiet"]) == 0
    torch.testing.assert_close(logits(load_exact(tmp_path / "out")), logits(model.eval()), atol=1e-5, rtol=0)


def test_dry_run_names_the_mapping(source, capsys):
    name, path, _ = source
    capsys.readouterr()
    assert convert_main([str(path), "--groups", "1", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"{TARGETS[name]} (" in text
    assert f"re-hosted: {FAMILY[name]}" in text


def test_aligned_refuses_partial_rotary_of_the_target(source, capsys):
    """Phi rotates part of each head (GPT-J rotary_dim 4 of 8, NeoX rotary_pct 0.5): aligned must refuse, read off
    transformers 5's rope_parameters (a 1.0 factor is allowed to proceed past this check)."""
    name, path, _ = source
    if name == "neox-nobias" or name in MQA_ONLY:
        pytest.skip("full rotary" if name == "neox-nobias" else "fused c_attn: aligned refuses it for that")
    capsys.readouterr()
    assert convert_main([str(path), "--groups", "2", "--method", "aligned", "--dry-run", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "partial_rotary_factor" in err and "--method mean" in err, err


def test_weights_saved_from_the_base_class_convert(source, tmp_path):
    """The hub's gpt2 weights were saved from GPT2Model (`wte.weight`, `h.0...`: no `transformer.`), OPT's from
    OPTModel (`decoder.*`); neither has the tied head."""
    from safetensors.torch import load_file, save_file

    name, path, model = source
    if name not in MQA_ONLY:
        pytest.skip("GPT-2 and OPT")
    prefix = {"gpt2": "transformer.", "opt": "model."}[name]
    bare = tmp_path / "bare"
    bare.mkdir()
    weights = load_file(path / "model.safetensors")
    save_file({k.removeprefix(prefix): v for k, v in weights.items() if not k.startswith("lm_head")},
              bare / "model.safetensors", metadata={"format": "pt"})
    (bare / "config.json").write_text((path / "config.json").read_text())
    assert convert_main([str(bare), "--groups", "4", "-o", str(tmp_path / "out"), "--quiet"]) == 0
    torch.testing.assert_close(logits(load_exact(tmp_path / "out")), logits(model), atol=1e-5, rtol=0)


def test_a_stored_head_that_is_not_the_embeddings_copy_is_kept_untied(source, tmp_path, capsys):
    """tie_word_embeddings true beside a stored lm_head of other values: transformers 5 uses that head, untied, and
    gqakit once dropped it as "the tied copy" (a review: OPT at G = H 28.45 off in the logits), then refused it.
    GPTBigCode holds a head of its own when untied: written so, the logits are the source's (at G = H) or the
    pooled reference's. A copy of the embeddings stays tied (not written)."""
    from safetensors.torch import load_file, save_file

    name, path, model = source
    if name not in MQA_ONLY:
        pytest.skip("GPT-2 and OPT")
    weights = load_file(path / "model.safetensors")
    embedding = {"gpt2": "transformer.wte.weight", "opt": "model.decoder.embed_tokens.weight"}[name]
    for case, head in (("copy", weights[embedding].clone()), ("other", weights[embedding].flip(0).contiguous())):
        folder = tmp_path / case
        folder.mkdir()
        save_file({**weights, "lm_head.weight": head}, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text((path / "config.json").read_text())
        source_model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        assert torch.equal(source_model.lm_head.weight, head)  # what transformers uses: the stored head
        for groups in (HEADS, 2):
            out = tmp_path / f"out-{case}-{groups}"
            assert convert_main([str(folder), "--groups", str(groups), "-o", str(out), "--quiet"]) == 0
            written = load_file(out / "model.safetensors")
            config = json.loads((out / "config.json").read_text())
            assert config["tie_word_embeddings"] is (case == "copy")
            assert ("lm_head.weight" in written) is (case == "other")
            want = source_model if groups == HEADS else pooled_reference(name, source_model, groups)
            torch.testing.assert_close(logits(load_exact(out)), logits(want), atol=1e-5, rtol=0)


def test_an_untied_source_keeps_its_head(source, tmp_path, capsys):
    """GPT-2 / OPT saved with tie_word_embeddings false (refused before: "GPTBigCode ties its head"): the head is
    GPTBigCode's own lm_head, untied, at every G; without a stored head the source would load a random one, refused."""
    from safetensors.torch import load_file, save_file

    name, _, _ = source
    if name not in MQA_ONLY:
        pytest.skip("GPT-2 and OPT")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(SOURCES[name](tie_word_embeddings=False), attn_implementation="eager",
                                             dtype=torch.float32)
    perturb_(model)
    model.save_pretrained(tmp_path / "untied")
    model.eval()
    assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    for groups in (HEADS, 2, 1):
        out = tmp_path / f"out-{groups}"
        assert convert_main([str(tmp_path / "untied"), "--groups", str(groups), "-o", str(out), "--quiet"]) == 0
        converted = load_exact(out)
        assert converted.config.tie_word_embeddings is False
        torch.testing.assert_close(converted.lm_head.weight, model.lm_head.weight, atol=0, rtol=0)
        want = model if groups == HEADS else pooled_reference(name, model, groups)
        torch.testing.assert_close(logits(converted), logits(want), atol=1e-5, rtol=0)
    weights = load_file(tmp_path / "untied" / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "untied" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert convert_main([str(tmp_path / "untied"), "--groups", "2", "-o", str(tmp_path / "headless"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "tie_word_embeddings false stores no lm_head.weight" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "headless").exists()


def test_an_unknown_tensor_is_refused_not_dropped(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_config(SOURCES["gptj"]())
    model.save_pretrained(tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["transformer.h.0.attn.extra_gate.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert convert_main([str(tmp_path / "m"), "--groups", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "transformer.h.0.attn.extra_gate.weight" in err and "GPT-J" in err
    assert not (tmp_path / "m-gqa2").exists()


ENCODER = ["is an encoder", "no KV cache", "gqakit converts decoders and encoder-decoders"]


def _config_only(tmp_path, config: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config, needles", [
    ({"architectures": ["BartForConditionalGeneration"], "encoder_attention_heads": 16, "d_model": 1024},
     ["BartForConditionalGeneration", "encoder-decoder"]),
    ({"architectures": ["BloomForCausalLM"], "n_head": 8}, ["BloomForCausalLM", "ALiBi"]),
    ({"architectures": ["BertModel"], "num_attention_heads": 12}, ["BertModel", "encoder", "no KV cache"]),
    ({"architectures": ["FalconForCausalLM"], "alibi": True}, ["FalconForCausalLM", "ALiBi"]),
    ({"architectures": ["FalconForCausalLM"], "multi_query": True}, ["FalconForCausalLM", "already multi-query"]),
    ({"architectures": ["FalconForCausalLM"], "multi_query": False}, ["FalconForCausalLM", "new_decoder_architecture"]),
    # a second attention with K/V heads that the table does not name (a review: converted, then failed to load)
    ({"architectures": ["GPTBigCodeForCausalLM"], "add_cross_attention": True, "n_head": 4},
     ["GPTBigCodeForCausalLM with add_cross_attention true", "does not regroup"]),
    # the hub's MPT configs spell the class MPTForCausalLM; with and without model_type
    ({"architectures": ["MPTForCausalLM"], "model_type": "mpt", "d_model": 64}, ["MPTForCausalLM", "ALiBi"]),
    ({"architectures": ["MPTForCausalLM"], "n_heads": 8}, ["MPTForCausalLM", "ALiBi"]),
    # encoders of any head, by model_type, or by class name where the config has none
    *[({"architectures": [arch], **({"model_type": mt} if mt else {})}, [arch, *ENCODER])
      for arch, mt in (("XLMRobertaForMaskedLM", "xlm-roberta"), ("BertForSequenceClassification", "bert"),
                       ("BertForSequenceClassification", None), ("ModernBertForMaskedLM", "modernbert"),
                       ("ElectraForPreTraining", "electra"), ("AlbertForMaskedLM", None),
                       ("DebertaForTokenClassification", "deberta"), ("DebertaV2ForSequenceClassification", None),
                       ("RobertaForQuestionAnswering", "roberta"), ("DistilBertForQuestionAnswering", "distilbert"),
                       ("CamembertModel", "camembert"), ("T5EncoderModel", "t5"))],
    # encoder-decoders other than T5 / mT5
    *[({"architectures": [arch], **({"model_type": mt} if mt else {})}, [arch, "encoder-decoder", "T5, Flan-T5"])
      for arch, mt in (("MBartForConditionalGeneration", "mbart"), ("PegasusForConditionalGeneration", "pegasus"),
                       ("MarianMTModel", "marian"), ("UMT5ForConditionalGeneration", "umt5"),
                       ("LongT5ForConditionalGeneration", None), ("BartForConditionalGeneration", "bart"))],
    # no architectures: the model_type's family reason, never "add the model class"
    ({"model_type": "bert", "num_attention_heads": 12}, ["bert (config.json's model_type)", *ENCODER]),
    ({"model_type": "bloom", "n_head": 8}, ["bloom (config.json's model_type)", "ALiBi"]),
    ({"model_type": "bart", "d_model": 16}, ["bart (config.json's model_type)", "encoder-decoder"]),
    ({"model_type": "falcon", "alibi": True}, ["falcon (config.json's model_type)", "ALiBi"]),
])
def test_known_families_are_refused_by_name(tmp_path, capsys, config, needles):
    """A family gqakit does not convert is named with its reason, never told to 'add' a field it spells
    otherwise (GPT-2's n_head, T5's num_heads)."""
    folder = _config_only(tmp_path, config)
    capsys.readouterr()
    assert convert_main([str(folder), "--groups", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "add it" not in err and "num_attention_heads" not in err, err
    for needle in needles:
        assert needle in err, err
    assert "add the model class" not in err and "gqakit converts decoders;" not in err, err


@pytest.mark.parametrize("config, needle", [
    ({"architectures": ["ModernBertDecoderForCausalLM"], "model_type": "modernbert-decoder"}, "is not supported"),
    ({"model_type": "llama"}, "add the model class"),  # a family gqakit converts: name the class
])
def test_a_prefix_or_model_type_alone_refuses_no_other_family(tmp_path, capsys, config, needle):
    """ModernBERT's decoder is not ModernBERT the encoder; a config without architectures of a family gqakit does
    not refuse is asked for its class."""
    capsys.readouterr()
    assert convert_main([str(_config_only(tmp_path, config)), "--groups", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "encoder" not in err, err


def test_grouped_bigcode_loads_after_import_gqakit_and_caches_g_heads(source, tmp_path):
    """GPT-2 / OPT at 1 < G < H: gqakit's own class, found by transformers' Auto classes in a fresh process once
    `gqakit` is imported (before or after transformers), and its cache holds G heads (measured)."""
    import subprocess
    import sys

    name, path, _ = source
    if name not in MQA_ONLY:
        pytest.skip("stock target")
    out = tmp_path / "g2"
    assert convert_main([str(path), "--groups", "2", "-o", str(out), "--quiet"]) == 0
    assert "import gqakit" in (out / "README.md").read_text()
    probe = ("import torch; m = transformers.AutoModelForCausalLM.from_pretrained({p!r}); "
             "o = m(torch.tensor([[3, 4, 5]]), use_cache=True); "
             "c = o['cache'] if 'cache' in o else o['past_key_values']; "
             "print(type(m).__name__, c.layers[0].keys.shape[1])").format(p=str(out))
    for first in ("import gqakit, transformers", "import transformers, gqakit"):
        done = subprocess.run([sys.executable, "-c", f"{first}; {probe}"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["GroupedGPTBigCodeForCausalLM", "2"], done.stdout
    plain = subprocess.run([sys.executable, "-c", f"import transformers; {probe}"], capture_output=True, text=True)
    assert plain.returncode != 0 and "gqakit_gpt_bigcode" in plain.stderr  # without gqakit: unknown model_type


@pytest.mark.parametrize("name, overrides, needle", [
    ("opt", dict(do_layer_norm_before=False), "do_layer_norm_before"),
    ("opt", dict(word_embed_proj_dim=16), "word_embed_proj_dim"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
])
def test_variants_without_a_stock_target_are_refused(tmp_path, capsys, name, overrides, needle):
    model = AutoModelForCausalLM.from_config(SOURCES[name](**overrides))
    model.save_pretrained(tmp_path / "m")
    capsys.readouterr()
    assert convert_main([str(tmp_path / "m"), "--groups", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("sharding, trainable", [("ddp", "all"), ("fsdp", "attention")])
def test_rehosted_mqa_uptrains_and_evaluates(tmp_path, capsys, sharding, trainable):
    """A re-hosted GPT-2 converted to MQA is an ordinary GPTBigCode checkpoint: `gqakit uptrain` (DDP and FSDP,
    which wraps its blocks) trains it, and `gqakit eval ppl` scores the result (eager and tiled agree)."""
    from transformers import AutoTokenizer

    from gqakit.cli import main

    assets = Path(__file__).resolve().parents[2] / "gqakit" / "assets"
    tok = AutoTokenizer.from_pretrained(assets / "austen-mha-8h")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(SOURCES["gpt2"](vocab_size=len(tok), n_positions=128, bos_token_id=None,
                                                             eos_token_id=None))
    model.save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    assert convert_main([str(tmp_path / "gpt2"), "--groups", "1", "-o", str(tmp_path / "mqa"), "--quiet"]) == 0
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "uptrain_embedded.yaml"
    assert main(["uptrain", str(recipe), f"model={tmp_path / 'mqa'}", f"output_dir={tmp_path / 'up'}", "teacher=null",
                 "steps=1", "seq_len=32", "batch_size=2", "eval_sequences=1", f"sharding={sharding}",
                 f"trainable={trainable}",
                 f"data=[{assets / 'pride_and_prejudice.txt'}]", f"eval_data=[{assets / 'heldout_emma.txt'}]",
                 "--quiet"]) == 0
    trained = load_exact(tmp_path / "up")
    assert type(trained).__name__ == "GPTBigCodeForCausalLM" and trained.config.multi_query
    before = load_exact(tmp_path / "mqa").state_dict()
    changed = {n for n, t in trained.state_dict().items() if not torch.equal(t, before[n])}
    assert any(".attn.c_attn." in n for n in changed)  # the attention trained
    if trainable == "attention":  # ... and nothing else did (GPTBigCode's attention is `attn`, not `self_attn`)
        assert all(".attn." in n for n in changed), sorted(changed)
    scores = []
    for attention in ("default", "tiled"):
        capsys.readouterr()
        assert main(["eval", "ppl", str(tmp_path / "up"), "--text", str(assets / "heldout_emma.txt"), "--max-tokens",
                     "256", "--max-length", "64", "--attention", attention,
                     "--output", str(tmp_path / f"eval-{attention}")]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "perplexity" in x and ":" in x)
        scores.append(float(line.split("perplexity")[1].split()[0]))
    assert math.isfinite(scores[0]) and scores[0] == pytest.approx(scores[1], rel=1e-4)
