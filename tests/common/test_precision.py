"""bf16 on a CPU without fast bf16 arithmetic: said once, with the measured cost, before the run."""
import pytest

from eval_tiny import checkpoint, run_eval, text, tokenizer
from gqakit.common import precision


def test_the_warning_follows_the_measured_ratio(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 8.04)
    line = precision.bf16_cpu_warning("mixed_precision=bf16", "mixed_precision=no")
    assert "8.0x as long as an fp32 one" in line and "mixed_precision=no runs faster" in line
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 0.4)  # a CPU with bf16 units (AMX, avx512_bf16)
    assert precision.bf16_cpu_warning("mixed_precision=bf16", "mixed_precision=no") is None


def test_the_probe_measures_this_cpu():
    ratio = precision.cpu_bf16_slowdown()
    assert 0 < ratio < 1000 and precision.cpu_bf16_slowdown() == ratio  # measured once per process


@pytest.mark.parametrize("ratio, warned", [(8.0, True), (0.5, False)])
def test_eval_in_bf16_on_a_slow_cpu_says_so(tmp_path, monkeypatch, ratio, warned):
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: ratio)
    tok = tokenizer()
    model = checkpoint(tmp_path / "m", tok)
    (tmp_path / "t.txt").write_text(text(400))
    code, out, err = run_eval("ppl", model, "--text", tmp_path / "t.txt", "--dtype", "bfloat16", "--device", "cpu",
                              "--max-length", 64, "-o", tmp_path / "r", "-q")
    assert code == 0, err
    assert ("gqakit: warning: --dtype bfloat16 on this CPU" in err) is warned, err
