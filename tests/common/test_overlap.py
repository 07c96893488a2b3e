"""Held-out text that is also training or calibration text (gqakit/common/overlap.py): the same file, a copy, a
prefix or a truncation are one text; other parts of a book, other books, hub names are not."""
from __future__ import annotations

import shutil

import pytest

from cli_contract import run_refused
from gqakit.common.errors import GqakitError
from gqakit.common.overlap import shared_text
from gqakit.common.recipes import load_recipe
from gqakit.uptrain.config import UptrainConfig, check
from gqakit.uptrain.data.token_cache import refuse_repeated_texts
from uptrain_tiny import make_text, make_uptrain_model, write_recipe


def test_copies_prefixes_and_the_same_file_are_one_text_other_slices_are_not(tmp_path):
    book = make_text(tmp_path / "book.txt", chars=30_000)
    start = make_text(tmp_path / "start.txt", chars=500)  # a short prefix: shorter than the bytes compared
    other = make_text(tmp_path / "other.txt", chars=12_000, start=100_000)
    copy = tmp_path / "folder" / "copy.txt"
    copy.parent.mkdir()
    shutil.copy(book, copy)
    (tmp_path / "empty.txt").write_text("")
    assert shared_text(book, book) == (book, book)
    assert shared_text(start, book) == (start, book) and shared_text(book, start) == (book, start)
    assert shared_text(tmp_path / "folder", book) == (copy, book)  # a folder: each of its files
    assert shared_text(other, book) is None and shared_text(tmp_path / "empty.txt", book) is None
    assert shared_text("hf:wikitext", book) is None and shared_text(tmp_path / "missing.txt", book) is None


def test_datasets_of_one_schema_are_not_one_text(tmp_path):
    """Two save_to_disk datasets (a train / test split) share a byte-identical dataset_info.json, and two rows
    folders a README: only data files are compared (a review found the split refused)."""
    import datasets

    split = datasets.Dataset.from_dict({"text": [f"document {i} about apples and rivers" * 20 for i in range(60)]}
                                       ).train_test_split(test_size=10, seed=0)
    split["train"].save_to_disk(str(tmp_path / "train"))
    split["test"].save_to_disk(str(tmp_path / "test"))
    assert (tmp_path / "train" / "dataset_info.json").read_bytes() == (tmp_path / "test" / "dataset_info.json"
                                                                          ).read_bytes()
    assert shared_text(tmp_path / "test", tmp_path / "train") is None
    split["train"].save_to_disk(str(tmp_path / "again"))
    assert shared_text(tmp_path / "again", tmp_path / "train") is not None  # the same rows saved twice
    for name, rows in (("a", range(0, 30)), ("b", range(30, 60))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "README.md").write_text("# my corpus\n" * 40)
        (tmp_path / name / "rows.jsonl").write_text("".join(f'{{"text": "row {i} " }}\n' * 20 for i in rows))
    assert shared_text(tmp_path / "a", tmp_path / "b") is None


def test_uptrain_refuses_eval_data_that_is_its_training_text(tmp_path):
    """A review's case: data and eval_data the same file ran and printed a "held-out perplexity" of text it trained
    on; a copy under another name too."""
    model = make_uptrain_model(tmp_path / "gqa")
    data = make_text(tmp_path / "train.txt")
    copy = tmp_path / "heldout.txt"
    shutil.copy(data, copy)
    for held in (data, copy):
        recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(data)], eval_data=[str(held)],
                              output_dir=str(tmp_path / "run"), steps=2)
        run_refused(tmp_path, "gqakit", "uptrain", str(recipe),
                    needles=(f"eval_data {held} and data {data} hold the same text",
                             "hold out a text that is not in data"))


def test_a_text_listed_twice_in_data_is_refused_where_data_is_held_out(tmp_path):
    """A review: data=[A, A] with no eval_data ran, and its held-out documents (data's last) were the second copy of a
    training text; `gqakit tokenize A A` built such a cache. Refused, for the same file or a copy; given eval_data
    of its own, a text listed twice is weighted twice (allowed)."""
    model = make_uptrain_model(tmp_path / "gqa")
    data = make_text(tmp_path / "train.txt")
    other = make_text(tmp_path / "other.txt", chars=12_000, start=100_000)
    copy = tmp_path / "copy.txt"
    shutil.copy(data, copy)
    for twice in (data, copy):
        recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(data), str(other), str(twice)],
                              output_dir=str(tmp_path / "run"), steps=2)
        run_refused(tmp_path, "gqakit", "uptrain", str(recipe),
                    needles=(f"data {data} and data {twice} hold the same text", "list each text once in data"))
        run_refused(tmp_path, "gqakit", "tokenize", str(data), str(twice), "-o", str(tmp_path / "cache"),
                    "--tokenizer", str(model), needles=("hold the same text", "list each text once"))
    # a token cache of another entry's text, two caches of one text, one hub name twice (a review of the diff)
    from gqakit.cli import main

    for name, source in (("cache-a", data), ("cache-b", copy)):
        assert main(["tokenize", str(source), "-o", str(tmp_path / name), "--tokenizer", str(model), "-q"]) == 0
    for entries in ((tmp_path / "cache-a", data), (tmp_path / "cache-a", tmp_path / "cache-b")):
        with pytest.raises(GqakitError, match="hold the same text \\(a token cache of the other's text"):
            check(load_recipe(UptrainConfig, str(write_recipe(
                tmp_path / "r.yaml", model=str(model), data=[str(e) for e in entries],
                output_dir=str(tmp_path / "run"), steps=2)), []))
    with pytest.raises(GqakitError, match="or one hub name twice"):
        refuse_repeated_texts(["hf:org/name", str(other), "hf:org/name"], "list each text once")
    held = make_text(tmp_path / "held.txt", chars=8_000, start=200_000)
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(data), str(data)], eval_data=[str(held)],
                          output_dir=str(tmp_path / "run"), steps=2)
    check(load_recipe(UptrainConfig, str(recipe), []))  # the checks a run makes first: passed
