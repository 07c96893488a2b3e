"""The reference model's recipe without its corpora (no ../shared): one line, exit 2, nothing written."""
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reference_model.yaml"


def test_missing_corpora_are_one_line(tmp_path):
    out = tmp_path / "model"
    run = subprocess.run([sys.executable, "-m", "gqakit.reference.train", str(RECIPE), f"corpora_dir={tmp_path}",
                          f"output_dir={out}", f"heldout_output={tmp_path / 'heldout.txt'}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "corpus file" in lines[0] and "set corpora_dir=FOLDER" in lines[0], run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_t5_recipe_pretrains_an_encoder_decoder_by_span_corruption(tmp_path):
    """recipes/reference_t5.yaml at toy size on shipped text: a T5 folder that loads with its sentinel tokenizer
    and records its span-corruption held-out perplexity and budget."""
    import json
    import shutil

    from gqakit.reference import HELDOUT_TEXT

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    shutil.copy(Path(HELDOUT_TEXT).parent / "pride_and_prejudice.txt", corpora / "train.txt")
    shutil.copy(HELDOUT_TEXT, corpora / "heldout.txt")
    out = tmp_path / "t5"
    recipe = RECIPE.with_name("reference_t5.yaml")
    run = subprocess.run([sys.executable, "-m", "gqakit.reference.train", str(recipe), f"corpora_dir={corpora}",
                          "train_files=[train.txt]", "heldout_file=heldout.txt", "heldout_chars=4000",
                          f"output_dir={out}", f"heldout_output={tmp_path / 'heldout.txt'}", "vocab_size=300",
                          "sentinels=16", "hidden_size=32", "intermediate_size=64", "num_hidden_layers=1",
                          "num_decoder_layers=1", "num_attention_heads=4", "seq_len=64", "batch_size=2", "steps=3",
                          "warmup_steps=1", "eval_every=2", "threads=1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from gqakit.common.span_corruption import sentinel_ids

    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert type(model).__name__ == "T5ForConditionalGeneration" and model.config.num_heads == 4
    tok = AutoTokenizer.from_pretrained(out)
    assert len(sentinel_ids(tok)) == 16 and tok.pad_token_id == model.config.decoder_start_token_id == 0
    record = json.loads((out / "pretraining.json").read_text())
    assert record["pretraining_tokens"] == 3 * 2 * 64
    assert record["heldout"]["objective"] == "span_corruption" and record["heldout"]["perplexity"] > 1


def _tiny_llama_run(tmp_path, out, heldout):
    """The Llama recipe at toy size on shipped text (seconds)."""
    import shutil

    from gqakit.reference import HELDOUT_TEXT

    corpora = tmp_path / "corpora"
    corpora.mkdir(exist_ok=True)
    shutil.copy(Path(HELDOUT_TEXT).parent / "pride_and_prejudice.txt", corpora / "train.txt")
    shutil.copy(HELDOUT_TEXT, corpora / "heldout.txt")
    return subprocess.run([sys.executable, "-m", "gqakit.reference.train", str(RECIPE), f"corpora_dir={corpora}",
                           "train_files=[train.txt]", "heldout_file=heldout.txt", "heldout_chars=3000",
                           f"output_dir={out}", f"heldout_output={heldout}", "vocab_size=300", "hidden_size=32",
                           "intermediate_size=64", "num_hidden_layers=1", "num_attention_heads=4", "seq_len=64",
                           "batch_size=2", "steps=2", "warmup_steps=1", "eval_every=2", "threads=1"],
                          capture_output=True, text=True, timeout=300)


def test_a_rebuild_replaces_its_own_outputs_and_refuses_a_users_before_training(tmp_path):
    """The recipe's outputs are rebuilt in place (the script's own model folder, the same held-out text); a folder
    or a file of the user's named as output_dir / heldout_output is refused in one line before any training (it
    was replaced, a review), and left as it was."""
    out, held = tmp_path / "model", tmp_path / "heldout.txt"
    first = _tiny_llama_run(tmp_path, out, held)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _tiny_llama_run(tmp_path, out, held)  # its own folder and the very same held-out text
    assert again.returncode == 0, again.stderr[-2000:]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    run = _tiny_llama_run(tmp_path, mine, held)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "a folder gqakit did not write, so this script will not replace it" in run.stderr
    assert "tokenizer:" not in run.stdout
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    diary = tmp_path / "diary.txt"
    diary.write_text("dear diary")
    run = _tiny_llama_run(tmp_path, tmp_path / "model2", diary)
    assert run.returncode == 2 and "heldout_output" in run.stderr and "choose another" in run.stderr, run.stderr
    assert diary.read_text() == "dear diary" and not (tmp_path / "model2").exists()
