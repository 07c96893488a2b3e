"""Per-token decoding latency and KV-cache bytes deep into a stream: SinkCache vs DynamicCache.

Grows one stream with each cache by feeding random tokens in chunks (fast, not token by token) to
each checkpoint (default 1k, 10k, 20k tokens), then times single-token decode steps there (median
over `--decode` steps, greedy, each step feeding the previous step's argmax) and records the bytes
held by the cache. Model: the embedded reference model (gqakit/assets/austen-mha-8h) when present,
else a random Llama of the same shape (8 layers, hidden 256, 8 heads, vocab 4096). Both caches run
the plain `model(..., cache=cache)` path (`past_key_values=` before transformers 5.24) with the model's default
positions.

DynamicCache beyond the model's max_position_embeddings still measures time and memory faithfully,
but its outputs there are meaningless (positions the model never saw); SinkCache stays in range.
A benchmark, never a test.

    python benchmarks/sink_decoding.py                        # 1k / 10k / 20k
    python benchmarks/sink_decoding.py --lengths 256,1024 --window 124 --decode 8   # seconds

Progress goes to stderr; stdout is only the markdown report.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from _measure import cache_bytes, command_line, logger, median_p90
from gqakit.decode.cache import SinkCache
from gqakit.hf.compat import LOAD_KWARGS, cache_kwargs

FLAT_TARGET = 1.5  # SinkCache: latency at the deepest point <= 1.5x latency at the first


log = logger("sink_decoding")


def load_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    try:
        from gqakit.reference import reference_model_path

        path = reference_model_path()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **LOAD_KWARGS)
        return model.eval(), f"embedded reference model ({path.name})"
    except FileNotFoundError:
        cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        return model.eval(), "random Llama of the reference shape (reference model not built yet)"


@torch.no_grad()
def measure(model, make_cache, lengths: list[int], chunk: int, decode: int, seed: int) -> list[dict]:
    """Grow one stream to each length in chunks, then time `decode` single-token steps there."""
    cache = make_cache()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    fed, rows = 0, []
    for target in lengths:
        begin = time.perf_counter()
        while fed < target:
            n = min(chunk, target - fed)
            model(torch.randint(vocab, (1, n), generator=g), **cache_kwargs(model, cache), use_cache=True,
                  logits_to_keep=1)
            fed += n
        log(f"  fed {fed:,} tokens ({time.perf_counter() - begin:.1f} s)")
        token = torch.randint(vocab, (1, 1), generator=g)
        times = []
        for _ in range(decode):
            t0 = time.perf_counter()
            logits = model(token, **cache_kwargs(model, cache), use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
        fed += decode
        median, p90 = median_p90(times)
        rows.append({"tokens": target, "median_ms": 1e3 * median, "p90_ms": 1e3 * p90,
                     "bytes": cache_bytes(cache.layers), "held": cache.layers[0].keys.shape[-2]})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1000,10000,20000", help="stream depths to measure at (comma list)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--chunk", type=int, default=512, help="tokens per forward while growing the stream")
    p.add_argument("--decode", type=int, default=32, help="timed single-token steps per depth")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--skip-dynamic", action="store_true", help="measure SinkCache only")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, what = load_model(getattr(torch, args.dtype))
    cfg = model.config
    caches = {f"SinkCache(S={args.sinks}, W={args.window})":
              lambda: SinkCache(args.sinks, args.window, rope=model)}
    if not args.skip_dynamic:
        from transformers import DynamicCache

        caches["DynamicCache"] = DynamicCache
    with torch.no_grad():  # untimed warm-up: first-call allocations and kernel selection
        warm = SinkCache(args.sinks, args.window, rope=model)
        for n in (min(args.chunk, 64), 1, 1):
            model(torch.zeros(1, n, dtype=torch.long), **cache_kwargs(model, warm), use_cache=True)
    results = {}
    for name, make in caches.items():
        log(f"{name}: growing a stream to {', '.join(f'{n:,}' for n in lengths)} tokens")
        results[name] = measure(model, make, lengths, args.chunk, args.decode, args.seed)

    command = command_line(__file__, argv)
    print(f"## Decoding deep into a stream: SinkCache vs DynamicCache\n\n`{command}`\n")
    print(f"Model: {what}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} K/V heads, vocab {cfg.vocab_size}, "
          f"max_position_embeddings {cfg.max_position_embeddings}, {args.dtype}, sdpa, "
          f"{torch.get_num_threads()} CPU thread(s), torch {torch.__version__}. Latency: median (p90) of "
          f"{args.decode} single-token steps; stream grown in chunks of {args.chunk}.\n")
    print("| cache | tokens into stream | ms / token, median (p90) | positions held / layer | cache MiB |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        for r in rows:
            print(f"| {name} | {r['tokens']:,} | {r['median_ms']:.2f} ({r['p90_ms']:.2f}) | {r['held']:,} | "
                  f"{r['bytes'] / 2**20:.2f} |")
    sink = next(iter(results.values()))
    flat = sink[-1]["median_ms"] / sink[0]["median_ms"]
    constant = len({r["bytes"] for r in sink if r["tokens"] >= args.sinks + args.window}) <= 1
    bounded = all(r["held"] <= args.sinks + args.window for r in sink)
    print("\n| target | measured | limit | result |")
    print("|---|---|---|---|")
    print(f"| SinkCache positions held per layer | max {max(r['held'] for r in sink):,} | "
          f"<= S + W = {args.sinks + args.window:,} | {'PASS' if bounded else 'FAIL'} |")
    print(f"| SinkCache bytes once full | {'constant' if constant else 'growing'} | constant | "
          f"{'PASS' if constant else 'FAIL'} |")
    print(f"| SinkCache latency, deepest / first depth | {flat:.2f}x | <= {FLAT_TARGET}x | "
          f"{'PASS' if flat <= FLAT_TARGET else 'FAIL'} |")
    if not args.skip_dynamic and lengths[-1] > cfg.max_position_embeddings:
        print(f"\nDynamicCache rows past {cfg.max_position_embeddings:,} tokens (max_position_embeddings) measure "
              "time and memory only: the model's outputs there are not meaningful.")
    return 0 if bounded and constant and flat <= FLAT_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
