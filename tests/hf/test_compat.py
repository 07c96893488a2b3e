"""gqakit/hf/compat.py: what changed within transformers 5.x, decided in one place."""
from __future__ import annotations

import pytest
import torch

from gqakit.hf.compat import LOAD_KWARGS, output_cache, transformers_before
from gqakit.reference import reference_model_path


def _loaders():
    from gqakit.hf.loading import load_model
    from gqakit.uptrain.modeling import load_lm

    return {"load_model": lambda path: load_model(path, with_tokenizer=False)[0], "load_lm": load_lm}


@pytest.mark.parametrize("loader", ["load_model", "load_lm"])
def test_models_load_without_hub_kernels_also_after_train(loader):
    """transformers 5.25 kernelizes every from_pretrained by default (Hub downloads on a GPU, swapped RMSNorm / RoPE /
    activations) and again at each train() / eval(); gqakit's loads decline it on every release."""
    model = _loaders()[loader](str(reference_model_path()))
    assert model.use_kernels is False and getattr(model, "kernels_mode", None) is None
    model.train()
    model.eval()
    assert model.use_kernels is False and getattr(model, "kernels_mode", None) is None
    assert LOAD_KWARGS == {"use_kernels": False}


def test_output_cache_reads_the_cache_under_either_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
        plain = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert output_cache(out).layers[0].keys.shape == (1, 1, 3, 8)
    assert output_cache(plain) is None
    assert ("cache" in out) == (not transformers_before("5.25"))  # 5.25 renamed the field


def test_transformers_before_compares_releases_numerically(monkeypatch):
    import transformers

    transformers_before.cache_clear()
    try:
        for version, before in (("5.9.0", True), ("5.24.1", True), ("5.25.0.dev0", False), ("5.25.0", False),
                                ("5.100.0", False)):
            monkeypatch.setattr(transformers, "__version__", version)
            transformers_before.cache_clear()
            assert transformers_before("5.25") is before, version
    finally:
        monkeypatch.undo()
        transformers_before.cache_clear()
