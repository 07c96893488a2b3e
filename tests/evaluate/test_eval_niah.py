"""`gqakit eval niah`: the RULER-style generators (seeded, exact token lengths, needles at the asked depth, one
answer, a consistent variable chain), the scorers, a fake model that always answers, the report of two models side
by side, the console script on the embedded model and one-line refusals."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_contract import run_cli, run_refused
from eval_tiny import checkpoint, one_line_error, run_eval
from gqakit.common import report
from gqakit.evaluate.generation import count_tokens
from gqakit.evaluate.needles import (NEEDLE, NIAH_INTRO, NIAH_QUESTION, TASKS, VT_INTRO, all_names_correct, haystack,
                                     niah_multikey, niah_single, number_correct, vt)
from gqakit.evaluate.niah import run_niah
from gqakit.evaluate.options import NiahConfig

EMBEDDED = Path(__file__).resolve().parents[2] / "gqakit" / "assets" / "austen-mha-8h"
HAYSTACKS = ("filler", "text")
_ASSIGN = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EMBEDDED)


def chain(prompt: str) -> tuple[str, list[str]]:
    """(the value, the names holding it, in assignment order) by following the prompt's VAR statements."""
    value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
    holding: list[str] = []
    for name, source, number in _ASSIGN.findall(prompt):
        if number == value or source in holding:
            holding.append(name)
    return value, holding


def oracle(prompt: str, new_tokens: int) -> str:
    """A fake model that always answers right."""
    if "Find all variables" in prompt:
        return " " + ", ".join(chain(prompt)[1]) + "."
    key = re.search(r"magic number for (\S+) mentioned", prompt).group(1)
    return " " + re.search(rf"magic numbers for {re.escape(key)} is: (\d+)\.", prompt).group(1) + ". The grass"


@pytest.mark.parametrize("task", list(TASKS))
def test_generators_are_deterministic_in_the_seed(tok, task):
    make = TASKS[task].generate
    for hay in (haystack(h) for h in HAYSTACKS):
        a, b, c = (make(tok, 300, 0.5, seed, hay) for seed in (7, 7, 8))
        assert a == b and a.prompt != c.prompt and a.answer != c.answer
        assert make(tok, 500, 0.0, 7, hay).answer == a.answer  # the needles depend on the seed only


@pytest.mark.parametrize("hay", HAYSTACKS)
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_lengths_are_exact(tok, task, hay):
    for length in (256, 700):
        for depth in (0.0, 1.0):
            sample = TASKS[task].generate(tok, length, depth, 3, haystack(hay))
            assert sample.tokens == count_tokens(tok, sample.prompt)
            assert length - 12 <= sample.tokens <= length  # whole units: short by less than one


@pytest.mark.parametrize("hay", HAYSTACKS)
def test_the_needle_is_at_the_asked_depth(tok, hay):
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        sample = niah_single(tok, 1024, depth, 1, haystack(hay))
        needle = sample.needles[0]
        question = NIAH_QUESTION.format(key=re.search(r"for (\S+) is:", needle).group(1))
        at = sample.prompt.index(needle)
        before = count_tokens(tok, sample.prompt[len(NIAH_INTRO):at])
        after = count_tokens(tok, sample.prompt[at + len(needle):-len(question)])
        assert abs(before / (before + after) - depth) < 0.03, (depth, before, after)
    prompt = vt(tok, 1024, 0.4, 1, haystack(hay)).prompt  # vt: the chain starts at the depth
    body = prompt[len(VT_INTRO):prompt.index("\nQuestion:")]
    before = count_tokens(tok, body[:body.index("VAR ")])
    assert abs(before / count_tokens(tok, _ASSIGN.sub("", body)) - 0.4) < 0.03


@pytest.mark.parametrize("hay", HAYSTACKS)
def test_the_answer_is_in_the_prompt_once(tok, hay):
    for seed in range(4):
        single = niah_single(tok, 512, 0.5, seed, haystack(hay))
        assert len(single.answer) == 1 and re.fullmatch(r"\d{7}", single.answer[0])
        assert single.prompt.count(single.answer[0]) == 1
        multi = niah_multikey(tok, 512, 0.5, seed, haystack(hay))
        found = re.findall(r"magic numbers for (\S+) is: (\d+)\.", multi.prompt)
        asked = re.search(r"magic number for (\S+) mentioned", multi.prompt).group(1)
        assert len(found) == 4 and len({k for k, _ in found}) == 4 and len({v for _, v in found}) == 4
        assert dict(found)[asked] == multi.answer[0] and multi.prompt.count(multi.answer[0]) == 1
        assert NEEDLE.format(key=asked, value=multi.answer[0]) in multi.prompt


