"""Data at scale: the token cache equals the in-memory stream, is never used corrupt, stale or from another
tokenizer, is read lazily window by window, and holds out whole documents."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gqakit.cli import main
from gqakit.common.errors import GqakitError
from gqakit.reference import HELDOUT_TEXT, reference_model_path
from gqakit.uptrain.data.batches import pack, prepare_data, read_documents, tokenize_stream
from gqakit.uptrain.data.sources import resolve_source, text_chunks
from gqakit.uptrain.data.token_build import build_cache, load_tokenizer, tokenize_to
from gqakit.uptrain.data.token_cache import DOCUMENTS, TOKENS, open_cache
from gqakit.uptrain.data.windows import Corpus, Windows, split_held_out
from uptrain_tiny import make_text, make_uptrain_model, write_recipe

EMMA = Path(HELDOUT_TEXT).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(reference_model_path()))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two .txt documents, JSON lines (with an empty and a null row, which are skipped, the null said) and a folder of
    two parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("tokens")
    a = make_text(root / "a.txt", chars=12_000)
    (root / "b.txt").write_text(EMMA[20_000:26_000], encoding="utf-8")
    rows = [EMMA[30_000 + 400 * i: 30_000 + 400 * i + 150 + 7 * i] for i in range(30)]
    with open(root / "docs.jsonl", "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"text": row, "id": i}) + "\n")
            if i == 3:
                f.write(json.dumps({"text": "  \n"}) + "\n" + json.dumps({"text": None}) + "\n")
    (root / "pq").mkdir()
    for part in range(2):
        texts = [EMMA[50_000 + 1000 * (5 * part + i): 50_000 + 1000 * (5 * part + i) + 300] for i in range(5)]
        pq.write_table(pa.table({"text": texts}), root / "pq" / f"part-{part}.parquet")
    return {"root": root, "a": a, "b": root / "b.txt", "jsonl": root / "docs.jsonl", "pq": root / "pq"}


def _entries(files) -> list[str]:
    return [str(files["a"]), str(files["jsonl"]), str(files["pq"]), str(files["b"])]


def stream_weights(cache) -> torch.Tensor:
    return torch.from_numpy(cache.read(0, cache.tokens).astype(np.int64))


def _boundaries(cache) -> np.ndarray:
    return np.fromfile(cache.path / DOCUMENTS, dtype="<i8")


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


# ---- the stream ------------------------------------------------------------------------------------

def test_text_chunks_cut_at_blank_lines_and_rejoin_to_the_file(files):
    text = files["a"].read_text(encoding="utf-8")
    chunks = list(text_chunks(files["a"], chunk_bytes=1000))
    assert "".join(chunks) == text and len(chunks) > 5
    for chunk in chunks[1:]:
        assert chunk.startswith("\n") and chunk[1:2].strip()  # "\nText": the last newline of a blank line
    assert all(1000 <= len(c.encode()) <= 4000 for c in chunks[:-1])


def test_line_ends_are_read_as_text_mode_reads_them_at_every_cut(files, tmp_path, monkeypatch):
    """\r\n and a lone \r become \n, as `read_text` (eval ppl, calibration, the in-memory reference) reads them, so
    training and evaluation see one text; also where a read ends between \r and \n (a CRLF file was tokenised with
    its \r: +6% tokens on one review's file)."""
    from gqakit.uptrain.data import sources

    monkeypatch.setattr(sources, "_RUN_SLACK", 1)  # reads of 4 x chunk_bytes + 1 bytes: every parity of cut
    text = files["a"].read_text(encoding="utf-8")[:6000]
    mixed = tmp_path / "crlf.txt"
    mixed.write_bytes(text.replace("\n", "\r\n").encode() + b"old Mac line\rend\r")
    for chunk_bytes in (5, 6, 64, 1000):
        assert "".join(text_chunks(mixed, chunk_bytes=chunk_bytes)) == mixed.read_text(encoding="utf-8")
    assert "\r" not in mixed.read_text(encoding="utf-8")


def test_a_line_longer_than_four_pieces_is_cut_at_a_space_not_in_a_word(files, tok, tmp_path):
    """A single 10 kB line with pieces of ~1 kB: cut before a space, so the ids equal the whole line's (cut at a
    byte count, words were split: 2,661 ids for 2,658, every later position shifted)."""
    line = tmp_path / "one-line.txt"
    line.write_text(" ".join(files["a"].read_text(encoding="utf-8").split())[:10_000] + "\n", encoding="utf-8")
    pieces = list(text_chunks(line, chunk_bytes=1000))
    assert len(pieces) > 2 and all(p.startswith(" ") for p in pieces[1:])
    assert [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]] == \
        tok(line.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]


