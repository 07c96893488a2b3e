"""Passkey retrieval (Mohtashami & Jaggi 2023) and `gqakit eval passkey`.

A random 5-digit key is hidden in repeated filler text at a relative depth (0 = right after the
introduction, 1 = right before the question); the prompt ends with "What is the pass key? The pass
key is" and the model decodes a few tokens greedily. A case is correct when the first run of digits
in the continuation is exactly the key (" 12345." is right; " 1234", " 123456", " 1 2 3 4 5" are not).

Prompt lengths count tokens of the model's tokenizer (with its default special tokens): a prompt is
the longest one made of whole filler sentences that fits in the target length (its real length, a
few tokens short at most, is recorded per case). Keys come from `random.Random` seeded by
(seed, length, depth, trial): the same seed gives the same prompts on any machine. `score` takes any
`generate(prompt) -> continuation` function, so it runs with fake models in tests and with
`greedy_generator(model, tokenizer)` for real.
"""
from __future__ import annotations

import dataclasses
import random
import re
import sys
from collections.abc import Callable, Iterable

from tqdm.auto import tqdm

from gqakit.attention.kinds import command_attention_options
from gqakit.common.errors import GqakitError, opt
from gqakit.evaluate.generation import (count_tokens, greedy_generator, held_after, held_heading, held_note,
                                        longest_fit, mean_held)
from gqakit.evaluate.options import PasskeyConfig

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
_DIGITS = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True)
class Case:
    length: int  # target prompt length in tokens
    depth: float
    trial: int
    key: str
    prompt: str
    prompt_tokens: int  # actual length


def make_key(seed: int, length: int, depth: float, trial: int) -> str:
    """A 5-digit key (10000..99999), the same for the same arguments on every machine."""
    return str(random.Random(f"passkey/{seed}/{length}/{float(depth)!r}/{trial}").randint(10_000, 99_999))


def _filler(sentences: int, start: int = 0) -> str:
    parts = FILLER.split(". ")
    parts = [p.strip().rstrip(".") + ". " for p in parts if p.strip()]
    return "".join(parts[(start + i) % len(parts)] for i in range(sentences))


def _assemble(before: int, after: int, key: str) -> str:
    return INTRO + _filler(before) + NEEDLE.format(key=key) + _filler(after, before) + QUESTION


def build_prompt(tokenizer, length: int, depth: float, key: str) -> tuple[str, int]:
    """(prompt, its token count): the longest prompt of whole filler sentences that fits in `length` tokens,
    with round(depth * sentences) of them before the needle."""
    def fit(sentences: int) -> tuple[str, int]:
        before = round(depth * sentences)
        prompt = _assemble(before, sentences - before, key)
        return prompt, count_tokens(tokenizer, prompt)

    fixed = count_tokens(tokenizer, _assemble(0, 0, key))
    sentences, prompt, n = longest_fit(fit, length, fixed, max(1.0, count_tokens(tokenizer, _filler(50)) / 50))
    if sentences < 1:
        raise GqakitError(f"{opt('lengths', length)} is too short for the passkey prompt (it needs more than {fixed} "
                          "tokens); use longer lengths, e.g. 256 or more")
    return prompt, n


def build_cases(tokenizer, lengths: Iterable[int], depths: Iterable[float], trials: int, seed: int,
                progress: bool = False) -> list[Case]:
    """Every (length, depth, trial) case, in that order, deterministic in `seed`."""
    if trials < 1:
        raise GqakitError(f"{opt('trials')} must be >= 1, got {trials}")
    cells = [(length, depth, trial) for length in lengths for depth in depths for trial in range(trials)]
    cases = []
    for length, depth, trial in tqdm(cells, desc="passkey prompts", unit="prompt", disable=not progress,
                                     leave=False):
        key = make_key(seed, length, depth, trial)
        prompt, n = build_prompt(tokenizer, length, depth, key)
        cases.append(Case(length, depth, trial, key, prompt, n))
    return cases


