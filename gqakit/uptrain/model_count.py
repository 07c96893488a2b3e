"""A model's parameters as the memory plan needs them: per tensor its rows and whether each `trainable` mode trains
it, the decoder layers', the Linear weights'. Counted without torch for a family of the architecture tables: from
the safetensors headers and config.json, its fields left out filled with the class's defaults
(`hf.config_defaults`), or, for a config.json alone, from the tensors it implies (`hf.architectures.shapes`).
Else (a family outside the tables, a variant the layouts do not describe, a model_type whose defaults the table
lacks) the model is built on the meta device with transformers, which loads torch. Both ways give the same counts
(tests/uptrain/test_model_count.py, every family of the tables)."""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from pathlib import Path

from gqakit.common.errors import GqakitError
from gqakit.hf.config_defaults import decoder_sizes
from gqakit.uptrain.config import TRAINABLE
from gqakit.uptrain.trainable import trains as trains_by_name

HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class ModelCount:
    """A model's parameters as the plan needs them (tied weights once)."""

    path: str
    architecture: str
    total: int
    rows: tuple[tuple[int, int], ...]  # per tensor: (dim-0 rows, elements per row)
    trains: dict  # trainable mode -> per tensor, does it train (None: the mode does not apply)
    trainable: dict  # trainable mode -> parameters (None: the mode does not apply)
    root: int  # parameters outside the decoder layers: embeddings, final norm, head
    layer: int  # parameters of the largest decoder layer
    layer_trainable: dict  # trainable mode -> trainable parameters of the largest decoder layer
    linear: int  # Linear weights (autocast copies them)
    linear_trainable: dict
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def shard(self, world: int, trainable: str | None = None) -> int:
        """Elements on the busiest rank when every tensor's dim 0 is split `world` ways (FSDP2);
        all tensors, or those `trainable` trains."""
        keep = self.trains[trainable] if trainable else None
        return sum(math.ceil(r / world) * e for i, (r, e) in enumerate(self.rows) if keep is None or keep[i])


def count_model(path: str | Path) -> ModelCount:
    """Count the parameters of the checkpoint folder's model: from its safetensors headers (or, with none, the
    tensors its config.json implies) where they say it exactly, else from its config.json on the meta device."""
    from gqakit.hf.folder import model_folder

    folder = model_folder(path)  # one-line errors for a missing folder or config.json
    config = folder.config
    if config.get("is_encoder_decoder"):
        arch = (config.get("architectures") or ["?"])[0]
        raise GqakitError(f"the memory plan models decoder-only transformers, and {path} is an encoder-decoder "
                          f"({arch}); drop --plan (encoder-decoder runs are not checked against device memory)")
    resolved = str(Path(path).resolve())
    try:
        shapes = {name: info.shape for name, info in folder.tensors.items()}
    except GqakitError:  # no weights (a config.json alone) or unreadable ones: the tensors config.json implies
        from gqakit.hf.architectures.shapes import config_shapes

        shapes = config_shapes(config)
    counted = count_stored(resolved, config, shapes) if shapes else None
    return counted if counted is not None else count_on_meta(resolved, json.dumps(config, sort_keys=True))


