"""Does calibrating and merging a Llama-2-7B-shaped checkpoint stay within the conversion's memory bound
plus one layer's statistics? (issue 13)

Synthesises a bf16 MHA Llama of the given shape (HF tensor names, <= 5 GB shards and an index; random
N(0, 1/in) weights so that heads differ and activations stay finite) with the embedded model's tokenizer,
then runs, side by side in one run and as subprocesses, `convert-gqa --groups G` with
`--method mean` (the streaming bound), `--method aligned` (one layer's attention held and merged) and
`--method fit --calibration TEXT` (the layer-by-layer calibration pass, then the merge), optionally
`--methods ... transfer` (fit, then each layer trained for `--transfer-steps`), and the latent-attention
paths of `--to mla` (`LATENT`: `mla`, the MQA merge held exactly; `mla-fit`, a latent of `--kv-rank` fitted from
the weights; `mla-fit-transfer`, that fit trained per layer; `mla-bias-free`, the bias-free latent trained), whose
bound is the issue's 2 GiB, and prints each one's wall time and peak RSS (the converter's own VmHWM, which it
writes at exit: ru_maxrss from wait4 would include this process's RSS at the fork) next to what the design
predicts:

* calibration holds one window's hidden states and attention probabilities and one block of one weight while
  a layer runs (the decoder layer's linears are streamed from the shards in row blocks, and the windows'
  hidden states, attention inputs and attention terms wait on disk), then one hidden x hidden float64 sum at
  a time, each summed alone over the windows and written to the layer's file;
* the merge holds the layer's four attention weights in their stored dtype, one column block of one
  statistic at a time (read from the layer's file), and the value rows' Gram (K d x K d, float32 for
  16-bit weights); nothing n x n in float64.

The issue's bound is the streaming conversion's peak (mean) plus one layer's statistics; the report
prints the verdict from the measured peaks.

Neither depends on the number of layers: `--layers 8` and the default 32 give the same peak.

    python benchmarks/calibration_memory.py                 # 7B shape, 32 layers: ~14 GB of scratch disk
    python benchmarks/calibration_memory.py --layers 4      # same layer shape, fewer layers
    python benchmarks/calibration_memory.py --preset small  # seconds
    python benchmarks/calibration_memory.py --layers 2 --tokens 256 --methods mean mla mla-fit mla-fit-transfer \
        mla-bias-free                                       # latent attention at the 7B layer shape

Progress goes to stderr; stdout is the markdown report.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _measure import (MIB, PRESETS, PRIDE, ROOT, converter_command, entries_bytes, llama_entries, logger,
                      run_child, write_random_llama)
from gqakit.convert.calibration.runner import MLP_TOKENS
from gqakit.convert.methods.grams import BLOCK
from gqakit.convert.output import max_shard_bytes

log = logger("calibration_memory")

FIT = ("--kv-rank", "{rank}", "--rope-dim", "{rope}")
LATENT = {  # --methods entries for latent attention: convert-gqa's flags after `--groups 1 --to mla`
    "mla": ("--method", "mean"),  # the MQA merge, embedded exactly
    "mla-fit": FIT,  # a latent fitted from the weights alone
    "mla-fit-transfer": (*FIT, "--method", "transfer"),  # that fit trained per layer
    "mla-bias-free": ("--bias-free", "--method", "transfer"),  # the MQA merge held bias-free, trained
}
LATENT_BOUND_MIB = 2048  # the goal for every latent path at the 7B layer shape


def method_flags(entry: str, groups: int, rank: int, rope: int) -> list[str]:
    """convert-gqa's flags for a `--methods` entry: a merge method to `groups` K/V heads, or a `LATENT` path."""
    if entry not in LATENT:
        return ["--groups", str(groups), "--method", entry]
    return ["--groups", "1", "--to", "mla", *(f.format(rank=rank, rope=rope) for f in LATENT[entry])]


