"""`gqakit eval niah`: the RULER-style generators (seeded, exact token lengths, needles at the asked depth, one
answer, a consistent variable chain), the scorers, a fake model that always answers, the report of two models side
by side, the console script on the embedded model and one-line refusals."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from gqakit.evaluate.generation import count_tokens
from gqakit.evaluate.needles import (NEEDLE, NIAH_INTRO, NIAH_QUESTION, TASKS, VT_INTRO, all_names_correct, haystack,
                                     niah_multikey, niah_single, number_correct, vt)

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
