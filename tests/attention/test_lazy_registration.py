"""`import gqakit.attention` loads neither torch nor transformers, yet `from_pretrained(attn_implementation=
"gqakit_tiled")` works after it, whichever of the two is imported first: the names reach transformers' interfaces
once it defines them, and the kernels load at their first call. Each case runs in a fresh interpreter (this one has
registered the real functions long since)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, tempfile
first = sys.argv[1]
if first == "gqakit":
    import gqakit.attention
    light = not any(m in sys.modules for m in ("torch", "transformers"))
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
import transformers.masking_utils, transformers.modeling_utils
if first == "transformers":
    light = True
    import gqakit.attention
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

def names():
    return {name: [ALL_ATTENTION_FUNCTIONS[name].__name__, ALL_MASK_ATTENTION_FUNCTIONS[name].__name__]
            for name in ("gqakit_tiled", "gqakit_ring")}

before = names()
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
torch.manual_seed(0)
ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
ids = torch.randint(3, 64, (2, 21))
padding = torch.ones(2, 21, dtype=torch.long)
padding[1, :5] = 0
with tempfile.TemporaryDirectory() as folder:
    ref.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="gqakit_tiled").eval()
    loaded = "gqakit.attention.registration" in sys.modules
    with torch.no_grad():
        diff = (model(ids, attention_mask=padding).logits - ref(ids, attention_mask=padding).logits)[padding.bool()]
print(json.dumps({"light": light, "before": before, "loaded_before_call": loaded, "after": names(),
                  "max_diff": diff.abs().max().item()}))
"""


@pytest.mark.parametrize("first", ["gqakit", "transformers"])
def test_gqakit_attention_names_reach_transformers_and_load_their_kernels_at_first_call(first):
    out = subprocess.run([sys.executable, "-c", CHILD, first], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["light"]
    assert got["before"] == {name: [f"{name}_on_first_call"] * 2 for name in ("gqakit_tiled", "gqakit_ring")}
    assert not got["loaded_before_call"]  # loading a model under the name loads no kernel
    assert got["after"] == {"gqakit_tiled": ["gqakit_tiled_attention", "gqakit_mask"],
                            "gqakit_ring": ["gqakit_ring_on_first_call"] * 2}
    assert got["max_diff"] < 1e-5  # the tiled kernel computes eager attention (padding included)
