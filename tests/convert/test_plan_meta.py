"""Planning needs only metadata: a 70B-shaped Llama, described on the meta device, in no real memory."""
import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gqakit.hf.headers import TensorInfo
from gqakit.convert.plan import make_plan, total_bytes


def test_70b_llama_plan_on_meta_device():
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=64, max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tensors = {name: TensorInfo(None, "BF16", tuple(t.shape)) for name, t in model.state_dict().items()}
    source_bytes = sum(info.nbytes for info in tensors.values())
    assert 150e9 < source_bytes < 160e9  # an MHA 70B (K/V as large as Q): 138 GB as GQA-8 + 18.8 GB

    plan = make_plan(cfg.to_dict(), tensors, groups=8, max_shard_bytes=5 * 10**9)
    ops = {op.name: op for op in plan.ops}
    assert set(ops) == set(tensors)
    for i in (0, 79):
        for proj in ("k_proj", "v_proj"):
            op = ops[f"model.layers.{i}.self_attn.{proj}.weight"]
            assert op.shape == (8 * 128, 8192) and op.kind == "kv" and op.dtype == "BF16"
        assert ops[f"model.layers.{i}.self_attn.q_proj.weight"].shape == (8192, 8192)
        assert ops[f"model.layers.{i}.self_attn.q_proj.weight"].kind == "copy"

    # The K/V projections shrink from 64 to 8 heads: 80 layers x 2 x 56 heads x 128 x 8192 x 2 bytes.
    saved = 80 * 2 * 56 * 128 * 8192 * 2
    assert total_bytes(plan) == source_bytes - saved
    sizes = [sum(math.prod(plan.ops[i].shape) * 2 for i in shard) for shard in plan.shards]
    assert all(size <= 5 * 10**9 for size in sizes)
    assert sum(sizes) == total_bytes(plan)
    assert len(sizes) == math.ceil(total_bytes(plan) / 5e9) or len(sizes) == math.ceil(total_bytes(plan) / 5e9) + 1
    assert plan.shard_files[0] == f"model-00001-of-{len(sizes):05d}.safetensors"
    # Shards are consecutive runs of the plan: every tensor is written exactly once, in order.
    assert [i for shard in plan.shards for i in shard] == list(range(len(plan.ops)))

    assert plan.kv_cache_bytes_per_token(after=False) == 2 * 80 * 64 * 128 * 2
    assert plan.kv_cache_bytes_per_token(after=True) == 2 * 80 * 8 * 128 * 2
