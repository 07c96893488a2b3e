"""`gqakit eval ppl`: strided perplexity against slow explicit loops, the BOS convention, the
comparison table, the text loaders, one-line errors, and reports that refuse to overwrite."""
from __future__ import annotations

import csv
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from eval_tiny import checkpoint, one_line_error, run_eval, text, tiny_llama, tokenizer
from gqakit.common.errors import GqakitError
from gqakit.common import report
from gqakit.common.text import encode_documents, load_columns, load_documents
from gqakit.evaluate.perplexity import perplexity, strided_nll

RTOL = 1e-5



@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, max_positions=64)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("ppl")
    (root / "text.txt").write_text(text(700, seed=3), encoding="utf-8")
    return {"root": root, "text": root / "text.txt", "a": checkpoint(root / "mha", tok, kv_heads=4),
            "b": checkpoint(root / "mqa", tok, kv_heads=1, seed=1)}


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def explicit_nll(model, x: torch.Tensor, max_length: int, stride: int, bos: int | None) -> tuple[float, int]:
    """Token by token: token j is scored once, given exactly [BOS] + x[c:j], where c is the start of the
    first window (starts 0, stride, 2 stride, ...; span = max_length - BOS) that reaches past j."""
    span = max_length - (bos is not None)
    total, count = 0.0, 0
    for j in range(x.numel()):
        c = next(k * stride for k in range(x.numel()) if k * stride + span > j)
        context = x[c:j] if bos is None else torch.cat([torch.tensor([bos]), x[c:j]])
        if context.numel() == 0:
            continue  # no BOS and no context: the convention leaves this token unscored
        logp = torch.log_softmax(model(input_ids=context[None]).logits[0, -1].double(), dim=-1)
        total -= float(logp[x[j]])
        count += 1
    return total, count


@pytest.mark.parametrize("max_length,stride", [(24, 8), (24, 11), (16, 16), (9, 1)])
@pytest.mark.parametrize("bos", [None, 1])
def test_strided_equals_explicit_loop(model, max_length, stride, bos):
    x = ids(70, seed=1)
    if bos is not None and stride > max_length - 1:
        stride = max_length - 1
    got, got_count = strided_nll(model, x, max_length, stride, progress=False, bos=bos)
    want, want_count = explicit_nll(model, x, max_length, stride, bos)
    assert got_count == want_count
    assert got == pytest.approx(want, rel=RTOL)
    if bos is not None:
        assert got_count == x.numel()  # with BOS every token is scored exactly once


def test_stride_equal_to_length_is_disjoint_windows(model):
    x = ids(101, seed=2)
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, 101, 25):  # disjoint windows, the last one short (101 = 4 x 25 + 1: a 1-token window)
            w = x[a:a + 25][None]
            if w.shape[1] > 1:
                total += model(input_ids=w, labels=w).loss.item() * (w.shape[1] - 1)
                count += w.shape[1] - 1
    got, got_count = strided_nll(model, x, 25, progress=False)
    assert got_count == count == 96 and got == pytest.approx(total, rel=RTOL)
    assert perplexity(model, x, 25, 25, progress=False) == pytest.approx(math.exp(total / count), rel=RTOL)


def test_several_models_give_one_table(files):
    out_dir = files["root"] / "report"
    code, out, err = run_eval("ppl", files["a"], files["b"], "--text", files["text"], "--max-length", 64,
                              "--stride", 32, "-o", out_dir, "-q")
    assert code == 0, err
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| model | K/V heads | KV-cache bytes/token (float32) | perplexity | scored tokens")
    assert [row.split(" | ")[1:3] for row in table[1:]] == [["4", "512"], ["1", "128"]]  # 2 x 2 layers x G x 8 x 4 B
    record = report.read_report(out_dir)
    assert record["kind"] == "ppl" and record["config"]["models"] == [str(files["a"]), str(files["b"])]
    assert set(record["versions"]) >= {"gqakit", "torch", "transformers"}
    assert record["results"]["max_length"] == 64 and record["results"]["stride"] == 32
    rows = list(csv.DictReader(open(out_dir / "results.csv")))
    assert [r["kv_heads"] for r in rows] == ["4", "1"]
    assert all(float(r["perplexity"]) > 1 and int(r["scored_tokens"]) == int(r["text_tokens"]) - 1 for r in rows)
    assert (out_dir / "ppl_vs_kv_bytes.png").stat().st_size > 1000


