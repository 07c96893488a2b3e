"""An encoder-decoder's KV cache and decode speed after grouping: MHA vs GQA vs MQA of a T5.

For each K/V head count (default: the model's heads, 2, 1), the model is converted by `convert-gqa` (mean) into a
temporary folder, loaded with `AutoModelForSeq2SeqLM` (sdpa), and generates `--new-tokens` greedily from an input
of `--input-tokens` tokens of held-out text. Reported per model: the bytes held by the decoder's self-attention
cache and its cross-attention cache at the end, read off the cache tensors themselves (not computed from the
config), and the decode rate (median of `--repeats` generations after one untimed generation each, the encoder
pass included), in the dtype the checkpoints store (the embedded T5's: bf16) on 2 threads. All models run in one
process, interleaved, so the ratios are comparable.

    python benchmarks/t5_cache.py                                   # the embedded T5 (gqakit/assets/austen-t5-8h)
    python benchmarks/t5_cache.py --model DIR --groups 8,2,1

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _measure import ROOT, cache_bytes, logger

log = logger("t5_cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "gqakit/assets/austen-t5-8h"))
    parser.add_argument("--groups", default=None, help="K/V head counts (default: the model's heads, 2, 1)")
    parser.add_argument("--input-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", default=str(ROOT / "gqakit/assets/heldout_emma.txt"))
    args = parser.parse_args()

    import gqakit  # noqa: F401  (registers gqakit's T5 with the Auto classes)
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from gqakit.cli import convert_main
    from gqakit.hf.compat import LOAD_KWARGS, cache_kwargs, output_cache

    torch.set_num_threads(2)
    heads = AutoConfig.from_pretrained(args.model).num_heads
    groups = [int(g) for g in args.groups.split(",")] if args.groups else [heads, 2, 1]
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor([tok(Path(args.text).read_text(encoding="utf-8")).input_ids[: args.input_tokens]])
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for g in groups:
            out = Path(tmp) / f"g{g}"
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the report
                code = convert_main([args.model, "--groups", str(g), "-o", str(out), "--quiet"])
            if code != 0:
                raise SystemExit(f"convert-gqa --groups {g} failed")
            models[g] = AutoModelForSeq2SeqLM.from_pretrained(out, attn_implementation="sdpa", **LOAD_KWARGS).eval()
        times = {g: [] for g in groups}
        sizes = {}
        dtype = str(next(iter(models.values())).dtype).removeprefix("torch.")  # the stored dtype, as loaded

        def generate(model, cache):
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                      do_sample=False, return_dict_in_generate=True, **cache_kwargs(model, cache))

        for model in models.values():  # one untimed run each: no variant is timed cold
            generate(model, EncoderDecoderCache(DynamicCache(), DynamicCache()))
        for r in range(args.repeats):
            for g, model in models.items():
                cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
                t0 = time.perf_counter()
                out = generate(model, cache)
                times[g].append(time.perf_counter() - t0)
                held = output_cache(out)
                sizes[g] = tuple(cache_bytes(part.layers)
                                 for part in (held.self_attention_cache, held.cross_attention_cache))
                log(f"repeat {r + 1}: G={g} {times[g][-1]:.2f}s")
    base = groups[0]
    print(f"`python benchmarks/t5_cache.py {shlex.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{Path(args.model).name}, {heads} heads; input {ids.shape[1]} tokens, {args.new_tokens} generated "
          f"greedily, {dtype} (as stored), sdpa, 2 threads; median of {args.repeats} after one untimed run each\n")
    print(f"| K/V heads | self-attention cache | cross-attention cache | both vs G = {base} | generate s "
          "| tokens/s (encoder pass included) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for g in groups:
        t = statistics.median(times[g])
        own, cross = sizes[g]
        ratio = (sizes[base][0] + sizes[base][1]) / (own + cross)
        speed = statistics.median(times[base]) / t
        print(f"| {g} | {own:,} B | {cross:,} B | {ratio:.2f}x smaller | {t:.2f} | {args.new_tokens / t:.1f} "
              f"| {speed:.2f}x |")


if __name__ == "__main__":
    main()
