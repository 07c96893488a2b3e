"""One bf16 step of `gqakit uptrain` equals a reference loop written out here: sharding=ddp under torchrun with
one process (accelerate wraps the model in DDP; bf16 autocast) and sharding=fsdp in a world of one (FSDP2's
mixed-precision policy: bf16 parameters for compute, fp32 gradient reduction and master weights). The CPU case runs
in the normal suite (gloo), the CUDA case under `-m cuda` (NCCL).

The reference loop takes the same windows (gqakit's data pipeline and batch order: what is compared is the step),
the same model, AdamW and schedule, and computes the loss (cross-entropy sum / target tokens), the backward, the
clip and the update by hand. Tolerances (bf16, as tests/uptrain/test_uptrain_fsdp.py): the loss within 1e-3, the
clipped gradients within 2% (relative norm of the difference), and each weight's change over the step within 5% of
the reference's change (Adam turns bf16 rounding in near-zero gradients into differences of order lr per element).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devices import DEVICES
from gqakit.common.recipes import load_recipe
from gqakit.uptrain import UptrainConfig
from uptrain_tiny import make_text, make_uptrain_model, write_recipe

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("uptrain-step")
    model, text = make_uptrain_model(root / "m"), make_text(root / "t.txt")
    return write_recipe(root / "r.yaml", model=str(model), data=[str(text)], steps=1, seq_len=32, batch_size=4,
                        grad_clip=1.0, eval_fraction=0.0, mixed_precision="bf16", save_dtype="float32")


def gqakit_step(recipe: Path, dump: Path, sharding: str, device: str) -> tuple[dict, dict]:
    """(the step's metrics row, weights and gradients after it) of a one-process torchrun launch."""
    dump.mkdir()
    paths = [str(TESTS / "workers"), str(TESTS / "support"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # accelerate would take a GPU where there is one
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone",
                          str(TESTS / "workers" / "uptrain_worker.py"), str(recipe), str(dump),
                          f"output_dir={dump / 'run'}", f"sharding={sharding}"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((dump / "rank-0.json").read_text()), load_file(dump / "rank-0.safetensors")


def reference_step(recipe: Path, sharding: str, device: str) -> tuple[float, dict, dict, dict]:
    """(loss, weights before, weights after, clipped gradients) of the same step, by hand."""
    from gqakit.uptrain import modeling
    from gqakit.uptrain.data.batches import BatchOrder, load_training_data
    from gqakit.uptrain.data.token_build import load_tokenizer
    from gqakit.uptrain.loss import cross_entropy_sum

    cfg = load_recipe(UptrainConfig, recipe, ["output_dir=unused"])  # nothing is written
    data = load_training_data(cfg, load_tokenizer(cfg.model))
    seqs = data.train[BatchOrder(len(data.train), cfg.batch_size, 1, 1, cfg.seed).indices(0, 0, 0)].to(device)
    model = modeling.load_lm(cfg.model).to(device).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = modeling.make_optimizer(model, cfg.lr, cfg.betas, cfg.weight_decay)
    scheduler = modeling.make_scheduler(optimizer, cfg.steps, modeling.warmup_steps(cfg.steps, cfg.warmup_steps,
                                                                                    cfg.warmup_fraction),
                                        cfg.min_lr_ratio)
    inputs, targets = seqs[:, :-1], seqs[:, 1:]  # (B, T)
    positions = torch.arange(inputs.shape[1], device=device).expand_as(inputs)
    if sharding == "ddp":  # accelerate's autocast: fp32 weights, bf16 compute where autocast says
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        loss = cross_entropy_sum(logits, targets) / targets.numel()
        loss.backward()
    else:  # FSDP2's policy: a bf16 copy of the parameters computes (buffers stay fp32), gradients come back fp32
        work = copy.deepcopy(model)
        for p in work.parameters():
            p.data = p.data.to(torch.bfloat16)
        loss = cross_entropy_sum(work(input_ids=inputs, position_ids=positions, use_cache=False).logits,
                                 targets) / targets.numel()
        loss.backward()
        for p, w in zip(model.parameters(), work.parameters()):
            p.grad = w.grad.float()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    scheduler.step()
    return float(loss.detach()), before, {n: p.detach() for n, p in model.named_parameters()}, grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm().clamp_min(1e-30))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_one_bf16_step_equals_the_reference_loop(recipe, tmp_path, sharding, device):
    row, dumped = gqakit_step(recipe, tmp_path / "dump", sharding, device)
    loss, before, after, grads = reference_step(recipe, sharding, device)
    assert float(row["loss"]) == pytest.approx(loss, abs=1e-3)
    for name, want in after.items():
        assert relative(dumped[f"grad.{name}"], grads[name]) <= 0.02, name
        change, want_change = dumped[name] - before[name].cpu(), want.cpu() - before[name].cpu()
        assert relative(change, want_change) <= 0.05, name
