"""Training metrics: one CSV row per logged step, TensorBoard when installed, a plot at the end."""
from __future__ import annotations

import csv
import math
from pathlib import Path

FIELDS = ("step", "tokens", "loss", "ce", "kd", "lr", "grad_norm", "tokens_per_s", "eval_loss", "eval_ppl")


class MetricsLog:
    """metrics.csv in the run folder; on resume, rows past the checkpoint's step are dropped first."""

    def __init__(self, output_dir: Path, resume_step: int = 0, enabled: bool = True):
        self.path = Path(output_dir) / "metrics.csv"
        self.enabled = enabled
        self.rows: list[dict] = []
        if not enabled:
            return
        if resume_step and self.path.is_file():
            with self.path.open() as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(self.rows)
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=resume_step + 1)
        except ImportError:  # tensorboard is optional
            pass

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: row.get(k, "") for k in FIELDS}
        self.rows.append(row)
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(row)
        if self.tensorboard is not None:
            for key in FIELDS[2:]:
                if row[key] != "":
                    self.tensorboard.add_scalar(f"uptrain/{key}", float(row[key]), int(row["step"]))

    def close(self) -> None:
        if self.enabled and self.tensorboard is not None:
            self.tensorboard.close()


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in ("", None)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    """Training loss and held-out perplexity against optimizer steps."""
    from gqakit.common.plots import new_figure

    fig = new_figure()
    left = fig.add_subplot()
    steps, loss = _series(rows, "loss")
    left.plot(steps, loss, color="tab:blue", lw=1, label="training loss")
    steps_ce, ce = _series(rows, "ce")
    if any(r.get("kd") not in ("", None) for r in rows):
        left.plot(steps_ce, ce, color="tab:cyan", lw=1, label="training cross-entropy")
    left.set_xlabel("optimizer step")
    left.set_ylabel("loss (nats/token)")
    eval_steps, ppl = _series(rows, "eval_ppl")
    if eval_steps:
        right = left.twinx()
        right.plot(eval_steps, ppl, "o-", color="tab:red", label="held-out perplexity")
        right.set_ylabel("held-out perplexity")
        if max(ppl) / max(min(ppl), 1e-9) > 10 and all(math.isfinite(p) for p in ppl):
            right.set_yscale("log")
        right.legend(loc="upper center", frameon=False)
    left.legend(loc="upper right", frameon=False)
    left.set_title(title)
    fig.savefig(path)


def plot_heldout(rows: list[dict], path: Path, references: dict[str, float], title: str = "") -> None:
    """Held-out perplexity against training tokens, with reference models' perplexities on the same
    held-out windows as horizontal lines (log scale when it spans a decade)."""
    from gqakit.common.plots import new_figure

    pairs = [(int(r["tokens"]), float(r["eval_ppl"])) for r in rows if r.get("eval_ppl") not in ("", None)]
    fig = new_figure()
    ax = fig.add_subplot()
    ax.plot([t for t, _ in pairs], [p for _, p in pairs], "o-", color="tab:red", label="uptrained model")
    for i, (name, ppl) in enumerate(references.items()):
        ax.axhline(ppl, ls="--", lw=1, color=f"C{i}", label=f"{name} ({ppl:,.1f})")
    values = [p for _, p in pairs] + list(references.values())
    if max(values) / max(min(values), 1e-9) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(title)
    ax.legend(frameon=False)
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    """python -m gqakit.uptrain.run.metrics RUN_DIR -o PLOT.png [--reference NAME=PPL ...]"""
    import argparse
    import csv as _csv

    p = argparse.ArgumentParser(prog="python -m gqakit.uptrain.run.metrics", description=plot_heldout.__doc__)
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--reference", action="append", default=[], metavar="NAME=PPL")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    with (Path(args.run_dir) / "metrics.csv").open() as f:
        rows = list(_csv.DictReader(f))
    refs = {k: float(v) for k, _, v in (r.partition("=") for r in args.reference)}
    plot_heldout(rows, Path(args.output), refs, args.title)


if __name__ == "__main__":
    main()
