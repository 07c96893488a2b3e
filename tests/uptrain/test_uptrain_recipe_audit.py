"""A recipe-key audit's findings (a review): a resume onto changed data, keys accepted and unused, a learned
position table past its end, and what the record and card say about the schedule and the clock."""
from __future__ import annotations

import json

import pytest

from gqakit.common.errors import GqakitError
from gqakit.common.recipes import load_recipe
from gqakit.uptrain import UptrainConfig, uptrain
from gqakit.uptrain.config import check
from uptrain_tiny import make_family_model, make_pairs, make_t5_model, make_text, make_uptrain_model, write_recipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    return {"model": make_uptrain_model(root / "gqa"), "root": root}


def _cfg(tmp_path, **fields) -> UptrainConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), **fields)
    return load_recipe(UptrainConfig, recipe)


def _stop(step, row, model):
    raise KeyboardInterrupt


@pytest.mark.parametrize("change", ["data", "eval_data"])
def test_a_resume_onto_changed_data_is_refused(tiny, tmp_path, capsys, change):
    """The data (or eval_data) files rewritten between the stop and the resume: the run went on with other
    sequences, and its card compared the perplexity before training (kept from the checkpoint, on the old held-out
    text) with the one after (on the new). Refused in one line; the unchanged data resumes."""
    data, held = make_text(tmp_path / "d.txt"), make_text(tmp_path / "e.txt", chars=4000, start=20_000)
    fields = dict(model=str(tiny["model"]), data=[str(data)], eval_data=[str(held)], steps=4, checkpoint_every=1,
                  eval_sequences=2)
    with pytest.raises(KeyboardInterrupt):
        uptrain(_cfg(tmp_path, **fields), on_step=_stop)
    changed = data if change == "data" else held
    original = changed.read_text()
    changed.write_text(original.upper())  # the same length in characters, other tokens
    with pytest.raises(GqakitError) as e:
        uptrain(_cfg(tmp_path, **fields))
    assert "is not what step-000001 was trained on" in str(e.value) and "restore the data" in str(e.value)
    assert "\n" not in str(e.value)
    changed.write_text(original)
    record = uptrain(_cfg(tmp_path, **fields))  # the data as it was: the run resumes and finishes
    assert record["budget"]["steps"] == 4 and record["train_seconds"] > 0


def test_the_fingerprint_reads_every_sequence_of_a_small_corpus_and_a_sample_of_a_large_one():
    import torch

    from gqakit.uptrain.data.batches import SAMPLED, PackedData

    train = torch.arange(3 * SAMPLED * 5).reshape(3 * SAMPLED, 5)
    base = PackedData(train, torch.zeros(2, 5, dtype=torch.long), train.numel()).fingerprint()
    small = PackedData(train[:10], torch.zeros(2, 5, dtype=torch.long), 50)
    for row in range(10):  # a change in any one sequence of a small corpus
        edited = train[:10].clone()
        edited[row, 2] += 1
        assert PackedData(edited, small.eval, 50).fingerprint() != small.fingerprint()
    edited = train.clone()
    edited[-1, 0] += 1  # the last sequence is always read
    assert PackedData(edited, torch.zeros(2, 5, dtype=torch.long), train.numel()).fingerprint() != base
    other_eval = torch.ones(2, 5, dtype=torch.long)
    assert PackedData(train, other_eval, train.numel()).fingerprint() != base


@pytest.mark.parametrize("key, value", [("num_proc", 2), ("cache_dir", "caches")])
def test_tokenising_keys_are_refused_with_pairs(tmp_path, key, value):
    """target_column pairs are read and tokenised in memory: num_proc and cache_dir were accepted and unused."""
    model = make_t5_model(tmp_path / "t5")
    pairs, _ = make_pairs(tmp_path / "pairs.jsonl", 40)
    value = str(tmp_path / value) if key == "cache_dir" else value
    with pytest.raises(GqakitError) as e:
        check(_cfg(tmp_path, model=str(model), data=[str(pairs)], target_column="target", steps=1, **{key: value}))
    assert f"{key}=" in str(e.value) and "read and tokenised in memory" in str(e.value)


def test_device_memory_is_refused_for_an_encoder_decoder(tmp_path):
    """The memory plan models decoder-only transformers: device_memory on a T5 was accepted and never checked."""
    from gqakit.uptrain.memory_plan import check_fits

    model = make_t5_model(tmp_path / "t5")
    text = make_text(tmp_path / "t.txt")
    with pytest.raises(GqakitError) as e:
        check_fits(_cfg(tmp_path, model=str(model), data=[str(text)], steps=1, device_memory="1KB"), 1)
    assert "device_memory=1KB asks for a memory check" in str(e.value) and "encoder-decoder" in str(e.value)
    assert check_fits(_cfg(tmp_path / "b", model=str(model), data=[str(text)], steps=1), 1) is None  # not asked


@pytest.mark.parametrize("attention", ["sliding", "sinks"])
def test_a_learned_position_table_bounds_seq_len_under_any_attention(tmp_path, attention):
    """A sliding or sink student may train past its context under RoPE, not past a learned table (GPT-2's 64
    positions here): an IndexError mid-run, and a run folder left behind, before."""
    model = make_family_model("gpt2", tmp_path / "g2")
    text = make_text(tmp_path / "t.txt")
    with pytest.raises(GqakitError) as e:
        check(_cfg(tmp_path, model=str(model), data=[str(text)], steps=1, seq_len=128, attention=attention,
                   window=16))
    assert "reads each position from a table that ends there" in str(e.value) and "lower seq_len to 64" in str(e.value)
    check(_cfg(tmp_path / "ok", model=str(model), data=[str(text)], steps=1, seq_len=64, attention=attention,
               window=16))


