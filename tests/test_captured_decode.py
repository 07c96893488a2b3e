"""The captured decode step of the GPU check (benchmarks/gpu/captured.py) against slow references on CPU: its grouped
attention against the per-head reference, and its static-cache step (run eagerly here; captured as a CUDA graph
on a GPU) against the model's own eager attention over a dynamic cache holding the same keys and values.
Tolerance: fp32 throughout, 1e-5 on attention outputs and 1e-4 on logits (sums over 64-256 terms in another order)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
for folder in (BENCH, BENCH / "gpu"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from captured import GROUPED, CapturedDecoder, grouped_attention, register, static_cache  # noqa: E402
from decode_kv_heads import SHAPES, build, filled_cache  # noqa: E402

from gqakit.attention.reference import eager_reference  # noqa: E402
from gqakit.hf.compat import cache_kwargs  # noqa: E402


class _Module(torch.nn.Module):
    training = False


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_grouped_attention_matches_the_per_head_reference(kv_heads, tq, mask_kind):
    g = torch.Generator().manual_seed(kv_heads * 10 + tq)
    B, H, Tk, d = 2, 4, 9, 8
    q = torch.randn(B, H, tq, d, generator=g)
    k, v = torch.randn(B, kv_heads, Tk, d, generator=g), torch.randn(B, kv_heads, Tk, 6, generator=g)
    allowed = torch.rand(B, 1, tq, Tk, generator=g) > 0.3
    allowed[..., 0] = True  # no fully masked row (the reference's convention there differs from a softmax's)
    mask = {"bool": allowed, "none": None,
            "float": torch.where(allowed, torch.randn(B, 1, tq, Tk, generator=g), torch.finfo(torch.float32).min)}
    out, weights = grouped_attention(_Module(), q, k, v, mask[mask_kind], scaling=0.3)
    ref, _ = eager_reference(q, k, v, 0.3, mask[mask_kind])
    assert weights is None and out.shape == (B, tq, H, 6)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_grouped_attention_refuses_what_it_does_not_implement():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="softcap"):
        grouped_attention(_Module(), q, k, k, None, softcap=30.0)
    with pytest.raises(ValueError, match="do not group"):
        grouped_attention(_Module(), q, torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8), None)


@pytest.mark.parametrize("kv_heads", [4, 2, 1, "mla"])
def test_the_static_step_decodes_as_the_eager_model(kv_heads):
    """Three greedy steps after 16 cached positions: the same tokens and logits as eager attention over a dynamic
    cache of the same keys and values."""
    batch, context, steps = 2, 16, 3
    model = build(SHAPES["tiny"], kv_heads, torch.float32, 64)
    dynamic = filled_cache(model, context, None, torch.float32, seed=1, batch=batch)
    copies = [(layer.keys.clone(), layer.values.clone()) for layer in dynamic.layers]
    first = torch.randint(model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("eager")
    token, ref_logits, ref_tokens = first, [], []
    with torch.no_grad():
        for i in range(steps):
            logits = model(token, **cache_kwargs(model, dynamic), position_ids=torch.full((batch, 1), context + i),
                           use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            ref_logits.append(logits)
            ref_tokens.append(token)
    model.set_attn_implementation(register())
    assert model.config._attn_implementation == GROUPED
    cache = static_cache(model, batch, context, steps, torch.float32, fill=lambda i: copies[i])
    decoder = CapturedDecoder(model, cache, batch, context, steps, first_token=first)
    for i in range(steps):
        tokens = decoder.step()
        torch.testing.assert_close(decoder.logits, ref_logits[i], atol=1e-4, rtol=1e-4)
        assert torch.equal(tokens, ref_tokens[i])
    with pytest.raises(RuntimeError, match="cache is full"):
        decoder.step()


def test_a_failed_capture_is_a_failed_check_and_the_eager_cells_still_run(tmp_path, monkeypatch, capsys):
    import json

    import captured
    import decode

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(captured.CapturedDecoder, "__init__", refuse)
    report = tmp_path / "decode.json"
    assert decode.main(["--dry-run", "--kv-heads", "4,1", "--json", str(report)]) == 1
    results = json.loads(report.read_text())
    cells = [c for v in results["variants"].values() for c in v["cells"].values()]
    assert all("tokens_per_s" in c and "graph_tokens_per_s" not in c for c in cells)
    assert "captured step: RuntimeError: operation not permitted when stream is capturing" in results["failed_checks"]
    assert "MHA: no captured cell ran" in results["failed_checks"]
    assert "| MQA | 1 | 32 |" in capsys.readouterr().out
