"""Synthetic long-context tasks in the style of RULER (Hsieh et al. 2024) for `gqakit eval niah`, generated here,
offline: no download, no data set.

- `niah_single`: "One of the special magic numbers for KEY is: NUMBER." hidden at a relative depth of a haystack;
  the question asks for KEY's number.
- `niah_multikey`: the same needle among `keys - 1` distractor needles with other keys and numbers, at seeded
  random depths; the question asks for one key.
- `vt` (variable tracking): a chain "VAR ABCDE = 12345." "VAR FGHIJ = VAR ABCDE." ... starting at the depth, the
  later hops spread evenly between it and the end; the question asks for every variable holding the value.

A haystack is a run of units joined by spaces: the repeated filler sentences ("The grass is green. The sky is
blue. ...") or the words of a local text (by default gqakit/assets/pride_and_prejudice.txt, from a seeded word
offset, wrapping round). Prompt lengths count tokens of the model's tokenizer: a prompt is the longest one of
whole units that fits in the target length (`generation.longest_fit`, as passkey's), so it is short of the target
by less than a unit (a filler sentence or a word); a statement at depth d follows round(d * units) of them.

Each generator is `(tokenizer, length, depth, seed, haystack) -> Sample`, deterministic in `seed` (an int or a
string, through `random.Random`) on every machine; the needles depend on the seed only, not on the length or the
depth, so sample i is the same question in every cell. Scoring, as RULER's: greedy decoding of a few tokens after
the question; `niah_*` is right when the first run of digits in the reply is exactly the number, `vt` when every
variable name of the chain is a word of the reply.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Callable
from pathlib import Path

from gqakit.common.errors import GqakitError, opt
from gqakit.common.options import each_once
from gqakit.evaluate.generation import count_tokens, longest_fit

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "assets" / "pride_and_prejudice.txt"

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
                 "The special magic number for {key} mentioned in the provided text is")
VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text.\n"
VT_VALUE = "VAR {name} = {value}."
VT_HOP = "VAR {name} = VAR {previous}."
VT_QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
               "According to the chain of variable assignments in the text above, {count} variables are assigned "
               "the value {value}, they are:")

# Keys are adjective-noun pairs ("amber-lantern"): words a text rarely joins with a hyphen.
_ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly", "keen",
               "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upper", "vivid",
               "wild", "young", "zesty", "bitter", "crimson", "distant", "early", "faint")
_NOUNS = ("anchor", "badger", "candle", "desert", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quartz", "river", "saddle", "tunnel",
          "umbrella", "violin", "walnut", "yacht", "zipper", "bridge", "cactus", "dragon", "feather", "glacier")
_DIGITS = re.compile(r"\d+")
_WORDS = re.compile(r"[A-Za-z]+")


@dataclasses.dataclass(frozen=True)
class Haystack:
    """Filler units, joined by spaces: `filler` cycles FILLER's sentences from the first; `text` cycles a text's
    words from a seeded offset."""

    name: str
    units: tuple[str, ...]

    def start(self, rng: random.Random) -> int:
        return 0 if self.name == "filler" else rng.randrange(len(self.units))

    def take(self, start: int, count: int) -> list[str]:
        return [self.units[(start + i) % len(self.units)] for i in range(count)]


HAYSTACKS = ("filler", "text")


@functools.lru_cache(maxsize=4)
def haystack(name: str = "filler", text: str | None = None) -> Haystack:
    """The `filler` haystack, or the `text` one made of the words of the UTF-8 file `text` (default DEFAULT_TEXT)."""
    if name == "filler":
        return Haystack("filler", FILLER)
    path = Path(text) if text else DEFAULT_TEXT
    try:
        words = tuple(path.read_text(encoding="utf-8").split())
    except (OSError, UnicodeDecodeError) as e:
        raise GqakitError(f"{opt('haystack_text', str(path))}: cannot read it as UTF-8 text ({type(e).__name__}); "
                          "give a readable .txt file") from None
    if len(words) < 100:
        raise GqakitError(f"{opt('haystack_text', str(path))} holds {len(words)} words; a haystack needs at least "
                          "100 (it wraps round, but a handful of words is not natural text)")
    return Haystack("text", words)


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str
    answer: tuple[str, ...]  # what the reply must hold: the number (niah) or every variable name (vt)
    tokens: int  # the prompt's length in tokens of the tokenizer it was built with
    needles: tuple[str, ...]  # the statements hidden in the haystack, in prompt order


def _build(tokenizer, length: int, hay: Haystack, start: int, intro: str, inserts: list[tuple[float, str]],
           question: str, task: str) -> tuple[str, int]:
    """(prompt, tokens): intro + haystack units with each (depth, statement) after round(depth * units) of them +
    question, with as many units as fit in `length` tokens."""
    inserts = sorted(inserts, key=lambda item: item[0])  # stable: a chain keeps its order at equal depths

    def assemble(units: int) -> str:
        words, pieces, at = hay.take(start, units), [], 0
        for depth, statement in inserts:
            cut = round(depth * units)
            pieces += words[at:cut] + [statement]
            at = cut
        return intro + " ".join(pieces + words[at:]) + question

    def fit(units: int) -> tuple[str, int]:
        prompt = assemble(units)
        return prompt, count_tokens(tokenizer, prompt)

    fixed = count_tokens(tokenizer, assemble(0))
    per_unit = max(1.0, count_tokens(tokenizer, " ".join(hay.take(start, 50))) / 50)
    units, prompt, n = longest_fit(fit, length, fixed, per_unit)
    if units < 1:
        raise GqakitError(f"{opt('lengths', length)} is too short for the {task} prompt (it needs more than {fixed} "
                          "tokens); use longer lengths, e.g. 512 or more")
    return prompt, n


def _keys(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """`count` (key, 7-digit number) pairs, keys distinct and numbers distinct."""
    keys = rng.sample([f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS], count)
    values = rng.sample(range(1_000_000, 10_000_000), count)
    return [(k, str(v)) for k, v in zip(keys, values)]


def niah_multikey(tokenizer, length: int, depth: float, seed: int | str, hay: Haystack | None = None,
                  keys: int = 4) -> Sample:
    """`keys` needles with distinct keys and numbers; the asked one at `depth`, the others at seeded depths."""
    hay = hay or haystack()
    task = "niah_single" if keys == 1 else "niah_multikey"
    rng = random.Random(f"{task}/{seed}")
    pairs = _keys(rng, keys)
    start = hay.start(rng)
    inserts = [(depth, NEEDLE.format(key=pairs[0][0], value=pairs[0][1]))]
    inserts += [(rng.random(), NEEDLE.format(key=k, value=v)) for k, v in pairs[1:]]
    prompt, n = _build(tokenizer, length, hay, start, NIAH_INTRO, inserts, NIAH_QUESTION.format(key=pairs[0][0]),
                       task)
    return Sample(prompt, (pairs[0][1],), n, tuple(s for _, s in sorted(inserts, key=lambda item: item[0])))


def niah_single(tokenizer, length: int, depth: float, seed: int | str, hay: Haystack | None = None) -> Sample:
    """One needle at `depth`."""
    return niah_multikey(tokenizer, length, depth, seed, hay, keys=1)


def vt(tokenizer, length: int, depth: float, seed: int | str, hay: Haystack | None = None, hops: int = 4) -> Sample:
    """A chain of `hops` + 1 variables holding one 5-digit value: its first assignment at `depth`, the hops spread
    evenly between it and the end."""
    hay = hay or haystack()
    rng = random.Random(f"vt/{seed}")
    names = rng.sample(sorted({"".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for _ in range(4 * hops + 8)}),
                       hops + 1)
    value = str(rng.randint(10_000, 99_999))
    start = hay.start(rng)
    statements = [VT_VALUE.format(name=names[0], value=value)]
    statements += [VT_HOP.format(name=b, previous=a) for a, b in zip(names, names[1:])]
    inserts = [(depth + (1 - depth) * i / (hops + 1), s) for i, s in enumerate(statements)]
    prompt, n = _build(tokenizer, length, hay, start, VT_INTRO, inserts,
                       VT_QUESTION.format(value=value, count=hops + 1), "vt")
    return Sample(prompt, tuple(names), n, tuple(statements))


def first_number(reply: str) -> str | None:
    """The first run of digits in the reply, or None."""
    match = _DIGITS.search(reply)
    return match.group(0) if match else None


def number_correct(reply: str, answer: tuple[str, ...]) -> bool:
    """Exact match: the first run of digits is the number (" 1234567." yes; " 12345678", " 1 2 3 ..." no)."""
    return first_number(reply) == answer[0]


def all_names_correct(reply: str, answer: tuple[str, ...]) -> bool:
    """Every name of the chain is a word of the reply (in any order, others allowed, as RULER's string_match_all)."""
    words = set(_WORDS.findall(reply))
    return all(name in words for name in answer)


@dataclasses.dataclass(frozen=True)
class Task:
    generate: Callable[..., Sample]
    correct: Callable[[str, tuple[str, ...]], bool]
    new_tokens: int  # decoded greedily unless --new-tokens says otherwise


TASKS = {"niah_single": Task(niah_single, number_correct, 12),
         "niah_multikey": Task(niah_multikey, number_correct, 12),
         "vt": Task(vt, all_names_correct, 32)}


def _names(spec: str, known: tuple[str, ...], field: str, what: str) -> tuple[str, ...]:
    names = tuple(each_once([p.strip() for p in spec.split(",") if p.strip()], opt(field)))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        said = f"unknown {what} {unknown[0]!r}" if unknown else "is empty"
        raise GqakitError(f"{opt(field)}: {said}; choose from {', '.join(known)} (comma-separated)")
    return names


def parse_tasks(spec: str) -> tuple[str, ...]:
    """'niah_single,vt' -> ('niah_single', 'vt'); an unknown name is refused in one line."""
    return _names(spec, tuple(TASKS), "tasks", "task")


def parse_haystacks(spec: str) -> tuple[str, ...]:
    """'filler,text' -> ('filler', 'text')."""
    return _names(spec, HAYSTACKS, "haystacks", "haystack")
