"""Data-free calibration: `convert-gqa --method fit|transfer` without --calibration calibrates on the model's own
samples, seeded, said in one line, recorded in the card, and nothing is written outside the output but the kept
sample (sample_cache.py)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from cli_contract import run_cli, snapshot
from gqakit.common.errors import GqakitError
from gqakit.convert.calibrated import open_calibration
from gqakit.convert.calibration.data import sample_calibration
from gqakit.common.precision import auto_dtype
from gqakit.convert.layer_share import Share
from gqakit.convert.options import ConvertConfig
from tiny_models import make_tiny_llama

SMALL = ("--calibration-tokens", "256", "--calibration-window", "32", "-q")


def _weights(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("datafree") / "src", heads=4, layers=2)


def test_fit_without_calibration_samples_the_model_seeded(src, tmp_path):
    outs = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        before = snapshot(tmp_path, src)
        result = run_cli("convert-gqa", "--groups", "2", str(src), "-o", str(tmp_path / name), "--method", "fit",
                         "--seed", seed, *SMALL)
        assert result.returncode == 0, result.stderr
        notice = [line for line in result.stderr.splitlines() if "sampled from the model itself" in line]
        assert len(notice) == 1 and "256 tokens" in notice[0] and f"seed {seed}" in notice[0], result.stderr
        reused = "were sampled before; read from" in result.stderr  # b: a's sample, kept (sample_cache)
        assert reused == (name == "b"), result.stderr
        after = snapshot(tmp_path, src)
        outside = [p for p in set(after) - set(before) if not p.startswith(str(tmp_path / name))]
        assert not outside, f"written outside the output: {outside}"  # no sample file, no scratch beside it
        assert all(before[p] == after[p] for p in before), "a file outside the output changed"
        outs[name] = tmp_path / name
    assert _weights(outs["a"]) == _weights(outs["b"])  # deterministic for a seed
    assert _weights(outs["a"]) != _weights(outs["c"])  # another seed, other samples, another fit
    card = (outs["c"] / "README.md").read_text()
    assert "the model's own samples" in card and "seed 1" in card
    assert "| calibration tokens | 256: 7 windows of 32 fitted, 1 held out" in card


def test_sampled_windows_are_documents_of_the_model(src):
    config = {"max_position_embeddings": 128, "vocab_size": 64}
    data = sample_calibration(src, config, tokens=200, window=32, seed=3, device="cpu", progress=False, keep=False)
    again = sample_calibration(src, config, tokens=200, window=32, seed=3, device="cpu", progress=False, keep=False)
    assert data.windows.shape == (6, 32) and data.heldout == 1  # 200 // 32 whole windows, one in eight held out
    assert bool((data.windows[:, 0] == 1).all())  # each window starts a document at the config's BOS
    assert int(data.windows.max()) < 64 and data.path is None
    assert data.sampled == {"seed": 3, "temperature": 1.0, "top_p": 1.0, "dtype": auto_dtype("auto", "cpu")}
    assert torch.equal(data.windows, again.windows) and data.sha256 == again.sha256


def test_dry_run_samples_nothing_and_aligned_stays_weights_only(src, tmp_path):
    dry = run_cli("convert-gqa", "--groups", "2", str(src), "--method", "transfer", "--dry-run", *SMALL)
    assert dry.returncode == 0 and "sampled from the model itself" not in dry.stderr, dry.stderr
    cfg = ConvertConfig(model_dir=str(src), groups=2, method="aligned")
    assert open_calibration(cfg, src, {}) is None  # aligned without --calibration merges from the weights alone


def test_torchrun_needs_one_calibration_text(src):
    cfg = ConvertConfig(model_dir=str(src), groups=2, method="transfer")
    with pytest.raises(GqakitError, match="every process must calibrate on the same text"):
        open_calibration(cfg, src, {"max_position_embeddings": 128}, Share(rank=1, world=2))


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("args, needle", [
    (("--calibration-window", "4096"), "--calibration-window 4096 exceeds the model's 128-token context"),
    (("--calibration-tokens", "100", "--calibration-window", "64"), "--calibration-tokens 100 is less than two"),
    (("--calibration-device", "bogus"), "unknown --calibration-device 'bogus'"),  # a dry run planned it (CLI audit)
])
def test_data_free_windows_are_checked_before_sampling_and_on_a_dry_run(src, tmp_path, dry, args, needle):
    """The dry run refuses what the run refuses (it planned a window past the context; a review's finding), and the
    run refuses it before its notice that it samples (two lines before)."""
    from cli_contract import run_refused

    out = tmp_path / "out"
    line = run_refused(tmp_path, "convert-gqa", "--groups", "2", str(src), "--method", "fit", "-o", str(out), *args,
                       *(("--dry-run",) if dry else ()), needles=(needle,))
    assert line and not out.exists()


def test_a_dry_run_plans_calibration_on_a_device_this_machine_lacks(src):
    """A plan may be made off the machine that runs it: --calibration-device cuda names a device, checked by name."""
    dry = run_cli("convert-gqa", "--groups", "2", str(src), "--method", "fit", "--calibration-device", "cuda:1",
                  "--dry-run")
    assert dry.returncode == 0, dry.stderr