def test_cache_equals_the_in_memory_stream_for_any_number_of_workers(files, tok, tmp_path):
    """Several files of every kind, a .txt cut into ~1 KB pieces, three datasets.map segments: one and
    two workers write the same stream as the in-memory reference, and documents.bin marks its EOSes."""
    entries = _entries(files)
    expected = tokenize_stream(read_documents(tuple(entries)), tok)
    sources = [resolve_source(e) for e in entries]
    streams = []
    for workers in (1, 2):
        header = build_cache(sources, tmp_path / f"c{workers}", tok, num_proc=workers, chunk_bytes=1000,
                             segment_bytes=15_000)
        cache = open_cache(tmp_path / f"c{workers}", verify=True)
        streams.append(stream_weights(cache))
        assert header["dtype"] == "<u2" and header["documents"] == len(read_documents(tuple(entries))) == 2 + 30 + 10
        assert [e["path"] for e in header["fitted"]] == [f["path"] for f in header["sources"]]  # digested when built
        bounds = _boundaries(cache)
        assert bounds[0] == 0 and bounds[-1] == cache.tokens
        assert np.all(cache.read(0, cache.tokens)[bounds[1:] - 1] == tok.eos_token_id)  # every document ends in EOS
        assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left behind
    assert torch.equal(streams[0], expected) and torch.equal(streams[1], expected)


def test_a_rows_folder_with_text_files_or_data_subfolders_is_refused(tmp_path):
    """A rows folder reads its own .jsonl/.json/.parquet files only: .txt files or data in subfolders beside them
    were left out without a word (a review: every .txt document of a mixed folder dropped)."""
    folder = tmp_path / "mixed"
    (folder / "more").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"text": "from a jsonl"}\n')
    (folder / "c.txt").write_text("from c txt\n")
    with pytest.raises(GqakitError, match=r"holds c\.txt beside its .*rows folder reads only its own row files"):
        resolve_source(str(folder))
    (folder / "c.txt").unlink()
    (folder / "more" / "d.jsonl").write_text('{"text": "from d"}\n')
    with pytest.raises(GqakitError, match=r"holds more/ beside"):
        resolve_source(str(folder))
    (folder / "more" / "d.jsonl").unlink()
    assert resolve_source(str(folder)).files == (folder / "a.jsonl",)  # an empty subfolder is nothing unread


def test_save_to_disk_folder_is_a_source(tok, tmp_path):
    import datasets

    docs = [EMMA[i * 500: i * 500 + 200] for i in range(12)]
    datasets.Dataset.from_dict({"body": docs, "n": list(range(12))}).save_to_disk(str(tmp_path / "saved"))
    build_cache([resolve_source(str(tmp_path / "saved"))], tmp_path / "c", tok, text_column="body")
    assert torch.equal(stream_weights(open_cache(tmp_path / "c")), tokenize_stream(docs, tok))
    with pytest.raises(GqakitError, match="has no column 'text'"):
        build_cache([resolve_source(str(tmp_path / "saved"))], tmp_path / "d", tok)
    assert not (tmp_path / "d").exists()


# ---- never a corrupt, stale or foreign cache -------------------------------------------------------

def _prepare(entries, tok, root, **kw):
    options = dict(seq_len=32, eval_fraction=0.0, eval_sequences=4, seed=0, cache_dir=str(root))
    return prepare_data(tuple(entries), (), tok, **{**options, **kw})


def _train_stream(data) -> torch.Tensor:
    return torch.from_numpy(data.train.read(0, data.train.tokens))