def test_attention_kind_and_bos(files):
    code, out, err = run_eval("ppl", files["a"], "--text", files["text"], "--max-length", 48, "--bos",
                              "--attention", "sliding", "--window", 16, "-o", files["root"] / "sliding", "-q")
    assert code == 0, err
    row = report.read_report(files["root"] / "sliding")["results"]["rows"][0]
    assert row["attention"] == "sliding" and row["attention_options"]["window"] == 16
    assert row["scored_tokens"] == row["text_tokens"]  # BOS: the first token is scored too


def test_reports_refuse_to_overwrite_without_force(files):
    out_dir = files["root"] / "twice"
    argv = ["ppl", files["b"], "--text", files["text"], "--max-tokens", 200, "-o", out_dir, "-q"]
    assert run_eval(*argv)[0] == 0
    stamp = (out_dir / "results.json").read_text()
    code, out, err = run_eval(*argv)
    assert one_line_error(code, err, "already exists; pass --force")
    assert (out_dir / "results.json").read_text() == stamp
    code, out, err = run_eval(*argv, "--force", "--stride", 50)
    assert code == 0, err
    assert report.read_report(out_dir)["results"]["stride"] == 50
    assert [p.name for p in out_dir.parent.iterdir() if p.name.startswith(".twice")] == []  # no leftovers


def test_report_is_atomic(tmp_path):
    def broken_plot(path):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        report.write_report(tmp_path / "r", kind="ppl", command="x", config={}, results={}, rows=[{"a": 1}],
                            plots={"p.png": broken_plot})
    assert list(tmp_path.iterdir()) == []  # neither the report nor its temporary folder
    assert report.default_output("ppl").parts[0] == "runs"


def test_default_report_names_never_collide(tmp_path, monkeypatch, capsys):
    """Evaluations launched together start in the same second: the default name gets -2, -3, ..., chosen at the
    start and again at the end if another run took it meanwhile; a name given with --output is still refused."""
    base = tmp_path / "runs" / "eval-ppl-20261128-001500"
    monkeypatch.setattr(report, "default_output", lambda kind, now=None: base)
    assert report.prepare_output(None, "ppl", False) == base
    base.mkdir(parents=True)
    assert report.prepare_output(None, "ppl", False) == base.with_name(base.name + "-2")
    base.with_name(base.name + "-2").mkdir()
    assert report.prepare_output(None, "ppl", False) == base.with_name(base.name + "-3")

    def write(target, default):
        return report.write_report(target, kind="ppl", command="x", config={}, results={"n": 1}, rows=[{"a": 1}],
                                   default=default)
    taken = base.with_name(base.name + "-3")
    taken.mkdir()  # another run published the name this one chose
    written = write(taken, default=True)
    assert written == base.with_name(base.name + "-4") and report.read_report(written)["results"] == {"n": 1}
    assert f"{taken} was written by another run meanwhile; this report goes to {written}" in capsys.readouterr().err
    assert list(taken.iterdir()) == []  # the other run's folder untouched
    with pytest.raises(GqakitError, match="already exists; pass"):
        write(taken, default=False)


def test_a_default_report_name_taken_while_writing_moves_on(tmp_path, capsys):
    """Another run may publish the name between the last check and the rename (while the plots are drawn); --force
    without -o never replaces another run's report; a dangling link holds its name."""
    base = tmp_path / "eval-ppl-20261128-001500"

    def other_run_publishes(path):
        if not base.exists():
            base.mkdir()
            (base / "results.json").write_text("theirs")
    written = report.write_report(base, kind="ppl", command="x", config={}, results={}, rows=[{"a": 1}],
                                  plots={"p.png": other_run_publishes}, default=True)
    assert written == base.with_name(base.name + "-2") and (base / "results.json").read_text() == "theirs"
    assert f"this report goes to {written}" in capsys.readouterr().err
    forced = report.write_report(base, kind="ppl", command="x", config={}, results={}, rows=[{"a": 1}],
                                 force=True, default=True)
    assert forced == base.with_name(base.name + "-3") and (base / "results.json").read_text() == "theirs"
    dangling = tmp_path / "eval-ppl-20261128-001501"
    dangling.symlink_to(tmp_path / "nowhere")
    assert report.write_report(dangling, kind="ppl", command="x", config={}, results={}, rows=[{"a": 1}],
                               default=True) == dangling.with_name(dangling.name + "-2")
    assert dangling.is_symlink() and not dangling.exists()


