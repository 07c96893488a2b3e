"""The GQA-paper grid end to end on a tiny MHA model: convert, score, uptrain, score, table, plot."""
from __future__ import annotations

import json

from gqakit.recipes import from_dict
from gqakit.uptrain.grid import GridConfig, run_grid
from gqakit.uptrain.report import format_table
from uptrain_tiny import make_text, make_uptrain_model


def test_grid_runs_every_cell_once_and_writes_one_table_and_plot(tmp_path, capsys):
    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "train.txt")
    cfg = from_dict(GridConfig, {
        "model": str(model), "output_dir": str(tmp_path / "grid"), "groups": [2], "methods": ["mean", "random"],
        "alphas": [0.1], "mqa_alphas": [], "distill": [False, True], "eval_text": str(text), "eval_tokens": 256,
        "eval_window": 32,
        "uptrain": {"data": [str(text)], "seq_len": 32, "batch_size": 2, "lr": 1.0e-3, "progress": False,
                    "eval_fraction": 0.0, "threads": 1},
    })
    rows = run_grid(cfg)
    names = [r["name"] for r in rows]
    assert names == ["mha", "mha-a0.1", "gqa2-mean-a0", "gqa2-mean-a0.1", "gqa2-mean-a0.1-kd",
                     "gqa2-random-a0", "gqa2-random-a0.1", "gqa2-random-a0.1-kd"]
    trained = [r for r in rows if r["alpha"] > 0]
    assert all(r["steps"] == 5 for r in trained)  # 10% of 3,200 tokens in steps of 2 x 32
    by_name = {r["name"]: r["perplexity"] for r in rows}
    assert by_name["gqa2-random-a0.1"] != by_name["gqa2-random-a0"]  # uptraining changed the model
    out = tmp_path / "grid"
    table = (out / "results.md").read_text()
    assert table.splitlines()[0] == "| K/V heads | method | alpha 0 | alpha 0.1 | alpha 0.1 + KD |"
    assert f"| 2 | mean | {by_name['gqa2-mean-a0']:.2f} | {by_name['gqa2-mean-a0.1']:.2f} |" in table
    assert (out / "gqa_paper.png").stat().st_size > 0
    assert len(json.loads((out / "results.json").read_text())["results"]) == 8
    assert f"| 4 (MHA) | - | {by_name['mha']:.2f} | {by_name['mha-a0.1']:.2f} |  |" in table
    assert not (out / "models").exists()  # converted and uptrained models are not kept by default

    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()}
    assert run_grid(cfg) == rows  # a second run reads every finished cell instead of training again
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()}
    assert format_table(rows) == table.strip()
