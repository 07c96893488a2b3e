"""The reference model's recipe without its corpora (no ../shared): one line, exit 2, nothing written."""
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reference_model.yaml"


def test_missing_corpora_are_one_line(tmp_path):
    out = tmp_path / "model"
    run = subprocess.run([sys.executable, "-m", "gqakit.reference.train", str(RECIPE), f"corpora_dir={tmp_path}",
                          f"output_dir={out}", f"heldout_output={tmp_path / 'heldout.txt'}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "corpus file" in lines[0] and "set corpora_dir=FOLDER" in lines[0], run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written
