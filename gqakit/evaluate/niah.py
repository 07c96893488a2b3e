"""`gqakit eval niah MODEL [MODEL ...]`: RULER-style long-context retrieval (`evaluate/needles.py` makes the
prompts), accuracy per (task, haystack, length, depth) of each model, side by side.

Every model answers the same questions (the needles depend on the seed only; the haystack is fitted to each
model's own tokenizer). A length past a model's context (max_position_embeddings) is refused before any model
runs: the positions there are untrained. Prompts run through `generation.greedy_generator`, the path of
`eval passkey`; `run_niah` takes any `generate(prompt, new_tokens) -> reply` instead, for tests.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from gqakit.attention.kinds import command_attention_options
from gqakit.common.errors import GqakitError, opt
from gqakit.evaluate.generation import held_after, held_heading, mean_held
from gqakit.evaluate.needles import TASKS, Haystack, haystack
from gqakit.evaluate.options import NiahConfig

Generate = Callable[[str, int], str]


@dataclasses.dataclass(frozen=True)
class Case:
    task: str
    haystack: str
    length: int  # target prompt length in tokens
    depth: float
    sample: int
    prompt: str
    answer: tuple[str, ...]
    prompt_tokens: int  # actual length


def build_cases(tokenizer, tasks: tuple[str, ...], haystacks: dict[str, Haystack], lengths: list[int],
                depths: list[float], samples: int, seed: int, progress: bool = False) -> list[Case]:
    """Every (task, haystack, length, depth, sample) case, in that order; sample i has the seed f"{seed}/{i}"."""
    cells = [(t, h, n, d, i) for t in tasks for h in haystacks for n in lengths for d in depths for i in range(samples)]
    cases = []
    for task, hay, length, depth, i in tqdm(cells, desc="niah prompts", unit="prompt", disable=not progress,
                                            leave=False):
        made = TASKS[task].generate(tokenizer, length, depth, f"{seed}/{i}", haystacks[hay])
        cases.append(Case(task, hay, length, depth, i, made.prompt, made.answer, made.tokens))
    return cases


def score(cases: list[Case], generate: Generate, new_tokens: int | None = None, progress: bool = False) -> list[dict]:
    """Run `generate` on every case (`new_tokens`, or the task's own); one dict per case with its correctness (and
    the KV-cache bytes per token held after the prompt, when `generate` measures them: `generation.held_after`)."""
    results = []
    for case in tqdm(cases, desc="niah", unit="prompt", disable=not progress, leave=False):
        task = TASKS[case.task]
        reply = generate(case.prompt, new_tokens or task.new_tokens)
        results.append({"task": case.task, "haystack": case.haystack, "length": case.length, "depth": case.depth,
                        "sample": case.sample, "answer": " ".join(case.answer), "prompt_tokens": case.prompt_tokens,
                        "reply": reply, "correct": task.correct(reply, case.answer), **held_after(generate)})
    return results


def accuracy(results: list[dict]) -> dict[tuple[str, str, int, float], float]:
    """Fraction correct per (task, haystack, length, depth)."""
    cells: dict[tuple, list[bool]] = {}
    for r in results:
        cells.setdefault((r["task"], r["haystack"], r["length"], r["depth"]), []).append(r["correct"])
    return {cell: sum(hits) / len(hits) for cell, hits in cells.items()}


def niah_table(names: list[str], accs: list[dict], variants: list[tuple[str, str]], lengths: list[int],
                 depths: list[float], held: list[dict] | None = None, kv_cache: str | None = None) -> str:
    """Rows: (task, haystack) x depth, then its mean over depths, then the mean of all; a column per (model,
    length), the model's name in the header only when there are several. Accuracy in percent. With `held` (per
    model, length -> bytes per token the `kv_cache` held after the prompt), a last row of them."""
    columns = [(m, n) for m in range(len(names)) for n in lengths]
    head = [f"{names[m]} {n:,}" if len(names) > 1 else f"{n:,}" for m, n in columns]
    lines = ["| task | haystack | depth | " + " | ".join(head) + " |", "|---" * (len(columns) + 3) + "|"]

    def row(task: str, hay: str, depth: str, cells: list[tuple[str, str, float]]) -> str:
        values = [sum(accs[m][(t, h, n, d)] for t, h, d in cells) / len(cells) for m, n in columns]
        return f"| {task} | {hay} | {depth} | " + " | ".join(f"{100 * v:.0f}%" for v in values) + " |"

    for task, hay in variants:
        lines += [row(task, hay, f"{d:g}", [(task, hay, d)]) for d in depths]
        if len(depths) > 1:
            lines.append(row(task, hay, "mean", [(task, hay, d) for d in depths]))
    if len(variants) > 1:
        lines.append(row("mean", "", "", [(t, h, d) for t, h in variants for d in depths]))
    if held and all(held):
        lines.append(f"| {held_heading(kv_cache)} | | | " + " | ".join(f"{held[m][n]:,.1f}" for m, n in columns)
                     + " |")
    return "\n".join(lines)


def _check(cfg: NiahConfig) -> None:
    if not cfg.models:
        raise GqakitError("give at least one MODEL folder")
    if cfg.samples < 1:
        raise GqakitError(f"{opt('samples')} must be >= 1, got {cfg.samples}")
    if cfg.new_tokens is not None and cfg.new_tokens < 1:
        raise GqakitError(f"{opt('new_tokens')} must be >= 1, got {cfg.new_tokens}")
    if cfg.haystack_text is not None and "text" not in cfg.haystacks:
        raise GqakitError(f"{opt('haystack_text')} is the text haystack's words, but {opt('haystacks')} is "
                          f"{','.join(cfg.haystacks)}; add {opt('haystacks', 'text')} (or drop {opt('haystack_text')})")
    from gqakit.evaluate.kvcache import check_options

    check_options(cfg.kv_cache, cfg.kv_chunk, cfg.attention)


def check_context(path: str, context: int | None, lengths: list[int]) -> None:
    """Refuse a length past the model's trained context, in one line."""
    longest = max(lengths)
    if context and longest > context:
        raise GqakitError(f"{opt('lengths', f'{longest:,}')} is past the {context:,}-token context of {path} "
                          f"(max_position_embeddings); use lengths up to {context:,}")