def test_a_corrupted_cache_is_rebuilt_never_used(files, tok, tmp_path, capsys):
    entries = [str(files["a"]), str(files["jsonl"])]
    expected = tokenize_stream(read_documents(tuple(entries)), tok)
    assert torch.equal(_train_stream(_prepare(entries, tok, tmp_path)), expected)
    assert "tokenised" in capsys.readouterr().err
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with open(folder / TOKENS, "r+b") as f:  # flip one byte
        f.seek(101)
        byte = f.read(1)
        f.seek(101)
        f.write(bytes([byte[0] ^ 0xFF]))
    data = _prepare(entries, tok, tmp_path)
    err = capsys.readouterr().err
    assert f"the token cache {folder} has a corrupted tokens.bin (it does not match its checksum); rebuilding it" in err
    assert torch.equal(_train_stream(data), expected)
    assert _prepare(entries, tok, tmp_path) and capsys.readouterr().err == ""  # valid now: reused silently


def test_a_stale_cache_is_rebuilt_never_used(tok, tmp_path, capsys):
    text = make_text(tmp_path / "t.txt", chars=3_000)
    _prepare([str(text)], tok, tmp_path / "root", seq_len=16)
    text.write_text(EMMA[5_000:8_000], encoding="utf-8")
    os.utime(text, ns=(1, 1))  # a new mtime even on a coarse clock
    data = _prepare([str(text)], tok, tmp_path / "root", seq_len=16)
    err = capsys.readouterr().err
    assert f"is stale ({text.resolve()} changed since it was tokenised); rebuilding it" in err
    assert torch.equal(_train_stream(data), tokenize_stream([EMMA[5_000:8_000]], tok))
    assert len([p for p in (tmp_path / "root").iterdir() if p.is_dir()]) == 1  # rebuilt in place, not beside
    (old,) = [p for p in (tmp_path / "root").iterdir() if p.is_dir()]
    text.unlink()  # the data is gone (its folder is here): the next build removes its cache
    _prepare([str(make_text(tmp_path / "u.txt", chars=3_000))], tok, tmp_path / "root", seq_len=16)
    err = capsys.readouterr().err
    assert f"removed the token cache {old} (" in err and "MiB): its data files are gone or changed" in err
    assert len([p for p in (tmp_path / "root").iterdir() if p.is_dir()]) == 1


