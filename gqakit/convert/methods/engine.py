"""The merge engine: each output tensor of the plan that is not a byte copy (`compute`), made by the merge method
the plan names: head-wise pooling of K/V rows (and fused q/k/v rows, key norms), or a layer merge (`layer.py`)
read from the checkpoint, computed ahead side by side (`merge_ahead.py`) or read back after attention transfer.
Every decision reads the method's table row (`convert.methods`)."""
from __future__ import annotations

import dataclasses
import functools
import zlib
from pathlib import Path

import torch

from gqakit.common.errors import GqakitError
from gqakit.convert import methods
from gqakit.convert.calibration.stored import StoredMoment, load_layer
from gqakit.convert.latent.construct import cast_trained, embed_mqa
from gqakit.convert.latent.fit import fit_latent, input_metric, offset_means
from gqakit.convert.methods.layer import merge_layer
from gqakit.convert.methods.merge_ahead import MergeAhead, merge_workers
from gqakit.convert.methods.pooling import merge_norms, random_heads, regroup, relative_error
from gqakit.convert.plan import Plan, TensorOp
from gqakit.hf.architectures.latent import ATTENTION
from gqakit.hf.checkpoint import DTYPES, load_tensor
from gqakit.hf.headers import TensorInfo


def tensor_seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + zlib.crc32(name.encode())


def regroup_rows(t: torch.Tensor, plan: Plan, std: float, seed: int, name: str) -> torch.Tensor:
    """Regroup a K/V projection weight or bias (heads along axis 0) by the plan's method."""
    method = methods.get(plan.method)
    if method.reinitialises:
        shape = (plan.groups * plan.head_dim, *t.shape[1:])
        if t.dim() == 1:  # biases start at zero, as the initializer would leave them
            return torch.zeros(shape, dtype=t.dtype)
        return random_heads(shape, std, tensor_seed(seed, name), t.dtype)
    return regroup(t, plan.num_key_value_heads, plan.groups, method.pooling)


def attention_key(plan: Plan, layer: int, name: str) -> str:
    """'q_w', 'k_b', ...: which of layer `layer`'s attention tensors `name` is."""
    for role, template in (("q", plan.spec.q_proj), ("k", plan.spec.k_proj), ("v", plan.spec.v_proj),
                           ("o", plan.spec.o_proj)):
        if name.startswith(template.format(i=layer) + "."):
            return f"{role}_{'b' if name.endswith('.bias') else 'w'}"
    raise AssertionError(f"{name} is not an attention tensor of layer {layer}")


@dataclasses.dataclass(frozen=True)
class LayerMerge:
    """What a layer merge needs besides its weights: the grouping and the calibration statistics folder."""

    grouping: str = "similarity"
    stats: Path | None = None  # layer-NNNNN.safetensors files written by the calibration pass
    transferred: bool = False  # the layers were merged and trained during calibration: read transferred-NNNNN files
    ahead: MergeAhead | None = None  # the write pass's layer merges, computed ahead of it (merge_ahead.py)


def read_stats(folder: Path, layer: int, names: tuple[str, ...]) -> dict:
    """The merge's statistics of one layer: the n x n ones read in row blocks as they are used, never whole;
    vectors in their stored float32."""
    out = {name: StoredMoment(folder, layer, name) for name in names if name in ("key", "value")}
    rest = tuple(name for name in names if name not in out)
    return {**out, **(load_layer(folder, layer, rest, dtype=torch.float32, held=False)[0] if rest else {})}


