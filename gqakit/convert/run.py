"""Carry out a conversion: validate, plan, stream tensors through the pooling maths, publish atomically."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import GqakitError
from .card import write_card
from .checkpoint import DTYPES, INDEX, SINGLE, ShardWriter, TensorInfo, atomic_output, load_tensor, scan_checkpoint
from .plan import Plan, TensorOp, make_plan
from .pooling import random_heads, regroup, relative_error
from .publish import check_replaceable

LOOKAHEAD = 2  # regrouped tensors computed ahead of the writer

# Files that the conversion rewrites or must not carry over; everything else (tokenizer, generation
# config, chat template, the pretraining record) is copied.
_NOT_COPIED = {"config.json", "README.md", INDEX, SINGLE}
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """Options of `convert-gqa`; the CLI flags map onto these fields one to one."""

    model_dir: str
    groups: int
    output_dir: str | None = None
    method: str = "mean"
    dtype: str = "auto"
    seed: int = 0
    max_shard_size: str = "5GB"
    force: bool = False
    dry_run: bool = False
    progress: bool = True


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = str(text).strip().upper()
    number = s.rstrip("KMGTIB")
    try:
        value = int(float(number) * units[s[len(number):].strip()])
    except (KeyError, ValueError):
        value = 0
    if value <= 0:
        raise GqakitError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return value


def default_output(model_dir: Path, groups: int) -> Path:
    suffix = "mqa" if groups == 1 else f"gqa{groups}"
    return model_dir.with_name(f"{model_dir.name}-{suffix}")


def read_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise GqakitError(f"model folder {model_dir} does not exist; pass the path of a Hugging Face checkpoint folder")
    path = model_dir / "config.json"
    if not path.is_file():
        raise GqakitError(f"{model_dir} has no config.json; point at a Hugging Face checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise GqakitError(f"{path} is not valid JSON ({e}); repair or re-save the config") from None
    if not isinstance(config, dict):
        raise GqakitError(f"{path} is not a JSON object; repair or re-save the config")
    return config


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


def prepare(cfg: ConvertConfig) -> tuple[Plan, dict, dict[str, TensorInfo], Path]:
    """Validate everything a conversion needs and plan it, before any output is written."""
    model_dir = Path(cfg.model_dir)
    config = read_config(model_dir)
    out = output_path(model_dir, cfg.output_dir, cfg.groups)
    if cfg.dtype != "auto" and cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise GqakitError(f"unknown --dtype {cfg.dtype!r}; choose auto, float32, bfloat16 or float16")
    max_shard = parse_size(cfg.max_shard_size)
    tensors = scan_checkpoint(model_dir)
    plan = make_plan(config, tensors, cfg.groups, cfg.method, cfg.dtype, max_shard)
    if not cfg.dry_run:
        check_output(model_dir, out, cfg.force)
    return plan, config, tensors, out


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


def compute(op: TensorOp, plan: Plan, tensors: dict[str, TensorInfo], std: float, seed: int,
            errors: dict[int, dict[str, float]]) -> torch.Tensor:
    """Make one output tensor that is not a plain byte copy."""
    out_dtype = DTYPES[op.dtype]
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
        q_rows = plan.num_attention_heads * plan.head_dim
        kv_rows = plan.num_key_value_heads * plan.head_dim
        q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=0)  # rows: [q | k | v]
        k2 = _regroup_rows(k, plan, std, seed, op.name + ".k")
        v2 = _regroup_rows(v, plan, std, seed, op.name + ".v")
        if op.role:
            errors.setdefault(op.layer, {}).update(
                k=relative_error(k, k2, plan.num_key_value_heads), v=relative_error(v, v2, plan.num_key_value_heads))
        return torch.cat([q, k2, v2], dim=0).to(out_dtype)
    raise AssertionError(f"unknown op kind {op.kind}")


def new_config(config: dict, plan: Plan, dtype: str) -> dict:
    config = dict(config)
    config["num_key_value_heads"] = plan.groups
    config["head_dim"] = plan.head_dim
    if dtype != "auto":
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    return config


def copy_side_files(model_dir: Path, dest: Path) -> list[str]:
    """Copy tokenizer, generation config, chat template and other small files; not weights or card."""
    copied = []
    for path in sorted(model_dir.iterdir()):
        if path.name.startswith(".") or path.name in _NOT_COPIED or path.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        if path.name.startswith("pytorch_model") or not path.is_file():  # folders, pipes, sockets
            continue
        shutil.copy2(path, dest / path.name)
        copied.append(path.name)
    return copied


def convert(cfg: ConvertConfig, command: str = "") -> dict:
    """Run a conversion end to end; returns a summary (also what the card records)."""
    plan, config, tensors, out = prepare(cfg)
    summary = {"plan": plan, "output_dir": out, "errors": {}}
    if cfg.dry_run:
        return summary
    try:
        summary["errors"] = _write(cfg, plan, config, tensors, out, command)
    except OSError as e:
        raise GqakitError(f"writing {out} failed ({e.strerror or e}); nothing was written: fix the cause "
                          "(disk space, permissions) and run again") from None
    return summary


def _write(cfg: ConvertConfig, plan: Plan, config: dict, tensors: dict[str, TensorInfo], out: Path,
           command: str) -> dict[int, dict[str, float]]:
    std = plan.initializer_range
    errors: dict[int, dict[str, float]] = {}
    entries = [(o.name, o.dtype, o.shape) for o in plan.ops]
    with atomic_output(out, cfg.force) as tmp:
        writer = ShardWriter(tmp, entries, plan.max_shard_bytes)
        # One worker thread computes the next regrouped tensors while this thread streams byte copies
        # (torch kernels and copy_file_range both release the GIL). At most LOOKAHEAD results wait,
        # so memory stays a few tensors.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: deque = deque()
            todo = iter(op for op in plan.ops if op.kind != "copy")

            def refill() -> None:
                while len(pending) < LOOKAHEAD and (op := next(todo, None)) is not None:
                    pending.append(pool.submit(compute, op, plan, tensors, std, cfg.seed, errors))

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
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(new_config(config, plan, cfg.dtype), indent=2) + "\n",
                                         encoding="utf-8")
        copy_side_files(Path(cfg.model_dir), tmp)
        write_card(tmp / "README.md", cfg, plan, errors, command)
    return errors
