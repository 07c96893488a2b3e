"""The GPU device check (benchmarks/gpu/run.sh) end to end on CPU, so that its code cannot rot between the rare runs
on a lent GPU: DRY_RUN=1 runs the decode and training benchmarks' dry runs (tiny shapes, CPU) and the cuda tests
(which skip here), and the summary must report every part and pass."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_dry_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), DRY_RUN="1", WHEELS=str(tmp_path / "no-wheels"),
               TMPDIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [p["part"] for p in report["parts"]] == ["pytest", "decode", "train"]
    assert report["failed"] == [] and report["pytest"]["failed"] == 0 and report["pytest"]["skipped"] > 0
    assert {"MHA", "GQA-2", "MQA"} <= set(report["decode"]["variants"])
    assert report["train"]["uptrain"]["ddp"]["vs_bare"] > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["decode.png", "image-packages.txt", "pytest.log",
                                                                    "report.json", "report.md", "run.log"]
    own = (tmp_path / "out" / "image-packages.txt").read_text().split()
    assert any(line.startswith("torch==") for line in own), own[:5]  # the environment's own packages
