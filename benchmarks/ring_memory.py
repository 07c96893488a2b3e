"""Ring attention on CPU processes: per-rank peak memory against ring size, and bytes sent per rank.

One attention layer, batch 1, 8 query heads, head_dim 64, fp32, forward + backward, on P gloo
processes forked for each cell (one thread each):

  (a) per-rank peak memory for T = 4096, 8192, 16384 and P = 1, 2, 4 (causal, zigzag layout), for
      MHA and GQA. The local inputs q, k, v and a small warm-up call (gloo connections, lazy init) are
      in the baseline; two measures of what forward + backward ADD on a rank:
        live  peak of glibc's in-use bytes (mallinfo2: uordblks + hblkhd, all arenas), sampled after
              every aten op by a TorchDispatchMode: the memory the algorithm holds (activations,
              gradients, K/V and dK/dV buffers in flight), without freed-but-retained heap;
        RSS   ru_maxrss high-water mark after minus before: what the OS sees, including the heap
              glibc keeps after frees (noisier; it depends on allocation order).
      Expect about 1/P; the ring adds the next K/V block and one outgoing dK/dV partial (O(T/P)).
  (b) bytes each rank sends (forward, backward), from `gqakit.attention.ring.STATS`, at the largest T
      and P: MHA (G = H) against GQA (G = 2), full causal (zigzag) against a sliding window
      (W = 1024, contiguous layout, which only talks to the previous rank).

    python benchmarks/ring_memory.py                         # full run (~10 min on 2 cores)
    python benchmarks/ring_memory.py --memory-kv-heads 8     # MHA rows only in table (a) (~6 min)
    python benchmarks/ring_memory.py --quick                 # T = 1024 2048, P = 1 2 (~15 s)

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _measure import live_peak, logger, maxrss_kib, mib
from gqakit.attention.masks import MaskSpec
from gqakit.attention.ring import STATS, RingLayout, ring_attention

MEMORY_TARGET = 1.5  # live per-rank peak at P ranks at most 1.5 x (peak at P = 1) / P
log = logger()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384], help="sequence lengths T")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="ring sizes P")
    p.add_argument("--heads", type=int, default=8, help="num_attention_heads")
    p.add_argument("--memory-kv-heads", type=int, nargs="+", default=[8, 2],
                   help="num_key_value_heads for table (a) (8 = MHA)")
    p.add_argument("--gqa-heads", type=int, default=2, help="num_key_value_heads of the GQA rows of table (b)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1024, help="sliding window for table (b)")
    p.add_argument("--block", type=int, default=128, help="block_q = block_k of the tiled kernel")
    p.add_argument("--quick", action="store_true", help="T = 1024 2048, P = 1 2, window 256")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.ranks, args.window = [1024, 2048], [1, 2], 256
    return args


def rank_body(rank: int, P: int, init: str, cfg: dict, queue) -> None:
    """One rank: warm up, then measure forward + backward of ring attention on local random shards."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(minutes=10))
    try:
        spec = MaskSpec(window=cfg["window"])
        H, G, d, block = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block"]

        def inputs(layout, seed):
            gen = torch.Generator().manual_seed(seed)
            shapes = [(1, H, layout.local_len, d)] + [(1, G, layout.local_len, d)] * 2
            return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]

        def step(layout, q, k, v):
            out = ring_attention(q, k, v, scale=d ** -0.5, layout=layout, spec=spec, block_q=block, block_k=block)
            out.backward(torch.ones_like(out))

        warm = RingLayout.for_spec(P, rank, 64 * P, spec)
        step(warm, *inputs(warm, 0))  # connections, allocator pools, lazy init: into the baseline
        layout = RingLayout.for_spec(P, rank, cfg["T"], spec)
        q, k, v = inputs(layout, rank + 1)
        dist.barrier()
        STATS.reset()
        before = maxrss_kib()  # KiB on Linux, a high-water mark
        with live_peak() as live:  # malloc's bytes in use above the level at entry, after every op
            step(layout, q, k, v)
        after = maxrss_kib()
        queue.put((rank, {"live_mib": live.peak / 2**20, "rss_mib": (after - before) / 1024, "kind": layout.kind,
                          "fwd": STATS.forward_bytes, "bwd": STATS.backward_bytes,
                          "inputs_mib": sum(t.numel() * 4 for t in (q, k, v)) / 2**20}))
    finally:
        dist.destroy_process_group()


