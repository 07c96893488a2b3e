"""Carry out a conversion: validate, plan, stream tensors through the pooling maths, publish atomically."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from gqakit.common import dtypes
from gqakit.common.errors import GqakitError
from gqakit.convert.align import GROUPINGS, check_merge_options, coordinates, merge_coordinates, permute_kv_heads
from gqakit.convert.calibration.calibrate import (LayerInputs, StoredMoment, calibrate, layer_path, load_layer,
                                                  logit_error)
from gqakit.convert.calibration.data import CalibrationData, load_calibration
from gqakit.convert.card import write_card
from gqakit.common.atomic import atomic_output
from gqakit.hf.checkpoint import DTYPES, ShardWriter, TensorInfo, load_tensor, scan_checkpoint
from gqakit.convert.grams import IndefiniteMetric, Metric, key_side, moment_metric, value_side
from gqakit.convert import methods
from gqakit.convert.options import ConvertConfig
from gqakit.convert.plan import Plan, TensorOp, check_family, make_plan
from gqakit.convert.pooling import random_heads, regroup, relative_error
from gqakit.convert.layer_share import (Share, barrier, check_share, finish, launched_share, meeting_folder,
                                        read_errors, start, write_errors)
from gqakit.convert.merge_ahead import MergeAhead, merge_workers
from gqakit.convert.transfer import TransferOptions, transfer_merged_layer, transfer_options
from gqakit.common.atomic import check_replaceable
from gqakit.convert.memory import release_freed_memory
from gqakit.common.sizes import parse_size
from gqakit.hf.folder import copy_side_files, read_config

LOOKAHEAD = 2  # regrouped tensors computed ahead of the writer

def max_shard_bytes(text: str) -> int:
    """--max-shard-size in bytes."""
    return parse_size(text, "--max-shard-size", "5GB, 500MB or 2GiB")


def default_output(model_dir: Path, groups: int) -> Path:
    suffix = "mqa" if groups == 1 else f"gqa{groups}"
    return model_dir.with_name(f"{model_dir.name}-{suffix}")


def output_path(model_dir: Path, output_dir: str | None, groups: int) -> Path:
    """The -o folder (or the default), with a final `..` or `.` resolved so that it has a name."""
    out = Path(output_dir) if output_dir else default_output(model_dir, groups)
    return out.resolve() if out.name in ("", ".", "..") else out


def check_output(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse an -o that is, holds or sits inside the model folder, or exists without --force.

    A symlink at -o is itself what --force replaces (the folder it points to is never touched), so
    the link's own location is what must lie outside the model folder.
    """
    src, dst = model_dir.resolve(), out.parent.resolve() / out.name
    if dst == src or src in dst.parents:
        raise GqakitError(f"output {out} is {'the model folder' if dst == src else 'inside the model folder'}; "
                          "choose an -o outside it")
    if dst in src.parents:
        raise GqakitError(f"output {out} contains the model folder; choose an -o that does not")
    if os.path.lexists(out) and not force:
        what = "a symlink" if out.is_symlink() else "a file" if not out.is_dir() else ""
        raise GqakitError(f"output {out} already exists{f' ({what})' if what else ''}; pass --force to replace it "
                          "or choose another -o")
    if force:
        check_replaceable(out)