def statistics_mib(shape) -> float:
    """One layer's calibration statistics: E[x x^T], the key and the value metric (float64), and two means."""
    return (3 * shape.hidden**2 + 2 * shape.hidden) * 8 / MIB


def transfer_mib(shape, window: int, batch: int = 2) -> float:
    """What `--method transfer` adds while a layer trains (fp32, q/k/v/o sized h x h at most): the teacher's and the
    student's attention weights, the student's gradients, AdamW's two moments, the best-scoring copy, the merged
    start and the original tensors read for the layer (8 x 4 h^2 floats), plus a batch's activations through the
    attention (inputs, q/k/v, probabilities, outputs and their gradients; a generous 16 x batch x window x h)."""
    h, heads = shape.hidden, shape.heads
    return (8 * 4 * h * h + 16 * batch * window * h + 4 * batch * heads * window * window) * 4 / MIB


def predicted(shape, window: int, weight_dtype_bytes: int = 2) -> dict[str, float]:
    """MiB the design says calibration and the merge hold besides the streaming conversion's own tensors."""
    h, i, heads = shape.hidden, shape.intermediate, shape.heads
    kv_rows = heads * (h // heads)
    return {
        "calibration: one of the layer's three statistics at a time (float64)": h * h * 8 / MIB,
        "calibration: one window's attention input and P x (float64)": 2 * window * h * 8 / MIB,
        "calibration: one window's hidden states, MLP activations of one chunk (fp32)":
            (window * h * 3 + min(window, MLP_TOKENS) * i * 3) * 4 / MIB,
        "calibration: one window's attention probabilities (fp32)": heads * window * window * 4 / MIB,
        "calibration: one block of a streamed weight (fp32, and its stored bytes)": 16 * 1.5,
        "merge: the layer's q/k/v/o in their stored dtype": 4 * h * h * weight_dtype_bytes / MIB,
        "merge: one column block of a statistic (float32 as stored, and float64)": BLOCK * h * (4 + 8) / MIB,
        "merge: the value rows' Gram (K d)^2 (float32 for 16-bit weights)": kv_rows**2 * 4 / MIB,
    }


def latent_fit_mib(shape, rank: int, rope: int) -> dict[str, float]:
    """MiB the latent fit (`convert/latent/fit.py`) holds at its peak, the SVD of L Y (M = G(N + d) rows, n = hidden
    columns, float64): L Y, torch's copy of it, U (M x m) and Vh (m x m), m = min(M, n), and gesdd's workspace of
    about 3 m^2; then the layer's q/k/v/o in their stored bf16."""
    d, n = shape.head_dim, shape.hidden
    rows = shape.heads * (2 * d - rope)
    m = min(rows, n)
    return {f"mla-fit: L Y ({rows:,} x {n:,}) and torch's copy of it (float64)": 2 * rows * n * 8 / MIB,
            f"mla-fit: the SVD's U and Vh (float64, {m:,} singular vectors)": (rows * m + m * m) * 8 / MIB,
            "mla-fit: gesdd's workspace, 3 min(M, n)^2 (float64)": 3 * m * m * 8 / MIB,
            "mla-fit: the layer's q/k/v/o in their stored dtype": 4 * n * n * 2 / MIB}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default 1024: 8 windows)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["mean", "aligned", "fit"])
    ap.add_argument("--transfer-steps", type=int, default=5, help="--method transfer: training steps per layer")
    ap.add_argument("--kv-rank", type=int, default=None, help="the mla-fit entries' latent rank (default: 3/2 "
                    "head_dim, with --rope-dim MQA's cache of 2 x head_dim + 1 values)")
    ap.add_argument("--rope-dim", type=int, default=None, help="the mla-fit entries' shared RoPE key (default: "
                    "head_dim / 2)")
    ap.add_argument("--scratch", default=str(ROOT / "scratch"), help="where the synthetic checkpoint goes "
                    "(git-ignored, as benchmarks/README.md says)")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each method, interleaved; medians are reported")
    args = ap.parse_args(argv)
    shape = PRESETS[args.preset]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    rope = args.rope_dim or shape.head_dim // 2
    rank = args.kv_rank or 2 * shape.head_dim - rope
    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    need = entries_bytes(llama_entries(shape)) * 2 + (2 << 30)
    if shutil.disk_usage(scratch).free < need:
        raise SystemExit(f"{scratch} needs about {need / 1e9:.1f} GB free; pass --scratch elsewhere")
    work = Path(tempfile.mkdtemp(prefix="calibration-memory-", dir=scratch))
    try:
        src = work / "llama-mha"
        log(f"synthesising a {shape.label(shape.heads)} bf16 checkpoint in {src} ...")
        start = time.perf_counter()
        write_random_llama(src, shape, max_shard_bytes(args.max_shard_size))
        log(f"written in {time.perf_counter() - start:.0f} s")
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in args.methods}
        for _ in range(args.repeats):  # interleaved, so that the machine's drift is shared by every method
            for method in args.methods:
                flags = method_flags(method, args.groups, rank, rope)
                cmd = [*converter_command(), str(src), "-o", str(work / method), "--quiet", *flags]
                if any(m in flags for m in ("fit", "transfer")):
                    cmd += ["--calibration", str(PRIDE), "--calibration-tokens", str(args.tokens),
                            "--calibration-window", str(args.window)]
                if "transfer" in flags:  # the peak is reached at the first step: a few steps measure it
                    cmd += ["--transfer-steps", str(args.transfer_steps)]
                log(" ".join(cmd[len(converter_command()):]))
                seconds, rss_kib = run_child(cmd, work)
                log(f"  {seconds:.1f} s, peak RSS {rss_kib / 1024:,.0f} MiB")
                runs[method].append((seconds, rss_kib / 1024))
                shutil.rmtree(work / method)
        rows = [(m, statistics.median(t for t, _ in r), statistics.median(p for _, p in r), [p for _, p in r])
                for m, r in runs.items()]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    windows = args.tokens // args.window
    parts = predicted(shape, args.window)
    if any(FIT[0] in LATENT[m] for m in args.methods if m in LATENT):
        parts |= latent_fit_mib(shape, rank, rope)
    base = next((rss for m, _, rss, _ in rows if m == "mean"), None)
    allowance = statistics_mib(shape)
    print(f"## Calibration and merge memory: {shape.label(args.groups)}, bf16, {windows} windows of {args.window} "
          f"calibration tokens, median of {args.repeats}\n")
    if any(m in LATENT for m in args.methods):
        print(f"The mla entries convert to latent attention with --groups 1 (mla-fit: --kv-rank {rank} --rope-dim "
              f"{rope}); their bound is {LATENT_BOUND_MIB:,} MiB of peak RSS.\n")
    print("| method | wall s | peak RSS MiB | runs | over mean MiB | within its bound |")
    print("|---|---|---|---|---|---|")
    for method, seconds, rss, peaks in rows:
        over = rss - base if base is not None else None
        bound = allowance + (transfer_mib(shape, args.window) if method == "transfer" else 0)
        if method in LATENT:
            verdict = "yes" if rss <= LATENT_BOUND_MIB else "**no**"
        else:
            verdict = "-" if over is None or method == "mean" else ("yes" if over <= bound else "**no**")
        print(f"| {method} | {seconds:.1f} | {rss:,.0f} | {', '.join(f'{p:,.0f}' for p in peaks)} | "
              f"{'-' if over is None else f'{over:,.0f}'} | {verdict} |")
    print(f"\nThe merge methods' bound is mean + one layer's statistics, {allowance:,.0f} MiB (3 x hidden^2 "
          f"float64); transfer's adds one layer's training state, {transfer_mib(shape, args.window):,.0f} MiB "
          "(`transfer_mib`).")
    print("\nWhat the design holds beyond the streaming conversion (MiB, computed from the shape; the calibration "
          "and merge phases do not overlap):\n")
    print("| part | MiB |")
    print("|---|---|")
    for name, mib in parts.items():
        print(f"| {name} | {mib:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
