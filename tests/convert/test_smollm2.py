"""The real model: SmolLM2-135M's MHA expansion mean-pooled to 3 groups IS the published GQA model."""
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from gqakit.cli import convert_main
from shared_data import smollm2_checkpoints

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return smollm2_checkpoints(tmp_path_factory.mktemp("smollm2"))


def test_mha_expansion_pooled_to_3_groups_is_the_published_gqa_model(smollm2, tmp_path):
    mha, gqa = smollm2
    out = tmp_path / "pooled"
    assert convert_main(["--groups", "3", str(mha), "-o", str(out), "--quiet"]) == 0

    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(gqa / "model.safetensors"), "pt") as b:
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.v_proj.weight"):
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name

    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, path in (("pooled", out), ("published", gqa)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert model.config.num_key_value_heads == 3
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert torch.equal(logits["pooled"], logits["published"])
