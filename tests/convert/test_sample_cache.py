"""Kept calibration samples (convert/calibration/sample_cache.py): a kept sample is exactly what sampling again
gives, is read only under the same model, sampling and machine, and a bad or unwritable cache costs a resample,
never a wrong or failed conversion."""
from __future__ import annotations

import os

import pytest
import torch

from gqakit.convert.calibration import sample_cache
from gqakit.convert.calibration.data import sample_calibration
from tiny_models import make_tiny_llama

CONFIG = {"max_position_embeddings": 128, "vocab_size": 64}


@pytest.fixture
def src(tmp_path, monkeypatch):
    monkeypatch.setenv("GQAKIT_CACHE_DIR", str(tmp_path / "caches"))
    return make_tiny_llama(tmp_path / "src", heads=4, layers=2)


def _sample(src, seed=3, keep=True):
    return sample_calibration(src, CONFIG, tokens=96, window=32, seed=seed, device="cpu", progress=False, keep=keep)


def _kept(tmp_path):
    return sorted((tmp_path / "caches" / "samples").glob("*.safetensors"))


def test_a_kept_sample_is_what_sampling_again_gives(src, tmp_path, capsys):
    fresh = _sample(src, keep=False)
    assert _kept(tmp_path) == []  # keep=False writes nothing
    first = _sample(src)
    assert "sampled before" not in capsys.readouterr().err and len(_kept(tmp_path)) == 1
    again = _sample(src)
    assert f"read from {_kept(tmp_path)[0]}" in capsys.readouterr().err
    for data in (first, again):
        assert torch.equal(data.windows, fresh.windows) and data.sha256 == fresh.sha256
        assert data.sampled == fresh.sampled


def test_another_seed_or_rewritten_weights_sample_anew(src, tmp_path, capsys):
    _sample(src)
    _sample(src, seed=4)
    assert len(_kept(tmp_path)) == 2
    weights = src / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # the same bytes, written again
    capsys.readouterr()
    _sample(src)
    assert "sampled before" not in capsys.readouterr().err and len(_kept(tmp_path)) == 3
    key = sample_cache.sample_key(src, {"tokens": 96}, "cpu")
    assert key["threads"] == torch.get_num_threads() and key["cpu_capability"]  # the machine's arithmetic


@pytest.mark.parametrize("damage", ["truncated", "other key"])
def test_a_damaged_file_is_sampled_anew_and_replaced(src, tmp_path, capsys, damage):
    fresh = _sample(src, keep=False)
    _sample(src)
    [path] = _kept(tmp_path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:50])
    else:  # a whole file whose metadata names another key (renamed by hand)
        from safetensors.torch import save_file
        save_file({"windows": torch.zeros(3, 32, dtype=torch.int64)}, str(path), metadata={"key": "{}"})
    capsys.readouterr()
    data = _sample(src)
    assert "sampled before" not in capsys.readouterr().err and torch.equal(data.windows, fresh.windows)
    assert torch.equal(sample_cache.load_sample(sample_cache.sample_key(
        src, {**fresh.sampled, "tokens": 96, "window": 32}, "cpu"))[0], fresh.windows)  # replaced by a good one


def test_an_unwritable_cache_folder_costs_only_the_keeping(src, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("GQAKIT_CACHE_DIR", str(blocker))  # samples/ cannot be made under a file
    assert torch.equal(_sample(src).windows, _sample(src, keep=False).windows)
    assert blocker.read_text() == ""


def test_a_failed_write_costs_only_the_keeping_and_leaves_nothing(src, tmp_path, monkeypatch):
    """A full disk or a quota met while writing: safetensors raises its own error, not an OSError."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert torch.equal(_sample(src).windows, _sample(src, keep=False).windows)
    assert list((tmp_path / "caches" / "samples").iterdir()) == []  # no working file left


def test_what_a_killed_write_left_the_next_write_removes(src, tmp_path, capsys):
    import subprocess

    from gqakit.common.atomic import sibling

    _sample(src)
    [path] = _kept(tmp_path)
    path.unlink()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has exited, as a SIGKILLed writer's has
    left = sibling(path, "tmp", pid=gone.pid)
    left.write_bytes(b"half a file")
    _sample(src)
    assert not left.exists() and _kept(tmp_path) == [path]
    assert f"removed {left.name} left by a stopped run" in capsys.readouterr().err
