"""Does an aligned K/V merge give uptraining a head start over mean-pooling? (issue 13)

Goal: "With uptraining (`gqakit uptrain`, same recipe and budget for both), the aligned start reaches
mean-pooling's end-of-budget perplexity in at most half the tokens."

For each G in --groups and each merge method in --methods, this converts the embedded model
(gqakit/assets/austen-mha-8h) and uptrains the result with ONE recipe, identical for every method
(recipes/uptrain_embedded.yaml: alpha 0.05 = 25 steps of 8 x 512 tokens, distilled from the MHA
teacher; only model/output_dir differ, plus eval_every and progress, the same for all). The held-out
perplexity (16 x 512 tokens of Emma) is read from each run's metrics.csv at every eval step. Per G it
prints: perplexity before training (step 0) and at the end of the budget, tokens trained, and the tokens
each method needs to reach mean's end-of-budget perplexity (linear interpolation in perplexity between
eval points; "not reached" if never), with the ratio to mean's own tokens (the goal: aligned <= 0.5).

The commands it runs (from the repository root; `convert-gqa`/`gqakit` are the venv's console scripts):

    convert-gqa --groups G --method M [--method-args M=...] gqakit/assets/austen-mha-8h \\
        -o runs/merge-uptrain/convert/gG-M
    gqakit uptrain recipes/uptrain_embedded.yaml model=runs/merge-uptrain/convert/gG-M \\
        output_dir=runs/merge-uptrain/TAG/gG-M eval_every=1 progress=false [--set key=value ...]

Outputs that exist already are reused (a finished conversion, a finished run; an interrupted run
resumes from its checkpoint), so rerunning the same command continues where it stopped. Each output
records what made it (OUT.made.json: the convert arguments; the recipe, its text's hash, the overrides and
the model); one made otherwise (other --method-args, another --recipe) is refused, naming the folder,
rather than reported under this command's labels.

    OMP_NUM_THREADS=1 python benchmarks/merge_uptrain.py --groups 2 1
    OMP_NUM_THREADS=1 python benchmarks/merge_uptrain.py --groups 2 1 --set alpha=0.10   # a second budget
    OMP_NUM_THREADS=1 python benchmarks/merge_uptrain.py --methods mean aligned fit \\
        --method-args fit="--calibration gqakit/assets/pride_and_prejudice.txt"
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from _measure import ROOT, eval_curve

BIN = Path(sys.executable).parent  # the venv's console scripts
SOURCE = "gqakit/assets/austen-mha-8h"
RECIPE = "recipes/uptrain_embedded.yaml"
RUNS = "runs/merge-uptrain"


def run_logged(cmd: list[str], log: Path) -> float:
    """Run `cmd` from the repository root, output to `log`; returns the wall time in seconds."""
    print("$ " + shlex.join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("a") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if code:
        sys.exit(f"failed ({code}) after {seconds:.0f} s; see {log}")
    print(f"  done in {seconds:.0f} s", flush=True)
    return seconds


def made_before(out: str, finished: str, made: dict, fix: str) -> bool:
    """Whether `out` holds a finished output (its file `finished` exists) made by `made`; exits, naming the folder
    and `fix`, when it was made otherwise (or by a version of this script that did not record it). Records
    `made` beside a folder that is about to be made (OUT.made.json, outside it: the tools refuse foreign files)."""
    record = ROOT / f"{out}.made.json"
    if not (ROOT / out / finished).is_file():
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(made, indent=2) + "\n")
        return False
    before = json.loads(record.read_text()) if record.is_file() else None
    if before != made:
        sys.exit(f"{out} was made {'by ' + json.dumps(before) if before else 'without a record of how'}, not by "
                 f"{json.dumps(made)}; {fix}")
    return True


def convert(groups: int, method: str, extra: list[str], runs: Path) -> tuple[str, float | None]:
    out = f"{runs}/convert/g{groups}-{method}"
    if made_before(out, "config.json", {"groups": groups, "method": method, "args": extra},  # written atomically
                   "remove it and the runs trained from it, or give this command its own --runs"):
        return out, None
    cmd = [str(BIN / "convert-gqa"), "--groups", str(groups), "--method", method, *extra, SOURCE, "-o", out, "-q"]
    return out, run_logged(cmd, ROOT / f"{out}.log")


def uptrain(model: str, out: str, overrides: list[str], recipe: str) -> float | None:
    text = hashlib.sha256((ROOT / recipe).read_bytes()).hexdigest()[:16]
    converted = ROOT / f"{model}.made.json"  # how the model was made: a conversion redone otherwise is another start
    made = {"recipe": recipe, "recipe_sha256": text, "model": model, "overrides": overrides,
            "model_made": json.loads(converted.read_text()) if converted.is_file() else None}
    if made_before(out, "uptraining.json", made,  # written last: the run finished
                   "remove it, or give this command its own --runs or --tag"):
        return None
    cmd = [str(BIN / "gqakit"), "uptrain", recipe, f"model={model}", f"output_dir={out}", *overrides]
    return run_logged(cmd, ROOT / f"{out}.log")  # beside the run folder: uptrain refuses foreign files in it


def tokens_to_reach(curve: list[tuple[int, int, float]], target: float) -> float | None:
    """Training tokens at which the perplexity first falls to `target` (linear between eval points)."""
    for i, (_, tokens, ppl) in enumerate(curve):
        if ppl <= target:
            if i == 0:
                return 0.0
            _, t0, p0 = curve[i - 1]
            return t0 + (p0 - target) / (p0 - ppl) * (tokens - t0)
    return None


def table(groups: int, rows: list[dict], reference: str) -> str:
    target = next(r["final_ppl"] for r in rows if r["method"] == reference)
    lines = [f"### G = {groups} ({reference}'s end-of-budget perplexity: {target:.2f})", "",
             f"| method | ppl step 0 | ppl end | tokens trained | tokens to reach {target:.2f} | ratio to {reference} "
             "| train s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        reach = "not reached" if r["tokens_to_reach"] is None else f"{r['tokens_to_reach']:,.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['method']} | {r['initial_ppl']:.2f} | {r['final_ppl']:.2f} | {r['tokens']:,} | {reach} "
                     f"| {ratio} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def parse_method_args(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, args = item.partition("=")
        if not sep:
            sys.exit(f"--method-args {item!r}: write METHOD=\"ARGS\"")
        out[name] = shlex.split(args)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, nargs="+", default=[2, 1], help="K/V heads after conversion (default: 2 1)")
    p.add_argument("--methods", "--method", nargs="+", default=["mean", "aligned"],
                   help="convert-gqa --method values (default: mean aligned)")
    p.add_argument("--method-args", action="append", default=[], metavar='METHOD="ARGS"',
                   help="extra convert-gqa arguments for one method, e.g. fit=\"--calibration FILE\"")
    p.add_argument("--reference", default="mean", help="the method whose end perplexity is the target (default: mean)")
    p.add_argument("--recipe", default=RECIPE, help=f"uptrain recipe, the same for every method (default: {RECIPE})")
    p.add_argument("--eval-every", type=int, default=1, help="held-out eval every N steps (default: 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe overrides for EVERY run (e.g. alpha=0.10); they name the runs' folder")
    p.add_argument("--tag", default=None, help="folder under runs/merge-uptrain for the runs (default: from --set)")
    p.add_argument("--runs", default=RUNS, help=f"where everything goes, relative to the repository (default: {RUNS})")
    p.add_argument("--json", default=None, help="write the results here (default: RUNS/TAG/results.json)")
    args = p.parse_args(argv)
    methods = list(dict.fromkeys(args.methods))
    if args.reference not in methods:
        sys.exit(f"--reference {args.reference} is not among --methods {' '.join(methods)}")
    method_args = parse_method_args(args.method_args)
    tag = args.tag or re.sub(r"[^A-Za-z0-9_.-]+", "", "_".join(args.set)) or "recipe"
    overrides = [f"eval_every={args.eval_every}", "progress=false", *args.set]
    runs = Path(args.runs)

    results = {"recipe": args.recipe, "overrides": overrides, "source": SOURCE, "groups": {}}
    for g in args.groups:
        rows = []
        for method in methods:
            model, convert_s = convert(g, method, method_args.get(method, []), runs)
            out = f"{runs}/{tag}/g{g}-{method}"
            wall = uptrain(model, out, overrides, args.recipe)
            record = json.loads((ROOT / out / "uptraining.json").read_text())
            curve = eval_curve(ROOT / out)  # (step, tokens, perplexity), step 0 included
            rows.append({"method": method, "convert_args": method_args.get(method, []), "model": model, "run": out,
                         "initial_ppl": curve[0][2], "final_ppl": curve[-1][2], "tokens": record["budget"]["tokens"],
                         "steps": record["budget"]["steps"], "train_seconds": record["train_seconds"],
                         "convert_wall_s": convert_s, "uptrain_wall_s": wall,
                         "curve": [{"step": s, "tokens": t, "ppl": ppl} for s, t, ppl in curve]})
        target = next(r["final_ppl"] for r in rows if r["method"] == args.reference)
        for r in rows:
            r["tokens_to_reach"] = tokens_to_reach([(c["step"], c["tokens"], c["ppl"]) for c in r["curve"]], target)
        base = next(r["tokens_to_reach"] for r in rows if r["method"] == args.reference)
        for r in rows:
            r["ratio"] = r["tokens_to_reach"] / base if r["tokens_to_reach"] is not None and base else None
        results["groups"][str(g)] = {"target_ppl": target, "methods": rows}
        print("\n" + table(g, rows, args.reference) + "\n", flush=True)

    for g, res in results["groups"].items():  # the verdict, per G
        for r in res["methods"]:
            if r["method"] != args.reference:
                ok = r["ratio"] is not None and r["ratio"] <= 0.5
                why = "not reached" if r["ratio"] is None else f"ratio {r['ratio']:.2f}"
                print(f"G={g} {r['method']}: {'PASS' if ok else 'FAIL'} ({why}; goal <= 0.50 of "
                      f"{args.reference}'s tokens)")
    path = ROOT / (args.json or f"{runs}/{tag}/results.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
