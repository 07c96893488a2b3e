"""Decode speed with a filled KV cache: MHA vs GQA vs MQA vs MLA, and with attention sinks.

For each number of K/V heads (default: the model's heads, a GQA count, 1) and each context length (default 1k,
4k, 16k tokens), the cache is filled directly with random keys and values of that length (the contents do not
change the cost of attending to them, and a 16k-token prefill of a 135M model would take minutes on a CPU), then
`--decode` single-token steps are timed (median and p90), each feeding the previous step's argmax through the
model's own forward (sdpa). The same runs with gqakit's SinkCache (StreamingLLM: S sinks + W recent positions):
its cache never holds more than S + W positions, whatever the context. `mla` in --kv-heads adds latent attention
as `convert-gqa --to mla` writes it (transformers' stock DeepseekV3 holding an MQA exactly: a latent of head_dim + 1
and one shared RoPE key per token), whose cache is as small as MQA's but whose stock forward re-expands the whole
latent through kv_b_proj into every head's keys and values at every step (no weight absorption); sinks are refused
for it (they would re-rotate the latent). All configurations run side by side in one process, every one at a
context before the next context (each configuration's steps back to back), so ratios are comparable.

The model is a random model of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads of 64, intermediate 1536,
vocab 49,152; `--shape embedded` for the embedded model's 8 x 256 shape): speed depends on shapes, not weights.

    python benchmarks/decode_kv_heads.py                                  # SmolLM2 shape, 9/3/1 K/V heads, MLA
    python benchmarks/decode_kv_heads.py --contexts 256,1024 --decode 4   # seconds

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from _measure import cache_bytes, command_line, logger, median_p90
from gqakit.hf.compat import cache_kwargs

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    head_dim=64, vocab_size=49152, kv=(9, 3, 1, "mla")),
    "embedded": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                     head_dim=32, vocab_size=4096, kv=(8, 2, 1, "mla")),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                 vocab_size=256, kv=(4, 2, 1, "mla")),  # dry runs
    # Llama-3.2-1B's shape (its GQA-8 is the second K/V count): benchmarks/gpu/decode.py's default
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     head_dim=64, vocab_size=128256, kv=(32, 8, 4, 1)),
}


log = logger("decode_kv_heads")


def build(shape: dict, kv_heads: int | str, dtype: torch.dtype, max_positions: int, device="cpu"):
    """A random Llama of `shape` with `kv_heads` K/V heads (or "mla": the stock DeepseekV3 that `convert-gqa --to
    mla` writes from its MQA), its weights made directly on `device`."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

    from gqakit.hf.architectures.latent import latent_config, mqa_shape

    fields = {k: v for k, v in shape.items() if k != "kv"}
    cfg = LlamaConfig(**fields, num_key_value_heads=1 if kv_heads == "mla" else kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=True)
    if kv_heads == "mla":
        latent = mqa_shape(shape["num_attention_heads"], shape["head_dim"])
        cfg = DeepseekV3Config(**latent_config(cfg.to_dict(), latent, shape["num_hidden_layers"]))
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()


def cached_shapes(cfg, batch: int, context: int) -> tuple[tuple, tuple]:
    """The shapes of one layer's cached keys and values for `batch` rows of `context` positions (latent attention
    caches its latent and its shared RoPE key, one "head" each)."""
    if getattr(cfg, "kv_lora_rank", None):
        return (batch, 1, context, cfg.kv_lora_rank), (batch, 1, context, cfg.qk_rope_head_dim)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    return shape, shape


def filled_cache(model, context: int, sinks: tuple[int, int] | None, dtype: torch.dtype, seed: int,
                 batch: int = 1):
    """A cache holding `context` positions of random keys and values for `batch` rows, on the model's device (a
    SinkCache keeps S + W of them)."""
    from transformers import DynamicCache

    from gqakit.decode.cache import SinkCache

    cfg, device = model.config, model.device
    cache = DynamicCache() if sinks is None else SinkCache(*sinks, rope=model)
    g = torch.Generator(device).manual_seed(seed)
    shape, second = cached_shapes(cfg, batch, context)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, generator=g, device=device, dtype=dtype),
                     torch.randn(second, generator=g, device=device, dtype=dtype), layer)
    return cache


