"""Does calibrating and merging a Llama-2-7B-shaped checkpoint stay within the conversion's memory bound
plus one layer's statistics? (issue 13)

Synthesises a bf16 MHA Llama of the given shape (HF tensor names, <= 5 GB shards and an index; random
N(0, 1/in) weights so that heads differ and activations stay finite) with the embedded model's tokenizer,
then runs, side by side in one run and as subprocesses, `convert-gqa --groups G` with
`--method mean` (the streaming bound), `--method aligned` (one layer's attention held and merged) and
`--method fit --calibration TEXT` (the layer-by-layer calibration pass, then the merge), and prints each
one's wall time and peak RSS (the child's own, from wait4) next to what the design predicts:

* calibration holds one decoder layer's weights in fp32 (read from the bf16 shards), the calibration
  activations (windows x tokens x hidden, fp32), one window's attention probabilities, and one layer's
  statistics (three hidden x hidden float64 sums, plus the float32 copy written to disk);
* the merge holds one layer's attention weights and its statistics in float64, and their whitened copies.

Neither depends on the number of layers: `--layers 8` and the default 32 give the same peak.

    python benchmarks/calibration_memory.py                 # 7B shape, 32 layers: ~14 GB of scratch disk
    python benchmarks/calibration_memory.py --layers 4      # same layer shape, fewer layers
    python benchmarks/calibration_memory.py --preset small  # seconds

Progress goes to stderr; stdout is the markdown report.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_speed import PRESETS, converter_command, llama_config, llama_entries, log, run_child  # noqa: E402

from gqakit.convert.checkpoint import ShardWriter  # noqa: E402
from gqakit.convert.run import parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "gqakit" / "assets" / "austen-mha-8h"
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"
MIB = 2**20


def synthesise(folder: Path, shape, max_shard_bytes: int, seed: int = 0) -> None:
    """config.json, tokenizer files and random bf16 shards, one tensor in memory at a time."""
    folder.mkdir(parents=True)
    config = llama_config(shape)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    entries = llama_entries(shape)
    writer = ShardWriter(folder, entries, max_shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    for name, _, dims in entries:
        if len(dims) == 1:  # norm weights: around 1
            t = 1 + 0.1 * torch.randn(dims, generator=gen)
        else:
            t = torch.randn(dims, generator=gen) / math.sqrt(dims[1])
        writer.write_tensor(name, t.to(torch.bfloat16))
        del t
    writer.finish()


def predicted(shape, windows: int, window: int) -> dict[str, float]:
    """MiB the design says calibration and the merge add over the streaming conversion."""
    h, i = shape.hidden, shape.intermediate
    layer_params = 4 * h * h + 3 * h * i + 2 * h
    stats = 3 * h * h * 8 + 2 * h * 8
    acts = windows * window * h * 4
    probs = shape.heads * window * window * 4
    attention = 4 * h * h * 8  # q, k, v, o in float64
    return {
        "layer fp32 weights": layer_params * 4 / MIB,
        "one layer's statistics (float64)": stats / MIB,
        "activations": acts / MIB,
        "attention probabilities (one window)": probs / MIB,
        "merge: attention weights (float64)": attention / MIB,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default 1024: 8 windows)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["mean", "aligned", "fit"])
    ap.add_argument("--scratch", default=str(ROOT / "runs"), help="where the synthetic checkpoint goes")
    ap.add_argument("--max-shard-size", default="5GB")
    args = ap.parse_args(argv)
    shape = PRESETS[args.preset]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    need = sum(math.prod(e[2]) * 2 for e in llama_entries(shape)) * 2 + (2 << 30)
    if shutil.disk_usage(scratch).free < need:
        raise SystemExit(f"{scratch} needs about {need / 1e9:.1f} GB free; pass --scratch elsewhere")
    work = Path(tempfile.mkdtemp(prefix="calibration-memory-", dir=scratch))
    rows = []
    try:
        src = work / "llama-mha"
        log(f"synthesising a {shape.label(shape.heads)} bf16 checkpoint in {src} ...")
        start = time.perf_counter()
        synthesise(src, shape, parse_size(args.max_shard_size))
        log(f"written in {time.perf_counter() - start:.0f} s")
        for method in args.methods:
            cmd = [*converter_command(), "--groups", str(args.groups), str(src), "-o", str(work / method),
                   "--quiet", "--method", method]
            if method == "fit":
                cmd += ["--calibration", str(TEXT), "--calibration-tokens", str(args.tokens),
                        "--calibration-window", str(args.window)]
            log(" ".join(cmd[len(converter_command()):]))
            seconds, rss_kib = run_child(cmd, work)
            log(f"  {seconds:.1f} s, peak RSS {rss_kib / 1024:,.0f} MiB")
            rows.append((method, seconds, rss_kib / 1024))
            shutil.rmtree(work / method)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    windows = args.tokens // args.window
    parts = predicted(shape, windows, args.window)
    base = next((rss for m, _, rss in rows if m == "mean"), None)
    print(f"## Calibration and merge memory: {shape.label(args.groups)}, bf16, {windows} windows of {args.window} "
          "calibration tokens\n")
    print("| method | wall s | peak RSS MiB | over mean MiB |")
    print("|---|---|---|---|")
    for method, seconds, rss in rows:
        over = f"{rss - base:,.0f}" if base is not None else "-"
        print(f"| {method} | {seconds:.1f} | {rss:,.0f} | {over} |")
    print("\nWhat the design holds beyond the streaming conversion (MiB, computed from the shape):\n")
    print("| part | MiB |")
    print("|---|---|")
    for name, mib in parts.items():
        print(f"| {name} | {mib:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
