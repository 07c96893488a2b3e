"""Does calibrating and merging a Llama-2-7B-shaped checkpoint stay within the conversion's memory bound
plus one layer's statistics? (issue 13)

Synthesises a bf16 MHA Llama of the given shape (HF tensor names, <= 5 GB shards and an index; random
N(0, 1/in) weights so that heads differ and activations stay finite) with the embedded model's tokenizer,
then runs, side by side in one run and as subprocesses, `convert-gqa --groups G` with
`--method mean` (the streaming bound), `--method aligned` (one layer's attention held and merged) and
`--method fit --calibration TEXT` (the layer-by-layer calibration pass, then the merge), optionally
`--methods ... transfer` (fit, then each layer trained for `--transfer-steps`), and prints each
one's wall time and peak RSS (the converter's own VmHWM, which it writes at exit: ru_maxrss from wait4
would include this process's RSS at the fork) next to what the design predicts:

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default 1024: 8 windows)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["mean", "aligned", "fit"])
    ap.add_argument("--transfer-steps", type=int, default=5, help="--method transfer: training steps per layer")
    ap.add_argument("--scratch", default=str(ROOT / "runs"), help="where the synthetic checkpoint goes")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each method, interleaved; medians are reported")
    args = ap.parse_args(argv)
    shape = PRESETS[args.preset]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
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
                cmd = [*converter_command(), "--groups", str(args.groups), str(src), "-o", str(work / method),
                       "--quiet", "--method", method]
                if method in ("fit", "transfer"):
                    cmd += ["--calibration", str(PRIDE), "--calibration-tokens", str(args.tokens),
                            "--calibration-window", str(args.window)]
                if method == "transfer":  # the peak is reached at the first step: a few steps measure it
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
    base = next((rss for m, _, rss, _ in rows if m == "mean"), None)
    allowance = statistics_mib(shape)
    print(f"## Calibration and merge memory: {shape.label(args.groups)}, bf16, {windows} windows of {args.window} "
          f"calibration tokens, median of {args.repeats}\n")
    print("| method | wall s | peak RSS MiB | runs | over mean MiB | within mean + one layer's statistics |")
    print("|---|---|---|---|---|---|")
    for method, seconds, rss, peaks in rows:
        over = rss - base if base is not None else None
        bound = allowance + (transfer_mib(shape, args.window) if method == "transfer" else 0)
        verdict = "-" if over is None or method == "mean" else ("yes" if over <= bound else "**no**")
        print(f"| {method} | {seconds:.1f} | {rss:,.0f} | {', '.join(f'{p:,.0f}' for p in peaks)} | "
              f"{'-' if over is None else f'{over:,.0f}'} | {verdict} |")
    print(f"\nOne layer's statistics: {allowance:,.0f} MiB (3 x hidden^2 float64); transfer's bound adds one "
          f"layer's training state, {transfer_mib(shape, args.window):,.0f} MiB (`transfer_mib`).")
    print("\nWhat the design holds beyond the streaming conversion (MiB, computed from the shape; the calibration "
          "and merge phases do not overlap):\n")
    print("| part | MiB |")
    print("|---|---|")
    for name, mib in parts.items():
        print(f"| {name} | {mib:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
