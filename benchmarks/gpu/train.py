"""Training speed on one GPU: attention forward + backward (tiled vs flex_attention vs sdpa), and `gqakit uptrain`
against a bare PyTorch loop on the same model and data.

  (a) one attention layer's forward + backward in bf16 at T = 4k .. 32k (batch 1, 32 query heads, 8 K/V heads,
      head_dim 64: Llama-3.2-1B's attention), causal: torch sdpa (enable_gqa), gqakit's compiled flex_attention
      (`flex_attention_forward`, its BlockMask from MaskSpec()), the same with a 1,024-token sliding window beside
      sdpa given that window as a boolean mask (what sdpa can express of it), and the tiled kernel (a Python loop
      over blocks: up to --tiled-max). Median of 3 synchronised calls after a warm-up (which holds the compile).
      Check: at the smallest T each kernel's output is within 2e-2 of its sdpa twin's (the windowed flex's twin is
      the masked sdpa, the others' the causal one).
  (b) tokens/s of `gqakit uptrain` (sharding=ddp and fsdp, one process, mixed_precision=bf16) against
      `uptrain_scale.py`'s bare loop (the same random Llama, batch, loss, clip, AdamW and bf16 autocast) on the
      GPU: median step after the warm-up steps, each launch its own process. Target: gqakit >= 0.9x the bare loop.

    python benchmarks/gpu/train.py --json train.json       # on the GPU (~2 min)
    python benchmarks/gpu/train.py --dry-run               # CPU, tiny sizes, no flex (no CPU backward)

Progress goes to stderr; stdout is only the markdown report. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _gpu import Budget, is_oom, pick_device, release, timed, versions, write_json
from _measure import ROOT, logger

log = logger("gpu/train")
SPEED_TARGET = 0.90  # as uptrain_scale.py's; held by the default sharding (ddp) only: FSDP on one GPU gathers and
# reshards for nothing (0.76x in the first device run), so its ratio is shown, not checked
CHECKED = ("ddp",)
LAUNCH_S = 25  # a launch took 16-21 s in the first device run: one is not started with less left
AGREE = 2e-2  # bf16 outputs of unit-variance inputs: max |kernel - sdpa|


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="4096,8192,16384,32768", help="attention lengths T (comma list)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--tiled-max", type=int, default=8192, help="longest T the tiled kernel is timed at")
    p.add_argument("--hidden", type=int, default=1024, help="uptrain model: hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--train-seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timed", type=int, default=8)
    p.add_argument("--shardings", default="ddp,fsdp")
    p.add_argument("--parts", default="attention,uptrain", help="which of (a) attention, (b) uptrain to run")
    p.add_argument("--budget-s", type=float, default=110.0)
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, fp32, no flex (seconds)")
    args = p.parse_args(argv)
    unknown = set(args.parts.split(",")) - {"attention", "uptrain"}
    if unknown:
        p.error(f"--parts: unknown {', '.join(sorted(unknown))}; use attention, uptrain or both (comma list)")
    if args.dry_run:
        args.seq, args.heads, args.kv_heads, args.head_dim, args.window, args.tiled_max = "256", 4, 2, 16, 64, 256
        args.hidden, args.layers, args.batch, args.train_seq, args.warmup, args.timed = 64, 2, 2, 32, 2, 2
        args.shardings = "ddp"
    return args


# ---- (a) attention forward + backward ----------------------------------------------------------------


def twin(name: str) -> str:
    """The sdpa run a kernel's output is checked against: the masked one for the windowed kernels."""
    return "sdpa W" if name.startswith(("flex W", "sdpa W")) else "sdpa"


def kernels(args, device) -> dict:
    """name -> fn(q, k, v) -> out, for every kernel this device can train with."""
    import torch
    import torch.nn.functional as F

    from gqakit.attention.flex import flex_attention_forward
    from gqakit.attention.masks import MaskSpec
    from gqakit.attention.tiled import tiled_attention

    scale = args.head_dim ** -0.5
    out = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                  enable_gqa=k.shape[1] != q.shape[1])}
    if device.type == "cuda":  # flex has no backward on CPU
        out["flex"] = lambda q, k, v: flex_attention_forward(q, k, v, scale=scale, spec=MaskSpec())
        out[f"flex W={args.window}"] = lambda q, k, v: flex_attention_forward(
            q, k, v, scale=scale, spec=MaskSpec(window=args.window))
        masks = {}  # T -> the window as a boolean mask, built once per length

        def sdpa_window(q, k, v):
            T = q.shape[2]
            if T not in masks:
                masks.clear()
                pos = torch.arange(T, device=q.device)
                masks[T] = MaskSpec(window=args.window).mask(pos, pos)  # (T, T), the flex run's own rule
            return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[T], scale=scale,
                                                  enable_gqa=k.shape[1] != q.shape[1])

        out["sdpa W"] = sdpa_window
    out["tiled"] = lambda q, k, v: tiled_attention(q, k, v, scale=scale, spec=MaskSpec())
    return out


