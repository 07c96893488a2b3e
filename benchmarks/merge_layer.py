"""Wall time and memory of one layer's aligned / fit merge at a model's layer shape, in process.

A random bf16 MHA attention layer (q/k/v/o, HF layouts) and random positive semi-definite float32 key and
value statistics (the second moment of `--samples` random inputs, as a short calibration gives) are merged
by `gqakit.convert.methods.layer.merge_layer` exactly as `convert-gqa --method aligned|fit` merges a layer, statistics
read from a layer file in row blocks as the conversion reads them. Prints, per method, the median wall time
of `--repeats` runs and the peak RSS growth over the live memory before the merge (sampled every 5 ms; the
process returns freed blocks of 1 MiB and more to the OS, as `convert-gqa` does for these methods).

    OMP_NUM_THREADS=1 python benchmarks/merge_layer.py               # the Llama-2-7B layer shape
    OMP_NUM_THREADS=1 python benchmarks/merge_layer.py --hidden 1024 --heads 16
    python benchmarks/merge_layer.py --hidden 1024 --heads 16 --busy   # quiet and beside a co-runner
    python benchmarks/merge_layer.py --hidden 1024 --heads 16 --layers 4 --busy   # a pass over 4 layers

With `--layers N` a pass over N such layers is timed two ways side by side: one merge at a time on all of
torch's threads (convert-gqa's policy before issue 22), and `convert.methods.merge_ahead.MergeAhead`, which
convert-gqa now uses: up to min(threads, 8) layers merged at once, each on one thread.

`--busy` times every method twice in one run: quiet, then while a bounded co-runner (another torch process doing
1024 x 1024 matmuls on every core, stopped at the end) shares the CPU; the target is a merge at most
2x its quiet time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import types
from pathlib import Path

import torch

from _measure import co_running, sampled_peak
from gqakit.convert.calibration.stored import save_layer
from gqakit.convert.memory import return_freed_memory_eagerly
from gqakit.convert.methods.merge_ahead import MergeAhead, merge_workers
from gqakit.convert.methods.engine import read_stats
from gqakit.convert.methods.layer import merge_layer


BUSY_TARGET = 2.0  # issue 22: a merge at most 2x its quiet time beside one co-running torch process


def one_at_a_time(plan, weights, stats, layers: int) -> list:
    return [merge_layer(plan, weights, "similarity", stats) for _ in range(layers)]


def side_by_side(plan, weights, stats, layers: int) -> list:
    ahead = MergeAhead(range(layers), lambda _: merge_layer(plan, weights, "similarity", stats), merge_workers(layers))
    try:
        return [ahead.get(i) for i in range(layers)]
    finally:
        ahead.close()


POLICIES = {"one at a time, all threads": one_at_a_time, "side by side, one thread each": side_by_side}


def timed(run, plan, weights, stats, layers: int, repeats: int) -> list[tuple[float, float]]:
    return [sampled_peak(lambda: run(plan, weights, stats, layers))[1:] for _ in range(repeats)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=512, help="random inputs behind each statistic")
    ap.add_argument("--methods", nargs="+", default=["aligned", "fit"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", action="store_true", help="also time each merge beside a co-running torch process")
    ap.add_argument("--layers", type=int, default=1, help="time a pass over this many layers, both policies")
    args = ap.parse_args(argv)
    return_freed_memory_eagerly()
    n, H = args.hidden, args.heads
    d = n // H
    gen = torch.Generator().manual_seed(0)
    weights = {k: (torch.randn(n, n, generator=gen) / n**0.5).to(torch.bfloat16) for k in ("q_w", "k_w", "v_w", "o_w")}
    with tempfile.TemporaryDirectory() as folder:
        x = torch.randn(args.samples, n, generator=gen)
        moment = x.T @ x / args.samples
        save_layer(Path(folder), 0, {"key": moment, "value": moment, "value_mean": x.mean(0)},
                   {"x": x[None, :2], "cos": torch.ones(2, d), "sin": torch.zeros(2, d),
                    "allowed": torch.ones(2, 2, dtype=torch.bool)})
        del x, moment
        rows = []
        for method in args.methods:
            plan = types.SimpleNamespace(num_attention_heads=H, num_key_value_heads=H, groups=args.groups,
                                         head_dim=d, method=method)
            stats = (lambda names: read_stats(Path(folder), 0, names)) if method == "fit" else None
            policies = POLICIES if args.layers > 1 else {"one at a time, all threads": one_at_a_time}
            for policy, run in policies.items():
                runs = timed(run, plan, weights, stats, args.layers, args.repeats)
                busy = None
                if args.busy:
                    with co_running():
                        busy = statistics.median(s for s, _ in timed(run, plan, weights, stats, args.layers,
                                                                     args.repeats))
                rows.append((method, policy, statistics.median(s for s, _ in runs),
                             statistics.median(m for _, m in runs), busy))
                print(f"{method}, {policy}: " + ", ".join(f"{s:.1f} s / +{m:.0f} MiB" for s, m in runs),
                      file=sys.stderr)
    what = "One layer's merge" if args.layers == 1 else f"A pass over {args.layers} layers' merges"
    print(f"## {what}: hidden {n}, {H} heads -> {args.groups} K/V heads, bf16, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}\n")
    if not args.busy:
        print("| method | policy | wall s | peak RSS growth MiB |")
        print("|---|---|---|---|")
        for method, policy, seconds, mib, _ in rows:
            print(f"| {method} | {policy} | {seconds:.1f} | {mib:,.0f} |")
        return 0
    print("| method | policy | wall s, quiet | wall s, busy | busy / quiet | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|")
    for method, policy, seconds, mib, busy in rows:
        print(f"| {method} | {policy} | {seconds:.2f} | {busy:.2f} | {busy / seconds:.2f} | {mib:,.0f} |")
    for method, policy, seconds, _, busy in rows:
        ok = busy / seconds <= BUSY_TARGET
        print(f"- {'PASS' if ok else 'FAIL'}: {method}, {policy}: busy / quiet {busy / seconds:.2f} "
              f"(target <= {BUSY_TARGET:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