def answer_digits(continuation: str) -> str | None:
    """The first run of digits in the continuation, or None."""
    match = _DIGITS.search(continuation)
    return match.group(0) if match else None


def score(cases: list[Case], generate: Callable[[str], str], progress: bool = False) -> list[dict]:
    """Run `generate` on every case; one dict per case with the answer and exact-match correctness (and the KV-cache
    bytes per token held after the prompt, when `generate` measures them: `held_after`)."""
    results = []
    for case in tqdm(cases, desc="passkey", unit="prompt", disable=not progress, leave=False):
        continuation = generate(case.prompt)
        answer = answer_digits(continuation)
        results.append({"length": case.length, "depth": case.depth, "trial": case.trial, "key": case.key,
                        "prompt_tokens": case.prompt_tokens, "answer": answer, "continuation": continuation,
                        "correct": answer == case.key, **held_after(generate)})
    return results


def accuracy(results: list[dict]) -> dict[tuple[int, float], float]:
    """Fraction correct per (length, depth)."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for r in results:
        cells.setdefault((r["length"], r["depth"]), []).append(r["correct"])
    return {cell: sum(hits) / len(hits) for cell, hits in cells.items()}


# ---------------------------------------------------------------------------------------------
# `gqakit eval passkey MODEL --lengths 1k,2k --depths 0,0.5,1 --trials N --seed S`
# ---------------------------------------------------------------------------------------------

def passkey_table(lengths: list[int], depths: list[float], acc: dict[tuple[int, float], float],
                 held: dict[int, float] | None = None, kv_cache: str | None = None) -> str:
    """Depth rows x length columns, accuracy in percent, plus a mean row; with `held` (length -> bytes per token
    the `kv_cache` held after the prompt, mean over the length's prompts), a row of them."""
    lines = ["| depth | " + " | ".join(f"{n:,}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for d in depths:
        lines.append(f"| {d:g} | " + " | ".join(f"{100 * acc[(n, d)]:.0f}%" for n in lengths) + " |")
    means = [sum(acc[(n, d)] for d in depths) / len(depths) for n in lengths]
    lines.append("| mean | " + " | ".join(f"{100 * m:.0f}%" for m in means) + " |")
    if held:
        lines.append(f"| {held_heading(kv_cache)} | " + " | ".join(f"{held[n]:,.1f}" for n in lengths) + " |")
    return "\n".join(lines)


def _times(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def reach_warning(lengths: list[int], context: int | None, in_force: dict, per_length: int) -> str | None:
    """One line when the longest prompt is past the model's trained context or its attention's window
    (what to expect, and the work: `per_length` prompts of each length); None when every length fits both."""
    longest = max(lengths)
    window = in_force.get("window")
    reach = window + in_force.get("sinks", 0) if window else None
    if context and longest > context:
        where = f"{_times(longest / context)} the model's {context:,}-token context (max_position_embeddings)"
        expect = (f"positions past it are untrained and a key more than {window:,} tokens before the question is "
                  "outside the window, so expect misses" if window else
                  "without --attention sinks or sliding, retrieval beyond the context is expected to fail")
    elif reach and longest > reach:
        where = f"{_times(longest / reach)} the {reach:,} tokens that --attention {in_force['kind']} keeps in view"
        expect = f"a key more than {window:,} tokens before the question is outside the window, so expect misses"
    else:
        return None
    prompts = per_length * len(lengths)
    return (f"warning: --lengths {longest:,} is {where}; {expect}; time grows with length "
            f"({prompts:,} prompt{'s' if prompts != 1 else ''}, {per_length * sum(lengths):,} tokens in all)")


def run_passkey(cfg: PasskeyConfig, command: str = "", out=None, generate: Callable[[str], str] | None = None,
                err=None) -> dict:
    """Build the cases, decode, score, print the table, write the report; `generate` overrides the model's.
    A warning (on `err`, stderr) comes first when a length is past the model's context or its window."""
    from gqakit.common import plots, report
    from gqakit.attention.registration import apply_attention
    from gqakit.evaluate.kvcache import check_options, report_fields
    from gqakit.decode.rope import positions_end
    from gqakit.hf.loading import describe, load_model

    out, err = out or sys.stdout, err or sys.stderr
    if cfg.new_tokens < 1:
        raise GqakitError(f"{opt('new_tokens')} must be >= 1, got {cfg.new_tokens}")
    if cfg.trials < 1:
        raise GqakitError(f"{opt('trials')} must be >= 1, got {cfg.trials}")
    check_options(cfg.kv_cache, cfg.kv_chunk, cfg.attention)
    lengths, depths = list(cfg.lengths), [float(d) for d in cfg.depths]
    options = command_attention_options(cfg.attention, cfg.window, cfg.sinks, cfg.attention_option)
    target = report.prepare_for(cfg, "passkey")
    model, tok = load_model(cfg.model, cfg.dtype, cfg.tokenizer, cfg.device)
    in_force = apply_attention(model, cfg.attention, options)
    shortest = min(lengths)  # refuse a too-short length (cheap) before warning about long ones
    build_prompt(tok, shortest, depths[0], make_key(cfg.seed, shortest, depths[0], 0))
    end = positions_end(model)
    if end and max(lengths) + cfg.new_tokens - 1 > end:  # the last reply token is not fed
        raise GqakitError(f"{opt('lengths', f'{max(lengths):,}')} + {opt('new_tokens', cfg.new_tokens)} positions run "
                          f"past the {end:,}-token context of {type(model).__name__}, whose positions come from a "
                          f"table that ends there (learned, or a precomputed RoPE table); use lengths up to "
                          f"{end + 1 - cfg.new_tokens:,}")
    warning = reach_warning(lengths, getattr(model.config, "max_position_embeddings", None), in_force,
                            len(depths) * cfg.trials)
    if warning:
        print(f"gqakit: {warning}", file=err, flush=True)
    cases = build_cases(tok, lengths, depths, cfg.trials, cfg.seed, cfg.progress)
    generate = generate or greedy_generator(model, tok, cfg.new_tokens, cfg.kv_cache, cfg.kv_chunk)
    results = score(cases, generate, cfg.progress)
    acc = accuracy(results)
    held = mean_held(results, lambda r: r["length"])
    print(passkey_table(lengths, depths, acc, held, cfg.kv_cache), file=out)
    overall = sum(r["correct"] for r in results) / len(results)
    print(f"(overall {100 * overall:.1f}% of {len(results)} prompts; exact match of the 5 digits)", file=out)
    if held:
        print(held_note(cfg.kv_cache, cfg.kv_chunk), file=out)
    cell_held = mean_held(results, lambda r: (r["length"], r["depth"]))
    cells = [{"length": n, "depth": d, "accuracy": acc[(n, d)], "trials": cfg.trials,
              "mean_prompt_tokens": sum(r["prompt_tokens"] for r in results if (r["length"], r["depth"]) == (n, d))
              / cfg.trials, **({"kv_bytes_held_per_token": cell_held[(n, d)]} if cell_held else {})}
             for n in lengths for d in depths]
    record = {"model": describe(model), "attention": cfg.attention or "default", "attention_options": in_force,
              **report_fields(cfg.kv_cache, cfg.kv_chunk), "kv_bytes_held_per_token": mean_held(results).get(None),
              "overall_accuracy": overall, "cells": cells, "cases": results}
    written = report.write_report(
        target, kind="passkey", command=command, config=dataclasses.asdict(cfg), results=record, rows=cells,
        force=cfg.force, default=not cfg.output,
        plots={"passkey_heatmap.png": lambda p: plots.passkey_heatmap(lengths, depths, acc, p)})
    print(f"wrote {written}", file=out)
    return record