def test_a_rewrite_that_keeps_size_and_mtime_is_stale(tok, tmp_path, capsys):
    """`cp -p`, `tar x` or an image with fixed timestamps can rewrite a file and keep its size and mtime: the cache
    then served the old text's tokens silently (a review); a hash of its first and last bytes now tells. The same
    bytes copied again (rsync -a staging, a new change time) are the same source: the cache serves them."""
    text = make_text(tmp_path / "t.txt", chars=3_000)
    _prepare([str(text)], tok, tmp_path / "root", seq_len=16)
    stat = text.stat()
    other = EMMA[5_000:5_000 + stat.st_size]  # the same size in bytes (Emma's text here is ASCII)
    assert len(other.encode("utf-8")) == stat.st_size
    text.write_text(other, encoding="utf-8")
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old mtime back, as cp -p leaves it
    assert (text.stat().st_size, text.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    data = _prepare([str(text)], tok, tmp_path / "root", seq_len=16)
    assert "is stale" in capsys.readouterr().err
    assert torch.equal(_train_stream(data), tokenize_stream([other], tok))
    stat = text.stat()
    text.write_bytes(text.read_bytes())  # the same bytes written again (a new ctime), with the old mtime back
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    data = _prepare([str(text)], tok, tmp_path / "root", seq_len=16)
    assert capsys.readouterr().err == "" and torch.equal(_train_stream(data), tokenize_stream([other], tok))


def test_caches_are_never_pruned_behind_the_users_back(tok, tmp_path, capsys):
    """A cache whose data folder is missing (an unmounted drive), whose data is unchanged, or that another process
    holds locked is kept; only a cache that nothing can use again goes, and is named."""
    from gqakit.uptrain.data.token_build import _locked, prune_orphans

    root = tmp_path / "root"
    drive = tmp_path / "drive"
    drive.mkdir()
    on_drive = make_text(drive / "d.txt", chars=3_000)
    _prepare([str(on_drive)], tok, root, seq_len=16)
    kept = make_text(tmp_path / "kept.txt", chars=3_000)
    _prepare([str(kept)], tok, root, seq_len=16)
    (tmp_path / "locked").mkdir()
    locked_text = make_text(tmp_path / "locked" / "l.txt", chars=3_000)
    _prepare([str(locked_text)], tok, root, seq_len=16)
    capsys.readouterr()
    caches = {p for p in root.iterdir() if p.is_dir()}
    assert len(caches) == 3
    shutil.move(str(drive), str(tmp_path / "unmounted"))  # the drive's folder is not there any more
    locked_text.unlink()  # its data is gone, but a run holds the cache
    (locked,) = [c for c in caches if str(locked_text.resolve()) in (c / "header.json").read_text()]
    with _locked(root / f"{locked.name}.lock"):
        assert prune_orphans(root, keep=root / "none") == []
    assert {p for p in root.iterdir() if p.is_dir()} == caches  # nothing went
    removed = prune_orphans(root, keep=root / "none")  # the lock is free now
    assert [folder for folder, _ in removed] == [locked] and removed[0][1] > 0
    assert {p for p in root.iterdir() if p.is_dir()} == caches - {locked}


def test_an_explicit_corrupted_cache_is_one_line_error(files, tok, tmp_path):
    tokenize_to([str(files["b"])], tmp_path / "tokens", str(reference_model_path()), progress=False)
    with open(tmp_path / "tokens" / TOKENS, "r+b") as f:
        f.seek(0)
        f.write(b"\x07\x07")
    with pytest.raises(GqakitError, match=r"tokens.bin does not match its checksum \(corrupted\); rebuild it with "
                                          r"gqakit tokenize .* --force"):
        _prepare([str(tmp_path / "tokens")], tok, tmp_path / "root")
    with open(tmp_path / "tokens" / TOKENS, "ab") as f:
        f.write(b"\x00")
    with pytest.raises(GqakitError, match="tokens.bin holds .* bytes but header.json promises"):
        _prepare([str(tmp_path / "tokens")], tok, tmp_path / "root")


def test_a_cache_from_another_tokenizer_is_refused_in_one_line(files, tmp_path, capsys):
    tokens = tmp_path / "tokens"
    tokenize_to([str(files["b"])], tokens, str(reference_model_path()), progress=False)
    model = make_uptrain_model(tmp_path / "model")
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}  # another tokenizer: same vocabulary, other ids for "Emma"
    (model / "tokenizer.json").write_text(json.dumps(spec))
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(tokens)], output_dir=str(tmp_path / "run"),
                          steps=1)
    capsys.readouterr()
    err = _one_line_error(capsys, ["uptrain", str(recipe)])
    assert f"{tokens} was tokenised by another tokenizer" in err
    assert f"re-run gqakit tokenize with --tokenizer {model}" in err


# ---- windows and the held-out split ----------------------------------------------------------------

def test_windows_read_from_disk_equal_pack(files, tok, tmp_path):
    """Windows over spans of two caches (so some windows straddle them) equal pack() of the joined stream."""
    for name, entry in (("a", files["a"]), ("j", files["jsonl"])):
        build_cache([resolve_source(str(entry))], tmp_path / name, tok)
    caches = [open_cache(tmp_path / n) for n in "aj"]
    corpus = Corpus(caches)
    stream = torch.cat([stream_weights(c) for c in caches])
    for seq_len in (7, 32):
        windows = Windows(corpus.spans(0, corpus.tokens), seq_len)
        packed = pack(stream, seq_len)
        assert len(windows) == len(packed)
        assert torch.equal(windows[list(range(len(windows)))], packed)
        picks = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seq_len))[:9].tolist()
        batch = windows[picks]
        assert batch.dtype == torch.long and batch.shape == (9, seq_len + 1)
        assert torch.equal(batch, packed[picks]) and torch.equal(windows[-1], packed[-1])
    inner = Windows(corpus.spans(100, caches[0].tokens + 50), 16)  # a range across the seam
    assert torch.equal(inner[list(range(len(inner)))], pack(stream[100:caches[0].tokens + 50], 16))


