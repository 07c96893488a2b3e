"""`gqakit eval ppl` on encoder-decoders: the perplexity of T5's span-corruption targets given the corrupted input,
checked against T5's own loss on the same corrupted windows; and the one-line refusals where an encoder-decoder
meets an option or command that only decoders have."""
from __future__ import annotations

import json
import math

import pytest
import torch

from gqakit.cli import main
from uptrain_tiny import make_t5_model, make_text, make_uptrain_model


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5eval")
    return {"gqa2": make_t5_model(root / "gqa2", kv_heads=2), "mha": make_t5_model(root / "mha", kv_heads=4, seed=1),
            "text": make_text(root / "text.txt", chars=6_000)}


def test_ppl_is_t5s_own_loss_on_the_corrupted_windows(t5, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from gqakit.common.span_corruption import corrupt, sentinel_ids

    out = tmp_path / "report"
    assert main(["eval", "ppl", str(t5["gqa2"]), str(t5["mha"]), "--text", str(t5["text"]), "--max-length", "64",
                 "-o", str(out), "-q"]) == 0
    rows = json.loads((out / "results.json").read_text())["results"]["rows"]
    tok = AutoTokenizer.from_pretrained(t5["gqa2"])
    ids = torch.tensor(tok(t5["text"].read_text()).input_ids)
    windows = ids[: ids.numel() // 64 * 64].view(-1, 64)
    import zlib
    for row, path in zip(rows, (t5["gqa2"], t5["mha"])):
        model = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
        total = count = 0
        with torch.no_grad():  # one window at a time, T5's own mean loss, its masks rebuilt from corrupt()
            for w in windows:
                seed = zlib.crc32(w.numpy().tobytes(), 0)
                inputs, targets = corrupt(w, sentinel_ids(tok), tok.eos_token_id, torch.Generator().manual_seed(seed))
                loss = model(input_ids=inputs[None], labels=targets[None]).loss.item()
                total, count = total + loss * targets.numel(), count + targets.numel()
        assert row["objective"] == "span_corruption" and row["scored_tokens"] == count
        assert row["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert [r["kv_heads"] for r in rows] == [2, 4]
    assert rows[0]["kv_bytes_per_token"] * 2 == rows[1]["kv_bytes_per_token"]  # the decoder cache, G / H


@pytest.mark.parametrize("argv, needle", [
    (["--stride", "32"], "drop --stride"),
    (["--bos"], "drop --bos"),
    (["--attention", "tiled"], "drop --attention"),
    (["--attention", "sliding", "--window", "8"], "drop --attention"),
])
def test_decoder_only_options_are_refused(t5, tmp_path, capsys, argv, needle):
    assert main(["eval", "ppl", str(t5["gqa2"]), "--text", str(t5["text"]), "--max-length", "64",
                 "-o", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "encoder-decoder" in err, err
    if argv[0] == "--attention":  # the reason (T5's additive position bias) and the alternative
        assert f"gqakit's {argv[1]} attention does not take" in err and "relative position bias" in err, err
        assert "use --attention default (T5's own sdpa or eager attention)" in err, err


def test_attention_default_is_t5s_own(t5, tmp_path):
    """--attention default, the alternative the refusal names, runs (and scores as no --attention does)."""
    runs = {}
    for name, extra in (("own", []), ("default", ["--attention", "default"])):
        out = tmp_path / name
        assert main(["eval", "ppl", str(t5["gqa2"]), "--text", str(t5["text"]), "--max-length", "64",
                     "--max-tokens", "200", "-o", str(out), "-q", *extra]) == 0
        runs[name] = json.loads((out / "results.json").read_text())["results"]["rows"][0]["perplexity"]
    assert runs["default"] == runs["own"] > 1


def test_mixing_decoders_and_encoder_decoders_is_refused(t5, tmp_path, capsys):
    llama = make_uptrain_model(tmp_path / "llama")
    capsys.readouterr()
    assert main(["eval", "ppl", str(llama), str(t5["gqa2"]), "--text", str(t5["text"]), "--max-length", "64",
                 "-o", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not comparable" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["eval", "stream", "--text", "TEXT", "--tokens", "64"],
                                     ["eval", "passkey", "--lengths", "64"], ["eval", "niah", "--lengths", "256"],
                                     ["generate", "--prompt", "Emma"]])
def test_decoder_commands_refuse_an_encoder_decoder(t5, tmp_path, capsys, command):
    argv = [a.replace("TEXT", str(t5["text"])) for a in command]
    argv = argv[:2] + [str(t5["gqa2"])] + argv[2:] if argv[0] == "eval" else argv[:1] + [str(t5["gqa2"])] + argv[1:]
    assert main([*argv, "-o", str(tmp_path / "r")] if argv[0] == "eval" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "encoder-decoder" in err and "gqakit eval ppl" in err, err


def test_targets_given_inputs_from_jsonl_rows(t5, tmp_path):
    """--target-column: each row's target scored given its input (both ending in EOS), against T5's own loss."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    rows = [{"text": "It is a truth universally acknowledged", "target": "that a single man must be in want"},
            {"text": "Emma Woodhouse, handsome, clever,", "target": "and rich"},
            {"text": "", "target": "an empty input row is skipped"}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report"
    assert main(["eval", "ppl", str(t5["gqa2"]), "--dataset", str(data), "--target-column", "target",
                 "--max-length", "64", "-o", str(out), "-q"]) == 0
    row = json.loads((out / "results.json").read_text())["results"]["rows"][0]
    model = AutoModelForSeq2SeqLM.from_pretrained(t5["gqa2"]).eval()
    tok = AutoTokenizer.from_pretrained(t5["gqa2"])
    total = count = 0
    with torch.no_grad():
        for r in rows[:2]:
            inputs = torch.tensor([tok(r["text"]).input_ids + [tok.eos_token_id]])
            targets = torch.tensor([tok(r["target"]).input_ids + [tok.eos_token_id]])
            total += model(input_ids=inputs, labels=targets).loss.item() * targets.numel()
            count += targets.numel()
    assert row["objective"] == "targets_given_inputs" and row["scored_tokens"] == count
    assert row["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


@pytest.mark.parametrize("argv, needle", [
    (["--text", "TEXT", "--target-column", "target"], "pass --dataset"),
    (["--dataset", "DATA", "--target-column", "target", "--max-tokens", "10"], "drop --max-tokens"),
    (["--dataset", "DATA", "--target-column", "target", "--text", "TEXT"], "--text would be read nowhere; drop --text"),
    (["--dataset", "DATA", "--target-column", "answer"], "no column 'answer'"),
    (["--dataset", "DATA", "--target-column", "target", "--max-length", "4"], "raise --max-length"),
])
def test_pair_options_are_refused_in_one_line(t5, tmp_path, capsys, argv, needle):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"text": "a question of some length", "target": "an answer"}) + "\n")
    argv = [a.replace("TEXT", str(t5["text"])).replace("DATA", str(data)) for a in argv]
    assert main(["eval", "ppl", str(t5["gqa2"]), *argv, "-o", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "r").exists()


def test_a_decoder_with_target_column_is_refused(tmp_path, capsys):
    llama = make_uptrain_model(tmp_path / "llama")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"text": "a question", "target": "an answer"}) + "\n")
    capsys.readouterr()
    assert main(["eval", "ppl", str(llama), "--dataset", str(data), "--target-column", "target",
                 "-o", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --target-column" in err, err
