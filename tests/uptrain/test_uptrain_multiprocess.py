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

from fork_cli import torchrun
from uptrain_tiny import make_pairs, make_t5_model, make_text, make_uptrain_model, write_recipe

pytestmark = pytest.mark.multiprocess
WORKERS = Path(__file__).resolve().parents[1] / "workers"


def _env() -> dict:
    paths = (str(WORKERS), str(WORKERS.parent / "support"), os.environ.get("PYTHONPATH", ""))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    launcher, env = torchrun(n, _env())  # its workers forked from one import of torch (fork_cli)
    return subprocess.run([*launcher, *args], env=env, capture_output=True, text=True, timeout=300)


def _one_and_two(tmp_path, recipe) -> tuple[dict, dict, dict]:
    """The recipe on one process with batch 4, and on two with batch 2 each: (one's rank 0, two's ranks 0 and 1)."""
    for name, n, batch in (("one", 1, 4), ("two", 2, 2)):
        dump = tmp_path / name
        dump.mkdir()
        run = _torchrun(n, str(WORKERS / "uptrain_worker.py"), str(recipe), str(dump),
                        f"output_dir={tmp_path / name / 'run'}", f"batch_size={batch}")
        assert run.returncode == 0, run.stderr[-3000:]
    one = load_file(tmp_path / "one" / "rank-0.safetensors")
    r0, r1 = (load_file(tmp_path / "two" / f"rank-{r}.safetensors") for r in (0, 1))
    return one, r0, r1


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    model = make_uptrain_model(tmp_path / "m")
    text = make_text(tmp_path / "t.txt")
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(text)], steps=3, seq_len=32)
    one, r0, r1 = _one_and_two(tmp_path, recipe)
    for key in one:
        assert torch.equal(r0[key], r1[key]), key  # replicas stay identical
        assert torch.allclose(r0[key], one[key], atol=1e-5, rtol=0), key  # = one process, same global batch
    assert not torch.equal(one["model.layers.0.self_attn.k_proj.weight"],
                           load_file(model / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"])
    final = load_file(tmp_path / "two" / "run" / "model.safetensors")
    assert torch.equal(final["model.norm.weight"], r0["model.norm.weight"])  # rank 0 wrote the final model
    rng = [(tmp_path / "two" / f"rng-{r}.txt").read_text() for r in (0, 1)]
    assert rng[0] != rng[1]  # each rank its own random stream (dropout masks), from (seed, rank)


@pytest.mark.parametrize("pairs", [False, True], ids=["span-corruption", "input-target-pairs"])
def test_an_encoder_decoder_on_two_processes_equals_one(tmp_path, pairs):
    """T5's span corruption depends on each window alone, and input/target pairs are normalised by the step's
    target tokens over every process, so DDP's split of the batch changes nothing: one step's gradients and weights
    equal one process's (1e-5). One step, not three: this T5's embeddings are ~4x larger than the Llama's and after
    three AdamW steps the fp32 rounding of the split sums grows to ~8e-5 on them."""
    model = make_t5_model(tmp_path / "m", kv_heads=2)
    if pairs:
        data, _ = make_pairs(tmp_path / "pairs.jsonl", 40)
        extra = {"target_column": "target"}
    else:
        data, extra = make_text(tmp_path / "t.txt", chars=20_000), {}
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(data)], steps=1, seq_len=64, **extra)
    one, r0, r1 = _one_and_two(tmp_path, recipe)
    key = "decoder.block.0.layer.1.EncDecAttention.k.weight"
    assert r0[key].shape[0] == 2 * 8  # the grouped cross-attention trained
    assert not torch.equal(one[key], load_file(model / "model.safetensors")[key])
    for key in one:
        assert torch.equal(r0[key], r1[key]), key
        assert torch.allclose(r0[key], one[key], atol=1e-5, rtol=0), key


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


def _run_worker(tmp_path, name: str, n: int, recipe, *overrides: str) -> tuple[dict, dict]:
    dump = tmp_path / name
    dump.mkdir()
    run = _torchrun(n, str(WORKERS / "uptrain_worker.py"), str(recipe), str(dump),
                    f"output_dir={dump / 'run'}", *overrides)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    return (load_file(dump / "rank-0.safetensors"), json.loads((dump / "rank-0.json").read_text()))


@pytest.mark.parametrize("processes,context_parallel,attention", [
    (2, 2, {"teacher": True}), (4, 4, {}), (2, 2, {"attention": "sliding", "window": 8}),
    (4, 2, {"gradient_checkpointing": True}),
], ids=["P2-distill", "P4", "P2-window", "2rings-x-P2-checkpointing"])
def test_context_parallel_step_equals_the_single_process_step(tmp_path, processes, context_parallel, attention):
    """One training step with each sequence split over a ring (P = 2, 4; with 4 processes and P = 2 also
    data parallel over 2 rings) equals the single-process step on whole sequences: loss within 1e-5,
    parameter gradients within 1e-4 (fp32). seq_len 30 is not a multiple of 2P, so padding is exercised;
    the first case also distils from an MHA teacher, which then runs inside the ring too."""
    model = make_uptrain_model(tmp_path / "m")
    fields = dict(attention)
    if fields.pop("teacher", False):
        fields["teacher"] = str(make_uptrain_model(tmp_path / "teacher", kv_heads=4, seed=1))
    text = make_text(tmp_path / "t.txt")
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(text)], steps=1, seq_len=30,
                          grad_clip=0.0, batch_size=2, **fields)
    one, row_one = _run_worker(tmp_path, "one", 1, recipe)
    batch = 2 * context_parallel // processes  # the same global batch of 2 sequences
    ring, row_ring = _run_worker(tmp_path, "ring", processes, recipe, f"context_parallel={context_parallel}",
                                 f"batch_size={batch}")
    assert row_ring["loss"] == pytest.approx(row_one["loss"], abs=1e-5)
    assert (row_one["kd"] != "") == ("teacher" in fields)
    assert row_ring["eval_loss"] == pytest.approx(row_one["eval_loss"], abs=1e-5)  # held-out loss, sharded too
    grads = [k for k in one if k.startswith("grad.")]
    assert len(grads) == 20  # every parameter got a gradient
    for key in grads:
        assert torch.allclose(ring[key], one[key], atol=1e-4, rtol=0), key


def test_an_error_under_torchrun_is_said_once(tmp_path):
    """Every rank refuses the same recipe; only rank 0 prints the one line (torchrun adds its own report)."""
    model = make_uptrain_model(tmp_path / "m")
    text = make_text(tmp_path / "t.txt")
    recipe = write_recipe(tmp_path / "r.yaml", model=str(model), data=[str(text)], steps=1, seq_len=32,
                          output_dir=str(tmp_path / "run"), attention="sliding")  # no window: refused
    run = _torchrun(2, "-m", "gqakit.cli", "uptrain", str(recipe))
    assert run.returncode != 0
    said = (run.stdout + run.stderr).count("gqakit: error: attention=sliding: attention kind 'sliding' needs a window")
    assert said == 1, run.stderr[-3000:]
