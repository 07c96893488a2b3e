"""Every architecture table, end to end: tiny random MHA model -> convert-gqa -> load -> compare logits.

For G = H the converted model must compute the very same logits. For G < H its logits must equal an
independent reference: the ORIGINAL (MHA) model class with each K/V head replaced by the pooled head
of its group, computed here with an explicit per-head loop from the tensor names transformers uses,
not from gqakit's tables or pooling code. A GQA model whose K/V heads are repeated back to H heads is
the same function as the MHA model with the repeated heads, so the two must agree to fp32 rounding.

Norm weights and biases are perturbed away from their ones/zeros initialisation before saving, so a
norm or bias that is dropped, left unpooled or pooled along the wrong axis changes the logits.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from safetensors.torch import load_file

from families import (ARCHITECTURES, FAMILIES, HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ2SEQ_ARCHITECTURES, VOCAB,
                      load_exact, make_model)
from gqakit.cli import convert_main


INPUT_IDS = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1234))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def convert(src, out, groups: int, *extra: str) -> None:
    code = convert_main([str(src), "--groups", str(groups), "-o", str(out), "--quiet", *extra])
    assert code == 0


def _pool_rows(t: torch.Tensor, kv_heads: int, groups: int, method: str) -> torch.Tensor:
    """Reference pooling along axis 0, written as a loop over groups and heads, then repeated back so
    that row block k (of kv_heads blocks) holds the pooled head of group k // (kv_heads / groups)."""
    d = t.shape[0] // kv_heads
    r = kv_heads // groups
    pooled = []
    for g in range(groups):
        members = [t[h * d:(h + 1) * d].double() for h in range(g * r, (g + 1) * r)]
        if method == "mean":
            head = sum(members) / r
        elif method == "first":
            head = members[0]
        else:
            raise AssertionError(method)
        pooled.append(head.to(t.dtype))
    return torch.cat([pooled[k // r] for k in range(kv_heads)], dim=0)


def reference_model(model, family: str, kv_heads: int, groups: int, method: str = "mean"):
    """The original model class (same K/V head count) with every K/V head replaced by its group's pool."""
    layout = FAMILIES[family][2]
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else HIDDEN // HEADS
    heads = model.config.num_attention_heads
    r = kv_heads // groups
    state = {k: v.clone() for k, v in model.state_dict().items()}
    new = {}
    touched = 0
    for name, t in state.items():
        if re.search(r"\.self_attn\.[kv]_proj\.(weight|bias)$", name):
            assert not layout.get("fused")
            new[name] = _pool_rows(t, kv_heads, groups, method)
            touched += 1
        elif re.search(r"\.self_attn\.qkv_proj\.(weight|bias)$", name):
            q, k, v = t[:heads * d], t[heads * d:(heads + kv_heads) * d], t[(heads + kv_heads) * d:]
            assert v.shape[0] == kv_heads * d
            new[name] = torch.cat([q, _pool_rows(k, kv_heads, groups, method),
                                   _pool_rows(v, kv_heads, groups, method)])
            touched += 1
        elif layout.get("grouped_bigcode") and re.search(r"\.attn\.c_attn\.(weight|bias)$", name):  # [q | k | v]
            q, k, v = t[:heads * d], t[heads * d:(heads + kv_heads) * d], t[(heads + kv_heads) * d:]
            new[name] = torch.cat([q, _pool_rows(k, kv_heads, groups, method), _pool_rows(v, kv_heads, groups, method)])
            touched += 1
        elif re.search(r"\.attn\.c_attn\.(weight|bias)$", name):  # GPTBigCode MHA: rows per head [q_h, k_h, v_h]
            assert layout.get("bigcode") and kv_heads == heads
            per = t.view(heads, 3, d, *t.shape[1:])
            rows = [_pool_rows(per[:, j].reshape(heads * d, *t.shape[1:]), kv_heads, groups, method)
                    for j in (1, 2)]
            per = per.clone()
            per[:, 1], per[:, 2] = (r.view(heads, d, *t.shape[1:]) for r in rows)
            new[name] = per.reshape(t.shape)
            touched += 1
        elif re.search(r"\.self_attention\.query_key_value\.(weight|bias)$", name):  # Falcon: per K/V head [q.., k, v]
            assert layout.get("falcon")
            per = t.view(kv_heads, heads // kv_heads + 2, d, *t.shape[1:]).clone()
            for j in (-2, -1):
                pooled = _pool_rows(per[:, j].reshape(kv_heads * d, *t.shape[1:]), kv_heads, groups, method)
                per[:, j] = pooled.view(kv_heads, d, *t.shape[1:])
            new[name] = per.reshape(t.shape)
            touched += 1
        elif layout.get("knorm_rows") and re.search(r"\.self_attn\.k_norm\.weight$", name):
            assert t.shape == (kv_heads * d,)
            new[name] = _pool_rows(t, kv_heads, groups, method)
            touched += 1
        elif m := re.search(r"^(.*\.k_layernorm\.norms\.)(\d+)\.(weight|bias)$", name):
            assert layout.get("knorm_mods")
            prefix, h, kind = m.group(1), int(m.group(2)), m.group(3)
            g = h // r
            members = [state[f"{prefix}{j}.{kind}"].double() for j in range(g * r, (g + 1) * r)]
            new[name] = (members[0] if method == "first" else sum(members) / r).to(t.dtype)
            touched += 1
    one = layout.get("fused") or layout.get("bigcode") or layout.get("falcon") or layout.get("grouped_bigcode")
    assert touched >= LAYERS * (1 if one else 2)  # the K/V tensors really changed
    state.update(new)
    ref = copy.deepcopy(model)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return ref.eval()


def check_shapes(model, family: str, groups: int) -> None:
    layout = FAMILIES[family][2]
    assert model.config.num_key_value_heads == groups
    d = HEAD_DIM
    if layout.get("falcon"):
        assert model.config.num_kv_heads == groups
        for block in model.transformer.h:
            assert block.self_attention.query_key_value.weight.shape == (HEADS * d + 2 * groups * d, HIDDEN)
        return
    if layout.get("bigcode") or layout.get("grouped_bigcode"):
        own = layout.get("grouped_bigcode") or 1 < groups < HEADS
        assert type(model).__name__ == ("GroupedGPTBigCodeForCausalLM" if own else "GPTBigCodeForCausalLM")
        assert model.config.multi_query == (groups == 1 and not own)
        for block in model.transformer.h:
            assert block.attn.c_attn.weight.shape == (HEADS * d + 2 * groups * d, HIDDEN)
        return
    for layer in model.model.layers:
        attn = layer.self_attn
        if layout.get("fused"):
            assert attn.qkv_proj.weight.shape == (HEADS * d + 2 * groups * d, HIDDEN)
        else:
            assert attn.k_proj.weight.shape == (groups * d, HIDDEN)
            assert attn.v_proj.weight.shape == (groups * d, HIDDEN)
            if attn.k_proj.bias is not None:
                assert attn.k_proj.bias.shape == (groups * d,)
                assert attn.v_proj.bias.shape == (groups * d,)
        if layout.get("knorm_rows"):
            assert attn.k_norm.weight.shape == (groups * d,)
        if layout.get("knorm_mods"):
            assert len(attn.k_layernorm.norms) == groups


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    family = request.param
    src = make_model(family, tmp_path_factory.mktemp(family) / "mha")
    return family, src, load_exact(src)


# ----------------------------------------------------------------------------------------------
# tests


def test_every_supported_architecture_is_tested():
    from gqakit.hf.architectures import supported_architectures

    assert sorted([*ARCHITECTURES.values(), *SEQ2SEQ_ARCHITECTURES.values()]) == supported_architectures()


def test_perturbation_is_visible(family_model):
    """Sanity: the norms/biases really are away from their initial values in the saved model."""
    family, src, model = family_model
    ones_or_zeros = [n for n, p in model.named_parameters()
                     if p.dim() == 1 and (torch.all(p == 1) or torch.all(p == 0))]
    assert not ones_or_zeros


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_mean_conversion(family_model, groups, tmp_path):
    family, src, original = family_model
    out = tmp_path / f"g{groups}"
    convert(src, out, groups)
    converted = load_exact(out)
    check_shapes(converted, family, groups)
    got = logits(converted)
    want_mha = logits(original)
    assert torch.isfinite(got).all()
    if groups == HEADS:
        assert torch.equal(got, want_mha)
        return
    ref = reference_model(original, family, HEADS, groups, "mean")
    want = logits(ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Sanity: pooling really changed the function, so the comparison above is not vacuous.
    assert (got - want_mha).abs().max() > 1e-3


def test_method_first_llama(tmp_path):
    src = make_model("llama", tmp_path / "mha")
    original = load_exact(src)
    convert(src, tmp_path / "first", 2, "--method", "first")
    converted = load_exact(tmp_path / "first")
    check_shapes(converted, "llama", 2)
    got = logits(converted)
    torch.testing.assert_close(got, logits(reference_model(original, "llama", HEADS, 2, "first")), atol=1e-5, rtol=0)
    # and differs from mean pooling
    mean = reference_model(original, "llama", HEADS, 2, "mean")
    assert (got - logits(mean)).abs().max() > 1e-3


def test_method_random_llama(tmp_path):
    src = make_model("llama", tmp_path / "mha")
    convert(src, tmp_path / "mean", 2)
    convert(src, tmp_path / "r0a", 2, "--method", "random", "--seed", "0")
    convert(src, tmp_path / "r0b", 2, "--method", "random", "--seed", "0")
    convert(src, tmp_path / "r1", 2, "--method", "random", "--seed", "1")
    tensors = {k: load_file(tmp_path / k / "model.safetensors") for k in ("mean", "r0a", "r0b", "r1")}
    kv = [n for n in tensors["mean"] if re.search(r"\.[kv]_proj\.weight$", n)]
    assert len(kv) == 2 * LAYERS
    assert tensors["r0a"].keys() == tensors["mean"].keys() == tensors["r1"].keys()
    for name in tensors["mean"]:
        a, b, c = tensors["r0a"][name], tensors["r0b"][name], tensors["r1"][name]
        assert torch.equal(a, b), name  # same seed: identical
        if name in kv:
            assert a.shape == (2 * HEAD_DIM, HIDDEN)
            assert not torch.equal(a, c), name  # another seed: other weights
            assert not torch.equal(a, tensors["mean"][name]), name  # not the pooled weights
        else:
            assert torch.equal(a, tensors["mean"][name]), name  # everything else untouched
    model = load_exact(tmp_path / "r0a")
    check_shapes(model, "llama", 2)
    assert torch.isfinite(logits(model)).all()


def test_regroup_existing_gqa_llama(tmp_path):
    """H = 8 query heads, K = 4 K/V heads: pool further to 2, or expand to 8 (MHA) by repetition."""
    overrides = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=4)
    src = make_model("llama", tmp_path / "gqa4", **overrides)
    original = load_exact(src)
    want = logits(original)

    convert(src, tmp_path / "g2", 2)
    pooled = load_exact(tmp_path / "g2")
    assert pooled.config.num_key_value_heads == 2
    assert pooled.model.layers[0].self_attn.k_proj.weight.shape == (2 * 4, HIDDEN)
    ref = reference_model(original, "llama", 4, 2, "mean")
    got = logits(pooled)
    torch.testing.assert_close(got, logits(ref), atol=1e-5, rtol=0)
    assert (got - want).abs().max() > 1e-3

    convert(src, tmp_path / "g8", 8)
    expanded = load_exact(tmp_path / "g8")
    assert expanded.config.num_key_value_heads == 8
    assert expanded.model.layers[0].self_attn.k_proj.weight.shape == (8 * 4, HIDDEN)
    torch.testing.assert_close(logits(expanded), want, atol=1e-6, rtol=0)


def test_falcon_plan_card_and_kv_bytes_say_what_its_cache_holds(tmp_path, capsys):
    """transformers' Falcon before 5.25 broadcast K/V to every query head before caching; 5.25 caches the K/V heads.
    The plan and the card say so, and the KV bytes per token eval reports are what the running release's cache
    holds (measured here on the converted MQA model)."""
    from gqakit.hf.compat import output_cache, transformers_before
    from gqakit.hf.loading import kv_bytes_per_token

    src = make_model("falcon", tmp_path / "mha")
    capsys.readouterr()
    assert convert_main([str(src), "--groups", "1", "--dry-run"]) == 0
    note = "Falcon before 5.25 expands K and V to every query head"
    assert note in capsys.readouterr().out
    convert(src, tmp_path / "mqa", 1)
    assert note in (tmp_path / "mqa" / "README.md").read_text()
    model = load_exact(tmp_path / "mqa")
    assert model.config.num_kv_heads == 1
    with torch.no_grad():
        cache = output_cache(model(input_ids=INPUT_IDS, use_cache=True))
    keys = cache.layers[0].keys  # (B, heads, T, d)
    assert keys.shape[1] == (HEADS if transformers_before("5.25") else 1)
    held = sum(t[0].numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model.config, torch.float32) == held // INPUT_IDS.shape[1]


@pytest.mark.parametrize("family, qk_layernorm", [("stablelm", False), ("phi", True)])
def test_a_key_norm_is_read_from_the_config_that_switches_it(family, qk_layernorm, tmp_path):
    """Phi and StableLM have a key norm only with qk_layernorm (StableLM's per K/V head, pooled; Phi's one LayerNorm
    shared by every head, kept): a StableLM without it converts and pools exactly, a Phi with it converts, pools and
    says in its card that pooling normalises the mean key."""
    src = make_model(family, tmp_path / "mha", qk_layernorm=qk_layernorm)
    original = load_exact(src)
    convert(src, tmp_path / "g2", 2)
    converted = load_exact(tmp_path / "g2")
    torch.testing.assert_close(logits(converted), logits(reference_model(original, family, HEADS, 2)),
                               atol=1e-5, rtol=0)
    card = (tmp_path / "g2" / "README.md").read_text()
    assert ("exact only for identical heads" in card) == qk_layernorm


@pytest.mark.parametrize("model_type", ["gpt2", "gptj", "codegen", "gpt_bigcode", "llama", "opt", "gpt_neox"])
def test_the_context_length_is_read_from_config_json_as_transformers_reads_it(model_type):
    """config.json spells the context n_positions for GPT-2-likes (transformers maps max_position_embeddings onto it):
    eval's checks before loading read it as the loaded config does (they read nothing, so a window past GPT-2's
    context reached its position table, an IndexError)."""
    from transformers import AutoConfig

    from gqakit.hf.fields import context_length

    config = AutoConfig.for_model(model_type)
    assert config.max_position_embeddings
    assert context_length(config.to_diff_dict() | config.to_dict()) == config.max_position_embeddings
    assert context_length({"text_config": config.to_dict()}) == config.max_position_embeddings


def test_t5s_n_positions_is_no_context():
    """T5's config.json carries n_positions 512, but its positions are relative buckets: no limit to check (read as
    one, it refused eval ppl windows past 512 and shrank the default window; a review's finding)."""
    from transformers import AutoConfig

    from gqakit.hf.fields import context_length

    assert context_length(AutoConfig.for_model("t5", n_positions=512).to_dict()) is None
