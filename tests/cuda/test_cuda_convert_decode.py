"""A conversion calibrated on the GPU equals the CPU's, and sink-attention decoding on the GPU gives the CPU's greedy
tokens. Each test runs its body on CPU in the normal suite (where it checks that the CPU result is reproducible) and
on CUDA under `-m cuda`, always against the CPU run.

Tolerances: `convert-gqa --method fit` in fp32, every output tensor within 1e-5 (absolute and relative) of the CPU
conversion's. Greedy decoding: the token streams are equal, or part only where the CPU's two best logits were within
1e-3 of each other (a near tie that rounding may break either way).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devices import DEVICES
from families import make_model
from gqakit.cli import convert_main
from gqakit.reference import HELDOUT_TEXT, reference_model_path

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "gqakit" / "assets" / "pride_and_prejudice.txt"
SMALL = ["--calibration-tokens", "256", "--calibration-window", "32"]
TIE = 1e-3


def convert_fit(src: Path, out: Path, device: str) -> dict:
    assert convert_main(["--groups", "2", str(src), "-o", str(out), "--method", "fit", "--calibration", str(TEXT),
                         *SMALL, "--calibration-device", device, "-q"]) == 0
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def fit_on_cpu(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    src = make_model("llama", root / "src", vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reference_model_path() / name, src / name)
    return src, convert_fit(src, root / "cpu", "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_fit_calibrated_on_the_device_equals_the_cpu_conversion(fit_on_cpu, device, tmp_path):
    src, want = fit_on_cpu
    got = convert_fit(src, tmp_path / "out", device)
    assert got.keys() == want.keys()
    for name in want:
        assert want[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def sink_generate(device: str, prompt: torch.Tensor, new_tokens: int):
    """Greedy tokens and per-step scores of the embedded model with gqakit 'sinks' attention (S = 4, W = 64)."""
    import gqakit.attention
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference_model_path(), dtype=torch.float32).to(device).eval()
    gqakit.attention.use(model, "sinks", sinks=4, window=64)
    with torch.no_grad():
        out = model.generate(prompt.to(device), max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, prompt.shape[1]:].cpu(), torch.stack(out.scores).squeeze(1).float().cpu()


@pytest.fixture(scope="module")
def sinks_on_cpu():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference_model_path())
    prompt = tokenizer(Path(HELDOUT_TEXT).read_text(encoding="utf-8")[:900], return_tensors="pt").input_ids[:, :160]
    assert prompt.shape[1] == 160  # longer than S + W: the cache evicts and re-rotates from the first new token
    return prompt, *sink_generate("cpu", prompt, 48)


@pytest.mark.parametrize("device", DEVICES)
def test_sink_generation_on_the_device_gives_the_cpu_tokens(sinks_on_cpu, device):
    prompt, want, scores = sinks_on_cpu
    got, _ = sink_generate(device, prompt, 48)
    differ = (got != want).nonzero()
    if len(differ):
        step = int(differ[0])
        top2 = scores[step].topk(2).values
        assert float(top2[0] - top2[1]) < TIE, f"greedy tokens part at step {step} without a near tie: {got} {want}"