def test_dataset_rows_joined_with_eos(tmp_path, tok):
    rows = ["It is a truth.", "Emma walks to the village.", "  "]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": r, "n": i}) for i, r in enumerate(rows)))
    docs = load_documents(dataset=str(tmp_path / "d.jsonl"), text_column="body")
    assert docs == rows[:2]  # blank rows dropped
    want = tok(rows[0]).input_ids + [tok.eos_token_id] + tok(rows[1]).input_ids
    assert encode_documents(docs, tok).tolist() == want
    import datasets

    datasets.Dataset.from_dict({"text": rows[:2]}).to_parquet(str(tmp_path / "d.parquet"))
    assert load_documents(dataset=str(tmp_path / "d.parquet")) == rows[:2]


def test_a_row_without_text_is_said_or_refused(tmp_path, capsys):
    """A review: rows whose text column was missing, null or a number were dropped without a word, by eval, the
    calibration loader and uptrain's data (a --target-column pair went missing too). A missing or null value is
    skipped with one stderr line (count and first row); a value of another type is refused, naming the row (likely
    not the text column). Blank strings are still dropped (a corpus's blank lines)."""
    from gqakit.uptrain.data.sources import iter_pieces, resolve_source

    good = json.dumps({"text": "It is a truth.", "target": "Yes."})
    for bad, said in (({"other": 1}, "skipped 1 row with no 'text' (missing or null), the first row 2"),
                      ({"text": None}, "skipped 1 row with no 'text' (missing or null), the first row 2"),
                      ({"text": "Fine.", "target": None},
                       "skipped 1 row with no 'text' or 'target' (missing or null), the first row 2")):
        path = tmp_path / "rows.jsonl"
        path.write_text("\n".join([good, json.dumps(bad), good]) + "\n")
        columns = ("text", "target") if "target" in said else ("text",)
        capsys.readouterr()
        assert load_columns(str(path), columns) == [("It is a truth.", "Yes.")[:len(columns)]] * 2
        assert said in capsys.readouterr().err
        if "target" not in said:
            assert sum(len(texts) for texts, _ in iter_pieces(resolve_source(str(path)))) == 2
            assert said in capsys.readouterr().err
    # pairs: a row with neither value is one row skipped, not two (a review: the notes counted it per column)
    path.write_text("\n".join([good, json.dumps({}), json.dumps({"text": "a", "target": None}), good]) + "\n")
    capsys.readouterr()
    assert len(load_columns(str(path), ("text", "target"))) == 2
    assert "skipped 2 rows with no 'text' or 'target' (missing or null), the first row 2" in capsys.readouterr().err
    path.write_text("\n".join([good, json.dumps({"text": 12345}), good]) + "\n")
    for read in (lambda: load_columns(str(path), ("text",)), lambda: list(iter_pieces(resolve_source(str(path))))):
        with pytest.raises(GqakitError, match=re.escape("row 2 has the int '12345' in column 'text', not text")):
            read()


@pytest.mark.parametrize("make,needle", [
    (lambda d: ["--text", d / "missing.txt"], "does not exist"),
    (lambda d: ["--text", d / "empty.txt"], "is empty"),
    (lambda d: ["--text", d / "short.txt"], "shorter than one window"),
    (lambda d: ["--text", d / "text.txt", "--stride", 100, "--max-length", 64], "--stride 100 is longer than a window"),
    (lambda d: ["--text", d / "text.txt", "--stride", 64, "--max-length", 64, "--bos"], "minus the BOS column"),
    (lambda d: ["--dataset", d / "table.csv"], "unknown data format"),
    (lambda d: ["--dataset", d / "rows.jsonl"], "has no column 'text'"),
    (lambda d: ["--dataset", d / "rows.jsonl", "--text-column", "body", "--text", d / "text.txt"], "exactly one of"),
    (lambda d: ["--text", d / "rows.jsonl"], "pass it with --dataset"),
    (lambda d: ["--text", d / "text.txt", "--text-column", "body"], "--text-column names a column of a --dataset"),
    (lambda d: ["--text", d / "text.txt", "--window", 8], "--window only applies with --attention sliding or sinks"),
    (lambda d: ["--text", d / "text.txt", "--attention", "sliding", "--window", 0], "window=0 must be a positive"),
    (lambda d: ["--text", d / "text.txt", "--max-length", 1], "too short"),
    (lambda d: ["--text", d / "text.txt", "--max-length", 256], "--max-length 256 exceeds a model's 128-token context"),
])
def test_bad_input_is_one_line(files, make, needle):
    d = files["root"]
    (d / "empty.txt").write_text("  \n")
    (d / "short.txt").write_text("Emma walks.")
    (d / "table.csv").write_text("text\nhello\n")
    (d / "rows.jsonl").write_text(json.dumps({"body": "It is a truth."}) + "\n")
    code, out, err = run_eval("ppl", files["a"], *make(d), "-o", d / "never", "-q")
    assert one_line_error(code, err, needle), err
    assert not (d / "never").exists()


