"""Sparse attention patterns in the tiled kernel on CPU: visited blocks, computed scores and forward time
against full causal attention, and how they scale with T (Longformer, Sparse Transformer strided / fixed).

For each T (default 4096 and 16384; --quick: 1024 and 4096), batch 1, --heads query heads on --kv-heads
K/V heads, head_dim 64, fp32, forward only (no grad), median of --repeats calls:

  causal       full causal attention (the baseline)
  sliding      a causal window of --window tokens (Mistral)
  longformer   encoder (not causal): --window attended tokens, half on each side, plus global token 0
  strided      Sparse Transformer strided, l = sqrt(T): merged head (A1 | A2), and per head (half A1, half A2)
  fixed        Sparse Transformer fixed, l = sqrt(T), c = --summary: merged, and per head

Columns: `blocks` = (query block, key block) tiles of the generic block plan, summed over K/V groups (and
over the calls of per-head patterns); by construction they are exactly the tiles where the pattern has an
allowed entry. `scores` = query-head x key score entries the kernel computes, with the Sparse Transformer
patterns in their own layouts (residue classes / gathered summaries), as a fraction of full causal's.
The scaling table divides each figure at the largest T by the one at the smallest: with l = sqrt(T) and a
fixed summary c the patterns cost O(T sqrt T) (x8 for T x4), full causal O(T^2) (x16).

    python benchmarks/sparse_patterns.py            # T = 4096, 16384 (~2 min on one core)
    python benchmarks/sparse_patterns.py --quick    # T = 1024, 4096 (~10 s)

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from gqakit.attention import patterns
from gqakit.attention.masks import MaskSpec
from gqakit.attention.tiled import block_plan, tiled_attention, work


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths T (default 4096 16384)")
    p.add_argument("--quick", action="store_true", help="T = 1024 4096, 2 repeats")
    p.add_argument("--repeats", type=int, default=3, help="timed forward calls per case (median reported)")
    p.add_argument("--block", type=int, default=64, help="block_q = block_k")
    p.add_argument("--heads", type=int, default=4, help="num_attention_heads")
    p.add_argument("--kv-heads", type=int, default=2, help="num_key_value_heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=512, help="sliding window / Longformer window (tokens)")
    p.add_argument("--summary", type=int, default=8, help="fixed pattern: c, the summary positions per block")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = [1024, 4096] if args.quick else [4096, 16384]
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return args


def cases(args, T: int) -> dict:
    l = math.isqrt(T)
    H = args.heads
    return {
        "causal": MaskSpec(),
        f"sliding W={args.window}": MaskSpec(window=args.window),
        f"longformer w={args.window} +global (enc)": patterns.longformer(args.window, global_tokens=(0,)),
        f"strided l={l} merged": patterns.strided(l),
        f"strided l={l} per head": patterns.factorised(patterns.strided(l, part="a1"),
                                                       patterns.strided(l, part="a2"), H),
        f"fixed l={l} c={args.summary} merged": patterns.fixed(l, args.summary),
        f"fixed l={l} c={args.summary} per head": patterns.factorised(
            patterns.fixed(l, args.summary, part="a1"), patterns.fixed(l, args.summary, part="a2"), H),
    }


def measure(args, T: int, spec) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, T, args.head_dim, generator=gen)
    k = torch.randn(1, args.kv_heads, T, args.head_dim, generator=gen)
    v = torch.randn(1, args.kv_heads, T, args.head_dim, generator=gen)
    b = args.block
    blocks = partial = 0
    for _, groups, plan in block_plan(spec, args.heads, args.kv_heads, T, T, block_q=b, block_k=b):
        for _, _, bl in plan:
            blocks += len(groups) * len(bl)
            partial += len(groups) * sum(needs for _, _, needs in bl)
    scores = work(spec, args.heads, args.kv_heads, T, T, block_q=b, block_k=b)["scores"]
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        with torch.no_grad():
            out = tiled_attention(q, k, v, scale=args.head_dim ** -0.5, spec=spec, block_q=b, block_k=b)
        times.append(time.perf_counter() - start)
        assert torch.isfinite(out).all()
    return {"blocks": blocks, "partial": partial, "scores": scores, "time": statistics.median(times)}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.no_grad():  # warm-up (allocator, kernels)
        tiled_attention(*(torch.randn(1, 2, 256, args.head_dim) for _ in range(3)), scale=0.1)
    results: dict[int, dict[str, dict]] = {}
    for T in args.seq:
        results[T] = {}
        for name, spec in cases(args, T).items():
            print(f"T={T} {name} ...", file=sys.stderr, flush=True)
            results[T][name] = measure(args, T, spec)
    cmd = "python benchmarks/sparse_patterns.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"## Sparse attention patterns, tiled kernel, CPU\n\n`{cmd.strip()}`: batch 1, {args.heads} query heads on "
          f"{args.kv_heads} K/V heads, head_dim {args.head_dim}, fp32, block {args.block}, {args.threads} thread(s), "
          f"forward median of {args.repeats}.\n")
    print("| T | pattern | blocks | of causal | partial | scores of causal | forward s | of causal |")
    print("|---|---|---|---|---|---|---|---|")
    for T, row in results.items():
        base = row["causal"]
        for name, r in row.items():
            print(f"| {T} | {name} | {r['blocks']:,} | {r['blocks'] / base['blocks']:.3f} | {r['partial']:,} | "
                  f"{r['scores'] / base['scores']:.3f} | {r['time']:.3f} | {r['time'] / base['time']:.3f} |")
    if len(args.seq) > 1:
        lo, hi = min(args.seq), max(args.seq)
        names_lo, names_hi = list(results[lo]), list(results[hi])  # same order; l differs with T
        print(f"\n### Growth from T = {lo} to T = {hi} (x{hi / lo:g} tokens: O(T sqrt T) is "
              f"x{(hi / lo) ** 1.5:g}, O(T^2) x{(hi / lo) ** 2:g})\n")
        print("| pattern | blocks | scores | forward time |")
        print("|---|---|---|---|")
        for a, b in zip(names_lo, names_hi):
            x, y = results[lo][a], results[hi][b]
            label = b.split(" l=")[0] + (" " + " ".join(b.split(" ")[2:]) if " l=" in b else "")
            print(f"| {label} | x{y['blocks'] / x['blocks']:.1f} | x{y['scores'] / x['scores']:.1f} | "
                  f"x{y['time'] / x['time']:.1f} |")


if __name__ == "__main__":
    main()