def check_method_options(cfg: ConvertConfig) -> None:
    """Refuse options the chosen method would ignore, and a fit without its calibration data."""
    if cfg.grouping is not None and cfg.grouping not in GROUPINGS:
        raise GqakitError(f"unknown --grouping {cfg.grouping!r}; choose contiguous or similarity")
    method = methods.get(cfg.method)
    if cfg.grouping is not None and not method.layerwise:
        raise GqakitError(f"--grouping is used only by --method {' or '.join(methods.LAYERWISE)}; drop it for "
                          f"--method {cfg.method} (which keeps contiguous groups)")
    if method.calibration == "required" and cfg.calibration is None:
        raise GqakitError(f"--method {cfg.method} needs calibration data: pass --calibration TEXT.txt (or a .jsonl / "
                          ".parquet dataset) in the model's language, e.g. a few hundred windows of its training text")
    if cfg.calibration is not None and method.calibration == "no":
        raise GqakitError(f"--calibration is used only by --method {' or '.join(methods.TAKE_CALIBRATION)}; drop it, "
                          f"or choose --method {' or '.join(methods.NEED_CALIBRATION)}")
    if cfg.calibration is None:
        given = [flag for flag, value in (("--calibration-tokens", cfg.calibration_tokens),
                                          ("--calibration-window", cfg.calibration_window),
                                          ("--text-column", cfg.text_column),
                                          ("--calibration-device", cfg.calibration_device)) if value is not None]
        if given:
            raise GqakitError(f"{given[0]} needs --calibration DATA; pass the calibration data or drop {given[0]}")
    for flag, value in (("--calibration-tokens", cfg.calibration_tokens),
                        ("--calibration-window", cfg.calibration_window)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise GqakitError(f"{flag} must be a positive number of tokens, got {value!r}")
    if not method.transfer:
        given = [flag for flag, value in (("--transfer-params", cfg.transfer_params),
                                          ("--transfer-steps", cfg.transfer_steps),
                                          ("--transfer-patience", cfg.transfer_patience),
                                          ("--transfer-inputs", cfg.transfer_inputs),
                                          ("--transfer-start", cfg.transfer_start),
                                          ("--transfer-dtype", cfg.transfer_dtype)) if value is not None]
        if given:
            raise GqakitError(f"{given[0]} is used only by --method {' or '.join(methods.TRANSFER)}; drop it")
    transfer_options(cfg)  # its own checks


def prepare(cfg: ConvertConfig) -> tuple[Plan, dict, dict[str, TensorInfo], Path, CalibrationData | None]:
    """Validate everything a conversion needs and plan it, before any output is written."""
    model_dir = Path(cfg.model_dir)
    config = read_config(model_dir)
    check_family(config)  # a refused family is named before anything else is looked at
    out = output_path(model_dir, cfg.output_dir, cfg.groups)
    if cfg.dtype not in dtypes.WITH_AUTO:
        raise GqakitError(f"unknown --dtype {cfg.dtype!r}; choose auto, float32, bfloat16 or float16")
    check_method_options(cfg)
    max_shard = max_shard_bytes(cfg.max_shard_size)
    tensors = scan_checkpoint(model_dir)
    plan = make_plan(config, tensors, cfg.groups, cfg.method, cfg.dtype, max_shard, cfg.pool_encoder)
    if plan.rehosted is not None:  # from here on the checkpoint is the target class's
        config, tensors = plan.rehosted.config, plan.rehosted.tensors
    if not cfg.dry_run:
        check_output(model_dir, out, cfg.force)
    calibration = None
    if cfg.calibration is not None:
        calibration = load_calibration(cfg.calibration, model_dir, config, cfg.calibration_tokens,
                                       cfg.calibration_window, cfg.text_column or "text")
        device = cfg.calibration_device or "cpu"
        try:
            torch.empty(0, device=device)
        except (RuntimeError, ValueError) as e:
            raise GqakitError(f"--calibration-device {device!r} is not usable here ({str(e).splitlines()[0]}); "
                              "use cpu or an available cuda device") from None
    return plan, config, tensors, out, calibration


def _tensor_seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + zlib.crc32(name.encode())


def _regroup_rows(t: torch.Tensor, plan: Plan, std: float, seed: int, name: str) -> torch.Tensor:
    """Regroup a K/V projection weight or bias (heads along axis 0) by the plan's method."""
    if plan.method == "random":
        shape = (plan.groups * plan.head_dim, *t.shape[1:])
        if t.dim() == 1:  # biases start at zero, as the initializer would leave them
            return torch.zeros(shape, dtype=t.dtype)
        return random_heads(shape, std, _tensor_seed(seed, name), t.dtype)
    return regroup(t, plan.num_key_value_heads, plan.groups, plan.method)


def _attention_key(plan: Plan, layer: int, name: str) -> str:
    """'q_w', 'k_b', ...: which of layer `layer`'s attention tensors `name` is."""
    for role, template in (("q", plan.spec.q_proj), ("k", plan.spec.k_proj), ("v", plan.spec.v_proj),
                           ("o", plan.spec.o_proj)):
        if name.startswith(template.format(i=layer) + "."):
            return f"{role}_{'b' if name.endswith('.bias') else 'w'}"
    raise AssertionError(f"{name} is not an attention tensor of layer {layer}")


RIDGES = (1e-6, 1e-4, 1e-2)  # a calibrated metric's ridge (times its mean diagonal), tried in turn


def key_metric(key: torch.Tensor | None, n: int, with_bias: bool, ridge: float = RIDGES[0]) -> Metric:
    """Keys are compared in the attention-weighted covariance of the inputs each query sees; a key (or query)
    bias shifts all of a query's logits alike, so its coordinate gets the average weight of an input direction."""
    if key is None:
        return Metric(n, with_bias)
    return moment_metric(key, with_bias, corner=float(key.diagonal().to(torch.float64).mean()), ridge=ridge)


def value_metric(value: torch.Tensor | None = None, value_mean: torch.Tensor | None = None, *, n: int,
                 with_bias: bool, ridge: float = RIDGES[0]) -> Metric:
    """Values are compared in the second moment of the attention-averaged input, (x, 1) with a v_proj bias."""
    if value is None:
        return Metric(n, with_bias)
    return moment_metric(value, with_bias, cross=value_mean, ridge=ridge)


def merge_layer(plan: Plan, weights: dict[str, torch.Tensor], grouping: str = "similarity",
                stats: Callable[[tuple[str, ...]], dict[str, torch.Tensor]] | None = None,
                heldout: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A merge of one layer by plan.method ("aligned" or "fit"): {'q_w', 'k_w', 'v_w', 'o_w', optional
    biases} -> the same keys, and for the card the relative error of the maps each query head computes
    (`bilinear_error`) and, with held-out calibration windows, of its attention logits.

    `stats(names)` reads calibration statistics ('key', 'value', 'value_mean'), one metric at a time, dropped
    once its Grams exist; from the calibration folder an n x n statistic is read in row blocks as the metric
    is applied, never whole."""
    H, K, G, d = plan.num_attention_heads, plan.num_key_value_heads, plan.groups, plan.head_dim
    check_merge_options(H, K, G, grouping=grouping, **methods.get(plan.method).merge)
    q_w, k_w, v_w, o_w = (weights[key] for key in ("q_w", "k_w", "v_w", "o_w"))
    q_b, k_b, v_b = (weights.get(key) for key in ("q_b", "k_b", "v_b"))
    n = k_w.shape[1]
    read = stats if stats is not None else (lambda names: {})
    # Each statistic lives only while its Grams are computed; the (K d)^2 value Gram only until the factors exist.
    # A calibrated metric whose float32 rounding the smallest ridge does not cover gets the next one.
    ridges = RIDGES if stats is not None else RIDGES[:1]  # weights alone: the identity metric, no ridge to raise
    for ridge in ridges:
        try:
            keys = key_side(q_w, q_b, k_w, k_b, key_metric(read(("key",)).get("key"), n, q_b is not None or
                                                           k_b is not None, ridge), H, K, d)
            values = value_side(v_w, v_b, o_w, value_metric(**read(("value", "value_mean")), n=n,
                                                            with_bias=v_b is not None, ridge=ridge), H, K, d)
            coords = coordinates(keys, values, K, G, d, grouping)
            break
        except IndefiniteMetric:
            keys = values = None
            if ridge == ridges[-1]:
                raise GqakitError(f"the merge's metric is not positive semi-definite even with a ridge of {ridge:g} x "
                                  "its mean diagonal; recalibrate (--calibration-tokens) or use --method aligned "
                                  "without --calibration") from None
    del keys, values
    merged = merge_coordinates(q_w, k_w, v_w, o_w, q_b, k_b, v_b, coords, H, K, G, d, **methods.get(plan.method).merge)
    del coords
    out = {key: getattr(merged, key) for key in weights}
    # query head j of the merged layer is the original head order[j] (grouping by similarity permutes whole
    # K/V heads with their query heads): compare through views, never a permuted copy of the weights
    r = H // K
    order = [merged.perm[j // r] * r + j % r for j in range(H)]
    errors = {
        "k": bilinear_error(q_w.reshape(H, d, -1), k_w.reshape(K, d, -1), out["q_w"].reshape(H, d, -1),
                            out["k_w"].reshape(G, d, -1), order),
        "v": bilinear_error(o_w.reshape(-1, H, d).permute(1, 2, 0), v_w.reshape(K, d, -1),
                            out["o_w"].reshape(-1, H, d).permute(1, 2, 0), out["v_w"].reshape(G, d, -1), order),
    }
    if heldout is not None:  # the same measure for mean-pooling, which a merge sold as better must not lose to
        pooled = (q_w, regroup(k_w, K, G, "mean"), q_b, None if k_b is None else regroup(k_b, K, G, "mean"))
        errors["logits_mean"] = logit_error(heldout, (q_w, k_w, q_b, k_b), pooled, H, K, G, d)
        del pooled
        q_w, k_w, _, _, q_b, k_b, _ = permute_kv_heads(q_w, k_w, v_w, o_w, merged.perm, H, K, d, q_b, k_b, v_b)
        errors["logits"] = logit_error(heldout, (q_w, k_w, q_b, k_b),
                                       (out["q_w"], out["k_w"], out.get("q_b"), out.get("k_b")), H, K, G, d)
    return out, errors


def bilinear_error(a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
                   order: list[int] | None = None) -> float:
    """sqrt(sum_j ||A_j^T B_h(j) - A2_j^T B2_g(j)||^2 / sum_j ||A_j^T B_h(j)||^2) over query heads j, with
    A (H, d, m) and B (K, d, n): the error of each head's key map q^T k (A = q rows, B = k rows) or value
    map O V (A = o columns transposed). `order[j]`: the head of A (and its K/V head of B) that merged head j
    replaces (identity when None). From d x d Gram products, one head in float64 at a time, never an m x n
    matrix (views of the stored weights in, no whole float64 copy)."""
    H, K, G = a.shape[0], b.shape[0], b2.shape[0]
    order = list(range(H)) if order is None else order

    def f64(t):
        return t.to(torch.float64)

    bb = [f64(x) @ f64(x).T for x in b]  # (d, d) per K/V head
    bb2 = [f64(x) @ f64(x).T for x in b2]
    bb_cross: dict[tuple[int, int], torch.Tensor] = {}  # B_h B2_g^T, once per (original, merged) K/V head pair
    ref = diff = 0.0
    for j in range(H):
        i = order[j]
        h, g = i // (H // K), j // (H // G)
        if (h, g) not in bb_cross:
            bb_cross[h, g] = f64(b[h]) @ f64(b2[g]).T
        aj, a2j = f64(a[i]), f64(a2[j])
        own = float(((aj @ aj.T) * bb[h]).sum())
        cross = float(((aj @ a2j.T) * bb_cross[h, g]).sum())  # tr(B^T A A2^T B2)
        ref += own
        diff += own + float(((a2j @ a2j.T) * bb2[g]).sum()) - 2 * cross
    return math.sqrt(max(diff, 0.0) / max(ref, 1e-300))


@dataclasses.dataclass(frozen=True)
class LayerMerge:
    """What a layer merge needs besides its weights: the grouping and the calibration statistics folder."""

    grouping: str = "similarity"
    stats: Path | None = None  # layer-NNNNN.safetensors files written by the calibration pass
    transferred: bool = False  # the layers were merged and trained during calibration: read transferred-NNNNN files
    ahead: MergeAhead | None = None  # the write pass's layer merges, computed ahead of it (merge_ahead.py)


def _read_stats(folder: Path, layer: int, names: tuple[str, ...]) -> dict:
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
    keys = {_attention_key(plan, layer, name): name for name in sources}
    stats = functools.partial(_read_stats, how.stats, layer) if how.stats is not None else None
    try:
        merged, cost = merge_layer(plan, {key: load_tensor(tensors[name], name) for key, name in keys.items()},
                                   how.grouping, stats, heldout)
    except GqakitError as e:
        raise GqakitError(f"layer {layer}: {e}") from None
    return {keys[key]: tensor for key, tensor in merged.items()}, cost


def _merged_layer(op: TensorOp, plan: Plan, tensors: dict[str, TensorInfo], errors: dict[int, dict[str, float]],
                  layers: dict[int, dict[str, torch.Tensor]], how: LayerMerge) -> torch.Tensor:
    """One of layer op.layer's q/k/v/o tensors from a layer merge. The first of them takes the whole merged
    layer (from `how.ahead`, which merges a few layers ahead side by side, or merged here); the others wait in
    `layers` until written."""
    if op.layer not in layers and how.transferred:
        from safetensors.torch import load_file

        layers[op.layer] = load_file(str(_transferred_path(how.stats, op.layer)))
    if op.layer not in layers:
        if how.ahead is not None:
            layers[op.layer], cost = how.ahead.get(op.layer)
        else:
            layers[op.layer], cost = merge_one_layer(plan, tensors, how, op.layer, op.sources)
        errors.setdefault(op.layer, {}).update(cost)
    held = layers[op.layer]
    out = held.pop(op.name)
    if not held:
        del layers[op.layer]
    return out


def merge_one_layer(plan: Plan, tensors: dict[str, TensorInfo], how: LayerMerge, layer: int,
                    sources: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """`merge_checkpoint_layer` with the layer's held-out windows read back from its calibration file (if any);
    statistics are read back one at a time, in the float32 they were stored in."""
    heldout = load_layer(how.stats, layer, ())[1] if how.stats is not None else None
    return merge_checkpoint_layer(plan, tensors, layer, sources, how, heldout)


def _merges_ahead(plan: Plan, tensors: dict[str, TensorInfo], how: LayerMerge) -> MergeAhead | None:
    """The layer merges of the write pass, run ahead of it side by side (merge_ahead.py); None for methods that
    merge no layer there."""
    if not methods.get(plan.method).layerwise or how.transferred:
        return None
    sources = {}
    for op in plan.ops:
        if op.kind == "attn":
            sources.setdefault(op.layer, op.sources)
    return MergeAhead(list(sources), lambda i: merge_one_layer(plan, tensors, how, i, sources[i]),
                      merge_workers(len(sources)))


def _transferred_path(folder: Path, layer: int) -> Path:
    return folder / f"transferred-{layer:05d}.safetensors"


def _transfer(inputs: LayerInputs, plan: Plan, config: dict, tensors: dict[str, TensorInfo], how: LayerMerge,
              opts: TransferOptions, errors: dict[int, dict[str, float]], device, progress: bool,
              into: Path | None = None) -> None:
    """Merge layer `inputs.index` by the calibrated merge training starts from (`fit`, or `aligned` with
    `--transfer-start aligned`), train it (`convert.transfer`), and leave its attention tensors in
    `_transferred_path` of `into` (default: the statistics folder), read back by the write pass; its errors go
    to `errors`."""
    from safetensors.torch import save_file

    i = inputs.index
    op = next(op for op in plan.ops if op.kind == "attn" and op.layer == i)
    heldout = load_layer(how.stats, i, ())[1]
    start_plan = dataclasses.replace(plan, method=opts.start)  # the calibrated merge that training starts from
    merged, cost = merge_checkpoint_layer(start_plan, tensors, i, op.sources, how, heldout)
    prefix = plan.spec.q_proj.format(i=i).rpartition(".")[0] + "."  # "model.layers.3.self_attn."
    original = {name[len(prefix):]: load_tensor(info, name) for name, info in tensors.items()
                if name.startswith(prefix)}
    student, cost_transfer = transfer_merged_layer(
        inputs.attention_class, config, new_config(config, plan, "auto"), i, inputs.attention_kwargs, original,
        {name[len(prefix):]: t for name, t in merged.items()}, inputs.windows, inputs.read, heldout["x"],
        how.stats, opts, device, progress, inputs.read_target, inputs.held_targets)
    inputs.trained_attention = student  # with --transfer-inputs converted, the next layer's inputs come through it
    params = dict(student.named_parameters())
    save_file({name: params[name[len(prefix):]].detach().cpu().contiguous() for name in merged},
              str(_transferred_path(into or how.stats, i)))
    errors.setdefault(i, {}).update({**cost, **cost_transfer})


def compute(op: TensorOp, plan: Plan, tensors: dict[str, TensorInfo], std: float, seed: int,
            errors: dict[int, dict[str, float]], layers: dict | None = None, how: LayerMerge = LayerMerge()
            ) -> torch.Tensor:
    """Make one output tensor that is not a plain byte copy (`layers`: the aligned merge's layer memo)."""
    out_dtype = DTYPES[op.dtype]
    if op.kind == "attn":
        return _merged_layer(op, plan, tensors, errors, layers if layers is not None else {}, how).to(out_dtype)
    if op.kind == "head_norm":
        stack = torch.stack([load_tensor(tensors[s], s).float() for s in op.sources])  # (n, d)
        merged = stack[0] if plan.method == "first" else stack.mean(dim=0)
        return merged.to(out_dtype)
    t = load_tensor(tensors[op.sources[0]], op.sources[0])
    if op.kind == "cast":
        return t.to(out_dtype)
    if op.kind == "norm":  # a key norm that spans heads is pooled, never re-initialised
        return regroup(t, plan.num_key_value_heads, plan.groups, "first" if plan.method == "first" else "mean").to(out_dtype)
    if op.kind == "kv":
        new = _regroup_rows(t, plan, std, seed, op.name)
        if op.role:
            errors.setdefault(op.layer, {})[op.role] = relative_error(t, new, plan.num_key_value_heads)
        return new.to(out_dtype)
    if op.kind == "qkv":
        q, k, v = split_qkv(t, plan.num_attention_heads, plan.num_key_value_heads, plan.head_dim, plan.qkv_layout[0])
        k2 = _regroup_rows(k, plan, std, seed, op.name + ".k")
        v2 = _regroup_rows(v, plan, std, seed, op.name + ".v")
        if op.role:
            errors.setdefault(op.layer, {}).update(
                k=relative_error(k, k2, plan.num_key_value_heads), v=relative_error(v, v2, plan.num_key_value_heads))
        return join_qkv(q, k2, v2, plan.groups, plan.qkv_layout[1]).to(out_dtype)
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


def new_config(config: dict, plan: Plan, dtype: str) -> dict:
    config = dict(config)
    if plan.spec.multi_query_key:  # the class reads its K/V head count from this flag
        config[plan.spec.multi_query_key] = plan.groups == 1
    if plan.own_class:  # a G no stock class holds: gqakit's own class, registered by `import gqakit`
        model_type, architecture, kv_key = plan.own_class
        config.update(model_type=model_type, architectures=[architecture])
        config[kv_key] = plan.groups
    for common, own in plan.spec.config_names:  # and this family spells it its own way
        if common == "num_key_value_heads":
            config[own] = plan.groups
    config["num_key_value_heads"] = plan.groups
    if plan.encoder_layers is not None:
        config[plan.spec.encoder_fields[1]] = plan.groups
    if plan.spec.head_dim_field:
        config["head_dim"] = plan.head_dim
    if dtype != "auto":
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    return config


def convert(cfg: ConvertConfig, command: str = "") -> dict:
    """Run a conversion end to end; returns a summary (also what the card records). Under torchrun, attention
    transfer's layers are split over the processes (`layer_share.py`); rank 0 writes the output."""
    share = launched_share()
    plan, config, tensors, out, calibration = prepare(cfg)
    transfer = methods.get(plan.method).transfer
    check_share(share, transfer, transfer_options(cfg).inputs if transfer else "", cfg.dry_run)
    summary = {"plan": plan, "output_dir": out, "errors": {}, "calibration": calibration}
    if cfg.dry_run:
        return summary
    start(share)
    try:
        if share.main:
            summary["errors"] = _write(cfg, plan, config, tensors, out, command, calibration, share)
        else:
            _transfer_share(cfg, plan, config, tensors, calibration, share)
    except OSError as e:
        raise GqakitError(f"writing {out} failed ({e.strerror or e}); nothing was written: fix the cause "
                          "(disk space, permissions) and run again") from None
    finally:
        finish(share)
    return summary


def _calibration_device(cfg: ConvertConfig, share: Share) -> str:
    device = cfg.calibration_device or "cpu"
    if share.world > 1 and device == "cuda":  # one GPU per process, as torchrun numbers them
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def _transfer_share(cfg: ConvertConfig, plan: Plan, config: dict, tensors: dict[str, TensorInfo],
                    calibration: CalibrationData, share: Share) -> None:
    """A process other than rank 0 under torchrun: calibrate in a scratch folder of its own, inside rank 0's
    temporary output folder, train the layers it owns and leave them (with their errors) beside rank 0's."""
    meeting = meeting_folder(share, None)
    own = meeting / f"rank-{share.rank}"
    own.mkdir()
    how = LayerMerge(grouping=cfg.grouping or "similarity", stats=own, transferred=True)
    opts, device = transfer_options(cfg), _calibration_device(cfg, share)
    errors: dict[int, dict[str, float]] = {}
    for layer in calibrate(config, plan.spec, tensors, calibration.windows, calibration.heldout, own, device,
                           False, with_inputs=True):
        if share.owns(layer.index):
            _transfer(layer, plan, config, tensors, how, opts, errors, device, False, into=meeting)
            write_errors(meeting, layer.index, errors[layer.index])
        layer_path(own, layer.index).unlink()  # its statistics are done with
    barrier(share)


def _write(cfg: ConvertConfig, plan: Plan, config: dict, tensors: dict[str, TensorInfo], out: Path,
           command: str, calibration: CalibrationData | None = None, share: Share = Share()
           ) -> dict[int, dict[str, float]]:
    std = plan.initializer_range
    errors: dict[int, dict[str, float]] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}  # aligned merges: a layer's tensors not yet written
    entries = [(o.name, o.dtype, o.shape) for o in plan.ops]
    with atomic_output(out, cfg.force) as tmp:
        how = LayerMerge(grouping=cfg.grouping or "similarity")
        if calibration is not None:  # one pass, layer by layer; statistics wait on disk, one file per layer
            transfer = methods.get(plan.method).transfer
            how = dataclasses.replace(how, stats=tmp / ".calibration", transferred=transfer)
            how.stats.mkdir()
            meeting_folder(share, how.stats)  # under torchrun: where the other processes leave their layers
            device = _calibration_device(cfg, share)
            opts = transfer_options(cfg) if transfer else None
            if opts is not None and opts.dtype == "bfloat16" and str(device).startswith("cpu") and share.rank == 0:
                from gqakit.common.precision import warn_if_slow_bf16

                warn_if_slow_bf16("convert-gqa", "--transfer-dtype bfloat16", "--transfer-dtype float32")
            for layer in calibrate(config, plan.spec, tensors, calibration.windows, calibration.heldout, how.stats,
                                   device, cfg.progress, with_inputs=transfer,
                                   converted_inputs=transfer and opts.inputs == "converted"):
                if transfer:  # while the layer's inputs are at hand: merge it, then train it
                    if share.owns(layer.index):
                        _transfer(layer, plan, config, tensors, how, opts, errors, device, cfg.progress)
                    layer_path(how.stats, layer.index).unlink()  # its statistics are done with
                # else each layer's statistics are in their file in how.stats when its index is yielded
            if transfer and share.world > 1:
                barrier(share)  # every process has left its layers in how.stats
                errors.update(read_errors(how.stats, range(plan.num_layers), share))
            release_freed_memory()  # the calibration model's heap goes back to the OS before the merge
        ahead = _merges_ahead(plan, tensors, how)
        how = dataclasses.replace(how, ahead=ahead)
        writer = ShardWriter(tmp, entries, plan.max_shard_bytes)
        # One worker thread computes the next regrouped tensors while this thread streams byte copies
        # (torch kernels and copy_file_range both release the GIL). At most LOOKAHEAD results wait,
        # so memory stays a few tensors.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: deque = deque()
            todo = iter(op for op in plan.ops if op.kind != "copy")

            def refill() -> None:
                while len(pending) < LOOKAHEAD and (op := next(todo, None)) is not None:
                    pending.append(pool.submit(compute, op, plan, tensors, std, cfg.seed, errors, layers, how))

            try:
                refill()
                for op in tqdm(plan.ops, desc="convert", unit="tensor", disable=not cfg.progress):
                    if op.kind == "copy":
                        writer.copy_tensor(op.name, tensors[op.sources[0]])
                    else:
                        writer.write_tensor(op.name, pending.popleft().result())
                        refill()
            finally:
                for future in pending:  # only on the way out of an error or an interrupt: do not wait for them
                    future.cancel()
                if ahead is not None:  # merges still running read files in tmp: they end before it goes
                    ahead.close()
        writer.finish()
        if how.stats is not None:
            shutil.rmtree(how.stats)
        (tmp / "config.json").write_text(json.dumps(new_config(config, plan, cfg.dtype), indent=2) + "\n",
                                         encoding="utf-8")
        copy_side_files(Path(cfg.model_dir), tmp)
        write_card(tmp / "README.md", cfg, plan, errors, command, calibration)
    return errors
