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
    from ..evaluate.plots import new_figure

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