def run_niah(cfg: NiahConfig, command: str = "", out=None, generate: Generate | None = None) -> dict:
    """Check every model's context, then per model: build the cases with its tokenizer, decode, score. Print the
    table, write the report (results.json, results.csv, a heatmap per model and task); `generate` overrides the
    models' decoding."""
    from gqakit.attention.registration import apply_attention
    from gqakit.common import plots, report
    from gqakit.evaluate.generation import greedy_generator, held_note
    from gqakit.evaluate.kvcache import report_fields
    from gqakit.hf.fields import context_length
    from gqakit.hf.loading import check_model_folder, describe, load_model

    out = out or sys.stdout
    _check(cfg)
    lengths, depths = list(cfg.lengths), [float(d) for d in cfg.depths]
    options = command_attention_options(cfg.attention, cfg.window, cfg.sinks, cfg.attention_option)
    target = report.prepare_for(cfg, "niah")
    for path in cfg.models:  # every local model's context, before the first one runs
        config = check_model_folder(path)
        check_context(path, config and context_length(config), lengths)
    haystacks = {name: haystack(name, cfg.haystack_text if name == "text" else None) for name in cfg.haystacks}
    names = [Path(p).name or p for p in cfg.models]
    if len(set(names)) < len(names):  # same folder names in different places: show the paths
        names = list(cfg.models)
    variants = [(t, h) for t in cfg.tasks for h in cfg.haystacks]
    models, accs, helds, cases_out = [], [], [], []
    for path, name in zip(cfg.models, names):
        model, tok = load_model(path, cfg.dtype, cfg.tokenizer, cfg.device)
        check_context(path, getattr(model.config, "max_position_embeddings", None), lengths)  # a hub name
        in_force = apply_attention(model, cfg.attention, options)
        cases = build_cases(tok, cfg.tasks, haystacks, lengths, depths, cfg.samples, cfg.seed, cfg.progress)
        run = generate or greedy_generator(model, tok, kv_cache=cfg.kv_cache, kv_chunk=cfg.kv_chunk)
        results = score(cases, run, cfg.new_tokens, cfg.progress)
        accs.append(accuracy(results))
        helds.append(mean_held(results, lambda r: r["length"]))
        overall = sum(r["correct"] for r in results) / len(results)
        models.append({"model": name, "path": str(path), **describe(model), "attention": cfg.attention or "default",
                       "attention_options": in_force, "kv_bytes_held_per_token": mean_held(results).get(None),
                       "overall_accuracy": overall})
        cases_out += [{"model": name, **r} for r in results]
        print(f"  {name}: {100 * overall:.1f}% of {len(results):,} prompts", file=out, flush=True)
        del model
    print(niah_table(names, accs, variants, lengths, depths, helds, cfg.kv_cache), file=out)
    print(f"(exact match: niah_* the first number of the reply, vt every variable name; {cfg.samples} sample"
          f"{'s' if cfg.samples != 1 else ''} per cell, seed {cfg.seed})", file=out)
    if all(helds):
        print(held_note(cfg.kv_cache, cfg.kv_chunk), file=out)
    cells = []
    for name, acc in zip(names, accs):
        for task, hay in variants:
            for n in lengths:
                for d in depths:
                    mine = [r for r in cases_out if r["model"] == name and
                            (r["task"], r["haystack"], r["length"], r["depth"]) == (task, hay, n, d)]
                    held = mean_held(mine)
                    cells.append({"model": name, "task": task, "haystack": hay, "length": n, "depth": d,
                                  "accuracy": acc[(task, hay, n, d)], "samples": cfg.samples,
                                  "mean_prompt_tokens": sum(r["prompt_tokens"] for r in mine) / len(mine),
                                  **({"kv_bytes_held_per_token": held[None]} if held else {})})
    record = {**report_fields(cfg.kv_cache, cfg.kv_chunk), "models": models, "cells": cells, "cases": cases_out}
    drawings = {}
    for m, (name, acc) in enumerate(zip(names, accs)):
        for task, hay in variants:
            grid = {(n, d): acc[(task, hay, n, d)] for n in lengths for d in depths}
            file = f"{task}_{hay}.png" if len(names) == 1 else f"{task}_{hay}_model{m + 1}.png"
            drawings[file] = (lambda p, grid=grid, title=f"{name}: {task} ({hay})":
                              plots.passkey_heatmap(lengths, depths, grid, p, title=title))
    written = report.write_report(target, kind="niah", command=command, config=dataclasses.asdict(cfg),
                                  results=record, rows=cells, force=cfg.force, default=not cfg.output, plots=drawings)
    print(f"wrote {written}", file=out)
    return record