def test_held_out_windows_are_whole_documents_that_training_never_sees(files, tok, tmp_path):
    entries = [str(files["jsonl"]), str(files["pq"])]
    data = _prepare(entries, tok, tmp_path, seq_len=16, eval_fraction=0.1, eval_sequences=4, seed=3)
    assert data.describe()["held_out"] == "documents" and len(data.eval) == 4
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    cache = open_cache(folder)
    split = split_held_out(Corpus([cache]), 16, 0.1, 4, seed=3)
    bounds = _boundaries(cache).tolist()
    held_docs = [d for d in range(cache.documents)
                 if any(a <= bounds[d] and bounds[d + 1] <= b for a, b in split.held)]
    assert 0 < len(held_docs) == split.documents == data.describe()["held_out_documents"] < cache.documents // 2
    assert sum(b - a for a, b in split.held) == sum(bounds[d + 1] - bounds[d] for d in held_docs)  # whole documents
    stream = tokenize_stream(read_documents(tuple(entries)), tok)
    docs = [stream[bounds[d]:bounds[d + 1]] for d in range(cache.documents)]
    train_stream = torch.cat([doc for d, doc in enumerate(docs) if d not in held_docs])
    held_stream = torch.cat([docs[d] for d in held_docs])
    assert torch.equal(data.train[list(range(len(data.train)))], pack(train_stream, 16))
    assert torch.equal(data.eval, pack(held_stream, 16)[:4])
    assert data.train_tokens == len(train_stream)
    other = _prepare(entries, tok, tmp_path, seq_len=16, eval_fraction=0.1, eval_sequences=4, seed=4)
    assert not torch.equal(other.eval, data.eval)  # the selection follows the seed