@pytest.mark.parametrize("hay", HAYSTACKS)
def test_the_variable_chain_is_consistent(tok, hay):
    for seed in range(4):
        sample = vt(tok, 512, 0.3 * seed, seed, haystack(hay))
        statements = _ASSIGN.findall(sample.prompt)
        assert len(statements) == 5 and len({name for name, _, _ in statements}) == 5  # each assigned once
        assigned = set()
        for name, source, number in statements:  # each hop reads a variable already assigned
            assert (source in assigned) if source else number
            assigned.add(name)
        value, holding = chain(sample.prompt)
        assert tuple(holding) == sample.answer and sample.prompt.count(f"= {value}.") == 1
        assert f"5 variables are assigned the value {value}" in sample.prompt


def test_scorers():
    assert number_correct(" 1234567.", ("1234567",)) and number_correct("1234567 and 42", ("1234567",))
    for wrong in (" 123456", " 12345678", " 1 2 3 4 5 6 7", " none", " 42 then 1234567"):
        assert not number_correct(wrong, ("1234567",))
    names = ("ABCDE", "FGHIJ", "KLMNO")
    assert all_names_correct(" KLMNO, ABCDE, FGHIJ and QRSTU.", names)
    assert not all_names_correct(" ABCDE, FGHIJ.", names)
    assert not all_names_correct(" ABCDEX FGHIJ KLMNO", names)  # whole words only


def test_two_models_side_by_side_with_a_fake_model(tok, tmp_path):
    tiny = checkpoint(tmp_path / "tiny", tok, max_positions=512)
    cfg = NiahConfig(models=(str(EMBEDDED), str(tiny)), lengths=(256,), depths=(0.0, 1.0), samples=2,
                     haystacks=HAYSTACKS, output=str(tmp_path / "r"), progress=False)
    record = run_niah(cfg, command="test", generate=oracle)
    assert [m["overall_accuracy"] for m in record["models"]] == [1.0, 1.0]
    assert len(record["cells"]) == 2 * 3 * 2 * 2 and len(record["cases"]) == 2 * 3 * 2 * 2 * 2
    saved = report.read_report(tmp_path / "r")
    assert saved["kind"] == "niah" and saved["config"]["tasks"] == list(TASKS)
    assert (tmp_path / "r" / "results.csv").read_text().splitlines()[0].startswith("model,task,haystack,length")
    assert (tmp_path / "r" / "vt_text_model2.png").stat().st_size > 1000


def test_the_console_script_runs_the_embedded_model(tmp_path):
    out_dir = tmp_path / "cli"
    done = run_cli("gqakit", "eval", "niah", str(EMBEDDED), "--lengths", "256", "--samples", "2", "--depths", "0.5",
                   "-o", str(out_dir), "-q")
    assert done.returncode == 0, done.stderr
    assert "| task | haystack | depth | 256 |" in done.stdout and "| vt | filler | 0.5 |" in done.stdout
    record = report.read_report(out_dir)["results"]
    assert len(record["cases"]) == 6 and all(256 - 12 <= c["prompt_tokens"] <= 256 for c in record["cases"])
    assert {c["task"] for c in record["cases"]} == set(TASKS)
    assert (out_dir / "niah_single_filler.png").is_file()


def test_a_length_past_the_context_is_refused_by_the_console_script(tmp_path):
    run_refused(tmp_path, "gqakit", "eval", "niah", str(EMBEDDED), "--lengths", "512,2k", "-o", str(tmp_path / "r"),
                needles=("--lengths 2,048 is past the 1,024-token context", "use lengths up to 1,024"))


@pytest.mark.parametrize("argv,needle", [
    (["--tasks", "niah_single,needle"], "--tasks: unknown task 'needle'; choose from niah_single, niah_multikey, vt"),
    (["--samples", 0], "--samples must be >= 1, got 0"),
    (["--lengths", "4k"], "--lengths 4,096 is past the 1,024-token context"),
    (["--lengths", "64"], "--lengths 64 is too short for the niah_single prompt"),
    (["--haystack", "text", "--haystack-text", "/nonexistent.txt", "--lengths", "256"],
     "--haystack-text /nonexistent.txt: cannot read"),
    (["--haystack", "essay"], "--haystack: unknown haystack 'essay'"),
    (["--haystack-text", "/nonexistent.txt", "--lengths", "256"],
     "--haystack-text is the text haystack's words, but --haystack is filler; add --haystack text"),
])
def test_bad_input_is_one_line(tmp_path, argv, needle):
    code, out, err = run_eval("niah", EMBEDDED, *argv, "-q", "-o", tmp_path / "never")
    assert one_line_error(code, err, needle), err
    assert not (tmp_path / "never").exists()