def attention_part(args, device, dtype, budget: Budget, rows: dict, failed: list[str]) -> None:
    """Fills `rows` and `failed` as it goes (an interrupted run keeps the rows it finished)."""
    import torch

    seqs = [int(x) for x in args.seq.split(",")]
    fns = kernels(args, device)
    for T in seqs:
        g = torch.Generator(device).manual_seed(T)
        shapes = [(1, args.heads, T, args.head_dim)] + [(1, args.kv_heads, T, args.head_dim)] * 2
        q, k, v = (torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_() for s in shapes)
        grad = torch.randn(1, args.heads, T, args.head_dim, generator=g, device=device, dtype=dtype)
        references = None if T != seqs[0] else {n: fns[n](q, k, v).detach() for n in ("sdpa", "sdpa W") if n in fns}
        flops = 4 * args.heads * T * T * args.head_dim / 2 * 3.5  # causal forward (2 matmuls) + backward (2.5x)
        for name, fn in fns.items():
            if budget.over() or (name == "tiled" and T > args.tiled_max):
                rows[f"{name}@{T}"] = {"skipped": "time budget" if budget.over() else "T > --tiled-max"}
                continue

            def step():
                for t in (q, k, v):
                    t.grad = None
                fn(q, k, v).backward(grad)

            med = None
            try:
                med = statistics.median(timed(step, device, warmup=1, repeats=3))
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    raise
            if med is None:  # out of memory; released after the except block, whose traceback held the tensors
                release(device)
                rows[f"{name}@{T}"] = {"skipped": "out of memory"}
                continue
            row = {"ms": 1e3 * med, "tflops": flops / med / 1e12}
            if references is not None:
                with torch.no_grad():
                    diff = fn(q, k, v).float() - references[twin(name)].float()
                    row["max_diff_vs_sdpa"] = float(diff.abs().max())
                if row["max_diff_vs_sdpa"] > AGREE:
                    failed.append(f"{name} at T={T} differs from {twin(name)} by {row['max_diff_vs_sdpa']:.3g} "
                                  f"> {AGREE:g}")
            rows[f"{name}@{T}"] = row
            log(f"attention {name} T={T}: {row}")
        del q, k, v, grad, references
        release(device)


# ---- (b) gqakit uptrain against the bare loop -------------------------------------------------------------


def uptrain_part(args, device, budget: Budget) -> tuple[dict, list[str]]:
    from uptrain_scale import Shape, _env, _step_times, make_model, recipe_file, run_cell

    from gqakit.reference import HELDOUT_TEXT

    shape = Shape(hidden=args.hidden, layers=args.layers, heads=args.hidden // 64 or 1,
                  intermediate=4 * args.hidden)
    precision = "bf16" if device.type == "cuda" else "no"
    steps = args.warmup + args.timed
    this = str(Path(ROOT / "benchmarks" / "uptrain_scale.py"))
    with tempfile.TemporaryDirectory(prefix="gpu-train-", dir=None) as tmp:
        work = Path(tmp)
        n_params = make_model(work / "model", shape, tie=False)
        text = work / "train.txt"  # the held-out Emma text, cut short for a dry run
        text.write_text(Path(HELDOUT_TEXT).read_text(encoding="utf-8")[: 20_000 if args.dry_run else None])
        recipe = recipe_file(work, work / "model", text, argparse.Namespace(seq=args.train_seq, batch=args.batch))
        env = _env(None)
        bare_spec = {"model": str(work / "model"), "text": str(text), "seq": args.train_seq, "batch": args.batch,
                     "lr": 3.0e-4, "grad_clip": 1.0, "steps": steps, "device": str(device),
                     "mixed_precision": precision}
        cells = {"bare": run_cell(work, "bare", [sys.executable, this, "--bare"], bare_spec, 1, env)}
        for kind in args.shardings.split(","):
            if budget.left() < LAUNCH_S:
                cells[kind] = {"skipped": "time budget"}
                continue
            overrides = [f"sharding={kind}", f"steps={steps}", f"mixed_precision={precision}",
                         f"output_dir={work / f'run-{kind}'}"]
            cells[kind] = run_cell(work, kind, [sys.executable, this, "--worker"],
                                   {"recipe": str(recipe), "overrides": overrides}, 1, env)
    tokens = args.batch * args.train_seq
    out, failed = {"parameters": n_params, "mixed_precision": precision, "tokens_per_step": tokens}, []
    med = {k: statistics.median(_step_times([c], args.warmup)) for k, c in cells.items() if "ranks" in c}
    for kind, cell in cells.items():
        if "skipped" in cell:  # not run: the time budget is spent (not a failed launch)
            out[kind] = cell
            continue
        if kind not in med:
            out[kind] = {"error": cell.get("error", "")[-1500:]}
            failed.append(f"uptrain {kind}: the launch failed")
            continue
        out[kind] = {"step_s": med[kind], "tokens_per_s": tokens / med[kind], "launch_s": cell["seconds"]}
        if kind != "bare" and "bare" in med:
            out[kind]["vs_bare"] = med["bare"] / med[kind]
            if out[kind]["vs_bare"] < SPEED_TARGET and device.type == "cuda" and kind in CHECKED:
                failed.append(f"uptrain {kind} runs at {out[kind]['vs_bare']:.2f}x the bare loop (target >= "
                              f"{SPEED_TARGET:g})")
    return out, failed


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _line(lead: list[str], skipped: str | None, cells, width: int) -> str:
    """A table row: the lead cells, then `skipped` and blanks, or cells()."""
    rest = [skipped] + [""] * (width - 1) if skipped else cells()
    return "| " + " | ".join([*lead, *rest]) + " |"