def run_cell(P: int, **cfg) -> list[dict]:
    """Fork P ranks (the parent has only imported torch, so forking is cheap and safe) -> per-rank dicts."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_body, args=(P, os.path.join(tmp, "init"), cfg, queue), nprocs=P, join=True,
                           start_method="fork")
    results = dict(queue.get() for _ in range(P))
    return [results[r] for r in range(P)]


def memory_table(args) -> tuple[list[str], list[tuple[int, int, int, float]]]:
    rows = ["| K/V heads | T | P | layout | live peak MiB per rank (max) | vs P=1 | ideal 1/P | RSS peak MiB (max) "
            "| local q,k,v MiB | sent per rank MiB fwd / bwd (max) |", "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for G in args.memory_kv_heads:
        for T in args.seq:
            base = None
            for P in args.ranks:
                log(f"memory G={G} T={T} P={P}")
                res = run_cell(P, T=T, heads=args.heads, kv_heads=G, head_dim=args.head_dim, block=args.block,
                               window=None)
                live = max(r["live_mib"] for r in res)
                base = live if P == 1 else base
                ratio = live / base if base else float("nan")
                if P > 1 and base:
                    ratios.append((G, T, P, ratio))
                rows.append(f"| {G} | {T} | {P} | {res[0]['kind']} | {live:,.0f} | {ratio:.2f} | {1 / P:.2f} | "
                            f"{max(r['rss_mib'] for r in res):,.0f} | {res[0]['inputs_mib']:,.0f} | "
                            f"{mib(max(r['fwd'] for r in res))} / {mib(max(r['bwd'] for r in res))} |")
    return rows, ratios


def bytes_table(args) -> tuple[list[str], dict]:
    T, P = max(args.seq), max(args.ranks)
    rows = ["| K/V heads | mask | layout | fwd MiB per rank (mean / max) | bwd MiB per rank (mean / max) "
            "| total vs MHA full |", "|---|---|---|---|---|---|"]
    totals = {}
    for G in (args.heads, args.gqa_heads):
        for window in (None, args.window):
            log(f"bytes G={G} window={window} T={T} P={P}")
            res = run_cell(P, T=T, heads=args.heads, kv_heads=G, head_dim=args.head_dim, block=args.block,
                           window=window)
            fwd, bwd = [r["fwd"] for r in res], [r["bwd"] for r in res]
            totals[(G, window)] = sum(fwd) + sum(bwd)
            rel = totals[(G, window)] / totals[(args.heads, None)]
            rows.append(f"| {G} | {'causal' if window is None else f'window {window}'} | {res[0]['kind']} | "
                        f"{mib(sum(fwd) / P)} / {mib(max(fwd))} | {mib(sum(bwd) / P)} / {mib(max(bwd))} | "
                        f"{rel:.3f} |")
    return rows, totals


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"`python {shlex.join(sys.argv)}`\n")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, 1 thread per rank, gloo; batch 1, {args.heads} heads, "
          f"head_dim {args.head_dim}, fp32, forward + backward of one attention layer; tiled block {args.block}\n")
    rows, ratios = memory_table(args)
    print("### (a) per-rank peak memory added by forward + backward (causal)\n")
    print("\n".join(rows) + "\n")
    rows, totals = bytes_table(args)
    print(f"### (b) bytes sent per rank at T={max(args.seq)}, P={max(args.ranks)} (K and V forward; K, V and "
          "fp32 dK, dV backward)\n")
    print("\n".join(rows) + "\n")

    print("### verdicts\n")
    for G, T, P, ratio in ratios:
        ok = ratio <= MEMORY_TARGET / P
        print(f"- {'PASS' if ok else 'FAIL'}: G={G} T={T} P={P}: live per-rank peak {ratio:.2f}x of P=1 "
              f"(target <= {MEMORY_TARGET:g}/P = {MEMORY_TARGET / P:.2f})")
    H, G, W = args.heads, args.gqa_heads, args.window
    for window in (None, W):
        ratio = totals[(H, window)] / totals[(G, window)]
        print(f"- {'PASS' if ratio == H / G else 'FAIL'}: MHA sends {ratio:g}x the bytes of GQA "
              f"({'full' if window is None else f'window {W}'}; expected H/G = {H / G:g})")
    ratio = totals[(H, None)] / totals[(H, W)]
    print(f"- {'PASS' if ratio > 1 else 'FAIL'}: window {W} sends {ratio:.1f}x fewer bytes than full causal")


if __name__ == "__main__":
    main()
