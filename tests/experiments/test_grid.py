"""The GQA-paper grid end to end on a tiny MHA model: convert, score, uptrain, score, table, plot."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gqakit.common.errors import GqakitError
from gqakit.common.recipes import from_dict, to_dict
from gqakit.experiments.grid import GridConfig, run_grid
from gqakit.experiments.grid_report import grid_table
from uptrain_tiny import make_text, make_uptrain_model


def test_grid_runs_every_cell_once_and_writes_one_table_and_plot(tmp_path, capsys):
    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "eval.txt")
    cfg = from_dict(GridConfig, {
        "model": str(model), "output_dir": str(tmp_path / "grid"), "groups": [2], "methods": ["mean", "random"],
        "alphas": [0.1], "mqa_alphas": [], "distill": [False, True], "eval_text": str(text), "eval_tokens": 256,
        "eval_window": 32,
        "uptrain": {"data": [str(_train_text(text))], "seq_len": 32, "batch_size": 2, "lr": 1.0e-3, "progress": False,
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
    assert grid_table(rows) == table.strip()


def _train_text(eval_text: Path, chars: int = 12_000) -> Path:
    """Training text beside `eval_text`, from another part of the book (the grid refuses to train on its eval_text)."""
    return make_text(Path(eval_text).with_name("train.txt"), chars=chars, start=100_000)


def _tiny_grid(tmp_path, model, text, **fields) -> dict:
    return {"model": str(model), "output_dir": str(tmp_path / "grid"), "groups": [2], "alphas": [], "mqa_alphas": [],
            "distill": [], "mha_control": False, "eval_text": str(text), "eval_tokens": 256, "eval_window": 32,
            "uptrain": {"data": [str(_train_text(text))], "seq_len": 32, "batch_size": 2, "progress": False,
                        "threads": 1},
            **fields}


def test_grid_adds_aligned_and_fit_rows_and_keeps_finished_cells(tmp_path):
    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "eval.txt")
    calibration = make_text(tmp_path / "calibration.txt", chars=8_000, start=150_000)
    first = run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"])))
    cells = tmp_path / "grid" / "cells"
    stamps = {p.name: p.stat().st_mtime_ns for p in cells.iterdir()}
    assert sorted(stamps) == ["gqa2-mean-a0.json", "mha.json"]

    cfg = from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean", "aligned", "fit"],
                                           calibration=str(calibration), calibration_tokens=512, keep_models=True))
    rows = run_grid(cfg)
    assert [r["name"] for r in rows] == ["mha", "gqa2-mean-a0", "gqa2-aligned-a0", "gqa2-fit-a0"]
    assert rows[:2] == first  # the finished cells are read back, not recomputed
    assert {n: t for n, t in ((p.name, p.stat().st_mtime_ns) for p in cells.iterdir()) if n in stamps} == stamps
    assert all(r["perplexity"] > 0 for r in rows)
    table = (tmp_path / "grid" / "results.md").read_text()
    assert f"| 2 | fit | {rows[3]['perplexity']:.2f} |" in table
    # calibration data goes to fit only: aligned stays a weights-only merge
    models = tmp_path / "grid" / "models" / "gqa2"
    assert "| calibration | none (weights only) |" in (models / "aligned" / "README.md").read_text()
    fit_card = (models / "fit" / "README.md").read_text()
    assert f"| calibration data | `{calibration}`" in fit_card and "| calibration tokens | 512:" in fit_card
    assert json.loads((tmp_path / "grid" / "grid.json").read_text())["calibration"] == str(calibration)


def test_cells_made_with_other_settings_are_refused_not_reported_under_these(tmp_path):
    """A finished cell is reused only under the settings it was made with: another eval_tokens (or an edited eval
    text) would report old numbers under the new settings. Refused in one line; force=true starts over."""
    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "eval.txt")
    first = run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"])))
    with pytest.raises(GqakitError, match=r"holds cells made with other eval_tokens; .* pass force=true"):
        run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"], eval_tokens=128)))
    same = dict(model=f"./{model.relative_to(Path.cwd())}/" if model.is_relative_to(Path.cwd()) else f"{model}/",
                uptrain={**_tiny_grid(tmp_path, model, text)["uptrain"], "progress": True, "betas": (0.9, 0.95)})
    os.utime(model / "config.json")  # touched, not changed: a copy or a checkout does this
    again = run_grid(from_dict(GridConfig, {**_tiny_grid(tmp_path, model, text, methods=["mean"]), **same}))
    assert again == first  # the same bytes, another spelling of the path, a tuple, a key that changes no number
    (model / "pretraining.json").write_text((model / "pretraining.json").read_text().replace("3200", "6400"))
    with pytest.raises(GqakitError, match="holds cells made with other model_files"):
        run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"])))
    (model / "pretraining.json").write_text((model / "pretraining.json").read_text().replace("6400", "3200"))
    text.write_text(text.read_text() + " More text.")
    with pytest.raises(GqakitError, match="holds cells made with other eval_text_file"):
        run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"])))
    again = run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"], eval_tokens=128,
                                                      force=True)))
    assert [r["name"] for r in again] == ["mha", "gqa2-mean-a0"]
    assert again[0]["perplexity"] != first[0]["perplexity"]  # scored again on 128 tokens, not read back
    assert run_grid(from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean"], eval_tokens=128))) \
        == again  # the same settings: the cells are read back


@pytest.mark.parametrize("fields, message", [
    ({"methods": ["mean", "fit"]}, "method fit needs calibration data"),
    ({"methods": ["mean", "aligned"], "calibration": "cal.txt"}, "calibration is used only by method fit"),
    ({"methods": ["fit"], "calibration": "cal.txt", "calibration_tokens": 0}, "calibration_tokens=0 must be > 0"),
    ({"methods": ["mean"], "calibration_tokens": 1024}, "calibration_tokens needs calibration"),
    ({"methods": ["mean", "pca"]}, "holds pca, not a convert-gqa method"),
    # set per cell: a shared teacher distilled the cells reported as not distilled; the others were overridden
    ({"uptrain": {"teacher": "m"}}, "uptrain.teacher is set by the grid for each cell (distill: true cells"),
    ({"uptrain": {"seed": 5}}, "uptrain.seed is set by the grid for each cell (the grid's seed)"),
    ({"uptrain": {"alpha": 0.5}}, "uptrain.alpha is set by the grid for each cell"),
    ({"uptrain": {"model": "other"}}, "uptrain.model is set by the grid for each cell"),
    ({"uptrain": {"force": False}}, "uptrain.force is set by the grid for each cell"),
    # the grid's budget: a shared steps / tokens stopped the first uptrained cell, after the files were written
    ({"uptrain": {"steps": 3}}, "uptrain.steps is set by the grid for each cell (its budget, alpha: alphas"),
    ({"uptrain": {"tokens": 512}}, "uptrain.tokens is set by the grid for each cell (its budget, alpha: alphas"),
])
def test_grid_refuses_bad_method_or_calibration_in_one_line(tmp_path, fields, message):
    with pytest.raises(GqakitError) as e:
        from_dict(GridConfig, {"model": "m", "output_dir": str(tmp_path), "uptrain": {}, **fields}, source="grid.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("grid.yaml: ")


@pytest.mark.parametrize("where", ["uptrain data", "calibration"])
def test_grid_refuses_to_score_on_text_it_trains_or_fits_on(tmp_path, where):
    """eval_text inside the uptraining data or the calibration text (here a copy of its start, under another name)
    ran silently: every cell was scored on text it was fitted on."""
    from gqakit.experiments.grid import _check

    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "eval.txt")
    inside = make_text(tmp_path / "book.txt", chars=30_000)  # eval.txt is its first 12,000 characters
    fields = ({"uptrain": {"data": [str(inside)], "seq_len": 32, "batch_size": 2}} if where == "uptrain data" else
              {"methods": ["fit"], "calibration": str(inside)})
    cfg = from_dict(GridConfig, _tiny_grid(tmp_path, model, text, **fields))
    with pytest.raises(GqakitError) as e:
        _check(cfg)
    assert f"eval_text {text} and {where} {inside} hold the same text" in str(e.value)
    assert "\n" not in str(e.value)


def test_grid_refuses_a_grouping_the_model_cannot_take_before_any_cell(tmp_path, monkeypatch):
    """groups=[3] on 4 heads failed only when its first conversion ran, after the MHA control cells had trained
    (a review: 5 minutes in). Every (groups, method) is planned on the headers before any cell."""
    from gqakit.experiments import grid

    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "eval.txt")
    cfg = from_dict(GridConfig, _tiny_grid(tmp_path, model, text, groups=[2, 3]))
    monkeypatch.setattr(grid, "run_cell", lambda *a, **k: pytest.fail("a cell ran before the refusal"))
    with pytest.raises(GqakitError) as e:
        run_grid(cfg)
    assert "groups=3, method=mean: 4 heads are not divisible into 3 groups" in str(e.value)
    assert not (tmp_path / "grid").exists() or not any((tmp_path / "grid").iterdir())


def _grid_refused(tmp_path, recipe: dict, *overrides: str, needles: tuple[str, ...]) -> str:
    """`python -m gqakit.experiments.grid RECIPE key=value ...` (forked from the test server): exit 2, one
    `gqakit grid: error:` line holding every needle, and nothing under tmp_path written or changed."""
    from cli_contract import assert_one_line_error, run_cli, snapshot

    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    before = snapshot(tmp_path)
    result = run_cli("python-worker", "-u", "-m", "gqakit.experiments.grid", str(path), *overrides)
    line = assert_one_line_error(result, "gqakit grid", *needles)
    assert snapshot(tmp_path) == before, line
    assert not (tmp_path / "grid").exists()
    return line


def test_grid_scores_no_position_past_the_context_nor_a_window_cut_to_the_text(tmp_path):
    """eval_window=2048 on a 1,024-token model scored unseen positions without a word, where `gqakit eval ppl
    --max-length 2048` is refused; eval_tokens (or a text) shorter than one window was scored in a shorter window
    and recorded as eval_window. Each is refused as `gqakit eval ppl` refuses it, before the grid writes anything."""
    from gqakit.experiments.grid import _check

    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)  # a 128-token context
    recipe = _tiny_grid(tmp_path, model, make_text(tmp_path / "eval.txt"), methods=["mean"])
    _grid_refused(tmp_path, recipe, "eval_window=256", "eval_tokens=1024",
                  needles=("eval_window=256 exceeds a model's 128-token context; use eval_window <= 128",))
    _grid_refused(tmp_path, recipe, "eval_tokens=100", "eval_window=128",
                  needles=("eval_tokens=100 is shorter than one window of eval_window=128; use eval_tokens >= 128 "
                           "(0 = the whole text) or eval_window <= 100",))
    short = make_text(tmp_path / "short.txt", chars=200)
    line = _grid_refused(tmp_path, recipe, f"eval_text={short}", "eval_tokens=0", "eval_window=128",
                         needles=(f"eval_text {short} has ", "tokens (mha's tokenizer), shorter than one window of "
                                  "eval_window=128; pass a longer eval_text or eval_window <= "))
    assert int(line.rsplit("<= ", 1)[1]) < 128
    _check(from_dict(GridConfig, {**recipe, "eval_window": 128}))  # the whole context is a window


@pytest.mark.parametrize("overrides, needle", [
    # G = 1 cells take mqa_alphas: alphas trained nothing (the review's groups=[1], mha_control: false)
    (("groups=[1]", "alphas=[0.002]", "mqa_alphas=[0.1]", "distill=[false]"),
     'alphas=[0.002] is read by no cell: they are the budgets of the G > 1 cells (each trained once per distill '
     'value) and of the MHA control, and here groups=[1], methods=["mean"], distill=[false], mha_control=false; set '
     'alphas: [] or add a G > 1 to groups, or set mha_control: true'),
    (("mqa_alphas=[0.1]", "distill=[false]"), "mqa_alphas=[0.1] is read by no cell: they are the budgets of the G = 1"),
    (("alphas=[0.1]",), "alphas=[0.1] is read by no cell: "),  # distill=[]: no converted cell is uptrained
    (("distill=[false]",), 'distill=[false] is read by no cell: it says how the converted cells that alphas / '
                           'mqa_alphas uptrain are trained, and here groups=[2], methods=["mean"], alphas=[], '
                           'mqa_alphas=[]; set distill: []'),
    (("methods=[]",), "groups=[2] is read by no cell: each G is converted by each of methods, and here methods=[]"),
    # a value twice: its cell ran once and was reported twice
    (("methods=[mean,mean]",), 'methods=["mean", "mean"] lists "mean" twice, which names the same cells; list each '
                               'value once'),
    (("groups=[2,2]",), "groups=[2, 2] lists 2 twice"),
    (("alphas=[0.1,0.10000001]", "distill=[false]"), "alphas=[0.1, 0.10000001] lists 0.1 twice"),
    (("alphas=[0.1]", "distill=[true,true]"), "distill=[true, true] lists true twice"),
    # a per-cell budget in the shared uptrain section: refused after the first cell had run and written its files
    (("alphas=[0.1]", "distill=[false]", "uptrain={data: [DATA], seq_len: 32, batch_size: 2, steps: 3}"),
     "uptrain.steps is set by the grid for each cell (its budget, alpha: alphas / mqa_alphas)"),
])
def test_grid_refuses_a_list_no_cell_reads_a_repeated_value_and_a_shared_budget_before_writing(tmp_path, overrides,
                                                                                               needle):
    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    recipe = _tiny_grid(tmp_path, model, make_text(tmp_path / "eval.txt"), methods=["mean"])
    data = recipe["uptrain"]["data"][0]  # DATA: the recipe's training text
    _grid_refused(tmp_path, recipe, *(o.replace("DATA", data) for o in overrides), needles=(needle,))


def test_the_mha_control_reads_both_budget_lists(tmp_path):
    """With mha_control, the MHA model is trained for every alpha of alphas and mqa_alphas: neither is refused, even
    where no converted cell reads it."""
    from gqakit.experiments.grid import _cells, _name

    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    grid = _tiny_grid(tmp_path, model, make_text(tmp_path / "eval.txt"), methods=["mean"], groups=[1],
                      alphas=[0.05], mqa_alphas=[0.1], distill=[False], mha_control=True)
    assert [_name(c) for c in _cells(from_dict(GridConfig, grid))] == ["mha", "mha-a0.05", "mha-a0.1", "mqa-mean-a0",
                                                                       "mqa-mean-a0.1"]


def test_grid_on_an_encoder_decoder_scores_span_corruption(tmp_path):
    """The paper's own setting: a T5 grouped, scored and uptrained on span corruption; the alpha-0 cells equal
    `gqakit eval ppl` of the converted models (the same corrupted windows), and no KD column is written for a
    grid without distillation."""
    from gqakit.cli import main
    from uptrain_tiny import make_t5_model

    model = make_t5_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=2_560)
    text = make_text(tmp_path / "eval.txt", chars=20_000)
    cfg = from_dict(GridConfig, _tiny_grid(tmp_path, model, text, methods=["mean", "first"], alphas=[0.1],
                                           distill=[False], eval_window=64, keep_models=True,
                                           uptrain={"data": [str(_train_text(text, 20_000))], "seq_len": 64,
                                                    "batch_size": 2,
                                                    "progress": False, "threads": 1, "eval_fraction": 0.0}))
    rows = {r["name"]: r for r in run_grid(cfg)}
    assert rows["gqa2-mean-a0.1"]["steps"] == 2  # 10% of 2,560 tokens in steps of 2 x 64
    assert rows["gqa2-mean-a0.1"]["perplexity"] != rows["gqa2-mean-a0"]["perplexity"]
    table = (tmp_path / "grid" / "results.md").read_text()
    assert table.splitlines()[0] == "| K/V heads | method | alpha 0 | alpha 0.1 |"
    report = tmp_path / "ppl"
    converted = tmp_path / "grid" / "models" / "gqa2" / "mean"
    assert main(["eval", "ppl", str(model), str(converted), "--text", str(text), "--max-length", "64",
                 "--max-tokens", "256", "-o", str(report), "-q"]) == 0
    scored = json.loads((report / "results.json").read_text())["results"]["rows"]
    assert [r["objective"] for r in scored] == ["span_corruption"] * 2
    assert scored[0]["perplexity"] == pytest.approx(rows["mha"]["perplexity"], rel=1e-6)
    assert scored[1]["perplexity"] == pytest.approx(rows["gqa2-mean-a0"]["perplexity"], rel=1e-6)


def test_the_grid_writes_only_into_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    """An output_dir holding the user's results.json, results.md and models/mine.txt was overwritten and its
    models/ deleted (a review); a cell file a crash cut short stopped every later run with a JSONDecodeError; Ctrl-C
    printed a traceback."""
    from gqakit.experiments import grid
    from gqakit.experiments.grid import _claim, _finished

    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    mine = tmp_path / "mine"
    (mine / "models").mkdir(parents=True)
    for name in ("results.json", "results.md", "models/mine.txt"):
        (mine / name).write_text("the user's")
    cfg = from_dict(GridConfig, {**_tiny_grid(tmp_path, model, make_text(tmp_path / "eval.txt")),
                                 "output_dir": str(mine)})
    for force in (False, True):
        with pytest.raises(GqakitError, match="has no grid.json: what it holds the grid did not write"):
            _claim(from_dict(GridConfig, {**to_dict(cfg), "force": force}), mine)
    (mine / "grid.json").write_text("{}")
    (mine / "notes.txt").write_text("mine too")
    with pytest.raises(GqakitError, match="holds notes.txt, which the grid did not write"):
        _claim(cfg, mine)
    assert sorted(p.name for p in mine.rglob("*")) == ["grid.json", "mine.txt", "models", "notes.txt",
                                                        "results.json", "results.md"]
    ours = tmp_path / "ours"  # a grid folder with a Finder file, or one a first run left with only an empty cells/
    (ours / "cells").mkdir(parents=True)
    (ours / ".DS_Store").write_bytes(b"")
    _claim(from_dict(GridConfig, {**to_dict(cfg), "output_dir": str(ours)}), ours)
    assert (ours / "grid.json").is_file()
    cut = tmp_path / "cell.json"
    cut.write_text('{"name": "mha", "perplex')
    assert _finished(cut) is None and "unreadable" in capsys.readouterr().out

    def stopped(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(grid, "run_grid", stopped)
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(json.dumps(_tiny_grid(tmp_path, model, tmp_path / "eval.txt")))
    assert grid.main([str(recipe)]) == 130
    assert capsys.readouterr().err == ("gqakit grid: interrupted; the finished cells are kept: run the same command "
                                       "again to go on\n")


def test_grid_help_prints_usage(capsys):
    """`--help` was read as a recipe path ("recipe --help does not exist", exit 2)."""
    from gqakit.experiments.grid import main

    assert main(["--help"]) == 0 and "usage: python -m gqakit.experiments.grid RECIPE.yaml" in capsys.readouterr().out


def test_the_distill_keys_reach_the_distilling_cells_only(tmp_path):
    """Found beside the grid's review: a distill key in the shared `uptrain:` section was refused ("needs a teacher")
    even with distill: true, and passed on it would have made uptrain refuse the cells that do not distil. The
    distilling cells read it (with the MHA model as teacher), the others train without it; with no distilling cell
    it is refused, before anything is written."""
    model = make_uptrain_model(tmp_path / "mha", kv_heads=4, pretraining_tokens=3_200)
    text = make_text(tmp_path / "eval.txt")
    grid = _tiny_grid(tmp_path, model, text, methods=["mean"], alphas=[0.1], distill=[False, True], keep_models=True)
    grid["uptrain"] = {**grid["uptrain"], "distill_temperature": 2.0}
    _grid_refused(tmp_path, grid, "distill=[false]",
                  needles=("uptrain.distill_temperature is read by distilling cells only", "add true to distill"))
    rows = run_grid(from_dict(GridConfig, grid))
    assert [r["name"] for r in rows] == ["mha", "gqa2-mean-a0", "gqa2-mean-a0.1", "gqa2-mean-a0.1-kd"]
    uptrained = tmp_path / "grid" / "models" / "uptrained"
    plain = json.loads((uptrained / "gqa2-mean-a0.1" / "uptraining.json").read_text())["recipe"]
    distilled = json.loads((uptrained / "gqa2-mean-a0.1-kd" / "uptraining.json").read_text())["recipe"]
    assert (plain["teacher"], plain["distill_temperature"]) == (None, 1.0)
    assert (distilled["teacher"], distilled["distill_temperature"]) == (str(model), 2.0)