def count_stored(path: str, config: dict, shapes: dict[str, tuple[int, ...]]) -> ModelCount | None:
    """The count from the tensors' shapes (`shapes`: name -> shape) and config.json, for a decoder of the
    architecture tables; None where they do not say it exactly (a field left to the default of a class the defaults
    table lacks, no one embedding, a family outside the tables)."""
    from gqakit.hf.architectures import find_family

    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    spec = find_family(arch) if arch else None
    fields = decoder_sizes(config)
    if spec is None or fields is None:
        return None
    h, a, L, V = (fields[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"))
    base = (spec.o_proj or spec.qkv_proj).split("{i}")[0]  # "model.layers."
    in_layer = [f"{base}{i}." for i in range(L)]
    params = dict(shapes)
    tie = fields["tie_word_embeddings"]
    embedding = [n for n, s in params.items() if not n.startswith(base) and len(s) == 2 and s[0] == V and n != HEAD]
    if len(embedding) != 1 or (HEAD in params and tie is None) or (HEAD not in params and tie is False):
        return None  # which tensor the head is, or whether it is tied, is not known here: ask transformers
    if HEAD in params and tie:
        del params[HEAD]  # tied: named_parameters lists the embedding alone
    head = HEAD if HEAD in params else embedding[0]  # a tied head's Linear reads the embedding
    names = list(params)
    size = {n: math.prod(params[n]) for n in names}
    linear = [n for n in names if n == head or (len(params[n]) == 2 and n.startswith(base))]
    layer_of = {n: next((p for p in in_layer if n.startswith(p)), None) for n in names}
    trains, trainable, layer_trainable, linear_trainable = {}, {}, {}, {}
    for mode in TRAINABLE:
        try:
            train = trains_by_name(mode, arch, L)
        except GqakitError:
            train = None
        keep = tuple(train(n) for n in names) if train else None
        if not keep or not any(keep):  # select_trainable refuses a mode that trains nothing
            trains[mode] = trainable[mode] = layer_trainable[mode] = linear_trainable[mode] = None
            continue
        trains[mode], trainable[mode] = keep, sum(size[n] for n, k in zip(names, keep) if k)
        layer_trainable[mode] = max(sum(size[n] for n, k in zip(names, keep) if k and layer_of[n] == p)
                                    for p in in_layer)
        linear_trainable[mode] = sum(size[n] for n, k in zip(names, keep) if k and n in linear)
    total = sum(size.values())
    return ModelCount(
        path=path, architecture=arch, total=total,
        rows=tuple((params[n][0] if params[n] else 1, math.prod(params[n][1:])) for n in names),
        trains=trains, trainable=trainable,
        root=sum(size[n] for n in names if layer_of[n] is None),
        layer=max(sum(size[n] for n in names if layer_of[n] == p) for p in in_layer),
        layer_trainable=layer_trainable, linear=sum(size[n] for n in linear), linear_trainable=linear_trainable,
        layers=L, hidden=h, heads=a, kv_heads=fields["num_key_value_heads"], head_dim=fields["head_dim"],
        intermediate=fields["intermediate_size"], vocab=V,
    )


@functools.lru_cache(maxsize=8)
def count_on_meta(path: str, config_json: str) -> ModelCount:
    """Count by building the model from config.json on the meta device (shapes, no storage): any family
    transformers builds, with or without weights. Loads torch and transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gqakit.uptrain.modeling import select_trainable

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))  # from_config mutates its config
    except Exception as e:  # noqa: BLE001 - any failure of transformers here is the config's
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GqakitError(f"cannot build the model of {path}/config.json on the meta device ({why}); "
                          "check config.json") from None
    try:
        from gqakit.uptrain.fsdp import decoder_layers  # the units sharding=fsdp wraps

        layers = decoder_layers(model)
    except (ImportError, GqakitError):
        layers = []
    params = [p for _, p in model.named_parameters()]  # tied weights once
    linear = list({id(m.weight): m.weight for m in model.modules()
                   if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}.values())
    trains, trainable, layer_trainable, linear_trainable = {}, {}, {}, {}
    for mode in TRAINABLE:
        try:
            trainable[mode] = select_trainable(model, mode)[0]
        except GqakitError:
            trains[mode] = trainable[mode] = layer_trainable[mode] = linear_trainable[mode] = None
            continue
        trains[mode] = tuple(p.requires_grad for p in params)
        layer_trainable[mode] = max((sum(p.numel() for p in m.parameters() if p.requires_grad) for m in layers),
                                    default=0)
        linear_trainable[mode] = sum(w.numel() for w in linear if w.requires_grad)
    total = sum(p.numel() for p in params)
    h, a = config.hidden_size, config.num_attention_heads
    return ModelCount(
        path=path, architecture=(getattr(config, "architectures", None) or [type(model).__name__])[0], total=total,
        rows=tuple((p.shape[0] if p.dim() else 1, math.prod(p.shape[1:])) for p in params),
        trains=trains, trainable=trainable,
        root=total - sum(p.numel() for m in layers for p in m.parameters()),
        layer=max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
        layer_trainable=layer_trainable, linear=sum(w.numel() for w in linear), linear_trainable=linear_trainable,
        layers=config.num_hidden_layers, hidden=h, heads=a,
        kv_heads=getattr(config, "num_key_value_heads", None) or a,
        head_dim=getattr(config, "head_dim", None) or h // a,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h,
        vocab=config.vocab_size,
    )


