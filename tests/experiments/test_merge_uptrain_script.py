"""benchmarks/merge_uptrain.py reuses a finished conversion or run only when the same arguments made it: one made
with other --method-args, or by another --recipe, was read back and reported under the new command's labels."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import merge_uptrain

    made = []

    def run_logged(cmd, log):  # stands in for convert-gqa / gqakit uptrain: writes what each leaves when done
        out = Path(cmd[cmd.index("-o") + 1]) if "-o" in cmd else Path(
            next(a for a in cmd if a.startswith("output_dir=")).split("=", 1)[1])
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / ("config.json" if "-o" in cmd else "uptraining.json")).write_text("{}")
        made.append(cmd)
        return 1.0

    monkeypatch.setattr(merge_uptrain, "ROOT", tmp_path)
    monkeypatch.setattr(merge_uptrain, "run_logged", run_logged)
    (tmp_path / "a.yaml").write_text("steps: 1\n")
    (tmp_path / "b.yaml").write_text("steps: 2\n")
    yield merge_uptrain, made
    sys.modules.pop("merge_uptrain", None)


def test_a_conversion_is_reused_only_for_the_same_arguments(script):
    merge_uptrain, made = script
    assert merge_uptrain.convert(2, "fit", ["--calibration", "x.txt"], Path("runs"))[1] == 1.0
    assert merge_uptrain.convert(2, "fit", ["--calibration", "x.txt"], Path("runs"))[1] is None  # reused
    assert len(made) == 1
    with pytest.raises(SystemExit, match=r"runs/convert/g2-fit was made by .*x\.txt.* not by .*y\.txt.*; remove it"):
        merge_uptrain.convert(2, "fit", ["--calibration", "y.txt"], Path("runs"))


def test_a_run_is_reused_only_for_the_same_recipe_text_and_overrides(script, tmp_path):
    merge_uptrain, made = script
    assert merge_uptrain.uptrain("m", "runs/t/g2-mean", ["eval_every=1"], "a.yaml") == 1.0
    assert merge_uptrain.uptrain("m", "runs/t/g2-mean", ["eval_every=1"], "a.yaml") is None
    for model, overrides, recipe in (("m", ["eval_every=1"], "b.yaml"), ("m", ["eval_every=2"], "a.yaml"),
                                     ("n", ["eval_every=1"], "a.yaml")):
        with pytest.raises(SystemExit, match="runs/t/g2-mean was made by"):
            merge_uptrain.uptrain(model, "runs/t/g2-mean", overrides, recipe)
    (tmp_path / "a.yaml").write_text("steps: 3\n")  # the same file, edited
    with pytest.raises(SystemExit, match="recipe_sha256"):
        merge_uptrain.uptrain("m", "runs/t/g2-mean", ["eval_every=1"], "a.yaml")
    assert json.loads((tmp_path / "runs/t/g2-mean.made.json").read_text())["recipe"] == "a.yaml"
    assert len(made) == 1


def test_a_run_trained_from_a_conversion_made_otherwise_is_not_reused(script, tmp_path):
    """Following the advice (remove the conversion, convert again with other arguments) must not leave the run
    trained from the old conversion to be reported under the new one."""
    merge_uptrain, made = script
    model, _ = merge_uptrain.convert(2, "fit", ["--calibration", "a.txt"], Path("runs"))
    merge_uptrain.uptrain(model, "runs/t/g2-fit", [], "a.yaml")
    import shutil

    shutil.rmtree(tmp_path / model)
    model, _ = merge_uptrain.convert(2, "fit", ["--calibration", "b.txt"], Path("runs"))
    with pytest.raises(SystemExit, match=r"runs/t/g2-fit was made by .*a\.txt.*; remove it"):
        merge_uptrain.uptrain(model, "runs/t/g2-fit", [], "a.yaml")
    assert len(made) == 3  # two conversions and one run
