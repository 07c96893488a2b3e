"""Decode on one GPU: MHA vs GQA vs MQA of a 1B-class Llama shape (random bf16 weights), per batch and context.

For each K/V head count (default Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads of 64, intermediate
8,192, vocab 128,256; K/V heads 32, 8, 4, 1), batch B and context T: the KV cache is filled with T positions of
random keys and values (`decode_kv_heads.filled_cache`, on the GPU), then `--decode` single-token steps are timed
(each synchronised). Reported per cell: decode tokens/s (B / median step), time to first token (a prefill forward
of B x T random tokens plus the argmax, where B x T <= --ttft-tokens), peak device memory, the KV bytes per token
read off the cache's tensors, and which SDPA kernel ran in decode and in prefill (the CUDA kernel names of one
profiled call: flash, efficient, cudnn or math; transformers passes `enable_gqa` to sdpa only with no mask and
head_dim <= 256). Then, per K/V count, the largest batch whose cache of --fit-contexts positions plus one decode
step fits (doubling, then bisecting, catching out-of-memory). A cell whose cache alone would exceed
--memory-fraction of the free memory is not tried; every K/V count gets an equal share of --budget-s.

With --captured (the default on CUDA) each cell is timed a second time as a server runs decode: a static cache,
attention that reads each cached K/V head once (transformers' sdpa path repeats K/V to every head whenever it has
a mask), and the step captured once as a CUDA graph and replayed (benchmarks/gpu/captured.py): the "graph"
columns. The eager step is host-bound on the device image, so only the graph columns show what fewer K/V heads
save in time.

MLA is the stock DeepseekV3 that `convert-gqa --to mla` writes (a latent of head_dim + 1 and one shared RoPE key
per token: MQA's cache, re-expanded through kv_b_proj into every head at each step): see MLA_VARIANTS.

    python benchmarks/gpu/decode.py --json decode.json          # on the GPU (~2 min)
    python benchmarks/gpu/decode.py --dry-run                   # CPU, tiny shape, seconds

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys

from _gpu import (Budget, classify_kernels, free_bytes, is_oom, kernels_of, peak_bytes, pick_device, release,
                  reset_peak, sync, timed, versions, write_json)
from _measure import cache_bytes, logger
from decode_kv_heads import SHAPES, build, cached_shapes, filled_cache

log = logger("gpu/decode")
# Further rows beside the K/V-head variants: (label, builder(shape, dtype, max_positions, device) -> model).
MLA_VARIANTS: list[tuple[str, object]] = [
    ("MLA", lambda shape, dtype, positions, device: build(shape, "mla", dtype, positions, device))]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--kv-heads", default=None, help="comma list (default: the shape's)")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--decode", type=int, default=8, help="timed single-token steps per cell (after 2 warm-up)")
    p.add_argument("--ttft-tokens", type=int, default=131072, help="time the prefill where B x T is at most this")
    p.add_argument("--fit-contexts", default="4096,32768", help="contexts of the largest-batch probe")
    p.add_argument("--fit-cap", type=int, default=4096, help="largest batch the probe tries")
    p.add_argument("--memory-fraction", type=float, default=0.85)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--captured", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the captured step (static cache, grouped attention, CUDA graph)")
    p.add_argument("--budget-s", type=float, default=110.0, help="time for the whole script (seconds)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="CPU, the tiny shape and sizes (seconds)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.batches, args.contexts, args.decode = "tiny", "1,2", "32,64", 2
        args.ttft_tokens, args.fit_contexts, args.fit_cap, args.dtype = 128, "64", 4, "float32"
    args.capture_error = None  # the first failed capture's line: eager only from there
    return args


def label(kv: int, heads: int) -> str:
    return "MHA" if kv == heads else ("MQA" if kv == 1 else f"GQA-{kv}")


def kv_bytes(cfg, batch: int, context: int, element: int) -> int:
    """What a full cache of `context` positions holds: keys and values of every layer (a latent model: its latent
    and shared RoPE key), at the shapes `filled_cache` and `static_cache` fill."""
    keys, values = cached_shapes(cfg, batch, context)
    return cfg.num_hidden_layers * (math.prod(keys) + math.prod(values)) * element


def decode_step(model, cache, token, position):
    from gqakit.hf.compat import cache_kwargs

    logits = model(token, **cache_kwargs(model, cache), position_ids=position, use_cache=True).logits
    return logits[:, -1:].argmax(-1)


def one_cell(model, batch: int, context: int, args, device, dtype, probe: bool) -> dict:
    """Decode (and prefill) figures of one (batch, context) cell."""
    import torch

    reset_peak(device)
    cache = filled_cache(model, context, None, dtype, seed=0, batch=batch)
    token = torch.randint(model.config.vocab_size, (batch, 1), device=device)
    steps = iter(range(10**9))

    def step():
        nonlocal token
        position = torch.full((batch, 1), context + next(steps), device=device)
        with torch.no_grad():
            token = decode_step(model, cache, token, position)

    times = timed(step, device, warmup=2, repeats=args.decode)
    row = {"tokens_per_s": batch / statistics.median(times), "step_ms": 1e3 * statistics.median(times),
           "kv_bytes_per_token": cache_bytes(cache.layers) / (batch * cache.layers[0].keys.shape[-2]),
           "peak_gib": None}
    if probe:
        row["decode_kernel"] = classify_kernels(kernels_of(step, device))
    peak = peak_bytes(device)
    row["peak_gib"] = None if peak is None else peak / 2**30
    del cache
    release(device)
    if args.captured and not args.capture_error:
        try:
            row.update(captured_cell(model, batch, context, args, device, dtype))
        except Exception as e:  # noqa: BLE001 - out of memory skips the cell; any other failure stops capturing
            if not is_oom(e):
                args.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                log(f"captured step failed, eager only from here: {args.capture_error}")
            row["graph_skipped"] = "out of memory" if is_oom(e) else "capture failed"
    if batch * context <= args.ttft_tokens:
        prompt = torch.randint(model.config.vocab_size, (batch, context), device=device)

        def prefill():
            with torch.no_grad():
                model(prompt, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)  # as generate() does

        row["ttft_ms"] = 1e3 * statistics.median(timed(prefill, device, warmup=1, repeats=2))
        if probe:
            row["prefill_kernel"] = classify_kernels(kernels_of(prefill, device))
        release(device)
    return row


def captured_cell(model, batch: int, context: int, args, device, dtype) -> dict:
    """The same cell's decode replayed from a captured step over a static cache (captured.py)."""
    from captured import CapturedDecoder, register, static_cache

    eager = model.config._attn_implementation
    model.set_attn_implementation(register())
    try:
        warmup = 2  # timed's, after the decoder's own capture warm-up
        room = CapturedDecoder.WARMUP + warmup + args.decode + 1
        cache = static_cache(model, batch, context, room, dtype, seed=0)
        decoder = CapturedDecoder(model, cache, batch, context, room)
        times = timed(decoder.step, device, warmup=warmup, repeats=args.decode)
        return {"graph_tokens_per_s": batch / statistics.median(times), "graph_step_ms": 1e3 * statistics.median(times),
                "graph_captured": decoder.graph is not None}
    finally:
        model.set_attn_implementation(eager)
        cache = decoder = None
        release(device)