def report(res: dict, args) -> None:
    v = res["versions"]
    print(f"## Training speed on {v.get('gpu', 'cpu')}\n")
    print(f"torch {v['torch']}, transformers {v['transformers']}; {res['dtype']}.\n")
    print(f"### (a) attention forward + backward, batch 1, {args.heads} heads, {args.kv_heads} K/V heads, "
          f"head_dim {args.head_dim}, causal (median of 3)\n")
    print("The sdpa twin of the windowed flex is sdpa with the window as a boolean mask; of the others, causal sdpa. "
          "TFLOP/s counts the causal work for every kernel.\n")
    print("| kernel | T | ms | x its sdpa twin | TFLOP/s (causal) | max diff vs its sdpa twin |\n"
          "|---|---|---|---|---|---|")
    rows = res["attention"]
    for key, row in rows.items():
        name, T = key.rsplit("@", 1)
        base = rows.get(f"{twin(name)}@{T}", {}).get("ms")
        print(_line([name, T], row.get("skipped"), lambda: [
            f"{row['ms']:.2f}", _fmt(row["ms"] / base if base and not name.startswith("sdpa") else None, ".2f"),
            f"{row['tflops']:.1f}", _fmt(row.get("max_diff_vs_sdpa"), ".2e")], 4))
    up = res["uptrain"]
    if not up:
        why = "interrupted at the time limit" if res.get("interrupted") else "not in --parts"
        print(f"\n### (b) gqakit uptrain: not run ({why})")
    else:
        print(f"\n### (b) gqakit uptrain vs a bare PyTorch loop: {up['parameters'] / 1e6:.0f}M parameters, "
              f"{args.batch} x {args.train_seq} tokens per step, mixed_precision={up['mixed_precision']}\n")
        print("| run | median step s | tokens/s | vs bare | launch s |\n|---|---|---|---|---|")
        for kind in ["bare", *args.shardings.split(",")]:
            row = up.get(kind, {"error": "not run"})
            lead = ["bare PyTorch" if kind == "bare" else f"gqakit {kind}"]
            print(_line(lead, "FAILED" if "error" in row else row.get("skipped"), lambda: [
                f"{row['step_s']:.4f}", f"{row['tokens_per_s']:,.0f}", _fmt(row.get("vs_bare"), ".2f"),
                f"{row['launch_s']:.0f}"], 4))
    print("\n### checks\n")
    for line in res["failed_checks"] or ["all passed"]:
        print(f"- {line}")


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    device = pick_device(args.dry_run)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = Budget(args.budget_s)
    res = {"versions": versions(device), "dtype": str(dtype).replace("torch.", "")}
    parts = args.parts.split(",")
    res["attention"], res["uptrain"], failed, more = {}, {}, [], []
    try:
        if "attention" in parts:
            attention_part(args, device, dtype, Budget(budget.left() / len(parts)), res["attention"], failed)
        if "uptrain" in parts:
            res["uptrain"], more = uptrain_part(args, device, budget)
    except KeyboardInterrupt:  # run.sh's timeout interrupts (SIGINT): keep and report what finished
        res["interrupted"] = True
        more = [*more, "interrupted at the time limit: the rows after the last one shown did not run"]
    res["failed_checks"] = failed + more
    report(res, args)
    write_json(args.json, res)
    return 1 if res["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
