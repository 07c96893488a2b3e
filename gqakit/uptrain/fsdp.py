"""`sharding: fsdp`: parameters, gradients and AdamW state sharded over every process with PyTorch's
FSDP2 (`torch.distributed.fsdp.fully_shard` on a `DeviceMesh`), one unit per decoder layer plus the root.

The same code runs on CPU (gloo, what the tests exercise) and on GPUs (NCCL); accelerate's FSDP plugin
is not used because with `cpu=True` it silently runs DDP instead.

Mesh. One dimension over the whole world: with context parallelism the ranks of a ring shard the
weights too (as torchtitan does), so a rank holds 1/world of the state; the ring's own process groups
carry the attention traffic. FSDP2 averages gradients over the mesh, like DDP, so the loop's loss
scaling is the same for both.

Loading never materialises the whole model on a rank: the model is built with its parameters on the
meta device (buffers, e.g. RoPE's `inv_freq`, are computed as usual), sharded, given empty local
storage, and each rank then reads only its own rows of every tensor from the safetensors files.
Peak host memory per rank is its shard plus one tensor's rows.

Mixed precision is FSDP2's policy: bf16 parameters for compute and all-gathers, fp32 gradient
reduction and fp32 master weights in the optimizer.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist

from gqakit.common.errors import GqakitError


def init_world(device_type: str) -> None:
    """Make sure a process group exists (a single process gets a 1-rank gloo group)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def make_mesh(device_type: str):
    """A 1-D DeviceMesh over every rank of the run: the mesh the weights are sharded over."""
    from torch.distributed.device_mesh import init_device_mesh

    init_world(device_type)
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def mp_policy(mixed_precision: str):
    """FSDP2's mixed-precision policy for the recipe's `mixed_precision` (fp16 is refused by config.check)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder blocks, found by the class names the model declares unsplittable (`_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise GqakitError(f"sharding=fsdp cannot wrap {type(model).__name__}: it names no decoder-layer class "
                          f"(_no_split_modules={sorted(names) or 'none'}); use sharding=ddp for this model")
    return layers


def check_wrappable(path: str, role: str = "model") -> None:
    """Refuse, before any work, a checkpoint whose model FSDP cannot be applied to per decoder layer
    (built on the meta device from config.json: no weights are read)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from gqakit.hf.loading import auto_model_class

    config = AutoConfig.from_pretrained(path)
    try:
        with init_empty_weights(include_buffers=True):
            model = auto_model_class(config).from_config(config)
    except Exception as e:  # an architecture transformers cannot build as a causal LM
        raise GqakitError(f"sharding=fsdp cannot build the {role} {path} ({str(e).splitlines()[0]}); "
                          "use sharding=ddp") from None
    try:
        decoder_layers(model)
    except GqakitError as e:
        raise GqakitError(f"{role} {path}: {e}") from None


def shard(model, mesh, policy, role: str = "model") -> None:
    """fully_shard every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    try:
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    except GqakitError:
        raise
    except Exception as e:  # a module FSDP2 cannot take: say which
        raise GqakitError(f"sharding=fsdp cannot wrap the {role} {type(model).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; use sharding=ddp") from None


def empty_model(path: str, prepare=None):
    """The checkpoint's model class with parameters on the meta device and real (computed) buffers;
    `prepare(model)` runs before anything is sharded (attention switch, trainable subset...)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from gqakit.hf.loading import auto_model_class

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = auto_model_class(config).from_config(config, dtype=torch.float32)
    model.tie_weights()  # init_empty_weights leaves tied weights (tie_word_embeddings) untied
    if prepare is not None:
        prepare(model)
    return model


def _local_rows(param) -> tuple[int, int]:
    """(first row, row count) of this rank's shard of a dim-0-sharded DTensor (torch.chunk layout)."""
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements
    if len(placements) != 1 or placements[0] != Shard(0):
        raise RuntimeError(f"expected a dim-0 sharded parameter, got {placements}")
    n, world, rank = param.shape[0], mesh.size(), mesh.get_local_rank()
    per = math.ceil(n / world)
    start = min(rank * per, n)
    return start, min(per, n - start)


def materialise(model, path: str, device: torch.device) -> None:
    """Give a sharded meta model local storage on `device` and fill every rank's rows from the
    checkpoint's safetensors files (non-persistent buffers keep their computed values)."""
    from gqakit.hf.checkpoint import DTYPES, load_tensor
    from gqakit.hf.headers import scan_checkpoint

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    tensors = scan_checkpoint(Path(path))
    params = dict(model.named_parameters())  # tied weights appear once, under the name the checkpoint keeps
    missing = [n for n in params if n not in tensors]
    if missing:
        raise GqakitError(f"{path} holds no tensor {missing[0]} (and {len(missing) - 1} more) that "
                          f"{type(model).__name__} needs; check the checkpoint or use sharding=ddp")
    unused = [n for n in tensors if n not in params and n not in buffers]
    if unused:
        raise GqakitError(f"{path} holds {unused[0]} (and {len(unused) - 1} more), which {type(model).__name__} "
                          "does not use; sharding=fsdp loads tensors by name only: use sharding=ddp")
    with torch.no_grad():
        for name, p in params.items():
            info = tensors[name]
            if tuple(info.shape) != tuple(p.shape):
                raise GqakitError(f"{path}: {name} has shape {list(info.shape)} but the config implies "
                                  f"{list(p.shape)}; check config.json")
            local = p.to_local()
            start, rows = _local_rows(p)
            if rows:
                row_bytes = math.prod(info.shape[1:]) * DTYPES[info.dtype].itemsize
                with open(info.file, "rb") as f:
                    f.seek(info.start + start * row_bytes)
                    raw = bytearray(f.read(rows * row_bytes))
                part = torch.frombuffer(raw, dtype=DTYPES[info.dtype]).view(rows, *info.shape[1:])
                local[:rows].copy_(part)
        for name, b in model.named_buffers():  # persistent buffers the checkpoint stores (rare)
            if name in tensors:
                b.copy_(load_tensor(tensors[name], name))


def load_sharded(path: str, mesh, policy, device: torch.device, prepare=None, role: str = "model"):
    """A sharded causal LM from a local checkpoint, without ever holding the whole model on one rank."""
    model = empty_model(path, prepare)
    shard(model, mesh, policy, role)
    materialise(model, path, device)
    return model


@contextlib.contextmanager
def gradient_sync(model, enabled: bool):
    """FSDP2's counterpart of DDP's no_sync: reduce-scatter gradients only when `enabled`."""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it), or `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
