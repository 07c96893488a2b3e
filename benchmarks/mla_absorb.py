"""One decode step of latent attention with a filled cache: the stock DeepseekV3 path, which re-expands the whole
cached latent through kv_b_proj into every head's keys and values at every step, against the same step with
kv_b_proj absorbed into the query and output sides (DeepSeek-V2's weight absorption), and MQA's step beside them.

Per layer, for one new token against T cached positions (H heads, head_dim d, latent r + 1, RoPE key D = d, no
position-free key part: what `convert-gqa --to mla` writes from an MQA):

- stock: K_h = [k_rot], V_h = W_uv,h c for every cached c (an H x T x d expansion), then sdpa over H heads;
- absorbed: scores from q_rot . k_rot (the shared key), p = softmax, then o_h = W_uv,h (sum_t p_t c_t): the latent
  is read once per head, never expanded (r + 1 values per position instead of H x d);
- MQA: sdpa over H heads reading one K/V head (expanded views).

All three compute the same output (checked here to 1e-4 relative before timing). Medians of --repeats single
steps, side by side in one process, in an interleaved order.

    python benchmarks/mla_absorb.py                       # SmolLM2's MLA shape, T = 1k, 4k, 16k
    python benchmarks/mla_absorb.py --contexts 256 --repeats 3   # seconds

A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from _measure import command_line, median_p90


def stock(q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, up_v: torch.Tensor) -> torch.Tensor:
    """q (H, d), latent (T, r + 1), k_rot (T, d), up_v (H, d, r + 1) -> (H, d): expand, then attend."""
    heads, d = q.shape
    values = torch.einsum("hdr,tr->htd", up_v, latent)  # (H, T, d): the expansion the stock class does each step
    keys = k_rot.expand(heads, -1, -1)
    return torch.nn.functional.scaled_dot_product_attention(q[:, None], keys, values)[:, 0]


def absorbed(q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, up_v: torch.Tensor) -> torch.Tensor:
    """The same output with kv_b_proj applied after the attention-weighted sum of latents."""
    probs = torch.softmax(q @ k_rot.T / math.sqrt(q.shape[-1]), dim=-1)  # (H, T)
    mixed = probs @ latent  # (H, r + 1)
    return torch.einsum("hdr,hr->hd", up_v, mixed)


def mqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    heads = q.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(q[:, None], k.expand(heads, -1, -1),
                                                           v.expand(heads, -1, -1))[:, 0]


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="layers per token (the table's ms/token multiplies by it)")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    H, d = args.heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    up_v = torch.randn(H, d, d + 1, generator=g) / math.sqrt(d)
    up_v[..., d] = 0  # the bias coordinate's column
    rows = []
    with torch.inference_mode():
        for T in (int(x) for x in args.contexts.split(",")):
            q = torch.randn(H, d, generator=g)
            latent = torch.cat([torch.randn(T, d, generator=g), torch.ones(T, 1)], dim=-1)
            k_rot = torch.randn(T, d, generator=g)
            v = latent[:, :d] @ up_v[0, :, :d].T  # MQA's one value head (head 0's view of the latent)
            reference = stock(q, latent, k_rot, up_v)
            err = (absorbed(q, latent, k_rot, up_v) - reference).norm() / reference.norm()
            if err > 1e-4:
                raise SystemExit(f"absorbed and stock differ at T={T}: relative {err:.2e}")
            times = {"stock": [], "absorbed": [], "mqa": []}
            for _ in range(args.repeats + 1):  # interleaved; the first round is a warm-up
                times["stock"].append(timed(stock, q, latent, k_rot, up_v))
                times["absorbed"].append(timed(absorbed, q, latent, k_rot, up_v))
                times["mqa"].append(timed(mqa, q, k_rot, v))
            med = {k: median_p90(v[1:])[0] for k, v in times.items()}
            rows.append((T, med))
    print(f"## One decode step of latent attention: stock expansion vs absorbed kv_b_proj vs MQA\n\n"
          f"`{command_line(__file__, argv)}`\n\n{H} heads of {d}, latent {d + 1} + RoPE key {d}, fp32, "
          f"{torch.get_num_threads()} CPU thread(s), torch {torch.__version__}; median of {args.repeats} steps of "
          f"one layer; ms/token = x {args.layers} layers.\n")
    print("| context | stock ms/token | absorbed ms/token | MQA ms/token | stock / absorbed | absorbed / MQA |")
    print("|---|---|---|---|---|---|")
    for T, m in rows:
        s, a, q = (1e3 * args.layers * m[k] for k in ("stock", "absorbed", "mqa"))
        print(f"| {T:,} | {s:.1f} | {a:.1f} | {q:.1f} | {s / a:.2f}x | {a / q:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