def test_a_single_document_holds_out_a_tail_span(files, tok, tmp_path):
    data = _prepare([str(files["a"])], tok, tmp_path, seq_len=32, eval_fraction=0.02, eval_sequences=4)
    stream = tokenize_stream(read_documents((str(files["a"]),)), tok)
    k = min(4, round(0.02 * ((len(stream) - 1) // 32)))
    need = k * 32 + 1
    assert data.describe()["held_out"] == "tail" and len(data.eval) == k
    assert data.describe()["held_out_documents"] is None  # no whole documents were held out
    assert torch.equal(data.eval, pack(stream[-need:], 32))
    assert torch.equal(data.train[list(range(len(data.train)))], pack(stream[:-need], 32))


def test_only_the_main_process_builds_and_the_others_wait(files, tok, tmp_path, capsys):
    calls = []
    with pytest.raises(GqakitError, match="the main process did not prepare a usable token cache"):
        _prepare([str(files["b"])], tok, tmp_path, is_main=False, barrier=lambda: calls.append("other"))
    assert calls == ["other"] and not any(tmp_path.iterdir())  # a non-main rank never tokenises
    main_data = _prepare([str(files["b"])], tok, tmp_path, is_main=True, barrier=lambda: calls.append("main"))
    capsys.readouterr()
    other = _prepare([str(files["b"])], tok, tmp_path, is_main=False, barrier=lambda: calls.append("other"))
    assert calls == ["other", "main", "other"] and capsys.readouterr().err == ""
    assert torch.equal(other.train[[0, 3]], main_data.train[[0, 3]])


# ---- gqakit tokenize -------------------------------------------------------------------------------

def test_tokenize_cli_end_to_end_and_its_refusals(files, tok, tmp_path, capsys):
    out = tmp_path / "tokens"
    argv = ["tokenize", str(files["a"]), str(files["jsonl"]), "-o", str(out), "--tokenizer",
            str(reference_model_path()), "--num-proc", "2", "-q"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    expected = tokenize_stream(read_documents((str(files["a"]), str(files["jsonl"]))), tok)
    assert line.startswith(f"wrote {out}: {len(expected):,} tokens, 31 documents in ") and line.endswith(" s")
    assert torch.equal(stream_weights(open_cache(out, verify=True)), expected)
    assert "skipped 1 row with no 'text' (missing or null), the first row 6" in capsys.readouterr().err  # the null

    assert "already holds a token cache; pass --force to replace it" in _one_line_error(capsys, argv)
    assert main([*argv, "--force"]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    err = _one_line_error(capsys, [*argv[:4], str(mine), *argv[5:], "--force"])
    assert "is not a gqakit token cache" in err and (mine / "notes.txt").read_text() == "keep me"
    assert "does not exist" in _one_line_error(capsys, ["tokenize", str(tmp_path / "no.txt"), "-o", str(tmp_path / "x"),
                                                        "--tokenizer", str(reference_model_path())])
    assert not (tmp_path / "x").exists()
    err = _one_line_error(capsys, ["tokenize", str(files["a"]), "-o", str(tmp_path / "x"), "--text-column", "body",
                                   "--tokenizer", str(reference_model_path())])
    assert "--text-column body names a column of .jsonl / .json / .parquet data" in err  # .txt has no columns
    assert not (tmp_path / "x").exists()


def test_uptrain_trains_on_a_token_cache(files, tmp_path, capsys):
    from gqakit.common.recipes import load_recipe
    from gqakit.uptrain import UptrainConfig, uptrain

    tokens, held = tmp_path / "tokens", tmp_path / "held"
    tokenize_to([str(files["jsonl"]), str(files["pq"])], tokens, str(reference_model_path()), progress=False)
    tokenize_to([str(files["b"])], held, str(reference_model_path()), progress=False)
    model = make_uptrain_model(tmp_path / "model")
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(tokens), str(files["a"])],
                          eval_data=[str(held)], output_dir=str(tmp_path / "run"), steps=1, seq_len=16)
    record = uptrain(load_recipe(UptrainConfig, recipe))
    assert record["data"]["held_out"] == "eval_data" and record["data"]["eval_sequences"] == 4
    assert record["data"]["held_out_documents"] is None  # evaluation data of its own: nothing held out of training
    recipe = write_recipe(tmp_path / "r3.yaml", model=str(model), data=[str(tokens), str(files["a"])],
                          output_dir=str(tmp_path / "run3"), steps=1, seq_len=16, text_column="body")
    capsys.readouterr()  # a cache is tokenised already, a .txt file has no columns: text_column would be read nowhere
    err = _one_line_error(capsys, ["uptrain", str(recipe)])
    assert "text_column=body names a column of" in err and "the data are .txt files and token caches" in err
    assert not (tmp_path / "run3").exists()
    rows = tmp_path / "held.jsonl"  # a column that the held-out rows need, beside cached training data: accepted
    rows.write_text("".join(json.dumps({"body": f"held out row {i}"}) + "\n" for i in range(3)))
    from gqakit.uptrain.config import check

    check(load_recipe(UptrainConfig, write_recipe(tmp_path / "r5.yaml", model=str(model), data=[str(tokens)],
                                                   eval_data=[str(rows)], output_dir=str(tmp_path / "run5"), steps=1,
                                                   seq_len=16, text_column="body", eval_fraction=0.0)))
    for key, value in (("num_proc", 2), ("cache_dir", str(tmp_path / "elsewhere"))):  # caches only: nothing to tokenise
        recipe = write_recipe(tmp_path / "r4.yaml", model=str(model), data=[str(tokens)], eval_data=[str(held)],
                              output_dir=str(tmp_path / "run4"), steps=1, seq_len=16, **{key: value})
        capsys.readouterr()
        err = _one_line_error(capsys, ["uptrain", str(recipe)])
        assert f"{key}={value} is for tokenising raw data, and every data and eval_data entry is a token cache" in err
    assert not (tmp_path / "run4").exists() and not (tmp_path / "elsewhere").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    recipe = write_recipe(tmp_path / "r2.yaml", model=str(model), data=[str(empty)], output_dir=str(tmp_path / "run2"),
                          steps=1)
    capsys.readouterr()
    assert "holds no .jsonl/.json/.parquet file, no token cache" in _one_line_error(capsys, ["uptrain", str(recipe)])
    shutil.rmtree(empty)


def test_a_failed_first_tokenisation_leaves_no_lock_file_or_folder(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "no text column here"}\n')
    root = tmp_path / "caches" / "tokens"
    with pytest.raises(GqakitError, match="has no column 'text'"):
        _prepare([str(rows)], tok, root)
    assert not (tmp_path / "caches").exists()



def test_a_cache_made_before_the_sample_was_recorded_is_compared_on_what_it_recorded():
    from gqakit.uptrain.data.token_cache import same_file

    now = {"path": "/d/t.txt", "size": 10, "mtime_ns": 5, "sample": "ab"}
    assert same_file({"path": "/d/t.txt", "size": 10, "mtime_ns": 5}, now)  # an older header: no rebuild
    assert not same_file({**now, "sample": "cd"}, now) and not same_file({**now, "mtime_ns": 6}, now)
