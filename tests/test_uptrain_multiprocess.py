"""`gqakit uptrain` on several CPU processes (gloo): data parallel equals one process with the same
global batch, and the silent single-process launch is refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from uptrain_tiny import make_text, make_uptrain_model, write_recipe

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).parent


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--standalone",
           *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    model = make_uptrain_model(tmp_path / "m")
    text = make_text(tmp_path / "t.txt")
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(text)], steps=3, seq_len=32)
    for name, n, batch in (("one", 1, 4), ("two", 2, 2)):
        dump = tmp_path / name
        dump.mkdir()
        run = _torchrun(n, str(TESTS / "uptrain_worker.py"), str(recipe), str(dump),
                        f"output_dir={tmp_path / name / 'run'}", f"batch_size={batch}")
        assert run.returncode == 0, run.stderr[-3000:]
    one = load_file(tmp_path / "one" / "rank-0.safetensors")
    r0, r1 = (load_file(tmp_path / "two" / f"rank-{r}.safetensors") for r in (0, 1))
    for key in one:
        assert torch.equal(r0[key], r1[key]), key  # replicas stay identical
        assert torch.allclose(r0[key], one[key], atol=1e-5, rtol=0), key  # = one process, same global batch
    assert not torch.equal(one["model.layers.0.self_attn.k_proj.weight"],
                           load_file(model / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"])
    final = load_file(tmp_path / "two" / "run" / "model.safetensors")
    assert torch.equal(final["model.norm.weight"], r0["model.norm.weight"])  # rank 0 wrote the final model


def test_accelerate_cpu_launch_of_n_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process: refuse instead of training alone."""
    model = make_uptrain_model(tmp_path / "m")
    text = make_text(tmp_path / "t.txt")
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(text)], steps=1,
                          output_dir=str(tmp_path / "run"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "-m", "gqakit.cli",
           "uptrain", str(recipe)]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "accelerate launch asked for 2 processes but started one" in run.stderr
    assert not (tmp_path / "run").exists()
