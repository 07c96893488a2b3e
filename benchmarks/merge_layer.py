"""Wall time and memory of one layer's aligned / fit merge at a model's layer shape, in process.

A random bf16 MHA attention layer (q/k/v/o, HF layouts) and random positive semi-definite float32 key and
value statistics (the second moment of `--samples` random inputs, as a short calibration gives) are merged
by `gqakit.convert.run.merge_layer` exactly as `convert-gqa --method aligned|fit` merges a layer, statistics
read from a layer file in row blocks as the conversion reads them. Prints, per method, the median wall time
of `--repeats` runs and the peak RSS growth over the live memory before the merge (sampled every 5 ms; the
process returns freed blocks of 1 MiB and more to the OS, as `convert-gqa` does for these methods).

    OMP_NUM_THREADS=1 python benchmarks/merge_layer.py               # the Llama-2-7B layer shape
    OMP_NUM_THREADS=1 python benchmarks/merge_layer.py --hidden 1024 --heads 16
    python benchmarks/merge_layer.py --hidden 1024 --heads 16 --busy   # quiet and beside a co-runner

`--busy` times every method twice in one run: quiet, then while a bounded co-runner (another torch process doing
1024 x 1024 matmuls on every core, stopped at the end) shares the CPU; the target is a merge at most
2x its quiet time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

from co_runner import co_running
from gqakit.convert.calibration.calibrate import save_layer
from gqakit.common.memory import return_freed_memory_eagerly
from gqakit.convert.run import _read_stats, merge_layer


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def peak_during(fn):
    """(fn(), seconds, peak RSS growth in MiB over the RSS before), RSS sampled every 5 ms."""
    base, peak, done = resident_mib(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_mib())
            time.sleep(0.005)

    thread = threading.Thread(target=sample)
    thread.start()
    start = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
    return out, seconds, max(peak[0], resident_mib()) - base


BUSY_TARGET = 2.0  # issue 22: a merge at most 2x its quiet time beside one co-running torch process


def timed(method: str, plan, weights, stats, repeats: int) -> list[tuple[float, float]]:
    return [peak_during(lambda: merge_layer(plan, weights, "similarity", stats))[1:] for _ in range(repeats)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=512, help="random inputs behind each statistic")
    ap.add_argument("--methods", nargs="+", default=["aligned", "fit"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", action="store_true", help="also time each merge beside a co-running torch process")
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
            stats = (lambda names: _read_stats(Path(folder), 0, names)) if method == "fit" else None
            runs = timed(method, plan, weights, stats, args.repeats)
            busy = None
            if args.busy:
                with co_running():
                    busy = statistics.median(s for s, _ in timed(method, plan, weights, stats, args.repeats))
            rows.append((method, statistics.median(s for s, _ in runs), statistics.median(m for _, m in runs), busy))
            print(f"{method}: " + ", ".join(f"{s:.1f} s / +{m:.0f} MiB" for s, m in runs), file=sys.stderr)
    print(f"## One layer's merge: hidden {n}, {H} heads -> {args.groups} K/V heads, bf16, median of {args.repeats}\n")
    if not args.busy:
        print("| method | wall s | peak RSS growth MiB |")
        print("|---|---|---|")
        for method, seconds, mib, _ in rows:
            print(f"| {method} | {seconds:.1f} | {mib:,.0f} |")
        return 0
    print("| method | wall s, quiet | wall s, busy | busy / quiet | peak RSS growth MiB |")
    print("|---|---|---|---|---|")
    for method, seconds, mib, busy in rows:
        print(f"| {method} | {seconds:.2f} | {busy:.2f} | {busy / seconds:.2f} | {mib:,.0f} |")
    for method, seconds, _, busy in rows:
        ok = busy / seconds <= BUSY_TARGET
        print(f"- {'PASS' if ok else 'FAIL'}: {method} busy / quiet {busy / seconds:.2f} (target <= {BUSY_TARGET:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
