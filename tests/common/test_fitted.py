"""The record of the texts a model was fitted on (gqakit/common/fitted.py): convert-gqa and uptrain write it, a derived
checkpoint carries it over, and `gqakit eval ppl | stream` refuse to score one of those texts unless told to."""
from __future__ import annotations

import json
import shutil

import pytest

from cli_contract import run_cli, run_refused
from eval_tiny import checkpoint, text, tokenizer
from gqakit.common import fitted
from gqakit.common.errors import GqakitError
from gqakit.common.overlap import HEAD, MIN_SHARED
from uptrain_tiny import make_text


def _model_fitted_on(folder, *paths, role="calibration"):
    folder.mkdir(parents=True, exist_ok=True)
    fitted.add(folder, fitted.entries(paths, role))
    return folder


def test_the_record_matches_by_overlaps_rule_without_holding_the_text(tmp_path):
    """The same file, a copy, a file it begins or that begins it are one text; another slice, a file sharing fewer
    than MIN_SHARED bytes, a hub name are not. The record keeps digests and the path, never the text."""
    book = make_text(tmp_path / "book.txt", chars=30_000)
    model = _model_fitted_on(tmp_path / "m", book, "hf:wikitext")
    record = (model / fitted.FILE).read_text()
    assert book.read_text()[:40] not in record and len(fitted.read(model)) == 1  # the hub name leaves no entry
    shutil.copy(book, tmp_path / "copy.txt")
    make_text(tmp_path / "start.txt", chars=500)  # shorter than HEAD: compared over MIN_SHARED bytes
    make_text(tmp_path / "longer.txt", chars=60_000)  # begins like the book over HEAD bytes
    make_text(tmp_path / "other.txt", chars=12_000, start=100_000)
    (tmp_path / "few.txt").write_bytes(book.read_bytes()[:MIN_SHARED - 1] + b"!" * HEAD)
    (tmp_path / "folder").mkdir()
    shutil.copy(book, tmp_path / "folder" / "inside.txt")

    def hit(name):
        return bool(fitted.fitted_matches([model], [("--text", str(tmp_path / name))]))

    # shorter than HEAD, sharing a 300-byte header with the book and then other text: not one text (a review: it
    # was compared over its first MIN_SHARED bytes only)
    header = book.read_bytes()[:300]
    (tmp_path / "boilerplate.txt").write_bytes(header + make_text(tmp_path / "x.txt", 3000, start=60_000).read_bytes())
    assert not hit("boilerplate.txt")
    assert all(hit(n) for n in ("book.txt", "copy.txt", "start.txt", "longer.txt", "folder"))
    assert not any(hit(n) for n in ("other.txt", "few.txt", "missing.txt"))
    assert not fitted.fitted_matches([tmp_path / "no-record"], [("--text", str(book))])
    with pytest.raises(GqakitError, match="is the calibration text .* pass --allow-fitted-text"):
        fitted.refuse_fitted([model], [("--text", str(book))], False, "--allow-fitted-text")
    with pytest.raises(GqakitError, match="starts like the calibration text"):
        fitted.refuse_fitted([model], [("--text", str(tmp_path / "copy.txt"))], False, "--allow-fitted-text")
    assert fitted.refuse_fitted([model], [("--text", str(book))], True, "--allow-fitted-text")[0]["model"] == str(model)


def test_a_derived_record_keeps_its_sources_entries_once(tmp_path):
    book, other = make_text(tmp_path / "book.txt"), make_text(tmp_path / "other.txt", start=50_000)
    model = _model_fitted_on(tmp_path / "m", book)
    fitted.add(model, fitted.entries([book], "calibration"))  # the same entry again: kept once
    fitted.add(model, fitted.entries([other], "uptraining"))
    assert [(e["role"], e["path"]) for e in fitted.read(model)] == [("calibration", str(book)),
                                                                   ("uptraining", str(other))]
    for broken in ("[1, 2]", '{"fitted": [{"role": "calibration", "path": "x.txt"}]}'):  # the second: a traceback
        (model / fitted.FILE).write_text(broken)
        with pytest.raises(GqakitError, match="not a gqakit record of fitted texts; repair it or delete it"):
            fitted.read(model)


@pytest.mark.parametrize("command", ["ppl", "stream"])
def test_eval_refuses_the_text_a_model_was_fitted_on_unless_told(tmp_path, command):
    tok = tokenizer()
    model = checkpoint(tmp_path / "model", tok, max_positions=128)
    train = tmp_path / "train.txt"
    train.write_text(text(400, seed=2), encoding="utf-8")
    held = tmp_path / "held.txt"
    held.write_text(text(400, seed=3), encoding="utf-8")
    fitted.add(model, fitted.entries([train], "uptraining"))
    argv = ["--max-length", "64"] if command == "ppl" else ["--tokens", "64", "--policy", "dense"]
    run_refused([tmp_path], "gqakit", "eval", command, str(model), "--text", str(train), *argv, "-q",
                "-o", str(tmp_path / "r"), needles=("is the uptraining text", "pass --allow-fitted-text"))
    ok = run_cli("gqakit", "eval", command, str(model), "--text", str(held), *argv, "-q", "-o", str(tmp_path / "h"))
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "h" / "results.json").read_text())["results"]["fitted_text"] == []
    anyway = run_cli("gqakit", "eval", command, str(model), "--text", str(train), *argv, "-q", "--allow-fitted-text",
                     "-o", str(tmp_path / "a"))
    assert anyway.returncode == 0 and "its score is not held out" in anyway.stderr, anyway.stderr
    found = json.loads((tmp_path / "a" / "results.json").read_text())["results"]["fitted_text"]
    assert [(f["text"], f["fitted"]["role"]) for f in found] == [(str(train), "uptraining")]
