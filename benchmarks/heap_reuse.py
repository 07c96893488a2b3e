"""What glibc's allocator settings cost a transfer training step: the default, the console script's eager return
of freed memory (`convert.memory.return_freed_memory_eagerly`: every block of 1 MiB or more mapped anew and faulted
in), and eager with the training loop inside `convert.memory.heap_kept` (what `--method transfer` does).

One step is transfer's: SmolLM2-135M's attention shape (576 wide, 9 query heads, 1 K/V head of 64), two
512-token windows, forward under bfloat16 autocast, the relative-error loss, backward, AdamW. Each setting runs in
its own process (the allocator's settings are process-wide), the settings interleaved `--repeats` times; the
table gives the median step time, the page faults per step and the system time, with the ratio to the default.

    python benchmarks/heap_reuse.py --steps 60 --repeats 2

A benchmark, never a test. stdout is the markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MODES = ("default", "eager", "eager + heap_kept")

CHILD = r"""
import json, resource, sys, time, torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
import gqakit.convert.memory as memory
mode, steps = sys.argv[1], int(sys.argv[2])
if mode != "default":
    memory.return_freed_memory_eagerly()
cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=1, head_dim=64,
                  max_position_embeddings=2048)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
attention = LlamaAttention(cfg, 0)
optimizer = torch.optim.AdamW(attention.parameters(), lr=1e-4)
x, y = torch.randn(2, 512, 576), torch.randn(2, 512, 576)
cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(512)[None])

def step():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    loss = (out.float() - y).pow(2).sum() / y.pow(2).sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()

with memory.heap_kept() if mode == "eager + heap_kept" else memory.contextlib.nullcontext():
    for _ in range(5):
        step()
    before, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"times": times, "faults": (after.ru_minflt - before.ru_minflt) / steps,
                  "sys": after.ru_stime - before.ru_stime}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    runs = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.steps)], capture_output=True, text=True,
                                 check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {m: statistics.median(t for r in rs for t in r["times"]) for m, rs in runs.items()}
    print(f"## A transfer step (SmolLM2 attention shape, 2 x 512 tokens, bf16 autocast), {args.steps} steps x "
          f"{args.repeats} runs per setting\n")
    print("| allocator | median ms / step | vs default | page faults / step | system s / run |")
    print("|---|---|---|---|---|")
    for mode, rs in runs.items():
        print(f"| {mode} | {1000 * medians[mode]:.1f} | {medians[mode] / medians['default']:.2f}x | "
              f"{statistics.median(r['faults'] for r in rs):,.0f} | {statistics.median(r['sys'] for r in rs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
