"""Tokens/s of `gqakit sample`'s sampler, variants side by side: transformers' `generate()` (the old path), the
hand-written loop of `gqakit.decode.sampling` with a dynamic or a static cache, on torch's intra-op threads or
split over one-threaded Python threads (`--split`), in fp32 or bf16, and torch.compile'd (opt-in: its compile
time is reported apart).

Every variant samples `--length` tokens per row after the model's start token at temperature 1 (the end token
held back), for each batch size; tokens/s is batch x length over the wall time, the median of `--repeats`. The
repeats are interleaved (repeat, batch, variant), so a co-running process slows every variant alike.

    python benchmarks/sampling_speed.py                                  # the embedded model
    python benchmarks/sampling_speed.py --model runs/smollm2-135m-gqa --batches 32,64,128 --length 64

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from _measure import EMBEDDED, command_line, logger

log = logger("sampling_speed")
VARIANTS = {  # name: (description, how it samples)
    "generate": "transformers generate(), DynamicCache, torch's threads (the old path)",
    "loop-dynamic": "the loop, DynamicCache, torch's threads (split=1)",
    "loop-static": "the loop, StaticCache, torch's threads (split=1)",
    "split-dynamic": "the loop, DynamicCache, rows split over one-threaded Python threads",
    "split-static": "the loop, StaticCache, rows split over one-threaded Python threads (the default)",
    "split-static-bf16": "split-static on a bf16 copy of the model",
    "compiled": "the loop, StaticCache, torch.compile'd step (inductor), torch's threads",
}
DEFAULT = ("generate", "loop-dynamic", "loop-static", "split-dynamic", "split-static", "split-static-bf16")


def generate_ids(model, start: int, count: int, length: int, seed: int) -> torch.Tensor:
    """The old `sample_ids`: generate() with min_new_tokens = length, seeded through the global RNG."""
    from transformers import GenerationConfig

    prompt = torch.full((count, 1), start, dtype=torch.long)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=length,
                              min_new_tokens=length, pad_token_id=start, use_cache=True)
    torch.manual_seed(seed)
    with torch.inference_mode():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)[:, 1:]


def run(variant: str, models: dict, start: int, count: int, length: int, seed: int) -> torch.Tensor:
    from gqakit.decode.sampling import sample_tokens

    if variant == "generate":
        return generate_ids(models["fp32"], start, count, length, seed)
    model = models["bf16" if variant.endswith("bf16") else "fp32"]
    return sample_tokens(model, start, count, length, seed=seed, cache="dynamic" if "dynamic" in variant else "static",
                         split=None if variant.startswith("split") else 1, compile=variant == "compiled")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(EMBEDDED), help="a decoder's folder (default: the embedded model)")
    parser.add_argument("--batches", default="16,32,64,128", help="batch sizes, comma-separated")
    parser.add_argument("--length", type=int, default=128, help="tokens per row (the static cache's size)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default=",".join(DEFAULT), help=f"of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    batches = [int(b) for b in args.batches.split(",")]

    from gqakit.common.precision import bf16_units
    from gqakit.convert.calibration.sample import start_token
    from gqakit.hf.loading import load_model

    model, _ = load_model(args.model, with_tokenizer=False)
    models = {"fp32": model}
    if any(v.endswith("bf16") for v in variants):
        models["bf16"] = copy.deepcopy(model).to(torch.bfloat16)
    start = start_token(model.config)
    load_before = os.getloadavg()[0]
    compile_s = None
    if "compiled" in variants:  # compile once per batch shape before timing: the compile time is reported apart
        t0 = time.perf_counter()
        for b in batches:
            run("compiled", models, start, b, args.length, 0)
        compile_s = time.perf_counter() - t0
    for b in batches:  # one untimed run of every other variant per batch size: none is timed cold
        for v in variants:
            if v != "compiled":  # compiled ran above
                run(v, models, start, b, args.length, 0)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.repeats):
        for b in batches:
            for v in variants:
                t0 = time.perf_counter()
                run(v, models, start, b, args.length, seed=r)
                rate = b * args.length / (time.perf_counter() - t0)
                rates.setdefault((v, b), []).append(rate)
                log(f"repeat {r + 1}/{args.repeats} batch {b} {v}: {rate:,.0f} tokens/s")

    params = sum(p.numel() for p in model.parameters())
    print(f"## Sampling tokens/s: {os.path.basename(os.path.normpath(args.model))} ({params / 1e6:.1f}M parameters)\n")
    print(f"`{command_line(__file__, argv)}`; {args.length} tokens per row, median of {args.repeats} after an "
          f"untimed run; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, bf16 units: {bf16_units()}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (1 min).\n")
    print("| variant | " + " | ".join(f"batch {b}" for b in batches) + " | what |")
    print("|---|" + "---|" * len(batches) + "---|")
    base = {b: statistics.median(rates[("generate", b)]) for b in batches if ("generate", b) in rates}
    for v in variants:
        cells = []
        for b in batches:
            med = statistics.median(rates[(v, b)])
            cells.append(f"{med:,.0f}" + (f" ({med / base[b]:.1f}x)" if b in base and v != "generate" else ""))
        print(f"| {v} | " + " | ".join(cells) + f" | {VARIANTS[v]} |")
    if compile_s is not None:
        print(f"\ncompiled: {compile_s:.0f} s of compilation (one shape per batch size) before the timed runs.")
    print("\n(x): against generate at the same batch size.")


if __name__ == "__main__":
    main()
