"""Plan a conversion from a config and tensor metadata alone: no tensor data is read here.

Because the plan needs only names, dtypes and shapes, it can be computed for a 70B model described on
the meta device, and `--dry-run` can print it without touching the weights.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

from gqakit.common.errors import GqakitError, opt
from gqakit.hf.architectures import (ArchSpec, KNorm, family_of_model_type, find_family,
                                     supported_architectures)
from gqakit.hf.architectures.latent import (LatentShape, fitted_shape, host_refusal, mqa_shape, pair_frequencies,
                                            shape_refusal)
from gqakit.hf.headers import CODES, ITEMSIZES, DerivedTensor, TensorInfo, assign_shards, shard_names
from gqakit.hf.architectures.refused import refusal
from gqakit.hf.architectures.rehost import Rehosted, find_rehost, rehost, rehosted_architectures
from gqakit.hf.config_defaults import filled_or_given, rope_of
from gqakit.hf.fields import ModelFields, architecture_of, positive_int, read_fields
from gqakit.convert import methods
from gqakit.convert.latent.ops import latent_tensors

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class TensorOp:
    """How one output tensor is made. kind: copy | cast | kv | qkv | head_norm | attn (one of a layer's
    q/k/v/o tensors from an aligned merge; `sources` are all of that layer's attention tensors) | latent (one of a
    layer's latent-attention tensors, `--to mla`; `sources` likewise)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    sources: tuple[str, ...]
    layer: int = -1
    role: str = ""  # "k" / "v" for projections whose relative error the card reports


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: ArchSpec
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # before
    groups: int  # after
    head_dim: int
    method: str
    ops: tuple[TensorOp, ...]
    max_shard_bytes: int
    source_kv_itemsize: int
    target_kv_itemsize: int
    initializer_range: float = 0.02  # the std of --method random's fresh K/V projections
    # a source family re-hosted on `architecture`: its target config and tensors, which the writer reads (None: native)
    rehosted: Rehosted | None = None
    # row order of a fused QKV projection before and after: "blocks" [q | k | v], "heads" [q_h, k_h, v_h] per head
    # (GPTBigCode's MHA form, which holds only G = H), or "groups" (ArchSpec.qkv_layout)
    qkv_layout: tuple[str, str] = ("blocks", "blocks")
    # an encoder-decoder's encoder layers when --pool-encoder regroups them too (None: the encoder is copied)
    encoder_layers: int | None = None
    # --to mla: each layer's latent attention, written as transformers' DeepseekV3 (None: grouped K/V heads)
    latent: LatentShape | None = None
    latent_fit: bool = False  # the latent is fitted to the source's K/V heads (--kv-rank / --rope-dim), not an MQA
    sliding_window: int | None = None  # the window of the layers that slide (they cache at most that many tokens)
    # a fitted latent that reads dims without rotation: the source's RoPE angle per position of each pair, and its
    # context (max_position_embeddings), over whose relative positions the card measures what that costs
    rope_frequencies: tuple[float, ...] = ()
    context: int | None = None

    @functools.cached_property
    def shards(self) -> list[list[int]]:
        return assign_shards([(o.name, o.dtype, o.shape) for o in self.ops], self.max_shard_bytes)

    @property
    def shard_files(self) -> list[str]:
        return shard_names(len(self.shards))

    def kv_cache_bytes_per_token(self, after: bool) -> int:
        """K and V cache bytes for one token across all layers."""
        heads = self.groups if after else self.num_key_value_heads
        itemsize = self.target_kv_itemsize if after else self.source_kv_itemsize
        if after and self.latent is not None:  # the latent and the shared RoPE key
            return self.num_layers * self.latent.values_per_token * itemsize
        return 2 * self.num_layers * heads * self.head_dim * itemsize

    @property
    def mode(self) -> str:
        if self.groups == self.num_key_value_heads:
            return "identity"
        return "pool" if self.groups < self.num_key_value_heads else "expand"

    @property
    def own_class(self) -> tuple[str, str, str] | None:
        """gqakit's class that the output needs (model_type, architecture, K/V field), or None for a stock one: a
        family whose stock class holds only MQA or MHA needs it for 1 < G < H; gqakit's own class always."""
        grouped = self.spec.grouped_class
        if grouped and (self.spec.multi_query_key is None or 1 < self.groups < self.num_attention_heads):
            return grouped
        return None

    @property
    def latent_trained(self) -> bool:
        """--to mla with a transfer method where the latent layer itself is trained (a fitted latent, or a bias-free
        one), rather than an MQA trained and then held exactly."""
        return (self.latent is not None and methods.get(self.method).transfer
                and (self.latent_fit or not self.latent.bias))

    @property
    def exact(self) -> bool:
        """Does the output compute exactly the mean of each group's keys (or the same function)?"""
        if self.latent_fit or (self.latent is not None and not self.latent.bias):
            return False
        if methods.get(self.method).reinitialises:
            return False
        if self.mode != "pool":
            return True
        return not self.spec.pooling_exact_for_identical_heads_only


def valid_groups(num_heads: int) -> list[int]:
    """Every G that divides `num_heads` (the valid K/V head counts)."""
    return [g for g in range(1, num_heads + 1) if num_heads % g == 0]


def check_groups(groups: int, heads: int, kv_heads: int) -> None:
    """Raise a one-line error unless `groups` is a valid K/V head count for this model."""
    valid = valid_groups(heads)
    choices = ", ".join(map(str, valid))
    if groups <= 0:
        raise GqakitError(f"{opt('groups')} must be a positive number of K/V heads, got {groups}; choose one of "
                          f"{choices}")
    if groups > heads:
        raise GqakitError(f"{opt('groups', groups)} exceeds the {heads} attention heads; choose one of {choices}")
    if heads % groups:
        raise GqakitError(f"{heads} heads are not divisible into {groups} groups; "
                          f"choose a divisor of {heads} ({choices})")
    if kv_heads % groups and groups % kv_heads:
        ok = [g for g in valid if kv_heads % g == 0 or g % kv_heads == 0]
        raise GqakitError(
            f"the model has {kv_heads} K/V heads, which cannot be regrouped exactly into {groups}; "
            f"choose a divisor of {kv_heads} (pool) or a multiple of it that divides {heads} (expand): "
            f"{', '.join(map(str, ok))}"
        )


def _need(tensors: dict[str, TensorInfo], name: str) -> TensorInfo:
    if name not in tensors:
        raise GqakitError(f"tensor '{name}' is missing from the checkpoint; the weights do not match config.json")
    return tensors[name]


def _check_rows(name: str, info: TensorInfo, rows: int, what: str) -> None:
    if not info.shape or info.shape[0] != rows:
        raise GqakitError(
            f"tensor '{name}' has shape {list(info.shape)} but config.json implies {rows} rows ({what}); "
            "the weights do not match the config"
        )


@dataclasses.dataclass(frozen=True)
class _Heads:
    heads: int
    kv_heads: int
    groups: int
    head_dim: int


def _projection_ops(spec: ArchSpec, tensors, i: int, h: _Heads, target,
                    sites: tuple[tuple[str, str, str], ...] | None = None) -> dict[str, list[TensorOp]]:
    """K/V projection weights and biases of layer i (or the fused QKV projection); `sites` are (name, k, v)
    templates, by default the family's own K/V projections and its other sites (T5's cross-attention)."""
    ops = {}
    kv_rows, new_rows = h.kv_heads * h.head_dim, h.groups * h.head_dim
    if spec.fused:
        for suffix in (".weight", ".bias"):
            name = spec.qkv_proj.format(i=i) + suffix
            if suffix == ".bias" and name not in tensors:
                continue
            info = _need(tensors, name)
            _check_rows(name, info, h.heads * h.head_dim + 2 * kv_rows,
                        f"{h.heads} q + 2x{h.kv_heads} k/v heads of {h.head_dim}")
            shape = (h.heads * h.head_dim + 2 * new_rows, *info.shape[1:])
            ops[name] = [TensorOp(name, target(info), shape, "qkv", (name,), i, "kv" if suffix == ".weight" else "")]
        return ops
    if sites is None:
        sites = (("", spec.k_proj, spec.v_proj), *spec.kv_sites)
    for site, k_template, v_template in sites:
        for role, template in (("k", k_template), ("v", v_template)):
            for suffix in (".weight", ".bias"):
                name = template.format(i=i) + suffix
                if suffix == ".bias" and name not in tensors:
                    continue
                info = _need(tensors, name)
                _check_rows(name, info, kv_rows, f"{h.kv_heads} K/V heads of {h.head_dim}")
                ops[name] = [TensorOp(name, target(info), (new_rows, *info.shape[1:]), "kv", (name,), i,
                                      (f"{site} {role}" if site else role) if suffix == ".weight" else "")]
    return ops


def _attention_ops(spec: ArchSpec, tensors, i: int, h: _Heads, target) -> dict[str, list[TensorOp]]:
    """Layer i's q/k/v/o weights and biases for a method that rewrites them together (aligned merge)."""
    rows = {"q": h.heads * h.head_dim, "k": h.kv_heads * h.head_dim, "v": h.kv_heads * h.head_dim}
    new_rows = {"q": h.heads * h.head_dim, "k": h.groups * h.head_dim, "v": h.groups * h.head_dim}
    names: dict[str, str] = {}
    for role, template in (("q", spec.q_proj), ("k", spec.k_proj), ("v", spec.v_proj), ("o", spec.o_proj)):
        for suffix in (".weight", ".bias"):
            name = template.format(i=i) + suffix
            if suffix == ".bias" and name not in tensors:
                continue
            if role == "o" and suffix == ".bias":
                continue  # an output bias acts after the heads are summed: untouched
            info = _need(tensors, name)
            if role == "o":
                if len(info.shape) != 2 or info.shape[1] != h.heads * h.head_dim:
                    raise GqakitError(f"tensor '{name}' has shape {list(info.shape)} but config.json implies "
                                      f"{h.heads * h.head_dim} input columns; the weights do not match the config")
            else:
                _check_rows(name, info, rows[role], f"{h.heads if role == 'q' else h.kv_heads} heads of {h.head_dim}")
            names[role + suffix] = name
    sources = tuple(names.values())
    ops = {}
    for key, name in names.items():
        role, suffix = key.split(".", 1)
        info = tensors[name]
        shape = info.shape if role == "o" else (new_rows[role], *info.shape[1:])
        ops[name] = [TensorOp(name, target(info), shape, "attn", sources, i, role if suffix == "weight" else "")]
    return ops


def _latent_ops(spec: ArchSpec, tensors, i: int, h: _Heads, target, shape: LatentShape) -> dict[str, list[TensorOp]]:
    """Layer i's attention as latent attention (`convert/latent/ops.py`): every target tensor where the key
    projection was, the other sources dropped."""
    def rows(name: str, n: int, what: str) -> None:
        _check_rows(name, _need(tensors, name), n, what)

    sources, key, shapes = latent_tensors(spec, tensors, i, h.heads, h.kv_heads, h.head_dim, shape, rows)
    dtype = target(tensors[key])
    new = [TensorOp(name, dtype, size, "latent", sources, i) for name, size in shapes.items()]
    return {name: (new if name == key else []) for name in sources}


def _norm_ops(spec: ArchSpec, tensors, i: int, h: _Heads, target) -> dict[str, list[TensorOp]]:
    """Key norms of layer i that carry K/V heads: one spanning all heads, or one module per head."""
    if spec.k_norm is KNorm.SPANS_HEADS:
        name = spec.k_norm_weight.format(i=i)
        info = _need(tensors, name)
        _check_rows(name, info, h.kv_heads * h.head_dim, f"a key norm over {h.kv_heads} heads of {h.head_dim}")
        return {name: [TensorOp(name, target(info), (h.groups * h.head_dim,), "norm", (name,), i)]}
    if spec.k_norm is not KNorm.ONE_PER_HEAD:
        return {}
    ops = {}
    for template in (spec.k_norm_weight, *spec.k_norm_extra):
        names = [template.format(i=i, h=k) for k in range(h.kv_heads)]
        if template != spec.k_norm_weight and names[0] not in tensors:
            continue
        infos = [_need(tensors, n) for n in names]
        for n, info in zip(names, infos):
            _check_rows(n, info, h.head_dim, f"one key norm of {h.head_dim} per head")
        new = []
        for g in range(h.groups):
            if h.groups <= h.kv_heads:  # pool: the group's heads
                size = h.kv_heads // h.groups
                srcs = tuple(names[g * size : (g + 1) * size])
            else:  # expand: the one head this copy repeats
                srcs = (names[g // (h.groups // h.kv_heads)],)
            new.append(TensorOp(template.format(i=i, h=g), target(infos[0]), infos[0].shape, "head_norm", srcs, i))
        ops.update({n: [] for n in names})
        ops[names[0]] = new  # emitted where the first old norm was
    return ops


def _layer_prefix(spec: ArchSpec) -> str:
    return (spec.qkv_proj if spec.fused else spec.k_proj).split("{i}")[0]  # "model.layers."


def check_layers(spec: ArchSpec, tensors: dict[str, TensorInfo], layers: int, prefix: str | None = None,
                 key: str | None = None) -> None:
    """The weights must hold exactly the layers 0 .. num_hidden_layers - 1 that config.json declares (or, with
    `prefix` and `key`, another stack's: T5's encoder)."""
    prefix = prefix or _layer_prefix(spec)
    key = key or dict(spec.config_names).get("num_hidden_layers", "num_hidden_layers")
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found: dict[int, str] = {}
    for name in sorted(tensors):
        if m := pattern.match(name):
            found.setdefault(int(m[1]), name)
    held = max(found) + 1 if found else 0
    head, _, rest = prefix.partition(".")
    if not found and rest and any(name.startswith(rest) for name in tensors):  # 'layers.0...' where 'model.layers.0'
        raise GqakitError(f"the weights name their layers {rest}N.* without the '{head}.' prefix of {prefix}N.*: "
                          f"saved from the base model class (no LM head), not the one config.json's architectures "
                          "names; save the model with its LM head (the ...ForCausalLM class)")
    if held != layers:
        example = f" (up to '{found[held - 1]}')" if found else f" named {prefix}N.*"
        raise GqakitError(f"config.json says {key} {layers} but the weights hold {held} "
                          f"layer{'' if held == 1 else 's'}{example}; fix {key} in config.json "
                          "(or point at the matching weights)")


def _head_templates(spec: ArchSpec, encoder: bool = False) -> list[str]:
    """Name templates of every tensor that carries K/V heads, which the plan must regroup, not copy (an encoder's
    too when it is regrouped)."""
    if spec.fused:
        bases = [spec.qkv_proj]
    else:
        bases = [spec.k_proj, spec.v_proj, *(t for _, k, v in spec.kv_sites for t in (k, v))]
        if encoder:
            bases += list(spec.encoder_kv)
    names = [b + suffix for b in bases for suffix in (".weight", ".bias")]
    if spec.k_norm in (KNorm.SPANS_HEADS, KNorm.ONE_PER_HEAD):
        names += [spec.k_norm_weight, *spec.k_norm_extra]
    return names


def check_accounted(spec: ArchSpec, tensors: dict[str, TensorInfo], planned: dict, fields: ModelFields,
                    encoder: bool = False) -> None:
    """Every tensor the architecture table names must be one the plan regroups: none may slip through as
    a copy because config.json declares fewer layers or K/V heads than the weights hold."""
    patterns = [re.compile(re.escape(t.format(i="<I>", h="<H>")).replace("<I>", r"\d+").replace("<H>", r"\d+"))
                for t in _head_templates(spec, encoder)]
    for name in sorted(tensors):
        if name not in planned and any(p.fullmatch(name) for p in patterns):
            raise GqakitError(
                f"tensor '{name}' carries K/V heads that config.json ({fields.num_hidden_layers} layers, "
                f"{fields.num_key_value_heads} K/V heads) does not account for; the weights do not match config.json"
            )


def check_alignable(spec: ArchSpec, arch: str, config: dict, groups: int, kv_heads: int, head_dim: int,
                    method: str = "aligned") -> None:
    """`--method aligned` / `fit` transform keys per RoPE pair (rotate_half layout, every dimension rotary) and
    merges heads: refuse, in one line, a model or a G it cannot handle exactly."""
    why = spec.alignable
    if why is None:
        rope = rope_of(config)  # transformers 5 keeps both inside rope_parameters, with the class's defaults
        factor = rope.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            why = f"rotates only part of each head (partial_rotary_factor {factor})"
        elif rope.get("rope_type") == "longrope":
            why = "uses LongRoPE, whose per-pair factors change with the sequence length"
        elif config.get("clip_qkv") is not None:
            why = f"clips q, k and v elementwise (clip_qkv {config['clip_qkv']}), which rotations do not commute with"
        elif head_dim % 2:
            why = f"has an odd head_dim {head_dim}, which RoPE pairs cannot split"
    if why is not None:
        raise GqakitError(f"{opt('method', method)} cannot convert {arch}: it {why}; use {opt('method', 'mean')}")
    if groups >= kv_heads:
        raise GqakitError(f"{opt('method', method)} merges heads, but {opt('groups', groups)} keeps or expands the "
                          f"{kv_heads} K/V heads; use {opt('method', 'mean')}")


FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors dtypes a merge may compute with


def check_family(config: dict) -> ArchSpec | None:
    """The family's table (None for a re-hosted source), or a one-line refusal that names the family: checked
    before any other field is read, since refused families spell their fields otherwise (n_head, num_heads)."""
    arch = architecture_of(config)
    quantized = config.get("quantization_config")
    if quantized:
        how = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "quantized"
        raise GqakitError(f"config.json holds a quantization_config ({how}): the weights are quantized codes and "
                          "scales, which merging would average as numbers; convert the model's floating-point "
                          "checkpoint, then quantize the result")
    if (why := refusal(arch, config)) is not None:  # a variant of a supported family may be refused too (Falcon)
        raise GqakitError(f"cannot convert: {why}")
    spec = find_family(arch, config)
    if spec is None and find_rehost(arch) is None:
        known = sorted({*supported_architectures(), *rehosted_architectures()})
        raise GqakitError(f"architecture {arch} is not supported; gqakit converts {', '.join(known)}")
    model_type = config.get("model_type")
    other = family_of_model_type(model_type) if spec is not None and model_type != spec.config_model_type else None
    if other is not None:  # transformers builds the class that model_type names: another family's tensors
        raise GqakitError(f"config.json names architectures [{arch}] but model_type {json.dumps(model_type)}, which "
                          f"is {other.architectures[0]}'s; transformers builds the model from model_type, so the "
                          "two must agree: correct the one that is wrong")
    return spec


def encoder_layers(spec: ArchSpec, arch: str, config: dict, tensors: dict[str, TensorInfo], kv_heads: int,
                   heads: int) -> int:
    """--pool-encoder: the encoder's layer count, checked against the weights, once its K/V heads are known to be
    the decoder's (one G regroups both)."""
    if spec.encoder_kv is None:
        raise GqakitError(f"{opt('pool_encoder')} regroups an encoder-decoder's encoder (T5); {arch} has no "
                          f"encoder: drop {opt('pool_encoder')}")
    layers_key, kv_key = spec.encoder_fields
    enc_kv = positive_int(config, kv_key, default=heads)
    if enc_kv != kv_heads:
        raise GqakitError(f"{opt('pool_encoder')} regroups the encoder's {enc_kv} K/V heads ({kv_key}) and the "
                          f"decoder's {kv_heads} into one G, which needs them equal; drop {opt('pool_encoder')}, or "
                          "convert the original checkpoint")
    layers = positive_int(config, layers_key)
    check_layers(spec, tensors, layers, spec.encoder_kv[0].split("{i}")[0], layers_key)
    return layers


def check_latent(spec: ArchSpec, arch: str, config: dict, groups: int, shape: LatentShape | None = None,
                 kv_heads: int = 1) -> None:
    """--to mla: refuse, in one line, a model whose layers the stock DeepseekV3 class cannot compute, or a G it
    cannot hold."""
    if (why := host_refusal(spec.family, config)) is not None:
        raise GqakitError(f"{opt('to', 'mla')} cannot convert {arch}: it {why}; drop {opt('to', 'mla')} to write "
                          "grouped K/V heads")
    if groups != 1:
        raise GqakitError(f"{opt('to', 'mla')} holds one latent and one shared RoPE key per token; use "
                          f"{opt('groups', 1)}, not {groups}")
    if shape is not None and (why := shape_refusal(shape, kv_heads, config)) is not None:
        raise GqakitError(why)


def make_plan(config: dict, tensors: dict[str, TensorInfo], groups: int, method: str = "mean",
              dtype: str | None = None, max_shard_bytes: int = 5 * 10**9, pool_encoder: bool = False,
              to: str = "gqa", kv_rank: int | None = None, rope_dim: int | None = None,
              bias_free: bool = False) -> Plan:
    """Decide every output tensor's name, dtype, shape and recipe. Raises GqakitError on bad input.

    A re-hosted family (GPT-NeoX, GPT-J, GPT-2, OPT) is planned on its target class: `plan.rehosted` then holds the
    target's config and tensors, which the caller must convert from instead of `config` and `tensors`."""
    spec = check_family(config)
    source_arch = architecture_of(config)  # what the user gave, before any re-host (errors name it)
    rehosted = rehost(config, tensors)
    if rehosted is not None:
        config, tensors = rehosted.config, rehosted.tensors
        spec = check_family(config)
    fields = read_fields(config, spec.config_names, spec.multi_query_key)
    arch = fields.architecture
    # errors name the user's class, and the stock class it is re-hosted as (GPT-2 and OPT as GPTBigCode)
    named = arch if arch == source_arch else f"{source_arch} (re-hosted as {arch})"
    layerwise = methods.get(method).layerwise
    heads, kv_heads, layers = fields.num_attention_heads, fields.num_key_value_heads, fields.num_hidden_layers
    head_dim = fields.head_dim
    check_groups(groups, heads, kv_heads)
    if spec.multi_query_key and spec.grouped_class is None and groups not in (1, heads):
        raise GqakitError(f"{named} holds one K/V head ({spec.multi_query_key}) or all {heads}, no stock class a "
                          f"grouping in between; use {opt('groups', 1)} (MQA) or {opt('groups', heads)}")
    if layerwise:
        check_alignable(spec, named, config, groups, kv_heads, head_dim, method)
    latent, latent_fit = None, kv_rank is not None or rope_dim is not None
    if to == "mla":
        latent = (fitted_shape(heads, kv_heads, head_dim, kv_rank, rope_dim, not bias_free) if latent_fit
                  else mqa_shape(heads, head_dim, not bias_free))
        check_latent(spec, named, config, groups, latent if latent_fit else None, kv_heads)
    check_layers(spec, tensors, layers)
    encoder = encoder_layers(spec, named, config, tensors, kv_heads, heads) if pool_encoder else None
    out_dtype = None if dtype in (None, "auto") else CODES[dtype]

    def target(info: TensorInfo) -> str:
        return out_dtype if out_dtype and info.dtype in FLOAT_DTYPES else info.dtype

    shape = _Heads(heads, kv_heads, groups, head_dim)
    # Source tensor name -> the output ops that replace it (an empty list drops it).
    special: dict[str, list[TensorOp]] = {}
    for i in range(layers):
        if latent is not None:
            special.update(_latent_ops(spec, tensors, i, shape, target, latent))
        elif layerwise:
            special.update(_attention_ops(spec, tensors, i, shape, target))
        else:
            special.update(_projection_ops(spec, tensors, i, shape, target))
        special.update(_norm_ops(spec, tensors, i, shape, target))
    for i in range(encoder or 0):
        special.update(_projection_ops(spec, tensors, i, shape, target, (("encoder", *spec.encoder_kv),)))
    check_accounted(spec, tensors, special, fields, encoder is not None)
    for op in (op for ops in special.values() for op in ops):  # what is averaged or fitted must be numbers
        coded = next((n for n in op.sources if tensors[n].dtype not in FLOATS), None)
        if coded is not None:
            raise GqakitError(f"tensor '{coded}' is stored as {tensors[coded].dtype}, quantized codes that merging "
                              "would average as numbers; convert the model's floating-point checkpoint")

    ops: list[TensorOp] = []
    # Keep source order (sorted by file then offset) so reads are sequential.
    order = sorted(tensors, key=lambda n: (str(tensors[n].file), tensors[n].start, n))
    for name in order:
        info = tensors[name]
        if name in special:
            ops += special[name]
        else:
            kind = "copy" if target(info) == info.dtype and not isinstance(info, DerivedTensor) else "cast"
            ops.append(TensorOp(name, target(info), info.shape, kind, (name,)))

    kv_probe = tensors[spec.qkv_proj.format(i=0) + ".weight" if spec.fused else spec.k_proj.format(i=0) + ".weight"]
    return Plan(
        spec=spec, architecture=arch, num_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, groups=groups, head_dim=head_dim, method=method, ops=tuple(ops),
        max_shard_bytes=max_shard_bytes, source_kv_itemsize=ITEMSIZES[kv_probe.dtype],
        target_kv_itemsize=ITEMSIZES[target(kv_probe)], initializer_range=fields.initializer_range,
        rehosted=rehosted, qkv_layout=qkv_layouts(spec, heads, kv_heads, groups), encoder_layers=encoder,
        latent=latent, latent_fit=latent_fit, sliding_window=None if latent is not None else _sliding_window(config),
        **_unrotated(config, latent if latent_fit else None),
    )


def _unrotated(config: dict, latent: LatentShape | None) -> dict:
    """Plan fields for a fitted latent that reads some dims without rotation (its card's error over positions)."""
    if latent is None or not latent.nope_dim:
        return {}
    return {"rope_frequencies": pair_frequencies(config, latent.v_dim),
            "context": filled_or_given(config).get("max_position_embeddings")}


# model types whose sliding_window acts only with use_sliding_window: true (their class's default is false)
OPT_IN_WINDOW = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _sliding_window(config: dict) -> int | None:
    """The window of a model's sliding-window layers (Mistral's every layer, the sliding ones of layer_types), or
    None: no window, one no sequence reaches (at least the context), or no layer that slides."""
    known = filled_or_given(config)
    window = known.get("sliding_window")
    if not isinstance(window, int) or window >= (known.get("max_position_embeddings") or window + 1):
        return None
    if known.get("model_type") in OPT_IN_WINDOW and known.get("use_sliding_window") is not True:
        return None
    types = known.get("layer_types")
    return window if types is None or "sliding_attention" in types else None


def qkv_layouts(spec: ArchSpec, heads: int, kv_heads: int, groups: int) -> tuple[str, str]:
    """The fused projection's row order before and after (see Plan.qkv_layout)."""
    if spec.multi_query_key is None:
        return (spec.qkv_layout, spec.qkv_layout)
    # the stock MHA form (every head) has rows per head; MQA and gqakit's grouped class: [q | k | v] blocks
    return tuple("heads" if n == heads > 1 else "blocks" for n in (kv_heads, groups))


def total_bytes(plan: Plan) -> int:
    return sum(math.prod(o.shape) * ITEMSIZES[o.dtype] for o in plan.ops)
