"""Wall time of the commands that only plan: `convert-gqa --dry-run` (mean, fit, transfer, fit with --calibration
text, a re-hosted GPT-2) and `gqakit uptrain RECIPE --plan` (the embedded model, and its config.json alone without
head_dim, num_key_value_heads and tie_word_embeddings), each run `--repeats` times as a fresh process (the console
scripts' own entry points under this interpreter), with the median and p90 and whether torch or transformers were
loaded. A plan is arithmetic over config.json and the safetensors headers; the targets are under 1 s quiet and
under 2 s beside a co-runner. The re-hosted GPT-2 (GPT-2 small's 12 layers at n_embd 64, config.json as a diff
against GPT2Config's defaults) and the lone config.json are written to a temporary folder first.

    python benchmarks/plan_startup.py                        # quiet, 5 repeats
    python benchmarks/plan_startup.py --busy                 # quiet, then beside a co-runner
    python benchmarks/plan_startup.py --against /work/main   # also a checkout of gqakit from before, side by side

`--against DIR` runs the same commands with DIR first on PYTHONPATH (another checkout of gqakit), alternating
with this tree run by run, so both see the same load. `--busy` repeats everything while a co-running torch
process does 1024 x 1024 matmuls on every core (`_measure.co_running`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _measure import EMBEDDED, ROOT, co_running, command_line, median_p90

TEXT = ROOT / "gqakit" / "assets" / "heldout_emma.txt"
RECIPE = str(ROOT / "recipes" / "uptrain_embedded.yaml")


def commands(fixtures: Path) -> dict[str, list[str]]:
    return {
        "convert-gqa --dry-run": ["convert-gqa", "--groups", "2", str(EMBEDDED), "--dry-run"],
        "convert-gqa --dry-run --method fit": ["convert-gqa", "--groups", "2", str(EMBEDDED), "--dry-run",
                                               "--method", "fit"],
        "convert-gqa --dry-run --method transfer": ["convert-gqa", "--groups", "2", str(EMBEDDED), "--dry-run",
                                                    "--method", "transfer"],
        "convert-gqa --dry-run --method fit --calibration TEXT": ["convert-gqa", "--groups", "2", str(EMBEDDED),
                                                                  "--dry-run", "--method", "fit", "--calibration",
                                                                  str(TEXT)],
        "convert-gqa --dry-run (re-hosted GPT-2)": ["convert-gqa", "--groups", "2", str(fixtures / "gpt2"),
                                                    "--dry-run"],
        "gqakit uptrain --plan": ["gqakit", "uptrain", RECIPE, "--plan", f"model={EMBEDDED}", "teacher=null",
                                  "batch_size=100000000"],
        "gqakit uptrain --plan (config.json alone)": ["gqakit", "uptrain", RECIPE, "--plan",
                                                      f"model={fixtures / 'config-alone'}", "teacher=null",
                                                      "batch_size=100000000"],
    }


def make_fixtures(folder: Path) -> None:
    """A 12-layer GPT-2 (n_embd 64) with config.json as a diff against GPT2Config's defaults, and the embedded
    model's config.json alone, without the fields its class has defaults for."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=4096,
                                                        bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder / "gpt2")
    (folder / "gpt2" / "config.json").write_text(model.config.to_json_string(use_diff=True))
    config = json.loads((EMBEDDED / "config.json").read_text())
    (folder / "config-alone").mkdir()
    (folder / "config-alone" / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in ("head_dim", "num_key_value_heads", "tie_word_embeddings")}))
_RUN = """import sys
from gqakit.cli import convert_main, main
rc = (convert_main if sys.argv[1] == "convert-gqa" else main)(sys.argv[2:])
print("LOADED", *[m for m in ("torch", "transformers") if m in sys.modules], file=sys.stderr)
sys.exit(rc)
"""
TARGETS = {"quiet": 1.0, "busy": 2.0}


def _once(argv: list[str], tree: str) -> tuple[float, list[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, env=env,
                          cwd=tree)  # `python -c` puts the working folder first on sys.path
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed under {tree}: {done.stderr.strip()}")
    return seconds, [line for line in done.stderr.splitlines() if line.startswith("LOADED")][-1].split()[1:]


def measure(trees: dict[str, str], repeats: int, load: str, fixtures: Path) -> list[str]:
    rows = []
    for name, argv in commands(fixtures).items():
        times: dict[str, list[float]] = {t: [] for t in trees}
        loaded: dict[str, list[str]] = {}
        for _ in range(repeats):
            for label, tree in trees.items():  # alternating: both trees see the same load
                seconds, loaded[label] = _once(argv, tree)
                times[label].append(seconds)
        for label in trees:
            med, p90 = median_p90(times[label])
            verdict = "PASS" if med < TARGETS[load] else "FAIL"
            heavy = ", ".join(loaded[label]) or "neither"
            rows.append(f"| {name} | {label} | {load} | {med:.2f} | {p90:.2f} | {heavy} "
                        f"| {verdict if label == 'this tree' else ''} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="also time everything beside a co-runner")
    ap.add_argument("--against", metavar="DIR", help="another gqakit checkout to time side by side (before)")
    args = ap.parse_args(argv)
    trees = {"this tree": str(ROOT), **({"against": args.against} if args.against else {})}
    print(command_line(__file__, argv))
    print(f"\n{os.cpu_count()} CPUs; medians of {args.repeats} fresh processes; targets: under "
          f"{TARGETS['quiet']:.0f} s quiet, {TARGETS['busy']:.0f} s busy\n")
    print("| command | tree | load | median s | p90 s | loaded | target |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        make_fixtures(Path(folder))
        for row in measure(trees, args.repeats, "quiet", Path(folder)):
            print(row, flush=True)
        if args.busy:
            with co_running():
                for row in measure(trees, args.repeats, "busy", Path(folder)):
                    print(row, flush=True)


if __name__ == "__main__":
    main()