def merge_checkpoint_layer(plan: Plan, tensors: dict[str, TensorInfo], layer: int, sources: tuple[str, ...],
                           how: LayerMerge, heldout: dict | None = None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Layer `layer`'s attention tensors `sources` merged by `merge_layer`, read from the checkpoint (and, with
    `how.stats`, its calibration statistics one at a time and the held-out windows `heldout`): ({checkpoint name:
    merged tensor}, the card's errors)."""
    keys = {attention_key(plan, layer, name): name for name in sources}
    stats = functools.partial(read_stats, how.stats, layer) if how.stats is not None else None
    wider = torch.float32 if plan.target_kv_itemsize > plan.source_kv_itemsize else None  # --dtype float32 of bf16
    try:
        merged, cost = merge_layer(plan, {key: widened(load_tensor(tensors[name], name), wider)
                                          for key, name in keys.items()}, how.grouping, stats, heldout)
    except GqakitError as e:
        raise GqakitError(f"layer {layer}: {e}") from None
    return {keys[key]: tensor for key, tensor in merged.items()}, cost


def whole_layer(plan: Plan, tensors: dict[str, TensorInfo], errors: dict[int, dict[str, float]], how: LayerMerge,
                layer: int, sources: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Layer `layer`'s merged q/k/v/o tensors {checkpoint name: tensor}: trained by attention transfer (read back),
    merged ahead side by side (`how.ahead`), or merged here; its errors go to `errors`."""
    if how.transferred:
        from safetensors.torch import load_file

        return load_file(str(transferred_path(how.stats, layer)))
    if how.ahead is not None:
        merged, cost = how.ahead.get(layer)
    else:
        merged, cost = merge_one_layer(plan, tensors, how, layer, sources)
    errors.setdefault(layer, {}).update(cost)
    return merged


def merged_layer(op: TensorOp, plan: Plan, tensors: dict[str, TensorInfo], errors: dict[int, dict[str, float]],
                  layers: dict[int, dict[str, torch.Tensor]], how: LayerMerge, std: float = 0.02, seed: int = 0
                  ) -> torch.Tensor:
    """One of layer op.layer's q/k/v/o tensors from a layer merge (or, for a `latent` op, one of its latent-attention
    tensors). The first of them makes the whole layer; the others wait in `layers` until written."""
    if op.layer not in layers:
        if op.kind == "latent":
            layers[op.layer] = latent_layer(plan, tensors, errors, how, op.layer, op.sources, DTYPES[op.dtype],
                                            std, seed)
        else:
            layers[op.layer] = whole_layer(plan, tensors, errors, how, op.layer, op.sources)
    held = layers[op.layer]
    out = held.pop(op.name)
    if not held:
        del layers[op.layer]
    return out


def latent_layer(plan: Plan, tensors: dict[str, TensorInfo], errors: dict[int, dict[str, float]], how: LayerMerge,
                 layer: int, sources: tuple[str, ...], dtype: torch.dtype, std: float = 0.02, seed: int = 0
                 ) -> dict[str, torch.Tensor]:
    """Layer `layer` merged to MQA by the plan's method, then written as latent attention (`convert/latent`) at
    `dtype`; or, with `plan.latent_fit`, its latent fitted to the source's K/V heads."""
    if plan.latent_trained and how.transferred:  # trained as latent attention during calibration, in float32
        from safetensors.torch import load_file

        prefix = ATTENTION.format(i=layer)
        held = load_file(str(transferred_path(how.stats, layer)))
        return {prefix + name: t for name, t in cast_trained({n[len(prefix):]: t for n, t in held.items()},
                                                             dtype).items()}
    names = {attention_key(plan, layer, name): name for name in sources}  # "q_w", "k_b", ... -> checkpoint name
    layerwise = methods.get(plan.method).layerwise and not plan.latent_fit
    merged = whole_layer(plan, tensors, errors, how, layer, sources) if layerwise else {}
    parts = {key: merged[name] if layerwise else widened(load_tensor(tensors[name], name), dtype)
             for key, name in names.items()}
    if not plan.latent_fit:
        for key in [key for key in parts if key[0] in "kv" and not layerwise]:  # head-wise: pooled here
            new = regroup_rows(parts[key], plan, std, seed, names[key])
            if key.endswith("_w"):
                errors.setdefault(layer, {})[key[0]] = relative_error(parts[key], new, plan.num_key_value_heads)
            parts[key] = new
    return made_latent(plan, layer, parts, dtype, errors.setdefault(layer, {}), how)


def made_latent(plan: Plan, layer: int, parts: dict[str, torch.Tensor], dtype: torch.dtype, errors: dict,
                how: LayerMerge) -> dict[str, torch.Tensor]:
    """Layer `layer`'s latent-attention tensors (target names) at `dtype` from its q/k/v/o `parts` ("q_w", "k_b",
    ...): with `plan.latent_fit` the latent fitted to those K/V heads (in the metric of the layer's calibration
    statistics where `how` has them; its errors into `errors`), else the MQA that `parts` are, embedded."""
    if plan.latent_fit:
        made = fit_latent(parts["q_w"], parts["k_w"], parts["v_w"], parts["o_w"], plan.latent, dtype,
                          parts.get("k_b"), parts.get("v_b"), errors=errors, inputs=calibrated_metric(how, layer),
                          turns=unrotated_turns(plan))
    else:
        made = embed_mqa(parts["q_w"], parts["k_w"], parts["v_w"], parts["o_w"], plan.latent, dtype,
                         parts.get("k_b"), parts.get("v_b"))
    return {ATTENTION.format(i=layer) + name: t for name, t in made.items()}


def unrotated_turns(plan: Plan) -> torch.Tensor | None:
    """`offset_means` of the pairs a fitted latent reads without rotation, over the source's context; None when it
    turns every pair (or the context is unknown)."""
    if not plan.rope_frequencies or not plan.context:
        return None
    return offset_means(plan.rope_frequencies[plan.latent.rope_dim // 2:], plan.context)


def calibrated_metric(how: LayerMerge, layer: int) -> torch.Tensor | None:
    """A latent fit's input metric from layer `layer`'s calibration statistics (`fit.input_metric`), or None
    without calibration (a fit from the weights alone)."""
    if how.stats is None:
        return None
    return input_metric(**load_layer(how.stats, layer, ("key", "value"), held=False)[0])


def merge_one_layer(plan: Plan, tensors: dict[str, TensorInfo], how: LayerMerge, layer: int,
                    sources: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """`merge_checkpoint_layer` with the layer's held-out windows read back from its calibration file (if any);
    statistics are read back one at a time, in the float32 they were stored in."""
    heldout = load_layer(how.stats, layer, ())[1] if how.stats is not None else None
    return merge_checkpoint_layer(plan, tensors, layer, sources, how, heldout)


def merges_ahead(plan: Plan, tensors: dict[str, TensorInfo], how: LayerMerge) -> MergeAhead | None:
    """The layer merges of the write pass, run ahead of it side by side (merge_ahead.py); None for methods that
    merge no layer there."""
    if not methods.get(plan.method).layerwise or how.transferred or plan.latent_fit:
        return None
    sources = {}
    for op in plan.ops:
        if op.kind in ("attn", "latent"):
            sources.setdefault(op.layer, op.sources)
    return MergeAhead(list(sources), lambda i: merge_one_layer(plan, tensors, how, i, sources[i]),
                      merge_workers(len(sources)))


def transferred_path(folder: Path, layer: int) -> Path:
    """Where attention transfer leaves layer `layer`'s trained attention tensors for the write pass."""
    return folder / f"transferred-{layer:05d}.safetensors"


def widened(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` where that is a wider float, and in float32 where it is another float of the same width
    (bfloat16 <-> float16): a merge is then computed above both precisions and rounded once, to the output's, not
    to the source's first."""
    if dtype is None or not t.is_floating_point() or dtype == t.dtype or dtype.itemsize < t.element_size():
        return t
    return t.to(dtype if dtype.itemsize > t.element_size() else torch.float32)


def cast(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`t` in the output dtype; a finite value that the cast would turn into inf (fp16 tops out at 65,504) is
    refused in one line, never written."""
    out = t.to(dtype)
    if (dtype.is_floating_point and t.is_floating_point() and torch.finfo(dtype).max < torch.finfo(t.dtype).max
            and bool(torch.isinf(out).any())):  # one pass over the output; the rest only when it has an inf
        lost = torch.isinf(out) & torch.isfinite(t)
        if bool(lost.any()):
            value = float(t[lost].abs().max())
            raise GqakitError(f"{name} holds {value:.4g}, beyond {str(dtype).removeprefix('torch.')}'s range "
                              f"(largest {torch.finfo(dtype).max:.6g}): it would be written as inf; use --dtype "
                              "bfloat16 (fp32's range) or keep the source dtype")
    return out


def compute(op: TensorOp, plan: Plan, tensors: dict[str, TensorInfo], std: float, seed: int,
            errors: dict[int, dict[str, float]], layers: dict | None = None, how: LayerMerge = LayerMerge()
            ) -> torch.Tensor:
    """Make one output tensor that is not a plain byte copy (`layers`: the aligned merge's layer memo)."""
    out_dtype = DTYPES[op.dtype]
    if op.kind in ("attn", "latent"):
        held = layers if layers is not None else {}
        return cast(merged_layer(op, plan, tensors, errors, held, how, std, seed), out_dtype, op.name)
    if op.kind == "head_norm":
        stack = torch.stack([load_tensor(tensors[s], s).float() for s in op.sources])  # (n, d)
        return cast(merge_norms(stack, methods.get(plan.method).norm_pooling), out_dtype, op.name)
    t = load_tensor(tensors[op.sources[0]], op.sources[0])
    if op.kind == "cast":
        return cast(t, out_dtype, op.name)
    t = widened(t, out_dtype)  # pooled at the output's precision where it is wider
    if op.kind == "norm":  # a key norm that spans heads is pooled, never re-initialised
        pooling = methods.get(plan.method).norm_pooling
        return cast(regroup(t, plan.num_key_value_heads, plan.groups, pooling), out_dtype, op.name)
    if op.kind == "kv":
        new = regroup_rows(t, plan, std, seed, op.name)
        if op.role:
            errors.setdefault(op.layer, {})[op.role] = relative_error(t, new, plan.num_key_value_heads)
        return cast(new, out_dtype, op.name)
    if op.kind == "qkv":
        q, k, v = split_qkv(t, plan.num_attention_heads, plan.num_key_value_heads, plan.head_dim, plan.qkv_layout[0])
        k2 = regroup_rows(k, plan, std, seed, op.name + ".k")
        v2 = regroup_rows(v, plan, std, seed, op.name + ".v")
        if op.role:
            errors.setdefault(op.layer, {}).update(
                k=relative_error(k, k2, plan.num_key_value_heads), v=relative_error(v, v2, plan.num_key_value_heads))
        return cast(join_qkv(q, k2, v2, plan.groups, plan.qkv_layout[1]), out_dtype, op.name)
    raise AssertionError(f"unknown op kind {op.kind}")


def split_qkv(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int, layout: str):
    """A fused projection's rows (weight or bias) -> (q, k, v) rows, each head's head_dim rows contiguous."""
    rest = t.shape[1:]
    if layout == "heads":  # [q_h, k_h, v_h] per head (kv_heads == heads)
        per = t.reshape(heads, 3, head_dim, *rest)
        return tuple(per[:, j].reshape(heads * head_dim, *rest) for j in range(3))
    if layout == "groups":  # per K/V head: its heads / kv_heads query heads, its key, its value
        per = t.reshape(kv_heads, heads // kv_heads + 2, head_dim, *rest)
        return (per[:, :-2].reshape(heads * head_dim, *rest), per[:, -2].reshape(kv_heads * head_dim, *rest),
                per[:, -1].reshape(kv_heads * head_dim, *rest))
    return t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)  # [q | k | v]


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, layout: str) -> torch.Tensor:
    """Inverse of `split_qkv` for the output's layout."""
    rest = q.shape[1:]
    if layout == "heads":
        return torch.stack([x.reshape(groups, -1, *rest) for x in (q, k, v)], dim=1).reshape(-1, *rest)
    if layout == "groups":
        d = k.shape[0] // groups
        parts = [q.reshape(groups, -1, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    return torch.cat([q, k, v], dim=0)