def test_a_warmup_that_takes_every_step_is_said_so(tiny, tmp_path, capsys):
    """warmup == steps leaves no step for the cosine decay: a warning, and the card no longer says "cosine"."""
    text = make_text(tmp_path / "t.txt")
    uptrain(_cfg(tmp_path, model=str(tiny["model"]), data=[str(text)], steps=2, warmup_steps=2, min_lr_ratio=0.5))
    assert "covers the whole run of 2, so no step decays towards min_lr_ratio=0.5" in capsys.readouterr().err
    card = (tmp_path / "run" / "README.md").read_text()
    assert "warmup 2 steps, no decay (the warmup takes every step)" in card and "cosine" not in card
    uptrain(_cfg(tmp_path / "b", model=str(tiny["model"]), data=[str(text)], steps=2, warmup_steps=1,
                 min_lr_ratio=0.5, save_dtype="float32"))
    card = (tmp_path / "b" / "run" / "README.md").read_text()
    assert "warmup 1 steps, cosine to 0.5 x lr" in card and "saved as they are" in card


def test_train_seconds_add_up_over_a_resume(tiny, tmp_path):
    """The record's train_seconds counted only the last launch of a resumed run."""
    text = make_text(tmp_path / "t.txt")
    fields = dict(model=str(tiny["model"]), data=[str(text)], steps=3, checkpoint_every=1)

    def slow_stop(step, row, model):
        import time

        time.sleep(0.6)
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        uptrain(_cfg(tmp_path, **fields), on_step=slow_stop)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "rank-00000.json").read_text())
    assert saved["train_seconds"] >= 1.2 - 0.6  # step 1's sleep at least (step 2's checkpoint comes before it)
    record = uptrain(_cfg(tmp_path, **fields))
    assert record["train_seconds"] >= saved["train_seconds"] - 0.05  # the record rounds to 0.1 s


def test_an_option_no_kind_takes_is_named_as_such():
    """YAML's `{stride:4}` (no space) is the key "stride:4": the refusal said it "only applies with
    attention=a gqakit kind"."""
    from gqakit.attention.kinds import attention_options

    with pytest.raises(GqakitError) as e:
        attention_options("default", {}, {"stride:4": None}, extra_name="attention_options")
    assert "is not an option of any gqakit attention kind" in str(e.value) and "window" in str(e.value)


def test_every_rank_seed_is_one_numpy_takes():
    """A resharded resume seeds each process from (seed, step, rank): past step 4,294 that passed 2**32 - 1, and
    accelerate's set_seed (numpy's seed) raised a traceback. Taken modulo 2**32 now; seeds themselves are bounded."""
    from accelerate.utils import set_seed

    from gqakit.common.options import SEED_MAX
    from gqakit.uptrain.loop import rank_seed

    assert rank_seed(7, 0, 1) == 8 and rank_seed(0, 3, 2) == 3_000_011  # unchanged where it fitted
    for seed, step, rank in ((0, 5_000, 3), (SEED_MAX, 1, 7), (SEED_MAX, 10**6, 63)):
        value = rank_seed(seed, step, rank)
        assert 0 <= value <= SEED_MAX
        set_seed(value)
    assert len({rank_seed(0, 5_000, r) for r in range(64)}) == 64


@pytest.mark.parametrize("argv", [["convert", "--groups", "1", "--method", "random", "--seed", "99999999999999999999"],
                                  ["sample", "--seed", "99999999999999999999"],
                                  ["eval", "ppl", "--seed", "99999999999999999999"]])
def test_a_seed_out_of_range_is_one_line(tiny, tmp_path, capsys, argv):
    """A seed past what the generators take ended in 'Overflow when unpacking long long' (the CLI audit)."""
    from gqakit.cli import main

    model = str(tiny["model"])
    text = str(make_text(tmp_path / "t.txt"))
    full = {"convert": [*argv, model, "-o", str(tmp_path / "o")],
            "sample": [argv[0], model, "-o", str(tmp_path / "s.jsonl"), *argv[1:]],
            "eval": [*argv[:2], model, "--text", text, *argv[2:], "-o", str(tmp_path / "r")]}[argv[0]]
    assert main(full) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "seed" in err and "4294967295" in err.replace(",", ""), err
    assert not any(p.name in ("o", "s.jsonl", "r") for p in tmp_path.iterdir())


def test_negative_seeds_still_seed_conversions(tiny, tmp_path, capsys):
    """Bounding seeds must not refuse what ran before (the diff review): convert-gqa --seed -3 seeds torch
    generators, which take negative seeds; uptrain, which seeds numpy, takes 0..2**32 - 1 only."""
    from gqakit.cli import main

    assert main(["convert", "--groups", "1", "--method", "random", "--seed", "-3", str(tiny["model"]), "-o",
                 str(tmp_path / "o"), "--quiet"]) == 0
    assert (tmp_path / "o" / "config.json").is_file()
