"""The GQA-paper grid's table and plot, written from its cell results."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from gqakit.common.atomic import replace_file, replace_text
from gqakit.common.recipes import to_dict
from gqakit.convert import methods

FIELDS = ("name", "groups", "method", "alpha", "distill", "perplexity", "vs_mha", "steps", "tokens",
          "train_seconds", "seconds")


def _lookup(rows: list[dict]) -> dict:
    return {(r["groups"], r["method"], r["alpha"], r["distill"]): r["perplexity"] for r in rows}


def _mha(rows: list[dict]) -> dict:
    return next(r for r in rows if r["method"] == "mha" and not r["alpha"])


def _line(heads: str, method: str, cells: list) -> str:
    return f"| {heads} | {method} | " + " | ".join(f"{c:.2f}" if c is not None else "" for c in cells) + " |"


def grid_table(rows: list[dict]) -> str:
    """One line per (G, method); columns alpha = 0, then each alpha without and (where any cell has it) with
    distillation."""
    ppl = _lookup(rows)
    mha = _mha(rows)
    alphas = sorted({r["alpha"] for r in rows if r["alpha"] > 0})
    kds = (False, True) if any(r["distill"] for r in rows) else (False,)
    header = ["K/V heads", "method", "alpha 0"] + [f"alpha {a:g}{' + KD' if kd else ''}" for a in alphas
                                                   for kd in kds]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             _line(f"{mha['groups']} (MHA)", "-", [mha["perplexity"]] + [
                 None if kd else ppl.get((mha["groups"], "mha", a, False)) for a in alphas for kd in kds])]
    for g in sorted({r["groups"] for r in rows if r["method"] != "mha"}, reverse=True):
        for method in dict.fromkeys(r["method"] for r in rows if r["groups"] == g and r["method"] != "mha"):
            cells = [ppl.get((g, method, 0.0, False))] + [ppl.get((g, method, a, kd)) for a in alphas
                                                          for kd in kds]
            lines.append(_line(f"{g}{' (MQA)' if g == 1 else ''}", method, cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Held-out perplexity against the uptraining fraction alpha, one panel per K/V head count."""
    from gqakit.common.plots import new_figure

    ppl = _lookup(rows)
    mha = _mha(rows)["perplexity"]
    groups = sorted({r["groups"] for r in rows if r["method"] != "mha"}, reverse=True)
    fig = new_figure(4.2 * len(groups), 4)
    axes = fig.subplots(1, len(groups), sharey=True, squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(methods.NAMES)}  # matplotlib's cycle: mean blue, first orange, ...
    for ax, g in zip(axes[0], groups):
        for method in dict.fromkeys(r["method"] for r in rows if r["groups"] == g):
            for kd, style in ((False, "o-"), (True, "s--")):
                points = sorted((a, p) for (gg, m, a, d), p in ppl.items()
                                if gg == g and m == method and (d == kd or a == 0.0))
                if len(points) > 1:
                    ax.plot(*zip(*points), style, color=colors.get(method), lw=1.5, ms=4,
                            label=f"{method}{' + KD' if kd else ''}")
        control = sorted((r["alpha"], r["perplexity"]) for r in rows if r["method"] == "mha")
        if len(control) > 1:  # the MHA model trained on for the same budgets
            ax.plot(*zip(*control), "^:", color="black", lw=1, ms=4, label="MHA (trained on)")
        else:
            ax.axhline(mha, color="black", lw=1, ls=":", label="MHA")
        ax.set_yscale("log")
        ax.set_title("MQA (1 K/V head)" if g == 1 else f"GQA-{g}")
        ax.set_xlabel("uptraining alpha (fraction of pretraining tokens)")
    axes[0][0].set_ylabel("held-out perplexity (log)")
    axes[0][-1].legend(frameon=False, fontsize=8)
    fig.savefig(path, format="png")  # path may be a working name without the suffix


def write_grid_report(out: Path, rows: list[dict], cfg, eval_tokens: int) -> None:
    out = Path(out)
    table = grid_table(rows)
    replace_text(out / "results.md", table + "\n")

    def write_csv(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    replace_file(out / "results.csv", write_csv)
    report = json.dumps({"config": to_dict(cfg), "eval_tokens": eval_tokens, "results": rows}, indent=2) + "\n"
    replace_text(out / "results.json", report)
    replace_file(out / "gqa_paper.png", lambda tmp: plot(rows, tmp))
    print(table)