def fits(model, batch: int, context: int, dtype, device) -> bool:
    import torch

    cache = None
    try:
        cache = filled_cache(model, context, None, dtype, seed=0, batch=batch)
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            decode_step(model, cache, token, torch.full((batch, 1), context, device=device))
        sync(device)
        return True
    except Exception as e:  # noqa: BLE001 - out of memory is the answer; anything else is re-raised
        if not is_oom(e):
            raise
        return False
    finally:
        del cache
        release(device)


def largest_batch(model, context: int, cap: int, dtype, device, budget: Budget) -> int | None:
    """The largest batch (up to `cap`) whose cache and one decode step fit: doubling, then 3 bisection steps."""
    good, bad = 0, None
    batch = 1
    while batch <= cap and not budget.over():
        if not fits(model, batch, context, dtype, device):
            bad = batch
            break
        good, batch = batch, batch * 2
    for _ in range(3):
        if bad is None or bad - good <= 1 or budget.over():
            break
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(model, mid, context, dtype, device) else (good, mid)
    return good or None


def run_variant(name: str, model, args, device, dtype, budget: Budget) -> dict:
    cfg = model.config
    element = dtype.itemsize
    cells, fit = {}, {}
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    for context in contexts:
        for batch in batches:
            key = f"{batch}x{context}"
            free = free_bytes(device)
            need = kv_bytes(cfg, batch, context, element)
            if free is not None and need > args.memory_fraction * free:
                cells[key] = {"skipped": f"cache {need / 2**30:.1f} GiB > {args.memory_fraction:g} of free "
                                         f"{free / 2**30:.1f} GiB"}
                continue
            if budget.over():
                cells[key] = {"skipped": "time budget"}
                continue
            cells[key] = None
            try:
                cells[key] = one_cell(model, batch, context, args, device, dtype, probe=batch == batches[0])
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    raise
            if cells[key] is None:  # out of memory; released after the except block, whose traceback held the
                release(device)  # cell's tensors (the next cell's free-memory reading would count them as taken)
                cells[key] = {"skipped": "out of memory"}
            log(f"{name} B={batch} T={context}: {cells[key]}")
    for context in (int(x) for x in args.fit_contexts.split(",")):
        fit[str(context)] = largest_batch(model, context, args.fit_cap, dtype, device, budget)
        log(f"{name} largest batch at T={context}: {fit[str(context)]}")
    return {"kv_heads": cfg.num_key_value_heads, "cells": cells, "largest_batch": fit}


def graph_vs_mha(results: dict) -> dict:
    """{context: {variant: (batch, ratio)}}: each variant's captured tok/s over MHA's at the largest batch where both
    ran at that context (MHA's cache is the first not to fit)."""
    variants = results["variants"]
    if "MHA" not in variants:
        return {}
    graph = {name: {tuple(int(x) for x in key.split("x")): c["graph_tokens_per_s"]
                    for key, c in res["cells"].items() if "graph_tokens_per_s" in c}
             for name, res in variants.items()}
    out: dict = {}
    for (batch, context), mha in sorted(graph["MHA"].items()):
        for name, cells in graph.items():
            if name != "MHA" and (batch, context) in cells:
                out.setdefault(str(context), {})[name] = (batch, cells[batch, context] / mha)
    return out