def test_missing_model_is_one_line(files, tmp_path):
    code, out, err = run_eval("ppl", tmp_path / "nope", "--text", files["text"], "-q")
    assert one_line_error(code, err, "does not exist")


def test_library_errors_name_the_fix(model):
    with pytest.raises(ValueError, match="stride 9 must be in 1..8"):
        strided_nll(model, ids(20), 9, 9, progress=False, bos=1)
    assert issubclass(GqakitError, Exception)


def test_a_context_known_only_after_loading_is_checked_then(files, monkeypatch):
    """A hub name's config is read only when it loads: --max-length past its context is refused then, in one line,
    as a local folder's is before (a review found it went unchecked)."""
    import gqakit.evaluate.perplexity as perplexity

    monkeypatch.setattr(perplexity, "_context", lambda path: (None, None))  # what a hub name gives before loading
    d = files["root"]
    code, out, err = run_eval("ppl", files["a"], "--text", d / "text.txt", "--max-length", 256, "-o", d / "never",
                              "-q")
    assert one_line_error(code, err, "--max-length 256 exceeds a model's 128-token context"), err
    assert not (d / "never").exists()


def test_a_tokenizer_that_numbers_tokens_otherwise_is_refused(tmp_path):
    """A review: --tokenizer naming another tokenizer of the same vocabulary size (the embedded T5's) scored the
    embedded model at 33,699 against 145.6 without a word. Refused when the model folder holds its own tokenizer;
    a copy of its own tokenizer elsewhere is fine."""
    from cli_contract import run_cli, run_refused

    assets = Path(__file__).resolve().parents[2] / "gqakit" / "assets"
    model, text = assets / "austen-mha-8h", assets / "heldout_emma.txt"
    args = ("gqakit", "eval", "ppl", str(model), "--text", str(text), "--max-tokens", "256", "--max-length", "128")
    run_refused(tmp_path, *args, "--tokenizer", str(assets / "austen-t5-8h"), "-o", str(tmp_path / "r"),
                needles=("gives 4,096 of 4,096 tokens other ids than", "drop --tokenizer"))
    copy = tmp_path / "tok"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((model / name).read_bytes())
    done = run_cli(*args, "--tokenizer", str(copy), "-o", str(tmp_path / "ok"))
    assert done.returncode == 0, done.stderr
    broken = tmp_path / "broken"  # its own tokenizer does not load: --tokenizer is the way to read it (a review)
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}')
    done = run_cli("gqakit", "eval", "ppl", str(broken), *args[4:], "--tokenizer", str(model), "-o",
                   str(tmp_path / "ok2"))
    assert done.returncode == 0, done.stderr


def test_every_model_and_the_text_are_checked_before_any_scoring(tmp_path):
    """A review: `eval ppl GOOD s/missing` scored GOOD for a minute, then said s/missing did not exist (a path with a
    slash was taken for a hub name until loaded); a file given as MODEL and a folder given as --text were said not to
    exist. The demo wrote its report into the model folder, and generate's message named options it refuses."""
    from cli_contract import run_refused

    assets = Path(__file__).resolve().parents[2] / "gqakit" / "assets"
    model, text = assets / "austen-mha-8h", assets / "heldout_emma.txt"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("mine")
    for second, needle in (("sub/missing", "model folder sub/missing does not exist"),
                           ("sub/notes.txt", "sub/notes.txt is a file, not a model folder")):
        line = run_refused(tmp_path, "gqakit", "eval", "ppl", str(model), second, "--text", str(text), "-o",
                           str(tmp_path / "r"), cwd=tmp_path, needles=(needle,))
        assert "perplexity" not in line
    run_refused(tmp_path, "gqakit", "eval", "ppl", str(model), "--text", str(assets), "-o", str(tmp_path / "r"),
                needles=(f"{assets} is a folder; pass a UTF-8 .txt file with --text",))
    run_refused(tmp_path, "gqakit", "demo", "-o", str(model / "report"), "--eval-tokens", "64",
                needles=("overlaps the model",))
    run_refused(tmp_path, "gqakit", "sample", str(model), "-o", str(model / "x.jsonl"), "--tokens", "64",
                needles=("is inside the model folder",))
    run_refused(tmp_path, "gqakit", "tokenize", str(text), "-o", str(model / "tok"), "--tokenizer", str(model),
                needles=("overlaps the tokenizer folder",))
    run_refused(tmp_path, "gqakit", "generate", str(model), "--prompt", "It is", "--attention", "default",
                "--attention-option", "block_k=4",
                needles=("--attention default is the model's own attention and takes no options",))