@torch.no_grad()
def time_decode(model, cache, context: int, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    token = torch.randint(model.config.vocab_size, (1, 1), generator=g)
    times = []
    for step in range(steps + 1):  # the first step is an untimed warm-up
        position = torch.tensor([[context + step]])
        t0 = time.perf_counter()
        logits = model(token, **cache_kwargs(model, cache), position_ids=position, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        if step:
            times.append(time.perf_counter() - t0)
    return times


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--kv-heads", default=None,
                   help="comma list of K/V head counts and `mla` (default: the shape's heads, a GQA count, 1, mla)")
    p.add_argument("--contexts", default="1024,4096,16384", help="tokens already in the cache (comma list)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--decode", type=int, default=16, help="timed single-token steps per configuration")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    kv_list = ([x if x == "mla" else int(x) for x in args.kv_heads.split(",")] if args.kv_heads
               else list(shape["kv"]))
    contexts = sorted(int(x) for x in args.contexts.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    models = {kv: build(shape, kv, dtype, max(contexts) + args.decode + 8) for kv in kv_list}
    results = {}
    for context in contexts:  # every configuration at one context before the next context
        for kv, model in models.items():
            for sinks in (None, (args.sinks, args.window)):
                if sinks is not None and (context <= sum(sinks) or kv == "mla"):
                    continue  # the sink cache holds everything (the same as the plain cache), or is refused (MLA)
                cache = filled_cache(model, context, sinks, dtype, args.seed)
                median, p90 = median_p90(time_decode(model, cache, context, args.decode, args.seed))
                results[kv, sinks is not None, context] = {
                    "median": median, "p90": p90, "bytes": cache_bytes(cache.layers),
                    "held": cache.layers[0].keys.shape[-2]}
                del cache
                log(f"K/V heads {kv}, context {context:,}{', sinks' if sinks else ''}: "
                    f"{1e3 * results[kv, sinks is not None, context]['median']:.1f} ms/token")

    command = command_line(__file__, argv)
    heads = shape["num_attention_heads"]
    print(f"## Decode tokens/s with a filled KV cache: MHA vs GQA vs MQA, with and without sinks\n\n`{command}`\n")
    print(f"Random model of the {args.shape} shape: {shape['num_hidden_layers']} layers, "
          f"hidden {shape['hidden_size']}, {heads} heads of {shape['head_dim']}, vocab {shape['vocab_size']:,}; "
          f"{args.dtype}, sdpa, "
          f"{torch.get_num_threads()} CPU thread(s), torch {torch.__version__}. Median (p90) of {args.decode} "
          f"single-token steps; sinks: SinkCache(S={args.sinks}, W={args.window}).\n")
    def name(kv) -> str:
        return "MLA" if kv == "mla" else "MHA" if kv == heads else ("MQA" if kv == 1 else f"GQA-{kv}")

    # the ratios are against MHA where it was measured, else the first head count given (the header says which)
    base_kv = heads if heads in kv_list else next((kv for kv in kv_list if kv != "mla"), kv_list[0])
    print(f"| K/V heads | cache | context | tokens/s, median (p90) | vs {name(base_kv)}, same cache and context | "
          "cache MiB | positions held |")
    print("|---|---|---|---|---|---|---|")
    for context in contexts:
        for sink in (False, True):
            for kv in kv_list:
                r = results.get((kv, sink, context))
                if r is None:
                    continue
                base = results.get((base_kv, sink, context))  # MLA has no sinks row
                ratio = f"{base['median'] / r['median']:.2f}x" if base else "-"
                label = "latent + RoPE key (MLA)" if kv == "mla" else f"{kv} ({name(kv)})"
                print(f"| {label} | {'sinks' if sink else 'full'} | {context:,} | {1 / r['median']:.1f} "
                      f"({1 / r['p90']:.1f}) | {ratio} | {r['bytes'] / 2**20:.1f} | {r['held']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
