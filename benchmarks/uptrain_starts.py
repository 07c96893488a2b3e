"""The GQA paper's uptraining curve for several conversion starts: perplexity against uptraining tokens.

Converts MODEL to G K/V heads with each `--methods` entry (default: mean, fit, transfer; timing each conversion),
scores every start with `gqakit eval ppl`, uptrains each start with the same recipe (only `model` and
`output_dir` differ), and plots the held-out perplexity the runs log (metrics.csv, every `eval_every` steps)
against training tokens, one curve per start, with the original as a reference line. Every step runs through the
console scripts, as a user would, in one process tree, one after another.

    python benchmarks/uptrain_starts.py                     # the embedded model to MQA, about 10 minutes
    python benchmarks/uptrain_starts.py --steps 10 --eval-every 5 --methods mean,transfer   # quicker

Writes OUT/curve.png, OUT/starts.json and prints the markdown table. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from _measure import EMBEDDED, PRIDE, ROOT, command_line, eval_curve, logger

HELD = ROOT / "gqakit" / "assets" / "heldout_emma.txt"
log = logger("uptrain_starts")


def run(*args: str) -> float:
    """Run a console command; its wall time in seconds (stderr shows its progress)."""
    log("$ " + " ".join(shlex.quote(a) for a in args))
    t0 = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def perplexity(model: Path, text: Path, max_length: int, out: Path, max_tokens: int | None) -> float:
    extra = ["--max-tokens", str(max_tokens)] if max_tokens else []
    run("gqakit", "eval", "ppl", str(model), "--text", str(text), "--max-length", str(max_length),
        "--output", str(out), "--force", "-q", *extra)
    return json.loads((out / "results.json").read_text())["results"]["rows"][0]["perplexity"]


def curve(run_dir: Path) -> list[tuple[int, float]]:
    return [(tokens, ppl) for _, tokens, ppl in eval_curve(run_dir)]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(EMBEDDED))
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--methods", default="mean,fit,transfer")
    p.add_argument("--calibration", default=str(PRIDE), help="calibration text of fit / transfer")
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "uptrain_embedded.yaml"))
    p.add_argument("--eval-text", default=str(HELD), help="scored before and after (gqakit eval ppl)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of --eval-text")
    p.add_argument("--steps", type=int, default=25, help="uptraining steps (default 25: the recipe's alpha = 0.05)")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--override", action="append", default=[], help="more KEY=VALUE for the recipe")
    p.add_argument("-o", "--output", default="runs/uptrain-starts")
    return p.parse_args(argv)


def plot(rows: dict, path: Path, title: str) -> None:
    """One curve per start (the runs' own held-out evaluations) and the original's perplexity on the whole
    evaluation text (`gqakit eval ppl`: not the same windows as the runs' evaluations, so a guide only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, r in rows.items():
        if method != "original":
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{method} start")
    ax.axhline(rows["original"]["ppl"], color="grey", linestyle="--", label="original (whole text, eval ppl)")
    ax.set_yscale("log")
    ax.set_xlabel("uptraining tokens")
    ax.set_ylabel("held-out perplexity (the run's own evaluation)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    rows = {"original": {"convert_s": 0.0, "ppl": perplexity(model, Path(args.eval_text), args.max_length,
                                                             out / "eval-original", args.max_tokens)}}
    for method in args.methods.split(","):
        start = out / f"{method}"
        calib = ["--calibration", args.calibration] if method in ("fit", "transfer") else []
        seconds = run("convert-gqa", "--groups", str(args.groups), str(model), "-o", str(start), "--method", method,
                      *calib, "--force", "-q")
        ppl = perplexity(start, Path(args.eval_text), args.max_length, out / f"eval-{method}", args.max_tokens)
        trained = out / f"{method}-uptrained"
        train_s = run("gqakit", "uptrain", args.recipe, f"model={start}", f"output_dir={trained}",
                      "alpha=null", f"steps={args.steps}", f"eval_every={args.eval_every}", "force=true",
                      *args.override)
        after = perplexity(trained, Path(args.eval_text), args.max_length, out / f"eval-{method}-uptrained",
                           args.max_tokens)
        rows[method] = {"convert_s": seconds, "ppl": ppl, "uptrain_s": train_s, "ppl_uptrained": after,
                        "curve": curve(trained)}
    (out / "starts.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "curve.png", f"{model.name} -> {args.groups} K/V head(s): uptraining from each start")

    command = command_line(__file__, argv)
    print(f"## Uptraining from each conversion start\n\n`{command}`\n")
    scored = f", its first {args.max_tokens:,} tokens" if args.max_tokens else ""
    print(f"{model} -> {args.groups} K/V head(s); perplexity by `gqakit eval ppl` on `{args.eval_text}` "
          f"({args.max_length}-token windows{scored}); uptraining: `{args.recipe}` with steps={args.steps}.\n")
    print("| start | conversion s | perplexity, converted | uptraining s | perplexity, uptrained |")
    print("|---|---|---|---|---|")
    for method, r in rows.items():
        if method == "original":
            print(f"| original | - | {r['ppl']:.2f} | - | - |")
        else:
            print(f"| {method} | {r['convert_s']:.0f} | {r['ppl']:.2f} | {r['uptrain_s']:.0f} | "
                  f"{r['ppl_uptrained']:.2f} |")
    print(f"\nCurve: {out / 'curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
