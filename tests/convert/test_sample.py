"""`gqakit sample`: calibration text drawn from the model itself.

* the file holds ceil(tokens / length) JSON-lines rows, each the decoded `length` tokens sampled after the start
  token (no row ends early), and `convert-gqa --calibration` reads it;
* deterministic for a seed, different for another; the sampler's settings are the ones asked (top-k off);
* bad options, an existing output without --force, an encoder-decoder: one line, exit 2, nothing written;
  an interrupted run leaves no file behind.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_contract import run_cli, run_refused
from gqakit.convert.calibration import sample as sampling
from gqakit.common.precision import auto_dtype
from gqakit.convert.calibration.sample import SampleConfig, sample, sample_ids, start_token
from gqakit.decode.sampling import reference_tokens
from gqakit.hf.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "gqakit" / "assets" / "austen-mha-8h"
T5 = ROOT / "gqakit" / "assets" / "austen-t5-8h"


def _rows(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_writes_whole_samples_that_calibration_reads(tmp_path):
    out = tmp_path / "samples.jsonl"
    result = run_cli("gqakit", "sample", str(EMBEDDED), "-o", str(out), "--tokens", "300", "--length", "128",
                     "--batch-size", "2", "-q")
    assert result.returncode == 0, result.stderr
    assert "3 samples" in result.stdout and "384 tokens" in result.stdout
    rows = _rows(out)
    assert len(rows) == 3 and all(r.strip() for r in rows) and len(set(rows)) == 3
    assert not [p for p in tmp_path.iterdir() if p.name != "samples.jsonl"]  # no temporary left
    # the samples calibrate a conversion
    done = run_cli("convert-gqa", "--groups", "2", "--method", "fit", "--calibration", str(out),
                   "--calibration-tokens", "256", "--calibration-window", "32", str(EMBEDDED), "-o",
                   str(tmp_path / "fit"), "-q")
    assert done.returncode == 0, done.stderr
    assert "samples.jsonl" in (tmp_path / "fit" / "README.md").read_text()


def test_rows_are_exactly_length_tokens_sampled_after_the_start():
    model, tok = load_model(str(EMBEDDED))
    start = start_token(tok)
    ids = sample_ids(model, start, count=3, length=40, temperature=1.0, top_p=1.0, seed=5)
    assert ids.shape == (3, 40)
    again = sample_ids(model, start, count=3, length=40, temperature=1.0, top_p=1.0, seed=5)
    other = sample_ids(model, start, count=3, length=40, temperature=1.0, top_p=1.0, seed=6)
    assert torch.equal(ids, again) and not torch.equal(ids, other)
    # the end-of-text token never cuts a row short, even where it is likely: a model that always ends at once
    eos = tok.eos_token_id
    if eos is not None:
        bias = torch.zeros(model.config.vocab_size)
        bias[eos] = 50.0
        head = model.get_output_embeddings()
        head.bias = torch.nn.Parameter(bias)
        forced = sample_ids(model, start, count=2, length=12, temperature=1.0, top_p=1.0, seed=0)
        assert forced.shape == (2, 12) and not (forced == eos).any()


def test_deterministic_for_a_seed(tmp_path):
    def draw(name, seed):
        out = tmp_path / name
        sample(SampleConfig(model=str(EMBEDDED), output=str(out), tokens=64, length=32, seed=seed, progress=False))
        return out.read_bytes()

    first = draw("a.jsonl", 3)
    assert draw("b.jsonl", 3) == first
    assert draw("c.jsonl", 4) != first


def test_temperature_and_top_p_reach_the_sampler():
    """The settings asked are the ones sampled with: the fast sampler equals the slow reference (a full forward
    per step) drawn with them, and differs from one drawn at the defaults."""
    model, tok = load_model(str(EMBEDDED))
    start = start_token(tok)
    ids = sample_ids(model, start, count=2, length=12, temperature=0.7, top_p=0.9, seed=0)
    assert torch.equal(ids, reference_tokens(model, start, 2, 12, temperature=0.7, top_p=0.9, seed=0))
    assert not torch.equal(ids, reference_tokens(model, start, 2, 12, seed=0))


def test_dtype_auto_is_bf16_where_the_hardware_has_bf16_units():
    from gqakit.common.precision import bf16_units

    assert auto_dtype("auto", "cpu") == ("bfloat16" if bf16_units("cpu") else "float32")
    assert auto_dtype("float32", "cpu") == "float32"
    assert SampleConfig(model="m", output="s.jsonl").dtype == "auto"


@pytest.mark.parametrize("args, needle", [
    (["--tokens", "0"], "--tokens 0"),
    (["--temperature", "0"], "--temperature"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--length", "0"], "--length"),
    (["--tokens", "1", "--length", "1100"], "--length 1100 is past the model's 1,024-token context"),  # ran before
])
def test_bad_options_are_refused(tmp_path, args, needle):
    run_refused(tmp_path, "gqakit", "sample", str(EMBEDDED), "-o", str(tmp_path / "s.jsonl"), *args,
                needles=(needle,))


def test_bad_outputs_and_models_are_refused(tmp_path):
    existing = tmp_path / "mine.jsonl"
    existing.write_text('{"text": "keep me"}\n')
    run_refused(tmp_path, "gqakit", "sample", str(EMBEDDED), "-o", str(existing), needles=("--force",))
    run_refused(tmp_path, "gqakit", "sample", str(EMBEDDED), "-o", str(tmp_path / "s.txt"), needles=(".jsonl",))
    run_refused(tmp_path, "gqakit", "sample", str(EMBEDDED), "-o", str(tmp_path / "no" / "s.jsonl"),
                needles=("does not exist",))
    run_refused(tmp_path, "gqakit", "sample", str(T5), "-o", str(tmp_path / "s.jsonl"), needles=("encoder-decoder",))
    run_refused(tmp_path, "gqakit", "sample", str(tmp_path / "missing"), "-o", str(tmp_path / "s.jsonl"))
    # --force replaces the file
    result = run_cli("gqakit", "sample", str(EMBEDDED), "-o", str(existing), "--tokens", "16", "--length", "16",
                     "--force", "-q")
    assert result.returncode == 0, result.stderr
    assert _rows(existing) != ["keep me"]


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    real = sampling.sample_ids

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "sample_ids", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sample(SampleConfig(model=str(EMBEDDED), output=str(tmp_path / "s.jsonl"), tokens=64, length=16,
                            batch_size=2, progress=False))
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_a_killed_runs_leftover_is_removed(tmp_path):
    """A run killed outright (no cleanup) leaves its hidden working file; the next run removes it."""
    from gqakit.common.atomic import sibling

    out = tmp_path / "s.jsonl"
    leftover = sibling(out, "tmp", pid=2 ** 22 + 12345)  # above Linux's largest pid: no such process
    leftover.write_text('{"text": "half"}\n')
    sample(SampleConfig(model=str(EMBEDDED), output=str(out), tokens=16, length=16, progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]
