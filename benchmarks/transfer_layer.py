"""Attention transfer on one layer, several training settings side by side: which defaults to ship.

Calibrates MODEL layer by layer up to `--layer` (as `convert-gqa --method transfer` does), merges that layer by
`fit`, and trains the merged attention once per setting in `--settings` (a JSON list of `TransferOptions` fields),
each from the same fit start, printing the held-out relative error of the layer's attention output before and
after, the error after on the fitting windows themselves (its gap to the held-out error is overfitting), and the
seconds each took (the teacher's targets and the held-out scores included). The SmolLM2 tables in
docs/results/transfer.md ("Attention transfer and cheap recovery") came from this script's maths, run on layer 4.

    python benchmarks/transfer_layer.py runs/smollm2-135m-gqa --groups 1 \\
        --calibration ../shared/corpora/austen/prideprejudice.txt --tokens 16384 --layer 4 \\
        --settings '[{"params": "kv"}, {"params": "qkvo"}]'

A benchmark, never a test. Progress goes to stderr; stdout is the markdown table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from gqakit.convert.calibration.runner import calibrate
from gqakit.convert.calibration.stored import load_layer
from gqakit.convert.options import ConvertConfig
from gqakit.convert.methods.engine import LayerMerge, merge_checkpoint_layer
from gqakit.convert.output import new_config
from gqakit.convert.prepare import prepare
from gqakit.convert.methods.transfer import (attend, attention_implementation, build_attention, output_error,
                                             transfer_merged_layer)
from gqakit.convert.options import TransferOptions
from gqakit.hf.checkpoint import load_tensor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--calibration", required=True)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layer", type=int, default=4)
    p.add_argument("--settings", default='[{"params": "kv"}, {"params": "qkvo"}]')
    args = p.parse_args(argv)
    settings = json.loads(args.settings)
    cfg = ConvertConfig(model_dir=args.model, groups=args.groups, output_dir=tempfile.mkdtemp() + "/out",
                        method="transfer", calibration=args.calibration, calibration_tokens=args.tokens,
                        progress=False)
    plan, config, tensors, _, calib = prepare(cfg)
    stats = Path(tempfile.mkdtemp(prefix="transfer-layer-"))
    rows = []
    try:
        for li in calibrate(config, plan.spec, tensors, calib.windows, calib.heldout, stats, "cpu", False,
                            with_inputs=True):
            if li.index < args.layer:
                continue
            i = li.index
            op = next(op for op in plan.ops if op.kind == "attn" and op.layer == i)
            heldout = load_layer(stats, i, ())[1]
            merged, _ = merge_checkpoint_layer(plan, tensors, i, op.sources, LayerMerge(stats=stats), heldout)
            prefix = plan.spec.q_proj.format(i=i).rpartition(".")[0] + "."
            original = {n[len(prefix):]: load_tensor(info, n) for n, info in tensors.items() if n.startswith(prefix)}
            start = {n[len(prefix):]: t for n, t in merged.items()}
            teacher = build_attention(li.attention_class, config, i, original, attention_implementation(config))
            fitting = torch.stack([li.read(w) for w in range(li.windows)])
            with torch.no_grad():
                targets = torch.stack([attend(teacher, x[None], li.attention_kwargs)[0] for x in fitting])
            for setting in settings:
                t0 = time.perf_counter()
                student, err = transfer_merged_layer(li.attention_class, config, new_config(config, plan, "auto"),
                                                     i, li.attention_kwargs, original, start, li.windows, li.read,
                                                     heldout["x"], stats, TransferOptions(**setting), "cpu", False)
                seconds = time.perf_counter() - t0
                err["fitting"] = output_error(student, fitting, targets, li.attention_kwargs)
                rows.append((setting, err, seconds, li.windows))
                print(f"[transfer_layer] {setting}: {err}", file=sys.stderr, flush=True)
            break
    finally:
        shutil.rmtree(stats, ignore_errors=True)
    print(f"## Attention transfer on layer {args.layer} of {args.model} ({args.groups} K/V heads), "
          f"{args.tokens:,} calibration tokens of `{args.calibration}`\n")
    print("| setting | fitting windows | held-out error, fit start | after | error on the fitting windows, after "
          "| steps | seconds |")
    print("|---|---|---|---|---|---|---|")
    for setting, err, seconds, windows in rows:
        print(f"| `{json.dumps(setting)}` | {windows} | {err['transfer_before']:.4f} | {err['transfer_after']:.4f} | "
              f"{err['fitting']:.4f} | {int(err['transfer_steps'])} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
