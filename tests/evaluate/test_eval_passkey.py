"""`gqakit eval passkey`: seeded prompts, the exact-match scorer, fake models that always / never answer,
greedy decoding on a tiny model, the heatmap report and one-line errors."""
from __future__ import annotations

import re

import pytest
import torch

from eval_tiny import checkpoint, one_line_error, run_eval, tokenizer
from gqakit.common import report
from gqakit.common.errors import GqakitError
from gqakit.evaluate.passkey import (INTRO, NEEDLE, QUESTION, PasskeyConfig, accuracy, answer_digits, build_cases,
                                     greedy_generator, make_key, run_passkey, score)
from gqakit.evaluate.options import parse_depths, parse_lengths

LENGTHS, DEPTHS = [256, 400], [0.0, 0.5, 1.0]



@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return checkpoint(tmp_path_factory.mktemp("passkey") / "model", tok, max_positions=512)


def oracle(prompt: str) -> str:
    """A fake model that always finds the key."""
    return " " + re.search(r"The pass key is (\d{5})\. Remember", prompt).group(1) + ". The grass"


def test_cases_are_deterministic_in_the_seed(tok):
    a = build_cases(tok, LENGTHS, DEPTHS, trials=3, seed=11)
    b = build_cases(tok, LENGTHS, DEPTHS, trials=3, seed=11)
    c = build_cases(tok, LENGTHS, DEPTHS, trials=3, seed=12)
    assert a == b and [x.key for x in a] != [x.key for x in c]
    assert len(a) == 2 * 3 * 3 and all(re.fullmatch(r"[1-9]\d{4}", x.key) for x in a)
    assert len({x.key for x in a}) > 10  # keys vary across cells and trials
    assert make_key(11, 256, 0.5, 1) == make_key(11, 256, 0.5, 1) == a[4].key


def test_prompt_length_and_depth(tok):
    for case in build_cases(tok, LENGTHS, DEPTHS, trials=1, seed=0):
        assert case.length - 12 <= case.prompt_tokens <= case.length  # the longest fit, whole sentences
        assert case.prompt_tokens == len(tok(case.prompt).input_ids)
        assert case.prompt.endswith(QUESTION) and case.prompt.count(case.key) == 2
        needle = NEEDLE.format(key=case.key)
        at = case.prompt.index(needle)
        before = case.prompt[len(INTRO):at].count(". ")  # filler sentences before / after the key
        after = case.prompt[at + len(needle):-len(QUESTION)].count(". ")
        assert before == round(case.depth * (before + after)) and before + after > 3


def test_exact_scorer():
    assert answer_digits(" 12345.") == "12345"
    assert answer_digits(" is 12345 and 678") == "12345"
    assert answer_digits(" 1 2 3 4 5") == "1"
    assert answer_digits(" the grass") is None
    cases = build_cases(tokenizer(), [256], [0.5], trials=1, seed=3)
    key = cases[0].key
    for reply, correct in [(f" {key}.", True), (f" {key[:4]}", False), (f" {key}6", False), (f"{key}", True),
                           (" none", False)]:
        assert score(cases, lambda p, r=reply: r)[0]["correct"] is correct


def test_fake_models_score_100_and_0_percent(tok):
    cases = build_cases(tok, LENGTHS, DEPTHS, trials=2, seed=5)
    assert set(accuracy(score(cases, oracle)).values()) == {1.0}
    assert set(accuracy(score(cases, lambda prompt: " 00000")).values()) == {0.0}


def test_report_with_a_fake_model(model_dir, tmp_path):
    cfg = PasskeyConfig(model=str(model_dir), lengths=tuple(LENGTHS), depths=tuple(DEPTHS), trials=2, seed=1,
                        output=str(tmp_path / "r"), progress=False)
    record = run_passkey(cfg, command="test", generate=oracle)
    assert record["overall_accuracy"] == 1.0 and len(record["cells"]) == 6
    saved = report.read_report(tmp_path / "r")
    assert saved["config"]["lengths"] == LENGTHS and saved["command"] == "test"
    assert (tmp_path / "r" / "passkey_heatmap.png").stat().st_size > 1000
    assert (tmp_path / "r" / "results.csv").read_text().splitlines()[0].startswith("length,depth,accuracy")


def test_greedy_generation_is_deterministic(model_dir, tok):
    from gqakit.hf.loading import load_model

    model, tok = load_model(str(model_dir))
    cases = build_cases(tok, [256], [0.0, 1.0], trials=2, seed=2)
    generate = greedy_generator(model, tok, new_tokens=6)
    first = [generate(c.prompt) for c in cases]
    assert first == [generate(c.prompt) for c in cases]
    ids = tok(cases[0].prompt, return_tensors="pt").input_ids
    with torch.no_grad():  # the cached loop equals re-running the whole prefix each step
        for _ in range(6):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    want_ids = ids[0, -6:].tolist()
    want = tok.decode(want_ids[:want_ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in want_ids else want_ids,
                      skip_special_tokens=True)
    assert first[0] == want


def test_cli_runs_the_model(model_dir, tmp_path):
    out_dir = tmp_path / "cli"
    argv = ["passkey", model_dir, "--lengths", "256", "--depths", "0,1", "--trials", 2, "--seed", 4,
            "--new-tokens", 4, "--attention", "sliding", "--window", 64, "-o", out_dir, "-q"]
    code, out, err = run_eval(*argv)
    assert code == 0, err
    assert out.splitlines()[0] == "| depth | 256 |" and "| mean |" in out
    record = report.read_report(out_dir)["results"]
    assert record["attention_options"]["window"] == 64 and len(record["cases"]) == 4
    code, out, err = run_eval(*argv)
    assert one_line_error(code, err, "already exists")


def test_parsers():
    assert parse_lengths("1k, 2k,4096") == [1024, 2048, 4096]
    with pytest.raises(GqakitError, match="lists 1024 twice; give each once"):  # deduplicated without a word before
        parse_lengths("1k,2k,1024")
    assert parse_lengths("0.5k") == [512]
    assert parse_depths("0,0.25,1") == [0.0, 0.25, 1.0]


@pytest.mark.parametrize("argv,needle", [
    (["--lengths", "abc"], "cannot read 'abc'"),
    (["--lengths", "32"], "too short for the passkey prompt"),
    (["--depths", "0,1.5"], "give fractions in [0, 1]"),
    (["--trials", 0], "--trials must be >= 1"),
    (["--attention", "sinks", "--sinks", -1], "sinks=-1 must be >= 0"),
])
def test_bad_input_is_one_line(model_dir, tmp_path, argv, needle):
    code, out, err = run_eval("passkey", model_dir, *argv, "-q", "-o", tmp_path / "never")
    assert one_line_error(code, err, needle), err
    assert not (tmp_path / "never").exists()


def test_past_the_context_of_learned_positions_is_refused(tok, tmp_path):
    """A GPT-2's positions end at its context: a prompt that runs past it crashed in its position table (an
    IndexError, after the warning meant for RoPE models); it is refused in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=300,
                               **ids)).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    code, out, err = run_eval("passkey", tmp_path / "gpt2", "--lengths", "256,400", "--new-tokens", 8, "-q", "-o",
                              tmp_path / "never")
    assert one_line_error(code, err, "--lengths 400 + --new-tokens 8 positions run past the 300-token context of "
                                     "GPT2LMHeadModel"), err
    assert "use lengths up to 293" in err and not (tmp_path / "never").exists()
