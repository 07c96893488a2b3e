"""Two models of one `gqakit eval ppl` report, compared window by window: A's perplexity over B's on the same
windows, with a paired 95% bootstrap interval (`gqakit.evaluate.spread.paired_ratio_interval`), and how many
windows A scores better. Rows whose own intervals overlap can still differ beyond doubt: a hard window is hard for
both models. Two models scored in separate runs of the same text and windows compare with `--b-report`.

    python benchmarks/paired.py runs/eval-report MODEL_A MODEL_B
    python benchmarks/paired.py runs/eval-a MODEL_A MODEL_B --b-report runs/eval-b
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gqakit.common.digest import sha256_of
from gqakit.evaluate.spread import paired_ratio_interval


WINDOWS = ("text", "dataset", "text_column", "target_column", "max_tokens", "max_length", "stride", "bos")


def _same(key: str, x, y) -> bool:
    """Equal config values; a text given under two paths counts as one when both files hold the same bytes."""
    if key == "max_tokens":  # None and 0 both score the whole text
        x, y = x or 0, y or 0
    if x == y:
        return True
    if key == "text" and x and y and Path(x).is_file() and Path(y).is_file():
        return sha256_of(Path(x)) == sha256_of(Path(y))
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a `gqakit eval ppl -o` folder (its results.json)")
    p.add_argument("a", help="model name (the report's model column) whose perplexity is the numerator")
    p.add_argument("b", help="the model it is compared with")
    p.add_argument("--b-report", help="read model B from this report instead (the same text and windows)")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def report(folder: str) -> dict:
        return json.loads((Path(folder) / "results.json").read_text())

    def row(folder: str, model: str) -> dict:
        rows = {r["model"]: r for r in report(folder)["results"]["rows"]}
        if model not in rows:
            p.error(f"{model!r} is not a model of {folder}; it has {', '.join(rows)}")
        return rows[model]

    a, b = row(args.report, args.a), row(args.b_report or args.report, args.b)
    if args.b_report:  # equal window lengths are not the same windows: the text and how it was cut must match
        ours, theirs = (report(folder).get("config") or {} for folder in (args.report, args.b_report))
        differ = [key for key in WINDOWS if not _same(key, ours.get(key), theirs.get(key))]
        if differ:
            p.error(f"the two reports scored other text or windows ({', '.join(differ)} differ); compare reports of "
                    "one text, cut the same way")
    if a["window_tokens"] != b["window_tokens"]:
        p.error("the two rows scored different windows")
    ratio, low, high = paired_ratio_interval(a["window_nll"], b["window_nll"], a["window_tokens"], args.bootstrap,
                                             args.seed)
    better = sum(x < y for x, y in zip(a["window_nll"], b["window_nll"]))
    print(f"{args.a} / {args.b}: perplexity ratio {ratio:.4f}, paired 95% interval {low:.4f}-{high:.4f} "
          f"({args.bootstrap} resamples, seed {args.seed}); {args.a} better on {better} of {len(a['window_nll'])} "
          "windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