def table(results: dict, args) -> list[str]:
    rows = ["| variant | batch | context | decode tok/s | step ms | graph tok/s | graph step ms | TTFT ms | peak GiB | "
            "KV bytes/token | decode kernel | prefill kernel |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for name, res in results["variants"].items():
        for key, c in res["cells"].items():
            batch, context = key.split("x")
            if "skipped" in c:
                rows.append(f"| {name} | {batch} | {context} | {c['skipped']} |  |  |  |  |  |  |  |  |")
                continue
            rows.append(f"| {name} | {batch} | {context} | {c['tokens_per_s']:,.0f} | {c['step_ms']:.2f} | "
                        f"{fmt(c.get('graph_tokens_per_s'), ',.0f')} | {fmt(c.get('graph_step_ms'), '.2f')} | "
                        f"{fmt(c.get('ttft_ms'), '.1f')} | {fmt(c['peak_gib'], '.2f')} | "
                        f"{c['kv_bytes_per_token']:,.0f} | {c.get('decode_kernel', '')} | "
                        f"{c.get('prefill_kernel', '')} |")
    for name, _ in MLA_VARIANTS or [("MLA", None)]:
        if name not in results["variants"]:
            rows.append(f"| {name} | - | - | not built yet (MLA_VARIANTS in benchmarks/gpu/decode.py) |"
                        "  |  |  |  |  |  |  |  |")
    ratios = results["graph_vs_mha"]
    if ratios:
        rows += ["", "Captured step, each variant's tokens/s over MHA's at the largest batch both ran:", "",
                 "| context | " + " | ".join(f"{n} (batch)" for n in results["variants"] if n != "MHA") + " |",
                 "|---|" + "---|" * (len(results["variants"]) - 1)]
        for context, by in ratios.items():
            rows.append(f"| {context} | " + " | ".join(
                f"{by[n][1]:.2f}x ({by[n][0]})" if n in by else "-" for n in results["variants"] if n != "MHA") + " |")
    rows += ["", "| variant | " + " | ".join(f"largest batch at T={c}" for c in args.fit_contexts.split(",")) + " |",
             "|---|" + "---|" * len(args.fit_contexts.split(","))]
    for name, res in results["variants"].items():
        rows.append(f"| {name} | " + " | ".join(str(res["largest_batch"].get(c) or "-")
                                                for c in args.fit_contexts.split(",")) + " |")
    return rows


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    device = pick_device(args.dry_run)
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    kv_list = [int(x) for x in args.kv_heads.split(",")] if args.kv_heads else [
        kv for kv in shape["kv"] if kv != "mla"]
    positions = max(int(c) for c in args.contexts.split(",")) + 64
    variants = [(label(kv, shape["num_attention_heads"]), lambda kv=kv: build(shape, kv, dtype, positions, device))
                for kv in kv_list]
    variants += [(name, lambda make=make: make(shape, dtype, positions, device)) for name, make in MLA_VARIANTS]
    results = {"versions": versions(device), "shape": args.shape, "dtype": args.dtype, "variants": {}}
    total = Budget(args.budget_s)
    interrupted = False
    try:
        for i, (name, make) in enumerate(variants):
            share = Budget(max(total.left(), 0) / (len(variants) - i))  # an equal share of what is left
            log(f"building {name}")
            model = make()
            results["variants"][name] = run_variant(name, model, args, device, dtype, share)
            del model
            release(device)
    except KeyboardInterrupt:  # run.sh's timeout interrupts (SIGINT): keep and report the variants that finished
        interrupted = True
    print(f"## Decode on {results['versions'].get('gpu', 'cpu')}: {args.shape} shape, {args.dtype}, sdpa\n")
    print(f"torch {torch.__version__}; median of {args.decode} synchronised single-token steps after 2 warm-up; "
          f"tokens/s = batch / step; TTFT = one prefill of batch x context tokens and its argmax. "
          f"graph: the step captured as a CUDA graph over a static cache with grouped attention (captured.py; run "
          f"eagerly off CUDA).\n")
    results["graph_vs_mha"] = graph_vs_mha(results)
    print("\n".join(table(results, args)))
    checks = [f"{name}: no cell ran" for name, res in results["variants"].items()
              if not any("tokens_per_s" in c for c in res["cells"].values())]
    if args.captured:
        checks += [f"{name}: no captured cell ran" for name, res in results["variants"].items()
                   if any("tokens_per_s" in c for c in res["cells"].values())
                   and not any("graph_tokens_per_s" in c for c in res["cells"].values())]
        if args.capture_error:
            checks.append(f"captured step: {args.capture_error}")
    if interrupted:
        checks.append(f"interrupted at the time limit after {len(results['variants'])} of {len(variants)} variants")
    results["failed_checks"] = checks
    write_json(args.json, results)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
