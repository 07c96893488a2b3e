"""The report figures: perplexity vs KV-cache bytes (ppl), perplexity vs position (stream), passkey heatmap.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch, no display).
"""
from __future__ import annotations

from pathlib import Path


def new_figure(width: float = 7.0, height: float = 4.5):
    """A figure on its own Agg canvas (save with fig.savefig)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _plain():
    """Tick labels as plain numbers (1,024 / 25.3), not powers, on log axes too."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 100 else f"{v:.3g}")


def ppl_vs_kv_bytes(rows: list[dict], path: Path) -> None:
    """One point per model: KV-cache bytes per token (x, log) against perplexity (y)."""
    fig = new_figure()
    ax = fig.add_subplot()
    for r in rows:
        ax.scatter(r["kv_bytes_per_token"], r["perplexity"], s=36)
        ax.annotate(f"{r['model']} ({r['kv_heads']} K/V)", (r["kv_bytes_per_token"], r["perplexity"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_plain())
    ax.margins(x=0.25, y=0.15)
    ax.set_xlabel("KV-cache bytes per token")
    ax.set_ylabel("perplexity")
    ax.set_title("perplexity vs KV-cache size")
    ax.grid(True, alpha=0.3)
    fig.savefig(path)


def ppl_vs_position(curves: dict[str, list[dict]], path: Path, marks: dict[str, int] | None = None) -> None:
    """One line per policy: perplexity of each position bucket (y, log) at the bucket's middle (x).

    `marks` draws labelled vertical lines (e.g. the cache size S + W, the model's trained context).
    """
    fig = new_figure(8.0, 4.5)
    ax = fig.add_subplot()
    for name, buckets in curves.items():
        xs = [(b["start"] + b["end"] - 1) / 2 for b in buckets]
        ax.plot(xs, [b["perplexity"] for b in buckets], marker=".", label=name)
    for label, x in (marks or {}).items():
        ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_plain())
    ax.yaxis.set_minor_formatter(_plain())
    ax.set_xlabel("token position in the stream")
    ax.set_ylabel("perplexity (per bucket)")
    ax.set_title("long-context fluency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path)


def passkey_heatmap(lengths: list[int], depths: list[float], accuracy: dict[tuple[int, float], float],
                    path: Path, title: str = "passkey retrieval accuracy") -> None:
    """Accuracy per (depth row, length column), 0..1, annotated with percentages."""
    import numpy as np

    grid = np.array([[accuracy[(n, d)] for n in lengths] for d in depths])  # (depths, lengths)
    fig = new_figure(1.6 + 1.1 * len(lengths), 1.4 + 0.55 * len(depths))
    ax = fig.add_subplot()
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{100 * grid[i, j]:.0f}%", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("depth of the key")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.savefig(path)
